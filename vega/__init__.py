"""Vega: optimizers written as specs, compiled to fused kernels for PyTorch.

The functional API follows the OCaml library Vega: ``vega.<name>_init(params)``
and ``vega.<name>_step(params, grads, state, **hypers)``; ``vega.optim`` has the
``torch.optim`` classes; ``vega.compile`` compiles your own spec.

- the shipped specs: ``vega.<name>`` (a :class:`CompiledSpec`), ``vega.<name>_init``,
  ``vega.<name>_step`` for each of ``builtin_names()``; ``lbfgs_init``, ``lbfgs_step``;
- your own: ``compile``, ``compile_file`` (``SpecError`` on a mistake; every error
  vega raises on purpose is a ``VegaError``);
- gradients: ``global_norm``, ``clip_by_global_norm``, ``clip_by_value``,
  ``grads_finite``; loss scaling: ``LossScale``;
- learning-rate schedules: ``vega.schedule``;
- states: ``state_names``, ``get_leaf``, ``set_leaf``, ``save``, ``load``.
"""
from typing import Any as _Any

from vega import optim, schedule
from vega.errors import SpecError, VegaError
from vega.runtime.io import get_leaf, load, save, set_leaf
from vega.runtime.lbfgs import lbfgs_init, lbfgs_step
from vega.runtime.library import builtin, builtin_names
from vega.runtime.loss_scale import LossScale, grads_finite
from vega.runtime.transforms import clip_by_global_norm, clip_by_value, global_norm
from vega.runtime.spec import CompiledSpec, compile, compile_file
from vega.runtime.tree import state_names

# The shipped specs (the files of specs/, listed, not parsed), each compiled when one of its
# names is first used (``__getattr__``): vega.<name> (its CompiledSpec), vega.<name>_init
# and vega.<name>_step.
_SHIPPED = tuple(builtin_names())
_LAZY = {name + suffix: (name, attr) for name in _SHIPPED
         for suffix, attr in (("", None), ("_init", "init"), ("_step", "step"))}


def __getattr__(name: str) -> _Any:  # (a CompiledSpec, or its init or step, by the name)
    found = _LAZY.get(name)
    if found is None:
        raise AttributeError(f"module 'vega' has no attribute {name!r}")
    spec = builtin(found[0])
    value = spec if found[1] is None else getattr(spec, found[1])
    globals()[name] = value  # (found directly from now on)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "CompiledSpec", "SpecError", "VegaError", "builtin", "builtin_names", "compile",
    "compile_file", "optim", "state_names", "schedule", "LossScale", "grads_finite",
    "save", "load", "get_leaf", "set_leaf",
    "clip_by_global_norm", "clip_by_value", "global_norm", "lbfgs_init", "lbfgs_step",
    *_LAZY,
]
