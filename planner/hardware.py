"""Hardware presets: ``HardwareProfile``s of machines hx plans and simulates for without running
on them (docs/architecture.md, "Planner"; the seeds' FlexGen T4 and A10G settings, and newer GPUs).

A preset is built from datasheet figures (memory, memory bandwidth, dense FP32 and BF16
matmul peaks), the host (cores, memory), the PCIe link as measured on that generation, and an
optional NVMe disk tier, each with its source (``docs/hardware-sources.md`` gives the
citations in full). Datasheets give peaks, not the rates hx's executor reaches, so the rate
curves are those **measured on an H100 80GB HBM3 machine** (``hx profile``, 2026-11-22,
``docs/measurements/h100-2026-11-22/profile-no-refine.json``) scaled to the preset:

* accelerator matmul at M rows: the H100's measured rate x (preset / H100 memory bandwidth),
  capped at the preset's datasheet peak x the H100's measured fraction of its own peak
  (small M is bound by reading the weights, large M by the tensor cores; a roofline), or,
  for 16-bit products, at a measured sustained rate where the sheet gives one (the T4's
  power cap: ``GpuSheet.sustained_low``);
* accelerator attention (KV bytes/s) and memory bandwidth: the H100's x the bandwidth ratio;
* host matmul: the measured 16-core host's rate x (cores / 16), but not above the rate its
  memory bandwidth allows at M rows (2·M FLOPs per float32 weight read), nor below the
  measured rate; host memory bandwidth and hx's host attention kernel as measured there, or,
  where the host sheet gives them (the T4), its memory bandwidth and one core's host SCORE rate
  (measured on the development VM) x its cores, at most that bandwidth (``HostSheet``);
* host products over GGUF blocks (ggml's, ``DeviceProfile.ggml_matmul``), where the host sheet
  gives its memory bandwidth: the development VM's measured rate per core x the host's cores,
  at most what ``GGML_BANDWIDTH_SHARE`` of that bandwidth feeds at M rows (2·M FLOPs per
  weight read at the layout's bytes per weight: a batch-1 product reads every weight once);
* per-launch overhead and the activation-transfer latency: as measured (hx's own dispatch).

Figures marked UNSOURCED in ``docs/hardware-sources.md`` are not used: where one is missing
the preset says so (``GpuSheet.note``) and stands in the nearest sourced figure.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

from hx.errors import HxError
from hx.models.formats import get_format
from hx.planner.mesh import Interconnect, tensor_parallel
from hx.planner.profile import DeviceProfile, HardwareProfile, load_default
from hx.sizing import sizing_for_absent_accelerator

GB, GiB = 10**9, 2**30


@dataclass(frozen=True)
class GpuSheet:
    """Datasheet figures of one GPU and its link.

    Attributes:
      memory: bytes of device memory.
      bandwidth: bytes/s of device memory.
      fp32 / bf16: dense peak FLOP/s (no 2:4 sparsity).
      h2d / d2h: bytes/s of pinned host -> device copies and device -> host activation
        copies as measured on that PCIe generation.
      source: where each figure comes from.
      sustained_low: dense 16-bit matmul FLOP/s that a long run of large products holds, where
        it is measured and the part's power cap keeps its clock below the boost clock its
        datasheet peak assumes (the 70 W T4); it replaces peak x the H100's measured share
        of its own peak as the cap of the 16-bit matmul curve. None: that product stands.
    """

    memory: int
    bandwidth: float
    fp32: float
    bf16: float
    h2d: float
    d2h: float
    source: str
    sustained_low: float | None = None


@dataclass(frozen=True)
class HostSheet:
    """The host: ``cores`` physical cores, ``memory`` bytes; ``source`` cites both.

    Optional host rates, each cited in ``source`` (``docs/hardware-sources.md``); where absent
    the measured reference host's stand in:
      memory_bandwidth: bytes/s of the host's memory (read + written).
      attention_per_core / attention_low_per_core: KV bytes/s one core's share of hx's host
        SCORE kernel (``host_compute.attention``, one thread per core) reads of a float32 /
        16-bit cache; the preset's curve is that times ``cores``, at most ``memory_bandwidth``.
    """

    cores: int
    memory: int
    source: str
    memory_bandwidth: float | None = None
    attention_per_core: float | None = None
    attention_low_per_core: float | None = None


@dataclass(frozen=True)
class DiskSheet:
    """An NVMe disk tier: sequential ``read``/``write`` bytes/s, ``capacity`` bytes."""

    read: float
    write: float
    capacity: int
    source: str


@dataclass(frozen=True)
class Preset:
    """A machine: GPU, host and optional disk."""

    name: str
    gpu: GpuSheet
    host: HostSheet
    disk: DiskSheet | None = None


# The measured reference: H100 80GB HBM3 (SXM5 datasheet: 3,350 GB/s, 67 TFLOP/s FP32,
# 989 TFLOP/s BF16 dense) on a 16-core host, jax 0.11.2, 2026-11-22 (rates in FLOP/s or B/s).
# h2d_latency 0: the staged-copy probe (``links.measure_staging_latency``) postdates that run;
# its two-size intercept (0.87 ms per copy) is not a staged copy's cost: hx's stream-all decode
# of Llama-2-7B:8L bf16 (56 staged copies, 3.24 GB) took 65.2 ms there, bytes / 46.5 GB/s =
# 69.7 ms, so the copies' fixed costs were hidden (docs/measurements/h100-2026-11-22).
REFERENCE_BANDWIDTH, REFERENCE_FP32, REFERENCE_BF16, REFERENCE_CORES = 3350 * GB, 67e12, 989e12, 16
REFERENCE = HardwareProfile(
    name="H100 80GB HBM3, measured",
    accelerator=DeviceProfile(
        matmul=((1, 6.13e11), (4, 4.31e12), (16, 1.60e13), (64, 3.80e13), (256, 4.75e13),
                (512, 4.81e13)),
        matmul_low=((1, 2.12e12), (4, 8.76e12), (16, 3.30e13), (64, 1.40e14), (256, 4.72e14),
                    (512, 5.76e14)),
        memory_bandwidth=2.38e12,
        attention=((256, 2.24e10), (1024, 7.43e10), (4096, 1.81e11)),
        launch_overhead=((1, 4.16e-4),)),
    host=DeviceProfile(
        matmul=((1, 3.19e10), (4, 1.18e11), (16, 1.80e11), (64, 6.68e11), (256, 8.03e11),
                (512, 7.25e11)),
        memory_bandwidth=5.92e10,
        attention=((256, 2.74e9), (1024, 2.43e9), (4096, 2.47e9)),
        launch_overhead=((1, 4.16e-4),)),
    h2d_bandwidth=4.65e10, d2h_bandwidth=2.52e9, transfer_latency=3.78e-4, contention=0.0,
    accelerator_memory=81559 * 2**20, host_memory=135148564480, h2d_latency=0.0,
    round_trip=1.07e-3)

# ggml's products on the development VM (2 cores of an AMD EPYC with AVX-512 VNNI; hx profile,
# 2026-11-28, docs/measurements/vm-2026-11-28b/profile_full.json): FLOP/s at M rows per layout
VM_CORES = 2
VM_GGML = (
    ("q4_0", ((1, 6.50e10), (2, 8.18e10), (4, 9.11e10), (8, 9.84e10), (16, 1.02e11),
              (32, 1.03e11), (64, 1.03e11))),
    ("q4_1", ((1, 6.55e10), (2, 6.61e10), (4, 7.14e10), (8, 7.51e10), (16, 7.75e10),
              (32, 7.43e10), (64, 7.55e10))),
    ("q8_0", ((1, 4.32e10), (2, 7.96e10), (4, 9.81e10), (8, 1.13e11), (16, 8.48e10),
              (32, 1.14e11), (64, 1.23e11))),
    ("q4_0 repacked", ((1, 7.72e10), (2, 8.36e10), (4, 1.27e11), (8, 1.27e11), (16, 1.55e11),
                       (32, 1.53e11), (64, 1.52e11), (128, 1.51e11), (256, 1.51e11),
                       (512, 1.49e11))))
# The share of a host's datasheet memory bandwidth ggml's batch-1 products are taken to read
# weights at: an assumption, not a measurement (STREAM-like reads reach 70-85 % of a DDR
# datasheet's peak; the VM's own 2-core q4_0 product, 21.7 GB/s of weights against a measured
# 38.0 GB/s copy, is bound by its 2 cores, not by memory, so it cannot say).
GGML_BANDWIDTH_SHARE = 0.75

PCIE3_LINK = (12.89 * GB, 4.82 * GB)  # (H2D, D2H) bytes/s of PCIe 3.0 x16: _PCIE3 cites them
_PCIE3 = ("PCIe 3.0 x16: H2D 12.89 GB/s, D2H 4.82 GB/s, FlexGen's rates fitted on the T4 "
          "(FlexiGen experimental/cost_model.py ctog_bdw, gtoc_bdw_hidden)")
_PCIE4 = ("PCIe 4.0 x16: H2D 25 GB/s measured peak on an A100 (BaM authors, ZaidQureshi/bam "
          "#54); D2H as measured on the H100 machine (no sourced Gen4 figure)")
_PCIE4_A10 = ("PCIe 4.0 x16: H2D 19.5 GB/s, one stream on an A10 (drkennetz/cuda_examples #1); "
              "D2H as measured on the H100 machine")

PRESETS: dict[str, Preset] = {
    "t4": Preset(
        "T4-16GB (PCIe 3.0), 208 GB host, NVMe (FlexGen's GCP machine)",
        GpuSheet(16 * GiB, 320 * GB, 8.1e12, 65e12, *PCIE3_LINK,
                 "NVIDIA T4 datasheet via sysrqmts.com: 16 GB GDDR6, 320 GB/s, 8.1 TFLOP/s "
                 "FP32, 65 TFLOP/s FP16 mixed (no sparsity on Turing; bf16 priced as fp16) at "
                 "the 1,590 MHz boost clock; sustained FP16: about 24 TFLOP/s, cuBLAS "
                 "4096^3 FP16 GEMM repeated 100 times on a T4, which NVIDIA's reply puts down "
                 "to the 70 W power cap lowering the clock, 'expected behavior for "
                 "approximately continuous matrix multiply operations on a T4' (NVIDIA "
                 "developer forum, 'About GPU peak performance', thread 264462); "
                 + _PCIE3, sustained_low=24e12),
        HostSheet(16, 208 * GB,
                  "FlexGen paper Table 1: 208 GB DRAM, Intel Xeon @ 2.00GHz; 32 vCPU (16 cores, "
                  "2 vCPUs per core: GCP CPU platforms) from n1-highmem-32, the GCP type with "
                  "208 GB; N1 at 2.0 GHz is Skylake (2.7 GHz all-core turbo): six DDR4-2666 "
                  "channels per socket, 6 x 21.3 GB/s = 128 GB/s peak (Kingston, Purley "
                  "platform); host SCORE per core as measured on the development VM (hx's numpy "
                  "kernel, one thread, OPT-30B decode shapes, 2026-11-24): 9.0 GB/s of a float32 "
                  "cache, 0.72 GB/s of a float16 one (numpy's float16 cast), x 16 cores; Turing "
                  "has no bfloat16, so the 16-bit curve is float16's",
                  memory_bandwidth=6 * 21.33 * GB, attention_per_core=9.0 * GB,
                  attention_low_per_core=0.72 * GB),
        DiskSheet(2 * GB, 1 * GB, 1500 * GB,
                  "FlexGen paper §6: 1.5 TB NVMe, read about 2 GB/s, write about 1 GB/s")),
    "a10g": Preset(
        "A10G-24GB (PCIe 4.0, AWS g5), 24-core EPYC host",
        GpuSheet(24 * GiB, 600 * GB, 31.2e12, 125e12, 19.5 * GB, REFERENCE.d2h_bandwidth,
                 "24 GB GDDR6, 600 GB/s (Baseten A10 vs A10G); FP32 and BF16 peaks are "
                 "UNSOURCED for the A10G: the A10's 31.2 TFLOP/s FP32 (sysrqmts.com) and "
                 "125 TFLOP/s BF16 dense (A10 datasheet, not in the corpus: unverified) "
                 "stand in; " + _PCIE4_A10),
        HostSheet(24, 192 * GiB, "g5.12xlarge: 48 vCPU (24 cores), 192 GiB (AWS Batch GPU "
                                 "jobs table); second-generation AMD EPYC (AWS EC2 G5)")),
    "a100-40gb": Preset(
        "A100-40GB PCIe 4.0, 32-core host",
        GpuSheet(40 * GiB, 1555 * GB, 19.5e12, 312e12, 25 * GB, REFERENCE.d2h_bandwidth,
                 "NVIDIA A100 datasheet (r4): 40 GB HBM2, 1,555 GB/s, 19.5 TFLOP/s FP32, "
                 "312 TFLOP/s BF16 dense; " + _PCIE4),
        HostSheet(32, 256 * GiB, "host assumed: 32 cores, 256 GiB (no single deployment)")),
    "l4": Preset(
        "L4-24GB PCIe 4.0, 16-core host",
        GpuSheet(24 * GiB, 300 * GB, 30.3e12, 121e12, 25 * GB, REFERENCE.d2h_bandwidth,
                 "NVIDIA L4: 24 GB GDDR6, 300 GB/s, 30.3 TFLOP/s FP32, 242 TFLOP/s FP16 with "
                 "sparsity = 121 dense; " + _PCIE4),
        HostSheet(16, 128 * GiB, "host assumed: 16 cores, 128 GiB (as GCP g2-standard-32)")),
    "h100-80gb": Preset(
        "H100-80GB HBM3 (PCIe 5.0 link), 16-core host, as measured",
        GpuSheet(REFERENCE.accelerator_memory, REFERENCE_BANDWIDTH, REFERENCE_FP32,
                 REFERENCE_BF16, REFERENCE.h2d_bandwidth, REFERENCE.d2h_bandwidth,
                 "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3,350 GB/s, 67 TFLOP/s FP32, 989 "
                 "BF16 dense; rates and link measured on it (hx profile, 2026-11-22)"),
        HostSheet(REFERENCE_CORES, REFERENCE.host_memory,
                  "measured: 16 cores, 128 GiB (the H100 machine hx was run on)")),
    # Mixture-of-Experts settings (docs/hardware-sources.md §9): the machines of the published
    # figures issue 40 compares with
    "rtx4090d-2x6454s": Preset(
        "RTX 4090 D 24GB (PCIe 4.0) + 2 x Xeon Gold 6454S, 1 TB DDR5 (kTransformers' machine)",
        GpuSheet(24 * GiB, 1008 * GB, 73.5e12, 147.1e12, 25 * GB, REFERENCE.d2h_bandwidth,
                 "hmc-tech.com RTX 4090 D (§9a [g4]): 24 GB GDDR6X, 1,008 GB/s, 73.5 TFLOP/s "
                 "FP32, 147.1 TFLOP/s FP16/BF16 tensor dense with FP32 accumulate (GeForce: "
                 "half the FP16-accumulate rate); the 4090's PCIe 4.0 x16 as stand in (the D's link "
                 "is UNSOURCED); "
                 + _PCIE4),
        HostSheet(64, 10**12,
                  "kvcache-ai/ktransformers DeepseekR1_V3_tutorial.md (§9b [h1]): 2 sockets of "
                  "32 cores, 8 x DDR5-4800 each, 1 TB; 2 x 307.2 GB/s peak (8 x 4,800 MT/s x "
                  "8 B a socket)", memory_bandwidth=2 * 307.2 * GB)),
    "rtx2080-i9-10900x": Preset(
        "RTX 2080 8GB (PCIe 3.0) + Core i9-10900X, 4-channel DDR4 (llama.cpp --n-cpu-moe 36)",
        GpuSheet(8 * GiB, 448 * GB, 10.07e12, 40.3e12, *PCIE3_LINK,
                 "RTX 2080 (§9a [g6][g7]): 8 GB GDDR6, 448 GB/s, 10.07 TFLOP/s FP32; FP16 "
                 "tensor with FP32 accumulate 40.3 TFLOP/s dense (368 tensor cores x 128 "
                 "FLOP/clock x 1.71 GHz, halved on GeForce [g8]; Turing has no bfloat16: priced "
                 "as float16); " + _PCIE3),
        HostSheet(10, 62 * GB,
                  "AlexsJones/llmfit #755 and #773 (§9b [h3][h4]): i9-10900X, 10 cores, 62 GB, "
                  "'measured ~102 GB/s quad-channel DDR4'", memory_bandwidth=102 * GB)),
    "quadro-rtx6000-48c": Preset(
        "Quadro RTX 6000 24GB (PCIe 3.0) + 48-core Skylake (Fiddler's first machine)",
        GpuSheet(24 * GiB, 672 * GB, 16.3e12, 130.5e12, *PCIE3_LINK,
                 "Quadro RTX 6000, active card (§9a [g9][g10]): 24 GB GDDR6, 672 GB/s, 16.3 "
                 "TFLOP/s FP32; FP16 tensor 130.5 TFLOP/s dense at either accumulate (576 x 128 "
                 "x 1.77 GHz; the passive card's sheet: 119.4 at 624 GB/s [g11]); no bfloat16: "
                 "priced as float16; " + _PCIE3),
        HostSheet(48, 384 * GiB,
                  "efeslab/fiddler README (§9b [h5]): a 48-core Intel Skylake; its memory is "
                  "UNSOURCED: 384 GiB assumed (hx's float32 host copies of Mixtral's experts "
                  "take 187 GB), and its bandwidth is the measured reference host's")),
}


@dataclass(frozen=True)
class Machine:
    """Several GPUs of one preset in one host (``PRESETS[preset]``: its GPU sheet is each
    GPU's; ``host`` the machine's, or the preset's), joined by ``interconnect``
    (``planner.mesh``)."""

    name: str
    preset: str
    gpus: int
    interconnect: Interconnect
    host: HostSheet | None = None

    def sheets(self) -> Preset:
        """One GPU of the machine beside its host, as a one-GPU preset."""
        one = PRESETS[self.preset]
        return dataclasses.replace(one, name=self.name, host=self.host or one.host)


# docs/hardware-sources.md §8 gives each figure's source in full.
MACHINES: dict[str, Machine] = {
    "4xa10g": Machine(
        "4 x A10G-24GB (AWS g5.12xlarge: the a10g preset's host), PCIe, no NVLink", "a10g", 4,
        Interconnect(
            3.10 * GB, 11e-6,
            "all-reduce bus bandwidth 3.10 GB/s: nccl-tests all_reduce_perf on 4 x A10G, "
            "29.4 MB, NCCL 2.18.5 (pytorch/pytorch #127077, abdulfatir; the faster of the two "
            "NCCL versions in that report); 11 us a small all-reduce: 4 x RTX A5000 on one "
            "PCIe host, 32-256 B (NVIDIA/nccl #757), no A10G figure found")),
    "8xh100": Machine(
        "8 x H100-80GB SXM (NVLink 4, NVSwitch), DGX H100 host", "h100-80gb", 8,
        Interconnect(
            370 * GB, 26e-6,
            "ring all-reduce bus bandwidth about 370 GB/s on 8 H100 SXM (NVIDIA/nccl-tests "
            "#212, sjeaugey; NVIDIA/nccl #1455: 365-370 GB/s from 2 to 8 GPUs); 26 us a 1 KB "
            "all-reduce on 8 H100 (Azure/AI-benchmarking-guide ND_H100_v5_results.md, "
            "NVLink SHARP forced: 0.07 GB/s busbw x 8/14)"),
        HostSheet(112, 2 * 10**12,
                  "DGX H100: 2 x Xeon Platinum 8480C, 56 cores each, 2.0 TB (NVIDIA's MLPerf "
                  "system description, mlcommons/inference_results_v3.1 closed/NVIDIA/systems/"
                  "DGX-H100_H100-SXM-80GBx8_TRT.json); memory bandwidth UNSOURCED: the "
                  "measured reference host's stands in")),
}


def machine(name: str) -> Machine | None:
    """The several-GPU machine ``name`` names (``MACHINES``), or None for a one-GPU preset."""
    return MACHINES.get(name.strip().lower())


def tensor_parallel_profile(name: str, tp: int) -> HardwareProfile:
    """One GPU of machine ``name`` under ``tp``-way tensor parallelism with its share of the
    host (``mesh.tensor_parallel``); ``hardware_profile(name)`` at ``tp`` = 1.

    Raises:
      HxError: ``tp`` > 1 on a one-GPU preset, or more than the machine's GPUs.
    """
    profile = hardware_profile(name)
    if tp == 1:
        return profile
    several = machine(name)
    gpus = several.gpus if several else 1
    if not 1 <= tp <= gpus:
        raise HxError(f"tensor parallelism over {tp} GPUs: {name!r} has {gpus}; several-GPU "
                      f"machines: {', '.join(f'{k} ({m.gpus})' for k, m in MACHINES.items())}")
    return tensor_parallel(profile, tp, several.interconnect)


def _scaled(curve: tuple[tuple[int, float], ...], factor: float, cap: float
                  ) -> tuple[tuple[int, float], ...]:
    return tuple((m, min(rate * factor, cap)) for m, rate in curve)


def _host_attention(host: HostSheet, per_core: float | None,
                    measured: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """The host SCORE curve of ``host``: ``per_core`` x its cores, at most its memory
    bandwidth, at every S (one thread per core, each reading its rows' cache), or the
    reference host's ``measured`` curve where the sheet gives no per-core rate."""
    if per_core is None:
        return measured
    rate = per_core * host.cores
    if host.memory_bandwidth:
        rate = min(rate, host.memory_bandwidth)
    return tuple((s, rate) for s, _ in REFERENCE.host.attention)


def _host_ggml(host: HostSheet) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """ggml's product curves on ``host`` (module docstring): ``VM_GGML`` per core x its
    cores, at most ``GGML_BANDWIDTH_SHARE`` x its memory bandwidth x 2·M / bytes per weight;
    none where the sheet gives no bandwidth."""
    if not host.memory_bandwidth:
        return ()
    curves = []
    for layout, curve in VM_GGML:
        fmt = get_format(layout.split()[0])
        per_weight = fmt.block_bytes / fmt.group
        fed = GGML_BANDWIDTH_SHARE * host.memory_bandwidth * 2 / per_weight
        curves.append((layout, tuple((m, min(rate / VM_CORES * host.cores, fed * m))
                                     for m, rate in curve)))
    return tuple(curves)


def build(preset: Preset) -> HardwareProfile:
    """The ``HardwareProfile`` of ``preset`` (module docstring: how its rates are scaled
    from the measured H100 machine)."""
    ref, gpu, host = REFERENCE, preset.gpu, preset.host
    bandwidth = gpu.bandwidth / REFERENCE_BANDWIDTH
    f32_cap = gpu.fp32 * ref.accelerator.matmul[-1][1] / REFERENCE_FP32
    bf16_cap = gpu.sustained_low or (gpu.bf16 * ref.accelerator.matmul_low[-1][1]
                                     / REFERENCE_BF16)
    accelerator = DeviceProfile(
        matmul=_scaled(ref.accelerator.matmul, bandwidth, f32_cap),
        matmul_low=_scaled(ref.accelerator.matmul_low, bandwidth, bf16_cap),
        memory_bandwidth=ref.accelerator.memory_bandwidth * bandwidth,
        attention=tuple((s, r * bandwidth) for s, r in ref.accelerator.attention),
        launch_overhead=ref.accelerator.launch_overhead)
    cores = host.cores / REFERENCE_CORES
    host_matmul = tuple(
        (m, max(rate, min(rate * cores, m / 2 * ref.host.memory_bandwidth)))
        for m, rate in ref.host.matmul)
    host_profile = DeviceProfile(
        matmul=host_matmul, memory_bandwidth=host.memory_bandwidth or ref.host.memory_bandwidth,
        attention=_host_attention(host, host.attention_per_core, ref.host.attention),
        attention_low=_host_attention(host, host.attention_low_per_core, ref.host.attention_low),
        launch_overhead=ref.host.launch_overhead, ggml_matmul=_host_ggml(host))
    disk = preset.disk
    return HardwareProfile(
        name=preset.name, accelerator=accelerator, host=host_profile,
        h2d_bandwidth=gpu.h2d, d2h_bandwidth=gpu.d2h, transfer_latency=ref.transfer_latency,
        contention=ref.contention, accelerator_memory=gpu.memory, host_memory=host.memory,
        h2d_latency=ref.h2d_latency, round_trip=ref.round_trip,
        disk_read_bandwidth=disk.read if disk else 0.0,
        disk_write_bandwidth=disk.write if disk else 0.0,
        disk_memory=disk.capacity if disk else None)


LOCAL = "local"  # the profile ``hx profile`` measured on this machine


def memory_sizing(name: str) -> ContextManager[None]:
    """The context to plan for hardware ``name`` in: this process's own compilations for
    ``local``, ``hx.sizing.sizing_for_absent_accelerator`` for a preset (its accelerator is
    not here, so XLA:CPU's temporaries of half-precision programs are not its)."""
    if name.strip().lower() == LOCAL:
        return nullcontext()
    return sizing_for_absent_accelerator()


def hardware_profile(name: str) -> HardwareProfile:
    """The profile of a preset (``PRESETS`` keys) or ``"local"`` (this machine's saved one);
    of a several-GPU machine (``MACHINES``), one of its GPUs beside the whole host
    (``mesh.tensor_parallel`` gives a GPU its share of the host under tensor parallelism).

    Raises:
      HxError: an unknown name (the message lists the presets), or ``local`` with no profile
        saved (run ``hx profile``).
    """
    key = name.strip().lower()
    if key == LOCAL:
        profile = load_default()
        if profile is None:
            raise HxError("no measured profile of this machine: run `hx profile` first")
        return profile
    if key in MACHINES:
        return build(MACHINES[key].sheets())
    if key not in PRESETS:
        raise HxError(f"unknown hardware preset {name!r}; presets: "
                      f"{', '.join([*PRESETS, *MACHINES, LOCAL])}")
    return build(PRESETS[key])
