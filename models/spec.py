"""Shapes-only description of a decoder-only model: enough to size, place and plan it.

A :class:`ModelSpec` never holds weights. The planner uses it to size models it never loads
(a 70B spec costs nothing), the loaders build one from a file's metadata, and the Flax model is
configured by it (it is frozen and hashable, so it can be a static argument under ``jax.jit``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from hx.errors import HxError
from hx.models.family import FAMILIES, TABLE, family
from hx.models.formats import DENSE, KV_DTYPES, Format, get_format, kv_cache_format
from hx.models.ops import (EMBED, EXPERT_OPS, EXPERTS_STREAMED, HEAD,  # noqa: F401
                           LAYER_OPS, SCORE)

# The dtypes hx runs a model in, with their bytes per element.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
XLA, TORCH_INT4, GGML = "xla", "torch-int4", "ggml"


@dataclass(frozen=True)
class HeldLayout:
    """How a host matmul (``ModelSpec.host_matmul``) holds compressed matrices.

    Attributes:
      arrays: ``Format``'s method giving a matrix's arrays in the layout (None where the
        format has no such layout); None: every matrix in its format's own arrays.
      tables: the embedding tables are held so too (else only projection kernels).
    """

    arrays: Any = None
    tables: bool = False


HELD_LAYOUTS = {XLA: HeldLayout(), TORCH_INT4: HeldLayout(Format.int4pack_arrays),
                GGML: HeldLayout(Format.blocks_arrays, tables=True)}
HOST_MATMULS = tuple(HELD_LAYOUTS)
# the fields a layer type may set for its layers (``ModelSpec.layer_overrides``): what a
# layer's ops compute with -- its window and RoPE -- and, in a Mixture of Experts whose first
# layers are dense (DeepSeek's), its feed-forward part (``moe`` None: a SwiGLU of ``d_ff``)
LAYER_FIELDS = ("sliding_window", "rope_theta", "rope_scaling", "moe")


def host_dtype(dtype: str) -> str:
    """The dtype host-computed ops hold their weights in, for a model run in ``dtype``: the
    model's own dtype for float32 and bfloat16 (no copies), float32 for float16.

    XLA:CPU multiplies bfloat16 fast where the CPU has bf16 instructions (this VM's AMD EPYC:
    ``avx512_bf16``) once a product has two rows or more: a (2 x 4096) @ (4096 x 11008) product
    with float32 accumulation took 5.8 ms held in bfloat16 against 16.1 ms in float32 (16 rows:
    8.5 vs 20.3; jax 0.10.2, 2 threads, median of 11). One-row products are padded to two
    (``models.layers.product``): XLA:CPU's matrix-vector path widens a bfloat16 matrix to a float32
    temporary first (61 ms). float16 has no fast path on XLA:CPU (64-84 ms at 1-16 rows), so a
    float16 model's host ops hold float32 copies (3.6 ms at one row), which the host budget
    counts. On a CPU without bf16 instructions the profiler's host rates, measured in this
    dtype, price the slower products; memory, not speed, is the constraint hx must not break.
    """
    return "float32" if dtype == "float16" else dtype


def numpy_dtype(dtype: str):
    """The numpy dtype of a ``DTYPE_BYTES`` name, or of any numpy dtype name (``uint8``,
    ``float16``; bfloat16 is ``ml_dtypes.bfloat16``, the type JAX itself uses: numpy has none
    of its own)."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def gathers(rows: int, top_k: int, experts: int) -> bool:
    """Whether an MoE layer's experts computed by XLA (``models.moe.Experts``) gather each
    row's k experts -- rows·k < X: fewer (row, expert) products than experts, a decode
    step's -- rather than run every expert."""
    return rows * top_k < experts


