"""``torch.optim.Optimizer`` classes over compiled specs.

The class only groups parameters and owns their state; the step is
``vega.runtime.engine.run``, the same as the functional API's. Each parameter
keeps torch's state layout: ``state[p] = {'mu': ..., 'nu': ..., 'step': ...}``,
with ``step`` a 0-d int32 tensor on the parameter's device.
"""
from __future__ import annotations

import collections
import difflib
import functools
import inspect
import math
import numbers
import operator
import weakref
from itertools import repeat
from typing import Callable, TypeVar, overload

import torch

from vega import codegen
from vega.codegen import quant
from vega.codegen.base import distinct, state_shape
from vega.codegen.record import finite_of
from vega.codegen.steps import INT32_MAX
from vega.codegen.tensors import (LAZY_LOAD_WORDS, NO_GRAD, NOT_PLAIN, NOT_STRIDED,
                                  PLAIN_TYPES, dense, dense_words, first_with_own_ops, gather,
                                  inplace_problem, in_memory_order, is_dtensor, like_layout,
                                  not_dense, own_ops_words, same, uninitialized)
from vega.errors import VegaError, warn
from vega.runtime import engine, sharded, torch_names
from vega.runtime.loss_scale import LEAVES, LossScale, check_scale_values

_Loss = TypeVar("_Loss")  # what a step's closure returns, and the step (its loss)
# a loss scale's tensor -> (a weak reference to) the optimizer that adjusts it (``_claim_scale``)
_SCALE_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LAYOUT = operator.attrgetter("layout")
_GRAD = operator.attrgetter("grad")


def _any_sparse(grads) -> bool:
    """Whether any gradient is sparse, of any layout but strided (COO, CSR, CSC, BSR, BSC:
    a map of an attrgetter, fast, where dynamo is not tracing: it cannot trace one)."""
    if torch.compiler.is_compiling():
        return any(g.layout != torch.strided for g in grads)
    return any(layout != torch.strided for layout in map(_LAYOUT, grads))


class _States(collections.defaultdict):
    """An optimizer's ``state``: torch's ``defaultdict(dict)`` of each parameter's state dict,
    counting the changes of which dict a parameter has (``changes``). A step whose plan
    counted as many reuses the state dicts it found without looking each parameter up (a
    tensor hashes in Python, about 0.2 µs a parameter); their entries it reads each step."""

    changes = 0
    plans = None  # the optimizer's list of step plans (``SpecOptimizer._plans``)

    def _changed(self) -> None:
        self.changes += 1

    def _removed(self) -> None:
        """A state dict was removed or replaced: the plans that hold it (and through it its
        tensors) go now, not at the next step, so that its memory is freed when the caller
        drops it (``state.clear()`` to free an optimizer's memory)."""
        self.changes += 1
        if self.plans:
            self.plans.clear()

    def __setitem__(self, key, value):
        if self.plans and key in self:
            self._removed()
        else:
            self._changed()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._removed()
        super().__delitem__(key)

    def __ior__(self, other):
        self._removed()  # (as update: it may replace state dicts)
        return super().__ior__(other)

    def clear(self):
        self._removed()
        super().clear()

    def pop(self, *args):
        self._removed()
        return super().pop(*args)

    def popitem(self):
        self._removed()
        return super().popitem()

    def setdefault(self, *args):
        self._changed()
        return super().setdefault(*args)

    def update(self, *args, **kwargs):
        self._removed()  # (it may replace state dicts, as __setitem__ does)
        super().update(*args, **kwargs)


def _counting(state) -> _States:
    """``state`` (torch's ``defaultdict(dict)``, or a dict) as a ``_States``."""
    return state if type(state) is _States else _States(dict, state)


