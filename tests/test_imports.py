"""Imports have no side effects; the planner imports neither JAX, Flax nor the executor (each
check in a fresh interpreter: this one has JAX loaded already, and in its source); hx's modules
import one another without a cycle."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from hx.devices import PREALLOCATE_ENV

HEAVY = ("jax", "jaxlib", "flax")
# what no module of planner/ imports, at any level (measuring is hx.measure's)
NOT_IN_PLANNER = (*HEAVY, "hx.executor", "hx.programs", "hx.measure")
ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"hx": "hx", "models": "hx.models", "planner": "hx.planner",
           "host_compute": "hx.host_compute"}  # source folder -> its import name


def modules() -> dict[str, Path]:
    """Every module of the four source folders by its import name (a package's
    ``__init__.py`` by the package's)."""
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((name, *parts)).removesuffix(".__init__")] = path
    return found


def imported(path: Path, name: str, type_checking: bool = True) -> list[tuple[str, int]]:
    """(module name, line) of every import in the module ``name`` at ``path``, at any level of
    nesting (in functions too); ``type_checking=False`` leaves out ``if TYPE_CHECKING:``
    blocks. ``from A import b`` names ``A.b`` (``resolve`` decides whether that is a module)."""
    found: list[tuple[str, int]] = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and (
                    ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                source = child.module
                if child.level:  # relative to this package, or to one above it
                    anchor = package.rsplit(".", child.level - 1)[0]
                    source = f"{anchor}.{source}" if source else anchor
                found.extend((f"{source}.{alias.name}", child.lineno) for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module of ``known`` an import of ``target`` loads: the longest prefix of it that is
    one (``from hx.planner import policies`` loads the module ``hx.planner.policies``; ``from
    hx.plan import ExecutionPlan`` the module ``hx.plan``); None outside hx."""
    parts = target.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                 if ".".join(parts[:n]) in known), None)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold a cycle: more than one module,
    or one that imports itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter (without a preallocation setting of the user's); it
    leaves a JSON-able ``result``."""
    script = f"import json, os, sys\n{code}\nprint(json.dumps(result))"
    env = {k: v for k, v in os.environ.items() if k != PREALLOCATE_ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_planner_imports_without_jax_flax_or_the_executor():
    """Every module of planner/ (and hx.memory, hx.schedule, which it plans with), imported in
    one fresh interpreter, loads none of ``NOT_IN_PLANNER``."""
    planner = sorted(name for name in modules() if name.startswith("hx.planner"))
    assert "hx.planner.cpsat" in planner
    result = fresh(f"import {', '.join([*planner, 'hx.memory', 'hx.schedule'])}\n"
                   f"result = [m for m in {NOT_IN_PLANNER} if m in sys.modules]")
    assert result == []


def test_no_planner_module_imports_jax_or_the_executor_even_in_a_function():
    """No import of ``NOT_IN_PLANNER`` anywhere in planner/'s source, in functions and
    ``TYPE_CHECKING`` blocks too: a lazy import would load it at its first call."""
    known = modules()
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for name, path in known.items() if name.startswith("hx.planner")
             for target, line in imported(path, name)
             if any(target == m or target.startswith(m + ".") for m in NOT_IN_PLANNER)]
    assert not found, "\n".join(found)


def test_no_import_cycle_among_hx_modules():
    """The import graph of every module of hx/, models/, planner/ and host_compute/ -- each
    import at any level, in functions too, but not in ``TYPE_CHECKING`` blocks -- has no cycle
    (a strongly connected component of more than one module, or a module importing itself)."""
    known = modules()
    edges = {name: {(target, line) for target, line in
                    ((resolve(t, known), line) for t, line in imported(path, name, False))
                    if target is not None} for name, path in known.items()}
    graph = {name: {target for target, _ in out} for name, out in edges.items()}
    assert "hx.planner.policies" in graph["hx.planner.grid"]  # ``from hx.planner import ...``
    found = [[f"{known[a].relative_to(ROOT)}:{line}: {a} -> {b}"
              for a in component for b, line in sorted(edges[a]) if b in component]
             for component in cycles(graph)]
    assert not found, "import cycles:\n" + "\n\n".join("\n".join(c) for c in found)


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
