"""The specs that ship with vega (``specs/*.vega``, installed as ``vega.specs``)."""
from __future__ import annotations

import threading
from functools import cache
from importlib.resources import files

from vega.runtime.spec import CompiledSpec, compile


def _dir():
    return files("vega.specs")


def builtin_names() -> list[str]:
    """The names of the shipped specs, sorted."""
    return sorted(f.name[:-5] for f in _dir().iterdir() if f.name.endswith(".vega"))


_LOCK = threading.Lock()  # a spec first used from two threads at once is compiled once


def builtin(name: str) -> CompiledSpec:
    """A shipped spec, compiled once, on first use."""
    with _LOCK:
        return _compiled(name)


@cache
def _compiled(name: str) -> CompiledSpec:
    if name not in builtin_names():
        raise ValueError(f"no shipped optimizer {name!r}; there are {', '.join(builtin_names())}")
    path = _dir().joinpath(f"{name}.vega")
    return compile(path.read_text(), f"specs/{name}.vega")