class SpecOptimizer(torch.optim.Optimizer):
    """Base of the optimizer classes; see ``CompiledSpec.optimizer_class``."""

    spec = None  # the CompiledSpec, set on each subclass
    _vega_torch_only: dict = {}  # torch_names.torch_only of its rule, set on each subclass
    # the fused-step settings, as the constructor takes them (set after it, a step checks them)
    max_grad_norm: float | None
    loss_scale: LossScale | None
    skip_nonfinite: bool

    def __init__(self, params, *args, backend: str | None = None,
                 state_dtype=None, max_grad_norm: float | None = None,
                 loss_scale=None, skip_nonfinite: bool = False, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None,
                 capturable: bool | None = None, differentiable: bool = False,
                 reduce_group=None, master_weights: bool = False,
                 stochastic_rounding: bool = False, rounding_seed: int = 0, **hypers):
        owner = type(self).__name__
        if self.spec is None:
            raise TypeError(f"{owner} has no rule: SpecOptimizer is the base of vega's "
                            "classes; make one of vega.optim's, or a spec's "
                            "(vega.compile(...).optimizer_class)")
        # (lr, and torch's other hyperparameters, by position: SGD(params, 0.1))
        torch_names.positional(owner, self.spec.class_name, self.spec, args, hypers)
        codegen.check_backend(backend)
        engine.check_precision(owner, master_weights, stochastic_rounding, rounding_seed)
        engine.check_fused(owner, max_grad_norm, skip_nonfinite, loss_scale)
        sharded.check_group(owner, reduce_group)
        self.reduce_group = reduce_group
        torch_names.check_keywords(owner, maximize, foreach, fused, capturable, differentiable)
        torch_names.take_rule_keywords(owner, self.spec.class_name, self.spec, hypers,
                                       self._vega_torch_only)
        torch_names.split_tuples(owner, self.spec, hypers)
        flags, values = engine.resolve(owner, self.spec.hypers, hypers)
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale
        self.skip_nonfinite = skip_nonfinite
        betas = {key: tuple(values[n] for n in ns)  # (betas; Rprop's etas, step_sizes)
                 for key, ns in torch_names.tuple_keys(self.spec).items()}
        if self.spec.modes:  # (schedule-free's: the parameters step in mode "train")
            if sorted(self.spec.modes) != ["eval", "train"]:  # (eval() then train(): there
                raise ValueError(                              # and back)
                    f"{owner}: the rule's modes are {', '.join(map(repr, self.spec.modes))}; "
                    "the class steps in mode 'train' and switches with train() and eval(), "
                    "so its rule declares exactly 'train' and 'eval' (the functional "
                    "spec.mode(name, ...) takes any)")
            betas["mode"] = "train"
        super().__init__(params, {**flags, **values, **betas, "maximize": maximize,
                                  "backend": backend, "state_dtype": state_dtype,
                                  "master_weights": master_weights,
                                  "stochastic_rounding": stochastic_rounding,
                                  "rounding_seed": rounding_seed})
        self.state = _counting(self.state)
        sync = self._tuples()  # (the defaults' tuples as made: ``TupleSync.sync_defaults``)
        sync.made = {key: tuple(self.defaults[key]) for key in sync.keys if key in self.defaults}
        self._claim_scale()

    def add_param_group(self, param_group: dict) -> None:
        """torch's, checked before the group is kept: a dict with ``'params'``, its tensors
        float or complex, dense and each given once, its hyperparameters in their ranges and
        the whole optimizer's settings (``max_grad_norm``, ...) at the optimizer's values
        (``ValueError``), and no key that looks like a misspelt hyperparameter
        (``TypeError``, naming the one meant). A refused group leaves the optimizer as
        it was."""
        owner = type(self).__name__
        if isinstance(param_group, dict) and "params" not in param_group:
            raise ValueError(f"{owner}: a parameter group is a dict with 'params' (the "
                             f"tensors it steps), got one with {sorted(map(str, param_group))}")
        if isinstance(param_group, dict):
            self._check_group_keys(owner, param_group)
            sharded.warn_group_objects(owner, self, param_group)
            self._tuples().fill(owner, param_group, self.defaults)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(owner, group)
            self._check_params(owner, group, len(self.param_groups) - 1)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._tuples().remember(group)

    @staticmethod
    def _check_params(owner: str, group: dict, index: int) -> None:
        """ValueError for a parameter of group ``index`` given twice (torch only warns; a step
        in place would write it twice), not float or complex, or not dense."""
        first: dict[int, int] = {}  # id -> its first position
        for k, p in enumerate(group["params"]):
            j = first.setdefault(id(p), k)
            if j != k:
                raise ValueError(f"{owner}: parameter {k} of group {index} is parameter {j} "
                                 f"again: give each parameter once")
            if not p.is_floating_point() and not p.is_complex():
                raise ValueError(f"{owner}: parameter {k} of group {index} is of dtype "
                                 f"{p.dtype}; {owner} can only optimize float or "
                                 "complex tensors")
            if not dense(p):
                raise ValueError(f"{owner}: parameter {k} of group {index} is "
                                 f"{dense_words(p)}")

    def _check_group_keys(self, owner: str, given: dict) -> None:
        """Refuse a group's key that would be ignored where its author meant a setting: one
        of the whole optimizer's (``max_grad_norm``: every group's gradients are clipped
        together) at a value other than the optimizer's, a misspelling of a hyperparameter
        (``lr_``: TypeError, as the constructor's), and torch's keywords as the constructor
        refuses them. Other keys (a name, a scheduler's ``initial_lr``) are kept, as torch
        keeps them."""
        for key in ("max_grad_norm", "loss_scale", "skip_nonfinite", "reduce_group"):
            if key not in given:
                continue
            theirs, mine = given[key], getattr(self, key, None)
            # (ZeroRedundancyOptimizer's groups hold its keywords, the optimizer's own)
            if theirs is mine or (isinstance(theirs, numbers.Real)
                                  and isinstance(mine, numbers.Real) and theirs == mine):
                continue
            raise ValueError(f"{owner}: a parameter group has {key}={engine.shown(theirs)}, "
                             f"but the optimizer's is {engine.shown(mine)}: {key} is a setting "
                             f"of the whole optimizer (the groups step together); give it to "
                             f"{owner}(..., {key}=...)")
        torch_names.check_torch_only(owner, self.spec.class_name, self._vega_torch_only, given)
        torch_names.check_keywords(owner, False, given.get("foreach"), given.get("fused"),
                                   given.get("capturable"), given.get("differentiable", False))
        known = {*_group_keys(self.spec), *_optional_keys(self.spec),
                 *torch_names.KEYWORDS, *_torch_hyper_names()}
        for key in given:
            if isinstance(key, str) and key not in known and key not in _GROUP_EXTRAS:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
                if close:
                    raise TypeError(f"{owner}: a parameter group has {key!r}, unknown to "
                                    f"{owner} (did you mean {close[0]!r}?)")

    def _check_group(self, owner: str, group: dict) -> None:
        """ValueError (or TypeError) where a group's settings are not ones a step can take:
        ``maximize``, ``backend``, ``state_dtype``, the precision settings and the
        hyperparameters (a group given to the optimizer, or loaded)."""
        self._check_settings_of(owner, _settings(group))
        _precision(owner, group)
        engine.resolve(owner, self.spec.hypers, {h.name: group[h.name] for h in self.spec.hypers})
        engine.shape_values(owner, self.spec._spec, {}, group)

    def _tuples(self) -> torch_names.TupleSync:
        """Which of each of torch's tuples (``betas``, ...: ``torch_names.tuple_keys``) and
        the values it names each group last had in step (kept off torch's state: an unpickled
        or loaded optimizer starts without)."""
        sync = self.__dict__.get("_vega_tuples")
        if sync is None:
            sync = self.__dict__["_vega_tuples"] = torch_names.TupleSync(
                torch_names.tuple_keys(self.spec))
        return sync

    def _group_values(self, group, k: int | None = None):
        """The group's (bool hyperparameters, float hyperparameters), checked, each as the
        check takes it (a real number of another type, a ``Fraction``, as its float, as
        the constructor and the functional step take it). ``k``: the group's position,
        where a step asks: values of immutable types (numbers, bools) checked at its last
        step are not checked again while the group holds the same objects (a tensor, which
        may change in place, or a schedule is checked each step)."""
        hypers = self.spec.hypers
        flags = {h.name: group[h.name] for h in hypers if h.type == "bool"}
        values = {h.name: group[h.name] for h in hypers if h.type == "float"}
        now = (*flags.values(), *values.values())
        keep = k is not None and _IMMUTABLE.issuperset(map(type, now)) \
            and not torch.compiler.is_compiling()
        if keep:
            kept = self.__dict__.setdefault("_vega_values_checked", {})
            last = kept.get(k)
            if last is not None and same(now, last):
                return flags, values
        flags, values = engine.resolve(type(self).__name__, hypers, {**flags, **values})
        if keep:
            kept[k] = now
        return flags, values

    def _init_state(self, p, program, values, group, at_zero: dict | None = None,
                    memo: dict | None = None):
        """A new parameter's state. ``at_zero``: the values at step 0 by device, filled
        here, so that a schedule is evaluated once for all the new parameters of a step;
        ``memo``: ``engine.init_leaf``'s, for the new parameters of one step of ``group``."""
        step = torch.zeros((), dtype=torch.int32, device=p.device)
        at_zero = {} if at_zero is None else at_zero
        vals = at_zero.get(p.device)
        if vals is None:
            vals = at_zero[p.device] = engine.at_step(values, step)
        leaves = engine.init_leaf(program, p, vals,
                                  engine.state_dtype_of(self.spec._spec, group["state_dtype"]),
                                  lambda: f"{type(self).__name__}: {self._name(p)}", memo)
        state = {s.name: leaf for s, leaf in zip(program.states, leaves)}
        state["step"] = step
        return state

    def _adapt_state(self, p, st: dict, want: set, program, values, group) -> bool:
        """A state a hyperparameter's value turned on or off (sgd's v, when momentum
        becomes positive or returns to 0): created fresh where missing, kept where no
        longer read, as torch keeps its momentum_buffer. A master copy (``master_weights``
        turned on, or a state loaded without one): made from the parameter where missing,
        dropped where no longer kept (a stale copy must not come back), its value taken by a
        parameter no longer half. False for any other mismatch."""
        lazy = self._lazy_states()
        missing, extra = want - st.keys(), (st.keys() & self._rule_keys()) - want
        if not (missing <= lazy and extra <= lazy):
            return False
        undo = self.__dict__.get("_vega_fresh")  # (what ``_refused`` undoes)
        if missing:
            fresh = self._init_state(p, program, values, group)
            st.update({name: fresh[name] for name in missing})
            if undo is not None:
                undo.append(lambda: [st.pop(name, None) for name in missing])
        if engine.MASTER in extra and engine.MASTER in lazy:
            if group.get("master_weights") and p.dtype not in engine.HALF_PARAMS:
                # a half parameter made float32 (``model.float()``): it steps on from its
                # master copy, the value the steps made, not from that value rounded
                if undo is not None:
                    undo.append(functools.partial(p.copy_, p.detach().clone()))
                p.copy_(st[engine.MASTER])
            self._drop_master(st)
        return True

    def _drop_master(self, st: dict) -> None:
        """``st``'s master copy dropped; kept for ``_refused`` to put back."""
        master = st.pop(engine.MASTER)
        undo = self.__dict__.get("_vega_fresh")
        if undo is not None:
            undo.append(functools.partial(st.__setitem__, engine.MASTER, master))

    def _lazy_states(self) -> frozenset:
        """The states a step makes where missing and keeps where no longer read: those an if
        on values or on bools declares (sgd's ``v``, amsgrad's ``nu_max``: torch.optim.Adam
        keeps its ``max_exp_avg_sq`` where amsgrad is turned off), and the master copy
        (unless the spec has a state of that name)."""
        spec = self.spec._spec
        own = engine.MASTER in spec.state_names
        lazy = spec.value_states | spec.flag_states
        scales = frozenset(n + quant.SUFFIX for n in lazy)  # (8-bit ones')
        return lazy | scales | (
            frozenset() if own else frozenset({engine.MASTER}))

    def _rule_keys(self) -> frozenset:
        """The entries of a parameter's state that are the rule's: its states (those its ifs
        turn on or off too), their 8-bit scales, the master copy and the step counter. Any
        other entry is the caller's own (an average of its own, a note), which a step keeps
        and never reads, and which ``state_dict`` saves and ``load_state_dict`` loads as
        torch.optim's do."""
        names = self.spec._spec.state_names
        return frozenset({*names, *(n + quant.SUFFIX for n in names), engine.MASTER, "step"})

    def _refuse_torch_state(self, p, st: dict, want: set) -> None:
        """ValueError where ``st`` holds the entries of a torch.optim class's state, written
        into this optimizer's without its ``load_state_dict`` (as
        ZeroRedundancyOptimizer.load_state_dict writes the state of the optimizer it
        wraps): not converted, and not the caller's own entries either."""
        theirs = [f"torch.optim.{n}" for n, keys in _TORCH_STATES.items()
                  if set(keys) == st.keys()]
        if theirs:
            owner = type(self).__name__
            raise ValueError(
                f"{owner}: the state of {self._name(p)} has {sorted(map(str, st))}, the "
                f"entries of {' or '.join(theirs)}'s state, where this optimizer "
                f"keeps {sorted(want)}: a state written into it without its "
                "load_state_dict (as ZeroRedundancyOptimizer.load_state_dict writes "
                "the state of the optimizer it wraps) is not converted; load it into "
                f"a vega.optim.{owner} with load_state_dict, which converts torch's "
                "states, and save that optimizer's state_dict")

    # (without a closure None; with one, what it returned: typed so, a checker infers which)
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], _Loss] | None = None) -> _Loss | None:
        """One fused update of every parameter that has a gradient; returns the closure's loss.

        With ``loss_scale``: gradients are divided by the scale, and the scale is
        adjusted afterwards, in place (``LossScale.adjust_``: the same tensors every step,
        as a captured CUDA graph needs). With
        ``max_grad_norm``: clipped by their joint norm over all groups. With a
        loss scale or ``skip_nonfinite``: a step whose gradients are not all
        finite changes no parameter and no state. Nothing is read back to the host.
        """
        if not torch.compiler.is_compiling():  # (refused under torch.func.grad, jvp,
            engine.class_step_transforms(  # functionalize; vmap of its own tensors)
                type(self).__name__, self._functional_step, self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # (the update outside autocast, the closure's forward pass in it)
        return engine.without_autocast(self._update, loss)

    def _update(self, loss):
        """The update of ``step``, after its closure; returns ``loss``."""
        self._check_settings()
        found_work = []  # (group, its engine.run calls)
        plain = set()  # the positions of those whose tensors are all plain (``_planned_work``)
        if not torch.compiler.is_compiling():  # the states this step makes (``_refused``)
            self.__dict__["_vega_fresh"] = []
        sync = self._tuples()
        try:  # (refused here: the states a first step made in an earlier group are dropped)
            for k, group in enumerate(self.param_groups):
                if group.get("mode", "train") != "train":
                    raise ValueError(f"{type(self).__name__}: step() with the parameters in "
                                     f"mode {group['mode']!r}; call train() before stepping")
                sync.sync(type(self).__name__, k, group)
                self._check_group_settings(k, group)
                flags, values = self._group_values(group, k)
                found, grads, is_plain = (None, self._grads(group), False) \
                    if torch.compiler.is_compiling() else \
                    self._planned_work(k, group, flags, values)
                if found is None:
                    found = self._group_work(k, group, grads, flags, values)
                elif is_plain:
                    plain.add(len(found_work))
                found_work.append((group, found))
            sync.keep(self.param_groups)
            if self.__dict__.get("_vega_fresh"):  # (states made: the records they need)
                self._mark_maps()
            self._check_scale_values(found_work)
            group_of = getattr(self, "reduce_group", None)
            spread = group_of is not None or any(item[0].spans_group or (
                k not in plain and sharded.involved(item[2], None))
                for k, (_, w) in enumerate(found_work) for item in w)
        except BaseException as err:  # (refused, or interrupted: nothing written yet)
            self._refused()
            missing = self._missing_setting(err)
            if missing is not None:
                raise missing from None
            raise
        if spread:
            # DTensors, a reduce_group, or reductions over a group: vega.runtime.sharded
            check = self.skip_nonfinite or self.loss_scale is not None
            try:  # (a wrapper subclass, TwoTensor, on the reference backend, as below,
                # where no DTensor or reduce_group spreads the step, as the functional step
                # routes it)
                local = group_of is None and not any(
                    k not in plain and sharded.involved(item[2], None)
                    for k, (_, w) in enumerate(found_work) for item in w)
                found_work = [(group, w if k in plain or not local else self._routed(group, w))
                              for k, (group, w) in enumerate(found_work)]
            except BaseException:
                self._refused()
                raise
            items = [i for _, w in found_work for i in w]
            all_plain = all(k in plain or PLAIN_TYPES.issuperset(map(type, it[2]))
                            for k, (_, w) in enumerate(found_work) for it in w)
            try:
                if len(items) > 1 and all_plain:
                    # (plain parameters, several calls: each checked before the first writes)
                    self._check_writes(items)
                    self._check_work(items)
                sharded.check_meta_sums(type(self).__name__, items,
                                        [k for k, (_, w) in enumerate(found_work) for _ in w],
                                        lambda j, k: self._name(items[j][2][k]))
                pre, _ = sharded.fused(type(self).__name__, items,
                                       engine.inverse_scale(self.loss_scale),
                                       self.max_grad_norm, check, True, group_of,
                                       [k for k, (_, w) in enumerate(found_work) for _ in w],
                                       spans=self.spec._spec.spans_group,
                                       plain=[k in plain for k, (_, w) in enumerate(found_work)
                                              for _ in w],
                                       name=lambda j, k: f"{type(self).__name__}: the gradient "
                                                         f"of {self._name(items[j][2][k])}")
            except (TypeError, ValueError, VegaError):  # (refused, or its kernels not built,
                self._refused()                          # before anything was written)
                if len(items) == 1 and all_plain:  # (in the class's words, where it has them)
                    self._check_writes(items)
                    self._check_work(items)
                raise
            if self.loss_scale is not None:  # (in place, as below)
                self.loss_scale.adjust_(finite_of(pre))
            self._share_group_states(found_work)
            self.__dict__.pop("_vega_fresh", None)
            return loss
        try:
            compiling = torch.compiler.is_compiling()
            work = [item for k, (group, w) in enumerate(found_work)
                    for item in (w if k in plain else self._routed(group, w))]
            # all checked before any is written; one call of a kernel that checks its own
            # tensors so (``checks_writes``) needs no more, and only what it refuses is named
            # here (not asked while dynamo traces: the C kernel's asks native.module(), which
            # locks)
            one_call = not compiling and len(work) == 1 and \
                getattr(codegen.kernel(work[0][1], work[0][0]), "checks_writes", False)
            if not compiling:  # (groups of one program: one call, a values dict a tensor,
                work = _joined(work)  # checked here as the calls were, to name a tensor)
            if not compiling and not one_call:
                self._check_writes(work)
            # what each call's kernel would refuse, and each one's values at its step
            # counters, found before the first call writes anything
            evaluated = None if compiling or one_call else self._check_work(work)
            check = self.skip_nonfinite or self.loss_scale is not None
            pre = engine.prelude([(prog, be, gs) for prog, be, _, gs, _, _, _ in work], None,
                                 self.max_grad_norm, check, loss_scale=self.loss_scale,
                                 name=lambda j, k: f"{type(self).__name__}: the gradient of "
                                                   f"{self._name(work[j][2][k])}")
        except BaseException:  # (refused, or interrupted: nothing written yet)
            self._refused()
            raise
        # the last step's kernels adjust the loss scale themselves where they can (Triton:
        # in the launch that advances the counters, none of its own)
        adjusted = False
        if self.loss_scale is not None and work:
            program, backend, params = work[-1][:3]
            kern = codegen.kernel(backend, program)
            adjusted = hasattr(kern, "adjusts") and kern.adjusts(params, True, self.loss_scale)
        for k, (program, backend, params, grads, states, steps, values) in enumerate(work):
            try:
                engine.run(program, backend, params, grads, states, steps,
                           _per_tensor(values, params) if evaluated is None else evaluated[k],
                           donate=True, pre=pre,
                           adjust=self.loss_scale if adjusted and k == len(work) - 1 else None,
                           evaluated=evaluated is not None)
            except (ValueError, VegaError) as err:
                if k == 0:  # (the first call writes nothing before it refuses its tensors, or
                    self._refused()  # fails to build its kernels: no state made is kept)
                if one_call and isinstance(err, ValueError):  # (in the class's words)
                    self._check_writes(work)
                    self._check_work(work)
                raise
        if self.loss_scale is not None and not adjusted and work:
            # (a step with no gradient at all checked none: the scale stays, as every state
            # does; torch.amp.GradScaler refuses such a step, "No inf checks were recorded")
            self.loss_scale.adjust_(finite_of(pre))
        self.__dict__.pop("_vega_fresh", None)
        return loss

    def _missing_setting(self, err: BaseException) -> ValueError | None:
        """Where ``err`` is the KeyError of a setting a group lacks (deleted from it, or the
        group appended to ``param_groups`` by hand, which ``add_param_group`` would have
        filled from the defaults): a ValueError naming the group and the settings it lacks,
        for the bare KeyError of the key, raised from deep in the step."""
        if type(err) is not KeyError or len(err.args) != 1 or \
                not isinstance(err.args[0], str) or err.args[0] not in self.defaults:
            return None
        for k, group in enumerate(self.param_groups):
            if err.args[0] not in group:
                missing = ", ".join(map(repr, sorted(self.defaults.keys() - group.keys())))
                return ValueError(
                    f"{type(self).__name__}: group {k} has no {missing}: a setting deleted "
                    "from it, or a group put in param_groups by hand (add_param_group fills a "
                    "new group's settings from the defaults)")
        return None

    def _refused(self) -> None:
        """A step refused before it wrote anything leaves no state it made either: the
        parameters' states made in it (``_group_work``: their first step) are dropped, with
        the plans that hold them, and what it changed of states it found is put back, last
        first (a master copy dropped, a parameter that took its master copy's value, a
        state a value turned on: ``_adapt_state``)."""
        fresh = self.__dict__.pop("_vega_fresh", None)
        if fresh:
            for item in reversed(fresh):
                if isinstance(item, torch.Tensor):
                    self.state.pop(item, None)
                else:
                    item()
            self._plans().clear()

    def _check_settings(self) -> None:
        """``check_fused`` of the settings as the step finds them (an attribute set after
        construction, ``opt.max_grad_norm = 0.0``, is checked as the constructor's
        argument), once for each value: the last ones checked are kept."""
        ls = self.loss_scale
        now = (self.max_grad_norm, self.skip_nonfinite, ls)
        if torch.compiler.is_compiling():  # (constants to dynamo: nothing kept, no guard)
            engine.check_fused(type(self).__name__, *now)
            return
        # (the scale's settings too: ``adjust`` refuses them after the update has written)
        config = ls._config() if isinstance(ls, LossScale) else ()
        last = self.__dict__.get("_vega_checked")
        if last is not None and all(map(operator.is_, now + config, last)):
            return
        engine.check_fused(type(self).__name__, *now)
        self._claim_scale()
        self.__dict__["_vega_checked"] = now + config

    def _place_scale(self) -> None:
        """A loss scale made without a device lives where the parameters are (no copy a
        step): moved there when the optimizer is made, or, where the parameters are on the
        meta device then (a model made there, for ``to_empty``), when a step first finds
        them elsewhere: a scale moved to meta would lose its values."""
        ls = self.loss_scale
        if ls is None or ls.device_given:
            return
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is not None and first.device.type != "meta":
            ls.to_(first.device)

    def _check_scale_values(self, found_work) -> None:
        """ValueError where the loss scale holds inference tensors outside inference mode
        (torch refuses their update in place), or where the gradients are on the meta device
        (so are the parameters: a step computes no values there) and the loss scale holds
        values, which the step would adjust in place by values it has not. Not asked while
        dynamo traces the step (it cannot trace ``torch.is_inference_mode_enabled``)."""
        ls = self.loss_scale
        if ls is None or torch.compiler.is_compiling():
            return
        if not torch.is_inference_mode_enabled() and any(
                t.is_inference() for t in ls.tensors()[:3]):
            raise ValueError(
                f"{type(self).__name__}: loss_scale holds inference tensors (made under "
                "torch.inference_mode()), which the step, adjusting them in place, cannot "
                "update outside inference mode; make the scale outside inference mode, or "
                "step inside it")
        g = next((g for _, w in found_work for item in w for g in item[3]), None)
        if g is not None and g.device.type == "meta":
            raise ValueError(
                f"{type(self).__name__}: the gradients are on the meta device, where a step "
                "computes no values, but the loss scale, adjusted in place by the step's, "
                f"holds values (on {ls.loss_scale.device}); step parameters on the meta "
                "device without a loss_scale")

    def _claim_scale(self) -> None:
        """The loss scale made this optimizer's: its steps adjust it in place, so that one
        shared with another optimizer would be adjusted by each, and the second would unscale
        its gradients by a scale the loss was not scaled by (and advance its counter twice a
        step). Refused while another optimizer that holds it lives and still has it as its
        ``loss_scale`` (one given another scale since has let it go); placed
        (``_place_scale``) once it is this optimizer's, so that a refused one is not moved."""
        ls = self.loss_scale
        if ls is None:
            return
        if any(t.device.type == "meta" for t in ls.tensors()):  # (before the lookup: a key
            # of the same hash is compared by value, which a meta tensor has not)
            raise ValueError(
                f"{type(self).__name__}: loss_scale is on the meta device, which holds no "
                "values (its scale and counters); make it without a device "
                "(LossScale.dynamic()), and the optimizer puts it where its parameters are")
        held = _SCALE_OWNERS.get(ls.loss_scale)
        other = held() if held is not None else None
        if other is not None and other is not self and getattr(other, "loss_scale", None) is ls:
            raise ValueError(
                f"{type(self).__name__}: loss_scale is the loss scale of another optimizer "
                f"({type(other).__name__}), whose steps adjust it in place: give each optimizer "
                "a LossScale of its own, or step both sets of parameters with one optimizer (a "
                "parameter group each), whose steps share one scale")
        self._place_scale()  # (before its tensor is the key: ``to_`` makes new ones)
        _SCALE_OWNERS[ls.loss_scale] = weakref.ref(self)

    def _check_group_settings(self, k: int, group: dict) -> None:
        """``_check_group``'s checks of the settings a step reads from a group, as the step
        finds them (``opt.param_groups[0]["maximize"] = 1`` is refused as the constructor
        refuses it, before a state is made): ``maximize``, ``backend``, ``state_dtype`` and
        torch's keywords; once for each value, the last ones checked kept (values only, not
        the group: a dropped group's parameters are freed; a dict of state dtypes, which may
        change in place, each step; the hyperparameters and the precision settings are
        checked each step)."""
        only = self._vega_torch_only
        if isinstance(group.get("state_dtype"), (str, dict)):  # (a saved group's, as
            # ZeroRedundancyOptimizer.load_state_dict copies it: ``engine.saved_state_dtype``)
            dtype = engine.loaded_state_dtype(group["state_dtype"])
            if dtype != group["state_dtype"]:
                group["state_dtype"] = dtype
        base = _settings(group)
        now = base + tuple(map(group.get, only)) if only else base
        keep = not torch.compiler.is_compiling() and not isinstance(now[2], dict)
        if keep:
            kept = self.__dict__.setdefault("_vega_group_checked", {})
            last = kept.get(k)
            if last is not None and all(map(operator.is_, now, last)):
                return
        self._check_settings_of(f"{type(self).__name__}: group {k}", base)
        torch_names.check_torch_only(f"{type(self).__name__}: group {k}", self.spec.class_name,
                                     only, group)
        if keep:
            kept[k] = now

    def _check_settings_of(self, owner: str, settings: tuple) -> None:
        """ValueError naming the first of a group's ``_settings`` a step cannot take."""
        maximize, backend, state_dtype, foreach, fused, capturable, differentiable = settings
        torch_names.check_keywords(owner, maximize, foreach, fused, capturable,
                                   differentiable if differentiable is not None else False)
        try:
            codegen.check_backend(backend)
        except ValueError as e:
            raise ValueError(f"{owner}: {e}") from None
        engine.check_state_dtype(owner, state_dtype, self.spec._spec.state_names)

    def _routed(self, group, work: list[tuple]) -> list[tuple]:
        """``work`` (a group's engine.run calls) on the reference backend where a tensor
        is a subclass with operations of its own (a wrapper such as TwoTensor:
        ``vega.codegen.tensors``; a DTensor steps its shard, ``vega.runtime.sharded``) and
        the group names no backend; ValueError where it names another."""
        out = []
        for item in work:
            program, backend, params, grads, states, steps, values = item
            # (a state entry set by hand, the step counter too)
            for n, col in zip([*program.state_names, "step"], [*states, steps]):
                i = next((j for j, x in enumerate(col) if not isinstance(x, torch.Tensor)), None)
                if i is not None:
                    raise ValueError(f"{type(self).__name__}: state '{n}' of "
                                     f"{self._name(params[i])} is {engine.shown(col[i])}, not a "
                                     f"tensor")
            if backend != "reference" and not torch.compiler.is_compiling():
                for what, tensors in (("", params), (" (its gradient)", grads),
                                      *((f" (its state '{n}')", col)
                                        for n, col in zip(program.state_names, states))):
                    i = first_with_own_ops(tensors)
                    if i is None:
                        continue
                    if group["backend"] is None:
                        item = (program, "reference", *item[2:])
                        break
                    raise ValueError(
                        f"{type(self).__name__}: {self._name(params[i])}{what} "
                        f"{own_ops_words(tensors[i])}; backend={backend!r} cannot step it: "
                        f"use backend='reference' (where such tensors step unless a backend "
                        f"is given)")
            out.append(item)
        return out

    def _name(self, p) -> str:
        """A parameter's name in a message: its position in its group."""
        for k, group in enumerate(self.param_groups):
            for j, q in enumerate(group["params"]):
                if q is p:
                    return f"parameter {j} of group {k}"
        return "a parameter"

    def _check_writes(self, work) -> None:
        """Raise ValueError where the step cannot write a parameter, a state or a step
        counter in place, or read a gradient that shares memory with one
        (``vega.codegen.tensors.inplace_problem``), naming it: checked for every tensor of
        every group before any is written."""
        written, where = [], []  # where: (state name, or None for parameters; parameters)
        grads, of = [], []  # (each gradient a step reads, and its parameter)
        for program, _, params, gs, states, steps, _ in work:
            grads += gs
            of += params
            written += params
            where.append((None, params))
            for name, col in zip(program.state_names, states):
                written += col
                where.append((name, params))
            uniq, index = distinct(steps)  # (a counter shared by several: written once)
            written += uniq
            where.append(("step", [params[index.index(u)] for u in range(len(uniq))]
                          if len(uniq) != len(steps) else params))
        problem = inplace_problem(written, grads)
        if problem is None:
            return

        def label(k: int) -> str:
            if k >= len(written):
                return f"the gradient of {self._name(of[k - len(written)])}"
            for name, params in where:
                if k < len(params):
                    p = self._name(params[k])
                    return p if name is None else f"state '{name}' of {p}"
                k -= len(params)
            return "a tensor"
        k, other, words = problem
        if other is not None and label(k) == label(other):  # (one tensor, listed twice)
            raise ValueError(f"{type(self).__name__}: {label(k)} is in the optimizer twice "
                             "(put in a group's list again after it was made): a step in "
                             "place would write it twice; give each parameter once")
        raise ValueError(f"{type(self).__name__}: {label(k)} "
                         f"{words.format(other=label(other)) if other is not None else words}")

    def _check_work(self, work) -> list:
        """Raise ValueError, naming the parameter, where the kernel of a call of ``work``
        (several: parameter groups, or programs) would refuse its tensors or values: its
        backend, the shapes and dtypes of its gradients and states (``check_states``,
        ``check_codes``, ``check_dtypes``), its hyperparameters at each step counter. All
        are checked before the first call writes, so that a step refused for one group has
        not stepped another. Returns each call's values as its kernel takes them
        (``engine.tensor_values``)."""
        owner = type(self).__name__
        out = []
        for program, backend, params, grads, states, steps, values in work:
            engine.check_call(owner, program, backend, params, grads, states, steps,
                              lambda i, params=params: self._name(params[i]))
            kern = codegen.kernel(backend, program)
            out.append(engine.tensor_values(program, kern, _per_tensor(values, params), steps))
        return out

    def _group_work(self, k, group, grads_all, flags, values) -> list[tuple]:
        """The engine.run calls of group ``k``: (program, backend, params, grads, states,
        steps, values) per program; states made where missing; remembered (``_Plan``)."""
        owner = type(self).__name__
        params = [p for p, g in zip(group["params"], grads_all) if g is not None]
        master, seed = _precision(owner, group)
        if not params:
            self._drop_masters(group, master)
            return []
        grads = [g for g in grads_all if g is not None]
        if _any_sparse(grads):
            i = next(i for i, g in enumerate(grads) if g.layout != torch.strided)
            raise ValueError(f"{owner} does not support sparse gradients: the gradient of "
                             f"{self._name(params[i])} is {grads[i].layout}")
        progs = engine.programs(owner, self.spec._spec, flags, values, params, master=master,
                                seed=seed, quantized=self._q8(group, params))
        shaped = "".join(f", or {n} (it picks each tensor's program)"
                         for n in self.spec._spec.shape_hypers)
        wants: dict[int, set[str]] = {}  # id of a program -> the state it needs
        own = self._rule_keys()
        sts = []  # each parameter's state dict (one lookup: a tensor hashes in Python)
        at_zero: dict = {}
        memo: dict = {}  # (engine.init_leaf's: the group's programs live through the loop)
        joined: list = []  # (the group's values of its states of one number per group)
        for p, program in zip(params, progs):
            want = wants.get(id(program))
            if want is None:
                want = wants[id(program)] = {*program.state_names, "step"}
            st = self.state.get(p)
            mine = st.keys() & own if st else None  # (the rule's entries: ``_rule_keys``)
            if not mine:
                if st:  # (the caller's own entries alone: kept, the rule's made beside them)
                    self._refuse_torch_state(p, st, want)
                if program.group_states and not joined:
                    joined.append(self._group_values_now(group, program))
                fresh = self.__dict__.get("_vega_fresh")  # (before the state is set: one
                if fresh is not None and not st:  # interrupted before it is whole is
                    fresh.append(p)  # dropped too)
                made = self._init_state(p, program, values, group, at_zero, memo)
                if st:
                    if fresh is not None:
                        fresh.append(functools.partial(_pop_all, st, tuple(made)))
                    st.update(made)
                else:
                    st = self.state[p] = made
                for name, value in (joined[0] if joined else {}).items():
                    st[name].copy_(value)
            elif mine != want and not self._adapt_state(p, st, want, program, values, group):
                self._refuse_torch_state(p, st, want)
                if "step" not in st:  # (no step made it: written in by hand, or it was deleted)
                    raise ValueError(
                        f"{owner}: the state of {self._name(p)} has {sorted(map(str, st))} and no "
                        "step count: it was written in before the first step made the state "
                        f"({sorted(want)}); write into it after the first step, or into the "
                        "state of a functional init (or, where it had stepped and its 'step' "
                        "was deleted, put back its step count, a 0-d int32 tensor)")
                gone = sorted(want - st.keys() - self._lazy_states())
                if gone and not self.spec._spec.reads_shape:  # (states no setting turns off)
                    raise ValueError(
                        f"{owner}: the state of {self._name(p)} has {sorted(map(str, st))} "
                        f"without {', '.join(map(repr, gone))}, which every step of the rule "
                        "reads (deleted from it?): put it back, or delete the parameter's "
                        "whole state (del opt.state[p]) for its next step to start it anew")
                reshaped = ", or the parameter's shape (now " + str(tuple(p.shape)) + \
                    ")" if self.spec._spec.reads_shape else ""
                raise ValueError(
                    f"{owner}: the state of {self._name(p)} has {sorted(map(str, st))} but the "
                    f"group's settings need {sorted(want)}; was a bool hyperparameter"
                    f"{shaped}{reshaped} changed after the first step?")
            sts.append(st)
        self._drop_masters(group, master)
        device = params[0].device.type
        backend = group["backend"] or codegen.default_backend(device)
        parts = [(program, None if len(ks) == len(params) else ks)
                 for program, ks in engine.groups(progs)]
        plan = _Plan(group, self.state, grads_all, flags, self._choosing(values), device,
                     params, sts, parts, self._shapes(params))
        plan.precision = (master, seed)
        # (master copies and stochastic rounding: programs chosen by the parameters' dtypes)
        plan.dtypes = [p.dtype for p in plan.params] if master or seed is not None else None
        if not torch.compiler.is_compiling():
            plans = self._plans()
            plans += [None] * (k + 1 - len(plans))
            plans[k] = plan
        return plan.work(backend, grads, sts, values)

    def _drop_masters(self, group, master: bool) -> None:
        """Master weights off in ``group``: every parameter's master copy dropped, those
        without a gradient this step too (a stale copy would come back, over what the
        parameter became since, when they are turned on again)."""
        if master or engine.MASTER not in self._lazy_states():
            return
        for q in group["params"]:
            st = self.state.get(q)
            if st and engine.MASTER in st:
                self._drop_master(st)

    def _group_values_now(self, group, program) -> dict:
        """The values a parameter's first state takes from its group where the group holds
        states of one number per group (``Program.group_states``: Prodigy's d and num), as
        those of Prodigy's and D-Adaptation's own implementations are the group's: the
        group's values and its step counter, from a parameter of the group that has stepped
        (``_share_group_states`` keeps them alike); none where none has."""
        names = (*program.group_states, "step")
        for q in group["params"]:
            st = self.state.get(q)
            if st and all(name in st for name in names):
                return {name: st[name] for name in names}
        return {}

    def _shapes(self, params) -> list | None:
        """The parameters' shapes, where the spec picks programs by shape."""
        return [p.shape for p in params] if self.spec._spec.reads_shape else None

    def _choosing(self, values: dict) -> dict:
        """The float hyperparameters that pick programs (``if momentum > 0``)."""
        return {n: values[n] for n in self.spec._spec.shape_hypers if n in values}

    def _plans(self) -> list:
        """The last step's _Plan of each group, by position (kept off torch's state: an
        unpickled or loaded optimizer starts without)."""
        plans = self.__dict__.get("_vega_plans")
        if plans is None:
            plans = self.__dict__["_vega_plans"] = []
        state = self.state
        if type(state) is _States and state.plans is not plans:
            state.plans = plans  # (which it empties where a state dict is removed)
        del plans[len(self.param_groups):]
        return plans

    def _same_programs(self, flags, values, plan) -> bool:
        """The hyperparameters that pick programs pick the plan's: for a spec whose ifs
        read values only, the one program they pick now (a cycled momentum that stays
        positive keeps it); for one that reads shapes too, the same values."""
        spec = self.spec._spec
        if not spec.shape_conditions:
            return True
        if spec.reads_shape:
            return _same(self._choosing(values), plan.choosing)
        master, seed = plan.precision
        program = engine.programs(type(self).__name__, spec, flags, values, plan.params[:1],
                                  master=master, seed=seed,
                                  quantized=self._q8(plan.group, plan.params[:1]))[0]
        return len(plan.parts) == 1 and program is plan.parts[0][0]

    def _planned_work(self, k, group, flags, values) -> tuple[list | None, list | None, bool]:
        """(``_group_work``'s answer again, when nothing it depends on has changed since the
        last step: the same parameters with gradients, settings, state dicts and state
        tensors (checked by identity), and shapes where the spec picks programs by shape;
        else None. Where None, the group's gradients, negated where it maximizes, for
        ``_group_work``. True where every tensor of the answer is a plain one,
        ``PLAIN_TYPES``: none a DTensor or a subclass with operations of its own, so that
        the step need not ask again; False says nothing.) The answer's tensors are
        gathered in one pass a program (``gather``)."""
        plans = self._plans()
        plan = plans[k] if k < len(plans) else None
        ps = group["params"]
        if plan is None or plan.group is not group or plan.state is not self.state \
                or not same(ps, plan.all_params) \
                or flags != plan.flags \
                or plan.precision != _precision(type(self).__name__, group) \
                or not self._same_programs(flags, values, plan):
            return None, self._grads(group), False
        state = self.state
        if type(state) is not _States or state.changes != plan.changes:
            # a state dict was replaced (or added): the same ones again?
            if not all(map(operator.is_, map(state.get, plan.params), plan.sts)):
                return None, self._grads(group), False
            plan.changes = getattr(state, "changes", None)
        # each program's gradients and state tensors in one pass (``gather``); the same
        # parameters with gradients as last time
        gathered, found = [], 0
        for params, sts, names in plan.lists:
            try:
                grads, cols, part_found = gather(params, sts, names)
            except KeyError:  # a state tensor was removed: the slow path says what is missing
                return None, self._grads(group), False
            gathered.append((grads, cols))
            found |= part_found
        if found & (NO_GRAD | NOT_STRIDED) or plan.params[0].device.type != plan.device \
                or self._shapes(plan.params) != plan.shapes \
                or (plan.dtypes is not None and [p.dtype for p in plan.params] != plan.dtypes) \
                or not all(map(operator.is_, map(_GRAD, plan.absent), repeat(None))):
            return None, self._grads(group), False
        backend = group["backend"] or codegen.default_backend(plan.device)
        return [(program, backend, params,
                 torch_names.negated(grads) if group["maximize"] else grads,
                 cols[:-1], cols[-1], values)
                for (program, _), (params, _, _), (grads, cols)
                in zip(plan.parts, plan.lists, gathered)], \
            None, plan.plain and not found & NOT_PLAIN

    @staticmethod
    def _grads(group) -> list:
        """The gradients of a group's parameters (None where one has none), negated where
        it maximizes (as torch's foreach step negates them)."""
        grads = [p.grad for p in group["params"]]  # p.grad: one read (a property)
        return torch_names.negated(grads) if group["maximize"] else grads

    def _share_group_states(self, found_work) -> None:
        """A parameter that did not step (no gradient) takes its group's new value of each
        state of one number per group (``Program.group_states``: Prodigy's d) and its step
        counter, as the group's one value and one counter of Prodigy's and D-Adaptation's
        own implementations: its own would go stale and come back when it steps."""
        for group, work in found_work:
            fresh: dict = {}
            for program, _, params, *_ in work:
                for name in program.group_states:
                    fresh.setdefault(name, self.state[params[0]][name])
            if not fresh or sum(len(item[2]) for item in work) == len(group["params"]):
                continue  # (every parameter of the group stepped)
            fresh["step"] = self.state[work[0][2][0]]["step"]
            stepped = {id(p) for item in work for p in item[2]}
            for p in group["params"]:
                st = self.state.get(p)
                if st and id(p) not in stepped:
                    for name, value in fresh.items():
                        if name in st:
                            st[name].copy_(value)

    def train(self) -> None:
        """Put the parameters in mode ``train``, the mode they step in (schedule-free's y),
        from the mode ``eval()`` put them in; nothing for a rule without modes."""
        self._switch("train")

    def eval(self) -> None:
        """Put the parameters in mode ``eval`` (schedule-free's x, where the loss is
        evaluated), as the spec's ``mode eval { p = ... }`` says; ``train()`` puts them back
        before the next step. Nothing for a rule without modes."""
        self._switch("eval")

    @torch.no_grad()
    def _switch(self, name: str) -> None:
        modes = self.spec.modes
        if not modes:
            return
        owner = type(self).__name__
        try:  # (name is 'train' or 'eval', which __init__ saw are the rule's modes)
            todo = self._switching(owner, name)
        except KeyError as err:  # (a setting missing from a group: named, as a step names it)
            missing = self._missing_setting(err)
            if missing is not None:
                raise missing from None
            raise
        for group, values, params, progs in todo:
            for program, ids in engine.groups(progs):
                ps = [params[i] for i in ids]
                sts = [self.state[p] for p in ps]
                if program.master and name == "train":  # the copies never left mode train
                    for p, st in zip(ps, sts):
                        p.copy_(st[engine.MASTER])
                    continue
                vals = [engine.at_step(values, st["step"]) for st in sts]
                engine.mode(program, name, ps,
                            [[st[n] for st in sts] for n in program.state_names], vals)
            group["mode"] = name

    def _switching(self, owner: str, name: str) -> list:
        """What ``_switch`` writes, each group's states checked before any is written:
        (group, values, its parameters with a state, their programs) a group not in mode
        ``name``."""
        todo = []
        for k, group in enumerate(self.param_groups):
            if group.get("mode", "train") == name:
                continue
            flags, values = self._group_values(group)
            master, seed = _precision(owner, group)
            own = self._rule_keys()  # (a state of the caller's entries alone: not stepped)
            params = [p for p in group["params"] if self.state.get(p, {}).keys() & own]
            progs = engine.programs(owner, self.spec._spec, flags, values, params,
                                    master=master, seed=seed,
                                    quantized=self._q8(group, params))
            if master:  # (a half parameter without its copy yet, which its next step makes,
                # switches from its own value; a float32 one has none: its program, no copy)
                plain = engine.programs(owner, self.spec._spec, flags, values, params,
                                        seed=seed, quantized=self._q8(group, params))
                progs = [prog if engine.MASTER in self.state[p] else alone
                         for prog, alone, p in zip(progs, plain, params)]
            for p, program in zip(params, progs):
                self._check_mode_states(f"{owner}.{name}()", p, self.state[p], program)
            todo.append((group, values, params, progs))
        return todo

    def _check_mode_states(self, owner: str, p, st: dict, program) -> None:
        """ValueError naming the state of ``p`` that a switch of modes cannot read (as the
        step and the functional ``mode`` refuse it): missing, not a tensor, or not of the
        shape and device its parameter needs (a state of another shape that broadcasts
        would write wrong values into the parameter)."""
        for n, dom in [("step", None), *((s.name, s.dom) for s in program.states)]:
            x, where = st.get(n), f"{owner}: state '{n}' of {self._name(p)}"
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{where} is {engine.shown(x)}, not a tensor")
            want = () if dom is None else state_shape(p, dom)
            if tuple(x.shape) != want or x.device != p.device:
                raise ValueError(f"{where} has shape {tuple(x.shape)} on {x.device}, but its "
                                 f"parameter, of shape {tuple(p.shape)}, needs {want} on "
                                 f"{p.device}")

    def _synced_tuples(self, owner: str) -> None:
        """Each group's ``betas`` and ``b1``, ``b2``, ... made to agree now, as the next step
        would (``TupleSync.sync``), before the groups are saved or copied: a loaded or copied
        group, whose memory of which changed is not saved, then holds the values the step
        would have taken."""
        sync = self._tuples()
        for k, group in enumerate(self.param_groups):
            sync.sync(owner, k, group)

    def __getstate__(self) -> dict:
        """torch's (defaults, state, groups) and the fused-step settings (copy.deepcopy,
        pickle); the groups' tuples and the defaults' made to agree first, as the next step
        and ``add_param_group`` would (``TupleSync.sync_defaults``)."""
        self._synced_tuples(type(self).__name__)
        self._tuples().sync_defaults(type(self).__name__, self.defaults)
        return {**super().__getstate__(), "max_grad_norm": self.max_grad_norm,
                "loss_scale": self.loss_scale, "skip_nonfinite": self.skip_nonfinite,
                "reduce_group": getattr(self, "reduce_group", None),
                _PICKLED_MAPS: quant.MAPS}

    def _functional_step(self) -> str:
        """The name of the functional step of this optimizer's rule, for a message."""
        from vega.runtime.library import shipped
        return f"vega.{self.spec.name}_step" if shipped(self.spec) else \
            "its CompiledSpec's step, spec.step"

    def __reduce_ex__(self, protocol):
        """As any object's, but an optimizer of a spec that is not shipped (``vega.compile``)
        is remade from its spec (pickled by its text: ``CompiledSpec.__reduce__``): its
        class, made for that spec, is not the one ``vega.optim`` has by its name (a shipped
        class of the same name, or none), so it cannot be pickled by that name."""
        out = super().__reduce_ex__(protocol)
        cls = type(self)
        if cls.__dict__.get("spec") is None or cls.spec.__dict__.get("optimizer_class") \
                is not cls:
            return out  # (a subclass of the caller's, pickled by its own name)
        from vega.runtime.library import shipped
        if shipped(cls.spec):
            return out
        return (_of_spec, (cls.spec,), *out[2:])

    def __setstate__(self, state: dict) -> None:
        """torch's, then each group's tuples taken as the groups hold them (``__getstate__``
        made them agree), as ``load_state_dict`` takes a loaded group's: a ``b1`` or a
        ``betas`` changed on the copy before its first step is then the one taken, as on the
        optimizer copied (the memory of what changed is not copied). Its 8-bit codes must
        have been pickled under this vega's maps (``quant.MAPS``), as ``load_state_dict``
        checks a state dict's: a ValueError otherwise."""
        state = dict(state)
        maps = state.pop(_PICKLED_MAPS, None)
        states = (state.get("state") or {}).values()
        codes = [] if _no_codes(states) else [n for st in states for n in _codes_in(st)]
        if codes and not _this_maps(maps):
            raise ValueError(
                f"{type(self).__name__}: the pickled optimizer's state {codes[0]!r} holds 8-bit "
                "codes pickled " + ("by a vega that did not record which maps its codes use"
                                    if maps is None else f"under vega's 8-bit maps version "
                                                         f"{maps!r}")
                + f"; this vega reads codes with maps version {quant.MAPS}, whose map for a "
                "state may differ and read them as other values. Unpickle it with the vega "
                "that pickled it, load its state_dict() into an optimizer of float state "
                "(state_dtype=None) there, which dequantizes it, and load that one's here")
        super().__setstate__(state)
        for k, group in enumerate(self.param_groups):
            group.setdefault("maximize", False)  # (pickled before groups held them, as
            for key, default in _PRECISION_DEFAULTS.items():  # load_state_dict takes them)
                group.setdefault(key, self.defaults.get(key, default))
            missing = [h.name for h in self.spec.hypers if h.name not in group]
            if missing:  # (a step would fail on the first one read)
                raise ValueError(f"{type(self).__name__}: group {k} of the pickled optimizer "
                                 f"has no {', '.join(map(repr, missing))}: it was pickled by "
                                 f"a vega whose {type(self).__name__} had no such setting, "
                                 "which this one's rule reads")
            self._tuples().sync(type(self).__name__, k, group)
        # (and the defaults' as they are, which agree: a b1 or betas edited on the copy is
        # then the one a group added takes, as on the optimizer copied)
        self._tuples().sync_defaults(type(self).__name__, self.defaults)

    def state_dict(self) -> dict:
        """torch's format, plus the loss scale's tensors under ``'loss_scale'`` and the
        rule's name (the spec's) under ``'vega_rule'``: ``load_state_dict`` refuses the state
        of another rule, whose groups may hold the same keys (Adam's and AdamW's do) with
        another meaning. torch's state_dict hooks run as torch runs them: the pre-hooks
        first, the post-hooks on the whole state dict, these entries in it."""
        return torch_names.saving(self, self._state_dict)

    def _state_dict(self) -> dict:
        self._synced_tuples(f"{type(self).__name__}.state_dict")
        # each group's records of its 8-bit codes' maps and shards, current (``_mark_maps``:
        # for states a compiled step made too, where the step does not), saved with it
        self._mark_maps()
        torch_names.drop_strays(f"{type(self).__name__}.state_dict", self)
        out = sharded.without_group_objects(self, super().state_dict())
        out["param_groups"] = [  # (dtypes by name; a list of the group's own, copied)
            {**g, quant.LAYOUT_KEY: list(g[quant.LAYOUT_KEY])} if quant.LAYOUT_KEY in g else g
            for g in engine.saved_groups(out["param_groups"])]
        out[torch_names.RULE_KEY] = self.spec.name
        if self.loss_scale is not None:
            out["loss_scale"] = dict(zip(LEAVES, self.loss_scale.tensors()))
        return out

    def torch_state_dict(self) -> dict:
        """``state_dict()`` in the format of torch.optim's class of the same rule (SGD, Adam,
        AdamW, RAdam, Adagrad, RMSprop): torch's state names, float32 step counters on the
        host, ``betas``; ValueError for a class torch has not."""
        owner = f"{type(self).__name__}.torch_state_dict"
        return torch_names.to_torch(owner, self.spec.class_name,
                                    torch_names.beta_names(self.spec),
                                    self._floats(owner, self.state_dict()))

    def _floats(self, owner: str, state_dict: dict) -> dict:
        """``state_dict`` with each 8-bit state dequantized to float32 and its scales
        dropped (torch.optim keeps float state), with a warning saying so."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        out, said = dict(state_dict), False
        out["state"] = dict(state_dict["state"])
        for pid, (p, group) in zip(ids, params):
            st = out["state"].get(pid)
            if not st or not any(str(k).endswith(quant.SUFFIX) for k in st):
                continue
            flags, values = self._group_values(group)
            program = engine.programs(owner, self.spec._spec, flags, values, [p])[0]
            st = out["state"][pid] = dict(st)
            for name in program.state_names:
                if name + quant.SUFFIX in st and st.get(name) is not None \
                        and st[name].dtype == torch.uint8:
                    st[name] = quant.dequantize_t(st[name], st.pop(name + quant.SUFFIX),
                                                  not quant.nonnegative(program, name))
                    said = True
        if said:
            warn(f"{owner}: the 8-bit states are dequantized to float32 (torch.optim "
                 "keeps float state)")
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, keeping vega's state dtypes: each group's ``state_dtype`` stays
        this optimizer's (a state saved in another dtype is converted: an 8-bit one
        dequantized, a float one quantized where this optimizer keeps 8 bits, each with a
        warning), float32 state for half parameters, the step counter int32 on the
        parameter's device. A state dict of
        torch.optim's class of the same rule (SGD, Adam, AdamW, RAdam, Adagrad, RMSprop) is
        converted (``torch_names.from_torch``); ValueError naming a setting under which
        torch's rule is not this class's.

        Checked first, each refusal a ``ValueError`` that leaves the optimizer as it was:
        the groups carry this optimizer's hyperparameters (not another optimizer's), each
        parameter's state has this optimizer's entries at the shapes its parameter needs,
        and the loss scale's tensors are 0-d, of their dtypes, with values a scale can take.
        torch's load_state_dict hooks run as torch runs them: the pre-hooks on what is
        given, before any of this, the post-hooks on the state loaded.
        """
        torch_names.loading(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        name = self.spec.class_name
        if torch_names.is_torch_format(state_dict, name, _group_keys(self.spec)):
            state_dict = torch_names.from_torch(f"{type(self).__name__}.load_state_dict", name,
                                                state_dict, self.param_groups)
        before, was = (self.state, self.param_groups), None
        try:
            self._check_saved(state_dict)
            self._check_layouts(state_dict)
            scale = self._load(state_dict)
            self._check_loaded()
            self._mark_maps()
            if scale is not None:  # (into the scale's own tensors: the object the caller
                # scales its loss with, and a captured graph replays, stays this optimizer's
                # scale; in the try, so that one interrupted part way is put back)
                was = [t.clone() for t in self.loss_scale.tensors()]
                for mine, saved in zip(self.loss_scale.tensors(), scale):
                    mine.copy_(saved)
            # (torch's loading made a new defaultdict, which counts no change of a state dict:
            # in the try, so that no interrupt leaves it in place; no plan of the state before
            # is taken for the new one)
            self.state = _counting(self.state)
            self._plans().clear()
        except BaseException:  # nothing changes
            self.state, self.param_groups = before
            if was is not None:
                for mine, value in zip(self.loss_scale.tensors(), was):
                    mine.copy_(value)
            raise
        sync = self._tuples()
        sync.seen = {id(g): sync.seen[id(g)] for g in self.param_groups if id(g) in sync.seen}

    def _warn_loaded_tuples(self, k: int, group: dict) -> None:
        """A warning where a loaded group's tuple (``betas``) and the names it holds (``b1``,
        ``b2``) disagree: the load takes the tuple, as torch's classes read it, and
        ``state_dict()`` saves the two in agreement, so such a group was changed by hand (or
        saved without that), and a change of ``b1`` alone would be lost without a word."""
        for key, names in self._tuples().keys.items():
            theirs = group.get(key)
            if not isinstance(theirs, (tuple, list)) or len(theirs) != len(names) or \
                    not all(n in group for n in names):
                continue  # (the sync names what is wrong with it)
            ours = tuple(group[n] for n in names)
            if not torch_names.same_betas(ours, theirs):
                mine = ", ".join(f"{n}={engine.shown(v)}" for n, v in zip(names, ours))
                warn(
                    f"{type(self).__name__}.load_state_dict: group {k} of the state has "
                    f"{key}={engine.shown(tuple(theirs))} and {mine}, which disagree "
                    f"(state_dict() saves them in agreement: one was changed by hand); it "
                    f"takes {key}, as torch's classes read it: where {mine} was meant, set "
                    f"{key} too")

    def _check_saved(self, state_dict) -> None:
        """What torch's loading would take without a word but the step cannot: a state_dict
        without its two entries, or groups without this optimizer's hyperparameters."""
        owner = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            got = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else \
                type(state_dict).__name__
            raise ValueError(f"{owner}: a state_dict is a dict with 'state' and 'param_groups' "
                             f"(what state_dict() returns), got {got}")
        rule = state_dict.get(torch_names.RULE_KEY, self.spec.name)
        if rule != self.spec.name:
            raise ValueError(f"{owner}: the state is of the rule {rule!r}, and "
                             f"{type(self).__name__} steps the rule {self.spec.name!r}: a "
                             "group's settings would not mean what they meant there")
        if not isinstance(state_dict["state"], dict) or not all(
                isinstance(v, dict) for v in state_dict["state"].values()):
            raise ValueError(f"{owner}: state_dict['state'] must be a dict of each parameter's "
                             "state dict (by parameter id)")
        own = self._rule_keys()  # (an entry of the caller's own is loaded as torch loads it)
        for pid, entries in state_dict["state"].items():
            for name, value in entries.items():
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    raise ValueError(f"{owner}: state {name!r} of parameter id {pid!r} is a "
                                     f"meta tensor, which has no values to load")
                if name not in own:  # (the caller's own, loaded as torch loads it)
                    continue
                if isinstance(value, torch.Tensor) and not dense(value):
                    raise ValueError(f"{owner}: state {name!r} of parameter id {pid!r} is "
                                     f"{not_dense(value)}; a step keeps dense (strided) states")
                if isinstance(value, torch.Tensor) and name != "step" and \
                        value.dtype != torch.uint8 and not (value.is_floating_point()
                                                            or value.is_complex()):
                    raise ValueError(f"{owner}: state {name!r} of parameter id {pid!r} is of "
                                     f"dtype {value.dtype}; a state is a float tensor, or 8-bit "
                                     "codes of dtype torch.uint8")
        want = _group_keys(self.spec)
        no_codes = _no_codes(state_dict["state"].values())
        groups = state_dict["param_groups"]
        if not isinstance(groups, (list, tuple)):
            raise ValueError(f"{owner}: state_dict['param_groups'] is "
                             f"{type(groups).__name__}; it is the list of the groups' dicts "
                             "that state_dict() writes")
        for k, group in enumerate(groups):
            if not isinstance(group, dict) or "params" not in group:
                raise ValueError(f"{owner}: param_groups[{k}] is not a parameter group (a dict "
                                 "with 'params')")
            codes = [] if no_codes else [(i, n) for i in group["params"]
                                         for n in _codes_in(state_dict["state"].get(i))]
            maps = group.get(torch_names.Q8_MAPS_KEY)
            if codes and not _this_maps(maps):
                i, n = codes[0]
                raise ValueError(
                    f"{owner}: state {n!r} of parameter id {i!r} (group {k}) holds 8-bit codes "
                    + ("saved by a vega that did not record which maps its codes use"
                       if maps is None else f"saved under vega's 8-bit maps version {maps!r}")
                    + f"; this vega reads codes with maps version {quant.MAPS}, whose map for "
                    "a state may differ and read them as other values. Load the state dict "
                    "with the vega that saved it into an optimizer of float state "
                    "(state_dtype=None), which dequantizes it, and load that one's here")
            if "state_dtype" in group:  # (this optimizer's own is kept: still a dtype)
                engine.check_state_dtype(owner, engine.loaded_state_dtype(group["state_dtype"]),
                                         self.spec._spec.state_names)
            missing = sorted(want - group.keys())
            if missing:
                unknown = sorted(group.keys() - want - _GROUP_EXTRAS - _optional_keys(self.spec))
                raise ValueError(
                    f"{owner}: group {k} of the state has no {', '.join(map(repr, missing))}"
                    + (f" and has {', '.join(map(repr, unknown))}, unknown to "
                       f"{type(self).__name__}" if unknown else "")
                    + f"; {_seems_from(group.keys(), type(self).__name__)}"
                    + ("" if unknown or not all(m in self.defaults for m in missing) else
                       " If not (a vega whose class had no such setting saved it), set "
                       + ", ".join(f"{m!r} (this optimizer's default: {self.defaults[m]!r})"
                                   for m in missing)
                       + " in each saved group to what that run used, and load it again"))

    def _mark_maps(self) -> None:
        """Each group whose parameters' states hold 8-bit codes holds ``quant.MAPS`` under
        ``torch_names.Q8_MAPS_KEY``, and one with such a DTensor state how its shards are
        cut, under ``quant.LAYOUT_KEY``, as ``state_dict`` saves them (set by a step that
        makes states, and by ``load_state_dict``); no other group holds them. torch's
        ``set_state_dict`` with ``flatten_optimizer_state_dict=True`` rebuilds a saved
        group from the keys of this optimizer's groups: a key in none of them was dropped,
        so that the 8-bit state it loaded was refused as saved without the record of its
        maps, and a state saved from shards cut otherwise was loaded unchecked. (Also by
        ``state_dict``, which torch's ``get_state_dict`` calls on the optimizer it loads
        into: a step dynamo traces does not set them.)"""
        none = _no_codes(self.state.values())  # (no codes at all: no parameter asked)
        for group in self.param_groups:
            if none:
                group.pop(torch_names.Q8_MAPS_KEY, None)
                group.pop(quant.LAYOUT_KEY, None)
                continue
            codes = [bool(_codes_in(self.state.get(p))) for p in group["params"]]
            layouts = [quant.shard_layout(p) if c and is_dtensor(p) else None
                       for p, c in zip(group["params"], codes)]
            for key, value, keep in ((torch_names.Q8_MAPS_KEY, quant.MAPS, any(codes)),
                                     (quant.LAYOUT_KEY, layouts,
                                      any(x is not None for x in layouts))):
                if keep:
                    group[key] = value
                else:
                    group.pop(key, None)

    def _check_layouts(self, state_dict: dict) -> None:
        """ValueError where a parameter's 8-bit states were saved with its shards cut
        otherwise than they are here (``quant.shard_layout``, which ``state_dict`` keeps in
        each group under ``quant.LAYOUT_KEY``): a row of the scales holds the blocks of the
        shard it was saved from, and where the shards are cut otherwise the same row would
        scale other values (``torch.distributed.checkpoint`` loads it without a word where
        the scales' shapes agree: as many shards, of as many blocks)."""
        owner = f"{type(self).__name__}.load_state_dict"
        params = [p for g in self.param_groups for p in g["params"]]
        at = 0
        for k, group in enumerate(state_dict["param_groups"]):
            ids, saved = list(group["params"]), group.get(quant.LAYOUT_KEY)
            if saved is not None and (not isinstance(saved, (list, tuple))
                                      or len(saved) != len(ids) or not all(
                                          x is None or isinstance(x, str) for x in saved)):
                raise ValueError(f"{owner}: group {k} of the state has {quant.LAYOUT_KEY}="
                                 f"{engine.shown(saved)}; state_dict() writes there, for each "
                                 "parameter of the group, how the shards of its 8-bit states "
                                 "were cut (a str), or None")
            for j, (pid, layout) in enumerate(zip(ids, saved or ())):
                if layout is None or at + j >= len(params) or \
                        not state_dict["state"].get(pid):
                    continue
                now = quant.shard_layout(params[at + j])
                if now != layout:
                    raise ValueError(
                        f"{owner}: the 8-bit states of parameter {pid} were saved from "
                        f"shards cut as {layout or 'one whole tensor'!r}, and its shards here "
                        f"are cut as {now or 'one whole tensor'!r}: their scales hold a row "
                        "of each saved shard's blocks, which here would scale other values. "
                        "Move 8-bit state to shards cut otherwise through float state "
                        "(docs/distributed.md)")
            at += len(ids)

    def _load(self, state_dict: dict) -> list | None:
        """torch's loading of ``state_dict`` and vega's conversions of its states; returns
        the saved loss scale's tensors, checked, for the caller to copy into this optimizer's
        scale once everything is loaded (None where none is saved)."""
        saved = state_dict["state"]
        originals = {k: dict(v) for k, v in saved.items()}
        scale = state_dict.get("loss_scale")
        if scale is not None and self.loss_scale is None:
            warn(f"{type(self).__name__}.load_state_dict: the state dict holds a loss "
                 "scale, but this optimizer has none (loss_scale=None): the saved "
                 "scale is not loaded")
            scale = None
        elif scale is not None:
            scale = _loaded_scale(f"{type(self).__name__}.load_state_dict", scale,
                                  self.loss_scale)
            saved_dynamic = int(scale[1]) != -1  # (good_steps: -1 for a static scale)
            if saved_dynamic != self.loss_scale.is_dynamic:
                kinds = ("dynamic", "static") if saved_dynamic else ("static", "dynamic")
                warn(f"{type(self).__name__}.load_state_dict: the state dict holds a "
                     f"{kinds[0]} loss scale, but this optimizer's is {kinds[1]}: "
                     "the saved scale is not loaded (to resume it, make the "
                     f"optimizer with LossScale.{kinds[0]}(...))")
                scale = None
        for k, group in enumerate(state_dict["param_groups"]):  # (before torch's loading,
            self._warn_loaded_tuples(k, group)  # whose __setstate__ takes each tuple)
        mine = [g.get("state_dtype") for g in self.param_groups]
        super().load_state_dict({**{k: v for k, v in state_dict.items()
                                    if k not in ("loss_scale", torch_names.RULE_KEY)},
                                 "param_groups": [
                                     {k: v for k, v in g.items()
                                      if k not in (torch_names.Q8_MAPS_KEY, quant.LAYOUT_KEY)}
                                     for g in state_dict["param_groups"]]})
        for group, dtype in zip(self.param_groups, mine):  # the dtypes this optimizer keeps
            group["state_dtype"] = dtype
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for k, group in enumerate(self.param_groups):
            group.setdefault("maximize", False)  # (a state saved before groups held it)
            for key, default in _PRECISION_DEFAULTS.items():  # (and the precision settings:
                # this optimizer's, as torch's classes setdefault an option that a state
                # saved before they had it lacks)
                group.setdefault(key, self.defaults.get(key, default))
            self._check_group(f"{type(self).__name__}.load_state_dict: group {k}", group)
            self._tuples().sync(f"{type(self).__name__}.load_state_dict", k, group)
        declared, own = self.spec._spec.state_names, self._rule_keys()
        saved_dtypes = {i: engine.loaded_state_dtype(g.get("state_dtype"))
                        for g in state_dict["param_groups"]
                        for i in g["params"]}
        where = [(i, k) for k, g in enumerate(self.param_groups) for i in range(len(g["params"]))]
        converted = {True: [], False: []}  # the states quantized, dequantized (one warning each)
        for pid, (p, _), (i, k) in zip(ids, params, where):
            if pid in originals and uninitialized(p):  # (torch loads its state unchecked)
                raise ValueError(f"{type(self).__name__}.load_state_dict: parameter {i} of "
                                 f"group {k} {LAZY_LOAD_WORDS}")
        for pid, (p, group) in zip(ids, params):
            if pid not in originals or p not in self.state:
                continue
            self._check_codes_kept(pid, p, group, saved_dtypes.get(pid), originals[pid])
            wanted = engine.state_dtype_of(self.spec._spec, group["state_dtype"])
            sds = wanted if isinstance(wanted, dict) else {}
            precise = self._precise_states(p, group) if wanted in engine.HALF else ()
            if self._q8(group, [p], fresh=True) or any(
                    quant.SUFFIX in str(n) or (isinstance(v, torch.Tensor)
                                               and v.dtype == torch.uint8)
                    for n, v in originals[pid].items()):
                # 8-bit states as this optimizer keeps them: codes kept, float values
                # quantized, codes dequantized where it keeps floats (a warning says which)
                originals[pid] = self._loaded_q8(pid, p, group, originals[pid], converted)
                for name in [n for n in self.state[p] if n not in originals[pid]]:
                    del self.state[p][name]  # (the scales of a state dequantized)
            # (states in the layout of a parameter stored in another order than its
            # dimensions', which its step reads without copies, as a new state is made:
            # ``like_layout``; a checkpoint's may be contiguous)
            laid_out = type(p) in PLAIN_TYPES and not p.is_contiguous() \
                and in_memory_order(self._loading_program(p, group))
            for name, value in originals[pid].items():
                if name not in own:  # the caller's own: as torch's loading cast it
                    continue
                sd = engine.state_dtype_for(p, sds.get(name) if sds else wanted)
                if sd == torch.uint8 or name in precise:  # kept in floats here (a tensor too
                    sd = engine.state_dtype_for(p, None)  # small for 8 bits), or at the
                    # parameter's precision under one half dtype (``engine.keeps_precision``)
                if name == engine.MASTER and group.get("master_weights"):
                    sd = engine.master_dtype(p)
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dtype == torch.uint8:  # codes, as saved
                    self.state[p][name] = value.to(device=p.device).clone()
                    continue
                if str(name).endswith(quant.SUFFIX) and name not in declared \
                        and str(name)[:-len(quant.SUFFIX)] in declared:  # scales: float32
                    self.state[p][name] = value.to(device=p.device, dtype=torch.float32).clone()
                    continue
                if name == "step":  # a copy: the step advances in place
                    _check_step(type(self).__name__, pid, value)
                    if value.is_floating_point():  # (torch's: 2**31 is as far as it saturates)
                        value = value.to(torch.float64).clamp(max=INT32_MAX)
                    self.state[p][name] = value.to(device=p.device, dtype=torch.int32).clone()
                elif value.is_floating_point() or value.is_complex():
                    value = value.to(device=p.device, dtype=sd)
                    self.state[p][name] = like_layout(value, p) if laid_out else value.clone()
                if is_dtensor(p) and not is_dtensor(self.state[p][name]):
                    self.state[p][name] = self._replicated(p, group, name,
                                                           self.state[p][name])
        _warn_converted(f"{type(self).__name__}.load_state_dict", converted)
        return scale

    def _replicated(self, p, group, name, value: torch.Tensor):
        """A plain tensor loaded as the state of one number of DTensor ``p`` (Prodigy's
        ``d``): torch's loading of a full state dict (``set_state_dict`` with
        ``full_state_dict=True``) gives every 0-d value as a plain tensor, as it does
        torch's ``step``; the step keeps such a state replicated over ``p``'s mesh. Other
        states are left as they are (a step names them)."""
        doms = {s.name: s.dom for s in self._loading_program(p, group).states}
        if doms.get(name) != sharded.SCALAR_STATE or value.numel() != 1:
            return value
        return sharded.replicated_scalar(p, value)

    def _check_codes_kept(self, pid, p, group, saved_dtype, saved: dict) -> None:
        """ValueError where a state its saved group kept in 8 bits (``state_dtype``
        torch.uint8) comes as floats without its scales, valued as codes are (whole
        numbers from 0 to 255): the codes cast to another dtype, as
        ``torch.distributed.checkpoint`` loads a checkpoint into the state dict of the
        optimizer it is given, which for float state has no scales (their values, 0 to
        254, would be taken as the state's). A float state made before the group's
        ``state_dtype`` became torch.uint8 (which leaves the states it has as they are)
        loads as a float state."""
        sd = engine.state_dtype_of(self.spec._spec, saved_dtype)
        q = engine.q8_names(sd, p) if isinstance(sd, dict) or sd == torch.uint8 else None
        if not q:
            return
        program = self._loading_program(p, group, [q])
        for name in program.quant:
            value = saved.get(name)
            if isinstance(value, torch.Tensor) and value.dtype != torch.uint8 \
                    and name + quant.SUFFIX not in saved and quant.like_codes(value):
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: state '{name}' of parameter "
                    f"{pid} was saved in 8 bits (its group's state_dtype is "
                    f"{engine.shown(saved_dtype)}), but holds {value.dtype} values without "
                    f"its scales '{name}{quant.SUFFIX}': the codes were cast, as "
                    "torch.distributed.checkpoint loads a checkpoint into the tensors of "
                    "the state dict it is given (an optimizer's of float state has no "
                    "scales, and dcp.load wrote the codes into its states too); load it "
                    "into an optimizer made with state_dtype=torch.uint8, then that "
                    "optimizer's state_dict() into one of float state (docs/distributed.md)")

    def _q8(self, group, params, fresh: bool = False) -> list[frozenset] | None:
        """``_q8`` of a group's parameters: as their states hold them (``fresh``: as the
        group's state_dtype would make them)."""
        return _q8(engine.state_dtype_of(self.spec._spec, group.get("state_dtype")), params,
                   None if fresh else self.state)

    def _loading_program(self, p, group, quantized=None):
        """The program that steps parameter ``p`` under ``group``'s settings, for
        ``load_state_dict`` (``quantized``: ``engine.programs``')."""
        owner = f"{type(self).__name__}.load_state_dict"
        flags, values = self._group_values(group)
        master, seed = _precision(owner, group)
        return engine.programs(owner, self.spec._spec, flags, values, [p], master=master,
                               seed=seed, quantized=quantized)[0]

    def _precise_states(self, p, group) -> set[str]:
        """The states of parameter ``p`` that keep its precision under one half state dtype
        for every state (``engine.keeps_precision``)."""
        return {s.name for s in self._loading_program(p, group).states
                if engine.keeps_precision(s)}

    def _loaded_q8(self, pid, p, group, saved: dict, converted: dict) -> dict:
        """``saved``, one parameter's loaded state, with its 8-bit states as this optimizer
        keeps them (``vega.codegen.quant``): a float state it keeps in 8 bits quantized, an
        8-bit one it keeps in floats dequantized, each named in ``converted[True]`` or
        ``converted[False]`` (for the load's one warning of each, ``_warn_converted``)."""
        owner = f"{type(self).__name__}.load_state_dict"
        base = self._loading_program(p, group)
        program = self._loading_program(p, group, self._q8(group, [p], fresh=True))
        out = dict(saved)
        for s in base.states:
            value, scale = saved.get(s.name), saved.get(s.name + quant.SUFFIX)
            if not isinstance(value, torch.Tensor):
                continue
            is_codes = value.dtype == torch.uint8
            if is_codes and not isinstance(scale, torch.Tensor):
                raise ValueError(f"{owner}: state '{s.name}' of parameter {pid} holds 8-bit "
                                 f"codes without their scales '{s.name}{quant.SUFFIX}'")
            if isinstance(scale, torch.Tensor):
                _check_q8_scales(owner, f"'{s.name}' of parameter {pid}", value, scale,
                                 s.name + quant.SUFFIX)
            if s.name in program.quant and not is_codes:
                signed = program.quant[s.name][1]
                out[s.name], out[s.name + quant.SUFFIX] = quant.quantize_t(
                    value.to(device=p.device, dtype=torch.float32), signed)
                converted[True].append(f"'{s.name}' of parameter {pid} (saved in "
                                       f"{value.dtype})")
            elif is_codes and s.name not in program.quant:
                blocks = (value.numel() + quant.BLOCK - 1) // quant.BLOCK
                if not is_dtensor(value) and (  # (a shard's blocks: each shard's own)
                        value.numel() != p.numel() or scale.numel() != blocks):
                    raise ValueError(
                        f"{owner}: state '{s.name}' of parameter {pid} holds "
                        f"{value.numel()} 8-bit codes and {scale.numel()} scales, but the "
                        f"parameter, of shape {tuple(p.shape)}, needs {p.numel()} codes and "
                        f"one scale a block of {quant.BLOCK}")
                out[s.name] = quant.dequantize_t(value.to(p.device), scale.to(p.device),
                                                 not quant.nonnegative(base, s.name))
                del out[s.name + quant.SUFFIX]
                converted[False].append(f"'{s.name}' of parameter {pid}")
        return out

    def _check_loaded(self) -> None:
        """Each loaded state has this optimizer's entries (those its settings read, give or
        take one a value turns on or off, as sgd's ``v``), tensors, each of the shape its
        parameter needs (a kernel would read and write past a smaller one)."""
        owner = type(self).__name__
        lazy, own = self._lazy_states(), self._rule_keys()
        for k, group in enumerate(self.param_groups):
            engine.check_state_dtype(f"{owner}.load_state_dict", group["state_dtype"],
                                     self.spec._spec.state_names)
            flags, values = self._group_values(group)
            held = [(i, p) for i, p in enumerate(group["params"])  # (a state of the
                    if self.state.get(p, {}).keys() & own]  # caller's entries alone: not
            # stepped, as the step takes it)
            master, seed = _precision(owner, group)
            progs = engine.programs(owner, self.spec._spec, flags, values, [p for _, p in held],
                                    master=master, seed=seed,
                                    quantized=self._q8(group, [p for _, p in held]))
            for (i, p), program in zip(held, progs):
                where = f"parameter {i} of group {k}"
                st = self.state[p]
                want = {*program.state_names, "step"}
                missing, extra = want - st.keys(), (st.keys() & own) - want
                if not (missing <= lazy and extra <= lazy):
                    raise ValueError(
                        f"{owner}.load_state_dict: the state of {where} has "
                        f"{sorted(map(str, st))}, but {owner} with these settings keeps "
                        f"{sorted(want)}" + "".join(
                            f"; {label} {sorted(map(str, names))}"
                            for label, names in (("missing", missing - lazy),
                                                 # (with the caller's own: one of
                                                 # them may be a state misnamed)
                                                 ("unknown", st.keys() - want - lazy))
                            if names)
                        + f"; {_seems_from(st.keys(), owner, states=True)}")
                for name, dom in [("step", None), *((s.name, s.dom) for s in program.states)]:
                    if name not in st:
                        continue  # one a value turns on: the step makes it
                    x = st[name]
                    if not isinstance(x, torch.Tensor):
                        raise ValueError(f"{owner}.load_state_dict: state '{name}' of {where} "
                                         f"is {engine.shown(x)}, not a tensor")
                    want_shape = () if dom is None else state_shape(p, dom)
                    if tuple(x.shape) != want_shape:
                        needs = "a step counter is 0-d" if dom is None else (
                            f"the parameter, of shape {tuple(p.shape)}, needs {want_shape}")
                        raise ValueError(
                            f"{owner}.load_state_dict: state '{name}' of {where} has "
                            f"shape {tuple(x.shape)}, but {needs}")


# the types of a hyperparameter value a step checks once while a group holds it: objects
# that cannot change (``_group_values``)
_IMMUTABLE = frozenset({float, int, bool})

# (torch's, its schedulers': OneCycleLR's, SWALR's)
_GROUP_EXTRAS = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr",
                           "max_momentum", "base_momentum", "swa_lr"})


