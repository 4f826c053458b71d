"""The ``hx`` command line (typer + rich): ``generate``, ``bench``, ``profile``, ``plan``,
``ablate``.

Every ``HxError`` becomes one line on stderr and exit status 2, without a traceback.
"""

from __future__ import annotations

import sys

from hx.cli import bench, generate, planning  # noqa: F401  (register the commands)
from hx.cli.common import app, err
from hx.errors import HxError


def main() -> None:
    """Console-script entry point: run the app, turning ``HxError`` into exit status 2."""
    try:
        app()
    except HxError as e:
        err.print(f"hx: error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
