"""The gpt-oss family (OpenAI's gpt-oss-20b and gpt-oss-120b; model card arXiv:2508.10925;
transformers' ``GptOssForCausalLM``, ``model_type`` ``gpt_oss``): Llama's layer with

* biases on every attention projection (q, k, v and o);
* attention sinks: each query head's learned logit joins its softmax's denominator
  (``ModelSpec.sinks``; SCORE owns no weights, so Q writes the sink as q's last element);
* sliding-window layers (``sliding_window``, 128) alternating with full ones (``layer_types``:
  ``ModelSpec.layer_overrides``);
* YaRN over the whole head, its attention factor on q and k (``models.llama.yarn_factors``);
* Mixture-of-Experts layers (``models.moe``): a router with a bias, softmax over the top k
  logits (Mixtral's renormalised top k), experts with biases and a clamped SwiGLU
  (``models.spec.ClampedSwiGLU``), held as transformers holds them: ``gate_up_proj`` (X, D,
  2F) with gate and up interleaved along 2F, ``down_proj`` (X, F, D), split and transposed at
  load into hx's (X, F, D) and (X, D, F) stacks.

  =====  ============================================================  ==================
  op     computes                                                      reads -> writes
  =====  ============================================================  ==================
  Q      h = RMSNorm(x); q = [RoPE(h Wq + bq) m | sink] (B,T,H,E + 1)  x -> h, q
  SCORE  softmax over [q k^T / sqrt(E) | sink] of the window, v        q, k, v -> o
  OUT    x + o Wo + bo                                                 o, x -> x
  MLP1   n = RMSNorm(x); softmax(n R^T + b) over the top k             x -> a
  MLP2   x + sum_e w_e (down_e(act(gate_e n + bg, up_e n + bu)) + bd)  a, x -> x
  =====  ============================================================  ==================

Refused (one line naming it): ``quantization_config`` (the released checkpoints' MXFP4
experts: hx reads a dequantized copy, e.g. bfloat16), layer types other than these two, and
what Llama refuses. hx reads gpt-oss from Hugging Face folders, not llama.cpp's ``gpt-oss``
GGUF. On the host, experts held in GGUF blocks (``--weights q4_0``, ``q8_0``) run in ggml's
graph as llama.cpp's gpt-oss graph does (``mul_mat_id``, ``add_id`` for the biases,
``swiglu_oai``: ``hx.host_compute.ggml_kernel.experts``); the layer's other ops run one by one
(no ``graph_layer``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from hx.models.family import ConfigReader, GraphLayer
from hx.models.gemma3 import GLOBAL, LOCAL, layer_types
from hx.models.layers import (RMSNorm, ScoreOp, Step, WeightedOp, append_kv, attention,
                              held_dtype)
from hx.models.llama import HF_LAYER_NAMES, HF_MODEL_NAMES, ROPE_TYPES, YARN, project_heads
from hx.models.moe import MOE_MODULES, ROUTER, MoeFamily, RouterOp, top_k_routed
from hx.models.ops import SCORE
from hx.models.opt import OutOp  # x + o Wo + bo: OPT's biased output projection
from hx.models.qwen3_moe import MOE_TRAINING
from hx.models.spec import ClampedSwiGLU, ModelSpec, MoeShape
from hx.models.tensors import kv_format

SINKS = "sinks"  # Q's (H,) sink logits
ROUTER_BIAS = "router_bias"  # MLP1's (X,) bias on the router's logits
FUSED = "mlp.experts.{}"  # transformers' stacked experts, within ``model.layers.{i}.``
# hx's expert paths -> (the fused tensor, the slice of its last axis: gate and up interleave)
EXPERT_TENSORS = {"experts/gate_kernel": ("gate_up_proj", slice(0, None, 2)),
                  "experts/up_kernel": ("gate_up_proj", slice(1, None, 2)),
                  "experts/down_kernel": ("down_proj", slice(None)),
                  "experts/gate_bias": ("gate_up_proj_bias", slice(0, None, 2)),
                  "experts/up_bias": ("gate_up_proj_bias", slice(1, None, 2)),
                  "experts/down_bias": ("down_proj_bias", slice(None))}


class QOp(WeightedOp):
    """Q: x (B,T,D) -> h = RMSNorm(x) (B,T,D), q (B,T,H,E + 1): RoPE(h Wq + bq) times YaRN's
    factor, each head's sink logit last."""

    @nn.compact
    def __call__(self, x: jax.Array, step: Step) -> tuple[jax.Array, jax.Array]:
        s = self.spec
        h = RMSNorm(s.norm_eps, held_dtype(self), name="attn_norm")(x)
        q = project_heads(self, h, "q", s.n_heads, step, rotate=True)
        sinks = self.param(SINKS, nn.initializers.zeros_init(), (s.n_heads,), held_dtype(self))
        sink = jnp.broadcast_to(sinks.astype(s.dtype), q.shape[:-1])[..., None]
        return h, jnp.concatenate([q, sink], axis=-1)


class SinkScoreOp(ScoreOp):
    """SCORE: append k, v to the layer's KV cache and attend (``models.layers.attention``)
    with q's last element as each head's sink -> o (B,T,H,E). ``attend`` is not used: the
    host's attention kernels know no sinks (``Family.host_attention`` is False here)."""

    def __call__(self, q, k, v, step: Step, cache):
        fmt, window, E = kv_format(self.spec), self.spec.sliding_window, self.spec.head_dim
        cache = append_kv(cache, k, v, step.write_index, fmt, ring=window is not None)
        return (attention(q[..., :E], cache, step, fmt, window,
                          sinks=q[..., E].astype(jnp.float32)),), cache