@dataclass(frozen=True)
class SwiGLU:
    """A routed expert's activation: SiLU(g) * u of its gate and up products (Shazeer 2020)."""

    def __call__(self, gate, up):
        """gate, up (..., F) float32 -> (..., F) float32."""
        import jax

        return jax.nn.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' ``GptOssExperts._apply_gate``): g clamped
    above at ``limit``, u to [-limit, limit]; (u + 1) * g * sigmoid(``alpha`` g)."""

    alpha: float
    limit: float

    def __call__(self, gate, up):
        """gate, up (..., F) float32 -> (..., F) float32."""
        import jax
        import jax.numpy as jnp

        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)


@dataclass(frozen=True)
class MoeShape:
    """The feed-forward part of a Mixture-of-Experts layer (Shazeer et al. 2017; Mixtral, Jiang
    et al. 2024): a router picks ``top_k`` of ``experts`` SwiGLU experts per token and sums
    their outputs weighted by its softmax probabilities (renormalised over the k where
    ``norm_top_k``); a shared expert, where ``d_shared`` > 0, runs on every token behind a
    sigmoid gate (Qwen1.5-MoE). Every decoder layer of the model is such a layer.

    Attributes:
      experts: routed experts per layer, X.
      top_k: experts each token is routed to, k.
      d_expert: a routed expert's SwiGLU inner size.
      d_shared: the shared expert's inner size; 0: none.
      norm_top_k: the k chosen probabilities are divided by their sum (Mixtral; a config's
        ``norm_topk_prob``).
      of: 0 for a whole layer; else this is the part of a layer of ``of`` routed experts
        that one op holds (``ModelSpec.expert_part``): ``experts`` of them (0 to ``of``),
        which ones an index array among its weights says.
      picks: pricing alone (the planner's; the executor ignores it): each of ``experts``'
        chance a row is routed to it (``hx.planner.experts.ExpertActivity``); () a random
        router's, top_k / routed each.
      routed_scale: the chosen weights are multiplied by it (DeepSeek's
        ``routed_scaling_factor``).
      groups: 0, or the experts form this many equal groups and a token's top k are taken
        from the ``top_groups`` groups that score highest: by their best expert (DeepSeek-V2's
        group-limited greedy routing, arXiv:2405.04434 §3.2.2 "device-limited routing") or
        their best two (DeepSeek-V3's, arXiv:2412.19437 §2.1.2; the family's router decides).
      shared_gate: the shared expert's output passes a sigmoid gate (Qwen1.5-MoE); False:
        added as it is (DeepSeek's ``shared_experts``).
      activation: the routed experts' (``SwiGLU``, or gpt-oss's ``ClampedSwiGLU``).
      expert_bias: each routed expert's gate, up and down products add its own bias
        (gpt-oss).
    """

    experts: int
    top_k: int
    d_expert: int
    d_shared: int = 0
    norm_top_k: bool = True
    of: int = 0
    picks: tuple[float, ...] = ()
    routed_scale: float = 1.0
    groups: int = 0
    top_groups: int = 0
    shared_gate: bool = True
    activation: SwiGLU | ClampedSwiGLU = SwiGLU()
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.routed:
            raise ValueError(f"top_k={self.top_k} of experts={self.routed}: 1 to experts")
        if self.groups and (self.routed % self.groups
                            or not 1 <= self.top_groups <= self.groups
                            or self.top_k > self.top_groups * self.routed // self.groups):
            raise ValueError(f"top_k={self.top_k} of the top {self.top_groups} of {self.groups} "
                             f"groups of {self.routed} experts")
        if self.of and not 0 <= self.experts <= self.of:
            raise ValueError(f"a part of {self.experts} of {self.of} experts")
        if self.picks and len(self.picks) != self.experts:
            raise ValueError(f"{len(self.picks)} picks for {self.experts} experts")

    @property
    def routed(self) -> int:
        """X: the layer's routed experts, over which the router's weights run."""
        return self.of or self.experts


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 §2.1; transformers'
    ``DeepseekV2Attention``), as hx computes it: with the up-projections absorbed (§2.1.2), so
    that the KV cache holds each token's latent alone, one head wide.

    A token's keys and values come from its compressed latent c = RMSNorm(h W_DKV) (``kv_rank``,
    eq. 9) and one key part k_R = RoPE(h W_KR) (``rope_dim``) shared by every head (eq. 14).
    Head i's query is [q_C,i | RoPE(q_R,i)] (``nope_dim`` + ``rope_dim``), its key [W_UK,i c |
    k_R] and its value W_UV,i c (``v_dim``). The absorbed form scores q_C,i W_UK,i . c + q_R,i .
    k_R -- the same number -- and sums p . c before W_UV,i, so the cache holds c as K and k_R
    as V (``ModelSpec.kv_width``), q is (H, kv_rank + rope_dim) and SCORE's output (H,
    kv_rank). The softmax scale is (nope_dim + rope_dim)^-1/2.

    Attributes:
      kv_rank: d_c, the latent's width (``kv_lora_rank``).
      q_rank: d_c' of the query's own low-rank projection (``q_lora_rank``); 0: q projected
        from h directly.
      nope_dim: d_h, each head's key and query part without position (``qk_nope_head_dim``).
      rope_dim: d_h^R, the rotated part (``qk_rope_head_dim``; ``ModelSpec.head_dim``).
      v_dim: each head's value width (``v_head_dim``).
      interleaved: RoPE turns adjacent pairs of the rotated part (DeepSeek's own layout;
        DeepSeek-V3's ``rope_interleave``); False: element i with i + rope_dim / 2, as Llama.
    """

    kv_rank: int
    q_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    interleaved: bool = True


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a decoder-only model of one of hx's families (no weights).

    Attributes:
      name: human-readable model name.
      n_layers: number of decoder layers.
      d_model: hidden size D.
      n_heads: query heads H.
      n_kv_heads: key/value heads K (grouped-query attention when K < H).
      head_dim: per-head size E (usually D / H).
      d_ff: SwiGLU inner size F.
      vocab_size: V.
      context_length: maximum sequence length the model was trained for (tokens).
      rope_theta: RoPE base frequency.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the LM head reuses the token-embedding matrix.
      dtype: the dtype hx runs the model in (``DTYPE_BYTES``: ``float32``, ``bfloat16``,
        ``float16``): of the weights on the accelerator (resident and streamed), of the
        activations between ops and of the KV caches. Matmuls accumulate in float32; norms,
        RoPE and softmax compute in float32; logits are float32. Weights of host-computed ops
        are held in ``host_dtype(dtype)``.
      family: the model family (``models.family.FAMILIES``: ``llama``, ``qwen2``, ``opt``,
        ...), which gives the weights of each op, their names in files and the math of each
        op (``models.family.Family``).
      sliding_window: a layer's queries attend only the last ``sliding_window`` positions,
        their own included (Mistral; Beltagy et al. 2020); None: the whole context.
      rope_scaling: the RoPE scaling of the model's config as sorted (key, value) pairs
        (``rope_type`` ``llama3`` with its factors, ``linear``, or a GGUF's
        ``frequency_factors`` with ``factors`` a tuple of E/2 floats); empty: none. The family
        applies it (``models.llama.inv_frequencies``).
      attention_scale: the factor of q . k in attention's softmax; None: 1/sqrt(head_dim)
        (Vaswani et al. 2017). Every attention kernel divides by sqrt(head_dim), so a family
        whose scale differs (Gemma 3: ``query_pre_attn_scalar``^-1/2) multiplies q by
        ``attention_scale`` * sqrt(head_dim) in its Q op.
      layer_types: each decoder layer's type, in order (Gemma 3's ``sliding_attention``,
        ``full_attention``; DeepSeek's ``dense`` and ``moe``); empty: the layers are alike.
        Layers of different types differ only in ``LAYER_FIELDS``: their window and RoPE, or
        their feed-forward part (``moe``: a dense layer's MLP1 and MLP2 hold other weights,
        and its ``a`` is d_ff wide). Their attention and caches are sized alike; each op is
        held and runs with its layer's spec (``layer_spec``; ``layer_weight_bytes`` sums
        them), and the ``moe`` of the model's own fields is its MoE layers'. Past the tuple's
        end the pattern repeats (a spec resized for pricing, ``replace(n_layers=)``).
      layer_overrides: per layer type, sorted, the ``LAYER_FIELDS`` its layers see in place of
        the model's: ((type, ((field, value), ...)), ...); empty exactly when ``layer_types``
        is.
      weight_format: how the projection matrices (the ``kernel`` of every Q, K, V, OUT, MLP1
        and MLP2 matrix) are held: ``dense`` (in ``dtype``) or a compressed format of
        ``models.formats.FORMATS`` (``int8``, ``int4``, ``q8_0``, ``q4_0``, ``q4_1``),
        decompressed inside each program right before its product.
      embedding_format: the same for the embedding tables (EMBED's, and HEAD's when untied).
      kv_format: how each layer's KV cache is held: ``dense`` (in ``dtype``), dense in a dtype of
        its own (``float16``, ``bfloat16``, ``float32``: ``models.formats.KV_DTYPES``;
        llama.cpp's cache is float16; written cast, read into float32), or a compressed
        format of ``models.formats.FORMATS`` (``int8``, ``int4``: FlexGen's), grouped along
        the head dim (``models.formats.kv_cache_format``), quantized as K and V are written
        and decompressed right before attention reads them (``models.tensors.kv_arrays``).
      host_matmul: how host-computed ops multiply their 4-bit projection matrices
        (``HOST_MATMULS``): ``xla`` decompresses each in the program before an XLA product;
        ``torch-int4`` holds each matrix torch's CPU int4 kernel can take in its layout
        (``models.formats.Format.int4pack_arrays``; made at load, one layout for both
        devices: the accelerator decompresses it) and calls that kernel
        (``hx.host_compute.int4_kernel``: bfloat16 activations, a bfloat16 scale and zero per
        group), where XLA:CPU cannot come close (it writes each decompressed matrix out and
        reads it back); ``ggml`` holds each matrix of a GGUF block format (q4_0, q4_1, q8_0)
        in the file's own blocks (``Format.blocks_arrays``; the accelerator decompresses them)
        and multiplies it with ggml, llama.cpp's kernels (``hx.host_compute.ggml_kernel``:
        float32 activations rounded to 8 bits a block, as llama.cpp).
        ``models.loader.resolve_host_matmul`` chooses it.
      moe: the Mixture-of-Experts shape of every layer's feed-forward part (``MoeShape``; its
        family's MLP1 routes, MLP2 runs the experts: ``models.moe``) -- of the layers whose
        type sets none other (``layer_types``: dense first layers, ``moe`` None there);
        None: a dense SwiGLU of ``d_ff``.
      mla: multi-head latent attention (``MlaShape``; DeepSeek-V2): its KV cache one latent
        head, ``head_dim`` the rotated part, ``n_kv_heads`` 1; None: attention over K heads of
        E keys and values.
      sinks: each query head has a learned sink logit that joins its softmax's denominator
        and weighs no value (gpt-oss's attention sinks); Q writes it as q's last element
        (``q_width`` E + 1), since SCORE owns no weights.
      embeds / heads: False in a pipeline stage (``pipeline_stage``) that does not hold the
        model's first (last) op: EMBED takes the previous stage's residual stream x (B, T, D)
        in ``dtype`` where token ids go and passes it on, and HEAD gives x of every position
        where logits go (each without weights).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"
    family: str = "llama"
    sliding_window: int | None = None
    rope_scaling: tuple[tuple[str, float | str | tuple[float, ...]], ...] = ()
    attention_scale: float | None = None
    layer_types: tuple[str, ...] = ()
    layer_overrides: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    weight_format: str = DENSE
    embedding_format: str = DENSE
    kv_format: str = DENSE
    host_matmul: str = XLA
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    sinks: bool = False
    embeds: bool = True
    heads: bool = True

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; one of {', '.join(FAMILIES)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}; hx runs models in "
                             f"{', '.join(DTYPE_BYTES)}")
        for name in (self.weight_format, self.embedding_format):
            get_format(name)  # raises on an unknown format
        if self.host_matmul not in HOST_MATMULS:
            raise ValueError(f"host_matmul={self.host_matmul!r}; one of {', '.join(HOST_MATMULS)}")
        kv_cache_format(self.kv_format, self.head_dim)  # raises on one that cannot group it
        if self.mla and (self.n_kv_heads != 1 or self.head_dim != self.mla.rope_dim
                         or self.kv_format not in (DENSE, *KV_DTYPES)):
            raise ValueError(f"latent attention holds one KV head (n_kv_heads={self.n_kv_heads}) "
                             f"whose head_dim={self.head_dim} is the rotated part "
                             f"({self.mla.rope_dim}), dense (kv_format={self.kv_format!r})")
        if self.mla and self.sinks:
            raise ValueError("sinks with latent attention: its SCORE takes no sink logits")
        overrides = dict(self.layer_overrides)
        if set(self.layer_types) != set(overrides):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} and layer_overrides "
                             f"{sorted(overrides)} must name the same layer types")
        for kind, fields in overrides.items():
            unknown = sorted(set(dict(fields)) - set(LAYER_FIELDS))
            if unknown:
                raise ValueError(f"layer type {kind!r} overrides {', '.join(unknown)}; a layer "
                                 f"type may set only {', '.join(LAYER_FIELDS)}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of weights, activations and KV caches (``dtype``'s size)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def inner_width(self) -> int:
        """The width of the activation MLP1 hands MLP2 (``models.tensors.ACTIVATIONS`` "a"):
        d_ff, or an MoE layer's normed x and its routing weights over the experts, D + X."""
        return self.d_model + self.moe.routed if self.moe else self.d_ff

    @property
    def q_width(self) -> int:
        """Each query head's width as SCORE reads it: E (E + 1 with ``sinks``: the head's
        sink logit last), or latent attention's absorbed kv_rank + rope_dim (``MlaShape``)."""
        if self.mla:
            return self.mla.kv_rank + self.mla.rope_dim
        return self.head_dim + 1 if self.sinks else self.head_dim

    @property
    def o_width(self) -> int:
        """Each head's width of SCORE's output: E, or latent attention's kv_rank."""
        return self.mla.kv_rank if self.mla else self.head_dim

    def kv_width(self, name: str) -> int:
        """Each KV head's width of the cache's ``k`` or ``v``: E, or latent attention's
        kv_rank (the latent) and rope_dim (the shared rotated key)."""
        if self.mla:
            return self.mla.kv_rank if name == "k" else self.mla.rope_dim
        return self.head_dim

    def expert_part(self, op: str, experts: int, picks: tuple[float, ...] = ()
                    ) -> "ModelSpec":
        """The spec an op of an MoE layer whose routed experts are placed one by one
        (``hx.plan.ExpertHomes``) is held and computed with: MLP2 the shared expert and the
        residual add, no routed expert (``experts`` 0); an ``EXPERT_OPS`` op ``experts`` of
        the layer's routed experts (which ones: its ``experts/ids``) and no shared one;
        ``picks`` (``MoeShape.picks``) for pricing."""
        moe = dataclasses.replace(self.moe, experts=experts, of=self.moe.routed,
                                  d_shared=self.moe.d_shared if op == "MLP2" else 0,
                                  picks=picks)
        return self.replace(moe=moe)

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def layer_type(self, layer: int) -> str:
        """Decoder layer ``layer``'s type (``layer_types``; the pattern repeating past its
        end), "" for a model whose layers are alike."""
        return self.layer_types[layer % len(self.layer_types)] if self.layer_types else ""

    def type_spec(self, kind: str) -> "ModelSpec":
        """The spec the ops of a layer of type ``kind`` run with: the model's with that type's
        ``layer_overrides`` (its window, its RoPE) and no layer types; the model itself for ""
        or a model whose layers are alike.

        Raises:
          ValueError: the model has no layer type ``kind``.
        """
        return _type_spec(self, kind) if self.layer_types and kind != "" else self

    def layer_spec(self, layer: int) -> "ModelSpec":
        """The spec decoder layer ``layer``'s ops run with (``type_spec`` of its type)."""
        return self.type_spec(self.layer_type(layer))

    def pipeline_stage(self, layers: range | int, first: bool, last: bool) -> "ModelSpec":
        """The part of the model one pipeline stage holds and computes (GPipe, Huang et al.
        2019): the consecutive decoder ``layers`` (a range of the model's; their
        ``layer_types`` cut out with them), EMBED's table only in the ``first`` stage and
        HEAD's only in the ``last`` (a tied table is held by both ends; between stages the
        residual stream x crosses: ``embeds``, ``heads``); the model itself for a stage holding
        all of it. ``layers`` may be a layer count where the layers are alike.

        Raises:
          ValueError: a layer count for a model whose layers differ (which layers is unknown).
        """
        if isinstance(layers, int):
            if self.layer_types:
                raise ValueError(f"{self.name}'s layers differ in type: give pipeline_stage "
                                 "the stage's range of layers, not their count")
            layers = range(layers)
        n_layers = len(layers)
        if first and last and n_layers == self.n_layers:
            return self
        kinds = self.layer_types and tuple(self.layer_type(i) for i in layers)
        return self.replace(name=f"{self.name} (stage of {n_layers} layers)", n_layers=n_layers,
                            embeds=self.embeds and first, heads=self.heads and last,
                            tie_embeddings=self.tie_embeddings and first and last,
                            **_with_types(self, kinds))

    def op_weight_shapes(self, op: str) -> dict[str, tuple[int, ...]]:
        """Logical shapes of the weight tensors owned by ``op``, keyed by parameter path: the
        family's (``models.family.Family.weight_shapes``).

        Matrices are in the checkpoint's (out..., in) layout: the contracted axis last (a
        Hugging Face or GGUF tensor taken as it is, grouped along that axis when compressed).
        The paths match the Flax parameter tree of that op. ``HEAD`` always lists its table
        (``models.family.TABLE``): for a tied model it is the ``EMBED`` matrix itself, which costs
        memory twice only where the two ops sit on different devices. A pipeline stage's
        pass-through EMBED or HEAD has none.
        """
        if (op == EMBED and not self.embeds) or (op == HEAD and not self.heads):
            return {}  # a pipeline stage's pass-through
        return _weight_shapes(self)["MLP2" if op in EXPERT_OPS else op]

    @property
    def model_family(self):
        """The ``models.family.Family`` of this model."""
        return family(self.family)

    def matrix_format(self, path: str) -> str:
        """The format ``path`` (an ``op_weight_shapes`` key) is held in: ``weight_format`` for
        projection kernels, ``embedding_format`` for embedding tables, ``dense`` for norm
        scales and biases (``Family.matrix_kind``)."""
        kind = self.model_family.matrix_kind(path)
        if kind == "kernel":
            return self.weight_format
        return self.embedding_format if kind == "table" else DENSE

    def product_shape(self, path: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """(out, in) of the 2-D product a projection kernel at ``path`` (logical ``shape``)
        computes (``models.layers.Dense``): OUT's kernel (D, H, E) contracts its last two
        axes, every other matrix its last (``Family.contracted_axes``)."""
        contracted = self.model_family.contracted_axes(path)
        return math.prod(shape[:-contracted]), math.prod(shape[-contracted:])

    def op_weight_arrays(self, op: str, dtype: str | None = None
                         ) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, dtype name) of each array held for ``op``'s weights, keyed by path: a dense
        tensor at its ``op_weight_shapes`` path in ``dtype`` (default: the model's dtype;
        ``host_dtype`` of it for what a host-computed op holds), a compressed matrix as the arrays
        of its format (``models.formats.Format.arrays``) at ``PATH/codes``, ``PATH/scale``
        and ``PATH/offset``; a projection kernel that ``host_matmul``'s layout can hold
        (``HELD_LAYOUTS``) in its arrays, on either device: torch-int4's ``PATH/packed`` and
        ``PATH/sz`` (``Format.int4pack_arrays``), ggml's ``PATH/blocks``
        (``Format.blocks_arrays``).

        Raises:
          HxError: a compressed matrix's last axis is not a multiple of its format's group.
        """
        held = {}
        for path, shape in self.op_weight_shapes(op).items():
            fmt = get_format(self.matrix_format(path))
            layout = HELD_LAYOUTS[self.host_matmul]
            relaid = path.endswith("kernel") or (layout.tables and path == TABLE)
            packed = (layout.arrays(fmt, self.product_shape(path, shape))
                      if fmt and layout.arrays and relaid else None)
            if self.model_family.matrix_kind(path) == "index":
                held[path] = (shape, "int32")
            elif fmt is None:
                held[path] = (shape, dtype or self.dtype)
            elif packed:
                held.update({f"{path}/{part}": array for part, array in packed.items()})
            else:
                held.update({f"{path}/{part}": array
                             for part, array in fmt.arrays(shape).items()})
        return held

    @functools.lru_cache(maxsize=1024)
    def op_weight_bytes(self, op: str, dtype: str | None = None) -> int:
        """Bytes of the weights held for ``op`` (``op_weight_arrays``: dense tensors in
        ``dtype``, default the model's, compressed matrices in their formats)."""
        return sum(math.prod(shape) * numpy_dtype(d).itemsize
                   for shape, d in self.op_weight_arrays(op, dtype).values())

    @property
    def layer_weight_bytes(self) -> int:
        """Bytes of one decoder layer's weights (of a layer of the model's own fields: an MoE
        layer where the first are dense; ``layers_weight_bytes`` sums each layer's own)."""
        return sum(self.op_weight_bytes(op) for op in LAYER_OPS)

    def layers_weight_bytes(self, layers) -> int:
        """Bytes of the weights of decoder ``layers`` (indices), each of its own type
        (``layer_spec``)."""
        if not self.layer_types:
            return len(layers) * self.layer_weight_bytes
        return sum(self.layer_spec(i).layer_weight_bytes for i in layers)

    @property
    def expert_layers(self) -> tuple[int, ...]:
        """The decoder layers whose feed-forward part is routed experts (``moe``): every layer
        of an MoE model but dense first layers; none of a dense model."""
        return tuple(i for i in range(self.n_layers) if self.layer_spec(i).moe)

    def shard(self, tp: int) -> "ModelSpec":
        """The part of the model one of ``tp`` accelerators holds and computes under tensor
        parallelism (Megatron-LM, Shoeybi et al. 2019, §3): Q, K, V split by column into
        heads (KV heads ceil(K / tp) per device, each query head beside its KV head; where K <
        tp, one KV head per device, copied where devices share it), OUT by row over the same
        heads, MLP1 by column and MLP2 by row over the feed-forward size (ceil(F / tp)), the
        embedding and HEAD over the vocabulary (ceil(V / tp)); D, norms and biases of
        row-split products whole on every device. Counts that ``tp`` does not divide are
        rounded up: a device holds zero-padded heads, as an executor with equal shards must.
        ``tp`` = 1 is the model itself.

        Raises:
          ValueError: ``tp`` < 1, or a model of latent attention (``mla``) and ``tp`` > 1.
        """
        if tp < 1:
            raise ValueError(f"tensor-parallel degree {tp}: 1 or more accelerators")
        if tp == 1:
            return self
        if self.mla:
            raise ValueError(f"{self.name}: hx does not split latent attention's one KV head "
                             "across accelerators (tensor parallelism)")
        kv = -(-self.n_kv_heads // tp)
        heads = (kv * (self.n_heads // self.n_kv_heads) if self.n_kv_heads >= tp
                 else -(-self.n_heads // tp))
        return self.replace(name=f"{self.name} (TP shard 1/{tp})", n_heads=heads,
                            n_kv_heads=kv, d_ff=-(-self.d_ff // tp),
                            vocab_size=-(-self.vocab_size // tp))

    @property
    def weight_bytes(self) -> int:
        """Bytes of all distinct weights (a tied embedding counted once)."""
        tied = 0
        if self.tie_embeddings:  # HEAD's table is EMBED's
            tied = sum(math.prod(shape) * numpy_dtype(d).itemsize for path, (shape, d)
                       in self.op_weight_arrays(HEAD).items()
                       if path == TABLE or path.startswith(TABLE + "/"))
        return (self.layers_weight_bytes(range(self.n_layers)) + self.op_weight_bytes(EMBED)
                + self.op_weight_bytes(HEAD) - tied)


@functools.lru_cache(maxsize=256)
def _type_spec(spec: ModelSpec, kind: str) -> ModelSpec:
    """``ModelSpec.type_spec``, made once per (spec, type)."""
    overrides = dict(spec.layer_overrides)
    if kind not in overrides:
        raise ValueError(f"{spec.name} has no layer type {kind!r} (its types: "
                         f"{', '.join(overrides)})")
    return spec.replace(layer_types=(), layer_overrides=(), **dict(overrides[kind]))


def _with_types(spec: ModelSpec, kinds: tuple[str, ...]) -> dict:
    """The ``layer_types`` and ``layer_overrides`` fields of ``spec`` cut to layers of
    ``kinds`` (empty: nothing to change): where they are all of one type, that type's fields
    become the model's own and the layers are alike."""
    if not spec.layer_types:
        return {}
    if len(set(kinds)) > 1:
        return {"layer_types": kinds,
                "layer_overrides": tuple(o for o in spec.layer_overrides if o[0] in kinds)}
    alike = spec.type_spec(kinds[0]) if kinds else spec
    return {"layer_types": (), "layer_overrides": (),
            **{f: getattr(alike, f) for f in LAYER_FIELDS}}


@functools.lru_cache(maxsize=256)
def _weight_shapes(spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
    """``spec``'s family's weight shapes, made once per spec."""
    return spec.model_family.weight_shapes(spec)


LLAMA31_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192.0), ("rope_type", "llama3"))


def _gemma3(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int,
            head_dim: int, d_ff: int, query_pre_attn_scalar: float) -> ModelSpec:
    """A Gemma 3 text decoder as its Hugging Face config gives it, with transformers'
    defaults for what the config leaves out (``models.gemma3``): every 6th layer global
    (RoPE base 10^6, linear scaling by 8; the model's own fields), the others local (a
    window of 1,024, base 10^4, unscaled); vocabulary 262,208, context 131,072, tied."""
    kinds = tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                  for i in range(n_layers))
    scaling = (("factor", 8.0), ("rope_type", "linear"))
    return ModelSpec(
        name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, d_ff=d_ff, vocab_size=262208, context_length=131072,
        rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, family="gemma3",
        rope_scaling=scaling, attention_scale=query_pre_attn_scalar ** -0.5, layer_types=kinds,
        layer_overrides=(
            ("full_attention", (("rope_scaling", scaling), ("rope_theta", 1e6),
                                ("sliding_window", None))),
            ("sliding_attention", (("rope_scaling", ()), ("rope_theta", 1e4),
                                   ("sliding_window", 1024)))))


DENSE_LAYER, MOE_LAYER = "dense", "moe"  # the layer types of an MoE model with dense layers


def feed_forward_fields(n_layers: int, dense: tuple[int, ...], moe: MoeShape | None
                        ) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a model whose MoE layers are ``moe`` but for the ``dense``
    ones (a SwiGLU of ``d_ff``): ``moe`` alone where no layer is dense, None where all are,
    else the layer types ``dense`` (``moe`` None) and ``moe`` (``layer_types``)."""
    dense = set(dense)
    if moe is None or not dense:
        return {"moe": moe}
    if len(dense) >= n_layers:
        return {"moe": None}
    return {"moe": moe,
            "layer_types": tuple(DENSE_LAYER if i in dense else MOE_LAYER
                                 for i in range(n_layers)),
            "layer_overrides": ((DENSE_LAYER, (("moe", None),)), (MOE_LAYER, (("moe", moe),)))}


def _deepseek(name: str, n_layers: int, dense: int, d_model: int, n_heads: int, q_rank: int,
              d_ff: int, vocab_size: int, moe: MoeShape, mscale: float, family: str
              ) -> ModelSpec:
    """A DeepSeek decoder of ``family`` as its Hugging Face config gives it
    (``models.deepseek_v2``, ``models.deepseek_v3``): latent attention of a 512 latent, heads
    of 128 + 64 rotated, values of 128; the first ``dense`` layers a SwiGLU of ``d_ff``
    (layer type ``dense``), the rest ``moe``; YaRN by 40 over an original 4,096 positions
    (``mscale`` and ``mscale_all_dim`` both ``mscale``), context 163,840."""
    yarn = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 40.0), ("mscale", mscale),
            ("mscale_all_dim", mscale), ("original_max_position_embeddings", 4096.0),
            ("rope_type", "yarn"), ("truncate", True))
    return ModelSpec(
        name=name, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=1,
        head_dim=64, d_ff=d_ff, vocab_size=vocab_size, context_length=163840,
        rope_theta=10000.0, norm_eps=1e-6, family=family, rope_scaling=yarn,
        mla=MlaShape(kv_rank=512, q_rank=q_rank, nope_dim=128, rope_dim=64, v_dim=128),
        **feed_forward_fields(n_layers, tuple(range(dense)), moe))


def _gpt_oss(name: str, n_layers: int, experts: int) -> ModelSpec:
    """gpt-oss as its config.json gives it: sliding (128) and full layers alternating, sinks,
    YaRN by 32 over an original 4,096 positions (not truncated), experts with biases and
    gpt-oss's clamped SwiGLU (alpha 1.702, limit 7)."""
    yarn = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0), ("mscale", 0.0),
            ("mscale_all_dim", 0.0), ("original_max_position_embeddings", 4096.0),
            ("rope_type", "yarn"), ("truncate", False))
    kinds = ("sliding_attention", "full_attention")
    return ModelSpec(
        name=name, n_layers=n_layers, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64,
        d_ff=2880, vocab_size=201088, context_length=131072, rope_theta=150000.0,
        norm_eps=1e-5, family="gpt_oss", rope_scaling=yarn, sinks=True,
        layer_types=kinds * (n_layers // 2),
        layer_overrides=((kinds[1], (("sliding_window", None),)),
                         (kinds[0], (("sliding_window", 128),))),
        moe=MoeShape(experts, 4, 2880, activation=ClampedSwiGLU(1.702, 7.0), expert_bias=True))


# Named shapes of real models, for planning models hx never loads and for random weights of
# those shapes (``preset``; ``loader.load("llama2-7b:8L")``). Values are from each model's
# Hugging Face config.json (repo id in the comment). Presets are float32; ``loader.load_spec``
# and ``loader.load`` give them in the dtype asked for.
PRESETS: dict[str, ModelSpec] = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": ModelSpec(
        name="SmolLM2-135M", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
        d_ff=1536, vocab_size=49152, context_length=8192, rope_theta=100000.0,
        norm_eps=1e-5, tie_embeddings=True),
    # meta-llama/Llama-2-7b-hf
    "llama2-7b": ModelSpec(
        name="Llama-2-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, head_dim=128,
        d_ff=11008, vocab_size=32000, context_length=4096, rope_theta=10000.0,
        norm_eps=1e-5),
    # meta-llama/Llama-2-13b-hf
    "llama2-13b": ModelSpec(
        name="Llama-2-13B", n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, head_dim=128,
        d_ff=13824, vocab_size=32000, context_length=4096, rope_theta=10000.0,
        norm_eps=1e-5),
    # meta-llama/Llama-2-70b-hf
    "llama2-70b": ModelSpec(
        name="Llama-2-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=28672, vocab_size=32000, context_length=4096, rope_theta=10000.0,
        norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": ModelSpec(
        name="Llama-3-8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=14336, vocab_size=128256, context_length=8192, rope_theta=500000.0,
        norm_eps=1e-5),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": ModelSpec(
        name="Llama-3-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=28672, vocab_size=128256, context_length=8192, rope_theta=500000.0,
        norm_eps=1e-5),
    # meta-llama/Llama-3.1-8B (rope_scaling llama3: factor 8, low 1, high 4, original 8192)
    "llama3.1-8b": ModelSpec(
        name="Llama-3.1-8B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
        head_dim=128, d_ff=14336, vocab_size=128256, context_length=131072,
        rope_theta=500000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE),
    # meta-llama/Llama-3.1-70B
    "llama3.1-70b": ModelSpec(
        name="Llama-3.1-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8,
        head_dim=128, d_ff=28672, vocab_size=128256, context_length=131072,
        rope_theta=500000.0, norm_eps=1e-5, rope_scaling=LLAMA31_ROPE),
    # mistralai/Mistral-7B-v0.1 (max_position_embeddings 32768, sliding window 4096)
    "mistral-7b": ModelSpec(
        name="Mistral-7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=14336, vocab_size=32000, context_length=32768, rope_theta=10000.0,
        norm_eps=1e-5, family="mistral", sliding_window=4096),
    # Qwen/Qwen2.5-7B (shapes; context 32768 as in Qwen/Qwen2.5-7B-Instruct's config, the base
    # repo's config lists 131072); biases on the q, k, v projections
    "qwen2.5-7b": ModelSpec(
        name="Qwen2.5-7B", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4, head_dim=128,
        d_ff=18944, vocab_size=152064, context_length=32768, rope_theta=1000000.0,
        norm_eps=1e-6, family="qwen2"),
    # Qwen/Qwen2.5-72B-Instruct
    "qwen2.5-72b": ModelSpec(
        name="Qwen2.5-72B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=29568, vocab_size=152064, context_length=32768, rope_theta=1000000.0,
        norm_eps=1e-6, family="qwen2"),
    # Qwen/Qwen3-8B (q/k RMSNorm; head dim 128 beside hidden 4096)
    "qwen3-8b": ModelSpec(
        name="Qwen3-8B", n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=12288, vocab_size=151936, context_length=40960, rope_theta=1000000.0,
        norm_eps=1e-6, family="qwen3"),
    # Qwen/Qwen3-32B
    "qwen3-32b": ModelSpec(
        name="Qwen3-32B", n_layers=64, d_model=5120, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=25600, vocab_size=151936, context_length=40960, rope_theta=1000000.0,
        norm_eps=1e-6, family="qwen3"),
    # microsoft/Phi-3-mini-4k-instruct (fused qkv and gate_up tensors; window 2047)
    "phi3-mini": ModelSpec(
        name="Phi-3-mini-4k", n_layers=32, d_model=3072, n_heads=32, n_kv_heads=32,
        head_dim=96, d_ff=8192, vocab_size=32064, context_length=4096, rope_theta=10000.0,
        norm_eps=1e-5, family="phi3", sliding_window=2047),
    # Mixtures of Experts (every layer's feed-forward part routed: ModelSpec.moe)
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of 14336, top 2 (no sliding window)
    "mixtral-8x7b": ModelSpec(
        name="Mixtral-8x7B", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        d_ff=14336, vocab_size=32000, context_length=32768, rope_theta=1000000.0,
        norm_eps=1e-5, family="mixtral", moe=MoeShape(8, 2, 14336)),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top 8, renormalised (norm_topk_prob)
    "qwen3-30b-a3b": ModelSpec(
        name="Qwen3-30B-A3B", n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4,
        head_dim=128, d_ff=6144, vocab_size=151936, context_length=40960,
        rope_theta=1000000.0, norm_eps=1e-6, family="qwen3_moe", moe=MoeShape(128, 8, 768)),
    # Qwen/Qwen3-235B-A22B: 128 experts of 1536, top 8
    "qwen3-235b-a22b": ModelSpec(
        name="Qwen3-235B-A22B", n_layers=94, d_model=4096, n_heads=64, n_kv_heads=4,
        head_dim=128, d_ff=12288, vocab_size=151936, context_length=40960,
        rope_theta=1000000.0, norm_eps=1e-6, family="qwen3_moe", moe=MoeShape(128, 8, 1536)),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts of 1408, top 4, not renormalised, a shared expert
    # of 5632 behind a sigmoid gate; q/k/v biases
    "qwen1.5-moe-a2.7b": ModelSpec(
        name="Qwen1.5-MoE-A2.7B", n_layers=24, d_model=2048, n_heads=16, n_kv_heads=16,
        head_dim=128, d_ff=5632, vocab_size=151936, context_length=8192,
        rope_theta=1000000.0, norm_eps=1e-6, family="qwen2_moe",
        moe=MoeShape(60, 4, 1408, d_shared=5632, norm_top_k=False)),
    # allenai/OLMoE-1B-7B-0924: 64 experts of 1024, top 8, not renormalised; q/k norms over
    # the whole projection
    "olmoe-1b-7b": ModelSpec(
        name="OLMoE-1B-7B", n_layers=16, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128,
        d_ff=1024, vocab_size=50304, context_length=4096, rope_theta=10000.0, norm_eps=1e-5,
        family="olmoe", moe=MoeShape(64, 8, 1024, norm_top_k=False)),
    # deepseek-ai/DeepSeek-V2-Lite: 64 experts of 1408, top 6 (greedy), two shared; the first
    # layer dense (10944)
    "deepseek-v2-lite": _deepseek(
        "DeepSeek-V2-Lite", 27, 1, 2048, 16, 0, 10944, 102400,
        MoeShape(64, 6, 1408, d_shared=2816, norm_top_k=False, shared_gate=False), 0.707,
        "deepseek_v2"),
    # deepseek-ai/DeepSeek-V3 (without its multi-token-prediction module): 256 experts of
    # 2048 chosen by sigmoid scores plus a learned bias, top 8 of the best 4 of 8 groups,
    # renormalised, x 2.5, one shared; the first 3 layers dense (18432); q through a 1536
    # latent
    "deepseek-v3": _deepseek(
        "DeepSeek-V3", 61, 3, 7168, 128, 1536, 18432, 129280,
        MoeShape(256, 8, 2048, d_shared=2048, norm_top_k=True, routed_scale=2.5, groups=8,
                 top_groups=4, shared_gate=False), 1.0, "deepseek_v3"),
    # openai/gpt-oss-20b and openai/gpt-oss-120b (``models.gpt_oss``): 32 or 128 experts of
    # 2880, top 4, 64 heads of 64 beside a hidden 2880, a 128-token window on every other
    # layer; their MXFP4 experts in whichever format is asked (q4_0: 4.5 bits a weight,
    # MXFP4's 4.25)
    **{name: _gpt_oss(name, layers, experts)
       for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    # google/gemma-3-12b-pt (its config.json's text_config; local and global layers 5:1)
    "gemma3-12b": _gemma3("Gemma-3-12B", 48, 3840, 16, 8, 256, 15360, 256),
    # google/gemma-3-27b-pt (head dim 128; query_pre_attn_scalar 168 = 5376 / 32)
    "gemma3-27b": _gemma3("Gemma-3-27B", 62, 5376, 32, 16, 128, 21504, 168),
    # OPT (Zhang et al. 2022), shapes from FMInference/FlexiGen flexgen/opt_config.py (FFN = 4 x
    # hidden, 2048 positions, vocabulary 50272); OPT-30B also from facebook/opt-30b's config.
    **{name: ModelSpec(
        name=label, n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=heads,
        head_dim=hidden // heads, d_ff=4 * hidden, vocab_size=50272, context_length=2048,
        tie_embeddings=True, family="opt")
       for name, label, layers, hidden, heads in (
           ("opt-6.7b", "OPT-6.7B", 32, 4096, 32), ("opt-30b", "OPT-30B", 48, 7168, 56),
           ("opt-66b", "OPT-66B", 64, 9216, 72), ("opt-175b", "OPT-175B", 96, 12288, 96))},
}

_LAYER_COUNT = re.compile(r"(\d+)[lL]?")


def is_preset(name: str | None) -> bool:
    """Whether ``name`` (``NAME[:NL]``) names a preset, whatever its layer count."""
    return bool(name) and name.partition(":")[0].strip().lower() in PRESETS


def preset(name: str) -> ModelSpec:
    """A preset's spec, optionally cut to fewer layers: ``NAME[:NL]``.

    ``"llama2-7b"`` is ``PRESETS["llama2-7b"]``; ``"llama2-7b:8L"`` is the same spec with
    ``n_layers=8``, named ``"Llama-2-7B (8 of 32 layers)"``. The name is case-insensitive and the
    ``L`` may be left out (``llama2-7b:8``). Asking for all the layers gives the preset itself.

    Raises:
      HxError: an unknown name (the message lists the presets), or a layer count that is not a
        whole number from 1 to the preset's ``n_layers``.
    """
    key, sep, layers = name.partition(":")
    key = key.strip()
    spec = PRESETS.get(key.lower())
    if spec is None:
        raise HxError(f"unknown model preset {key!r}; presets: {', '.join(PRESETS)} "
                      "(add :NL for N layers, e.g. llama2-7b:8L)")
    if not sep:
        return spec
    match = _LAYER_COUNT.fullmatch(layers.strip())
    n = int(match.group(1)) if match else 0
    if not 1 <= n <= spec.n_layers:
        raise HxError(f"bad layer count in {name!r}: {spec.name} has {spec.n_layers} layers; "
                      f"write NAME:NL with N from 1 to {spec.n_layers}, e.g. {key}:2L")
    if n == spec.n_layers:
        return spec
    return spec.replace(n_layers=n, name=f"{spec.name} ({n} of {spec.n_layers} layers)",
                        **_with_types(spec, tuple(spec.layer_type(i) for i in range(n))))
