"""Weight streaming on SmolLM2: the next streamed segment's weights are copied ahead of the
current segment's compute (prefetch depth 1), and a segment's compute depends on its own
weights' copy in the trace. Properties of the issue order and the Schedule's edges, which hold
whatever the machine's load (observed start and end times do not: a watcher thread stamps an
end when it gets the interpreter back); how much copy time the compute hides is measured by ``hx bench`` (its
``overlap`` column)."""

from hx.devices import discover
from hx.generate import Engine
from hx.planner import policies
from hx.sampling import SamplingParams
from hx.timeline import ACC_COMPUTE, H2D, Timeline


def test_stream_all_copies_the_next_segment_ahead_of_this_segments_compute(smollm_dense,
                                                                             tmp_path):
    smollm = smollm_dense
    timeline = Timeline()
    L = smollm.spec.n_layers
    engine = Engine(smollm, policies.stream_all(L),
                    discover(accelerator_memory=smollm.spec.weight_bytes // 4), timeline)
    engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=6))
    timeline.wait()
    steps = timeline.steps("decode")
    assert len(steps) == 5
    for events in steps:  # stream-all: every accelerator segment streams its weights
        copies = sorted((e for e in events if e.resource == H2D
                         and e.name.startswith("weights")), key=lambda e: e.dispatch)
        computes = sorted((e for e in events if e.resource == ACC_COMPUTE),
                          key=lambda e: e.dispatch)
        assert len(copies) == len(computes) == 2 * L + 1  # Q K V and OUT MLP per layer, HEAD
        assert sorted(layer for c in copies for layer in c.args["layers"]) == sorted(
            2 * list(range(L)))
        for j, compute in enumerate(computes):
            own = copies[j]
            assert own.id in compute.deps, compute.name  # the Schedule's edge, on the trace
            if j + 1 < len(copies):
                assert copies[j + 1].dispatch < compute.dispatch, compute.name
    timeline.to_chrome(str(tmp_path / "stream-all.json"))
