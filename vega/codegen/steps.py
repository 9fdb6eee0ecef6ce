"""Helpers every backend and the runtime share: the step counters' advance, a memo of work
done once per distinct tensor within one call, and staged steps (``drive``): a step run in
stages whose reductions over a group, or over tensors split across processes, are combined
between them (each reduction's parts, ``shard_part``, ``axis_part``, ``tensor_parts``, and
their finishing, ``finished``, ``finish_combined``)."""
from __future__ import annotations

import math

import torch

from vega.dsl.ir import Op

INT32_MAX = 2**31 - 1


class Done:
    """What a staged step (a backend's ``staged``) yields last: its answer, ``value``. (Not
    the generator's return value, which dynamo cannot read back from the StopIteration
    while it traces a step.)"""

    def __init__(self, value):
        self.value = value


def shard_part(op: Op, raw: torch.Tensor, weight, key) -> tuple:
    """One reduction's partial results over a group's tensors, as a staged step yields
    them (``drive``): each tensor's raw sum of squares, sum (times its copy's ``weight``,
    None for all 1) or maximum, and the reduction's ``key`` where it spans the group."""
    if op is Op.AMAX:
        return "max", raw, key
    return "sum", raw if weight is None else raw * weight, key


def finished(op: Op, total: torch.Tensor, count) -> torch.Tensor:
    """A reduction's value from its ``total`` combined over processes: a norm's square
    root, a mean's division by the whole tensor's ``count`` of values."""
    return total.sqrt() if op is Op.NORM else (total / count if op is Op.MEAN else total)


def axis_part(how: str, raw: torch.Tensor, out: torch.Tensor, view, length: int, parts: list,
              finish: list) -> None:
    """A reduction along an axis that a shard splits, in a staged step over shards of a
    program over a matrix view: its partial results ``raw`` (sums, or maxima: ``how``)
    appended to ``parts`` (a sum times the view's weight), and where its finished value
    goes (``out``, divided by the whole axis's ``length`` where a mean) to ``finish``
    (``finish_combined``)."""
    part = raw.double()
    parts.append(("max", part) if how == "max" else
                 ("sum", part * view.weight if view.weight != 1 else part))
    finish.append((out, how, length))


def tensor_parts(node, col: torch.Tensor, views, geos, parts: list, finish: list,
                 on_device=None) -> None:
    """A per-tensor reduction (``node``) of a dtype group's tensors in a staged step over
    shards of a program over a matrix view, their raw results in ``col`` (a tensor each;
    ``views``, ``geos``: their ``ShardView``s, or None, and local matrix views): finished in
    place where a tensor's values are all here; for the others, one part appended to
    ``parts`` (each times its view's weight) and its finish to ``finish``
    (``finish_combined``). ``on_device``: how a small table made on the host reaches
    ``col``'s device (a GPU's: without blocking, ``triton_runtime._device``)."""
    move = on_device or (lambda t: t)
    dom = node.src[0].dom
    here, split = [], []  # (row, count of the values reduced)
    for r, (v, g) in enumerate(zip(views, geos)):
        if v is None or not v.spans(None, dom):
            here.append((r, math.prod(g.shape(dom))))
        else:
            split.append((r, math.prod(v.full.shape(dom)), v.weight))

    def rows(found) -> torch.Tensor:  # (tables made on the host, whatever the default device)
        return move(torch.tensor([x[0] for x in found], dtype=torch.int64, device="cpu"))

    def counts(found) -> torch.Tensor:
        return move(torch.tensor([x[1] for x in found], dtype=torch.float64, device="cpu"))
    if here:
        at = rows(here)
        col[at] = finished(node.op, col[at], counts(here))
    if split:
        at, weights = rows(split), [x[2] for x in split]
        parts.append(shard_part(node.op, col[at], None if all(w == 1 for w in weights) else
                                move(torch.tensor(weights, dtype=torch.float64,
                                                  device="cpu")), None)[:2])
        finish.append((col, at, node.op, counts(split)))


def finish_combined(finish: list, combined: list) -> None:
    """Each total of ``combined`` (the parts of ``axis_part`` and ``tensor_parts``, combined
    over processes) finished into its place."""
    for done, value in zip(finish, combined):
        if isinstance(done[1], str):  # an axis reduction's totals, into its values
            out, how, length = done
            out.copy_(value / length if how == "mean" else value)
        else:
            row, q, op, count = done
            row[q] = finished(op, value, count)


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


