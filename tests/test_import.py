"""Importing vega compiles nothing; the shipped optimizers are built when first used."""
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vega
import vega.optim
from vega.runtime.library import builtin, builtin_names

# whether the spec grammar was ever built (a spec's first parse builds it) and how many
# shipped specs were compiled, after importing vega, then after naming one step
PROBE = """
import json
import vega, vega.optim
from vega.dsl import parser
from vega.runtime import library
seen = [(parser._parser.cache_info().currsize, library._compiled.cache_info().currsize)]
vega.adamw_step
seen.append((parser._parser.cache_info().currsize, library._compiled.cache_info().currsize))
print(json.dumps(seen))
"""


def test_import_parses_no_spec():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True)
    at_import, after_use = json.loads(out.stdout.splitlines()[-1])
    assert at_import == [0, 0], "import vega parsed or compiled a spec"
    assert after_use == [1, 1]  # (the probe sees a compile: naming a step is one)


def test_shipped_names_resolve():
    assert set(vega.__all__) <= set(dir(vega))
    assert set(vega.optim.__all__) <= set(dir(vega.optim))
    names = sorted(n for n in vega.__all__ if n.endswith("_step") and n != "lbfgs_step")
    assert names == sorted(f"{n}_step" for n in builtin_names())
    from vega import adamw_step
    assert adamw_step == builtin("adamw").step and vega.adamw is builtin("adamw")
    made = [n for n in vega.optim.__all__ if n not in ("SpecOptimizer", "LBFGS")]
    assert sorted(getattr(vega.optim, n).spec.name for n in made) == builtin_names()
    for name in made:
        cls = getattr(vega.optim, name)
        assert cls.__name__ == name and cls.__module__ == "vega.optim"


def test_a_lazily_made_class_pickles():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = vega.optim.Lion([p], lr=0.1, backend="reference")
    opt.step()
    back = pickle.loads(pickle.dumps(opt))
    assert type(back) is vega.optim.Lion
    assert torch.equal(back.param_groups[0]["params"][0], p)


WITHOUT_TRITON = r"""
import json, sys
sys.modules["triton"] = None  # its import fails, as where it is not installed (not Linux)
import torch, vega
p = torch.nn.Parameter(torch.ones(4))
p.grad = torch.ones(4)
vega.optim.SGD([p], lr=0.5, backend="reference").step()
try:
    vega.optim.SGD([p], lr=0.5, backend="triton")
    said = None
except ValueError as e:
    said = str(e)
print(json.dumps({"p": p.tolist(), "said": said}))
"""


def test_vega_imports_and_steps_without_triton():
    # vega asks for triton on Linux only; elsewhere backend='triton' says it is not installed
    # (it said "not available in this version of vega")
    run = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = json.loads(run.stdout.splitlines()[-1])
    assert ran["p"] == [0.5] * 4
    assert ran["said"] is not None and "triton package, which is not installed" in ran["said"]
    assert "available: 'reference', 'c'" in ran["said"]


def test_a_checkout_on_the_path_compiles_its_own_specs(tmp_path):
    # specs/ is installed as vega.specs (pyproject.toml's package-dir): a checkout only on
    # PYTHONPATH had none (import vega failed), or another checkout's, where that one was
    # installed in editable mode, whose specs it then compiled in place of its own
    root = Path(vega.__file__).resolve().parents[1]
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / "vega", tmp_path / "vega", ignore=ignore)
    shutil.copytree(root / "specs", tmp_path / "specs", ignore=ignore)
    shutil.copy(root / "pyproject.toml", tmp_path)
    adamw = tmp_path / "specs" / "adamw.vega"
    adamw.write_text(adamw.read_text().replace("lr = 1e-3 in", "lr = 7e-3 in", 1))
    code = "import vega; print(dict((h.name, h.default) for h in vega.adamw.hypers)['lr'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split()[-1]) == 7e-3


def test_builtin_refuses_a_name_that_is_not_a_shipped_ones_string():
    # (as its docstring says: ValueError naming the shipped ones; a list was an unhashable
    # TypeError from the cache, that named neither the argument nor the names)
    for name in ("nonesuch", ["adam"], None, {"adam": 1}):
        with pytest.raises(ValueError, match=r"no shipped optimizer .*; there are adabelief"):
            vega.builtin(name)
    assert "ValueError" in vega.builtin.__doc__


# The modules that only torch.compile needs (dynamo loads them all: sympy, triton, FSDP and
# DTensor); vega marks its constants for dynamo from inside a trace (vega.tracing)
COMPILE_ONLY = ("torch._dynamo", "torch._inductor", "sympy", "triton",
                "torch.distributed.tensor", "torch.fx.experimental.symbolic_shapes")
LOADED = r"""
import contextlib, io, json, sys
import torch
names = %r
seen = {"torch": [m for m in names if m in sys.modules]}
import vega, vega.optim
from vega import cli
seen["import vega"] = [m for m in names if m in sys.modules]
for argv in (["list"], ["show", "adamw"]):
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(argv) == 0
p, g = torch.ones(5), torch.ones(5)
vega.adamw_step([p], [g], vega.adamw_init([p]), lr=0.1)
seen["vega list, vega show adamw, an eager step"] = [m for m in names if m in sys.modules]
print(json.dumps(seen))
"""


def test_import_and_eager_use_load_no_compiler_modules():
    # import vega loaded dynamo (vega.tracing and vega.codegen marked their constants for it
    # at import), and with it sympy, triton and torch.distributed.tensor: 1.5 s of a CPU
    # more than torch itself, in every vega command and every process that imports vega
    run = subprocess.run([sys.executable, "-c", LOADED % (COMPILE_ONLY,)], capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    torch_own = set(seen.pop("torch"))
    for after, loaded in seen.items():
        assert set(loaded) - torch_own == set(), f"{after}: loaded {sorted(loaded)}"


def test_a_class_name_of_vega_or_vega_optim_is_one_it_exports():
    # (typing's Any, imported at the top of both for their __getattr__, was vega.optim.Any
    # in dir(vega.optim) and completion, among the optimizer classes, and vega.Any)
    import vega.optim
    for module in (vega, vega.optim):
        names = [n for n in dir(module) if n[:1].isupper()]
        assert set(names) <= set(module.__all__), (module.__name__, names)
