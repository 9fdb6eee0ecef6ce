"""``torch.optim``-compatible classes for the shipped specs.

Each is a real ``torch.optim.Optimizer``: param groups with their own
hyperparameters, ``state_dict`` / ``load_state_dict``, ``zero_grad``.
"""
from vega.runtime.library import builtin
from vega.runtime.optim import SpecOptimizer

SGD = builtin("sgd").optimizer_class
Adam = builtin("adam").optimizer_class
AdamW = builtin("adamw").optimizer_class

__all__ = ["SpecOptimizer", "SGD", "Adam", "AdamW"]