def _pop_all(st: dict, names) -> None:
    """``names`` taken out of the state dict ``st`` (those it holds)."""
    for name in names:
        st.pop(name, None)


def _per_tensor(values, params) -> list:
    """An engine.run call's values, a dict a tensor: a group's one dict for each of its
    parameters, or the list ``_joined`` made of several groups' (as it is)."""
    return values if isinstance(values, list) else [values] * len(params)


def _joined(work: list) -> list:
    """A step's engine.run calls with those of one program and backend in a row (groups
    that differ in their hyperparameters' values only, as groups of layer-wise rates do)
    made one call, its values a dict a tensor (``_per_tensor``), which the kernels take as
    the functional step's per-leaf values: a call costs tens of microseconds around its
    kernels, where a tensor more costs about one. Not a program with sums over a group
    (``spans_group``: Prodigy's d is the group's; LAMB's trust ratios, each a tensor's,
    join), whose calls are its groups, nor groups on two devices."""
    if len(work) < 2:
        return work
    out: list = []
    for item in work:
        last = out[-1] if out else None
        if last is None or last[0] is not item[0] or last[1] != item[1] \
                or item[0].spans_group or last[2][0].device != item[2][0].device:
            out.append(item)
            continue
        if not isinstance(last[6], list):  # (lists of its own, to extend: one pass in all)
            last = out[-1] = (*last[:2], list(last[2]), list(last[3]),
                              [list(col) for col in last[4]], list(last[5]),
                              _per_tensor(last[6], last[2]))
        last[2].extend(item[2])
        last[3].extend(item[3])
        for col, more in zip(last[4], item[4]):
            col.extend(more)
        last[5].extend(item[5])
        last[6].extend(_per_tensor(item[6], item[2]))
    return out


