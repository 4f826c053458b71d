"""FlexGen's setting, simulated: OPT-30B and OPT-175B on the T4 preset (16 GB GPU, 208 GB host,
NVMe), prompt 512, generation 32, each under FlexGen's published policies -- uncompressed and
compressed (4-bit) -- and, uncompressed, under hx's CP-SAT plan with the same memory and block.

Usage: python scripts/flexgen_setting.py [--json OUT.json] [--time-limit 5] [--models opt-175b]

Takes about 4 minutes on the 2-core development VM (3 min 52 s beside other work,
2026-11-27): four FlexGen rows (about a second in all) and two CP-SAT plans (most of it,
OPT-175B's the larger). Prints only the table (a spinner on a terminal's stderr meanwhile);
``--json`` writes the rows; ``--models`` keeps the settings of the models named.

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
T4's memory and, in the uncompressed rows (attention on the host beside the cache, as hx's
host- and disk-KV patterns attend), run as hx runs a plan (``hx_run``): the same simulator,
counting and memory model as the CP-SAT rows -- the figure CP-SAT's plan is compared with.
The replayed figure differs from it in FlexGen's loop and in how the benchmark counts: decode
timed at token 1 (OPT-175B: the 512 cached positions read from disk per layer and GPU batch,
where hx prices the step at mid-generation and reads the 527 written before it -- both read
what is on disk, not the host kernel's 64-slot blocks) and prefill in one pass of the prompt
(hx's memory estimate fits OPT-175B's 32 x 512 tokens in chunks of 256 at most: 14.1 GB of
activations at 512); the replay also writes the new K, V to disk (0.4 % of OPT-175B's run:
0.539 tokens/s without), which hx's schedule does not price yet.

FlexGen's compressed rows (``--compress-cache``, and ``--compress-weight`` for 175B; bench_suite
``*_1x1_comp``) run the same loop with FlexGen's 4-bit group-64 format, which is hx's ``int4``
(``FlexGenPolicy.spec``: ``Format.nbytes`` counts codes plus fp16 scale and min per group, 0.5625
bytes per value, as FlexGen holds them), and without ``--cpu``:

* decode attends on the GPU over the cache copied up the iteration before (``load_cache`` path
  0): the GPU batch's P + 1 cached slots, compressed, pinned by ``pin_memory()`` on the main
  thread (the cache is unpinned) and copied on the cache stream, which shares the PCIe link with
  the weight stream (``LINKS``); the GPU decompresses the whole prefix, attends, and compresses
  the new K, V (``gpu_decode_attention_seconds``, ``decompress_bytes``, ``compress_bytes``:
  FlexGen's kernels' memory traffic, counted from flexgen/compression.py, at the GPU's memory
  bandwidth);
* compressed weights (175B) are copied compressed and decompressed by every GPU batch's
  compute; ``--pin-weight 0`` weights are pinned on the main thread before each copy
  (175B, both rows);
* prefill stores the compressed K, V through the copy threads' relay.

Both sides run in float16 and are priced with the same profile and op prices; the published
figures are FlexGen's own measurements on a real T4 (README table; docs/hardware-sources.md,
"FlexGen's T4 setting (issue 26)").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from hx.cli.console import print_table
from hx.devices import ACCELERATOR, HOST, discover
from hx.errors import HxError
from hx.memory import PROXY, check_fits
from hx.models.formats import DENSE, Format, get_format
from hx.models.spec import EMBED, HEAD, SCORE, ModelSpec, numpy_dtype, preset
from hx.models.tensors import kv_arrays, kv_bytes, kv_format
from hx.plan import DISK, RESIDENT, STREAMED, WEIGHTED_OPS
from hx.planner.cpsat import fit_chunk
from hx.planner.grid import Scenario, simulate_run
from hx.planner.hardware import hardware_profile, memory_sizing
from hx.planner.patterns import Pattern, layer_plan
from hx.planner.policies import plan_on
from hx.planner.simulator import Task, op_seconds, run_tasks
from hx.schedule import D2H, DISK_READ, H2D, SYNC
from hx.workload import MIN_CHUNK

COMPRESSION = "int4"  # FlexGen's 4-bit group-64 asymmetric scheme (models/formats.py)


@dataclass(frozen=True)
class FlexGenPolicy:
    """One bench_suite.py case's flags (flexgen/flex_opt.py argparse).

    Attributes:
      name: the row's policy label.
      gpu / cpu: ``--percent``'s weight shares on the GPU and in CPU memory (the rest on disk).
      kv: the KV cache's home, HOST (``--percent .. 0 100``) or DISK (``0 0``).
      cpu_attention: ``--cpu`` (decode attention on the CPU, load_cache path 1); else the cache
        is copied to the GPU and attended there (path 0).
      pin_weight: ``--pin-weight`` (default true): CPU-homed weight matrices in pinned memory;
        false: pageable, so every copy to the GPU goes through ``pin_memory()`` first.
      compress_weight / compress_cache: ``--compress-weight`` / ``--compress-cache``: weights
        (every 2-D tensor, embeddings included) / the KV cache held in FlexGen's 4-bit
        group-64 format (hx's ``int4``).
    """

    name: str
    gpu: float
    cpu: float
    kv: str
    cpu_attention: bool = True
    pin_weight: bool = True
    compress_weight: bool = False
    compress_cache: bool = False

    def spec(self, model: str) -> ModelSpec:
        """``model`` in float16 with the policy's formats, so that hx's byte counts
        (``op_weight_bytes``, ``kv_bytes``: ``Format.nbytes``) are what FlexGen holds."""
        weights = COMPRESSION if self.compress_weight else DENSE
        return preset(model).replace(dtype="float16", weight_format=weights,
                                     embedding_format=weights,
                                     kv_format=COMPRESSION if self.compress_cache else DENSE)


# (model, FlexGen's policy, block, published tokens/s): bench_suite.py's seq_len-512 cases
# (``suite_30b_1x1``, ``suite_175b_1x1``, ``*_1x1_comp``; README table)
SETTINGS = (
    ("opt-30b", FlexGenPolicy("flexgen:20:80", 20, 80, HOST), Scenario("48x3", 48, 512, 32, 3),
     7.32),
    ("opt-175b", FlexGenPolicy("flexgen:0:50:kv-disk", 0, 50, DISK, pin_weight=False),
     Scenario("32x8", 32, 512, 32, 8), 0.69),
    ("opt-30b", FlexGenPolicy("flexgen-c:0:100 (KV 4-bit)", 0, 100, HOST, cpu_attention=False,
                              compress_cache=True), Scenario("64x8", 64, 512, 32, 8), 8.38),
    ("opt-175b", FlexGenPolicy("flexgen-c:0:100 (w+KV 4-bit)", 0, 100, HOST,
                               cpu_attention=False, pin_weight=False, compress_weight=True,
                               compress_cache=True), Scenario("48x3", 48, 512, 32, 3), 1.12),
)
# FlexGen's sub-layers (``--sep-layer``, its default): SelfAttention and MLP, each split on its own
SUBLAYERS = (("Q", "K", "V", "OUT"), ("MLP1", "MLP2"))
# layers of token 1 FlexGen's ``--debug fewer_batch`` runs (``execute_num_batches``); it times
# those from the 11th on (``costs[10:]``)
TIMED_LAYERS = 20


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


def flexgen_plan(spec, policy: FlexGenPolicy, profile, workload):
    """FlexGen's placement as an hx plan, to check that it fits the T4 (``flexgen_run``
    prices FlexGen's loop, not this plan): ``flexgen_homes`` for every layer, the KV cache at
    ``policy``'s home with attention beside it, HEAD streamed (FlexGen's output embedding
    follows the same split), EMBED on the host; prefill in one chunk of the whole prompt, as
    FlexGen's (the placement is checked against the T4's budgets at hx's smallest chunk: hx's
    executor would need smaller chunks than FlexGen's, whose run did fit). ``spec`` carries the
    policy's formats (``FlexGenPolicy.spec``), so compressed weights and cache are sized held.

    Raises:
      HxError: it does not fit.
    """
    pattern = Pattern(policy.kv, flexgen_homes(spec, policy.gpu, policy.cpu))
    plan = layer_plan(spec, [pattern] * spec.n_layers,
                      RESIDENT if policy.gpu == 100 else STREAMED, policy.name)
    devices = discover(accelerator_memory=profile.accelerator_memory,
                       host_memory=profile.host_memory)
    with memory_sizing("t4"):
        check_fits(plan.with_prefill_chunk(MIN_CHUNK), spec, devices, workload, sizing=PROXY)
    return plan.with_prefill_chunk(None)


ATTENTION = "attention"  # FlexGen's SelfAttention layer; the others compute no attention
COPY_THREADS = "copy threads"  # TorchDisk's copy threads' host-side copies
MAIN_THREAD = "main thread"  # FlexGen's Python loop, where it blocks (``pin_memory()``)
# FlexGen's CUDA streams (flex_opt.py ``OptLM.__init__``): each is an in-order queue in the
# replay. The default stream (hidden states; compute) is ``H2D``/``D2H``; the weights and the
# cache are copied on ``load_weight_stream`` and ``load_cache_stream``. All H2D queues share
# the one PCIe link (``LINKS``: ``run_tasks`` splits its bandwidth among the running ones).
WEIGHT_STREAM = "H2D weights"
CACHE_STREAM = "H2D cache"
LINKS = {H2D: "PCIe H2D", WEIGHT_STREAM: "PCIe H2D", CACHE_STREAM: "PCIe H2D"}


def matrix_elements(spec, ops: tuple[str, ...]) -> int:
    """Elements of ``ops``' weight matrices held compressed (``ModelSpec.matrix_format``):
    what FlexGen decompresses on the GPU every time it computes them."""
    return sum(math.prod(shape) for op in ops for path, shape in spec.op_weight_shapes(op).items()
               if spec.matrix_format(path) != DENSE)


def matrix_bytes(spec, ops: tuple[str, ...]) -> int:
    """Bytes held of ``ops``' 2-D weight tensors (codes and their scale/offset arrays, or dense
    matrices; not biases and norms): the tensors ``--pin-weight 0`` leaves pageable
    (``init_weight_list`` pins every 1-D one). FlexGen's biases are 1-D; hx's per-head ones
    (Q, K, V: heads x head_dim) are not counted either."""
    return sum(math.prod(shape) * numpy_dtype(dtype).itemsize for op in ops
               for path, (shape, dtype) in spec.op_weight_arrays(op).items()
               if len(shape) >= 2 and not path.endswith("bias"))


@dataclass(frozen=True)
class FlexGenLayer:
    """One of FlexGen's layers (``OptLM.layers`` with ``--sep-layer``, its default): the input
    embedding, per decoder layer its SelfAttention and MLP, the output embedding.

    Attributes:
      kind: ``attention`` for a SelfAttention layer, else its first op.
      ops: the hx ops it computes (SCORE included for attention).
      cpu_bytes / disk_bytes: bytes of its weights homed in CPU memory / on disk (copied to the
        GPU every time it is loaded; GPU-homed ones stay), as held (compressed ones compressed).
      cpu_tensors: how many weight tensors it copies from CPU memory (one copy each).
      kv: its KV cache's home (attention layers), else None.
      pageable_bytes: of ``cpu_bytes``, what ``pin_memory()`` copies before each load
        (``--pin-weight 0``: the 2-D tensors, ``matrix_bytes``; else 0).
      compressed: elements of its weight matrices decompressed per GPU batch
        (``--compress-weight``; ``matrix_elements``).
      cpu_attention: decode attention on the CPU (``--cpu``), else on the GPU.
    """

    kind: str
    ops: tuple[str, ...]
    cpu_bytes: int
    disk_bytes: int
    cpu_tensors: int
    kv: str | None
    pageable_bytes: int = 0
    compressed: int = 0
    cpu_attention: bool = True


def flexgen_layers(spec, policy: FlexGenPolicy) -> list[FlexGenLayer]:
    """FlexGen's 2L + 2 layers under ``policy``, each layer's weights split by
    ``split_homes`` (the embeddings as one tensor each); ``spec`` carries the policy's formats
    (``FlexGenPolicy.spec``)."""
    groups = [(EMBED,)] + [*SUBLAYERS] * spec.n_layers + [(HEAD,)]
    layers = []
    for ops in groups:
        homes = split_homes(spec, ops, policy.gpu, policy.cpu)
        cpu_ops = tuple(op for op in ops if homes[op] == STREAMED)
        attention = ops == SUBLAYERS[0]
        layers.append(FlexGenLayer(
            ATTENTION if attention else ops[0],
            ops[:3] + (SCORE,) + ops[3:] if attention else ops,
            sum(spec.op_weight_bytes(op) for op in cpu_ops),
            sum(spec.op_weight_bytes(op) for op in ops if homes[op] == DISK),
            len(cpu_ops), policy.kv if attention else None,
            0 if policy.pin_weight else matrix_bytes(spec, cpu_ops),
            matrix_elements(spec, ops), policy.cpu_attention))
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


def group_bytes(fmt: Format) -> tuple[float, float]:
    """(code bytes, scale + offset bytes) per element of ``fmt`` (``Format.nbytes`` of one
    group: FlexGen's packed data and its float16 (scale, min) pair per group)."""
    codes = fmt.bits / 8
    return codes, fmt.nbytes((fmt.group,)) / fmt.group - codes


SECTOR = 32  # bytes a GPU's memory moves per access (a 32-byte L2 sector, a GDDR6 burst)


def decompress_bytes(fmt: Format, interleaved: bool, value_bytes: int = 2) -> float:
    """Bytes of GPU memory traffic per element of FlexGen's decompression into float16
    (``TorchCompressedDevice.decompress``, flexgen/compression.py), counted from its code:
    per nibble half, ``packed >> 4`` (or ``& 0xF``) reads the packed codes and writes a uint8
    temporary, and the strided assignment into the float16 output reads that and writes half
    the values (3·c + d/2); then ``div_(scale)`` and ``add_(mn)`` each read and write the
    values (2·d) and read their groups' scale or min. ``interleaved``: the group runs along
    the contiguous axis (the cache's ``group_dim=2``), so each half writes every other value
    and touches every ``SECTOR`` of the output: d per half, not d/2 (the weights'
    ``group_dim=0`` halves are whole rows). With c code bytes, p scale + min bytes per element
    and d = 2: 6·c + 5·d + p = 13.06 (weights), 6·c + 6·d + p = 15.06 (cache)."""
    codes, pairs = group_bytes(fmt)
    return 6 * codes + (6 if interleaved else 5) * value_bytes + pairs


# The rate FlexGen's decompression reaches on the bytes ``decompress_bytes`` counts, over the
# memory bandwidth the presets scale from (planner/hardware.py ``REFERENCE``: the H100's 2.38
# TB/s, hx's probe), measured by ``scripts/flexgen_decompress.py`` on an H100 80GB HBM3
# (docs/measurements/h100-2026-11-26/flexgen-decompress.json): weights (groups along rows)
# 1,146-1,180 GB/s, the cache (groups along the contiguous head axis) 1,344-1,345 GB/s; a
# float16 copy ran at 2,850-2,960 GB/s beside them. A preset's bandwidth times these is the
# H100's measured rate scaled by the GPUs' peak bandwidth ratio, the rule every preset's
# memory bandwidth follows (hardware-sources.md §7f). Keyed by ``interleaved``.
DECOMPRESS_EFFICIENCY = {False: 0.489, True: 0.565}


def decompress_seconds(values: float, fmt: Format, interleaved: bool, bandwidth: float
                       ) -> float:
    """Seconds the GPU spends decompressing ``values`` elements of ``fmt`` into float16:
    ``decompress_bytes`` per element at ``bandwidth`` (B/s, the GPU's memory bandwidth) times
    ``DECOMPRESS_EFFICIENCY`` (FlexGen's eager kernels, measured)."""
    return (values * decompress_bytes(fmt, interleaved)
            / (bandwidth * DECOMPRESS_EFFICIENCY[interleaved]))


def compress_bytes(fmt: Format, value_bytes: int = 2) -> float:
    """Bytes of GPU memory traffic per element of FlexGen's compression of float16 cache
    values (``TorchCompressedDevice.compress``, flexgen/compression.py; 4 bits, groups along
    the contiguous axis), counted from its code: ``min`` and ``max`` over each group read the
    values (2·d); ``data - mn``, ``mul_``, ``clamp_``, ``round_`` each read and write them
    (8·d); ``.to(uint8)`` reads them and writes a byte (d + 1); packing reads the even bytes
    and the odd bytes (every ``SECTOR``: 1 each), writes the shifted half (0.5) and reads it
    back (0.5), and writes the packed codes (c); the (scale, min) pairs are written (p):
    11·d + 4 + c + p = 26.56 at 4 bits, group 64."""
    codes, pairs = group_bytes(fmt)
    return 11 * value_bytes + 4 + codes + pairs


def gpu_decode_attention_seconds(spec, profile, batch: int, slots: int) -> float:
    """Seconds of FlexGen's decode attention on the GPU (``mha_gen`` without ``--cpu``) over
    ``slots`` copied cache slots of ``batch`` rows, K and V: a compressed cache is first
    decompressed whole into float16 (``decompress_seconds``); the two ``bmm``s at one query row
    read each float16 K and V value once (2 bytes), on strided views (no copy) -- memory-bound
    at the GPU's memory bandwidth (the mask and softmax over (B·H, 1, S) are S/D of that, not
    counted)."""
    elements = 2 * batch * slots * spec.n_heads * spec.head_dim
    fmt, bandwidth = kv_format(spec), profile.accelerator.memory_bandwidth
    return (elements * spec.dtype_bytes / bandwidth
            + (decompress_seconds(elements, fmt, True, bandwidth) if fmt else 0.0))


def kv_part_bytes(spec, rows: int, slots: int) -> tuple[int, int]:
    """(code bytes, other bytes) of one layer's K and V for ``rows`` x ``slots`` as held
    (``kv_arrays``); dense: (0, all)."""
    codes = other = 0
    for key, (shape, dtype) in kv_arrays(spec, rows, slots).items():
        n = math.prod(shape) * numpy_dtype(dtype).itemsize
        if kv_format(spec) and key in ("k", "v"):
            codes += n
        else:
            other += n
    return codes, other


class _Loop:
    """The tasks FlexGen's loop issues, in its order; every task of an iteration follows the
    previous iteration's ``sync()`` and whatever blocked the main thread before it was
    issued (``pin``), and the next ``sync()`` waits for all of them."""

    def __init__(self, spec, profile, batch: int, tokens: int, cache_slots: int, context: int):
        self.spec, self.profile = spec, profile
        # ops are priced as dense float16 products: FlexGen decompresses before multiplying
        self.dense = spec.replace(weight_format=DENSE, embedding_format=DENSE, kv_format=DENSE)
        self.B, self.T, self.S, self.context = batch, tokens, cache_slots, context
        self.tasks: list[Task] = []
        self.since: list[int] = []  # issued since the last sync
        self.synced: int | None = None
        self.blocked: int | None = None  # the main thread's last blocking task

    def add(self, resource: str, name: str, seconds: float, after=(), nbytes: int = 0) -> int:
        """A task after the last sync, the main thread's last block and ``after`` (task
        indices; None entries skipped)."""
        deps = tuple(d for d in (self.synced, self.blocked, *after) if d is not None)
        self.tasks.append(Task(resource, name, seconds, deps, nbytes=nbytes))
        self.since.append(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def move(self, resource: str, name: str, nbytes: int, after=()) -> int:
        """An activation or cache copy over the link (as the simulator prices a ``move``)."""
        p = self.profile
        bandwidth = p.h2d_bandwidth if resource == H2D else p.d2h_bandwidth
        return self.add(resource, name, p.transfer_latency + nbytes / bandwidth, after, nbytes)

    def copy_up(self, stream: str, name: str, nbytes: int, tensors: int, after=()) -> int:
        """``tensors`` copies of ``nbytes`` in all from pinned CPU memory to the GPU on
        ``stream`` (a weight copy's price: per-copy latency + bytes / H2D bandwidth)."""
        p = self.profile
        return self.add(stream, name, tensors * p.h2d_latency + nbytes / p.h2d_bandwidth, after,
                        nbytes)

    def pin(self, name: str, nbytes: int) -> None:
        """``pin_memory()`` of ``nbytes`` of pageable CPU tensors before their copy to the GPU
        (general_copy, pytorch_backend.py: a pageable source is copied into a pinned buffer,
        then copied up ``non_blocking``): a host memcpy on the main thread, which issues
        nothing meanwhile -- read and written at the host's memory bandwidth (torch's CPU
        copy runs on its intra-op threads; the pinned buffers come from torch's caching host
        allocator, so no page-locking after the first use)."""
        self.blocked = self.add(MAIN_THREAD, name,
                                2 * nbytes / self.profile.host.memory_bandwidth)

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

    def compute(self, device: str, name: str, ops: tuple[str, ...], after=(),
                extra: float = 0.0) -> int:
        """``ops`` on ``device`` at B rows, T new tokens, plus the device's launch overhead and
        ``extra`` seconds (SCORE: on the host over ``context`` cached slots; on the GPU, in
        prefill, FlexGen's ``mha``: ``prefill_attention_seconds``). Products are priced
        dense: FlexGen's decompression is in ``extra``."""
        seconds = self.profile.device(device).launch_seconds(self.B) + extra
        for op in ops:
            if op == SCORE and device == ACCELERATOR:
                seconds += prefill_attention_seconds(self.dense, self.profile, self.B, self.T)
            else:
                seconds += op_seconds(self.dense, self.profile, device, op, self.B, self.T,
                                      self.S, self.context)
        return self.add(device, name, seconds, after)

    def sync(self) -> int:
        """``sync()``: waits for everything issued since the last one."""
        self.synced = self.add(SYNC, "sync", self.profile.sync_overhead, self.since)
        self.since, self.blocked = [], None
        return self.synced

    def load_weights(self, layer: FlexGenLayer, name: str) -> None:
        """``load_weight``: CPU-homed tensors copied on the weight stream (one copy each),
        pageable ones (``--pin-weight 0``) pinned first on the main thread; disk-homed ones
        read by the copy threads, then copied from their pinned relay buffer (on the copy
        threads' own CUDA streams, queued here with the weight stream's)."""
        if layer.pageable_bytes:
            self.pin(f"pin weights {name}", layer.pageable_bytes)
        if layer.cpu_bytes:
            self.copy_up(WEIGHT_STREAM, f"weights {name}", layer.cpu_bytes, layer.cpu_tensors)
        if layer.disk_bytes:
            read = self.disk(f"read weights {name}", layer.disk_bytes)
            self.copy_up(WEIGHT_STREAM, f"weights {name} (from disk)", layer.disk_bytes, 0,
                         [read])

    def load_cache_to_gpu(self, name: str) -> None:
        """``load_cache`` path 0 (no ``--cpu``): the cache's used prefix -- P + 1 slots at
        token 1 (flex_opt.py: ``slice(0, prompt_len + i)``) -- of a GPU batch, K and V as
        held (compressed: codes and (scale, min) pairs, ``kv_bytes``), pinned on the main
        thread (the cache is allocated unpinned) and copied up on the cache stream."""
        nbytes = kv_bytes(self.spec, self.B, self.context + 1)
        self.pin(f"pin KV {name}", nbytes)
        self.copy_up(CACHE_STREAM, f"load KV {name}", nbytes, len(kv_arrays(self.spec, 1, 1)))

    def store_cache(self, name: str, kv: str, prefill: bool) -> None:
        """``store_cache`` of a GPU batch's new K, V (compressed on the GPU when the cache
        is): down on the store stream; prefill's into an unpinned CPU cache through the copy
        threads' relay (``copy_worker_func``: codes land in a pageable uint8 temporary, are
        cast into the float16 relay and back into the cache -- 6 host bytes per code byte;
        float16 arrays go relay -> cache, 2 per byte), or written to disk."""
        codes, other = kv_part_bytes(self.spec, self.B, self.T)
        down = self.move(D2H, f"store KV {name}", codes + other)
        if kv == DISK:
            self.disk(f"write KV {name}", codes + other, write=True, after=[down])
        elif prefill:
            self.add(COPY_THREADS, f"KV to cache {name}",
                     (6 * codes + 2 * other) / self.profile.host.memory_bandwidth, [down])


def _attention_extra(loop: _Loop, layer: FlexGenLayer, tokens: int) -> float:
    """Seconds a layer's GPU compute adds beyond its dense products: decompressing its
    compressed weights (every GPU batch: ``mha``, ``mha_gen``, ``mlp`` and the embeddings
    decompress what they were given) and, for attention with a compressed cache, compressing
    the ``tokens`` new K, V positions (``decompress_seconds``; ``compress_bytes`` at the GPU's
    memory bandwidth: FlexGen's compression is not measured)."""
    spec, bandwidth = loop.spec, loop.profile.accelerator.memory_bandwidth
    seconds = 0.0
    if layer.compressed:
        seconds += decompress_seconds(layer.compressed, get_format(spec.weight_format), False,
                                      bandwidth)
    fmt = kv_format(spec)
    if layer.kind == ATTENTION and fmt:
        new = 2 * loop.B * tokens * spec.n_heads * spec.head_dim
        seconds += new * compress_bytes(fmt) / bandwidth
    return seconds


def _compute_layer(loop: _Loop, layer: FlexGenLayer, name: str, decode: bool, before) -> None:
    """``compute_layer`` of one GPU batch: a decode attention layer with ``--cpu``
    (``mha_gen``) runs Q, K, V on the GPU, copies q (float32) and the new k, v down, attends on
    the CPU, copies the result (float32) up and runs OUT on the GPU; without ``--cpu`` it
    runs all on the GPU over the cache copied up the iteration before
    (``gpu_decode_attention_seconds``); prefill attention (``mha``) and the other layers run
    on the GPU."""
    spec, profile = loop.spec, loop.profile
    extra = _attention_extra(loop, layer, loop.T)
    if decode and layer.kind == ATTENTION and layer.cpu_attention:
        qkv = loop.compute(ACCELERATOR, f"QKV {name}", layer.ops[:3], before, extra)
        down = loop.move(D2H, f"q k v {name}", loop.B * spec.d_model * (4 + 2 * 2), [qkv])
        score = loop.compute(HOST, f"SCORE {name}", (SCORE,), [down])
        up = loop.move(H2D, f"attention {name}", loop.B * spec.d_model * 4, [score])
        loop.compute(ACCELERATOR, f"OUT {name}", layer.ops[4:], [up])
    elif decode and layer.kind == ATTENTION:
        extra += gpu_decode_attention_seconds(spec, profile, loop.B, loop.context + 1)
        loop.compute(ACCELERATOR, name, layer.ops[:3] + layer.ops[4:], before, extra)
    else:
        loop.compute(ACCELERATOR, name, layer.ops, before, extra)


def flexgen_pass(spec, layers: list[FlexGenLayer], profile, phase: str, batch: int,
                 micro_batches: int, prompt: int, cache_slots: int,
                 count: int | None = None) -> FlexGenPass:
    """FlexGen's ``generation_loop_debug_multi_batch`` (flexgen/flex_opt.py) over ``count``
    of ``layers`` (default all) for token 0 (``prefill``: the whole prompt per GPU batch) or
    token 1 (``decode``: ``prompt`` cached slots read), with ``micro_batches`` GPU batches of
    ``batch`` rows; ``spec`` carries the policy's formats (``FlexGenPolicy.spec``). Per layer j
    and GPU batch k, in its order:

    * ``load_weight(i, j+1, k)``: at k = 0 only, layer j+1's CPU- and disk-homed weights
      (``_Loop.load_weights``; pageable ones pinned on the main thread first);
    * ``load_cache(i, j, k+1)`` (decode): the next GPU batch's cache -- on disk: read by the
      copy threads; in CPU memory with ``--cpu``: cast to float32 on the main thread, priced
      with the host SCORE (the preset's host attention rate stands for FlexGen's copy + ``bmm``
      kernel); in CPU memory without: pinned and copied up (``_Loop.load_cache_to_gpu``);
    * ``store_hidden(i, j, k-1)`` and ``load_hidden(i, j, k+1)``: the previous GPU batch's
      output to its home in CPU memory (``--percent .. 0 100``) and the next one's input back,
      both on the default CUDA stream, so batch k's compute waits for them;
    * ``compute_layer(i, j, k)`` (``_compute_layer``);
    * ``store_cache(i, j, k-1)``: the previous GPU batch's new K, V to the cache's home
      (``_Loop.store_cache``);
    * ``sync()``: waits for the GPU's streams and the copy threads' queue.

    Copies are priced as the simulator prices them (latency + bytes / bandwidth; the H2D
    streams share the link: ``LINKS``), ops by ``op_seconds``; FlexGen's Python dispatch is
    not modelled beyond the preset's launch and copy latencies.
    """
    decode = phase == "decode"
    tokens = 1 if decode else prompt
    loop = _Loop(spec, profile, batch, tokens, cache_slots, prompt)
    hidden = batch * tokens * spec.d_model * spec.dtype_bytes
    ids = 4 * batch * tokens  # int32 token ids
    n, N = len(layers), micro_batches
    ends = []
    for j in range(n if count is None else count):
        layer = layers[j]
        for k in range(N):
            name = f"{layer.kind} {j} [mb {k}]"
            if k == 0:
                loop.load_weights(layers[(j + 1) % n], str((j + 1) % n))
            to_load = (j, k + 1) if k + 1 < N else (j + 1, 0)
            loading = layers[to_load[0]] if to_load[0] < n else None
            if decode and loading and loading.kv == DISK:
                loop.disk(f"read KV {to_load}", kv_bytes(spec, batch, prompt))
            elif decode and loading and loading.kv and not loading.cpu_attention:
                loop.load_cache_to_gpu(str(to_load))
            # store_hidden, then load_hidden, then the compute: one CUDA stream, in this order
            previous = (j - 1 if k == 0 else j, (k - 1) % N)  # GPU batch k - 1
            stored = loop.move(D2H, f"store hidden {previous}",
                               4 * batch if layers[previous[0]].kind == HEAD else hidden) \
                if j or k else None
            before = [loop.move(H2D, f"load hidden {to_load}",
                                hidden if to_load[0] % n else ids, [stored])]
            _compute_layer(loop, layer, name, decode, before)
            owner = layers[previous[0]]
            if (j or k) and owner.kind == ATTENTION:  # store_cache of GPU batch k - 1
                loop.store_cache(str(previous), owner.kv, not decode)
            loop.sync()
        ends.append(loop.synced)
    seconds = run_tasks(loop.tasks, profile.contention, profile.compute_contention, LINKS)
    times = [0.0] + [loop.tasks[i].end for i in ends]
    return FlexGenPass(loop.tasks, [b - a for a, b in zip(times, times[1:])], seconds)


def flexgen_run(spec, policy: FlexGenPolicy, profile, scenario: Scenario) -> dict:
    """FlexGen's run of ``scenario`` under ``policy`` as its benchmark (``--debug
    fewer_batch``) times and counts it: the whole prefill (token 0) simulated; decode timed on
    layers 10-19 of token 1 (``costs[10:]`` of its first 20 layers), their mean taken for
    each of the 2L + 2 layers of each of the G - 1 decode steps; throughput = B·N·G /
    (prefill + decode). Returns tokens_per_s, ttft_s (the prefill), tpot_s (the counted decode
    step), utilisation (each resource's busy share of token 1's simulated layers) and
    breakdown (``pass_breakdown`` of token 1's timed layers)."""
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
            "utilisation": {r: b / timed.seconds for r, b in busy.items()},
            "breakdown": pass_breakdown(timed, TIMED_LAYERS // 2)}


def pass_breakdown(run: FlexGenPass, first: int) -> dict:
    """Seconds per decoder layer (an attention and an MLP layer) of ``run`` from its layer
    ``first`` on, and of each task kind within them (the task name's words before the first
    digit or bracket: ``load KV``, ``weights``, ``attention``...), summed over GPU batches:
    what a row's time is made of. A task counts by its duration, not by what it hides."""
    start = sum(run.layer_seconds[:first])
    layers = len(run.layer_seconds) - first
    kinds: dict[str, float] = {}
    for t in run.tasks:
        if t.start >= start - 1e-12 and t.resource != SYNC:
            kind = t.name.split(" (")[0].split(" [")[0].rstrip("0123456789 ")
            kinds[kind] = kinds.get(kind, 0.0) + (t.end - t.start) * 2 / layers
    return {"layer_s": 2 * sum(run.layer_seconds[first:]) / layers, "tasks_s": kinds}


def hx_run(plan, spec, profile, scenario: Scenario) -> dict:
    """``plan`` (FlexGen's placement: ``flexgen_plan``) run and counted as hx runs a plan
    (``simulate_run``: hx's schedule, decode at mid-generation), in the largest prefill chunk
    CP-SAT may take (``cpsat.fit_chunk``) under which it fits the T4's memory: the price of
    FlexGen's policy by the simulator and memory model that price the CP-SAT rows."""
    devices = discover(accelerator_memory=profile.accelerator_memory,
                       host_memory=profile.host_memory)
    workload = scenario.workload()
    with memory_sizing("t4"):
        plan = fit_chunk(plan.with_prefill_chunk(None), spec, devices, workload)
    run = simulate_run(plan, spec, profile, scenario)
    return {"tokens_per_s": run.tokens_per_s, "ttft_s": run.ttft_s, "tpot_s": run.tpot_s,
            "prefill_chunk": plan.prefill_chunk}


def settings(models: tuple[str, ...] | None = None):
    """(spec with the policy's formats, policy, scenario, published tokens/s or None) of every
    priced row (of ``models``' settings, default all): each setting under FlexGen's policy,
    then the uncompressed ones under CP-SAT (hx's own plan; in float16, as FlexGen's
    uncompressed run)."""
    for model, flexgen, scenario, published in SETTINGS:
        if models is not None and model not in models:
            continue
        spec = flexgen.spec(model)
        yield spec, flexgen, scenario, published
        if not (flexgen.compress_weight or flexgen.compress_cache):
            yield spec, "cpsat", scenario, None


def setting_row(spec, policy, scenario: Scenario, published: float | None, profile,
                time_limit: float, status) -> dict:
    """One row: the policy's plan on the T4 preset and its simulated run (or why none fits).
    ``policy``: FlexGen's (a ``FlexGenPolicy``), run and counted as FlexGen's benchmark runs
    and counts it (``flexgen_run``), or a ``policies.build`` name, run as hx runs it
    (``simulate_run``: hx's schedule, mid-generation decode context), its plan kept
    (``ExecutionPlan.to_json``). ``status`` is told what is being planned. A FlexGen row
    whose hx plan does not fit keeps its price and says why (``hx_plan_error``: hx sizes its
    own cache and buffers, not FlexGen's); one with ``--cpu`` also has its placement's run as
    hx runs it (``hx_run``)."""
    flexgen = isinstance(policy, FlexGenPolicy)
    name = policy.name if flexgen else policy
    status(f"planning and simulating {spec.name} under {name}")
    row = {"model": spec.name, "policy": name, "block": scenario.name,
           "published_tok_s": published}
    try:
        if flexgen:  # FlexGen's loop is priced whether or not hx's plan of it fits
            row.update(flexgen_run(spec, policy, profile, scenario))
            plan = flexgen_plan(spec, policy, profile, scenario.workload())
            if policy.cpu_attention:
                row["hx_run"] = hx_run(plan, spec, profile, scenario)
        else:
            plan, _ = plan_on(policy, spec, "t4", profile, profile.accelerator_memory,
                              scenario.workload(), time_limit)
            run = simulate_run(plan, spec, profile, scenario)
            row.update(tokens_per_s=run.tokens_per_s, ttft_s=run.ttft_s, tpot_s=run.tpot_s,
                       utilisation=run.utilisation, plan=plan.to_json())
        row["prefill_chunk"] = plan.prefill_chunk
    except HxError as e:
        key = "hx_plan_error" if "tokens_per_s" in row else "error"
        row[key] = str(e).splitlines()[0]
    return row


def hx_cell(row: dict) -> str:
    """The table's hx-run cell: a FlexGen row's placement as hx runs it (tokens/s, chunk), a
    CP-SAT row's own tokens/s and chunk."""
    run = row.get("hx_run") or (row if row["policy"] == "cpsat" and "tokens_per_s" in row
                                else None)
    if run is None:
        return ""
    return f"{run['tokens_per_s']:.3g} (chunk {run['prefill_chunk'] or 'prompt'})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows as JSON")
    parser.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve")
    parser.add_argument("--models", help="only these models' settings, comma-separated "
                        f"({', '.join(dict.fromkeys(m for m, *_ in SETTINGS))})")
    args = parser.parse_args()
    models = None if args.models is None else tuple(args.models.split(","))
    if models is not None and not set(models) <= {m for m, *_ in SETTINGS}:
        parser.error(f"--models: unknown model in {args.models!r}")
    profile = hardware_profile("t4")
    with Console(stderr=True).status("planning") as status:
        rows = [setting_row(spec, policy, scenario, published, profile, args.time_limit,
                            status.update)
                for spec, policy, scenario, published in settings(models)]
    table = Table(title=f"FlexGen's setting on {profile.name}, prompt 512, generation 32 "
                        "(simulated)",
                  caption="flexgen rows: FlexGen's generation loop (a sync after every layer "
                          "and GPU batch) replayed, timed and counted as its benchmark "
                          "(--debug fewer_batch); cpsat rows: hx's own plan, run and counted "
                          "as hx's; hx-run: the row's plan (FlexGen's placement) run and "
                          "counted as hx's, in its prefill chunks")
    for col in ("model", "policy", "block", "tokens/s", "TTFT s", "TPOT s", "host busy",
                "hx-run tokens/s", "published tokens/s", "vs published"):
        table.add_column(col, justify="right")
    notes = []
    for r in rows:
        published, simulated = r["published_tok_s"], r.get("tokens_per_s")
        error = f"{simulated / published - 1:+.0%}" if simulated and published else ""
        if "error" in r or "hx_plan_error" in r:
            why = r.get("error") or "priced, but hx's own plan of this placement does not " \
                f"fit: {r['hx_plan_error']}"
            notes.append(f"[{len(notes) + 1}] {r['model']} {r['policy']}: {why}")
        busy = r.get("utilisation", {})
        table.add_row(r["model"], r["policy"], r["block"],
                      (f"{simulated:.2f}" if simulated else "-")
                      + (f" [{len(notes)}]" if "error" in r or "hx_plan_error" in r else ""),
                      f"{r['ttft_s']:.0f}" if "ttft_s" in r else "",
                      f"{r['tpot_s']:.1f}" if "tpot_s" in r else "",
                      f"{busy.get(HOST, 0) + busy.get(MAIN_THREAD, 0):.0%}" if busy else "",
                      hx_cell(r), str(published or ""), error)
    print_table(table)
    for note in notes:
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
