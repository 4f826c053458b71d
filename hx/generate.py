"""Generation: prefill + decode with a KV cache over a batch of prompts (DESIGN §7).

Prompts of different lengths are left-padded to a common length T (rounded up to a multiple of
``PREFILL_BUCKET`` so few prefill shapes get compiled); each row's padding is masked out of
attention through ``Step.kv_start`` and its RoPE positions start at 0 at its first real token.
Decode then writes every row's new token into the same cache slot, so one compiled decode step
serves the whole batch. ``Engine.generate_ids`` runs such a static batch as the ``refill=False``
policy of ``hx.scheduler`` (every prompt joins at once; a row that ends idles until the last
ends), carried out by ``hx.continuous.BlockRunner`` as throughput mode is.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from hx.continuous import BlockRunner
from hx.decode_loop import LOOP_STEPS
from hx.devices import ACCELERATOR, HOST, Devices, discover, release_free_heap
from hx.errors import HxError
from hx.executor import Executor
from hx.models.layers import Cache
from hx.models.loader import Model
from hx.models.spec import ModelSpec
from hx.models.tensors import step_limit
from hx.models.tokenizer import Tokenizer
from hx.pipeline import Pipeline
from hx.plan import ExecutionPlan, Stint, plan_at, recompute_consistent
from hx.prefill import check_prompts, left_pad, run_prefill
from hx.sampling import Sampler, SamplingParams, sample
from hx.scheduler import BlockConfig, Completion
from hx.segments import split_segments
from hx.streamed_kv import keep_h
from hx.timeline import H2D, Timeline
from hx.workload import Workload, new_tokens, padded_length, prefill_chunks, step_chunk


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of a prompt, rendered with the model's chat template when ``chat``."""
    return tokenizer.encode(tokenizer.render_chat(prompt) if chat else prompt)