@functools.cache
def _torch_hyper_names() -> frozenset:
    """The keywords of torch.optim's classes: a group built for any of them (a framework's,
    such as a ``weight_decay`` for every optimizer) may hold them, and none is taken for a
    misspelling."""
    names = set()
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            names |= set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    return frozenset(names)


def _group_keys(cspec) -> frozenset:
    """The keys of a parameter group of ``cspec``'s optimizer class, ``params`` aside."""
    return frozenset({*(h.name for h in cspec.hypers), "backend", "state_dtype"})


def _optional_keys(cspec) -> frozenset:
    """The keys of a group that a state saved before groups held them may lack: torch's
    names ``maximize``, ``betas`` (where the spec has ``b1``, ``b2``, ...) and the other
    tuples (``torch_names.tuple_keys``), and the precision options (off)."""
    return frozenset({"maximize", *torch_names.tuple_keys(cspec),
                      *(("mode",) if cspec.modes else ()), *_PRECISION_DEFAULTS})


_PRECISION_DEFAULTS = torch_names.PRECISION_DEFAULTS


# the entry of a pickled optimizer's state that holds ``quant.MAPS`` (``__getstate__``)
_PICKLED_MAPS = "_vega_q8_maps"


def _this_maps(maps) -> bool:
    """Whether ``maps``, the version of the maps recorded beside saved 8-bit codes, is this
    vega's (``quant.MAPS``): an integer, compared as one (a tensor of several values, or
    another object whose ``!=`` is not a bool, made the check itself raise inside)."""
    return isinstance(maps, numbers.Integral) and not isinstance(maps, bool) and \
        int(maps) == quant.MAPS


