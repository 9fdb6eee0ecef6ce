"""Helpers every backend and the runtime share: the step counters' advance, and a memo of
work done once per distinct tensor within one call."""
from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1


def advance_steps(steps, finite, donate):
    """Each distinct step counter plus one (saturating; not on a skipped step)."""
    def advance(step):
        inc = (step < INT32_MAX).to(step.dtype)
        if finite is not None:
            inc = inc * finite.to(step.dtype)
        return step.add_(inc) if donate else step + inc
    done: dict = {}
    compiling = torch.compiler.is_compiling()
    return [memo(done, (step,), (), advance, step, compiling=compiling) for step in steps]


def memo(seen: dict, objs: tuple, plain: tuple, make, *args, compiling: bool | None = None):
    """``make(*args)``, once per distinct ``objs`` (by identity) and ``plain`` (by equality).

    Eagerly a dict keyed by ``id``; under ``torch.compile`` a scan by ``is``: there
    the ``id`` of an input tensor guards on that very tensor, and each new step
    counter (a new state) would recompile. ``compiling`` saves asking, in loops.
    """
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if compiling:
        for known, known_plain, value in seen.values():
            if known_plain == plain and len(known) == len(objs) \
                    and all(a is b for a, b in zip(known, objs, strict=True)):
                return value
        key = len(seen)
    else:
        key = (*map(id, objs), *plain)
        if key in seen:
            return seen[key][2]
    value = make(*args)
    seen[key] = (objs, plain, value)  # holding objs keeps their ids from being reused
    return value
