"""Vega: optimizers written as specs, compiled to fused kernels for PyTorch.

The functional API follows the OCaml library Vega: ``vega.<name>_init(params)``
and ``vega.<name>_step(params, grads, state, **hypers)``; ``vega.optim`` has the
``torch.optim`` classes; ``vega.compile`` compiles your own spec.
"""
from vega import optim, schedule
from vega.errors import SpecError, VegaError
from vega.runtime.io import get_leaf, load, save, set_leaf
from vega.runtime.lbfgs import lbfgs_init, lbfgs_step
from vega.runtime.library import builtin, builtin_names
from vega.runtime.loss_scale import LossScale, grads_finite
from vega.runtime.transforms import clip_by_global_norm, clip_by_value, global_norm
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

radam = builtin("radam")
radam_init = radam.init
radam_step = radam.step

lamb = builtin("lamb")
lamb_init = lamb.init
lamb_step = lamb.step

lars = builtin("lars")
lars_init = lars.init
lars_step = lars.step

lion = builtin("lion")
lion_init = lion.init
lion_step = lion.step

adagrad = builtin("adagrad")
adagrad_init = adagrad.init
adagrad_step = adagrad.step

rmsprop = builtin("rmsprop")
rmsprop_init = rmsprop.init
rmsprop_step = rmsprop.step

adan = builtin("adan")
adan_init = adan.init
adan_step = adan.step

adafactor = builtin("adafactor")
adafactor_init = adafactor.init
adafactor_step = adafactor.step

__version__ = "0.1.0"

__all__ = [
    "CompiledSpec", "SpecError", "VegaError", "builtin", "builtin_names", "compile",
    "compile_file", "optim", "state_names", "schedule", "LossScale", "grads_finite",
    "save", "load", "get_leaf", "set_leaf",
    "clip_by_global_norm", "clip_by_value", "global_norm", "lbfgs_init", "lbfgs_step",
    "sgd", "sgd_init", "sgd_step", "adam", "adam_init", "adam_step",
    "adamw", "adamw_init", "adamw_step",
    "radam", "radam_init", "radam_step",
    "lamb", "lamb_init", "lamb_step",
    "lars", "lars_init", "lars_step",
    "lion", "lion_init", "lion_step",
    "adagrad", "adagrad_init", "adagrad_step",
    "rmsprop", "rmsprop_init", "rmsprop_step",
    "adan", "adan_init", "adan_step",
    "adafactor", "adafactor_init", "adafactor_step",
]
