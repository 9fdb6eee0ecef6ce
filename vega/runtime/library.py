"""The specs that ship with vega (``specs/*.vega``, installed as ``vega.specs``)."""
from __future__ import annotations

import os
import threading
from functools import cache
from importlib.resources import files
from pathlib import Path

from vega.errors import shown
from vega.runtime.spec import CompiledSpec, compile

_TREE = Path(__file__).resolve().parents[2]  # the directory that holds this package, vega/


@cache
def _dir():
    """The shipped specs: ``specs/`` beside the package where it is a source checkout's (its
    ``vega.specs``, pyproject.toml's mapping of ``specs/``, exists only where a checkout is
    installed, and may be another checkout's: one installed in editable mode while this one
    is on PYTHONPATH), else the installed ``vega.specs``."""
    beside = _TREE / "specs"
    if (_TREE / "pyproject.toml").is_file() and (beside / "__init__.py").is_file():
        return beside
    return files("vega.specs")


def builtin_names() -> list[str]:
    """The names of the shipped specs, sorted."""
    return sorted(f.name[:-5] for f in _dir().iterdir() if f.name.endswith(".vega"))


_LOCK = threading.Lock()  # a spec first used from two threads at once is compiled once


def _forked() -> None:
    """In a child made by ``os.fork``: a new lock, as one that another thread of the parent
    held at the fork (compiling a spec) would be held in the child for ever."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def builtin(name: str) -> CompiledSpec:
    """A shipped spec, compiled once, on first use; ``ValueError``, naming the shipped ones,
    for a name that is not one of :func:`builtin_names`."""
    if not isinstance(name, str):  # (before the cache, which would hash it)
        _unknown(name)
    with _LOCK:
        return _compiled(name)


def _unknown(name):
    raise ValueError(f"no shipped optimizer {shown(name)}; there are "
                     f"{', '.join(builtin_names())}")


@cache
def _compiled(name: str) -> CompiledSpec:
    if name not in builtin_names():
        _unknown(name)
    path = _dir().joinpath(f"{name}.vega")
    return compile(path.read_text(), f"specs/{name}.vega")


def shipped(spec: CompiledSpec) -> bool:
    """Whether ``spec`` is ``builtin(spec.name)`` (not another spec of a shipped name)."""
    with _LOCK:
        return spec.name in builtin_names() and spec is _compiled(spec.name)
