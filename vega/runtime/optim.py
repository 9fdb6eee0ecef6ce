"""``torch.optim.Optimizer`` classes over compiled specs.

The class only groups parameters and owns their state; the step is
``vega.runtime.engine.run``, the same as the functional API's. Each parameter
keeps torch's state layout: ``state[p] = {'mu': ..., 'nu': ..., 'step': ...}``,
with ``step`` a 0-d int32 tensor on the parameter's device.
"""
from __future__ import annotations

import collections
import operator

import numpy as np
import torch

from vega import codegen
from vega.codegen import native
from vega.codegen.base import distinct, state_shape
from vega.codegen.tensors import first_with_own_ops, inplace_problem, own_ops_words
from vega.runtime import engine

_LOSS_SCALE_LEAVES = ("loss_scale", "good_steps", "skipped_steps", "min_scale")
_IS_SPARSE = operator.attrgetter("is_sparse")


def _any_sparse(grads) -> bool:
    """Whether any gradient is sparse (a map of an attrgetter, fast, where dynamo is not
    tracing: it cannot trace one)."""
    if torch.compiler.is_compiling():
        return any(g.is_sparse for g in grads)
    return any(map(_IS_SPARSE, grads))


class SpecOptimizer(torch.optim.Optimizer):
    """Base of the optimizer classes; see ``CompiledSpec.optimizer_class``."""

    spec = None  # the CompiledSpec, set on each subclass

    def __init__(self, params, *, backend: str | None = None,
                 state_dtype: torch.dtype | None = None, max_grad_norm: float | None = None,
                 loss_scale=None, skip_nonfinite: bool = False, **hypers):
        owner = type(self).__name__
        codegen.check_backend(backend)
        engine.check_fused(owner, max_grad_norm, skip_nonfinite, loss_scale)
        flags, values = engine.resolve(owner, self.spec.hypers, hypers)
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale
        self.skip_nonfinite = skip_nonfinite
        super().__init__(params, {**flags, **values, "backend": backend,
                                  "state_dtype": state_dtype})
        self.state = _StateDict(dict, self.state)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # (load_state_dict comes here too, with a new state)
        if not isinstance(self.state, _StateDict):
            self.state = _StateDict(dict, self.state)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            codegen.check_backend(group.get("backend"))
            engine.resolve(type(self).__name__, self.spec.hypers,
                           {h.name: group[h.name] for h in self.spec.hypers})
            engine.shape_values(type(self).__name__, self.spec._spec, {}, group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        for p in group["params"]:
            if not p.is_floating_point() and not p.is_complex():
                self.param_groups.pop()
                raise ValueError(f"{type(self).__name__} can only optimize float or complex "
                                 f"tensors, got one of dtype {p.dtype}")

    def _group_values(self, group):
        """The group's (bool hyperparameters, float hyperparameters), checked."""
        flags = {h.name: group[h.name] for h in self.spec.hypers if h.type == "bool"}
        values = {h.name: group[h.name] for h in self.spec.hypers if h.type == "float"}
        engine.resolve(type(self).__name__, self.spec.hypers, {**flags, **values})
        return flags, values

    def _init_state(self, p, program, values, group, at_zero: dict | None = None):
        """A new parameter's state. ``at_zero``: the values at step 0 by device, filled
        here, so that a schedule is evaluated once for all the new parameters of a step."""
        step = torch.zeros((), dtype=torch.int32, device=p.device)
        at_zero = {} if at_zero is None else at_zero
        vals = at_zero.get(p.device)
        if vals is None:
            vals = at_zero[p.device] = engine.at_step(values, step)
        leaves = engine.init_leaf(program, p, vals, group["state_dtype"])
        state = {s.name: leaf for s, leaf in zip(program.states, leaves)}
        state["step"] = step
        return state

    def _adapt_state(self, p, st: dict, want: set, program, values, group) -> bool:
        """A state a hyperparameter's value turned on or off (sgd's v, when momentum
        becomes positive or returns to 0): created fresh where missing, kept where no
        longer read, as torch keeps its momentum_buffer. False for any other mismatch."""
        lazy = self.spec._spec.value_states
        missing, extra = want - st.keys(), st.keys() - want
        if not (missing <= lazy and extra <= lazy):
            return False
        if missing:
            fresh = self._init_state(p, program, values, group)
            st.update({name: fresh[name] for name in missing})
        return True

    @torch.no_grad()
    def step(self, closure=None):
        """One fused update of every parameter that has a gradient; returns the closure's loss.

        With ``loss_scale``: gradients are divided by the scale, and the scale is
        adjusted afterwards (``self.loss_scale`` is replaced). With
        ``max_grad_norm``: clipped by their joint norm over all groups. With a
        loss scale or ``skip_nonfinite``: a step whose gradients are not all
        finite changes no parameter and no state. Nothing is read back to the host.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._direct_step():
            return loss
        work = []
        for k, group in enumerate(self.param_groups):
            flags, values = self._group_values(group)
            grads = [p.grad for p in group["params"]]  # p.grad: one read (a property)
            found = self._planned_work(k, group, grads, flags, values)
            work += self._routed(group, found if found is not None else
                                 self._group_work(k, group, grads, flags, values))
        if not torch.compiler.is_compiling():  # all checked before any is written
            self._check_writes(work)
        check = self.skip_nonfinite or self.loss_scale is not None
        pre = engine.prelude([(prog, be, gs) for prog, be, _, gs, _, _, _ in work],
                             engine.inverse_scale(self.loss_scale), self.max_grad_norm, check)
        for program, backend, params, grads, states, steps, values in work:
            engine.run(program, backend, params, grads, states, steps, [values] * len(params),
                       donate=True, pre=pre)
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.adjust(engine.finite_of(pre))
        self._plan_direct(work)
        return loss

    def _routed(self, group, work: list[tuple]) -> list[tuple]:
        """``work`` (a group's engine.run calls) on the reference backend where a tensor
        is a subclass with operations of its own (DTensor: ``vega.codegen.tensors``) and
        the group names no backend; ValueError where it names another."""
        out = []
        for item in work:
            program, backend, params, grads, states, steps, values = item
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
        counter in place (``vega.codegen.tensors.inplace_problem``), naming it: checked for
        every tensor of every group before any is written."""
        written, where = [], []  # where: (state name, or None for parameters; parameters)
        for program, _, params, _, states, steps, _ in work:
            written += params
            where.append((None, params))
            for name, col in zip(program.state_names, states):
                written += col
                where.append((name, params))
            uniq, index = distinct(steps)  # (a counter shared by several: written once)
            written += uniq
            where.append(("step", [params[index.index(u)] for u in range(len(uniq))]
                          if len(uniq) != len(steps) else params))
        problem = inplace_problem(written)
        if problem is None:
            return

        def label(k: int) -> str:
            for name, params in where:
                if k < len(params):
                    p = self._name(params[k])
                    return p if name is None else f"state '{name}' of {p}"
                k -= len(params)
            return "a tensor"
        k, other, words = problem
        raise ValueError(f"{type(self).__name__}: {label(k)} "
                         f"{words.format(other=label(other)) if other is not None else words}")

    def _direct_step(self) -> bool:
        """The step through ``_Direct`` plans, where the last step left one and nothing it
        depends on has changed (checked with the native scanner: a few calls a group, not a
        few a tensor); False, having changed nothing, otherwise."""
        direct = self.__dict__.get("_vega_direct")
        if direct is None or torch.compiler.is_compiling():
            return False
        if direct.state is not self.state or self.state.version != direct.version \
                or len(self.param_groups) != len(direct.groups):
            return self._drop_direct()
        ready = []
        for group, d in zip(self.param_groups, direct.groups):
            ps = group["params"]
            if group is not d.plan.group or len(ps) != len(d.plan.all_params) \
                    or not all(map(operator.is_, ps, d.plan.all_params)) \
                    or group["backend"] != d.backend:
                return self._drop_direct()
            flags, values = self._group_values(group)
            if flags != d.plan.flags or not self._same_programs(flags, values, d.plan):
                return self._drop_direct()
            if d.c.inference and not torch.is_inference_mode_enabled():
                return self._drop_direct()  # (the Python path says what is wrong)
            rows, held = d.c.scanner.scan_grads(ps)  # (held: the gradients, until launched)
            if not d.c.current(rows) or not d.c.scanner.same_items(d.plan.sts, d.names,
                                                                   d.c.held):
                return self._drop_direct()
            ready.append((d, np.ascontiguousarray(rows[:, 3]), values, held))
        for k, (d, grad_ptrs, values, held) in enumerate(ready):  # (checked: each once)
            if any(map(engine.is_schedule, values.values())):  # at the counters, as run()
                stacked = d.c.scanner.stacked_counters(d.c.plan.step_ptrs)
                ready[k] = (d, grad_ptrs, engine.group_rows(d.program, values, d.c.steps,
                                                            stacked), held)
        pre = engine.record(torch.device("cpu"), engine.inverse_scale(self.loss_scale),
                            self.max_grad_norm, self.skip_nonfinite or self.loss_scale is not None)
        if pre is not None:
            for d, grad_ptrs, _, _ in ready:
                d.c.prelude(grad_ptrs, pre)
        nth = torch.get_num_threads()
        for d, grad_ptrs, values, _ in ready:
            d.c.launch(grad_ptrs, values, pre, nth)
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.adjust(engine.finite_of(pre))
        self.__dict__["_vega_direct_misses"] = 0
        return True

    def _drop_direct(self) -> bool:
        """Forget the ``_Direct`` plan (the Python path plans again); False."""
        del self.__dict__["_vega_direct"]
        self.__dict__["_vega_direct_misses"] = self.__dict__.get("_vega_direct_misses", 0) + 1
        return False

    def _plan_direct(self, work) -> None:
        """After a step on the Python path: a ``_Direct`` plan for the next steps, where every
        group is one program on the C backend over parameters that all have gradients
        (contiguous, real, on the CPU), of a spec whose ifs read no shape; hyperparameters
        may be numbers, CPU tensors or schedules. Not after a few plans in a row were
        dropped (something changes every step)."""
        if self.__dict__.get("_vega_direct_misses", 0) > 4 or torch.compiler.is_compiling() \
                or not isinstance(self.state, _StateDict) or self.spec._spec.reads_shape:
            return  # (a spec whose ifs read shapes: the Python path checks them every step)
        scanner = native.scanner()
        plans = self._plans()
        if scanner is None or not self.param_groups or len(work) != len(self.param_groups) \
                or len(plans) != len(self.param_groups):
            return
        groups = []
        for group, plan, (program, backend, params, grads, states, steps, values) in zip(
                self.param_groups, plans, work):
            if plan is None or plan.group is not group or plan.params is not plan.all_params \
                    or params is not plan.params or len(plan.parts) != 1 or backend != "c" \
                    or program.uses_axes or len(set(map(id, steps))) != len(steps) \
                    or not all(map(_cpu_or_plain, values.values())):
                return
            if any(map(torch.Tensor.is_complex, params)):  # (they step as real views)
                return
            c = codegen.kernel("c", program).direct(
                scanner, params, grads, [s for col in states for s in col], steps, values)
            if c is None:  # not every tensor a contiguous CPU tensor
                return
            groups.append(_DirectGroup(group, plan, program, c))
        self.__dict__["_vega_direct"] = _Direct(self.state, groups)

    def _group_work(self, k, group, grads_all, flags, values) -> list[tuple]:
        """The engine.run calls of group ``k``: (program, backend, params, grads, states,
        steps, values) per program; states made where missing; remembered (``_Plan``)."""
        owner = type(self).__name__
        params = [p for p, g in zip(group["params"], grads_all) if g is not None]
        if not params:
            return []
        grads = [g for g in grads_all if g is not None]
        if _any_sparse(grads):
            raise ValueError(f"{owner} does not support sparse gradients")
        progs = engine.programs(owner, self.spec._spec, flags, values, params)
        shaped = "".join(f", or {n} (it picks each tensor's program)"
                         for n in self.spec._spec.shape_hypers)
        wants: dict[int, set[str]] = {}  # id of a program -> the state it needs
        sts = []  # each parameter's state dict (one lookup: a tensor hashes in Python)
        at_zero: dict = {}
        for p, program in zip(params, progs):
            want = wants.get(id(program))
            if want is None:
                want = wants[id(program)] = {*program.state_names, "step"}
            st = self.state.get(p)
            if not st:
                st = self.state[p] = self._init_state(p, program, values, group, at_zero)
            elif st.keys() != want and not self._adapt_state(p, st, want, program, values,
                                                              group):
                raise ValueError(
                    f"{owner}: a parameter's state has {sorted(st)} but the "
                    f"group's settings need {sorted(want)}; was a bool hyperparameter"
                    f"{shaped} changed after the first step?")
            sts.append(st)
        device = params[0].device.type
        backend = group["backend"] or codegen.default_backend(device)
        parts = [(program, None if len(ks) == len(params) else ks)
                 for program, ks in engine.groups(progs)]
        plan = _Plan(group, self.state, grads_all, flags, self._choosing(values), device,
                     params, sts, parts, self._shapes(params))
        plans = self._plans()
        plans += [None] * (k + 1 - len(plans))
        plans[k] = plan
        return plan.work(backend, grads, sts, values)

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
        program = engine.programs(type(self).__name__, spec, flags, values, plan.params[:1])[0]
        return len(plan.parts) == 1 and program is plan.parts[0][0]

    def _planned_work(self, k, group, grads_all, flags, values) -> list[tuple] | None:
        """``_group_work``'s answer again, when nothing it depends on has changed since the
        last step: the same parameters with gradients, settings, state dicts and state
        tensors (checked by identity), and shapes where the spec picks programs by shape;
        None otherwise."""
        plans = self._plans()
        plan = plans[k] if k < len(plans) else None
        ps = group["params"]
        if plan is None or plan.group is not group or plan.state is not self.state \
                or len(ps) != len(plan.all_params) \
                or not all(map(operator.is_, ps, plan.all_params)) \
                or [g is not None for g in grads_all] != plan.present \
                or flags != plan.flags or not self._same_programs(flags, values, plan):
            return None
        if plan.params is plan.all_params:
            params, grads = plan.params, grads_all
        else:
            params = plan.params
            grads = [g for g in grads_all if g is not None]
        if _any_sparse(grads) or params[0].device.type != plan.device \
                or self._shapes(params) != plan.shapes:
            return None
        sts = list(map(self.state.get, params))
        if not all(map(operator.is_, sts, plan.sts)):
            return None
        backend = group["backend"] or codegen.default_backend(plan.device)
        try:
            return plan.work(backend, grads, sts, values)
        except KeyError:  # a state tensor was removed: the slow path says what is missing
            return None

    def __getstate__(self) -> dict:
        """torch's (defaults, state, groups) and the fused-step settings (copy.deepcopy,
        pickle)."""
        return {**super().__getstate__(), "max_grad_norm": self.max_grad_norm,
                "loss_scale": self.loss_scale, "skip_nonfinite": self.skip_nonfinite}

    def state_dict(self) -> dict:
        """torch's format, plus the loss scale's two tensors under ``'loss_scale'``."""
        out = super().state_dict()
        if self.loss_scale is not None:
            out["loss_scale"] = dict(zip(_LOSS_SCALE_LEAVES, self.loss_scale.tensors()))
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, keeping vega's state dtypes (float32 state for half
        parameters, the step counter int32 on the parameter's device)."""
        before = self.state, self.param_groups, self.loss_scale
        try:
            self._load(state_dict)
            self._check_loaded()
        except BaseException:  # nothing changes
            self.state, self.param_groups, self.loss_scale = before
            raise
        self._plans().clear()
        self.__dict__.pop("_vega_direct", None)  # (it holds the old state's tensors)

    def _load(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        originals = {k: dict(v) for k, v in saved.items()}
        scale = state_dict.get("loss_scale")
        if scale is not None and self.loss_scale is not None:
            mine = dict(zip(_LOSS_SCALE_LEAVES, self.loss_scale.tensors()))
            self.loss_scale = type(self.loss_scale)._from(
                [scale.get(name, mine[name]).to(device=mine[name].device, dtype=mine[name].dtype)
                 for name in _LOSS_SCALE_LEAVES], self.loss_scale._config())
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "loss_scale"})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if pid not in originals or p not in self.state:
                continue
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            sd = engine.state_dtype_for(p, group["state_dtype"])
            for name, value in originals[pid].items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name == "step":  # a copy: the step advances in place
                    self.state[p][name] = value.to(device=p.device, dtype=torch.int32).clone()
                elif value.is_floating_point() or value.is_complex():
                    self.state[p][name] = value.to(device=p.device, dtype=sd).clone()

    def _check_loaded(self) -> None:
        """Each loaded state tensor has the shape its parameter needs (a kernel would read
        and write past a smaller one)."""
        owner = type(self).__name__
        for k, group in enumerate(self.param_groups):
            flags, values = self._group_values(group)
            params = [p for p in group["params"] if self.state.get(p)]
            progs = engine.programs(owner, self.spec._spec, flags, values, params)
            for p, program in zip(params, progs):
                for name, dom in [("step", None), *((s.name, s.dom) for s in program.states)]:
                    x = self.state[p].get(name)
                    if not isinstance(x, torch.Tensor):
                        continue  # missing: the step names what it needs
                    want = () if dom is None else state_shape(p, dom)
                    if tuple(x.shape) != want:
                        i = next(i for i, q in enumerate(group["params"]) if q is p)
                        needs = "a step counter is 0-d" if dom is None else (
                            f"the parameter, of shape {tuple(p.shape)}, needs {want}")
                        raise ValueError(
                            f"{owner}.load_state_dict: state '{name}' of parameter {i} of "
                            f"group {k} has shape {tuple(x.shape)}, but {needs}")


class _StateDict(collections.defaultdict):
    """The optimizer's ``state``, torch's defaultdict of each parameter's dict, which counts
    the changes made to it (``version``): a ``_Direct`` plan holds the dicts it found, and is
    dropped when one was replaced, added or removed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def __setitem__(self, key, value):
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.version += 1
        super().__delitem__(key)

    def __ior__(self, other):
        self.version += 1
        return super().__ior__(other)

    def _changing(name):  # noqa: N805 (a helper of the class body)
        def method(self, *args, **kwargs):
            self.version += 1
            return getattr(collections.defaultdict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    pop, popitem, clear, update, setdefault = map(
        _changing, ("pop", "popitem", "clear", "update", "setdefault"))
    del _changing


class _DirectGroup:
    """A group's part of a ``_Direct`` plan: what it was planned for (the group's ``_Plan``,
    its backend setting), and its C plan (``vega.codegen.c.Direct``, which holds the state
    tensors and counters, state by state in ``names`` order)."""

    def __init__(self, group, plan, program, c):
        self.plan, self.backend, self.program, self.c = plan, group["backend"], program, c
        self.names = (*program.state_names, "step")


class _Direct:
    """The plan of ``SpecOptimizer._direct_step``: the state mapping as it was (and its
    version), and each group's part."""

    def __init__(self, state, groups):
        self.state, self.version, self.groups = state, state.version, groups


