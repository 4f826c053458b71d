"""Several decode steps in one launch, sampled where they run.

A decode step launched from Python pays the executor's instructions, a call with every weight
as an argument, a second launch for the sampler and a wait for the token before the next step
can start: about 2 ms a token on the 2-core VM (SmolLM2 Q4_1 all-host: 11.0 ms a step through
``Executor.run_block`` against 9.3 ms for the bare executable), while llama.cpp's whole step
takes 6.5-7.7 ms. Where a plan's decode is one segment whose weights and KV caches stay where
it runs (``Executor.loops``: every op, weight and cache on the host), ``loop_function`` runs
up to ``steps`` decode steps as one XLA program: a ``lax.while_loop`` whose body is the
segment's own function followed by ``hx.sampling.choose``, each step's token fed to the next,
stopping early once every row has drawn a stop token or reached its limit. Each step computes
what the step-by-step path computes (the same segment function and sampler, each row's token
keyed by (its seed, its token index)), so tokens are the same; the runner hands a launch's
tokens to the scheduler one step at a time (``hx.continuous.BlockRunner``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hx.models.layers import Step
from hx.sampling import Sampler, choose

LOOP_STEPS = 16  # decode steps a launch runs at most (Engine.loop_steps)


def loop_function(step_function, steps: int, sampler: Sampler):
    """A jitted ``(params, tokens, caches, step, n, drawn, seeds, remaining, stop,
    temperature, top_p) -> (tokens (B, steps) int32, steps run () int32, caches)`` running up
    to ``n`` <= ``steps`` decode steps of ``step_function`` (a ``hx.programs.segment_function``
    whose only read is ``tokens`` and whose writes include ``logits``), caches donated.

    Args (of the returned function):
      params, caches: the segment's, as its own launch takes them.
      tokens: (B, 1) int32, each row's last token.
      step: the first step's ``Step``; step i adds i to its positions and write index.
      n: () int32, steps to run at most (<= ``steps``; the cache has room for them).
      drawn: (B,) uint32 tokens each row has drawn (its PRNG step).
      seeds: (B,) uint32 each row's sampling seed.
      remaining: (B,) int32 tokens each row may still draw (0: the row is done).
      stop: (V,) bool, the stop tokens.
      temperature, top_p: () float32 (``hx.sampling.choose``'s).
    The loop ends after ``n`` steps or once every row is done (a stop token, or its
    ``remaining`` drawn); a done row's later tokens are computed and are not its own.
    """

    def run(params, tokens, caches, step, n, drawn, seeds, remaining, stop, temperature,
            top_p):
        B = tokens.shape[0]

        def more(carry):
            i, _, _, done, _ = carry
            return (i < n) & ~jnp.all(done)

        def one(carry):
            i, last, caches, done, out = carry
            at = Step(step.positions + i, step.write_index + i, step.kv_start)
            acts, caches = step_function(params, {"tokens": last}, caches, at)
            new = choose(acts["logits"], sampler, seeds, drawn + i.astype(jnp.uint32),
                         temperature, top_p)
            out = jax.lax.dynamic_update_slice(out, new[:, None], (0, i))
            done = done | stop[new] | (i + 1 >= remaining)
            return i + 1, new[:, None], caches, done, out

        start = (jnp.int32(0), tokens, caches, remaining <= 0,
                 jnp.zeros((B, steps), jnp.int32))
        ran, _, caches, _, out = jax.lax.while_loop(more, one, start)
        return out, ran, caches

    return jax.jit(run, donate_argnums=(2,))
