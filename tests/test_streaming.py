"""Weight streaming on SmolLM2: the next layer's copies overlap the current layer's compute."""

from hx.devices import discover
from hx.generate import Engine
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.timeline import COMPUTE, H2D, Timeline, median_overlap


def test_stream_all_overlaps_next_layer_copy_with_compute(smollm, tmp_path):
    timeline = Timeline()
    engine = Engine(smollm, policies.stream_all(smollm.spec.n_layers),
                    discover(accelerator_memory=smollm.spec.weight_bytes // 4), timeline)
    engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=6))
    timeline.wait()
    steps = timeline.steps("decode")
    assert len(steps) == 5
    overlapping_layers = []
    for events in steps:
        copies = [e for e in events if e.resource == H2D and e.name.startswith("weights")]
        compute = [e for e in events if e.resource in COMPUTE]  # accelerator or host
        hits = set()
        for c in compute:
            for w in copies:
                nxt = [layer + 1 for layer in c.args["layers"]]
                if set(w.args["layers"]) & set(nxt) and w.start < c.end and c.start < w.end:
                    hits.update(c.args["layers"])
        overlapping_layers.append(len(hits))
    # a decode step shows layer i+1's weights in flight while layer i computes (on the
    # accelerator, or its SCORE on the host) for at least half of the layers
    assert max(overlapping_layers) >= smollm.spec.n_layers // 2, overlapping_layers
    assert median_overlap(timeline) > 0.2
    timeline.to_chrome(str(tmp_path / "stream-all.json"))
