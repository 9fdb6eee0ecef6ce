"""torch.optim's keywords on the optimizer classes: ``betas``, ``maximize``, ``foreach``,
``fused``, ``capturable`` and ``differentiable``.

``betas`` is a second name for a spec's ``b1``, ``b2``, ... (the hyperparameters a spec
names so): a group holds both, and whichever a caller (or a torch LR scheduler, as
``OneCycleLR(cycle_momentum=True)``) changes, the other follows at the next step.
"""
from __future__ import annotations

import numbers

import torch

from vega.runtime import engine

# torch's keywords that choose among its implementations; vega has one, fused
_IMPLEMENTATION_KEYWORDS = ("foreach", "fused", "capturable")


def beta_names(spec) -> tuple[str, ...]:
    """The spec's ``b1``, ``b2``, ... in order (``betas`` names them), or () for none."""
    names = {h.name for h in spec.hypers}
    out: list[str] = []
    while f"b{len(out) + 1}" in names:
        out.append(f"b{len(out) + 1}")
    return tuple(out)


def _same(x, y) -> bool:
    """The same value: the same object, or equal plain numbers."""
    if x is y:
        return True
    plain = (isinstance(x, numbers.Real) and isinstance(y, numbers.Real)
             and not isinstance(x, bool) and not isinstance(y, bool))
    return plain and x == y


def same_betas(a, b) -> bool:
    return len(a) == len(b) and all(map(_same, a, b))


def _shown_betas(names) -> str:
    return f"({', '.join(names)})"


def split_betas(owner: str, names: tuple, betas, given: dict) -> dict:
    """``betas`` as ``{b1: ..., b2: ...}``; ValueError where it is not a sequence of
    ``len(names)`` values, or where it disagrees with a value ``given`` by its own name."""
    if not isinstance(betas, (tuple, list)) or len(betas) != len(names):
        raise ValueError(f"{owner}: betas={engine.shown(betas)} must be a tuple of "
                         f"{len(names)} values, {_shown_betas(names)}")
    out = dict(zip(names, betas))
    for name in names:
        if name in given and not _same(given[name], out[name]):
            raise ValueError(f"{owner}: betas={engine.shown(tuple(betas))} and "
                             f"{name}={engine.shown(given[name])} disagree; betas is "
                             f"{_shown_betas(names)}: give one of the two")
    return out


def check_keywords(owner: str, maximize, foreach, fused, capturable, differentiable) -> None:
    """torch's keywords as torch takes them; ValueError naming one it does not, and for
    ``differentiable=True`` (a step autograd can differentiate: vega's kernels are not)."""
    if not isinstance(maximize, bool):
        raise ValueError(f"{owner}: maximize={engine.shown(maximize)} must be True or False")
    for name, value in zip(_IMPLEMENTATION_KEYWORDS, (foreach, fused, capturable)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{owner}: {name}={engine.shown(value)} must be None, True or "
                             "False (vega's step is always one fused kernel)")
    if not isinstance(differentiable, bool):
        raise ValueError(f"{owner}: differentiable={engine.shown(differentiable)} must be "
                         "True or False")
    if differentiable:
        raise ValueError(f"{owner}: differentiable=True is not supported: vega's fused step "
                         "is not differentiable by autograd; use torch.optim for a "
                         "differentiable step")


def negated(grads: list) -> list:
    """``grads`` negated (``maximize``), None kept where a parameter has no gradient: a
    new list of new tensors, as torch's foreach step negates them."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    neg = iter(torch._foreach_neg(present))
    return [None if g is None else next(neg) for g in grads]


class BetaSync:
    """The ``betas`` of each group as last seen in step with its ``b1``, ``b2``, ...: which
    of the two names a caller changed since (kept off torch's state, by the group)."""

    def __init__(self, names: tuple):
        self.names = names
        self.seen: dict[int, tuple] = {}  # id(group) -> (group, betas)

    def fill(self, owner: str, param_group: dict, defaults: dict) -> None:
        """A group being added: ``betas`` from its own names (or theirs from ``betas``),
        defaults for the rest; ValueError where the two disagree."""
        if not self.names:
            return
        given = {n: param_group[n] for n in self.names if n in param_group}
        if "betas" in param_group:
            param_group.update(split_betas(owner, self.names, param_group["betas"], given))
        param_group["betas"] = tuple(param_group.get(n, defaults[n]) for n in self.names)

    def remember(self, group: dict) -> None:
        if self.names:
            self.seen[id(group)] = (group, tuple(group["betas"]))

    def sync(self, owner: str, k: int, group: dict) -> None:
        """Make ``group``'s ``betas`` and ``b1``, ``b2``, ... agree, taking the one changed
        since the last step; ValueError where both changed to values that disagree."""
        if not self.names:
            return
        ours = tuple(group[n] for n in self.names)
        theirs = group.get("betas")
        if theirs is None:  # (a state saved before groups held betas)
            group["betas"] = ours
        elif not isinstance(theirs, (tuple, list)) or len(theirs) != len(self.names):
            raise ValueError(f"{owner}: group {k} has betas={engine.shown(theirs)}; it must be "
                             f"a tuple of {len(self.names)} values, {_shown_betas(self.names)}")
        elif not same_betas(ours, theirs):
            seen = self.seen.get(id(group))
            last = seen[1] if seen is not None and seen[0] is group else None
            if last is not None and same_betas(ours, last):  # betas changed
                group.update(zip(self.names, theirs))
            elif last is not None and same_betas(theirs, last):  # b1, b2, ... changed
                group["betas"] = ours
            else:
                mine = ", ".join(f"{n}={engine.shown(v)}" for n, v in zip(self.names, ours))
                raise ValueError(f"{owner}: group {k} has betas={engine.shown(tuple(theirs))} "
                                 f"but {mine}; betas is {_shown_betas(self.names)}: change "
                                 "one of the two")
        self.remember(group)

