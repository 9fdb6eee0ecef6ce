"""A wheel holds every file of the package (its modules and subpackages, and the files it
opens beside them: the grammar, the Triton template, the native operator's source, the
shipped specs), and an sdist every file of the repository (the tests read docs/, bench/ and
.ci/run beside the package). Both are built from a copy of the tracked files by setuptools,
as ``pip wheel --no-build-isolation`` and ``python -m build --sdist`` would (a few seconds);
the tests skip outside a git checkout or without setuptools."""
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one hook a process: setuptools keeps state between builds in one process
BUILD = """
import sys
from setuptools import build_meta
print("built:", getattr(build_meta, sys.argv[1])(sys.argv[2]))  # (setuptools talks on stdout too)
"""


def _tracked() -> list[str]:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: which files are the package's is git's to say")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    setuptools = pytest.importorskip("setuptools")
    pytest.importorskip("setuptools.build_meta")
    have = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    needs = re.search(r'requires = \["setuptools>=(\d+)', (ROOT / "pyproject.toml").read_text())
    if have < (int(needs[1]),):
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build's "
                    f"setuptools>={needs[1]}")
    files = _tracked()
    src = tmp_path_factory.mktemp("src")
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = src / "dist"
    made = []
    for hook in ("build_wheel", "build_sdist"):
        run = subprocess.run([sys.executable, "-c", BUILD, hook, str(out)], cwd=src,
                             capture_output=True, text=True, timeout=300,
                             stdin=subprocess.DEVNULL)
        assert run.returncode == 0, run.stderr[-3000:]
        # what setuptools says it will stop accepting (a license written as a table: "By
        # 2027-Feb-18, you need to update your project") would fail a later install
        assert "Deprecat" not in run.stderr, run.stderr[-3000:]
        made.append(next(line for line in run.stdout.splitlines()
                         if line.startswith("built: ")).split()[1])
    wheel, sdist = made
    return files, out / wheel, out / sdist


def test_the_wheel_holds_every_file_of_the_package(built):
    files, wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    # specs/ is installed as vega.specs (pyproject.toml's package-dir)
    wanted = {f if f.startswith("vega/") else "vega/" + f for f in files
              if f.startswith(("vega/", "specs/"))}
    assert sorted(wanted - names) == []
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} \
        == {"vega"}
    assert "vega = vega.cli:main" in entry_points
    # the version vega says it is (vega bench prints it) is the one it is installed as
    import vega
    assert wheel.name.startswith(f"vega-{vega.__version__}-"), (wheel.name, vega.__version__)


def test_the_sdist_holds_every_file_of_the_repository(built):
    files, _, sdist = built
    with tarfile.open(sdist) as t:
        names = {n.partition("/")[2] for n in t.getnames()}
    assert sorted(set(files) - {".gitignore"} - names) == []
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_the_wheel_is_marked_typed(built):
    # PEP 561: without vega/py.typed in the installed package, mypy and pyright skip vega's
    # annotations ('module is installed, but missing library stubs or py.typed marker', an
    # error on `import vega` under mypy's defaults) and every vega name is Any to them
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        assert "vega/py.typed" in z.namelist()


def test_every_subpackage_is_found_by_the_tools_that_walk_the_package():
    # vega.runtime had no __init__.py (a namespace package): pkgutil.walk_packages, which
    # stubgen -p vega, pdoc and Sphinx's autosummary walk, did not list it, so stubgen's
    # stubs of vega held none of its 11 modules (CompiledSpec, LossScale, the optimizer
    # classes, L-BFGS, the state files), which the stubs of vega itself import from
    import pkgutil

    import vega
    found = {m.name for m in pkgutil.walk_packages(vega.__path__, "vega.")}
    for folder in sorted((ROOT / "vega").rglob("*.py")):
        rel = folder.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if name not in ("vega", "vega.__main__"):
            assert name in found, name
