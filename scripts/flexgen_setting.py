"""FlexGen's setting, simulated: OPT-30B and OPT-175B on the T4 preset (16 GB GPU, 208 GB host,
NVMe), prompt 512, generation 32, each under FlexGen's published policy and under hx's CP-SAT
plan with the same memory and block; FlexGen's compressed rows with why they are not priced.

Usage: python scripts/flexgen_setting.py [--json OUT.json] [--time-limit 5]

Takes 1.5-3.5 minutes on the 2-core development VM (3 min 36 s beside other work, 2026-11-24):
two settings, each planned under FlexGen's policy and by CP-SAT and simulated (CP-SAT is most of
it). Prints only the table (a spinner on a terminal's stderr
meanwhile); ``--json`` writes the rows.

FlexGen's policies (Sheng et al. 2023 §6.1, FMInference/FlexiGen benchmark/flexgen/
bench_suite.py), each weight tensor homed as FlexGen's ``init_weight_list`` homes it
(``split_homes``: per sub-layer -- attention, MLP, ``--sep-layer`` being FlexGen's default --
by the midpoint of the tensor's cumulative bytes, disk first, then CPU, then GPU):

* OPT-30B: ``--percent 20 80 0 100 0 100 --cpu`` -- of each attention sub-layer the last 20 %
  on the GPU (OUT resident; Q, K, V from CPU memory), the MLP from CPU memory (fc1 and fc2
  both below 80 %); KV cache and activations on the CPU, attention on the CPU, GPU batch
  48 x 3 micro-batches. Published: 7.32 tokens/s.
* OPT-175B: ``--percent 0 50 0 0 0 100 --cpu --pin-weight 0`` -- Q, K and MLP1 (fc1) on disk,
  V, OUT and MLP2 in CPU memory (exactly half of each layer's bytes on disk); the KV cache on
  disk (256 sequences of 544 tokens hold ~650 GB of KV, past the host's 208 GB), activations
  on the CPU, attention on the CPU, 32 x 8. Published: 0.69 tokens/s.

FlexGen's rows are run as FlexGen's benchmark ran them (flexgen/flex_opt.py,
``generation_loop_debug_multi_batch``: ``--debug fewer_batch``, which every bench_suite case of
these rows passes), replayed by the simulator's event engine (``run_tasks``) with its op and
copy prices on the T4 preset (``flexgen_pass``), not through hx's Schedule -- FlexGen's loop is
not hx's executor:

* layers are FlexGen's 2L + 2 (input embedding, per decoder layer SelfAttention and MLP,
  output embedding), and each (layer, GPU batch) iteration ends in ``sync()`` (the CUDA
  streams and the disk copy queue drained): the next layer's weights, issued at GPU batch 0,
  overlap that batch only;
* each GPU batch's hidden state goes to its home in CPU memory after every layer and comes
  back before the next, on the default CUDA stream, ahead of the compute;
* prefill takes each GPU batch's whole 512-token prompt in one pass and attends on the GPU
  (``mha``), storing the new K, V in the cache's home through the copy threads; decode
  attends on the CPU (``--cpu``, ``mha_gen``) over the 512 cached slots of token 1;
* decode is timed as the benchmark times it: layers 10-19 of token 1, their mean taken for all
  2L + 2 layers of each of the 31 decode steps (``flexgen_run``); throughput = generated
  tokens / (prefill + decode), FlexGen's ``total_throughput``.

FlexGen's placement is also built as an hx plan (``flexgen_plan``) to check that it fits the
T4's memory.

FlexGen's compressed rows (4-bit group-wise weights and/or KV cache, group 64) are listed with
their published figures and no simulated ones: both attend on the GPU over a compressed cache
homed in CPU memory and copied over every decode step, which the replay does not model
(``COMPRESSED`` says what each lacks).

Both sides run in float16 and are priced with the same profile and op prices; the published
figures are FlexGen's own measurements on a real T4 (README table; docs/hardware-sources.md,
"FlexGen's T4 setting (issue 26)").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.memory import PROXY, check_fits
from hx.models.spec import EMBED, HEAD, SCORE, preset
from hx.models.tensors import kv_bytes
from hx.plan import DISK, RESIDENT, STREAMED, WEIGHTED_OPS
from hx.planner.grid import Scenario, plan_on, simulate_run
from hx.planner.hardware import hardware_profile, memory_sizing
from hx.planner.patterns import Pattern, layer_plan
from hx.planner.simulator import Task, op_seconds, run_tasks
from hx.schedule import D2H, DISK_READ, H2D, SYNC
from hx.workload import MIN_CHUNK

# (model, FlexGen's policy: weights % on GPU, % on CPU, KV home; block; published tokens/s)
SETTINGS = (("opt-30b", ("flexgen:20:80", 20, 80, HOST), Scenario("48x3", 48, 512, 32, 3), 7.32),
            ("opt-175b", ("flexgen:0:50:kv-disk", 0, 50, DISK), Scenario("32x8", 32, 512, 32, 8),
             0.69))
# FlexGen's sub-layers (``--sep-layer``, its default): SelfAttention and MLP, each split on its own
SUBLAYERS = (("Q", "K", "V", "OUT"), ("MLP1", "MLP2"))
# layers of token 1 FlexGen's ``--debug fewer_batch`` runs (``execute_num_batches``); it times
# those from the 11th on (``costs[10:]``)
TIMED_LAYERS = 20
# FlexGen's compressed rows (bench_suite.py ``*_1x1_comp``, seq_len 512; README table): model,
# policy, block, published tokens/s, and what hx lacks to price them
COMPRESSED = (
    ("opt-30b", "flexgen-c:0:100 (KV 4-bit)", "64x8", 8.38,
     "KV cache 4-bit (group 64) in CPU memory, its prefix copied to the GPU every decode step "
     "and attended there (no --cpu; load_cache path 0): hx holds a 4-bit KV cache "
     "(ModelSpec.kv_format) but flexgen_pass has no GPU-attended CPU cache, nor a price for "
     "decompressing the cache on the GPU"),
    ("opt-175b", "flexgen-c:0:100 (w+KV 4-bit)", "48x3", 1.12,
     "weights int4 in CPU memory (hx holds them), KV cache 4-bit in CPU memory copied to the "
     "GPU and attended there (no --cpu): flexgen_pass has no GPU-attended CPU cache, nor a "
     "price for decompressing the cache on the GPU"),
)


def split_homes(spec, ops: tuple[str, ...], gpu_percent: float, cpu_percent: float
                ) -> dict[str, str]:
    """The homes of one FlexGen layer's tensors ``ops`` as ``init_weight_list``
    (flexgen/flex_opt.py) homes them: a tensor goes to disk, CPU or GPU by where the midpoint
    of its cumulative size falls among the cumulative percentages in the order disk, CPU, GPU
    (``get_choice``). An op here is one tensor (its bias and norms ride with it)."""
    disk = 100 - gpu_percent - cpu_percent
    sizes = [spec.op_weight_bytes(op) for op in ops]
    homes, done = {}, 0
    for op, size in zip(ops, sizes):
        middle = 100 * (done + size / 2) / sum(sizes)
        homes[op] = DISK if middle < disk else STREAMED if middle < disk + cpu_percent \
            else RESIDENT
        done += size
    return homes


def flexgen_homes(spec, gpu_percent: float, cpu_percent: float) -> tuple[str, ...]:
    """Each weighted op's home (``WEIGHTED_OPS`` order), split per FlexGen sub-layer
    (``SUBLAYERS``: attention, MLP; ``split_homes``)."""
    home = {}
    for ops in SUBLAYERS:
        home.update(split_homes(spec, ops, gpu_percent, cpu_percent))
    return tuple(home[op] for op in WEIGHTED_OPS)


def flexgen_plan(spec, policy, profile, workload):
    """FlexGen's placement as an hx plan, to check that it fits the T4 (``flexgen_run``
    prices FlexGen's loop, not this plan): ``flexgen_homes`` for every layer, the KV cache at
    ``policy``'s home with attention beside it, HEAD streamed (FlexGen's output embedding
    follows the same split), EMBED on the host; prefill in one chunk of the whole prompt, as
    FlexGen's (the placement is checked against the T4's budgets at hx's smallest chunk: hx's
    executor would need smaller chunks than FlexGen's, whose run did fit).

    Raises:
      HxError: it does not fit.
    """
    name, gpu, cpu, kv = policy
    pattern = Pattern(kv, flexgen_homes(spec, gpu, cpu))
    plan = layer_plan(spec, [pattern] * spec.n_layers, RESIDENT if gpu == 100 else STREAMED,
                      name)
    devices = discover(accelerator_memory=profile.accelerator_memory,
                       host_memory=profile.host_memory)
    with memory_sizing("t4"):
        check_fits(plan.with_prefill_chunk(MIN_CHUNK), spec, devices, workload, sizing=PROXY)
    return plan.with_prefill_chunk(None)


ATTENTION = "attention"  # FlexGen's SelfAttention layer; the others compute no attention
COPY_THREADS = "copy threads"  # TorchDisk's copy threads' host-side copies
# FlexGen's weight copies run on their own CUDA stream (``load_weight_stream``; the copy
# threads' relay copies on theirs), the hidden states' and attention's on the default stream
# with the compute: in the simulator each is its own in-order queue. How the streams share
# the PCIe link is not modelled: the default stream's copies beside a weight copy are < 1 MB in
# decode, and in prefill (352-403 MB) at most one per layer overlaps one.
WEIGHT_STREAM = "H2D weights"


@dataclass(frozen=True)
class FlexGenLayer:
    """One of FlexGen's layers (``OptLM.layers`` with ``--sep-layer``, its default): the input
    embedding, per decoder layer its SelfAttention and MLP, the output embedding.

    Attributes:
      kind: ``attention`` for a SelfAttention layer, else its first op.
      ops: the hx ops it computes (SCORE included for attention).
      cpu_bytes / disk_bytes: bytes of its weights homed in CPU memory / on disk (copied to the
        GPU every time it is loaded; GPU-homed ones stay).
      cpu_tensors: how many weight tensors it copies from CPU memory (one copy each).
      kv: its KV cache's home (attention layers), else None.
    """

    kind: str
    ops: tuple[str, ...]
    cpu_bytes: int
    disk_bytes: int
    cpu_tensors: int
    kv: str | None


def flexgen_layers(spec, policy) -> list[FlexGenLayer]:
    """FlexGen's 2L + 2 layers under ``policy`` (a ``SETTINGS`` policy), each layer's weights
    split by ``split_homes`` (the embeddings as one tensor each)."""
    _, gpu, cpu, kv = policy
    groups = [(EMBED,)] + [*SUBLAYERS] * spec.n_layers + [(HEAD,)]
    layers = []
    for ops in groups:
        homes = split_homes(spec, ops, gpu, cpu)
        cpu_ops = [op for op in ops if homes[op] == STREAMED]
        attention = ops == SUBLAYERS[0]
        layers.append(FlexGenLayer(
            ATTENTION if attention else ops[0],
            ops[:3] + (SCORE,) + ops[3:] if attention else ops,
            sum(spec.op_weight_bytes(op) for op in cpu_ops),
            sum(spec.op_weight_bytes(op) for op in ops if homes[op] == DISK),
            len(cpu_ops), kv if attention else None))
    return layers


@dataclass
class FlexGenPass:
    """FlexGen's generation loop over its layers for one token, simulated.

    Attributes:
      tasks: the replayed tasks (``planner.simulator.Task``), in issue order.
      layer_seconds: each layer's time, its first iteration's start to its last sync's end
        (what ``timers("decoding_gpu_batch")`` measures of a layer).
      seconds: the pass's makespan.
    """

    tasks: list[Task]
    layer_seconds: list[float]
    seconds: float


def prefill_attention_seconds(spec, profile, batch: int, tokens: int) -> float:
    """Seconds of FlexGen's prefill attention on the GPU (``TorchDevice.mha``,
    flexgen/pytorch_backend.py) over ``tokens`` prompt tokens of ``batch`` rows: its two
    ``bmm``s (2·2·B·T²·D FLOPs) at the 16-bit matmul rate at T rows, plus the traffic of its
    (B·H, T, T) score matrix of W = 2·B·H·T² bytes at the GPU's memory bandwidth: written by
    the first ``bmm``, read and written by ``torch.where`` (the mask) and by ``softmax``, read
    by the second ``bmm`` -- 6·W. (hx's simulator prices an accelerator SCORE at hx's own
    kernel's measured bytes/s; FlexGen's kernel is this one.)"""
    rates = profile.device(ACCELERATOR)
    flops = 4.0 * batch * tokens * tokens * spec.n_heads * spec.head_dim
    scores = 2 * batch * spec.n_heads * tokens * tokens
    return (rates.matmul_seconds(flops, tokens, spec.dtype)
            + 6 * scores / rates.memory_bandwidth)


class _Loop:
    """The tasks FlexGen's loop issues, in its order; every task of an iteration follows the
    previous iteration's ``sync()`` and the next ``sync()`` waits for all of them."""

    def __init__(self, spec, profile, batch: int, tokens: int, cache_slots: int, context: int):
        self.spec, self.profile = spec, profile
        self.B, self.T, self.S, self.context = batch, tokens, cache_slots, context
        self.tasks: list[Task] = []
        self.since: list[int] = []  # issued since the last sync
        self.synced: int | None = None

    def add(self, resource: str, name: str, seconds: float, after=(), nbytes: int = 0) -> int:
        """A task after the last sync and ``after`` (task indices; None entries skipped)."""
        deps = tuple(d for d in (self.synced, *after) if d is not None)
        self.tasks.append(Task(resource, name, seconds, deps, nbytes=nbytes))
        self.since.append(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def move(self, resource: str, name: str, nbytes: int, after=()) -> int:
        """An activation or cache copy over the link (as the simulator prices a ``move``)."""
        p = self.profile
        bandwidth = p.h2d_bandwidth if resource == H2D else p.d2h_bandwidth
        return self.add(resource, name, p.transfer_latency + nbytes / bandwidth, after, nbytes)

    def disk(self, name: str, nbytes: int, write: bool = False, after=()) -> int:
        """A read (or write) of ``nbytes`` on the disk at the profile's bandwidth.

        Raises:
          HxError: the profile has no disk tier.
        """
        p = self.profile
        bandwidth = p.disk_write_bandwidth if write else p.disk_read_bandwidth
        if not bandwidth:
            raise HxError(f"FlexGen's policy keeps data on disk, but {p.name!r} has no disk "
                          "tier")
        return self.add(DISK_READ, name, nbytes / bandwidth, after, nbytes)

    def compute(self, device: str, name: str, ops: tuple[str, ...], after=()) -> int:
        """``ops`` on ``device`` at B rows, T new tokens, plus the device's launch overhead
        (SCORE: on the host over ``context`` cached slots; on the GPU, in prefill, FlexGen's
        ``mha``: ``prefill_attention_seconds``)."""
        seconds = self.profile.device(device).launch_seconds(self.B)
        for op in ops:
            if op == SCORE and device == ACCELERATOR:
                seconds += prefill_attention_seconds(self.spec, self.profile, self.B, self.T)
            else:
                seconds += op_seconds(self.spec, self.profile, device, op, self.B, self.T,
                                      self.S, self.context)
        return self.add(device, name, seconds, after)

    def sync(self) -> int:
        """``sync()``: waits for everything issued since the last one."""
        self.synced = self.add(SYNC, "sync", self.profile.sync_overhead, self.since)
        self.since = []
        return self.synced

    def load_weights(self, layer: FlexGenLayer, name: str) -> None:
        """``load_weight``: CPU-homed tensors copied on the weight stream (one copy each);
        disk-homed ones read by the copy threads, then copied from their pinned relay buffer
        (on the copy threads' own CUDA streams, queued here with the weight stream's)."""
        p = self.profile
        if layer.cpu_bytes:
            self.add(WEIGHT_STREAM, f"weights {name}", layer.cpu_tensors * p.h2d_latency
                     + layer.cpu_bytes / p.h2d_bandwidth, nbytes=layer.cpu_bytes)
        if layer.disk_bytes:
            read = self.disk(f"read weights {name}", layer.disk_bytes)
            self.add(WEIGHT_STREAM, f"weights {name} (from disk)",
                     layer.disk_bytes / p.h2d_bandwidth, [read], layer.disk_bytes)


def flexgen_pass(spec, layers: list[FlexGenLayer], profile, phase: str, batch: int,
                 micro_batches: int, prompt: int, cache_slots: int,
                 count: int | None = None) -> FlexGenPass:
    """FlexGen's ``generation_loop_debug_multi_batch`` (flexgen/flex_opt.py) over ``count``
    of ``layers`` (default all) for token 0 (``prefill``: the whole prompt per GPU batch) or
    token 1 (``decode``: ``prompt`` cached slots read), with ``micro_batches`` GPU batches of
    ``batch`` rows. Per layer j and GPU batch k, in its order:

    * ``load_weight(i, j+1, k)``: at k = 0 only, layer j+1's CPU- and disk-homed weights
      (``_Loop.load_weights``);
    * ``load_cache(i, j, k+1)`` (decode): the next GPU batch's cache -- on disk: read by the
      copy threads; in CPU memory: cast to float32 on the main thread, priced with the host
      SCORE (the preset's host attention rate stands for FlexGen's copy + ``bmm`` kernel);
    * ``store_hidden(i, j, k-1)`` and ``load_hidden(i, j, k+1)``: the previous GPU batch's
      output to its home in CPU memory (``--percent .. 0 100``) and the next one's input back,
      both on the default CUDA stream, so batch k's compute waits for them;
    * ``compute_layer(i, j, k)`` on the GPU; a decode attention layer with ``--cpu``
      (``mha_gen``) runs Q, K, V on the GPU, copies q (float32) and the new k, v down,
      attends on the CPU, copies the result (float32) up and runs OUT on the GPU; prefill
      attention (``mha``) runs all on the GPU;
    * ``store_cache(i, j, k-1)``: the previous GPU batch's new K, V to the cache's home --
      prefill: the copy threads' pinned relay (D2H) then a host copy into the unpinned cache,
      or a disk write; decode: the new token's, directly (or written to disk);
    * ``sync()``: waits for the GPU's streams and the copy threads' queue.

    Copies are priced as the simulator prices them (latency + bytes / bandwidth), ops by
    ``op_seconds``; FlexGen's own costs the preset has no figure for (``pin_memory()`` of
    ``--pin-weight 0`` weights on the main thread, its Python dispatch) are not modelled.
    """
    decode = phase == "decode"
    tokens = 1 if decode else prompt
    loop = _Loop(spec, profile, batch, tokens, cache_slots, prompt)
    hidden = batch * tokens * spec.d_model * spec.dtype_bytes
    ids = 4 * batch * tokens  # int32 token ids
    kv_new = kv_bytes(spec, batch, tokens)
    n, N = len(layers), micro_batches
    ends = []
    for j in range(n if count is None else count):
        layer = layers[j]
        for k in range(N):
            name = f"{layer.kind} {j} [mb {k}]"
            if k == 0:
                loop.load_weights(layers[(j + 1) % n], str((j + 1) % n))
            to_load = (j, k + 1) if k + 1 < N else (j + 1, 0)
            if decode and to_load[0] < n and layers[to_load[0]].kv == DISK:
                loop.disk(f"read KV {to_load}", kv_bytes(spec, batch, prompt))
            # store_hidden, then load_hidden, then the compute: one CUDA stream, in this order
            previous = (j - 1 if k == 0 else j, (k - 1) % N)  # GPU batch k - 1
            stored = loop.move(D2H, f"store hidden {previous}",
                               4 * batch if layers[previous[0]].kind == HEAD else hidden) \
                if j or k else None
            before = [loop.move(H2D, f"load hidden {to_load}",
                                hidden if to_load[0] % n else ids, [stored])]
            if decode and layer.kind == ATTENTION:
                qkv = loop.compute(ACCELERATOR, f"QKV {name}", layer.ops[:3], before)
                down = loop.move(D2H, f"q k v {name}", batch * spec.d_model * (4 + 2 * 2),
                                 [qkv])
                score = loop.compute(HOST, f"SCORE {name}", (SCORE,), [down])
                up = loop.move(H2D, f"attention {name}", batch * spec.d_model * 4, [score])
                loop.compute(ACCELERATOR, f"OUT {name}", layer.ops[4:], [up])
            else:
                loop.compute(ACCELERATOR, name, layer.ops, before)
            owner = layers[previous[0]]
            if (j or k) and owner.kind == ATTENTION:  # store_cache of GPU batch k - 1
                down = loop.move(D2H, f"store KV {previous}", kv_new)
                if owner.kv == DISK:
                    loop.disk(f"write KV {previous}", kv_new, write=True, after=[down])
                elif not decode:  # the relay buffer into the unpinned cache
                    loop.add(COPY_THREADS, f"KV to cache {previous}",
                             2 * kv_new / profile.host.memory_bandwidth, [down])
            loop.sync()
        ends.append(loop.synced)
    seconds = run_tasks(loop.tasks, profile.contention, profile.compute_contention)
    times = [0.0] + [loop.tasks[i].end for i in ends]
    return FlexGenPass(loop.tasks, [b - a for a, b in zip(times, times[1:])], seconds)


def flexgen_run(spec, policy, profile, scenario: Scenario) -> dict:
    """FlexGen's run of ``scenario`` under ``policy`` as its benchmark (``--debug
    fewer_batch``) times and counts it: the whole prefill (token 0) simulated; decode timed on
    layers 10-19 of token 1 (``costs[10:]`` of its first 20 layers), their mean taken for
    each of the 2L + 2 layers of each of the G - 1 decode steps; throughput = B·N·G /
    (prefill + decode). Returns tokens_per_s, ttft_s (the prefill), tpot_s (the counted decode
    step) and utilisation (each resource's busy share of token 1's simulated layers)."""
    layers = flexgen_layers(spec, policy)
    B, N, P = scenario.batch, scenario.micro_batches, scenario.prompt_tokens
    slots = P + scenario.new_tokens - 1  # FlexGen's cache: prompt_len + gen_len - 1 slots
    prefill = flexgen_pass(spec, layers, profile, "prefill", B, N, P, slots).seconds
    timed = flexgen_pass(spec, layers, profile, "decode", B, N, P, slots, TIMED_LAYERS)
    step = len(layers) * sum(timed.layer_seconds[10:]) / len(timed.layer_seconds[10:])
    busy: dict[str, float] = {}
    for t in timed.tasks:
        busy[t.resource] = busy.get(t.resource, 0.0) + t.end - t.start
    generated = B * N * scenario.new_tokens
    return {"tokens_per_s": generated / (prefill + (scenario.new_tokens - 1) * step),
            "ttft_s": prefill, "tpot_s": step,
            "utilisation": {r: b / timed.seconds for r, b in busy.items()}}


def settings():
    """(spec in float16, policy, scenario, published tokens/s or None) of every priced row:
    each setting under FlexGen's policy, then under CP-SAT."""
    for model, flexgen, scenario, published in SETTINGS:
        spec = preset(model).replace(dtype="float16")
        yield spec, flexgen, scenario, published
        yield spec, "cpsat", scenario, None


def setting_row(spec, policy: str, scenario: Scenario, published: float | None, profile,
                time_limit: float, status) -> dict:
    """One row: the policy's plan on the T4 preset and its simulated run (or why none fits).
    ``policy``: FlexGen's (a ``SETTINGS`` tuple), run and counted as FlexGen's benchmark runs
    and counts it (``flexgen_run``), or a ``policies.build`` name, run as hx runs it
    (``simulate_run``: hx's schedule, mid-generation decode context). ``status`` is told what
    is being planned."""
    name = policy[0] if isinstance(policy, tuple) else policy
    status(f"planning and simulating {spec.name} under {name}")
    row = {"model": spec.name, "policy": name, "block": scenario.name,
           "published_tok_s": published}
    try:
        if isinstance(policy, tuple):
            plan = flexgen_plan(spec, policy, profile, scenario.workload())
            row.update(flexgen_run(spec, policy, profile, scenario))
        else:
            plan, _ = plan_on(policy, spec, "t4", profile, profile.accelerator_memory,
                              scenario.workload(), time_limit)
            run = simulate_run(plan, spec, profile, scenario)
            row.update(tokens_per_s=run.tokens_per_s, ttft_s=run.ttft_s, tpot_s=run.tpot_s,
                       utilisation=run.utilisation)
        row["prefill_chunk"] = plan.prefill_chunk
    except HxError as e:
        row["error"] = str(e).splitlines()[0]
    return row


def compressed_rows() -> list[dict]:
    """FlexGen's compressed rows: published figures, no simulated ones (``COMPRESSED``)."""
    return [{"model": preset(model).name, "policy": policy, "block": block,
             "published_tok_s": published, "error": f"not priced: {why}"}
            for model, policy, block, published, why in COMPRESSED]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve")
    args = parser.parse_args()
    profile = hardware_profile("t4")
    with Console(stderr=True).status("planning") as status:
        rows = [setting_row(spec, policy, scenario, published, profile, args.time_limit,
                            status.update)
                for spec, policy, scenario, published in settings()]
    rows += compressed_rows()
    table = Table(title=f"FlexGen's setting on {profile.name}, prompt 512, generation 32 "
                        "(simulated)",
                  caption="flexgen rows: FlexGen's generation loop (a sync after every layer "
                          "and GPU batch) replayed, timed and counted as its benchmark "
                          "(--debug fewer_batch); cpsat rows: hx's own plan, run and counted "
                          "as hx's")
    for col in ("model", "policy", "block", "tokens/s", "TTFT s", "TPOT s", "host busy",
                "published tokens/s", "vs published"):
        table.add_column(col, justify="right")
    notes = []
    for r in rows:
        published, simulated = r["published_tok_s"], r.get("tokens_per_s")
        error = f"{simulated / published - 1:+.0%}" if simulated and published else ""
        if "error" in r:
            notes.append(f"[{len(notes) + 1}] {r['model']} {r['policy']}: {r['error']}")
        table.add_row(r["model"], r["policy"], r["block"],
                      f"{simulated:.2f}" if simulated else f"- [{len(notes)}]",
                      f"{r['ttft_s']:.0f}" if "ttft_s" in r else "",
                      f"{r['tpot_s']:.1f}" if "tpot_s" in r else "",
                      f"{r['utilisation'].get('host', 0):.0%}" if "utilisation" in r else "",
                      str(published or ""), error)
    print_table(table)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