def _cpu_or_plain(v) -> bool:
    """A hyperparameter value the direct step takes: a number, a schedule or a CPU tensor."""
    return not isinstance(v, torch.Tensor) or v.device.type == "cpu"


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
        self.present = [g is not None for g in grads_all]
        self.params = self.all_params if all(self.present) else params
        self.flags, self.choosing, self.device = dict(flags), choosing, device
        self.sts, self.parts, self.shapes = sts, parts, shapes

    def work(self, backend, grads, sts, values) -> list[tuple]:
        out = []
        for program, ks in self.parts:
            params, gs, ss = (self.params, grads, sts) if ks is None else (
                [self.params[k] for k in ks], [grads[k] for k in ks], [sts[k] for k in ks])
            out.append((program, backend, params, gs,
                        [[st[n] for st in ss] for n in program.state_names],
                        [st["step"] for st in ss], values))
        return out


def optimizer_class(spec) -> type:
    """A SpecOptimizer subclass for ``spec``, named after its class name."""
    lines = [spec.doc or f"The {spec.name} optimizer.", "", "Hyperparameters (defaults):"]
    for h in spec.hypers:
        rng = f", in {h.range}" if h.range is not None else ""
        default = str(h.default).lower() if h.type == "bool" else h.default
        lines.append(f"    {h.name}: {h.type} = {default}{rng}")
    lines += ["", "Also: backend=None|'reference'|'c'|'triton', state_dtype=None (float32 for "
              "bfloat16/float16 parameters),", "max_grad_norm=None, loss_scale=None (a "
              "vega.LossScale), skip_nonfinite=False."]
    return type(spec.class_name, (SpecOptimizer,), {
        "spec": spec, "__doc__": "\n".join(lines), "__module__": "vega.optim",
        "__qualname__": spec.class_name,
    })
