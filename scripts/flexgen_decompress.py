"""FlexGen's 4-bit decompression, timed on the GPU at hand: the rate the simulator's FlexGen
replay (``scripts/flexgen_setting.py``, ``decompress_bytes``) prices at the GPU's memory
bandwidth, measured (issue 26 G; docs/hardware-sources.md §7e-f).

Usage: python scripts/flexgen_decompress.py [--runs 20] [--scale 0.1] [--json OUT.json]

FlexGen's ``TorchCompressedDevice.decompress`` (flexgen/compression.py) is a sequence of eager
PyTorch ops on float16 groups of 64 along one axis: the packed codes' high nibbles (``>> 4``)
and low nibbles (``& 0xF``) are written into the even and odd positions of a float16 output
through stride-2 views, then ``div_`` by the group's scale and ``add_`` of its minimum (both
broadcast along the group). This script runs the same sequence (its own code, written from
that description) on the shapes of FlexGen's compressed rows: OPT-175B's weight matrices
(grouped along their first axis) and the decode KV prefixes of OPT-30B (GPU batch 64, 56
heads) and OPT-175B (GPU batch 48, 96 heads) at 513 slots (grouped along the head dimension,
the contiguous axis). Beside each: a float16 copy (``clone``) of the output's size, the
device's achieved copy rate.

Printed per shape: the median time (CUDA events where torch has CUDA, else wall time), ns per
value, the rate of the bytes the replay counts (13.06 B per value for weights, 15.06 for the
cache: ``decompress_bytes``), and that rate over the copy rate — the kernels' efficiency, which
times a T4's measured copy rate (about 240 GB/s, §7f) prices them on a T4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# (name, output shape, axis of the groups, counted bytes per value: decompress_bytes)
SHAPES = (
    ("opt-175b fc1 weight", (49152, 12288), 0, 13.0625),
    ("opt-175b q weight", (12288, 12288), 0, 13.0625),
    ("opt-30b KV prefix (513, 64x56, 128)", (513, 64 * 56, 128), 2, 15.0625),
    ("opt-175b KV prefix (513, 48x96, 128)", (513, 48 * 96, 128), 2, 15.0625),
)
GROUP = 64


def compressed(shape, axis, device, torch):
    """Random packed codes (uint8, two per byte, groups of ``GROUP`` along ``axis``) and their
    float16 (scale, minimum) pairs, in FlexGen's layout: codes (..., groups, GROUP/2, ...),
    pairs (..., groups, 2, ...)."""
    groups = shape[axis] // GROUP
    packed = shape[:axis] + (groups, GROUP // 2) + shape[axis + 1:]
    pairs = shape[:axis] + (groups, 2) + shape[axis + 1:]
    codes = torch.randint(0, 256, packed, dtype=torch.uint8, device=device)
    scale = (torch.rand(pairs, device=device) * 10 + 5).to(torch.float16)
    return codes, scale


def decompress(codes, pairs, axis, torch):
    """FlexGen's op sequence: nibbles into a float16 output's even and odd positions along the
    group, then ``div_`` by the scale, ``add_`` of the minimum. Returns (..., groups, GROUP, ...)
    float16."""
    shape = codes.shape[:axis + 1] + (GROUP,) + codes.shape[axis + 2:]
    out = torch.empty(shape, dtype=torch.float16, device=codes.device)
    lead = (slice(None),) * (axis + 1)
    out[lead + (slice(0, GROUP, 2),)] = codes.bitwise_right_shift(4)
    out[lead + (slice(1, GROUP, 2),)] = codes.bitwise_and(0xF)
    scale, minimum = pairs.split(1, dim=axis + 1)
    out.div_(scale)
    out.add_(minimum)
    return out


def timed(fn, runs, torch, cuda):
    """Median seconds of ``runs`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink each shape's first axis by this factor (a CPU smoke run)")
    parser.add_argument("--json", help="write the rows as JSON")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {name}, torch {torch.__version__}, median of {args.runs}", flush=True)
    rows = []
    for label, shape, axis, counted in SHAPES:
        shape = (max(1, int(shape[0] * args.scale)),) + shape[1:]
        codes, pairs = compressed(shape, axis, device, torch)
        seconds = timed(lambda: decompress(codes, pairs, axis, torch), args.runs, torch, cuda)
        values = codes.numel() * 2
        dense = torch.empty(values, dtype=torch.float16, device=device)
        copy = timed(lambda: dense.clone(), args.runs, torch, cuda)
        copy_rate = 4 * values / copy  # float16 read + write
        rate = counted * values / seconds
        rows.append({"shape": label, "values": values, "seconds": seconds,
                     "ns_per_value": seconds / values * 1e9, "counted_bytes_per_value": counted,
                     "counted_rate": rate, "copy_rate": copy_rate,
                     "efficiency": rate / copy_rate})
        print(f"{label}: {seconds * 1e3:.2f} ms, {seconds / values * 1e9:.4f} ns/value, "
              f"counted {rate / 1e9:.0f} GB/s, copy {copy_rate / 1e9:.0f} GB/s, "
              f"efficiency {rate / copy_rate:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "runs": args.runs,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