def _codes_in(st) -> list:
    """The names of the states of one parameter's saved state ``st`` that are 8-bit codes
    (uint8 beside their scales, ``<name>_absmax``)."""
    if not isinstance(st, dict):
        return []
    return [n for n, v in st.items() if isinstance(n, str) and n + quant.SUFFIX in st
            and isinstance(v, torch.Tensor) and v.dtype == torch.uint8]


def _no_codes(states) -> bool:
    """Whether no entry of ``states`` (parameters' saved states) holds 8-bit codes
    (``_codes_in``), asked of the union of their keys: a ``<name>`` beside its
    ``<name>_absmax`` in no state is in the union of none. One pass over the dicts at C
    speed, where ``_codes_in`` of each parameter's (and the lookup of its state, a tensor
    hashed in Python) cost about 1.5 us (state_dict() of 2,000 parameters took 3 ms more
    than torch's packing); False where one may hold them, or the union cannot be taken (an
    entry that is not a dict): then each is asked."""
    keys: set = set()
    try:
        keys.update(*states)
    except TypeError:  # (None, an unhashable key: answered by ``_codes_in`` of each)
        return False
    return not any(isinstance(k, str) and k + quant.SUFFIX in keys for k in keys)


def _q8(sd, params, state=None) -> list[frozenset] | None:
    """The states each parameter keeps in 8 bits, None for none: as its state in ``state``
    holds them (the states with scales), or for a parameter without one, as ``sd`` (a
    group's state_dtype over the spec's, ``engine.state_dtype_of``) makes them
    (``engine.q8_names``). A state's dtype is chosen when it is made, as for any
    ``state_dtype``."""
    asks = sd is not None and (sd == torch.uint8 or isinstance(sd, dict))
    out, any_q8 = [], False
    for p in params:
        st = state.get(p) if state is not None else None
        q = engine.q8_names(sd, p) if asks else frozenset()
        if st:  # as the states it has are; one it has not yet, as the group says
            have = frozenset(n[:-len(quant.SUFFIX)] for n in st
                             if isinstance(n, str) and n.endswith(quant.SUFFIX))
            floats = frozenset(n for n in st if isinstance(n, str) and n not in have)
            q = have | (q | {"!" + n for n in floats} if "*" in q else q - floats)
        any_q8 = any_q8 or bool(q)
        out.append(q)
    return out if any_q8 else None


