"""How ops run on the host CPU multiply held matrices (``models.compressed.Products``): the
executor passes ``HOST_PRODUCTS`` to them, as it passes the host's attention kernel to SCORE."""

from __future__ import annotations

from hx.devices import HOST
from hx.host_compute import ggml_kernel, int4_kernel
from hx.models.compressed import DEFAULT_PRODUCTS, Products

# torch's int4 kernel and ggml's up to their rows; a one-row LM-head product over a float32
# table; an MoE layer's routed experts by ggml's mul_mat_id
HOST_PRODUCTS = Products(int4=int4_kernel.matmul, int4_rows=int4_kernel.KERNEL_ROWS,
                         head_vector_f32=True, blocks=ggml_kernel.product,
                         blocks_rows=ggml_kernel.KERNEL_ROWS, experts=ggml_kernel.experts,
                         experts_layouts=ggml_kernel.EXPERT_LAYOUTS)


def products_on(device: str) -> Products:
    """The products ops on ``device`` (``hx.devices.HOST`` or ``ACCELERATOR``) run with."""
    return HOST_PRODUCTS if device == HOST else DEFAULT_PRODUCTS
