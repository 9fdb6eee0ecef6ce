"""The step itself, shared by the functional API and the torch.optim classes.

Everything here is tensor arithmetic on the device: hyperparameter schedules
are evaluated at the step counter tensor, the counter advances with a
saturating add, and nothing is read back to the host.
"""
from __future__ import annotations

import difflib
import functools
import math
import numbers
import operator
import sys
from typing import Callable, TypeVar

import torch

from vega import codegen
from vega.codegen.base import (HyperRows, check_codes, check_complexness, check_dtypes,
                               check_state_devices, check_states, distinct, is_schedule,
                               like_words)
from vega.codegen import precision, quant
from vega.codegen.precision import MASTER
from vega.codegen.record import PRE_SLOTS, make_pre
from vega.codegen.steps import memo
from vega.codegen.tensors import (any_complex, first_real, first_with_own_ops, fit, like,
                                  mode_tensors, mode_words, on_one_device, same, transformed,
                                  transforms, uniform, wrapped)
from vega.errors import shown
from vega.schedule import KEPT_REACH, Schedule
from vega.dsl.ir import SCALAR_STATE, HyperParam, Program
from vega.tracing import untraced


def _suggest(name, names) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


HALF = (torch.bfloat16, torch.float16)
# the parameters that keep a master copy under ``master_weights``: half ones, real or complex
# (a complex one steps as pairs of its real dtype)
HALF_PARAMS = (*HALF, torch.complex32)
STATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _state_float(dtype) -> bool:
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)


def check_state_dtype(owner: str, state_dtype, names=None) -> None:
    """``state_dtype``: None, a torch float (or complex) dtype for every state, or (where
    ``names``, the states a spec declares, are given) a dict from state names to float
    dtypes; else ValueError naming it."""
    if _state_float(state_dtype) and not (state_dtype in STATE_DTYPES
                                          or state_dtype.is_complex):
        raise ValueError(f"{owner}: state_dtype={shown(state_dtype)} is not a dtype the "
                         "kernels keep state in: torch.float32, torch.float64, "
                         "torch.bfloat16, torch.float16"
                         + (" or torch.uint8 (8-bit blockwise)" if names is not None else "")
                         + " (complex64 or complex128 for complex parameters)")
    if state_dtype is None or _state_float(state_dtype) or (
            names is not None and state_dtype == torch.uint8):
        return
    if isinstance(state_dtype, dict) and names is not None:
        for name, dtype in state_dtype.items():
            if name not in names:
                raise ValueError(f"{owner}: state_dtype names a state {shown(name)} that it "
                                 f"does not keep{_suggest(str(name), list(names))}; its states "
                                 f"are {', '.join(names) or 'none'}")
            if not (isinstance(dtype, torch.dtype) and (dtype in STATE_DTYPES
                                                        or dtype == torch.uint8)):
                raise ValueError(f"{owner}: state_dtype[{name!r}]={shown(dtype)} must be one "
                                 "of torch.float32, torch.float64, torch.bfloat16, "
                                 "torch.float16, torch.uint8 (8-bit blockwise)")
        return
    if names is None and state_dtype == torch.uint8:
        raise ValueError(f"{owner}: state_dtype=torch.uint8 (8-bit state) is kept by the "
                         "optimizers written as specs; this one keeps a float dtype")
    per_state = " or torch.uint8 (8-bit blockwise), or a dict from state names to dtypes" \
        if names is not None else ""
    raise ValueError(f"{owner}: state_dtype={shown(state_dtype)} must be None, a torch float "
                     f"dtype (torch.float32, torch.float64, torch.bfloat16, ...){per_state}")


def saved_state_dtype(state_dtype):
    """``state_dtype`` as a state dict holds it: each dtype as its name ("torch.uint8"),
    since ``torch.distributed.checkpoint``'s state dict functions take tensors, numbers,
    strings, lists and dicts only (``get_state_dict`` of whole tensors, or on the CPU, refuses
    a ``torch.dtype``); ``loaded_state_dtype`` reads it back."""
    if isinstance(state_dtype, torch.dtype):
        return str(state_dtype)
    if isinstance(state_dtype, dict):
        return {k: saved_state_dtype(v) for k, v in state_dtype.items()}
    return state_dtype


def saved_groups(groups: list) -> list:
    """A state dict's ``param_groups`` with each group's ``state_dtype`` as it is saved
    (``saved_state_dtype``)."""
    return [{**g, "state_dtype": saved_state_dtype(g["state_dtype"])}
            if "state_dtype" in g else g for g in groups]


def loaded_state_dtype(state_dtype):
    """``saved_state_dtype``'s names of dtypes as the dtypes; anything else as it is (a
    state dict saved with the dtypes themselves, or a value ``check_state_dtype`` names)."""
    if isinstance(state_dtype, str) and state_dtype.startswith("torch.") and isinstance(
            getattr(torch, state_dtype[len("torch."):], None), torch.dtype):
        return getattr(torch, state_dtype[len("torch."):])
    if isinstance(state_dtype, dict):
        return {k: loaded_state_dtype(v) for k, v in state_dtype.items()}
    return state_dtype


