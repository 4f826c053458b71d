"""The ``hx`` command line (typer + rich): ``generate``, ``bench``, ``profile``, ``plan``,
``ablate``, ``simulate``, ``expert-trace``.

Every ``HxError`` becomes one line on stderr and exit status 2, without a traceback. XLA's
C++ log lines are off (``TF_CPP_MIN_LOG_LEVEL=3`` unless the environment sets it): sizing a
plan compiles segments it may never run, and XLA:GPU logs an error-level line for some of them
(an H100 printed one when a Llama-2-70B segment's arguments exceeded its scheduler's memory
limit); failures that matter raise, and hx reports them.

Importing the package loads nothing but ``mesh`` (plain Python) and sets nothing: ``main``
registers the commands, so a script can use ``hx.cli.console`` alone.
"""

from __future__ import annotations

import os
import sys

from hx.cli.mesh import mesh_shape


def main() -> None:
    """Console-script entry point: turn XLA's C++ log lines off, register the commands,
    configure the runtime (``hx.devices.configure_runtime``) before any command computes with
    JAX and the help's width when piped (``console.widen_piped_help``), then run the app,
    turning ``HxError`` into exit status 2."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before XLA first logs
    from hx.cli import bench, experts, generate, planning, simulate  # noqa: F401  (commands)
    from hx.cli.common import app, err
    from hx.cli.console import widen_piped_help
    from hx.devices import configure_runtime
    from hx.errors import HxError

    configure_runtime(1 + _accelerators(sys.argv[1:]))
    widen_piped_help()
    try:
        app()
    except HxError as e:
        err.print(f"hx: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


def _accelerators(argv: list[str]) -> int:
    """The accelerators the command line asks of this process: ``--devices N``, or tp x pp of
    ``--mesh tp=A,pp=B`` (tp with ``--coordinator``: one stage per process); 1 without either,
    or with one that does not parse (the command's own parsing reports that). Emulated
    accelerators are CPU devices, which XLA creates when JAX starts, before any command's
    options are parsed."""
    for i, arg in enumerate(argv):
        for flag in ("--devices", "--mesh"):
            value = (arg.split("=", 1)[1] if arg.startswith(flag + "=") else
                     argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if value is None:
                continue
            if flag == "--devices" and value.isdigit() and int(value) > 0:
                return int(value)
            if flag == "--mesh":
                try:
                    tp, pp = mesh_shape(value)
                except ValueError:
                    continue
                distributed = any(a.split("=")[0] == "--coordinator" for a in argv)
                return tp if distributed else tp * pp  # several processes: a stage each
    return 1


if __name__ == "__main__":
    main()
