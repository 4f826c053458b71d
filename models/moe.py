"""Mixture-of-Experts layers (Shazeer et al. 2017; Mixtral, Jiang et al. 2024): what the MoE
families (``models.mixtral``, ``models.qwen3_moe``, ``models.qwen2_moe``, ``models.olmoe``)
share. Their attention is Llama's (``models.llama``, with their relatives' switches); their
feed-forward part (``ModelSpec.moe``: ``MoeShape``) maps onto MLP1 and MLP2:

  =====  ==============================================================  ================
  op     computes                                                        reads -> writes
  =====  ==============================================================  ================
  MLP1   ROUTER: n = RMSNorm(x); p = softmax(n R^T) over the X experts;  x -> a
         the top k of p (divided by their sum where ``norm_top_k``), as
         weights over all X (0 off the k): a = [n | weights] (B, T, D + X)
  MLP2   EXPERTS: x + sum_e weight_e SwiGLU_e(n) [+ sigmoid(n g)          a, x -> x
         SwiGLU_shared(n)]
  =====  ==============================================================  ================

The router (X, D) stays dense in any weight format (a compressed router would choose other
experts). The experts are held stacked, one array a matrix kind, expert e's matrix contiguous
at index e as a checkpoint's ``(experts, out, in)`` (transformers' ``gate_up_proj`` and
``down_proj``, llama.cpp's ``ffn_*_exps``): ``experts/gate_kernel``, ``experts/up_kernel``
(X, F, D) and ``experts/down_kernel`` (X, D, F); a checkpoint's per-expert tensors are stacked
at load. On the host, GGUF blocks are multiplied by ggml's ``mul_mat_id``, each row by its k
experts alone (``Experts``); elsewhere, at fewer (row, expert) products than experts (decode),
each row's k experts are gathered, and at more every expert runs, those not routed to weighted
by 0 -- the same sums at X / (rows k) the FLOPs (``hx.planner.cost.gathered_share``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from hx.errors import HxError
from hx.models.family import ConfigReader, GraphLayer, MetadataReader
from hx.models.compressed import DEFAULT_PRODUCTS, Products, expert_rows, product
from hx.models.formats import DENSE
from hx.models.layers import RMSNorm, Step, WeightedOp, dense, held_dtype, matrix
from hx.models.llama import GGUF_LAYER_NAMES, MODULES, LlamaFamily
from hx.models.spec import EXPERT_OPS, ClampedSwiGLU, ModelSpec, MoeShape, SwiGLU, gathers

ROUTER = "router"  # the router's (X, D) matrix: MLP1's, dense
SHARED_GATE = "shared_expert_gate"  # the shared expert's sigmoid gate (1, D): MLP2's, dense
# the routed experts' stacked matrices (MLP2's), one path a kind
EXPERT_KINDS = ("experts/gate_kernel", "experts/up_kernel", "experts/down_kernel")
EXPERT_IDS = "experts/ids"  # a part's experts' indices in their layer (int32)


class RouterOp(WeightedOp):
    """MLP1 of an MoE layer: x (B,T,D) -> a = [RMSNorm(x) | routing weights (X)] (B,T,D+X).

    The router's logits n R^T are rounded to the model's dtype (computed in float32 throughout
    where ``float32_logits``: DeepSeek's) and the experts chosen from them in float32
    (``choose``: here the k largest softmax probabilities, ``top_k_routed``, of the best
    groups where ``MoeShape.groups``); their weights, renormalised where ``norm_top_k``, times
    ``routed_scale``, rounded to the model's dtype, are the weights of their experts
    (transformers' ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``DeepseekV2TopkRouter``).
    """

    float32_logits: ClassVar[bool] = False

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s, moe = self.spec, self.spec.moe
        n = RMSNorm(s.norm_eps, held_dtype(self), name="ffn_norm")(x)
        table = self.param(ROUTER, nn.initializers.lecun_normal(), (moe.experts, s.d_model),
                           held_dtype(self))
        dtype = jnp.float32 if self.float32_logits else table.dtype
        logits = jnp.einsum("btd,xd->btx", n.astype(dtype), table.astype(dtype),
                            preferred_element_type=jnp.float32)
        if not self.float32_logits:
            logits = logits.astype(s.dtype)
        top, ids = self.choose(logits.astype(jnp.float32))
        if moe.norm_top_k:
            top = top / top.sum(axis=-1, keepdims=True)
        top = (top * moe.routed_scale).astype(s.dtype).astype(jnp.float32)
        weights = (jax.nn.one_hot(ids, moe.experts, dtype=jnp.float32) * top[..., None]).sum(-2)
        return (jnp.concatenate([n.astype(s.dtype), weights.astype(s.dtype)], axis=-1),)

    def choose(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights, ids) (B,T,k) float32 and int32 of the experts chosen from the router's
        logits (B,T,X) float32: the k largest softmax probabilities (``top_k_routed``)."""
        return top_k_routed(jax.nn.softmax(logits, axis=-1), self.spec.moe)


def best_expert(grouped: jax.Array) -> jax.Array:
    """A group's score (..., groups) from its experts' (..., groups, X / groups): the best
    one's (DeepSeek-V2's ``group_limited_greedy``)."""
    return grouped.max(axis=-1)


def top_k_routed(scores: jax.Array, moe: MoeShape, group_score=best_expert
                 ) -> tuple[jax.Array, jax.Array]:
    """(scores, ids) (..., k) of the k highest of ``scores`` (..., X) float32: over all X, or
    where ``moe.groups`` over the experts of the ``top_groups`` groups (X / groups consecutive
    experts each) that ``group_score`` ranks highest, the others' taken as -inf (DeepSeek-V2's
    ``group_limited_greedy``, arXiv:2405.04434 §3.2.2; transformers' ``DeepseekV2TopkRouter``,
    ``DeepseekV3TopkRouter``)."""
    if moe.groups:
        X = scores.shape[-1]
        grouped = scores.reshape(*scores.shape[:-1], moe.groups, X // moe.groups)
        _, best = jax.lax.top_k(group_score(grouped), moe.top_groups)
        kept = jax.nn.one_hot(best, moe.groups, dtype=jnp.bool_).any(axis=-2)  # (..., groups)
        scores = jnp.where(jnp.repeat(kept, X // moe.groups, axis=-1), scores, -jnp.inf)
    return jax.lax.top_k(scores, moe.top_k)


class ExpertsOp(WeightedOp):
    """MLP2 of an MoE layer: a (B,T,D+X), x (B,T,D) -> x + sum_e w_e SwiGLU_e(n) (B,T,D),
    plus the shared expert where ``MoeShape.d_shared``, behind its sigmoid gate where
    ``shared_gate`` (Qwen1.5-MoE's ``shared_expert``, ``shared_expert_gate``; DeepSeek's
    ``shared_experts`` have none); the routed experts by ``Experts``. Under a
    part's spec (``ModelSpec.expert_part``) the same sum over the part's experts alone: MLP2
    of a layer whose experts are placed one by one (none of them), an ``EXPERT_OPS`` op (no
    shared expert)."""

    @nn.compact
    def __call__(self, a: jax.Array, x: jax.Array, step: Step) -> tuple[jax.Array]:
        s, moe = self.spec, self.spec.moe
        n, weights = a[..., :s.d_model], a[..., s.d_model:].astype(jnp.float32)
        y = jnp.zeros(n.shape, jnp.float32)
        if moe.experts:
            y = Experts(moe.experts, moe.top_k, moe.d_expert, held_dtype(self), s.weight_format,
                        self.products, moe.of, moe.activation, moe.expert_bias,
                        name="experts")(n, weights)
        if moe.d_shared:
            gate = dense(self, moe.d_shared, name="shared_w_gate")(n)
            up = dense(self, moe.d_shared, name="shared_w_up")(n)
            shared = dense(self, s.d_model, name="shared_w_down")(jax.nn.silu(gate) * up)
            if not moe.shared_gate:
                return ((x.astype(jnp.float32) + y + shared).astype(s.dtype),)
            mix = self.param(SHARED_GATE, nn.initializers.lecun_normal(), (1, s.d_model),
                             held_dtype(self))
            scale = jnp.einsum("btd,od->bto", n.astype(mix.dtype), mix,
                               preferred_element_type=jnp.float32)
            y = y + jax.nn.sigmoid(scale.astype(s.dtype).astype(jnp.float32)) * shared
        return ((x.astype(jnp.float32) + y).astype(s.dtype),)


class Experts(nn.Module):
    """The routed experts of one layer: y (B,T,D) float32 = sum_e w_e down_e(act(gate_e n,
    up_e n)) of n (B,T,D) and the routing weights w (B,T,X) float32 (0 off each row's k);
    ``activation`` act (``models.spec.SwiGLU``: SiLU(g) u), and where ``biased`` each product
    adds its expert's bias (``gate_bias``, ``up_bias`` (X, F), ``down_bias`` (X, D), dense).

    ``gate_kernel``, ``up_kernel`` (X, F, D) and ``down_kernel`` (X, D, F) are held in ``fmt``.
    Where the device multiplies them as held (``Products.takes_experts``: the host's ggml,
    llama.cpp's ``mul_mat_id``, its ``add_id`` for the biases) each row runs its k experts
    alone, after the k largest weights and their experts are read off w (``jax.lax.top_k``).
    Elsewhere XLA runs a loop
    (``jax.lax.fori_loop``, so one step's matrices are decompressed at a time): at fewer
    (row, expert) pairs than experts (``gathers``: decode) over j < k, each row's j-th
    expert's matrices gathered (``held_experts``: a compressed one's blocks, then
    decompressed) and multiplied; at more, over the X experts, each on every row weighted by
    w (0 off its k).
    Initialised as each expert's LeCun normal. A part of a layer of ``of`` routed experts
    (``MoeShape.of``) holds ``ids`` (X,) int32, the layer's index of each of its experts, and
    reads those columns of w (B,T,of); each row then runs its min(k, X) largest of them, the
    rest weighted 0 (ggml reads no expert for a slot weighted 0: ``host_compute/ggml_moe.cc``;
    XLA's gather does).
    """

    experts: int
    top_k: int
    d_expert: int
    param_dtype: Any = jnp.float32
    fmt: str = DENSE
    products: Products = DEFAULT_PRODUCTS
    of: int = 0
    activation: SwiGLU | ClampedSwiGLU = SwiGLU()
    biased: bool = False

    @nn.compact
    def __call__(self, n: jax.Array, weights: jax.Array) -> jax.Array:
        X, F, D = self.experts, self.d_expert, n.shape[-1]
        if self.of:
            ids = self.param("ids", nn.initializers.zeros_init(), (X,), jnp.int32)
            weights = jnp.take(weights, ids, axis=-1)
        init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        gate, up, down = (matrix(self, name, shape, self.fmt, self.param_dtype, init)
                          for name, shape in (("gate_kernel", (X, F, D)),
                                              ("up_kernel", (X, F, D)),
                                              ("down_kernel", (X, D, F))))
        biases = tuple(self.param(name, nn.initializers.zeros_init(), shape, self.param_dtype)
                       for name, shape in (("gate_bias", (X, F)), ("up_bias", (X, F)),
                                           ("down_bias", (X, D)))) if self.biased else ()
        rows, w = n.reshape(-1, D), weights.reshape(-1, X)
        k = min(self.top_k, X)
        if self.products.takes_experts((gate, up, down)):
            top, ids = jax.lax.top_k(w, k)
            return self.products.experts(rows, ids, top, gate, up, down, biases,
                                         self.activation).reshape(n.shape)
        dtype = self.param_dtype
        if gathers(rows.shape[0], k, X):  # each row's j-th expert, one j at a time
            top, ids = jax.lax.top_k(w, k)
            picks, weight, spec = ids.T, top.T, "rfd,rd->rf"
        else:  # every expert, one at a time, on every row, weighted 0 off its k
            picks, weight, spec = jnp.arange(X)[:, None], w.T, "fd,rd->rf"
        x, picks, weight = rows.astype(dtype), jnp.asarray(picks), jnp.asarray(weight)

        def one(j, y):  # y + the weighted outputs of choice j (the held experts at picks[j])
            g, u, d = (held_experts(m, picks[j], X, dtype).reshape(-1, *shape).squeeze(0)
                       if spec[0] == "f" else
                       held_experts(m, picks[j], X, dtype).reshape(-1, *shape)
                       for m, shape in ((gate, (F, D)), (up, (F, D)), (down, (D, F))))
            gb, ub, db = (held_experts(b, picks[j], X, dtype).reshape(-1, b.shape[-1])
                          .astype(jnp.float32) for b in biases) if biases else (0.0, 0.0, 0.0)
            inner = self.activation(
                jnp.einsum(spec, g, x, preferred_element_type=jnp.float32) + gb,
                jnp.einsum(spec, u, x, preferred_element_type=jnp.float32) + ub
            ) * weight[j][:, None]
            return y + weight[j][:, None] * db + jnp.einsum(
                spec.replace("fd", "df").replace("rd->rf", "rf->rd"), d, inner.astype(dtype),
                preferred_element_type=jnp.float32)

        y = jax.lax.fori_loop(0, picks.shape[0], one, jnp.zeros(rows.shape, jnp.float32))
        return y.reshape(n.shape)


def part_params(tree: Mapping[str, Any], op: str, ids: tuple[int, ...], experts: int
                ) -> dict[str, Any]:
    """The weights a part of an MoE layer holds (``ModelSpec.expert_part``), from the layer's
    MLP2 tree ``tree`` of ``experts`` routed experts: MLP2's, all but the routed experts; an
    ``EXPERT_OPS`` op's, the experts ``ids`` (``models.compressed.expert_rows``) and the ids
    themselves (int32)."""
    if op == "MLP2":
        return {k: v for k, v in tree.items() if k != "experts"}
    index = np.asarray(ids, np.int32)
    part = {name: expert_rows(leaf, index, experts) for name, leaf in tree["experts"].items()}
    return {"experts": {**part, EXPERT_IDS.split("/")[1]: index}}


def held_experts(matrix, ids: jax.Array, experts: int, dtype) -> jax.Array:
    """The matrices of experts ``ids`` (any shape) of a stack of ``experts`` held as
    ``matrix`` (``models.compressed.expert_rows``), decompressed to ``dtype``: (ids.size,
    out, in) worth of weights, flattened as the held layout holds them."""
    part = expert_rows(matrix, ids.reshape(-1), experts)
    return part if isinstance(part, jax.Array) else part.decompress(dtype)


MOE_MODULES = {**MODULES, "MLP1": RouterOp, "MLP2": ExpertsOp,
               **{op: ExpertsOp for op in EXPERT_OPS}}

# llama.cpp's names of an MoE layer's tensors (its ``LLM_TENSOR_FFN_*_EXPS``, ``*_SHEXP``)
GGUF_MOE_NAMES = {**GGUF_LAYER_NAMES, ("MLP1", ROUTER): "ffn_gate_inp.weight",
                  ("MLP2", "experts/gate_kernel"): "ffn_gate_exps.weight",
                  ("MLP2", "experts/up_kernel"): "ffn_up_exps.weight",
                  ("MLP2", "experts/down_kernel"): "ffn_down_exps.weight",
                  ("MLP2", "shared_w_gate/kernel"): "ffn_gate_shexp.weight",
                  ("MLP2", "shared_w_up/kernel"): "ffn_up_shexp.weight",
                  ("MLP2", "shared_w_down/kernel"): "ffn_down_shexp.weight",
                  ("MLP2", SHARED_GATE): "ffn_gate_inp_shexp.weight"}


@dataclass(frozen=True)
class MoeFamily(LlamaFamily):
    """Llama's attention (with its relatives' switches) and an MoE feed-forward part (module
    docstring).

    Attributes:
      hf_experts: the Hugging Face name, within ``model.layers.{i}.``, of routed expert e's
        matrix of each ``EXPERT_KINDS`` path (``{e}`` its index), stacked at load.
      hf_moe_names: the Hugging Face names of the router and the shared expert's tensors.
    """

    hf_experts: Mapping[str, str] = None
    hf_moe_names: Mapping[tuple[str, str], str] = None

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """Llama's attention weights; MLP1 the FFN norm and the router (X, D), MLP2 the
        experts' gate and up (X, F, D) and down (X, D, F), with a shared expert its gate and
        up (Fs, D), down (D, Fs) and sigmoid gate (1, D; where ``shared_gate``); with
        ``expert_bias`` the experts' biases (X, F), (X, F), (X, D); a part of a layer's
        experts (``ModelSpec.expert_part``) its X experts' and their ids (X,)."""
        shapes = super().weight_shapes(spec)
        if spec.moe is None:  # a dense layer (``ModelSpec.layer_types``): Llama's MLP
            return shapes
        D, moe = spec.d_model, spec.moe
        X, F = moe.experts, moe.d_expert
        shapes["MLP1"] = {"ffn_norm/scale": (D,), ROUTER: (moe.routed, D)}
        shapes["MLP2"] = {"experts/gate_kernel": (X, F, D), "experts/up_kernel": (X, F, D),
                          "experts/down_kernel": (X, D, F)} if X else {}
        if moe.expert_bias and X:
            shapes["MLP2"] |= {"experts/gate_bias": (X, F), "experts/up_bias": (X, F),
                               "experts/down_bias": (X, D)}
        if moe.of and X:  # a part of the layer's experts (``ModelSpec.expert_part``)
            shapes["MLP2"][EXPERT_IDS] = (X,)
        if moe.d_shared:
            Fs = moe.d_shared
            shapes["MLP2"] |= {"shared_w_gate/kernel": (Fs, D), "shared_w_up/kernel": (Fs, D),
                               "shared_w_down/kernel": (D, Fs)}
            if moe.shared_gate:
                shapes["MLP2"][SHARED_GATE] = (1, D)
        return shapes

    def modules(self) -> Mapping[str, type]:
        return MOE_MODULES

    def module(self, spec: ModelSpec, op: str) -> type:
        """``modules()``'s, or in a dense layer (``moe`` None: DeepSeek's first layers)
        Llama's MLP1 and MLP2."""
        if spec.moe is None and op in ("MLP1", "MLP2"):
            return MODULES[op]
        return self.modules()[op]

    def graph_layer(self, spec: ModelSpec) -> GraphLayer | None:
        """Llama's layer with this family's switches, its FFN the routed experts and a shared
        one (``hx.host_compute.ggml_layer``: llama.cpp's MoE graph)."""
        return super().graph_layer(spec)

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """Expert 0's tensor for a stacked path (``hf_experts``), the router's and the shared
        expert's (``hf_moe_names``), else Llama's."""
        if layer is not None and path in EXPERT_KINDS:
            return f"model.layers.{layer}.{self.hf_experts[path].format(0)}"
        if layer is not None and (op, path) in self.hf_moe_names:
            return f"model.layers.{layer}.{self.hf_moe_names[(op, path)]}"
        return super().hf_name(layer, op, path)

    def from_hf(self, spec: ModelSpec, tensors: Mapping[str, Any], layer: int | None, op: str,
                path: str):
        """A stacked path's experts, each the checkpoint's (out, in), stacked (X, out, in)."""
        if layer is None or path not in EXPERT_KINDS:
            return super().from_hf(spec, tensors, layer, op, path)
        name = f"model.layers.{layer}.{self.hf_experts[path]}"
        return np.stack([tensors[name.format(e)] for e in range(spec.moe.experts)])

    def read_gguf_moe(self, reader: MetadataReader, d_ff: int) -> MoeShape:
        """``LlamaFamily.read_gguf_moe``, which must find experts.

        Raises:
          HxError: the file sets no ``expert_count``, or what the Llama family refuses.
        """
        moe = super().read_gguf_moe(reader, d_ff)
        if moe is None:
            raise HxError(f"{reader.where}: a {reader.arch} GGUF without "
                          f"{reader.arch}.expert_count; the file is incomplete")
        return moe

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """The config's MoE shape: ``num_experts`` (or ``num_local_experts``),
        ``num_experts_per_tok``, the expert size (``read_expert_size``), the shared expert's
        (``read_shared_size``), ``norm_topk_prob`` (``read_norm_top_k``).

        Raises:
          HxError: a key missing.
        """
        experts = reader.get("num_experts") or reader.need("num_local_experts")
        reader.get("num_local_experts")
        return MoeShape(experts=int(experts), top_k=int(reader.need("num_experts_per_tok")),
                        d_expert=int(self.read_expert_size(reader)),
                        d_shared=int(self.read_shared_size(reader)),
                        norm_top_k=bool(self.read_norm_top_k(reader)))

    def read_expert_size(self, reader: ConfigReader) -> int:
        """A routed expert's inner size: ``moe_intermediate_size``."""
        return reader.need("moe_intermediate_size")

    def read_shared_size(self, reader: ConfigReader) -> int:
        """The shared expert's inner size; 0: none (the config sets none)."""
        return 0

    def read_norm_top_k(self, reader: ConfigReader) -> bool:
        """Whether the top k probabilities are renormalised: ``norm_topk_prob``."""
        return reader.get("norm_topk_prob", False)

    def read_dense_layers(self, reader: ConfigReader, n_layers: int) -> tuple[int, ...]:
        """The layers with a dense MLP of ``intermediate_size`` (transformers' Qwen2-MoE and
        Qwen3-MoE decoder layers): those in ``mlp_only_layers``, and layer i where (i + 1) is
        not a multiple of ``decoder_sparse_step``; they become the layer type ``dense``
        (``models.spec.feed_forward_fields``).

        Raises:
          HxError: ``decoder_sparse_step`` below 1, or a layer index out of range.
        """
        step = int(reader.get("decoder_sparse_step", 1))
        only = set(reader.get("mlp_only_layers", []) or [])
        if step < 1 or not only <= set(range(n_layers)):
            raise HxError(f"{reader.where}: config.json sets decoder_sparse_step={step} and "
                          f"mlp_only_layers={sorted(only)}; hx reads a step of 1 or more and "
                          f"layers 0 to {n_layers - 1}")
        return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