def run_staged(kern, params, grads, states, steps, values, donate, pre):
    """``kern``'s step of tensors that are all this process's, in stages (``kern.staged``),
    its reductions over the group combined between them (``drive``)."""
    results = [None]
    drive({0: kern.staged(params, grads, states, steps, values, donate, pre,
                          [None] * len(params))}, results,
          needs={0: set(kern.global_keys.values())})
    return results[0]


def drive(gens: dict, results: list, combine=None, spanning=None, group_of=None,
          needs=None) -> None:
    """Run staged steps (``Kernel.staged``: position -> generator) together.

    A stage's parts are ``(how, float64 tensor)`` (how: "sum" or "max"), a reduction of one
    tensor whose values lie on several processes, or ``(how, tensor, key)``, one part of a
    reduction over every tensor of a group (``global_sum``; ``key`` names the reduction,
    the same in every program of a spec: ``vega.codegen.reference.global_keys``). The first
    are combined over processes by ``combine(parts)``. The second are summed (or their
    maximum taken, a NaN winning) over the tensors of their group (``group_of[position]``,
    0 for all where None), then combined over processes by ``spanning(parts)`` (None: by
    ``combine``, in the same call), and each part is given back its group's total. A step
    waits for a reduction's total until every step of its group that reduces it
    (``needs[position]``: the keys a step's program reduces) has given its part, whatever
    stage each reaches it in (tensors of different programs). ``combine`` None: nothing
    spans processes."""
    needs = needs or {}

    def group(k):
        return group_of[k] if group_of is not None else 0

    def is_global(part):
        return len(part) == 3 and part[2] is not None
    wanted: dict = {}  # (group, key) -> the steps that reduce it
    for k, keys in needs.items():
        for key in keys:
            wanted.setdefault((group(k), key), set()).add(k)
    asked, totals, done_keys = {}, {}, {}
    given: dict = {}  # (group, key) -> the steps that have given their part

    def send(k, answer) -> bool:  # its next request asked (True), or its result kept
        got = gens[k].send(answer)
        if isinstance(got, Done):
            results[k] = got.value
            asked.pop(k, None)
            return False
        asked[k] = got
        return True
    fresh = {k for k in gens if send(k, None)}
    while asked:
        for k in fresh:  # each new request's parts of reductions over the group, summed
            for part in asked[k]:
                if not is_global(part):
                    continue
                how, x, key = part
                name = (group(k), key)
                here = x.sum() if how == "sum" else x.amax()
                if name not in totals:
                    totals[name] = [how, here]
                elif how == "sum":
                    totals[name][1] = totals[name][1] + here
                else:
                    totals[name][1] = torch.maximum(totals[name][1], here)
                given.setdefault(name, set()).add(k)
        ready = [k for k in asked if all(
            (name := (group(k), part[2])) in done_keys
            or given.get(name, set()) >= wanted.get(name, {k})
            for part in asked[k] if is_global(part))]
        if not ready:
            raise RuntimeError("vega: the reductions over a group of the programs of one step "
                               "do not line up (a reduction each waits on the other for); "
                               "please report it with the spec")
        own = [part[:2] for k in ready for part in asked[k] if not is_global(part)]
        names = list(dict.fromkeys(
            (group(k), part[2]) for k in ready for part in asked[k]
            if is_global(part) and (group(k), part[2]) not in done_keys))
        spanned = [(totals[n][0], totals[n][1].reshape(1)) for n in names]
        if spanning is not None and spanned:
            done_own = combine(own) if combine is not None and own else [x for _, x in own]
            done_spanned = spanning(spanned)
        elif combine is not None and own + spanned:  # one collective for both
            both = combine(own + spanned)
            done_own, done_spanned = both[:len(own)], both[len(own):]
        else:
            done_own, done_spanned = [x for _, x in own], [x for _, x in spanned]
        done_keys.update({n: x.reshape(()) for n, x in zip(names, done_spanned)})
        own_done = iter(done_own)
        fresh = set()
        for k in ready:
            answer = [done_keys[(group(k), part[2])].expand(part[1].shape) if is_global(part)
                      else next(own_done) for part in asked[k]]
            if send(k, answer):
                fresh.add(k)
