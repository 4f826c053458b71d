"""``HardwareProfile``: the measured rates the cost model turns FLOPs and bytes into seconds.

A profile is plain data with a JSON round trip. ``hx profile`` measures one on the devices present
(``hx/measure/profiler.py``); named presets for real GPUs and hosts belong to the simulator.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from hx.errors import HxError
from hx.models.formats import get_format
from hx.models.spec import DTYPE_BYTES

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "hx", "profile.json")
# The quick profile a command measures when it needs one and none is saved
# (``profiler.load_or_measure``) is kept apart from DEFAULT_PATH, which only ``hx profile``
# writes: commands that use a profile only when one is saved (``load_default``: ``hx generate``
# with the auto policy) never plan on a quick one.
QUICK_PATH = os.path.join(os.path.expanduser("~"), ".cache", "hx", "quick-profile.json")
LOW_DTYPES = ("bfloat16", "float16")  # priced with ``DeviceProfile.matmul_low``


# (B rows, H query heads, K KV heads, E head dim) of the profiler's attention probe: one query
# per row over S slots (``rates.measure_attention``; Llama-3-8B's attention)
ATTENTION_PROBE = (8, 32, 8, 128)


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear in log(x) through sorted (x, y) points, constant beyond the ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


@dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device as the executor drives it.

    Attributes:
      matmul: ((M rows, FLOP/s), ...) sorted by M: rate of float32 (M x N) @ (N x P) products
        whose weights come from memory (working set larger than the caches).
      matmul_low: the same in 16-bit floats (measured in bfloat16; float16 runs on the same
        units of a GPU), for ops on an accelerator holding a bf16/f16 model; empty where not
        measured (the host, which computes in float32) -- ``matmul`` is used then.
      memory_bandwidth: bytes/s (read + written) of an in-place elementwise pass over a buffer
        larger than the caches (gathers, elementwise work).
      attention: ((cache slots S, KV bytes/s), ...) sorted by S: rate at which the device's
        SCORE kernel reads a float32 KV cache of S slots at ``ATTENTION_PROBE``'s shape.
      attention_low: the same with a bfloat16 cache (a bf16/f16 model keeps its KV cache in
        its dtype on both sides); empty where not measured -- ``attention`` is used then.
      launch_overhead: ((batch, seconds), ...): what the executor adds per segment it launches
        on this device -- dispatch, and the cost of switching devices, which grows with the
        batch on a 2-core host (interpolated in log batch).
      compute_scale: ((batch, factor), ...): a model's observed compute time / what these
        rates predict for it, per batch (``calibrate.refine``); 1 when empty.
      dequantize: ((weight format, ((weights per matrix, seconds per weight), ...)), ...):
        what decompressing a matrix held in that format adds to its product in float32, by
        the matrix's size (``rates.measure_dequantize``; interpolated in log size); a format
        not measured is priced as one memory-bound pass (``dequantize_seconds``).
      dequantize_low: the same decompressing into bfloat16, where measured (the
        accelerator).
      int4_matmul: ((M, FLOP/s), ...) of torch's CPU int4 kernel (``host_compute.int4_kernel``:
        bfloat16 activations, 4-bit weights in groups of 64; ``rates.measure_int4_matmul``),
        where it was measured (the host, when the kernel builds): what a host op multiplying
        its matrices in that layout (``ModelSpec.host_matmul`` torch-int4) runs at, with no
        decompression besides.
      ggml_matmul: ((held layout, ((M, FLOP/s), ...)), ...) of ggml's products over a GGUF's
        blocks (``rates.measure_ggml_matmul``; layouts as ``GGUFBlocks.layout`` names them:
        ``q4_0``, ``q4_1``, ``q4_0 repacked``...), where measured (the host, when ggml is
        built): what a host op multiplying its matrices held so (``host_matmul`` ggml) runs
        at, each curve ending at the rows that layout's kernel takes
        (``ggml_kernel.KERNEL_ROWS``).
    """

    matmul: tuple[tuple[int, float], ...]
    memory_bandwidth: float
    attention: tuple[tuple[int, float], ...]
    launch_overhead: tuple[tuple[int, float], ...]
    compute_scale: tuple[tuple[int, float], ...] = ()
    matmul_low: tuple[tuple[int, float], ...] = ()
    attention_low: tuple[tuple[int, float], ...] = ()
    dequantize: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    dequantize_low: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    int4_matmul: tuple[tuple[int, float], ...] = ()
    ggml_matmul: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()

    def launch_seconds(self, batch: int) -> float:
        """``launch_overhead`` at ``batch``."""
        return _interpolate(self.launch_overhead, batch) if self.launch_overhead else 0.0

    def scale(self, batch: int) -> float:
        """``compute_scale`` at ``batch`` (interpolated in log batch)."""
        return _interpolate(self.compute_scale, batch) if self.compute_scale else 1.0

    def matmul_seconds(self, flops: float, rows: int, dtype: str = "float32",
                       int4: bool = False) -> float:
        """Seconds of ``flops`` of matmul at M = ``rows`` with operands of ``dtype``; with
        ``int4``, by torch's int4 kernel (``int4_matmul``; unmeasured, as bfloat16)."""
        if not flops:
            return 0.0
        if int4 and self.int4_matmul:
            return flops / _interpolate(self.int4_matmul, rows)
        if int4:
            dtype = "bfloat16"
        curve = self.matmul_low if dtype in LOW_DTYPES and self.matmul_low else self.matmul
        return flops / _interpolate(curve, rows)

    def ggml_seconds(self, layout: str, flops: float, rows: int) -> float | None:
        """Seconds of ``flops`` of ggml's product over a matrix held in ``layout`` at M =
        ``rows`` (``ggml_matmul``, interpolated in log M); None where that layout was not
        measured or ``rows`` passes its curve's last M (its kernel's rows)."""
        curve = dict(self.ggml_matmul).get(layout)
        if curve is None or rows > curve[-1][0]:
            return None
        return flops / _interpolate(curve, rows)

    def dequantize_seconds(self, fmt: str, weights: int, dtype: str = "float32") -> float:
        """Seconds that decompressing one matrix of ``weights`` weights held in format ``fmt``
        into ``dtype`` adds to its product: the measured ``dequantize`` curve
        (``dequantize_low`` for bfloat16/float16) at its size, per weight; unmeasured, one pass
        over memory reading the codes and writing ``dtype``."""
        table = self.dequantize_low if dtype in LOW_DTYPES and self.dequantize_low \
            else self.dequantize
        curve = dict(table).get(fmt)
        if curve is None:
            return weights * (get_format(fmt).bits / 8 + DTYPE_BYTES[dtype]) / \
                self.memory_bandwidth
        return weights * _interpolate(curve, weights)

    def attention_seconds(self, kv_bytes: float, slots: float, dtype: str = "float32"
                          ) -> float:
        """Seconds for SCORE to read ``kv_bytes`` of a ``dtype`` cache at the rate of the
        curve at ``slots`` (a SCORE's own S, or ``probe_slots``)."""
        if not kv_bytes:
            return 0.0
        return kv_bytes / _interpolate(self._attention_curve(dtype), slots)

    def probe_slots(self, kv_bytes: float, dtype: str = "float32") -> float:
        """S of the ``ATTENTION_PROBE`` that reads ``kv_bytes`` of the cache the attention
        curve for ``dtype`` was measured with (bfloat16 for ``attention_low``)."""
        B, _, K, E = ATTENTION_PROBE
        itemsize = 2 if self._attention_curve(dtype) is self.attention_low else 4
        return kv_bytes / (2 * B * K * E * itemsize)

    def _attention_curve(self, dtype: str) -> tuple[tuple[int, float], ...]:
        return (self.attention_low if dtype in LOW_DTYPES and self.attention_low
                else self.attention)