def _settings(group: dict) -> tuple:
    """A group's settings a step reads besides its hyperparameters and precision:
    (maximize, backend, state_dtype, and torch's foreach, fused, capturable,
    differentiable)."""
    return (group["maximize"], group["backend"], group["state_dtype"],
            *(group.get(key) for key in torch_names.KEYWORDS[:4]))


def _precision(owner: str, group: dict) -> tuple[bool, int | None]:
    """A group's (master_weights, seed of its stochastic rounding or None), checked. A
    group without one of them (appended to ``param_groups`` by hand, or the key deleted) is
    a KeyError of the key (``SpecOptimizer._missing_setting`` names the group): taken as
    off, it stepped a group of an optimizer made with master weights without them."""
    master = group["master_weights"]
    return master, engine.check_precision(owner, master, group["stochastic_rounding"],
                                          group["rounding_seed"])


def _optimizer_keys() -> dict[str, frozenset]:
    """The group keys of each optimizer class a state_dict may come from: vega's and
    torch's (torch's from their signatures: their defaults are their keyword arguments)."""
    from vega.runtime.library import builtin, builtin_names
    found = {f"vega.optim.{builtin(n).class_name}": _group_keys(builtin(n))
             | _optional_keys(builtin(n)) for n in builtin_names()}
    found["vega.optim.LBFGS"] = frozenset({"lr", "memory_size", "scale_init_precond",
                                           "state_dtype"})
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) \
                and cls is not torch.optim.Optimizer:
            try:
                keys = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
            except (TypeError, ValueError):
                continue
            found[f"torch.optim.{name}"] = frozenset(keys)
    return found


