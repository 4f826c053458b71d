"""FLOPs and bytes of every op and transfer, from a ``ModelSpec`` and the step's shapes.

Notation as in ``models/layers.py``: B batch, T new tokens per row (prompt length in prefill, 1 in
decode), S cache slots attended, D hidden, H/K query/KV heads, E head dim, F FFN size, V vocab.
A dense (M x N) @ (N x P) product costs 2·M·N·P FLOPs (one multiply and one add per term; Kaplan
et al. 2020, §2.1). Elementwise work (norms, RoPE, SiLU, softmax) is a few FLOPs per element and
is left out of matmul-bound ops. Bytes are at ``spec.dtype_bytes`` per element -- the model's
dtype, which is that of the weights on the accelerator, of the activations on either device and
of the KV caches; token ids are int32 and logits float32 (``models.tensors`` sizes every tensor).
Ops computed on the host hold their weights in float32 (``models.tensors.weight_dtype``).
A compressed matrix's bytes are its format's (``ModelSpec.op_weight_bytes``); its
decompression before the product is priced per weight (``OpCost.dequantized``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hx.models.formats import DENSE
from hx.models.spec import EMBED, EXPERT_OPS, HEAD, SCORE, ModelSpec, MoeShape, gathers
from hx.models.tensors import kv_bytes


@dataclass(frozen=True)
class OpCost:
    """Work of one op in one step.

    Attributes:
      flops: floating-point operations.
      rows: M of its matmuls (B·T, or B for HEAD, which scores only the last position).
      weight_bytes: weight bytes read.
      kv_read_bytes / kv_write_bytes: KV-cache bytes read (SCORE over S slots) and appended.
      other_bytes: other memory traffic (EMBED's gathered rows).
      dequantized: ((weight format, weights), ...): each compressed matrix the op
        decompresses before its product (``models.layers.dequantize``).
    """

    flops: float
    rows: int
    weight_bytes: int
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    other_bytes: int = 0
    dequantized: tuple[tuple[str, int], ...] = ()


def dequantized_weights(spec: ModelSpec, op: str, share: float = 1.0
                        ) -> tuple[tuple[str, int], ...]:
    """((format, weights), ...), one per matrix of ``op`` held compressed
    (``ModelSpec.matrix_format``), a stack of routed experts' at ``share`` of its weights
    (those gathered: ``gathered_share``); EMBED decompresses only the rows it gathers (left
    out, as its elementwise work is)."""
    if op == EMBED:
        return ()
    return tuple((spec.matrix_format(path),
                  round(math.prod(shape) * (share if _routed(path) else 1.0)))
                 for path, shape in spec.op_weight_shapes(op).items()
                 if spec.matrix_format(path) != DENSE)


def _routed(path: str) -> bool:
    return path.startswith("experts/") and path.endswith("kernel")


def op_cost(spec: ModelSpec, op: str, batch: int, tokens: int, slots: int) -> OpCost:
    """FLOPs and bytes of ``op`` for ``batch`` rows of ``tokens`` new tokens over ``slots``
    attended cache slots.

    Formulas (M = B·T): an op with weights, 2·M per element of its matrices (its family's,
      ``models.family.Family.flops``: Q 2·M·D·H·E, K and V 2·M·D·K·E, OUT 2·M·H·E·D, a
      SwiGLU MLP1 2·(2·M·D·F), OPT's fc1 2·M·D·F, MLP2 2·M·F·D; an MoE layer's routed
      experts all X of them, or the rows·k XLA gathers: ``gathered_share``) and HEAD
      2·B·D·V;  SCORE:
      q·kᵀ and p·v, 2·B·H·T·S·(Eq + Eo) (4·B·H·T·S·E; latent attention's absorbed q and
      output widths: ``ModelSpec.q_width``, ``o_width``), reading the B·S cache slots and
      appending B·T (``kv_bytes``);  EMBED: B·T·D elements gathered.
    A pipeline stage's pass-through EMBED or HEAD (``ModelSpec.embeds``, ``heads``) costs
    nothing.
    """
    s, w = spec, spec.dtype_bytes
    D, H = s.d_model, s.n_heads
    M = batch * tokens
    weights = s.op_weight_bytes(op)
    if (op == EMBED and not s.embeds) or (op == HEAD and not s.heads):
        return OpCost(0.0, M, 0)
    if op == EMBED:
        return OpCost(0.0, M, 0, other_bytes=M * D * w)
    if op == SCORE:
        return OpCost(2.0 * batch * H * tokens * slots * (s.q_width + s.o_width), M, 0,
                      kv_read_bytes=kv_bytes(spec, batch, slots),
                      kv_write_bytes=kv_bytes(spec, batch, tokens))
    rows = batch if op == HEAD else M
    share = gathered_share(spec, op, rows)  # < 1: XLA runs the rows·k experts it gathers
    experts = sum(math.prod(shape) for path, shape in s.op_weight_shapes(op).items()
                  if _routed(path))
    return OpCost(s.model_family.flops(s, op, rows) - 2.0 * rows * (1 - share) * experts,
                  rows, weights, dequantized=dequantized_weights(spec, op, share))


def gathered_share(spec: ModelSpec, op: str, rows: int) -> float:
    """The share of an MoE op's routed experts XLA runs at ``rows`` rows: rows·k / X where it
    gathers each row's k (``models.spec.gathers``; repeats counted), else 1 (every expert)."""
    moe = spec.moe
    if moe is None or not moe.experts or op not in ("MLP2", *EXPERT_OPS):
        return 1.0
    k = min(moe.top_k, moe.experts)
    return rows * k / moe.experts if gathers(rows, k, moe.experts) else 1.0


def routed_experts(moe: MoeShape, rows: int) -> tuple[float, float]:
    """(experts run, rows each) of ggml's ``mul_mat_id`` over an MoE layer's part
    (``MoeShape``: ``experts`` of the layer's X), each of ``rows`` rows through the part's
    experts it is routed to: expert e, picked by a row with chance p_e (``MoeShape.picks``;
    by default a random router's k / X, the random models' here -- a trained router is skewed:
    fewer experts run, more rows each), runs when some row picks it (``routed_chance``), and
    the rows·sum(p_e) (row, expert) pairs split evenly over those run (a slot weighted 0
    reads no expert: ``host_compute/ggml_moe.cc``). The experts run are also what ``experts
    in`` copies of a layer's streamed part. (0, 0) where no row is expected."""
    p = np.asarray(moe.picks) if moe.picks else np.full(moe.experts, moe.top_k / moe.routed)
    run = float(routed_chance(p, rows).sum())
    return (run, rows * float(p.sum()) / run) if run > 0 else (0.0, 0.0)


def routed_chance(picks: np.ndarray, rows: int) -> np.ndarray:
    """The chance a step of ``rows`` rows routes to each expert that a row picks with chance
    ``picks`` (any shape), the rows picking alone: 1 - (1 - p)^rows."""
    return 1.0 - (1.0 - picks) ** rows
