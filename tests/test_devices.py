"""Process set-up for real GPUs (docs/architecture.md, "Devices and memory"): XLA's allocator does
not preallocate, its pool is
capped at the first budget plus headroom, and float32 matmuls are float32 on every backend. The
assertions hold on the emulated accelerator and on a GPU alike."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hx.devices import (ACCELERATOR, MEM_FRACTION_ENV, MEM_FRACTION_ENVS, PREALLOCATE_ENV,
                        discover, pool_headroom)
from hx.errors import HxError

GiB = 2**30


def python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter whose environment has no XLA_* or JAX_* variables but
    ``env``; returns its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**clean, **env}, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_allocator_does_not_preallocate_unless_the_user_says_so():
    show = f"import os, hx; hx.discover(); print(os.environ.get({PREALLOCATE_ENV!r}))"
    assert python(show) == "false"
    assert python(show, **{PREALLOCATE_ENV: "true"}) == "true"


def test_matmul_precision_is_highest_once_the_runtime_is_configured():
    assert jax.config.jax_default_matmul_precision == "highest"


def test_float32_matmul_is_float32_on_the_accelerator(devices):
    """TF32 (XLA's default for float32 dots on NVIDIA GPUs) misses by ~3e-4 here; float32 by
    ~6e-7 (norm of the error over norm of the float64 product)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 1024), dtype=np.float32)
    b = rng.standard_normal((1024, 256), dtype=np.float32)
    acc = devices[ACCELERATOR]
    got = np.asarray(jax.jit(jnp.matmul)(jax.device_put(a, acc), jax.device_put(b, acc)))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-6


# Records the fraction XLA's GPU client would read when the backends start (the environment at
# the first ``xla_bridge.backends()`` call), with a GPU of 80 GiB standing in for the driver's
# answer, then what is left in the environment after ``discover``.
PROBE = f"""
import os, hx, hx.devices as d
from jax._src import xla_bridge
seen, start = [], xla_bridge.backends
def backends():
    if not seen:
        seen.append(os.environ.get({MEM_FRACTION_ENV!r}))
    return start()
xla_bridge.backends = backends
d._cuda_total_memory = lambda: 80 * 2**30
devices = d.discover(accelerator_memory=2**30)
print(seen[0], os.environ.get({MEM_FRACTION_ENV!r}))
"""


def test_first_budget_caps_the_pool_for_the_backend_start_only():
    at_start, after = python(PROBE).split()
    assert float(at_start) == (GiB + pool_headroom(GiB)) / (80 * GiB)
    assert after == "None"  # child processes do not inherit the cap


def test_a_users_fraction_wins():
    for name in MEM_FRACTION_ENVS:
        at_start, after = python(PROBE, **{name: "0.5"}).split()
        assert (at_start, after) == (("0.5", "0.5") if name == MEM_FRACTION_ENV
                                     else ("None", "None"))


def test_headroom():
    assert pool_headroom(0) == pool_headroom(5 * GiB) == GiB
    assert pool_headroom(20 * GiB) == 2 * GiB


def test_pool_limit_of_a_fresh_process_is_budget_plus_headroom():
    """Unpatched: on a GPU the pool XLA reports is the budget plus headroom (XLA rounds it to
    whole 2 MiB); XLA:CPU reports no pool."""
    limit = python("import hx; print(hx.discover(accelerator_memory=2**30).accelerator.pool_limit)")
    assert limit == "None" or abs(int(limit) - (GiB + pool_headroom(GiB))) <= 4 * 2**20


def test_a_budget_for_other_hardware_is_kept_and_the_pool_is_not_changed(devices):
    """Plans may be made for a larger device than this one; the pool was fixed at start."""
    acc = discover(accelerator_memory=10**13).accelerator
    assert (acc.capacity, acc.pool_limit) == (10**13, devices.accelerator.pool_limit)


def test_describe_says_emulated_exactly_when_it_is(devices):
    assert ("EMULATED" in devices.describe()) == devices.emulated


def test_several_accelerators_are_a_group_with_one_budget_each(devices):
    """In a fresh process: 3 emulated accelerators (CPU devices 1-3) and their mesh; here, where
    JAX started with two CPU devices, asking for 4 says why it cannot."""
    out = python("from hx.devices import discover; d = discover('1GiB', accelerators=3); "
                 "a = d.accelerator; print([x.id for x in a.group], dict(a.mesh().shape), "
                 "a.capacity, d.host.device.id)")
    assert out.splitlines()[-1] == f"[1, 2, 3] {{'tp': 3}} {GiB} 0"
    with pytest.raises(HxError, match="4 accelerators asked, 1 XLA CPU devices"):
        discover(accelerators=4)
    assert devices.accelerator.group == ()  # one accelerator: no group


# A fresh process: compiles one program under ``configure_runtime`` and prints the cache folder
# JAX was given and whether a second process's compile of it was a cache hit (jax's own log).
CACHE_PROBE = """
import logging, io, jax, jax.numpy as jnp
from hx.devices import configure_runtime
configure_runtime()
log = io.StringIO()
handler = logging.StreamHandler(log)
logging.getLogger("jax._src.compiler").addHandler(handler)
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
jax.jit(lambda x: jnp.tanh(x @ x.T) + 3.25)(jnp.ones((8, 8))).block_until_ready()
print(jax.config.jax_compilation_cache_dir, "cache hit" in log.getvalue().lower())
"""


def test_compiled_programs_persist_across_processes_unless_turned_off(tmp_path):
    """``HX_XLA_CACHE``: a folder, where the first process's program is written and a second
    process loads it instead of compiling (JAX's log says so); ``off``: no cache at all."""
    def probe(value: str) -> list[str]:
        env = {**os.environ, "HX_XLA_CACHE": value}
        out = subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        return out.stdout.split()

    folder = str(tmp_path / "xla")
    assert probe(folder) == [folder, "False"] and os.listdir(folder)
    assert probe(folder) == [folder, "True"]
    assert probe("off") == ["None", "False"]
