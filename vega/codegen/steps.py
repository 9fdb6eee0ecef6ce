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


def drive(gens: dict, results: list, combine=None, spanning=None, group_of=None) -> None:
    """Run staged steps (``Kernel.staged``: position -> generator) together, stage by stage.

    A stage's parts are ``(how, float64 tensor)`` (how: "sum" or "max"), a reduction of one
    tensor whose values lie on several processes, or ``(how, tensor, key)``, one part of a
    reduction over every tensor of a group (``global_sum``; ``key`` names the reduction,
    the same in every program of a spec). The first are combined over processes by
    ``combine(parts)``; the second are first summed (or their maximum taken, a NaN
    winning) over the tensors of their group (``group_of[position]``, 0 for all where
    None), then combined over processes by ``spanning(parts)`` (None: by ``combine``, in
    the same call), and every part is given back its group's total. ``combine`` None:
    nothing spans processes."""
    asked = {}
    for k, gen in gens.items():
        try:
            asked[k] = gen.send(None)
        except StopIteration as done:
            results[k] = done.value
    while asked:
        order = list(asked)
        entries = [(k, part) for k in order for part in asked[k]]
        own = [part[:2] for _, part in entries if len(part) == 2 or part[2] is None]
        totals: dict = {}
        for k, part in entries:
            if len(part) == 3 and part[2] is not None:
                how, x, key = part
                key = (group_of[k] if group_of is not None else 0, key)
                here = x.sum() if how == "sum" else x.amax()
                if key not in totals:
                    totals[key] = [how, here]
                elif how == "sum":
                    totals[key][1] = totals[key][1] + here
                else:
                    totals[key][1] = torch.maximum(totals[key][1], here)
        names = list(totals)
        spanned = [(h, x.reshape(1)) for h, x in totals.values()]
        if spanning is not None and spanned:
            done_own = combine(own) if combine is not None and own else [x for _, x in own]
            done_spanned = spanning(spanned)
        elif combine is not None and own + spanned:  # one collective for both
            both = combine(own + spanned)
            done_own, done_spanned = both[:len(own)], both[len(own):]
        else:
            done_own, done_spanned = [x for _, x in own], [x for _, x in spanned]
        total = {name: x.reshape(()) for name, x in zip(names, done_spanned)}
        own_done = iter(done_own)
        answers: dict = {k: [] for k in order}
        for k, part in entries:
            if len(part) == 3 and part[2] is not None:
                key = (group_of[k] if group_of is not None else 0, part[2])
                answers[k].append(total[key].expand(part[1].shape))
            else:
                answers[k].append(next(own_done))
        for k in order:
            try:
                asked[k] = gens[k].send(answers[k])
            except StopIteration as done:
                results[k] = done.value
                del asked[k]
