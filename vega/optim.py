"""``torch.optim``-compatible classes for the shipped specs.

Each is a real ``torch.optim.Optimizer``: param groups with their own
hyperparameters, ``state_dict`` / ``load_state_dict``, ``zero_grad``.
"""
from vega.runtime.lbfgs import LBFGS
from vega.runtime.library import builtin
from vega.runtime.optimizer import SpecOptimizer

SGD = builtin("sgd").optimizer_class
Adam = builtin("adam").optimizer_class
AdamW = builtin("adamw").optimizer_class
RAdam = builtin("radam").optimizer_class
LAMB = builtin("lamb").optimizer_class
LARS = builtin("lars").optimizer_class
Lion = builtin("lion").optimizer_class
Adagrad = builtin("adagrad").optimizer_class
RMSprop = builtin("rmsprop").optimizer_class
Adan = builtin("adan").optimizer_class
Adafactor = builtin("adafactor").optimizer_class

__all__ = ["SpecOptimizer", "SGD", "Adam", "AdamW", "RAdam", "LAMB", "LARS", "Lion", "Adagrad",
           "RMSprop", "Adan", "Adafactor", "LBFGS"]