class BiasedRouterOp(RouterOp):
    """MLP1: ``RouterOp`` whose logits add a bias (X,) before the top k are chosen
    (transformers' ``GptOssTopKRouter``: softmax over the top k logits, which is the
    renormalised top k of the softmax over all)."""

    def choose(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights, ids) (B,T,k) of the k largest softmax(logits + bias)."""
        bias = self.param(ROUTER_BIAS, nn.initializers.zeros_init(), (self.spec.moe.experts,),
                          held_dtype(self))
        biased = (logits + bias.astype(jnp.float32)).astype(self.spec.dtype)
        return top_k_routed(jax.nn.softmax(biased.astype(jnp.float32), axis=-1), self.spec.moe)


MODULES = {**MOE_MODULES, "Q": QOp, SCORE: SinkScoreOp, "OUT": OutOp, "MLP1": BiasedRouterOp}

HF_GPT_OSS_NAMES = {**HF_LAYER_NAMES, ("Q", SINKS): "self_attn.sinks",
                    ("OUT", "wo/bias"): "self_attn.o_proj.bias"}
HF_ROUTER_NAMES = {("MLP1", ROUTER): "mlp.router.weight",
                   ("MLP1", ROUTER_BIAS): "mlp.router.bias"}


@dataclass(frozen=True)
class GptOssFamily(MoeFamily):
    """Llama's layer with gpt-oss's attention and experts (module docstring)."""

    # training's router losses; the original context (YaRN's is in rope_parameters)
    hf_ignored: ClassVar[frozenset] = MOE_TRAINING | frozenset({"initial_context_length"})
    host_attention: ClassVar[bool] = False
    rope_types: ClassVar[tuple[str, ...]] = (*ROPE_TYPES, YARN)  # YaRN: ``yarn_factors``

    def weight_shapes(self, spec: ModelSpec) -> dict[str, dict[str, tuple[int, ...]]]:
        """``MoeFamily``'s (with q/k/v biases and the experts' biases); Q also the sinks
        (H,), OUT the output bias (D,), MLP1 the router's bias (X,)."""
        shapes = super().weight_shapes(spec)
        shapes["Q"][SINKS] = (spec.n_heads,)
        shapes["OUT"]["wo/bias"] = (spec.d_model,)
        shapes["MLP1"][ROUTER_BIAS] = (spec.moe.routed,)
        return shapes

    def modules(self) -> Mapping[str, type]:
        return MODULES

    def graph_layer(self, spec: ModelSpec) -> GraphLayer | None:
        """None: sinks, biases and the clamped experts are not llama.cpp's layer graph here
        (its ops run one by one)."""
        return None

    def hf_name(self, layer: int | None, op: str, path: str) -> str:
        """The fused expert tensor an expert path is cut from, else ``MoeFamily``'s."""
        if layer is not None and path in EXPERT_TENSORS:
            return f"model.layers.{layer}.{FUSED.format(EXPERT_TENSORS[path][0])}"
        return super().hf_name(layer, op, path)

    def from_hf(self, spec: ModelSpec, tensors: Mapping[str, Any], layer: int | None, op: str,
                path: str):
        """An expert path from its fused tensor (``EXPERT_TENSORS``): gate_up_proj (X, D, 2F)
        and down_proj (X, F, D) sliced along their last axis and transposed to (X, out, in),
        the biases sliced; else ``MoeFamily``'s."""
        if layer is None or path not in EXPERT_TENSORS:
            return super().from_hf(spec, tensors, layer, op, path)
        part = tensors[self.hf_name(layer, op, path)][..., EXPERT_TENSORS[path][1]]
        return np.ascontiguousarray(part.transpose(0, 2, 1) if part.ndim == 3 else part)

    def read_attention(self, reader: ConfigReader, n_layers: int) -> dict[str, Any]:
        """Sinks on every layer; the layers' types (``layer_types``, else transformers'
        alternation: sliding, full, ...), the sliding ones attending the last
        ``sliding_window`` slots.

        Raises:
          HxError: a layer type other than those two, or a count other than the layers'.
        """
        kinds = layer_types(reader, n_layers, self.name, period=2)
        window = int(reader.need("sliding_window"))
        overrides = {LOCAL: (("sliding_window", window),), GLOBAL: (("sliding_window", None),)}
        return {"sliding_window": None, "sinks": True, "layer_types": tuple(kinds),
                "layer_overrides": tuple(sorted((k, overrides[k]) for k in set(kinds)))}

    def read_moe(self, reader: ConfigReader) -> MoeShape:
        """``num_local_experts`` experts of ``intermediate_size``, the top
        ``num_experts_per_tok`` (``experts_per_token`` where also set) renormalised, with
        biases and ``ClampedSwiGLU(swiglu_alpha, swiglu_limit)``.

        Raises:
          HxError: ``experts_per_token`` other than ``num_experts_per_tok``, or a key
            missing.
        """
        top_k = int(reader.need("num_experts_per_tok"))
        reader.expect("experts_per_token", (top_k,), top_k)
        return MoeShape(experts=int(reader.need("num_local_experts")), top_k=top_k,
                        d_expert=int(reader.need("intermediate_size")), norm_top_k=True,
                        activation=ClampedSwiGLU(float(reader.get("swiglu_alpha", 1.702)),
                                                 float(reader.get("swiglu_limit", 7.0))),
                        expert_bias=True)


FAMILY = GptOssFamily(
    name="gpt_oss", hf_model_types=("gpt_oss",), hf_layer_names=HF_GPT_OSS_NAMES,
    hf_model_names=HF_MODEL_NAMES, hf_experts={}, hf_moe_names=HF_ROUTER_NAMES, qkv_bias=True)
