"""Several accelerators: tensor parallelism priced with the one-accelerator machinery
(docs/architecture.md, "Several accelerators"; issue 28).

Under tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3) every accelerator of a group
of ``tp`` runs the same plan on its shard of each op (``ModelSpec.shard``: heads, the
feed-forward size and the vocabulary split ``tp`` ways), at the same moments. One accelerator's
step -- the shard's shapes, on a profile that gives it its share of what the group shares
(``tensor_parallel``) -- is then the step of all of them, and the Schedule, the estimate, the
simulator and CP-SAT price it unchanged:

* **The host** computes a host-placed op once for the whole group, so a shard's host work
  (1/tp of the op) takes the whole op's time: the view's host rates (matmul, attention, memory
  bandwidth) are the host's / tp, and its host memory is the host's / tp (the shards' host
  weights and caches together are the model's).
* **The links**: each accelerator copies its shard of a streamed weight over its own link, all
  of them at once, out of the same host memory: H2D per accelerator is the link's bandwidth or
  the host's memory bandwidth / tp, whichever is lower (D2H the same).
* **Collectives**: a product split by rows (OUT, MLP2, and the embedding split over the
  vocabulary) leaves each accelerator a partial sum of its output, rows x D, which an
  all-reduce adds up before the next op (``allreduce_seconds``); HEAD's logits, split over the
  vocabulary, are gathered (``allgather_seconds``). ``simulator.op_seconds`` adds them to those
  ops on the accelerator. A host-placed op needs none: the host computes it whole.

The collective times are NCCL's ring model in its own terms (NVIDIA/nccl-tests
doc/PERFORMANCE.md): an all-reduce of S bytes over n ranks moves 2 (n - 1) / n x S per rank,
which nccl-tests reports as "bus bandwidth" busbw = S / t x 2 (n - 1) / n, so t = latency +
2 (n - 1) / n x S / busbw; an all-gather moves (n - 1) / n x S (S: the gathered size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hx.models.spec import EMBED, HEAD, ModelSpec
from hx.planner.profile import DeviceProfile, HardwareProfile

ROW_SPLIT = ("OUT", "MLP2", EMBED)  # ops whose output is a partial sum under TP
LOGIT_BYTES = 4  # HEAD's logits are float32


@dataclass(frozen=True)
class Interconnect:
    """How a machine's accelerators reach each other.

    Attributes:
      bandwidth: all-reduce bus bandwidth, bytes/s (nccl-tests' busbw at large messages).
      latency: seconds of a small all-reduce (nccl-tests at a few KB).
      source: where both come from (``docs/hardware-sources.md``).
    """

    bandwidth: float
    latency: float
    source: str


def allreduce_seconds(profile: HardwareProfile, nbytes: int) -> float:
    """Seconds of an all-reduce of ``nbytes`` (each rank's buffer) over the profile's
    ``tensor_parallel`` accelerators: latency + 2 (n - 1) / n x bytes / bus bandwidth (module
    docstring); 0 on one accelerator."""
    n = profile.tensor_parallel
    if n == 1:
        return 0.0
    return profile.allreduce_latency + 2 * (n - 1) / n * nbytes / profile.allreduce_bandwidth


def allgather_seconds(profile: HardwareProfile, nbytes: int) -> float:
    """Seconds of an all-gather whose result is ``nbytes`` on every rank: latency + (n - 1) /
    n x bytes / bus bandwidth; 0 on one accelerator."""
    n = profile.tensor_parallel
    if n == 1:
        return 0.0
    return profile.allreduce_latency + (n - 1) / n * nbytes / profile.allreduce_bandwidth


def collective_seconds(spec: ModelSpec, profile: HardwareProfile, op: str, batch: int,
                       tokens: int) -> float:
    """The collective that ends ``op`` on the accelerator under tensor parallelism, ``spec``
    being the shard (``ModelSpec.shard``): an all-reduce of batch x tokens x D activations
    after a row-split op, the gather of batch x V float32 logits after HEAD, else 0."""
    if profile.tensor_parallel == 1:
        return 0.0
    if op in ROW_SPLIT:
        return allreduce_seconds(profile, batch * tokens * spec.d_model * spec.dtype_bytes)
    if op == HEAD:
        vocab = spec.vocab_size * profile.tensor_parallel
        return allgather_seconds(profile, batch * vocab * LOGIT_BYTES)
    return 0.0


def _host_share(host: DeviceProfile, tp: int) -> DeviceProfile:
    """``host``'s rates / ``tp`` (launch overheads as they are: one dispatch per segment)."""
    def share(curve):
        return tuple((x, rate / tp) for x, rate in curve)

    def slower(table):  # seconds per weight, x tp
        return tuple((f, tuple((n, s * tp) for n, s in points)) for f, points in table)

    return dataclasses.replace(
        host, matmul=share(host.matmul), matmul_low=share(host.matmul_low),
        attention=share(host.attention), attention_low=share(host.attention_low),
        int4_matmul=share(host.int4_matmul), memory_bandwidth=host.memory_bandwidth / tp,
        ggml_matmul=tuple((layout, share(curve)) for layout, curve in host.ggml_matmul),
        dequantize=slower(host.dequantize), dequantize_low=slower(host.dequantize_low))


def host_share(profile: HardwareProfile, n: int) -> HardwareProfile:
    """``profile`` as one of ``n`` accelerators using the host at once: host rates / ``n``,
    each link at most the host's memory bandwidth / ``n`` (``profile`` itself at ``n`` = 1)."""
    if n == 1:
        return profile
    host_bw = profile.host.memory_bandwidth / n
    return dataclasses.replace(
        profile, host=_host_share(profile.host, n),
        h2d_bandwidth=min(profile.h2d_bandwidth, host_bw),
        d2h_bandwidth=min(profile.d2h_bandwidth, host_bw))


def tensor_parallel(profile: HardwareProfile, tp: int, link: Interconnect | None
                    ) -> HardwareProfile:
    """One of ``tp`` accelerators of ``profile``'s kind under tensor parallelism, with its
    share of the host (module docstring); ``profile`` itself at ``tp`` = 1.

    Raises:
      ValueError: ``tp`` < 1, or ``tp`` > 1 without an interconnect.
    """
    if tp < 1:
        raise ValueError(f"tensor-parallel degree {tp}: 1 or more accelerators")
    if tp == 1:
        return profile
    if link is None:
        raise ValueError(f"{profile.name}: {tp} accelerators need an interconnect to price "
                         "their all-reduces (a preset with several GPUs names one)")
    return dataclasses.replace(
        host_share(profile, tp), name=f"{profile.name}, 1 of {tp} (tensor parallel)",
        host_memory=None if profile.host_memory is None else profile.host_memory // tp,
        tensor_parallel=tp, allreduce_bandwidth=link.bandwidth,
        allreduce_latency=link.latency)
