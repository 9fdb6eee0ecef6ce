"""``torch.optim``-compatible classes for the shipped specs.

Each is a real ``torch.optim.Optimizer``: param groups with their own
hyperparameters, ``state_dict`` / ``load_state_dict``, ``zero_grad``. A class
compiles its spec when first used, not when ``vega.optim`` is imported.
"""
from typing import Any as _Any

from vega.runtime.lbfgs import LBFGS
from vega.runtime.library import builtin
from vega.runtime.optimizer import SpecOptimizer

# each class is made when first used (``__getattr__``): the shipped spec it steps
_SPECS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw", "RAdam": "radam", "LAMB": "lamb",
          "LARS": "lars", "Lion": "lion", "Adagrad": "adagrad", "RMSprop": "rmsprop",
          "Adan": "adan", "Adafactor": "adafactor", "Adamax": "adamax", "Adadelta": "adadelta",
          "Rprop": "rprop", "Yogi": "yogi", "AdaBelief": "adabelief", "AdamAtan2": "adam_atan2",
          "ADOPT": "adopt", "AdEMAMix": "ademamix", "NAdam": "nadam", "NovoGrad": "novograd",
          "Prodigy": "prodigy", "ScheduleFreeAdamW": "schedule_free_adamw", "Muon": "muon",
          "DAdaptAdamW": "dadapt_adamw"}


# (-> Any: each class is a SpecOptimizer subclass, but typed type[SpecOptimizer], an
# optimizer's loss_scale is LossScale | None to a checker, which then refuses the README's
# opt.loss_scale.scale(loss) of one made with a loss_scale; Any leaves the classes unchecked)
def __getattr__(name: str) -> _Any:
    spec = _SPECS.get(name)
    if spec is None:
        raise AttributeError(f"module 'vega.optim' has no attribute {name!r}")
    cls = globals()[name] = builtin(spec).optimizer_class  # (found directly from now on)
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *_SPECS})


__all__ = ["SpecOptimizer", *_SPECS, "LBFGS"]