def _seems_from(keys, owner: str, states: bool = False) -> str:
    """Which optimizers a state with these group keys (or, ``states``, these per-parameter
    state entries) seems to come from, as the end of a message."""
    keys = frozenset(map(str, keys)) - _GROUP_EXTRAS
    if states:
        known = {f"torch.optim.{n}": frozenset(s) for n, s in _TORCH_STATES.items()}
    else:
        known = _optimizer_keys()
    best, score = [], 0.0
    for name, theirs in known.items():
        s = len(keys & theirs) / max(1, len(keys | theirs))
        if s > score + 1e-9:
            best, score = [name], s
        elif abs(s - score) <= 1e-9 and s > 0:
            best.append(name)
    if f"vega.optim.{owner}" in best:  # (its own keys, some missing: no other to name)
        return f"was it saved from another optimizer than vega.optim.{owner}?"
    if best == [f"torch.optim.{owner}"] and score >= 0.6:  # (a format not converted)
        return (f"it seems to be the state of torch.optim.{owner}, whose format "
                f"vega.optim.{owner} does not convert (torch's states are converted for "
                f"{', '.join(sorted(torch_names.TORCH_STATES))})")
    if best and score >= 0.6:
        return (f"it seems to be the state of {' or '.join(best)}; load an optimizer's state "
                "into an optimizer of the same class")
    return f"was it saved from another optimizer than vega.optim.{owner}?"


