"""Imports have no side effects, and the planner imports neither JAX nor Flax (each check in a
fresh interpreter: this one has JAX loaded already)."""

import json
import os
import subprocess
import sys

from hx.devices import PREALLOCATE_ENV

HEAVY = ("jax", "jaxlib", "flax")


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (without a preallocation setting of the user's); it
    leaves a JSON-able ``result``."""
    script = f"import json, os, sys\n{code}\nprint(json.dumps(result))"
    env = {k: v for k, v in os.environ.items() if k != PREALLOCATE_ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_planner_imports_without_jax_or_flax():
    result = fresh("import hx.planner.cpsat, hx.planner.simulator, hx.planner.grid, "
                   "hx.planner.baselines, hx.memory, hx.schedule\n"
                   f"result = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY}))")
    assert result == []


def test_import_hx_starts_no_backend_and_sets_no_environment_variable():
    result = fresh("before = dict(os.environ)\n"
                   "import hx\n"
                   "result = {'env': dict(os.environ) != before,\n"
                   f"          'heavy': sorted({{m.split('.')[0] for m in sys.modules}} & "
                   f"set({HEAVY}))}}")
    assert result == {"env": False, "heavy": []}


def test_public_names_load_on_first_use_and_discover_configures_the_runtime():
    result = fresh("import hx\n"
                   "from jax._src import xla_bridge\n"
                   "started = xla_bridge.backends_are_initialized()\n"
                   "devices = hx.discover(accelerator_memory='1MiB')\n"
                   "result = {'started_by_import': started, 'engine': hx.Engine.__name__,\n"
                   "          'capacity': devices.accelerator.capacity,\n"
                   "          'preallocate': os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')}")
    assert result == {"started_by_import": False, "engine": "Engine", "capacity": 2**20,
                      "preallocate": "false"}