def default_workload(spec: ModelSpec) -> Workload:
    """What ``Engine`` plans for when given neither a plan nor a workload: one prompt of up
    to 512 tokens generating up to 512 (``Workload.for_prompts``: 1,024 KV-cache slots), both
    at most half the model's context."""
    tokens = min(512, spec.context_length // 2)
    return Workload.for_prompts(1, tokens, tokens, spec)


def default_plan(spec: ModelSpec, devices: Devices | Sequence[Devices],
                 workload: Workload) -> ExecutionPlan:
    """The plan ``hx generate`` makes when given no plan or policy: ``auto`` for
    ``workload`` on ``devices`` (over pipeline stages, per stage: ``hx.pipeline.place``),
    priced on the saved hardware profile, or on a quick one measured now where ``auto``
    needs one (``hx.measure.profiler.for_policy``).

    Raises:
      HxError: nothing fits the budgets (``policies.build``, naming the bytes over).
    """
    from hx.measure.profiler import for_policy
    from hx.pipeline import place, plan_targets
    from hx.planner import policies

    first = devices if isinstance(devices, Devices) else devices[0]
    profile = for_policy("auto", None, first, plans=[
        (part, on, workload) for part, on in plan_targets(spec, devices)])
    return place(spec, devices,
                 lambda part, on: policies.build("auto", part, on, workload, profile=profile))


class Engine:
    """Generates text with a model under an execution plan.

    Args:
      model: a loaded model (``hx.load``).
      plan: op placement and memory homes. When omitted (and no ``stints``), the plan
        ``hx generate`` makes by default (``default_plan``): policy ``auto`` for ``workload``
        on ``devices`` -- all-accelerator where it fits the budgets, else CP-SAT's plan or
        stream-all priced on the hardware profile ``hx profile`` saved, without one the
        largest layer split that fits, and where that overflows the host memory budget a
        CP-SAT plan on a quick profile measured now (<= 20 s, kept for the next time:
        ``hx.measure.profiler.for_policy``), which can keep weights on disk.
      devices: accelerator (with its memory budget) and host; discovered when omitted. A
        list of them, one per pipeline stage (``hx.pipeline.stage_devices``), runs the model's
        layers in that many stages (``hx.pipeline.Pipeline``), each with its own budget.
      workload: the shapes the default plan is made to fit (``hx.workload.Workload``);
        default ``default_workload``'s: one prompt of up to 512 tokens and 512 new ones
        (1,024 KV-cache slots), each at most half the model's context. A call beyond it runs where its
        plan still fits and is refused otherwise (``check``); pass the workload of the calls
        you make (or a plan) to plan for them. Ignored when a plan or stints are given.
      timeline: records every segment and transfer when given (``--trace``).
      spill_dir: where disk-homed weights that are no file hx can map are written once
        (``hx.disk``; None refuses such plans).
      stints: plans that follow the context as it grows (``hx.planner.replan``): the first
        prefills and decodes from step 0, each other from its ``start``; the engine switches
        between decode steps (``follow``). ``plan`` is then the first stint's (or omitted).
    Attributes:
      model: ``model`` without its weight tree (``params`` is empty): once placed, the
        weights live where the plan put them, and the caller's ``Model`` is the only other
        reference to the loader's host arrays.
      on_status: when set, called with a short line as a batch moves through compiling,
        each prefill chunk and decoding (a progress display: compiling and a long prompt's
        prefill can take minutes).
      plan_log: (first decode step, plan name) of each plan the last run ran under.
      loop_steps: decode steps a launch of a static batch runs at most where the plan's
        decode loops (``Executor.loops``: one host segment holding every weight and KV
        cache); default ``hx.decode_loop.LOOP_STEPS``, 1 runs them one by one. The tokens
        are the same either way.
    Raises:
      HxError: ``plan`` is not the first stint's; a stint recomputes where one before kept
        no ``h`` (``hx.plan.recompute_consistent``); no default plan fits the budgets
        (naming the bytes over); the executor's.
    """

    def __init__(self, model: Model, plan: ExecutionPlan | None = None,
                 devices: Devices | Sequence[Devices] | None = None,
                 timeline: Timeline | None = None, spill_dir: str | None = None,
                 stints: Sequence[Stint] = (), workload: Workload | None = None):
        if stints and plan is not None and plan != stints[0].plan:
            raise HxError("plan and stints disagree: the first stint's plan is the one that "
                          "prefills; pass one of them")
        if stints and list(stints) != recompute_consistent(stints):
            raise HxError("a stint recomputes K, V of a layer whose cache a stint before it "
                          "kept no activations h for; hx.plan.recompute_consistent(stints) "
                          "sets those r to 0")
        if devices is None:
            devices = discover()
        self.plan = (stints[0].plan if stints else plan) or default_plan(
            model.spec, devices, workload or default_workload(model.spec))
        self.stints = tuple(stints) or (Stint(0, self.plan),)
        self.plan_log: list[tuple[int, str]] = [(0, self.plan.name)]
        self._spill_dir = spill_dir
        if isinstance(devices, (list, tuple)):  # pipeline stages, one ``Devices`` each
            if len(self.stints) > 1:
                raise HxError("plans that follow the context (stints) over pipeline stages: "
                              "not yet; run one plan, or one stage")
            self.executor = Pipeline(model.spec, model.params, self.plan, devices, timeline,
                                     spill_dir)
        else:
            self.executor = Executor(model.spec, model.params, self.plan, devices, timeline,
                                     spill_dir)
        # the executor holds the weights where the plan put them; keep no second reference to
        # the loader's host copies, so dropping the ``Model`` frees them (one copy per weight)
        self.model = dataclasses.replace(model, params={})
        self._compiled: set[tuple] = set()  # shapes and sampler kinds already compiled
        self.on_status: Callable[[str], None] | None = None
        self.loop_steps = LOOP_STEPS

    def status(self, line: str) -> None:
        """Pass a progress line to ``on_status`` (when set)."""
        if self.on_status is not None:
            self.on_status(line)

    @property
    def accountant(self):
        """The executor's accelerator memory accountant."""
        return self.executor.accountant

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt, rendered with the model's chat template when ``chat``."""
        return encode_prompt(self.model.tokenizer, prompt, chat)

    def check(self, workload: Workload):
        """Reject the job before it runs if a plan (of any stint) does not fit the memory
        budgets.

        Returns:
          the first stint's ``hx.memory.MemoryEstimate`` (over pipeline stages, a list of
          them, one per stage).
        Raises:
          HxError: naming the plan, the limit and the bytes over.
        """
        return [self.executor.check(stint.plan, workload) for stint in self.stints][0]

    def follow(self, step: int, caches: Sequence[list[Cache]]) -> list[list[Cache]]:
        """Switch to the plan of decode step ``step`` (``stints``) if it is not the one in
        use: caches that leave the accelerator moved out first, a new executor from this
        one's placed weights (``Executor.switched``: weights that leave go before any
        arrives), the caches moved to its KV homes (``Executor.adopt_cache``), a ``re-plan``
        event on the timeline (when there is one). Returns the caches (the same lists when
        nothing changes)."""
        plan = plan_at(self.stints, step)
        if plan == self.plan:
            return list(caches)
        started = time.perf_counter()
        self.executor.release_cache()
        host, old = self.executor.devices[HOST], self.plan.kv
        caches = [[jax.device_put(cache, host)  # caches leaving the accelerator go first
                   if old[layer] == ACCELERATOR != plan.kv[layer] else cache
                   for layer, cache in enumerate(block)] for block in caches]
        self.executor = self.executor.switched(plan, self._spill_dir)
        self.plan = plan
        self.plan_log.append((step, plan.name))
        moved = [self.executor.adopt_cache(c, micro=m) for m, c in enumerate(caches)]
        if self.executor.timeline is not None:  # until the weights and caches are in place
            jax.block_until_ready((moved, self.executor.params_tree()))
            self.executor.timeline.record(H2D, f"re-plan to {plan.name}", (), [],
                                          dispatch=started, decode_step=step)
        return moved

    def generate(self, prompts: Sequence[str], sampling: SamplingParams = SamplingParams(),
                 chat: bool = False, cache_slots: int | None = None) -> list[Completion]:
        """Generate a completion for every prompt, as one batch.

        Raises:
          HxError: an empty prompt, one that does not fit the context, or a plan that does
            not fit the memory budget.
        """
        return self.generate_ids([self.encode(p, chat) for p in prompts], sampling, cache_slots)

    def last_logits(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        """Prefill a batch and return the next-token logits of every prompt.

        Returns:
          (B, V) float32 numpy, one row per prompt (padding does not change a row).
        Raises:
          HxError: an empty prompt, one that does not fit the context, or a plan that does
            not fit the memory budget.
        """
        lengths = self._check(prompts)
        tokens, step = left_pad(prompts, padded_length(int(lengths.max()), self.model.spec),
                                self.model.tokenizer.eos_id or 0)
        B, T = tokens.shape
        self.check(Workload(B, T, T))
        try:
            caches = self.executor.new_cache(B, T)
            logits, _ = run_prefill(self.executor, tokens, step, caches,
                                    self.plan.prefill_chunk)
            return np.asarray(logits)
        finally:
            self.executor.release_cache()

    def _compile(self, workload: Workload, sampling: SamplingParams) -> float:
        """Compile every segment of prefill (each chunk shape) and decode at ``workload``'s
        shapes ahead of time, from shapes alone, and the sampler on zero logits; returns the
        seconds it took (0 when already done). Keeps compilation out of TTFT and decode
        rates."""
        shapes = dataclasses.replace(workload, new_tokens=None)  # G changes no shape
        key = (shapes, Sampler.of(sampling), self.loop_steps)
        if key in self._compiled:
            return 0.0
        self.status(f"compiling batch {workload.batch} x {workload.prompt_tokens} tokens, "
                     f"{workload.cache_slots} KV slots")
        start = time.perf_counter()
        B, S = workload.batch, workload.cache_slots
        for chunk in set(prefill_chunks(workload.prompt_tokens, self.plan.prefill_chunk,
                                        step_limit(self.model.spec))):
            self.executor.compile("prefill", B, chunk, S)
        self.executor.compile("decode", B, 1, S)
        if self.loop_steps > 1 and len(self.stints) == 1 and self.executor.loops(B, S):
            self.executor.loop_executable(B, S, self.loop_steps, Sampler.of(sampling))
        for stint in self.stints[1:]:  # the plans switched to later decode only
            self.executor.programs.prepare([(seg, B, 1, S, keep_h(stint.plan, seg))
                                            for seg in split_segments(stint.plan, "decode")])
        for phase in ("prefill", "decode"):
            device = self.executor.devices[self.plan.phase(phase).head]
            zeros = jax.device_put(np.zeros((B, self.model.spec.vocab_size), np.float32), device)
            sample(zeros, sampling, 0).block_until_ready()
        release_free_heap()
        self._compiled.add(key)
        return time.perf_counter() - start

    def _check(self, prompts: Sequence[Sequence[int]]) -> np.ndarray:
        lengths = np.array([len(p) for p in prompts], dtype=np.int32)
        check_prompts(lengths, self.model.spec)
        return lengths

    def generate_ids(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams = SamplingParams(),
                     cache_slots: int | None = None, seeds: Sequence[int] | None = None,
                     on_finish: Callable[[int, Completion], None] | None = None,
                     max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        """Generate from token ids, as one (static) batch: it runs until its last row ends
        (``hx.scheduler``'s static policy, carried out by ``hx.continuous.BlockRunner``).

        Args:
          prompts: B prompts of token ids (lengths may differ).
          sampling: sampling and stopping rules.
          seeds: B sampling seeds, one per prompt (default: ``sampling.seed`` for all).
          on_finish: called with (row, its ``Completion``) the moment a row ends -- at its
            stop token or its own token limit, while the others go on (a batch run writes
            each result then).
          cache_slots: KV-cache length; by default ``hx.workload.cache_length`` of this batch.
            A batch run passes one value for all its batches so decode compiles once.
          max_new_tokens: B token limits, one per prompt (default: ``sampling``'s for all).
        Raises:
          HxError: an empty prompt, one that does not fit the context, a too-small cache, or a
            plan that does not fit the memory budget.
        """
        self.follow(0, [])  # a run starts under the first stint's plan
        self.plan_log = [(0, self.plan.name)]
        spec = self.model.spec
        lengths = self._check(prompts)
        B, longest = len(prompts), int(lengths.max())
        T = padded_length(longest, spec)
        asked = list(max_new_tokens or [sampling.max_new_tokens] * B)
        max_new = new_tokens(longest, max(asked), spec)  # rows share slots: the longest caps
        workload = Workload.for_prompts(B, longest, max(asked), spec)
        if cache_slots is not None:
            if cache_slots < T + max_new - 1:
                raise HxError(f"KV cache of {cache_slots} slots is too small for a {T}-token "
                              f"prompt and {max_new} new tokens")
            workload = Workload(B, T, cache_slots)
        self.check(workload)
        compile_s = self._compile(workload, sampling)
        config = BlockConfig(B, 1, workload.cache_slots, pad=T,
                             chunk=step_chunk(self.plan.prefill_chunk, step_limit(spec)),
                             refill=False)
        runner = BlockRunner(self, config, sampling, compile_s, on_finish)
        return runner.run(prompts, [min(n, max_new) for n in asked], asked, seeds)
