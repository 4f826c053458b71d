"""The wheel holds every module of the four source folders under its ``hx.*`` name, and the
``hx`` command runs from a non-editable install of it."""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"hx": "hx", "models": "hx/models", "planner": "hx/planner",
           "host_compute": "hx/host_compute"}  # source folder -> its place in the wheel


def sources() -> set[str]:
    """Wheel paths the .py files of the four folders must have."""
    return {f"{dest}/{path.relative_to(ROOT / folder).as_posix()}"
            for folder, dest in FOLDERS.items()
            for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts}


def test_wheel_holds_every_module_and_the_cli_runs_installed(tmp_path):
    # Build from a copy, so the build/ and *.egg-info it writes stay out of the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("hx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sources() - names == set()

    site_dir = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(site_dir), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    # -S: no site-packages .pth files, so an editable install of hx (whose import finder would
    # supply any module the wheel lacks from the checkout) is not loaded; the dependencies come
    # from PYTHONPATH and site-packages, after the installed wheel. cwd is outside the checkout
    # so its folders do not shadow the wheel either.
    path = [str(site_dir), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
            *site.getsitepackages()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))

    def run(code, *args):
        return subprocess.run([sys.executable, "-S", "-c", code, *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    modules = sorted(n[:-len(".py")].replace("/", ".").removesuffix(".__init__")
                     for n in names if n.endswith(".py") and not n.endswith("__main__.py"))
    where = run("import importlib, sys\n"
                "for m in sys.argv[1:]: print(importlib.import_module(m).__file__)", *modules)
    assert where.returncode == 0, where.stderr
    files = where.stdout.split()
    assert len(files) == len(modules)
    assert all(Path(f).is_relative_to(site_dir) for f in files), files

    result = run("import sys; sys.argv[0] = 'hx'; from hx.cli import main; main()", "--help")
    assert result.returncode == 0, result.stderr
    for command in ("generate", "bench", "profile", "plan", "ablate"):
        assert command in result.stdout, result.stdout