_DTYPE_WORDS = {"float32": torch.float32, "float64": torch.float64,
                "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def state_dtype_of(spec, state_dtype):
    """The state_dtype an init or a class uses: the caller's, over the dtypes the spec's
    declarations name (``state nu: bfloat16 = zeros``): a dict by state name where the spec
    names any and the caller gives none or a dict (the caller's names win); one dtype for
    every state, as the caller gives it."""
    declared = spec.declared_dtypes
    if not declared or (state_dtype is not None and not isinstance(state_dtype, dict)):
        return state_dtype
    out = {name: _DTYPE_WORDS[word] for name, word in declared.items()}
    if isinstance(state_dtype, dict):
        out.update(state_dtype)
    return out


def keeps_precision(state) -> bool:
    """Whether ``state`` keeps its parameter's precision under one half dtype (or 8 bits)
    for every state: a copy of the weights (``quant.weight_copy``) or a state of one
    number a tensor."""
    return quant.weight_copy(state) or state.dom == SCALAR_STATE


def master_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s master copy: float32, complex64 for a complex parameter (complex32
    steps as pairs of float16)."""
    return torch.complex64 if p.is_complex() else torch.float32


def state_dtypes(p: torch.Tensor, program: Program, state_dtype,
                 where="") -> list[torch.dtype]:
    """The dtype of each state of ``program`` for parameter ``p``: ``state_dtype`` (one dtype
    for all, or a dict by state name, the others by default; ``state_dtype_for``); a master
    copy of the parameter (``master_weights``) is float32 whatever it says. ``where``: the
    owner and the parameter a refusal names (``"adamw_init: params leaf 'w'"``), or a
    function that returns them (called only for a refusal)."""
    per = state_dtype if isinstance(state_dtype, dict) else {}
    every = None if isinstance(state_dtype, dict) else state_dtype
    out = []
    scales = quant.scale_names(program)
    for s in program.states:
        if s.name == MASTER and program.master:
            out.append(master_dtype(p))
            continue
        if s.name in scales:
            out.append(torch.float32)
            continue
        dtype = per.get(s.name, every)
        if dtype == torch.uint8 and p.is_complex():
            at = at_where(where)
            raise ValueError(f"{at + ' is ' + str(p.dtype) + ': ' if at else ''}"
                             f"state_dtype={shown(dtype)} (8-bit state) is kept for real "
                             "parameters; a complex parameter keeps complex state")
        if dtype == torch.uint8:  # 8 bits where the program keeps them so (quant.variant)
            out.append(dtype if s.name in program.quant else state_dtype_for(p, None))
            continue
        if every in HALF and keeps_precision(s):
            # one half dtype for every state: a copy of the weights (Prodigy's p0,
            # schedule-free's z) and a state of one number (Prodigy's d, schedule-free's
            # weight_sum) at the parameter's precision, as under 8 bits: rounded to half,
            # Prodigy's p0 - p read the rounding as progress, z is the iterate, and a sum
            # in bfloat16 stops growing once it is 256 times what it adds
            out.append(state_dtype_for(p, None))
            continue
        if dtype is not None and p.is_complex() and not dtype.is_complex:
            at, key = at_where(where), f"[{s.name!r}]" if s.name in per else ""
            raise ValueError(f"{at + ' is ' + str(p.dtype) + ': ' if at else ''}"
                             f"state_dtype{key}={shown(dtype)}: a complex parameter keeps "
                             "complex state (torch.complex64 or torch.complex128; None for "
                             "its own precision)")
        out.append(state_dtype_for(p, dtype))
    return out


def check_value(owner: str, h: HyperParam, value):
    """A hyperparameter value as the step takes it, or ValueError naming it."""
    if h.type == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{owner}: {h.name}={shown(value)} must be True or False (it selects "
                             "the compiled kernel)")
        return value
    if type(value) is float and value == value and (h.range is None or h.range.contains(value)):
        return value  # (the common case, checked every step, without numbers.Real's isinstance)
    if isinstance(value, bool) or not (
            isinstance(value, (numbers.Real, torch.Tensor)) or callable(value)):
        raise ValueError(f"{owner}: {h.name}={shown(value)} must be a float, a 0-d tensor or a "
                         "schedule (a callable of the step counter)")
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{owner}: {h.name} must be a 0-d float tensor, got shape "
                             f"{tuple(value.shape)} and dtype {value.dtype}")
        if value.device.type == "meta":
            raise ValueError(f"{owner}: {h.name} is a meta tensor, which has no value: give "
                             f"a tensor on the parameters' device, or a float")
        return value
    if isinstance(value, numbers.Real):
        try:
            value = float(value)
        except OverflowError:  # an int (or Fraction) past the float range: 10**400
            raise ValueError(f"{owner}: {h.name}={shown(value)} is too large for a float")\
                from None
        if math.isnan(value) or (h.range is not None and not h.range.contains(value)):
            where = f"outside its range {h.range}" if h.range is not None else "not a number"
            raise ValueError(f"{owner}: {h.name}={shown(value)} is {where}")
    elif isinstance(value, Schedule) and value.elementwise() and h.range is not None:
        check_reach(owner, h.name, h.range, value)
    return value


def check_reach(owner: str, name: str, r, sched: Schedule) -> None:
    """ValueError where a ``vega.schedule`` schedule given for hyperparameter ``name`` takes,
    at a count the step counter holds, a value outside its range ``r`` (a
    ``vega.dsl.ast.Range``; ``Schedule.reach``: on the host, without a step;
    kept per schedule object, as the classes check their groups every step). A growing
    schedule that overflows to infinity on a side where the range has no bound (an
    exponential growth of ``lr``) is taken: a step reaches it only past the float range."""
    key = sched._values()
    kept = sched.__dict__.get(KEPT_REACH)
    if kept is not None and kept[2] is r and kept[0] == key:
        return  # (checked against this range last time)
    reach = kept[1] if kept is not None and kept[0] == key else sched.reach()

    def within(v: float) -> bool:
        return r.contains(v) or (v == math.inf and r.hi == math.inf) or \
            (v == -math.inf and r.lo == -math.inf)
    inside = None  # the last step listed whose value is within the range
    for k, v in reach or ():
        if within(v):
            inside = k
            continue
        if inside is not None:  # the first step outside, between the two
            k = sched._first_outside(within, inside, k)
            v = sched(k)
        raise ValueError(f"{owner}: {name}={shown(sched)} is {v!r} at step {k}, outside "
                         f"{name}'s range {r}; give a schedule that stays within it at every "
                         "count a step counter holds (to 2**31 - 1)")
    sched.__dict__[KEPT_REACH] = (key, reach, r)


def check_precision(owner: str, master_weights, stochastic_rounding, rounding_seed):
    """The seed of stochastic rounding (None without it), each option checked: ValueError
    naming it."""
    for name, v in (("master_weights", master_weights),
                    ("stochastic_rounding", stochastic_rounding)):
        if not isinstance(v, bool):
            raise ValueError(f"{owner}: {name}={shown(v)} must be True or False")
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int) \
            or not 0 <= rounding_seed < 2 ** 32:
        raise ValueError(f"{owner}: rounding_seed={shown(rounding_seed)} must be an int in "
                         "[0, 2**32)")
    return rounding_seed if stochastic_rounding else None


_TRANSFORM_WORDS = {"Grad": "torch.func.grad (or grad_and_value, vjp, jacrev, hessian)",
                    "Jvp": "torch.func.jvp", "Vmap": "torch.func.vmap",
                    "Functionalize": "torch.func.functionalize"}


def under_transforms(owner: str, backend, donate: bool, backends: bool = True):
    """The backend a functional step takes under the ``torch.func`` transforms it is called
    in (``backend`` itself outside them). A step runs under ``torch.no_grad``, its kernels
    outside autograd: under ``grad`` it is refused rather than give a gradient silently zero.
    Under ``vmap`` and ``jvp`` (forward mode, which ``no_grad`` leaves on) it steps by the
    reference backend's torch operations, purely: ``donate=True`` and a compiled backend,
    whose kernels read a tensor's memory, which a transform's wrapper does not have, are
    refused. Under ``functionalize`` likewise by the reference backend, whose operations it
    follows (a compiled backend is refused: its tensors have no storage either), ``donate=True``
    included: it turns the writes in place into new tensors, and writes them back into the
    inputs at its end. ``backends``: whether the step takes a backend at all."""
    keys = transforms()
    if not keys:
        return backend
    if "Grad" in keys:
        raise ValueError(
            f"{owner}: called under {_TRANSFORM_WORDS['Grad']}: a step is not differentiable "
            f"by reverse mode (it runs under torch.no_grad, its kernels outside autograd), so "
            f"a gradient through it would be silently zero; call the step outside the "
            f"transform, and to differentiate through an update (meta-learning) write that "
            f"update in torch operations")
    named = [_TRANSFORM_WORDS[k] for k in keys if k in ("Vmap", "Jvp", "Functionalize")]
    if not named:
        return backend
    pure = [_TRANSFORM_WORDS[k] for k in keys if k in ("Vmap", "Jvp")]
    if donate and pure:
        raise ValueError(f"{owner}: donate=True under {pure[-1]}: the step cannot update "
                         f"a transform's tensors in place; use donate=False (the default), "
                         f"which returns the new params and state")
    if backends and backend not in (None, "reference"):
        raise ValueError(f"{owner}: backend={backend!r} under {named[-1]}: its kernels read "
                         f"the tensors' memory, which a transform's tensor does not have; "
                         f"use backend='reference' (the default under {named[-1]})")
    return "reference" if backends else backend


def class_step_transforms(owner: str, rule: str | Callable[[], str], groups: list) -> None:
    """(``rule``: the functional step's name, ``vega.adamw_step``, or a function that gives
    it.) Refuse a class's ``step()`` called under ``torch.func.grad``, ``jvp`` or
    ``functionalize``, or under ``vmap`` with a parameter or gradient of its ``groups``
    batched, before it changes anything: it writes its parameters and its state, tensors
    from outside the transform, in place, which these transforms cannot follow (a state
    made there would hold the transform's tensors, which outlive it). Under ``vmap`` of
    other tensors it steps its own as outside it. Under a ``FakeTensorMode`` with a real
    parameter likewise: the mode's operations give fake tensors, so the step wrote none of
    its parameters and kept fake states, which later steps read."""
    made = mode_tensors()
    if made is not None:
        at = next(((k, i) for k, g in enumerate(groups)
                   if (i := first_real(g["params"], made)) is not None), None)
        if at is not None:
            words = mode_words(made)
            raise ValueError(
                f"{owner}.step: called under a {words['mode']} with parameter {at[1]} of group "
                f"{at[0]} a real tensor: the mode's operations make {words['made']}s of real "
                f"ones, so the step would write none of its parameters and keep "
                f"{words['made']} states; call step() outside the mode, or give the optimizer "
                f"{words['made']} parameters")
    keys = transforms()
    if not keys:
        return
    named = [k for k in keys if k in ("Grad", "Jvp", "Functionalize")]
    if not named and "Vmap" in keys and any(
            wrapped(t) for g in groups for p in g["params"] for t in (p, p.grad)
            if t is not None):
        named = ["Vmap"]
    if named:
        raise ValueError(
            f"{owner}.step: called under {_TRANSFORM_WORDS[named[-1]]}"
            f"{' with a batched parameter or gradient' if named[-1] == 'Vmap' else ''}: a "
            f"class's step updates its parameters and its state in place, tensors from "
            f"outside the transform, which the transform cannot follow; call step() outside "
            f"the transform, or inside it the functional step of the rule "
            f"({rule() if callable(rule) else rule}), which "
            f"returns the new params and state")


# the device types whose autocast a step turns off (``without_autocast``)
AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def without_autocast(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with autocast off on each device type where it is on: a step
    left inside ``torch.autocast`` (around ``optimizer.step()``, a common slip) ran its
    matrix products (Muon's Newton-Schulz iterations) in the autocast dtype, another update
    than outside it. One check per type where none is on."""
    for kind in AUTOCAST_TYPES:
        if torch.is_autocast_enabled(kind):
            with torch.autocast(kind, enabled=False):
                return without_autocast(fn, *args, **kwargs)
    return fn(*args, **kwargs)


_F = TypeVar("_F", bound=Callable)


def outside_autocast(fn: _F) -> _F:
    """``fn`` run by ``without_autocast`` (a functional step); of ``fn``'s signature and
    type, to a type checker too."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return without_autocast(fn, *args, **kwargs)
    return run  # type: ignore[return-value]


def zeros(like, shape, dtype, device) -> torch.Tensor:
    """``torch.zeros(shape)`` for the state of ``like`` (a parameter, or None): under
    ``torch.func.vmap``, where ``like`` is batched and ``torch.zeros`` would make one tensor
    that every member of the batch saw (in stride 0 once out of vmap), a batched one made
    by ``like.new_zeros``, each member's own."""
    if like is not None and wrapped(like):
        return like.new_zeros(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def check_fused(owner: str, max_grad_norm, skip_nonfinite, loss_scale=None) -> None:
    """Validate the fused-step options of a step or an optimizer."""
    from vega.runtime.loss_scale import LossScale
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise ValueError(f"{owner}: loss_scale={loss_scale!r} must be a vega.LossScale "
                         "(LossScale.dynamic() or LossScale.static(s)) or None")
    if loss_scale is not None:  # (as adjust checks them, before a step writes anything)
        loss_scale.check_settings(f"{owner}: loss_scale")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real) \
                or not positive_finite(max_grad_norm):
            raise ValueError(f"{owner}: max_grad_norm={shown(max_grad_norm)} must be a positive "
                             "finite number (or None for no clipping)")
    if not isinstance(skip_nonfinite, bool):
        raise ValueError(f"{owner}: skip_nonfinite={skip_nonfinite!r} must be True or False")


def as_float(x: numbers.Real) -> float:
    """A real number as a float; one past the float range (an int, 10**400) as inf or -inf,
    beyond every float on its side."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def positive_finite(x: numbers.Real) -> bool:
    """Whether a real number is positive and a finite float (NaN and 10**400 are not), in
    comparisons alone: under ``torch.compile(dynamic=True)`` a float setting is a symbolic
    float, which ``math.isfinite`` cannot take (dynamo breaks the graph there) and a test
    of ``abs(x) < inf`` would pass at infinity (dynamo takes it as true for every float)."""
    return 0 < x <= sys.float_info.max


def resolve(owner: str, hypers: tuple[HyperParam, ...], given: dict, init: str | None = None):
    """Split keyword arguments into (flags, values), defaults filled in, each checked.
    ``init``: the name of the function that makes the state, for a step's arguments."""
    known = {h.name: h for h in hypers}
    for name in given:
        if name == "state_dtype" and init is not None:
            raise TypeError(f"{owner} got state_dtype: a state's dtypes are chosen where it "
                            f"is made ({init}(params, state_dtype=...)), and a step keeps "
                            "them")
        if name not in known:
            raise TypeError(f"{owner} got an unexpected hyperparameter {name!r}"
                            f"{_suggest(name, list(known))}; it takes "
                            f"{', '.join(known) or 'none'}")
    flags, values = {}, {}
    for h in hypers:
        value = given[h.name] if h.name in given else h.default
        value = check_value(owner, h, value)
        (flags if h.type == "bool" else values)[h.name] = value
    return flags, values


def shape_values(owner: str, spec, flags: dict, values: dict) -> dict:
    """What the spec's shape conditions read: the bool hyperparameters and the float ones
    they name, which must be plain numbers (ValueError naming the argument)."""
    known = dict(flags)
    for name in spec.shape_hypers:
        v = values[name]
        if isinstance(v, (torch.Tensor, bool)) or callable(v):
            raise ValueError(f"{owner}: {name}={v!r} must be a plain number: an if of "
                             "the spec reads it (or a repeat, as its count) to decide which "
                             "program steps each tensor")
        known[name] = float(v)
    return known


def programs(owner: str, spec, flags: dict, values: dict, tensors,
             held: tuple = (), master: bool = False,
             seed: int | None = None, quantized=None) -> list[Program | None]:
    """The program that steps each tensor (None for a None entry).

    A spec without conditions on values or shapes has one program per setting of
    its bool hyperparameters; one with ``if momentum > 0`` or ``if ndim(p) >= 2``
    has one per outcome of those conditions, chosen here from the values and each
    tensor's shape. ``held``: conditions taken as true whatever they say (one bool per
    shape condition, ``Spec.held_open``). ``quantized``: the states each tensor keeps in 8
    bits (a frozenset each, ``q8_names``; None: none). Lowering a program runs outside a
    dynamo trace (``vega.tracing``).
    """
    out = _programs(owner, spec, flags, values, tensors, held)
    if master or seed is not None:  # (a master copy for half parameters only)
        out = [None if prog is None else
               untraced(precision.variant, prog, master and t.dtype in HALF_PARAMS, seed)
               for prog, t in zip(out, tensors)]
    if quantized is not None and any(quantized):
        try:
            out = [prog if prog is None or not q else untraced(quant.variant, prog, q)
                   for prog, q in zip(out, quantized)]
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
    return out


def q8_names(state_dtype, t) -> frozenset[str]:
    """The states tensor ``t`` keeps in 8 bits under ``state_dtype``: ``torch.uint8`` for
    every state shaped like the parameter (``{"*"}``), or by name in a dict; none for a
    tensor of fewer than ``quant.MIN_NUMEL`` values, which keeps them in its default
    dtype."""
    if state_dtype is None or t is None or t.numel() < quant.MIN_NUMEL:
        return frozenset()
    if isinstance(state_dtype, dict):
        return frozenset(n for n, d in state_dtype.items() if d == torch.uint8)
    return frozenset({"*"}) if state_dtype == torch.uint8 else frozenset()


def _programs(owner: str, spec, flags: dict, values: dict, tensors,
              held: tuple = ()) -> list[Program | None]:
    known = shape_values(owner, spec, flags, values) if spec.shape_conditions else {}
    fkey = tuple(sorted(flags.items()))
    if not spec.reads_shape:  # no conditions, or on values only: one program for all
        program = untraced(_lower, spec, fkey, _or(_outcomes(spec, known, ()), held))
        return [None if t is None else program for t in tensors]
    # (while dynamo traces, the values may be symbolic floats (dynamic=True), which the
    # cache's key cannot hold: the trace keeps what it picks)
    out = []
    seen = {} if torch.compiler.is_compiling() else spec.chosen({**known, "\0held": held})
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        shape = tuple(t.shape)
        found = seen.get(shape)
        if found is None:
            found = seen[shape] = untraced(_lower, spec, fkey,
                                           _or(_outcomes(spec, known, shape), held))
        out.append(found)
    return out


def _outcomes(spec, known: dict, shape: tuple) -> tuple:
    """``spec.shapes(known, shape)``, each outcome a Python bool also where a value is a
    symbolic float of dynamo's (``torch.compile(dynamic=True)``): an ``if`` on it guards the
    graph on the outcome, which ``untraced`` can then take as a constant."""
    return tuple(True if c else False for c in spec.shapes(known, shape))


def _or(outcomes: tuple, held: tuple) -> tuple:
    return tuple(a or b for a, b in zip(outcomes, held)) + outcomes[len(held):] \
        if held else outcomes


def _lower(spec, fkey: tuple, outcomes: tuple) -> Program:
    return spec.program(dict(fkey), outcomes)


def groups(progs) -> list[tuple[Program, list[int]]]:
    """The positions stepped by each distinct program, in order of first use.

    Programs are told apart by identity (``is``): under ``torch.compile`` hashing one
    would make dynamo hash its whole expression DAG, field by field."""
    progs = progs if isinstance(progs, list) else list(progs)
    if progs and progs[0] is not None and not torch.compiler.is_compiling() \
            and same(progs, [progs[0]] * len(progs)):  # one program for all (one native pass)
        return [(progs[0], list(range(len(progs))))]
    found: list[tuple[Program, list[int]]] = []
    for i, prog in enumerate(progs):
        if prog is None:
            continue
        for known, where in found:
            if known is prog:
                where.append(i)
                break
        else:
            found.append((prog, [i]))
    return found


def state_fields(progs) -> list:
    """Every state variable of these programs, by name, in order of first appearance."""
    fields: dict[str, object] = {}
    for prog, _ in groups(progs):
        for s in prog.states:
            fields.setdefault(s.name, s)
    return list(fields.values())


def at_step(values: dict, step: torch.Tensor) -> dict:
    """Hyperparameter values at a step counter: schedules are called with the tensor (and
    what they return checked, ``scheduled``)."""
    return {k: (scheduled(k, v(step)) if is_schedule(v) else v)
            for k, v in values.items()}


def scheduled(name: str, x):
    """``x``, what the schedule of hyperparameter ``name`` returned at one step counter, if
    it is one value: a real number, or a real tensor of one element; else ValueError naming
    the hyperparameter. Its dtype and shape are checked, never its value (no host sync)."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "meta" or x.layout != torch.strided:
            what = "a meta tensor" if x.device.type == "meta" else f"a {x.layout} tensor"
            raise ValueError(f"hyperparameter {name!r}: its schedule returned {what}, which "
                             "the step cannot read: a schedule returns one value at a step "
                             "counter, a number or a 0-d float tensor on the counter's "
                             "device")
        if x.numel() == 1 and not x.is_complex() and x.dtype != torch.bool:
            return x
        raise ValueError(f"hyperparameter {name!r}: its schedule returned a tensor of shape "
                         f"{tuple(x.shape)} and dtype {x.dtype}; a schedule returns one value "
                         "at a step counter: a number or a 0-d float tensor")
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        if _fits(x):
            return x
        raise ValueError(f"hyperparameter {name!r}: its schedule returned {shown(x)}, too large "
                         "for a float")
    raise ValueError(f"hyperparameter {name!r}: its schedule returned {shown(x)}, a "
                     f"{type(x).__name__}; a schedule returns one value at a step counter: a "
                     "number or a 0-d float tensor")


def _fits(x: numbers.Real) -> bool:
    """Whether a real number converts to a float (10**400 does not)."""
    try:
        float(x)
    except OverflowError:
        return False
    return True


def state_dtype_for(p: torch.Tensor, state_dtype: torch.dtype | None) -> torch.dtype:
    """float32 state for bfloat16/float16 parameters by default, else the parameter's; a
    complex ``state_dtype`` given for a real parameter its real counterpart."""
    if state_dtype is not None:
        if state_dtype.is_complex and not p.is_complex():
            return state_dtype.to_real()
        return state_dtype
    real = p.real.dtype if p.is_complex() else p.dtype
    base = torch.float32 if real in (torch.bfloat16, torch.float16) else real
    if p.is_complex():
        return torch.complex128 if base == torch.float64 else torch.complex64
    return base


def _real(x: torch.Tensor, resolve: bool = True) -> torch.Tensor:
    """A complex tensor's real view (of its values: a conjugate, ``x.conj()``, resolved into
    a copy first; it has no real view. ``resolve_conj`` returns ``x`` itself where it is no
    conjugate, and dynamo cannot trace ``is_conj()``). Not ``resolve``: the view of ``x``
    itself (torch refuses a conjugate). Anything else, a tensor that is not complex or a
    state set by hand to another object, as it is (the kernels' checks name the latter)."""
    if not isinstance(x, torch.Tensor) or not x.is_complex():
        return x
    return torch.view_as_real(x.resolve_conj() if resolve else x)


def complex_axes_words(program: Program, p: torch.Tensor) -> str:
    """Why complex parameter ``p`` cannot step under ``program`` (``uses_axes``), for a
    message that names it."""
    what = "matrix products" if program.torch_only else "row and column reductions"
    return (f"is of dtype {p.dtype}: {program.name}'s {what} step real parameters only "
            "(complex parameters have no matrix view)")


def at_where(where) -> str:
    """The owner and parameter a refusal names: ``where``, or what it returns where it is a
    function (called for a refusal only: ``init_leaf``, ``state_dtypes``)."""
    return where() if callable(where) else where


def _no_complex_axes(program: Program, p: torch.Tensor, where="") -> None:
    """ValueError, naming complex ``p`` (``where``; else the rule's 'a parameter'), where
    ``program`` has row and column reductions."""
    if program.uses_axes:
        at = at_where(where) or f"{program.name}: a parameter"
        raise ValueError(f"{at} {complex_axes_words(program, p)}")


def init_leaf(program: Program, p: torch.Tensor, values: dict,
              state_dtype, where="", memo: dict | None = None) -> list[torch.Tensor]:
    """The initial state tensors of one parameter (built by the reference backend; a
    DTensor's on its local shard, ``vega.runtime.sharded``). ``state_dtype``: None, a dtype,
    or a dict by state name (``state_dtypes``); ``where``, the parameter a refusal names.
    ``memo``: where given, a dict the caller keeps for parameters of one ``state_dtype``,
    while ``program`` lives (the parameters of one step of a group): the kernel and the
    states' dtypes kept there by the program and the parameter's dtype, on which alone they
    and the refusals made on the way depend (the first parameter refused is named)."""
    from vega.runtime import sharded
    if sharded.is_dtensor(p):
        return sharded.init_leaf(program, p, values, state_dtype, where)
    key = (id(program), p.dtype)
    found = None if memo is None else memo.get(key)
    if found is None:
        if p.is_complex():
            _no_complex_axes(program, p, where)
        found = (codegen.kernel("reference", program),
                 [sd.to_real() if sd.is_complex else sd
                  for sd in state_dtypes(p, program, state_dtype, where)])
        if memo is not None:
            memo[key] = found
    kern, sds = found
    out = kern.init(_real(p), values, sds)
    # (a state like its parameter is complex like it; one of one number a tensor stays real)
    return [torch.view_as_complex(s) if p.is_complex() and st.dom == "rc" else s
            for st, s in zip(program.states, out)]


def inverse_scale(loss_scale) -> torch.Tensor | None:
    """1 / the loss scale, formed in float64 (as GradScaler forms its inv_scale)."""
    return None if loss_scale is None else loss_scale.loss_scale.double().reciprocal()


def _has_schedule(values: dict) -> bool:
    return any(map(is_schedule, values.values()))


def record(device, inv_scale=None, max_norm=None, check=False) -> torch.Tensor | None:
    """A fresh prelude record on ``device`` (``make_pre``), or None when nothing is asked."""
    if inv_scale is None and max_norm is None and not check:
        return None
    return make_pre(device, inv_scale, max_norm, check)


def _check_prelude(parts, every, name=None) -> None:
    """ValueError where a fused step's gradients (``every``, those of ``parts``) are not all
    plain tensors on one device. ``name(j, k)``: the owner and gradient ``k`` of part ``j``
    (``"adamw_step: grads leaf 'w'"``), for the message."""
    for j, (_, _, grads) in enumerate(parts):
        k = first_with_own_ops(grads) if not torch.compiler.is_compiling() else None
        if k is not None:
            which = f"{name(j, k)} is" if name is not None else "one is"
            raise ValueError(
                f"{which} a {type(grads[k]).__name__}, a tensor subclass with operations of "
                f"its own (whose norm is its own), but a fused step (max_grad_norm, "
                f"loss_scale, skip_nonfinite) sums over every gradient as plain tensors; "
                f"step without them, clipping with torch.nn.utils.clip_grad_norm_")
    if not on_one_device(every):
        devices = {g.device for g in every}
        words = (f"a fused step with clipping or loss scaling needs all gradients on one "
                 f"device, got {sorted(map(str, devices))}")
        first = every[0].device
        at = next(((j, k) for j, (_, _, grads) in enumerate(parts)
                   for k, g in enumerate(grads) if g.device != first), None)
        if name is None or at is None:
            raise ValueError(words)
        raise ValueError(f"{name(*at)} is on {parts[at[0]][2][at[1]].device}, and the first "
                         f"gradient on {first}: {words}")


def prelude(parts, inv_scale=None, max_norm=None, check=False,
            loss_scale=None, name=None) -> torch.Tensor | None:
    """Gather, over every gradient of every group, what a fused step needs before updating.

    ``parts`` lists (program, backend, grads) per group; the gradients are multiplied by
    ``inv_scale``, or by the inverse of ``loss_scale`` (a ``LossScale``: formed by the
    kernels that write the record, else here, ``inverse_scale``). Returns the float64
    record of ``vega.codegen.record.make_pre`` (None when nothing is asked). ``name``: how
    a refusal names a gradient (``_check_prelude``).
    """
    if inv_scale is None and loss_scale is None and max_norm is None and not check:
        return None
    every = parts[0][2] if len(parts) == 1 else [g for _, _, grads in parts for g in grads]
    # the common case in one native pass: plain real tensors on one device; else each asked
    plain = uniform(every)
    if not plain:
        _check_prelude(parts, every, name)
    device = every[0].device if every else torch.device("cpu")
    kerns = [codegen.kernel(backend, program) for program, backend, _ in parts]
    init = None
    if kerns and all(getattr(k, "writes_record", False) for k in kerns):
        # the first launch writes the record whole: no copy of a blank one first
        pre = torch.empty(len(PRE_SLOTS), dtype=torch.float64, device=device)
        init = (inv_scale, max_norm, check,
                loss_scale.loss_scale if loss_scale is not None else None)
    else:
        if loss_scale is not None:
            inv_scale = inverse_scale(loss_scale)
        pre = record(device, inv_scale, max_norm, check)
        if pre is not None and transformed():
            # under torch.func.vmap, a record each member's own (the reference kernel's
            # in-place sums of batched gradients into an unbatched one fail)
            batched = next((g for g in every if wrapped(g)), None)
            if batched is not None:
                pre = zeros(batched, (), pre.dtype, device) + pre
    for kern, (_, _, grads) in zip(kerns, parts):
        if not plain and any_complex(grads):
            grads = [_real(g) for g in grads]
        if init is not None:
            kern.prelude(grads, pre, init)
            init = None
        else:
            kern.prelude(grads, pre)
    return pre


def hyper_rows(program: Program, values, steps) -> HyperRows | None:
    """The float hyperparameters of each tensor, schedules evaluated at its step counter:
    a row per distinct values dict, or per distinct (values dict, step counter) where the
    dict holds a schedule. A ``vega.schedule`` schedule is evaluated once a dict, on the
    distinct counters of that dict's tensors stacked (a class's parameters each have their
    own, and usually all equal); any other callable once per counter. None when the counters
    are on several devices."""
    names = program.float_hypers
    uniq_v, v_index = distinct(values)
    uniq_s, s_index = distinct(steps)
    device = uniq_s[0].device
    if any(s.device != device for s in uniq_s):
        return None
    # each dict's counters: those of its own tensors only (a class's groups each read their
    # own parameters' counters), where every dict's rows at every counter of the step grew
    # as groups times parameters (3,000 groups of a schedule each: 1.9 GB and seconds a step)
    if len(uniq_v) == 1:
        mine: list = [None]  # (all of them, in their order)
        local = s_index
    else:
        seen: list[dict] = [{} for _ in uniq_v]
        local = [seen[v].setdefault(s, len(seen[v])) for v, s in zip(v_index, s_index)]
        mine = [None if len(d) == len(uniq_s) and all(map(operator.eq, d, range(len(d))))
                else list(d) for d in seen]
    stacked: list = []  # all the counters stacked, once
    blocks, starts, per_step, nrows = [], [], [], 0
    for vals, ks in zip(uniq_v, mine):
        counters, own = (uniq_s, stacked) if ks is None else ([uniq_s[k] for k in ks], [])
        block, timed = _block(names, vals, counters, own, device)
        starts.append(nrows)
        per_step.append(timed)
        nrows += block.shape[0]
        blocks.append(block)
    index = [starts[v] + (s if per_step[v] else 0) for v, s in zip(v_index, local)]
    table = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return HyperRows(tuple(names), table.contiguous(), index)


def _block(names, vals: dict, counters: list, stacked: list, device):
    """(the rows of one values dict: one per counter where it holds a schedule, else one;
    whether it does). ``stacked``: the counters stacked, filled on first need."""
    timed = any(is_schedule(vals[n]) for n in names)
    rows = len(counters) if timed else 1
    cols = [_column(n, vals[n], counters, stacked, rows, device) for n in names]
    return (torch.stack(cols, dim=1) if cols else
            torch.zeros((rows, 1), dtype=torch.float64, device=device)), timed


def _column(name: str, v, counters, stacked: list, rows: int, device) -> torch.Tensor:
    """Hyperparameter ``name``'s value ``v`` at each counter (``rows`` of them), float64."""
    if isinstance(v, Schedule) and v.elementwise() and len(counters) > 1:
        if not stacked:
            stacked.append(torch.stack(counters))
        try:
            out = v(stacked[0])
            if isinstance(out, torch.Tensor) and out.shape == stacked[0].shape:
                return out.to(device=device, dtype=torch.float64)
        except (RuntimeError, TypeError):  # an _at with a Python if on the step: one by one
            pass
    if is_schedule(v):
        return torch.stack([_float64(scheduled(name, v(s)), device) for s in counters])
    if isinstance(v, torch.Tensor):
        return v.detach().reshape(()).to(device=device, dtype=torch.float64).expand(rows)
    return torch.full((rows,), float(v), dtype=torch.float64, device=device)


def _float64(x, device) -> torch.Tensor:
    """A callable's value as a 0-d float64 tensor (a Python float kept exactly)."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.tensor(float(x), dtype=torch.float64, device=device)


def tensor_values(program: Program, kern, values, steps):
    """The hyperparameters of each tensor as ``kern`` takes them: ``values`` as they are
    where no schedule is among them, else evaluated at each tensor's step counter (a
    ``HyperRows`` table, or a dict per tensor)."""
    compiling = torch.compiler.is_compiling()
    if compiling:
        uniq = values
    elif values and same(values, [values[0]] * len(values)):  # (one dict for all: a class's
        uniq = values[:1]  # group; by identity: dicts compared by == compare tensors' values)
    else:
        uniq = list({id(v): v for v in values}.values())
    if not any(_has_schedule(v) for v in uniq):
        return values  # nothing depends on the step: the values as they are
    rows = hyper_rows(program, values, steps)
    if rows is None:  # counters on several devices: each tensor's values at its own
        evaluated: dict = {}
        return [memo(evaluated, (step, vals), (), at_step, vals, step, compiling=compiling)
                for step, vals in zip(steps, values)]
    if getattr(kern, "takes_rows", False):
        return rows
    dicts = rows.dicts()  # (0-d tensors: a value given as a number stays one, which the
    for d, given in zip(dicts, values):  # reference's products take exact: Kernel._args)
        for name, v in given.items():
            if type(v) in (float, int) and name in d:
                d[name] = v
    return dicts


def run(program: Program, backend: str, params, grads, states, steps, values, donate: bool,
        pre: torch.Tensor | None = None, adjust=None, evaluated: bool = False):
    """One step of ``program`` over lists of tensors.

    ``states`` is a list, one per state variable, of per-parameter tensor lists;
    ``steps`` the int32 counter of each parameter (the same tensor may repeat);
    ``values`` the hyperparameters of each parameter, schedules unevaluated;
    ``pre`` the prelude's record (``prelude``); ``adjust`` a ``LossScale`` the kernel
    adjusts in place after the step, where its ``adjusts`` says it does; ``evaluated``:
    ``values`` are ``tensor_values``' already. Returns (new params, new states, new steps,
    finite).
    """
    kern = codegen.kernel(backend, program)
    per_tensor = values if evaluated else tensor_values(program, kern, values, steps)
    # complex parameters step as real pairs
    real_p, real_g, real_s = as_real(program, params, grads, states, donate) \
        if any_complex(params) else (params, grads, states)
    extra = {"adjust": adjust} if adjust is not None else {}
    new_p, new_s, new_steps, finite = kern(real_p, real_g, real_s, steps, per_tensor, donate,
                                           pre, **extra)
    if real_p is not params:
        new_p, new_s = as_complex(params, states, real_p, real_s, new_p, new_s, donate)
    elif donate:
        new_p, new_s = list(params), [list(col) for col in states]
    return new_p, new_s, new_steps, finite


def check_call(owner: str, program: Program, backend: str, params, grads, states, steps,
               name) -> None:
    """Raise ValueError, naming the tensor (``name(i)``: parameter ``i``'s name), where the
    kernel of one ``run`` call would refuse its tensors: the shapes, devices and dtypes of
    its gradients and states (``check_states``, ``check_codes``, ``check_dtypes``, the
    compiled kernels' ``state_dtypes``) and its step counters. A step of several calls
    checks each before the first writes, so that one refused has not stepped another."""
    # the devices its kernel runs on (C's the CPU, Triton's a GPU or its interpreter's): a step
    # of two calls (two programs, two groups) would have written the first call's tensors
    # before the second refused its own
    devices_ok = getattr(codegen.kernel(backend, program), "check_devices", None)
    quick = like(params, grads)  # (every parameter on the first one's device)
    if devices_ok is not None:
        try:
            devices_ok(params[:1] if quick else params)
        except ValueError as e:
            for i, p in enumerate(params):  # (which parameter, by the caller's name of it)
                try:
                    devices_ok([p])
                except ValueError as one:
                    raise ValueError(f"{owner}: {name(i)}: {one}") from None
            raise ValueError(f"{owner}: {e}") from None
    if quick and fit(params, params, "rc") and fit(params, grads, "rc") \
            and all(fit(params, col, s.dom, 1 if s.name in program.quant else 0)
                    for s, col in zip(program.states, states)) \
            and fit(params, steps, SCALAR_STATE, 3):
        # (the common case, in the native module's passes: a few ns a tensor; states like
        # their parameters, of one number, or 8-bit codes and their scales)
        if any_complex(params):
            _check_complex_call(owner, program, params, states, name)
        return
    for i, (p, g) in enumerate(zip(params, grads)):
        if g.shape != p.shape:
            raise ValueError(f"{owner}: the gradient of {name(i)} has shape {tuple(g.shape)}, "
                             f"but the parameter has shape {tuple(p.shape)}")
    try:
        check_state_devices(backend, program, params, states)
        check_states(backend, program, params, states)
        check_codes(backend, program, states)
        check_dtypes(backend, program, params, grads, states)
    except ValueError as e:
        for i, p in enumerate(params):  # (which parameter, by the caller's name of it)
            try:
                its = [[col[i]] for col in states]
                check_state_devices(backend, program, [p], its)
                check_states(backend, program, [p], its)
                check_codes(backend, program, its)
                check_dtypes(backend, program, [p], [grads[i]], its)
            except ValueError as one:
                words = str(one).replace(" of parameter 0 ", " ")
                raise ValueError(f"{owner}: {name(i)}: {words}") from None
        # (none refused alone: a real state of a complex parameter is found beside another's
        # complex one; the checks below name it)
        unnamed = ValueError(f"{owner}: {e}")
    else:
        unnamed = None
    supported = getattr(codegen.kernel(backend, program), "state_dtypes", None)  # (compiled)
    for i, t in enumerate(steps):  # (the compiled kernels read an int32; not a tensor: named
        if not isinstance(t, torch.Tensor):  # by the caller's check of what it writes)
            continue
        if t.dim() != 0 or t.device != params[i].device or (
                supported is not None and t.dtype != torch.int32):
            raise ValueError(f"{owner}: {name(i)}: backend '{backend}': a step counter must be "
                             "a 0-d " + ("tensor (one number)" if supported is None else
                                         "int32 tensor") + f" on {params[i].device}, got shape "
                             f"{tuple(t.shape)} and dtype {t.dtype} on {t.device}")
    for what, dom, col in (("parameters", "rc", params), ("gradients", "rc", grads),
                           *((f"state '{s.name}'", s.dom, col)
                             for s, col in zip(program.states, states))):
        # (a complex tensor is stepped as its real view: one like its parameter is complex
        # like it, one of one number real)
        bad = next((i for i, x in enumerate(col) if supported is not None and (
            x.dtype.to_real() not in supported
            or x.is_complex() != (params[i].is_complex() and dom == "rc")
            or x.dtype == torch.uint8 and what[0] != "s")), None)
        if bad is None:
            continue
        x, p = col[bad], params[bad]
        if x.dtype.to_real() in supported and (x.dtype != torch.uint8 or what[0] == "s"):
            raise ValueError(f"{owner}: {name(bad)}: {what} is of dtype {x.dtype}, but its "
                             f"parameter is of dtype {p.dtype}: "
                             + (like_words(dom, p) if what[0] == "s" else
                                "complex like it" if p.is_complex() else "real like it"))
        raise ValueError(f"{owner}: {name(bad)}: backend '{backend}' does not support {what} "
                         f"of dtype {x.dtype}")
    if any_complex(params):  # (``as_real``'s checks, here before the first call writes)
        _check_complex_call(owner, program, params, states, name)
    if unnamed is not None:
        raise unnamed from None


def _check_complex_call(owner: str, program: Program, params, states, name) -> None:
    """``check_call``'s ValueError, naming the parameter, where ``as_real`` would refuse a
    call's complex parameters on any backend: a program with row and column reductions
    (none has a matrix view), or a state whose complexness is not its parameter's (a real
    ``mu`` kept from before ``p.data`` became complex). ``as_real`` refuses them inside the
    run, after the calls before it have written."""
    if program.uses_axes:
        i = next(i for i, p in enumerate(params) if p.is_complex())
        raise ValueError(f"{owner}: {name(i)} {complex_axes_words(program, params[i])}")
    try:
        check_complexness(owner, program, params, states)
    except ValueError:
        for i, p in enumerate(params):  # (which parameter, by the caller's name of it)
            try:
                check_complexness(owner, program, [p], [[col[i]] for col in states])
            except ValueError as one:  # (on every backend alike: no backend named)
                words = str(one).removeprefix(f"{owner}: ").replace(" of parameter 0 ", " ")
                raise ValueError(f"{owner}: {name(i)}: {words}") from None
        raise


def mode(program: Program, name: str, params, states, values) -> None:
    """Set ``params`` in place to their values in mode ``name`` (the reference kernel's
    ``mode``), read with ``states`` (a list per state of the program): complex parameters as
    their real pairs, as the step steps them (``as_real``; a conjugate as a copy copied
    back), where the kernel's arithmetic in the real compute dtype would drop their
    imaginary parts."""
    kern = codegen.kernel("reference", program)
    if not any_complex(params):
        kern.mode(name, params, states, values)
        return
    real_p, _, real_s = as_real(program, params, [], states, True)
    kern.mode(name, real_p, real_s, values)
    as_complex(params, states, real_p, real_s, real_p, real_s, True)


def as_real(program: Program, params, grads, states, donate: bool):
    """(params, grads, states) of a step over complex parameters, each complex tensor as its
    real view, checked first (``check_complexness``: a real view of a complex state would
    pass as the parameter's real view does, where torch.optim refuses it). A conjugate
    written in place steps as a resolved copy, which ``as_complex`` copies back; while
    dynamo traces, which cannot ask which are conjugates, it is refused as before."""
    z = next((p for p in params if p.is_complex()), None)
    if z is not None:
        _no_complex_axes(program, z)
    check_complexness(program.name, program, params, states)
    writes = not (donate and torch.compiler.is_compiling())
    return ([_real(p, writes) for p in params], [_real(g) for g in grads],
            [[_real(s, writes) for s in col] for col in states])


def as_complex(params, states, real_p, real_s, new_p, new_s, donate: bool):
    """The new (params, states) of a step over ``as_real``'s tensors, complex where their
    old values were: a pure step's new values viewed as complex; in place, the old tensors
    themselves, a conjugate stepped as a copy copied back."""
    if not donate:
        return ([torch.view_as_complex(n) if o.is_complex() else n
                 for o, n in zip(params, new_p)],
                [[torch.view_as_complex(n) if o.is_complex() else n for o, n in zip(col, ncol)]
                 for col, ncol in zip(states, new_s)])
    if not torch.compiler.is_compiling():
        for orig, real in zip([*params, *(s for col in states for s in col)],
                              [*real_p, *(s for col in real_s for s in col)]):
            if orig.is_complex() and orig.is_conj():
                orig.copy_(torch.view_as_complex(real))
    return list(params), [list(col) for col in states]