# the per-parameter state entries of torch.optim's optimizers (a state's own words)
_TORCH_STATES = {
    "SGD": ("momentum_buffer",), "Adam": ("step", "exp_avg", "exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq"), "Adagrad": ("step", "sum"),
    "RMSprop": ("step", "square_avg"), "Adamax": ("step", "exp_avg", "exp_inf"),
    "NAdam": ("step", "mu_product", "exp_avg", "exp_avg_sq"),
    "RAdam": ("step", "exp_avg", "exp_avg_sq"), "Adadelta": ("step", "square_avg", "acc_delta"),
}


def _warn_converted(owner: str, converted: dict) -> None:
    """One warning for the states a load quantized (``converted[True]``) and one for those
    it dequantized (``converted[False]``), each naming how many and the first few: one a
    state of every parameter made hundreds for a model's checkpoint."""
    for quantized, names in converted.items():
        if not names:
            continue
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        if quantized:
            warn(f"{owner}: {len(names)} state(s) saved in floats are quantized to 8 bits, as "
                 f"this optimizer keeps them (state_dtype torch.uint8): {shown}")
        else:
            warn(f"{owner}: {len(names)} state(s) saved in 8 bits are dequantized to the dtype "
                 f"this optimizer keeps them in: {shown}")


def _check_q8_scales(owner: str, what: str, codes: torch.Tensor, scales: torch.Tensor,
                     name: str) -> None:
    """A loaded 8-bit state ``what``: uint8 codes beside floating-point scales none of which
    is negative (a block's largest magnitude: a negative one turns its values over, and the
    square root of a second moment is NaN; a NaN or an infinite one is what a step leaves
    where a block held one, as a float state holds it). Codes cast to a float after saving
    are refused: read as values, they would be the codes, each up to 255. (Read on the
    host: loading is not a step.)"""
    if codes.dtype != torch.uint8:
        raise ValueError(f"{owner}: state {what} is {codes.dtype} beside its 8-bit scales "
                         f"'{name}': 8-bit codes are torch.uint8 (were they cast after "
                         "saving?); load a state saved by the optimizer, or without the "
                         "scales a float state")
    if not scales.is_floating_point():
        raise ValueError(f"{owner}: the scales '{name}' of state {what} are {scales.dtype}, "
                         "not floating-point")
    if quant.any_negative(scales):
        raise ValueError(f"{owner}: the scales '{name}' of state {what} hold a negative "
                         "value; a scale is the largest magnitude of its block")


def _check_step(owner: str, pid, value: torch.Tensor) -> None:
    """A saved step counter (int32 in vega's states, float32 in torch's) holds a count that
    an int32 counter takes: a whole number in [0, 2**31 - 1]; a float one may hold 2**31,
    which float32 makes of every count from 2**31 - 64 up (``torch_state_dict`` of a counter
    there), loaded as the saturated 2**31 - 1. (A counter of another shape is refused after
    loading, by ``_check_loaded``.)"""
    if value.numel() != 1 or value.device.type == "meta":
        return
    if value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{owner}.load_state_dict: state 'step' of parameter id {pid!r} is "
                         f"of dtype {value.dtype}; a step counter is a whole number")
    x = value.item()
    last = 2**31 if value.is_floating_point() else INT32_MAX
    if not (math.isfinite(x) and float(x).is_integer() and 0 <= x <= last):
        raise ValueError(f"{owner}.load_state_dict: state 'step' of parameter id {pid!r} is "
                         f"{x!r}; a step counter is a whole number in [0, 2**31 - 1]")


def _loaded_scale(owner: str, scale, current) -> list:
    """The tensors of a state_dict's ``'loss_scale'`` entry, in ``current.tensors()``'s order,
    on its devices (those missing from the entry: ``current``'s own values); ValueError naming
    the entry and its value where it is not a scale's (a negative scale flips every update; a
    NaN one skips every step)."""
    if not isinstance(scale, dict):
        raise ValueError(f"{owner}: 'loss_scale' is {engine.shown(scale)}; it is the dict of "
                         f"{', '.join(LEAVES)} that state_dict() writes")
    unknown = sorted(map(str, scale.keys() - set(LEAVES)))
    if unknown:
        raise ValueError(f"{owner}: 'loss_scale' has {', '.join(map(repr, unknown))}; a loss "
                         f"scale has {', '.join(LEAVES)}")
    mine = dict(zip(LEAVES, current.tensors()))
    got = {name: scale.get(name, mine[name]) for name in LEAVES}
    check_scale_values(owner, [got[n] for n in LEAVES], "loss_scale entry ")
    got = {name: x.to(device=mine[name].device) for name, x in got.items()}
    return [got[n].clone() for n in LEAVES]


def _same(a: dict, b: dict) -> bool:
    """The same hyperparameter values: the same objects, or equal plain numbers."""
    return a.keys() == b.keys() and all(
        x is y or (type(x) is float and type(y) is float and x == y)
        for x, y in ((a[k], b[k]) for k in a))


class _Plan:
    """What a group's step found: the parameters with gradients, their state dicts, and the
    programs that step them (positions, None for all), for the next steps to reuse."""

    def __init__(self, group, state, grads_all, flags, choosing, device, params, sts, parts,
                 shapes):
        self.group, self.state = group, state
        self.all_params = list(group["params"])
        present = [g is not None for g in grads_all]
        self.params = self.all_params if all(present) else params
        self.flags, self.choosing, self.device = dict(flags), choosing, device
        self.sts, self.parts, self.shapes = sts, parts, shapes
        # (``_States``; not read while dynamo traces, which keeps no plan: no guard on it)
        self.changes = None if torch.compiler.is_compiling() else getattr(state, "changes",
                                                                            None)
        # each part's parameters, their state dicts and the names of the state tensors its
        # program reads, with the step counter's; the parameters without a gradient
        self.lists = [(self.params, sts, [*program.state_names, "step"]) if ks is None else
                      ([self.params[k] for k in ks], [sts[k] for k in ks],
                       [*program.state_names, "step"]) for program, ks in parts]
        self.absent = [p for p, there in zip(self.all_params, present) if not there]
        self.plain = PLAIN_TYPES.issuperset(map(type, self.all_params))

    def work(self, backend, grads, sts, values) -> list[tuple]:
        out = []
        for program, ks in self.parts:
            params, gs, ss = (self.params, grads, sts) if ks is None else (
                [self.params[k] for k in ks], [grads[k] for k in ks], [sts[k] for k in ks])
            out.append((program, backend, params, gs,
                        [[st[n] for st in ss] for n in program.state_names],
                        [st["step"] for st in ss], values))
        return out


def _of_spec(spec) -> SpecOptimizer:
    """An optimizer of ``spec``'s class not yet set up (the unpickling of one: its state is
    set next, ``SpecOptimizer.__setstate__``)."""
    return object.__new__(spec.optimizer_class)


def optimizer_class(spec) -> type[SpecOptimizer]:
    """A SpecOptimizer subclass for ``spec``, named after its class name."""
    lines = [spec.doc or f"The {spec.name} optimizer.", "", "Hyperparameters (defaults):"]
    for h in spec.hypers:
        rng = f", in {h.range}" if h.range is not None else ""
        default = str(h.default).lower() if h.type == "bool" else h.default
        lines.append(f"    {h.name}: {h.type} = {default}{rng}")
    order = torch_names.positional_names(spec.class_name, spec)
    if order:  # (torch's order, not the list's: SGD(params, 0.1, 0.9))
        whose = f", torch.optim.{spec.class_name}'s order" if order != ["lr"] else ""
        lines += ["", f"By position after params: {', '.join(order)}{whose}; the others by "
                  "name."]
    lines += ["", "Also: backend=None|'reference'|'c'|'triton', state_dtype=None (float32 for "
              "bfloat16/float16 parameters;", "a dtype for every state, or a dict by state "
              "name: {'nu': torch.bfloat16}; torch.uint8: 8-bit blockwise),",
              "master_weights=False (a float32 copy of each half parameter, the state "
              "'master'),", "stochastic_rounding=False, "
              "rounding_seed=0 (bfloat16 values rounded stochastically; docs/precision.md),",
              "max_grad_norm=None, loss_scale=None (a "
              "vega.LossScale), skip_nonfinite=False, maximize=False,",
              "foreach=None, fused=None, capturable=None (accepted: the step is always "
              "fused), differentiable=False,", "reduce_group=None (a torch.distributed process "
              "group: the gradients' norm and finite check span its ranks' parameters;",
              "DTensor parameters reduce over their mesh: vega.runtime.sharded)."]
    for key, names in torch_names.tuple_keys(spec).items():
        lines[-1] += f" {key}=({', '.join(names)}), torch's name for {', '.join(names)}."

    return type(spec.class_name, (SpecOptimizer,), {
        "spec": spec, "__doc__": "\n".join(lines), "__module__": "vega.optim",
        "_vega_torch_only": torch_names.torch_only(spec),
        "__qualname__": spec.class_name,
    })