@dataclass(frozen=True)
class HardwareProfile:
    """Accelerator, host and the link between them.

    Attributes:
      name: label (e.g. the machine it was measured on).
      accelerator / host: ``DeviceProfile`` of each side.
      h2d_bandwidth: bytes/s of large copies from the accelerator's pinned_host memory kind
        into its device memory (how the executor stages streamed weights).
      d2h_bandwidth: bytes/s of large copies from accelerator memory to the host CPU device
        (how the executor moves activations to host segments).
      transfer_latency: seconds an activation transfer adds on its link beyond
        bytes / bandwidth (profiler: a (16, 576) float32 transfer as the executor issues it,
        mean of both directions; ``calibrate`` refits it with the launch overhead).
      contention: 0..1, share of the shorter of an overlapped copy and computation that is
        lost when they run together (0: independent engines, as a GPU's DMA engine and SMs
        nearly are; 1: fully serialised). Measured by the profiler.
      compute_contention: 0..1, the same between computation on the accelerator and on the
        host at the same moment (0: separate processors, a GPU and the CPU; 1: one shared
        set of cores, as an emulated accelerator and the host share them). Measured by the
        profiler; 0 when not measured.
      sync_overhead: seconds between a streaming segment finishing and the executor, which
        waited for it, issuing the next weight copy and launch (fitted by ``calibrate``).
      accelerator_memory / host_memory: capacities in bytes (None = unknown).
      emulated: the accelerator was an XLA CPU device standing in for a GPU.
      model_error: median |predicted / observed - 1| of the decode steps calibration observed
        with the fitted profile (0 when not calibrated). The planner counts plans predicted
        this close to each other as ties (``cpsat.plan_cpsat``).
      h2d_latency: seconds each staged weight copy adds beyond bytes / bandwidth, copies
        issued back to back (``links.measure_staging_latency``); 0 when not measured.
      d2h_latency: seconds of fixed cost per large copy call device -> host, from the
        profiler's two-size fit (t = latency + bytes / bandwidth); 0 when not measured.
      round_trip: seconds of JAX's own device switch there and back, the floor under the
        executor's: a (1, 576) float32 activation computed on the accelerator, one
        ``device_put`` to the host CPU device, a tiny op there, one ``device_put`` back, a tiny
        op on the accelerator, waited for (``links.measure_round_trip``); 0 when not
        measured. ``excursion_seconds`` is what the simulator prices for the same trip.
      quick: measured by ``profiler.quick`` (fewer sizes, shorter runs, no calibration) because
        a command needed a profile and none was saved; ``hx profile`` measures a full one.
      disk_read_bandwidth / disk_write_bandwidth: bytes/s of sequential reads into and writes
        from host memory of the disk tier (NVMe); 0 when the machine has none (hardware
        presets, ``planner.hardware``). The profiler measures reads only, cold (a file dropped
        from the page cache: ``rates.measure_disk_read``), 0 in a profile measured before it
        did (``hx profile`` again); nothing prices writes.
      disk_memory: bytes of the disk tier (None: none or unknown).
      tensor_parallel: accelerators each step's ops are split over (``planner.mesh``): this
        profile is then one of them beside its share of the host (``mesh.tensor_parallel``),
        and every row-split product on the accelerator ends in an all-reduce.
      allreduce_bandwidth / allreduce_latency: the accelerators' all-reduce, NCCL's "bus
        bandwidth" in bytes/s and the seconds of a small one (``mesh.allreduce_seconds``);
        0 on one accelerator.
    """

    name: str
    accelerator: DeviceProfile
    host: DeviceProfile
    h2d_bandwidth: float
    d2h_bandwidth: float
    transfer_latency: float
    contention: float
    sync_overhead: float = 0.0
    accelerator_memory: int | None = None
    host_memory: int | None = None
    emulated: bool = False
    model_error: float = 0.0
    h2d_latency: float = 0.0
    d2h_latency: float = 0.0
    quick: bool = False
    round_trip: float = 0.0
    disk_read_bandwidth: float = 0.0
    disk_write_bandwidth: float = 0.0
    disk_memory: int | None = None
    compute_contention: float = 0.0
    tensor_parallel: int = 1
    allreduce_bandwidth: float = 0.0
    allreduce_latency: float = 0.0

    def excursion_seconds(self, batch: int = 1, nbytes: int = 0) -> float:
        """Seconds the simulator adds for one accelerator -> host -> accelerator excursion of a
        ``nbytes`` activation beyond the ops' compute: a transfer each way (latency + bytes /
        bandwidth) and one more launch on each device. Compare with ``round_trip``."""
        return (2 * self.transfer_latency + nbytes / self.d2h_bandwidth
                + nbytes / self.h2d_bandwidth + self.accelerator.launch_seconds(batch)
                + self.host.launch_seconds(batch))

    def device(self, name: str) -> DeviceProfile:
        """The ``DeviceProfile`` of ``"accelerator"`` or ``"host"``."""
        return self.accelerator if name == "accelerator" else self.host

    def to_json(self) -> dict[str, Any]:
        """Plain-dict form (tuples become lists)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HardwareProfile":
        """Parse ``to_json``'s form.

        Raises:
          HxError: a missing or malformed field.
        """
        try:
            devices = {}
            for side in ("accelerator", "host"):
                d = dict(data[side])
                d["matmul"] = tuple((int(m), float(r)) for m, r in d["matmul"])
                d["attention"] = tuple((int(s), float(r)) for s, r in d["attention"])
                d["compute_scale"] = tuple((int(b), float(f))
                                           for b, f in d.get("compute_scale", ()))
                d["launch_overhead"] = tuple((int(b), float(t)) for b, t in d["launch_overhead"])
                for curve in ("matmul_low", "attention_low", "int4_matmul"):
                    d[curve] = tuple((int(x), float(r)) for x, r in d.get(curve, ()))
                for curve in ("dequantize", "dequantize_low", "ggml_matmul"):
                    d[curve] = tuple((str(f), tuple((int(n), float(r)) for n, r in points))
                                     for f, points in d.get(curve, ()))
                devices[side] = DeviceProfile(**d)
            rest = {f.name: data[f.name] for f in fields(cls)
                    if f.name not in devices and f.name in data}
            return cls(**devices, **rest)
        except (KeyError, TypeError, ValueError) as e:
            raise HxError(f"malformed hardware profile ({e!r}): an older hx or a hand edit "
                          "wrote it; run `hx profile` to measure a new one") from None

    def save(self, path: str) -> None:
        """Write the JSON form to ``path`` (creating its folder)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        """Read a profile JSON file.

        Raises:
          HxError: missing file, invalid JSON or malformed profile.
        """
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except FileNotFoundError:
            raise HxError(f"hardware profile not found: {path}; measure one with "
                          "`hx profile --output PATH`") from None
        except json.JSONDecodeError as e:
            raise HxError(f"hardware profile {path} is not valid JSON: {e}") from None


def load_default(path: str | None = None) -> HardwareProfile | None:
    """The profile at ``path``; without one, the one ``hx profile`` saved by default, if any
    (never a quick one: ``QUICK_PATH``).

    Raises:
      HxError: ``path`` given but missing or malformed.
    """
    if path:
        return HardwareProfile.load(path)
    return HardwareProfile.load(DEFAULT_PATH) if os.path.isfile(DEFAULT_PATH) else None
