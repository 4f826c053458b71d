"""Hardware presets: datasheet figures scaled from the measured H100 as a roofline, each preset
complete, and the simulator ranking machines as their links and memories say."""

import pytest

from hx.errors import HxError
from hx.models.spec import PRESETS as MODELS
from hx.planner import policies
from hx.models.formats import get_format
from hx.planner.hardware import (PRESETS, REFERENCE, REFERENCE_BANDWIDTH, VM_CORES, VM_GGML,
                                 hardware_profile)
from hx.planner.simulator import predict


@pytest.mark.parametrize("name", list(PRESETS))
def test_rates_follow_the_roofline(name):
    """At M = 1 a matmul reads its weights: the rate scales with memory bandwidth; at large M
    it is capped at the datasheet peak times the H100's measured share of its own peak."""
    sheet, profile = PRESETS[name].gpu, hardware_profile(name)
    ratio = sheet.bandwidth / REFERENCE_BANDWIDTH
    for low, ref in ((profile.accelerator.matmul_low, REFERENCE.accelerator.matmul_low),
                     (profile.accelerator.matmul, REFERENCE.accelerator.matmul)):
        assert low[0][1] == pytest.approx(min(ref[0][1] * ratio, low[-1][1]))
        assert all(a[1] <= b[1] * 1.0001 for a, b in zip(low, low[1:]))  # rises with M
    assert profile.accelerator.matmul_low[-1][1] < sheet.bf16
    assert profile.accelerator.matmul[-1][1] < sheet.fp32
    assert profile.h2d_bandwidth == sheet.h2d and profile.accelerator_memory == sheet.memory
    assert "UNSOURCED" not in sheet.source or "stand in" in sheet.source
    assert profile.host.matmul[0][1] >= REFERENCE.host.matmul[0][1]


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.host.memory_bandwidth])
def test_host_products_read_weights_no_faster_than_the_host_memory(name):
    """ggml's products on a preset host whose sheet gives its memory bandwidth: every layout
    the development VM measured, never reading weights faster than that bandwidth (M rows
    share each weight read, 2·M FLOPs a weight), nor faster per core than the VM's cores."""
    host, rates = PRESETS[name].host, hardware_profile(name).host
    curves = dict(rates.ggml_matmul)
    assert set(curves) == {layout for layout, _ in VM_GGML}
    for layout, measured in VM_GGML:
        fmt = get_format(layout.split()[0])
        for (m, rate), (_, vm) in zip(curves[layout], measured):
            assert rate * fmt.block_bytes / fmt.group / (2 * m) <= host.memory_bandwidth
            assert rate <= vm / VM_CORES * host.cores * 1.0001


def test_flexgen_t4_machine_has_its_disk():
    t4 = hardware_profile("t4")
    assert t4.disk_read_bandwidth == 2e9 and t4.disk_write_bandwidth == 1e9
    assert t4.host_memory == 208e9 and t4.disk_memory == 1500e9
    assert hardware_profile("h100-80gb").disk_read_bandwidth == 0.0


def test_unknown_preset_names_the_presets():
    with pytest.raises(HxError, match="t4, a10g"):
        hardware_profile("v100")


def test_streamed_decode_ranks_machines_by_their_links():
    """A stream-all Llama-2-7B decode step is bound by the host->GPU link: PCIe 3 (T4)
    slower than PCIe 4 (A100) slower than the measured PCIe 5 (H100), each at least the
    weights' bytes over its link."""
    spec = MODELS["llama2-7b"].replace(n_layers=4, dtype="bfloat16")
    plan = policies.stream_all(spec.n_layers)
    seconds = {}
    for name in ("t4", "a100-40gb", "h100-80gb"):
        profile = hardware_profile(name)
        seconds[name] = predict(plan, spec, profile, "decode", 1, 1, 256, 128).seconds
        streamed = spec.n_layers * spec.layer_weight_bytes
        assert seconds[name] >= streamed / profile.h2d_bandwidth
    assert seconds["t4"] > seconds["a100-40gb"] > seconds["h100-80gb"]


def test_t4_host_attention_is_per_core_rate_times_cores():
    """The T4 host's SCORE curves: one core's measured rate x 16 cores, at most the host's
    memory bandwidth (docs/hardware-sources.md, "FlexGen's T4 setting"); float16 below it
    (numpy's cast), float32 at it. Presets without per-core rates keep the measured host's."""
    sheet, host = PRESETS["t4"].host, hardware_profile("t4").host
    assert host.memory_bandwidth == sheet.memory_bandwidth == pytest.approx(128e9, rel=0.01)
    assert {r for _, r in host.attention_low} == {sheet.attention_low_per_core * 16}
    assert {r for _, r in host.attention} == {sheet.memory_bandwidth}  # 9.0 x 16 > 128 GB/s
    assert host.attention_low[0][1] < host.attention[0][1]
    a100 = hardware_profile("a100-40gb").host
    assert a100.attention == REFERENCE.host.attention and a100.attention_low == ()
    assert a100.memory_bandwidth == REFERENCE.host.memory_bandwidth



def test_t4_16bit_matmuls_are_capped_at_its_sustained_rate():
    """The T4's 70 W cap holds long 16-bit products near 24 TFLOP/s, well below its 65 TFLOP/s
    boost-clock peak (GpuSheet.sustained_low): large-M products run at that, small-M ones are
    still bound by reading the weights. Presets without such a figure keep peak x the H100's
    measured share of its own peak."""
    t4 = hardware_profile("t4").accelerator.matmul_low
    assert t4[-1][1] == PRESETS["t4"].gpu.sustained_low == 24e12
    ratio = PRESETS["t4"].gpu.bandwidth / REFERENCE_BANDWIDTH
    assert t4[0][1] == pytest.approx(REFERENCE.accelerator.matmul_low[0][1] * ratio)
    a100, sheet = hardware_profile("a100-40gb").accelerator.matmul_low, PRESETS["a100-40gb"].gpu
    assert sheet.sustained_low is None
    assert a100[-1][1] == pytest.approx(
        sheet.bf16 * REFERENCE.accelerator.matmul_low[-1][1] / 989e12)
