"""Token sampling, kept out of the model: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hx.errors import HxError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
      max_new_tokens: upper bound on generated tokens per prompt.
      temperature: 0 selects greedy argmax; otherwise logits are divided by it.
      top_k: keep the k most likely tokens (0 = no limit).
      top_p: keep the smallest set of tokens whose probability reaches p (Holtzman et al.
        2020); 1.0 = no limit.
      seed: PRNG seed. Each row draws with a key derived from (its seed, step) only, so a
        prompt's sample does not depend on which other prompts share its batch (a batch run
        gives each prompt a seed derived from this one and its id: ``row_seed``).
      stop_ids: extra token ids that end a sequence (the model's EOS always does).
    Raises:
      HxError: out-of-range values.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise HxError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise HxError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise HxError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise HxError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: take the argmax."""
        return self.temperature == 0


def row_seed(seed: int, row_id: object) -> int:
    """The sampling seed of one prompt of a batch run: a hash of the run's seed and the
    prompt's id (stable across processes), so a resumed run samples as an uninterrupted one
    and equal prompts with different ids draw differently."""
    digest = hashlib.sha256(f"{seed}:{row_id!r}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Sampler:
    """What of ``SamplingParams`` a compiled sampler depends on (its static part).

    Attributes:
      greedy: argmax (temperature 0).
      top_k: keep the k most likely tokens (0 = no limit).
      use_top_p: nucleus filtering is on (top_p < 1).
    """

    greedy: bool
    top_k: int = 0
    use_top_p: bool = False

    @classmethod
    def of(cls, params: SamplingParams) -> "Sampler":
        """The static part of ``params`` (none but ``greedy`` when it is greedy)."""
        if params.greedy:
            return cls(True)
        return cls(False, params.top_k, params.top_p < 1.0)


def choose(logits: jax.Array, sampler: Sampler, seeds: jax.Array, steps: jax.Array,
           temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Next token of every row, traceable (``sample`` runs it jitted; ``hx.decode_loop``
    inside its loop).

    Args:
      logits: (B, V) float32.
      sampler: the static part of the sampling (``Sampler.of``).
      seeds: (B,) uint32 seed of each row.
      steps: (B,) uint32 index of the token each row draws (mixed into its PRNG key).
      temperature, top_p: () float32 (not read when greedy).
    Returns:
      (B,) int32 token ids.
    """
    if sampler.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    B, V = logits.shape
    top_k, use_top_p = sampler.top_k, sampler.use_top_p
    scaled = logits.astype(jnp.float32) / temperature
    if top_k or use_top_p:
        values, index = jax.lax.top_k(scaled, min(top_k, V) if top_k else V)  # (B,k) sorted
    else:
        values, index = scaled, jnp.broadcast_to(jnp.arange(V), (B, V))
    if use_top_p:
        probs = jax.nn.softmax(values, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        values = jnp.where(before < top_p, values, -jnp.inf)  # the top token always stays

    def draw(seed, step, row):
        return jax.random.categorical(jax.random.fold_in(jax.random.PRNGKey(seed), step), row)

    choice = jax.vmap(draw)(seeds, steps, values)
    return jnp.take_along_axis(index, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


_choose = jax.jit(choose, static_argnums=1)


def row_arrays(params: SamplingParams, step: int | Sequence[int], seeds: Sequence[int] | None,
               rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(seeds, steps), each (rows,) uint32: ``sample``'s ``seeds`` (default ``params.seed``
    for every row) and ``step`` broadcast to every row."""
    seed = np.full(rows, params.seed, np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    return seed, np.broadcast_to(np.asarray(step, np.uint32), (rows,))


def sample(logits: jax.Array, params: SamplingParams, step: int | Sequence[int],
           seeds: Sequence[int] | None = None) -> jax.Array:
    """Next token of every row.

    Args:
      logits: (B, V) float32.
      params: sampling configuration.
      step: index of the token being generated (0 for the first), mixed into the PRNG key;
        one for all rows or (B,) one per row (rows that joined a running batch at different
        iterations are at different tokens).
      seeds: (B,) seed of each row (default: ``params.seed`` for every row).
    Returns:
      (B,) int32 token ids, on the logits' device.
    """
    rows, steps = row_arrays(params, step, seeds, logits.shape[0])
    return _choose(logits, Sampler.of(params), rows, steps, np.float32(params.temperature),
                   np.float32(params.top_p))
