"""Shapes-only description of a decoder-only model: enough to size, place and plan it.

A :class:`ModelSpec` never holds weights. The planner uses it to size models it never loads
(a 70B spec costs nothing), the loaders build one from a file's metadata, and the Flax model is
configured by it (it is frozen and hashable, so it can be a static argument under ``jax.jit``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The seven per-layer ops (TwinPilots Table I / FlexGen): the unit of placement everywhere in hx.
LAYER_OPS: tuple[str, ...] = ("Q", "K", "V", "SCORE", "OUT", "MLP1", "MLP2")
# Per-model ops outside the layer stack: token embedding lookup and final norm + LM head.
EMBED, HEAD = "EMBED", "HEAD"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyper-parameters of a Llama-family decoder (no weights).

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
      dtype_bytes: bytes per weight/activation element as hx runs the model (4 = float32).
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
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def op_weight_shapes(self, op: str) -> dict[str, tuple[int, ...]]:
        """Shapes of the weight tensors owned by ``op``, keyed by parameter path.

        The paths match the Flax parameter tree of that op (see ``models/llama.py``). ``HEAD``
        always lists ``embedding``: for a tied model it is the ``EMBED`` matrix itself, which
        costs memory twice only where the two ops sit on different devices.
        """
        D, H, K, E, F, V = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                            self.d_ff, self.vocab_size)
        shapes = {
            EMBED: {"embedding": (V, D)},
            "Q": {"attn_norm/scale": (D,), "wq/kernel": (D, H, E)},
            "K": {"wk/kernel": (D, K, E)},
            "V": {"wv/kernel": (D, K, E)},
            "SCORE": {},
            "OUT": {"wo/kernel": (H, E, D)},
            "MLP1": {"ffn_norm/scale": (D,), "w_gate/kernel": (D, F), "w_up/kernel": (D, F)},
            "MLP2": {"w_down/kernel": (F, D)},
            HEAD: {"final_norm/scale": (D,), "embedding": (V, D)},
        }
        return shapes[op]

    def op_weight_bytes(self, op: str) -> int:
        """Bytes of the weights owned by ``op`` at ``dtype_bytes`` per element."""
        total = 0
        for shape in self.op_weight_shapes(op).values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total * self.dtype_bytes

    @property
    def layer_weight_bytes(self) -> int:
        """Bytes of one decoder layer's weights."""
        return sum(self.op_weight_bytes(op) for op in LAYER_OPS)

    @property
    def weight_bytes(self) -> int:
        """Bytes of all distinct weights (a tied embedding counted once)."""
        tied = self.vocab_size * self.d_model * self.dtype_bytes if self.tie_embeddings else 0
        return (self.n_layers * self.layer_weight_bytes + self.op_weight_bytes(EMBED)
                + self.op_weight_bytes(HEAD) - tied)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token per layer: 2 (K and V) x K heads x E x dtype bytes."""
        return 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes


# Named specs for models hx plans but may never load. Values are from the models' configs.
PRESETS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="SmolLM2-135M", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
        d_ff=1536, vocab_size=49152, context_length=8192, rope_theta=100000.0,
        norm_eps=1e-5, tie_embeddings=True),
    "llama2-70b": ModelSpec(
        name="Llama-2-70B", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=28672, vocab_size=32000, context_length=4096, rope_theta=10000.0,
        norm_eps=1e-5, tie_embeddings=False, dtype_bytes=2),
}
