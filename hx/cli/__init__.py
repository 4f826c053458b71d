"""The ``hx`` command line (typer + rich): ``generate``, ``bench``, ``profile``, ``plan``,
``ablate``.

Every ``HxError`` becomes one line on stderr and exit status 2, without a traceback. XLA's
C++ log lines are off (``TF_CPP_MIN_LOG_LEVEL=3`` unless the environment sets it): sizing a
plan compiles segments it may never run, and XLA:GPU logs an error-level line for some of them
(an H100 printed one when a Llama-2-70B segment's arguments exceeded its scheduler's memory
limit); failures that matter raise, and hx reports them.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before XLA first logs

from hx.cli import bench, generate, planning, simulate  # noqa: E402,F401  (register the commands)
from hx.cli.common import app, err  # noqa: E402
from hx.cli.console import widen_piped_help  # noqa: E402
from hx.devices import configure_runtime  # noqa: E402
from hx.errors import HxError  # noqa: E402


def main() -> None:
    """Console-script entry point: configure the runtime (``hx.devices.configure_runtime``)
    before any command computes with JAX and the help's width when piped
    (``console.widen_piped_help``), then run the app, turning ``HxError`` into exit status
    2."""
    configure_runtime()
    widen_piped_help()
    try:
        app()
    except HxError as e:
        err.print(f"hx: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
