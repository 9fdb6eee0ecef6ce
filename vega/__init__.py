"""Vega: optimizers written as specs, compiled to fused kernels for PyTorch.

The functional API follows the OCaml library Vega: ``vega.<name>_init(params)``
and ``vega.<name>_step(params, grads, state, **hypers)``; ``vega.optim`` has the
``torch.optim`` classes; ``vega.compile`` compiles your own spec.
"""
from vega import optim
from vega.errors import SpecError, VegaError
from vega.runtime.library import builtin, builtin_names
from vega.runtime.spec import CompiledSpec, compile, compile_file
from vega.runtime.tree import state_names

sgd = builtin("sgd")
sgd_init = sgd.init
sgd_step = sgd.step

adam = builtin("adam")
adam_init = adam.init
adam_step = adam.step

adamw = builtin("adamw")
adamw_init = adamw.init
adamw_step = adamw.step

__version__ = "0.1.0"

__all__ = [
    "CompiledSpec", "SpecError", "VegaError", "builtin", "builtin_names", "compile",
    "compile_file", "optim", "state_names",
    "sgd", "sgd_init", "sgd_step", "adam", "adam_init", "adam_step",
    "adamw", "adamw_init", "adamw_step",
]
