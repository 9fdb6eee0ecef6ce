"""A compiled spec: the functional API (init, step), its optimizer class, its sources."""
from __future__ import annotations

import math
import operator
import os
import re
from functools import cached_property, partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from vega import codegen, dsl
from vega.dsl import ir
from vega.codegen import quant
from vega.codegen.base import state_shape
from vega.codegen.record import finite_of
from vega.codegen.tensors import (LAZY_WORDS, dense, dense_words, first_with_own_ops, floats,
                                  inplace_problem, like, on_one_device, own_ops_words, same,
                                  uninitialized)
from vega.codegen.steps import advance_steps
from vega.runtime import engine, sharded
from vega.runtime.io import not_regular
from vega.runtime.optimizer import SpecOptimizer
from vega.runtime.tree import flatten, is_steppable, leaf_paths, path_name, unflatten

_Params = TypeVar("_Params")  # a pytree of parameters, and one of its structure


class CompiledSpec:
    """An optimizer compiled from a spec. ``vega.adamw`` and ``vega.compile(text)`` alike.

    - ``init(params, **hypers)`` -> state, a dict of fields shaped like ``params``
      plus ``step``, an int32 0-d tensor;
    - ``step(params, grads, state, *, backend=None, donate=False, **hypers)``
      -> (params, state), pure unless ``donate=True``;
    - ``optimizer(params, **hypers)`` -> a ``torch.optim.Optimizer``;
    - ``source(backend)`` -> the generated kernel source.

    Attributes: ``name`` (the spec's, ``"adamw"``), ``class_name`` (its ``vega.optim``
    class's, ``"AdamW"``), ``doc`` (the spec's leading comment), ``hypers`` (its declared
    hyperparameters) and ``defaults`` (their defaults by name).
    """

    def __init__(self, spec: dsl.Spec):
        self._spec = spec
        self.name = spec.name
        self.class_name = spec.tree.class_name or spec.name.capitalize()
        self.doc = spec.doc
        self.hypers = spec.hypers
        self.defaults = {h.name: h.default for h in spec.hypers}

    def __copy__(self) -> CompiledSpec:
        """The spec itself, as for a function or a class: a compiled spec does not change
        (what it holds besides its rule are its kernels, built once, and its class), so a
        copy of an object that holds one (a deep copy of a configuration, of an optimizer)
        shares it, where copying its kernels would copy their loaded libraries."""
        return self

    def __deepcopy__(self, memo) -> CompiledSpec:
        return self

    def __reduce__(self):
        """Pickled by its text: unpickled, a shipped spec is ``vega.builtin``'s (the one
        compiled in that process), any other one is compiled again from the text it was
        compiled from (its kernels and loaded libraries are not pickled)."""
        from vega.runtime.library import builtin, shipped
        if shipped(self):
            return builtin, (self.name,)
        return compile, (self._spec.source, self._spec.filename)

    def __setstate__(self, state: dict) -> None:
        """A spec pickled by its attributes (by a vega before compiled specs pickled by their
        text, ``__reduce__``) is compiled again from the text it holds, as one pickled now
        is: the attributes of another vega's parse are not this one's (a spec of one
        without ``flag_states`` unpickled, and its class's first step failed on it)."""
        old = state.get("_spec") if isinstance(state, dict) else None
        source = getattr(old, "source", None)
        if not isinstance(source, str):
            raise ValueError("a pickled CompiledSpec holds the text of its spec, which this "
                             "one does not: compile the spec again (vega.compile)")
        fresh = compile(source, getattr(old, "filename", None) or "<spec>")
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"<vega optimizer {self.name}({args}) from {self._spec.filename}>"

    @property
    def source_text(self) -> str:
        """The text of the spec this optimizer was compiled from."""
        return self._spec.source

    def program(self, shape=None, **hypers):
        """The IR for these hyperparameters (defaults elsewhere) and, for a spec whose ifs
        read the shape (``if ndim(p) >= 2``), a parameter of ``shape`` (without one: a
        scalar's, shape ``()``)."""
        flags, values = engine.resolve(self.name, self.hypers, hypers)
        if not self._spec.shape_conditions:
            return self._spec.program(flags)
        shape = () if shape is None else _checked_shape(f"{self.name}.program", shape)
        # (a tensor of that shape, of no storage: the programs read its shape alone, and a
        # meta tensor of float32 storage refuses more than 2**61 elements, its bytes)
        like = torch.empty_strided(shape, (0,) * len(shape), device="meta")
        return engine.programs(self.name, self._spec, flags, values, [like])[0]

    def source(self, backend: str = "reference", shape=None, **hypers) -> str:
        """The generated source of this optimizer's kernel on ``backend`` (for a parameter of
        ``shape``, where the spec has shape conditions)."""
        codegen.check_backend(backend)
        return codegen.kernel(backend, self.program(shape, **hypers)).source()

    def _fields(self, flags, progs, held=()) -> list:
        """The state fields for the programs of these tensors (with none to step, those of
        the spec's plain program)."""
        return engine.state_fields(progs if any(progs) else [self._spec.program(flags, held)])

    def _quantized(self, state, n: int, owner: str) -> list[frozenset] | None:
        """The states each of ``n`` parameters keeps in 8 bits, as ``state`` holds them: those
        with scales (``mu_absmax`` beside ``mu``, ``vega.codegen.quant``) where its leaf is
        there; None where the state holds none. ValueError naming the leaf where 8-bit codes
        (uint8) have no scales beside them, or scales have no codes."""
        if not isinstance(state, dict):
            return None
        declared = self._spec.state_names
        names = [k for k in declared if k + quant.SUFFIX in state
                 and k + quant.SUFFIX not in declared]  # (a spec's own state of that name)
        if not names:
            return None
        out: list[set] = [set() for _ in range(n)]
        for name in names:
            scales = flatten(state[name + quant.SUFFIX])[0]
            if len(scales) != n:
                raise ValueError(f"{self.name}: state '{name}{quant.SUFFIX}' has "
                                 f"{len(scales)} leaves, the parameters {n}")
            codes = flatten(state[name])[0] if name in state else []
            scaled = [leaf is not None for leaf in scales]
            for q, there in zip(out, scaled):
                if there:
                    q.add(name)
            if len(codes) == n and [getattr(c, "dtype", None) == torch.uint8
                                    for c in codes] != scaled:
                _unpaired(owner, name, state[name], codes, scaled)
        return [frozenset(q) for q in out]

    # -- functional API -------------------------------------------------------
    def init(self, params, *, state_dtype=None, master_weights: bool = False,
             **hypers) -> dict:
        """A fresh state for ``params`` (any pytree of tensors). ``state_dtype``: the dtype of
        every state (None: float32 for bfloat16 and float16 parameters, else the
        parameter's), or a dict from state names to dtypes (``{"nu": torch.bfloat16}``).
        ``master_weights``: a state ``master``, a float32 copy of each bfloat16 or float16
        parameter (complex64 of a complex32 one), which the step updates
        (docs/precision.md). ``**hypers``: the spec's hyperparameters, checked as a step
        checks them (``ValueError`` outside a range); they decide which states there are
        (sgd's ``momentum=0`` keeps no buffer, adam's ``amsgrad=True`` keeps ``nu_max``)
        and their first values (adagrad's ``initial_accumulator_value``); any not given
        take their defaults."""
        owner = f"{self.name}_init"
        flags, values = engine.resolve(owner, self.hypers, hypers)
        engine.check_state_dtype(owner, state_dtype, self._spec.state_names)
        engine.check_precision(owner, master_weights, False, 0)
        state_dtype = engine.state_dtype_of(self._spec, state_dtype)  # (the spec's too)
        leaves, spec = flatten(params)
        _check_leaves(owner, "params", params, leaves)
        _check_dense(owner, params, leaves)
        _check_distinct_names(owner, params)
        # a state an if on values declares (sgd's v under `if momentum > 0`) is made
        # unless the values given here turn the if off: sgd_init(params) has v
        held = self._spec.held_open(flags, values, self._spec.value_hypers - hypers.keys())
        steppable = [p if is_steppable(p) else None for p in leaves]
        progs = engine.programs(owner, self._spec, flags, values, steppable, held,
                                master=master_weights,
                                quantized=[engine.q8_names(state_dtype, p) for p in steppable])
        fields = self._fields(flags, progs, held)
        first = next((p for p in leaves if is_steppable(p)), None)
        device = torch.device("cpu") if first is None else first.device
        step = engine.zeros(first, (), torch.int32, device)  # (vmap: each member's own)
        # Build the kernels a step on these parameters will use by default, here and not in
        # the first step: dynamo cannot trace the build (it runs generated code), so a
        # compiled step that is the first to need a kernel would break its graph.
        for program, _ in engine.groups(progs):
            codegen.kernel(codegen.default_backend(device.type), program)
        vals = engine.at_step(values, step)
        columns = {f.name: [None] * len(leaves) for f in fields}
        memo: dict = {}  # (engine.init_leaf's, for the leaves' programs, which progs holds)
        with torch.no_grad():
            for i, (p, program) in enumerate(zip(leaves, progs)):
                if program is None or not is_steppable(p):
                    continue
                def where(i=i):  # (the leaf's name, for a refusal only)
                    return f"{owner}: params leaf {_paths(params, leaves)[i]!r}"
                for s, leaf in zip(program.states,
                                   engine.init_leaf(program, p, vals, state_dtype, where,
                                                    memo)):
                    columns[s.name][i] = leaf
        state = {f.name: unflatten(columns[f.name], spec) for f in fields}
        state["step"] = step
        return state

    @engine.outside_autocast
    def step(self, params, grads, state, *, backend: str | None = None, donate: bool = False,
             max_grad_norm: float | None = None, skip_nonfinite: bool = False,
             loss_scale=None, reduce_group=None, master_weights: bool = False,
             stochastic_rounding: bool = False, rounding_seed: int = 0,
             **hypers) -> tuple[Any, ...]:
        """One update: returns (params, state). Pure unless ``donate=True``.

        ``**hypers``: the spec's hyperparameters (``defaults`` holds the defaults of those
        not given; ``help(vega.optim.<its class>)`` lists them with their ranges): a float
        one a number, a 0-d tensor or a schedule (a ``vega.schedule``, or any callable of
        the step counter; a plain number where an ``if`` of the spec reads it), a bool one
        True or False. ``backend``:
        ``"reference"``, ``"c"`` or ``"triton"`` (None: by the tensors' device, ``"triton"``
        on CUDA, ``"c"`` on the CPU where a C compiler is found, else ``"reference"``).

        Fused into the same step, in this order: ``loss_scale`` (a
        ``vega.LossScale``) divides the gradients by the scale; ``max_grad_norm``
        clips them by their joint L2 norm (optax's rule,
        ``g * max_norm / max(norm, max_norm)``); with a loss scale or
        ``skip_nonfinite``, a step whose gradients are not all finite leaves
        params and the whole state, step counter included, exactly as they were.
        With ``loss_scale`` the step returns ``(params, state, loss_scale)``, the
        scale adjusted for the next step.

        A leaf whose gradient is ``None`` keeps its parameter and state, and the state's
        one step counter advances for all leaves: a later step of that leaf counts every
        call, not its own updates (the classes count each parameter's own, as torch does;
        docs/conventions.md says how to count one leaf's alone).

        ``reduce_group`` (a ``torch.distributed`` process group): the gradients' norm and
        finite check span the parameters of every rank of the group, each rank stepping
        its own. DTensor parameters step their local shards, every reduction combined
        across their mesh (``vega.runtime.sharded``).

        ``master_weights``: the state holds a float32 master copy of each bfloat16 or float16
        parameter (complex64 of a complex32 one; made by ``init(params,
        master_weights=True)``), which the step updates before writing the parameter
        rounded. ``stochastic_rounding``: bfloat16 values (the
        parameters, bfloat16 state) are rounded stochastically, with bits drawn from
        ``rounding_seed``, the step counter and each tensor's and element's position
        (docs/precision.md).
        """
        owner = f"{self.name}_step"
        if not isinstance(donate, bool):  # (a truthy 'no' would write the inputs in place)
            raise ValueError(f"{owner}: donate={engine.shown(donate)} must be True or False")
        seed = engine.check_precision(owner, master_weights, stochastic_rounding, rounding_seed)
        codegen.check_backend(backend)
        backend = engine.under_transforms(owner, backend, donate)
        engine.check_fused(owner, max_grad_norm, skip_nonfinite, loss_scale)
        sharded.check_group(owner, reduce_group)
        flags, values = engine.resolve(owner, self.hypers, hypers, init=f"{self.name}_init")
        p_leaves, p_spec, g_leaves = flatten_pair(owner, params, grads)
        # a state that an if on values declares steps whenever the state holds it, by
        # the values given (sgd's v with momentum 0: v = g)
        held = self._spec.held_open(flags, values, self._spec.value_hypers,
                                    present=state.keys()) \
            if isinstance(state, dict) and self._spec.value_hypers else ()
        every_float = floats(p_leaves)
        try:
            progs = engine.programs(owner, self._spec, flags, values,
                                    p_leaves if every_float else
                                    [p if is_steppable(p) else None for p in p_leaves], held,
                                    master=master_weights, seed=seed,
                                    quantized=self._quantized(state, len(p_leaves), owner))
        except RuntimeError:  # torch's, from a lazy parameter's shape: name the leaf instead
            _check_dense(owner, params, p_leaves)
            raise
        names = [f.name for f in self._fields(flags, progs, held)]
        shaped = self._spec.shape_hypers
        columns = _check_state(owner, self, flags, names, state, p_spec, shaped,
                               master=master_weights)
        _check_masters(owner, params, p_leaves, progs, columns)
        step = state["step"]

        def check_state(i, name, p):  # name(): the leaf's path, for messages
            for s in progs[i].states:
                leaf = columns[s.name][i]
                if leaf is None and shaped:
                    raise ValueError(
                        f"{owner}: state leaf '{_label(s.name, name)}' is missing; this "
                        f"tensor's shape conditions chose a program with state "
                        f"{', '.join(progs[i].state_names)}: was the state made with other "
                        f"values of {', '.join(shaped)}? make it with {self.name}_init(params, "
                        f"...) and the same values as the step")
                _check_state_leaf(owner, lambda s=s: _label(s.name, name), p, leaf, s.dom)
        def states_ok(idx, ps, shapes) -> bool:  # all at once, the common case
            program = progs[idx[0]] if idx else None
            if shapes is None:  # every leaf (``every_float``): in the native module's passes
                return program is not None and same(progs, [program] * len(progs)) and all(
                    s.dom == "rc" and like(ps, columns[s.name]) for s in program.states)
            if program is None or any(progs[i] is not program for i in idx):
                return False
            for s in program.states:
                leaves = [columns[s.name][i] for i in idx]
                if s.dom != "rc" or not all(isinstance(x, torch.Tensor) for x in leaves) \
                        or [x.shape for x in leaves] != shapes \
                        or not on_one_device([ps[0], *leaves]):
                    return False
            return True
        idx = stepped(owner, params, p_leaves, g_leaves, check_state, states_ok, every_float)
        # DTensors step their local shards (vega.runtime.sharded); another tensor subclass
        # with operations of its own (TwoTensor): only the reference backend steps it
        spread = sharded.involved([p_leaves[i] for i in idx], reduce_group)
        own = _own_ops(params, p_leaves, g_leaves, columns, names, idx) \
            if backend != "reference" and not spread and not torch.compiler.is_compiling() \
            else None
        if backend is None:
            device = p_leaves[idx[0]].device.type if idx else "cpu"
            backend = "reference" if own is not None else codegen.default_backend(device)
        elif own is not None:
            label, t = own
            raise ValueError(f"{owner}: {label} {own_ops_words(t)}; backend={backend!r} cannot "
                             f"step it: use backend='reference' (where such tensors step "
                             f"unless a backend is given)")
        work = engine.groups([progs[i] for i in idx])
        work = [(program, [idx[k] for k in ks]) for program, ks in work]
        # (plain tensors are checked here under a reduce_group too: its calls run one after
        # another, and one refused would leave those before it written)
        checked = not torch.compiler.is_compiling() and not (
            spread and sharded.involved([p_leaves[i] for i in idx], None))
        if donate and checked:
            _check_writes(owner, params, p_leaves, columns, work, step,  # before any write
                          g_leaves)
        new_p = {}
        new_cols = {n: {} for n in names}
        with torch.no_grad():
            check = skip_nonfinite or loss_scale is not None
            inv = engine.inverse_scale(loss_scale)
            # several programs share the one counter: each reads it as it was, and it
            # advances once
            items = [(program, backend, [p_leaves[i] for i in ids], [g_leaves[i] for i in ids],
                      [[columns[n][i] for i in ids] for n in program.state_names],
                      [step if len(work) == 1 or not donate else step.clone()] * len(ids),
                      [values] * len(ids)) for program, ids in work]
            found: list = []  # (the leaves' names: found only for a message)

            def path_of(i):
                if not found:
                    found.extend(_paths(params, p_leaves))
                return found[i]

            def named(k, ids):
                return f"params leaf '{path_of(ids[k])}'"

            def check_calls():  # (each call's tensors as its kernel takes them, by name)
                for (program, ids), item in zip(work, items):
                    engine.check_call(owner, program, backend, *item[2:6],
                                      lambda k, ids=ids: named(k, ids))
            if donate and len(items) > 1 and checked:
                check_calls()  # (several calls in place: each checked before the first writes)

            def grad_name(j, k):  # (gradient k of call j, for a message)
                return f"{owner}: grads leaf '{path_of(work[j][1][k])}'"
            if spread or any(program.spans_group for program, _ in work):
                sharded.check_meta_sums(owner, items, None, lambda j, k: named(k, work[j][1]))
                pre, results = sharded.fused(owner, items, inv, max_grad_norm, check, donate,
                                             reduce_group, spans=self._spec.spans_group,
                                             name=grad_name)
            else:
                pre = engine.prelude(
                    [(item[0], backend, item[3]) for item in items], inv, max_grad_norm, check,
                    name=grad_name)
                try:
                    results = [engine.run(*item, donate, pre) for item in items]
                except ValueError:  # (refused by a kernel before it wrote: in the step's words,
                    if checked:     # naming the leaf, where the checks find what it refused)
                        check_calls()
                    raise
            new_step = None
            for (program, ids), (ps, ss, steps, _) in zip(work, results):
                if new_step is None:
                    new_step = steps[0]
                if donate:  # updated in place: the same tensors
                    continue
                for k, i in enumerate(ids):
                    new_p[i] = ps[k]
                for n, col in zip(program.state_names, ss):  # (a column at a time: the
                    into = new_cols[n]                        # names once, not a leaf's)
                    for k, i in enumerate(ids):
                        into[i] = col[k]
            if new_step is None:
                new_step = advance_steps([step], finite_of(pre), donate)[0]
            elif donate and new_step is not step:
                new_step = step.copy_(new_step)
        out_p = list(p_leaves)
        for i, p in new_p.items():
            out_p[i] = p
            if not donate and p_leaves[i].requires_grad:
                out_p[i].requires_grad_(True)
        out_cols = {n: list(columns[n]) for n in names}
        for n, changed in new_cols.items():
            for i, leaf in changed.items():
                out_cols[n][i] = leaf
        _share_group_states(work, idx, out_cols, donate)
        new_state = {n: unflatten(out_cols[n], p_spec) for n in names}
        new_state["step"] = new_step
        if loss_scale is not None:
            return unflatten(out_p, p_spec), new_state, loss_scale.adjust(finite_of(pre))
        return unflatten(out_p, p_spec), new_state

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes the spec declares (``mode eval { p = ... }``), in source order."""
        return tuple(m.name for m in self._spec.tree.body if isinstance(m, dsl.ast.Mode))

    def mode(self, name: str, params: _Params, state, *, master_weights: bool = False,
             **hypers) -> _Params:
        """``params`` as they look in mode ``name`` of the spec (``mode eval { p = ... }``:
        schedule-free's evaluation point, from the parameters the step keeps), read with
        ``state``: new parameters, a pure function. ``master_weights``: the state holds
        float32 master copies (``init(..., master_weights=True)``), which the mode reads in
        place of the parameters."""
        owner = f"{self.name}.mode"
        engine.check_precision(owner, master_weights, False, 0)
        if not isinstance(name, str) or name not in self.modes:
            known = ", ".join(repr(m) for m in self.modes) or "none"
            raise ValueError(f"{owner}: mode {engine.shown(name)} is not one of this spec's "
                             f"modes ({known})")
        flags, values = engine.resolve(owner, self.hypers, hypers)
        p_leaves, p_spec = flatten(params)
        _check_leaves(owner, "params", params, p_leaves)
        progs = engine.programs(owner, self._spec, flags, values,
                                [p if is_steppable(p) else None for p in p_leaves],
                                master=master_weights,
                                quantized=self._quantized(state, len(p_leaves), owner))
        names = [f.name for f in self._fields(flags, progs)]
        columns = _check_state(owner, self, flags, names, state, p_spec,
                               self._spec.shape_hypers, master=master_weights)
        _check_masters(owner, params, p_leaves, progs, columns)
        out = [p.detach().clone() if is_steppable(p) else p for p in p_leaves]
        vals = engine.at_step(values, state["step"])
        with torch.no_grad():
            for program, ids in engine.groups(progs):
                for i in ids:
                    for s in program.states:
                        _check_state_leaf(owner, lambda s=s, i=i: _label(
                            s.name, lambda: _paths(params, p_leaves)[i]),
                            p_leaves[i], columns[s.name][i], s.dom)
                engine.mode(program, name, [out[i] for i in ids],
                            [[columns[n][i] for i in ids] for n in program.state_names],
                            [vals] * len(ids))
        return unflatten(out, p_spec)

    # -- torch.optim ----------------------------------------------------------
    @cached_property
    def optimizer_class(self) -> type[SpecOptimizer]:
        """This optimizer as a ``torch.optim.Optimizer`` subclass (of ``SpecOptimizer``)."""
        from vega.runtime.optimizer import optimizer_class
        return optimizer_class(self)

    def optimizer(self, params, *args, **kwargs) -> SpecOptimizer:
        """A ``torch.optim.Optimizer`` (a ``SpecOptimizer``) over ``params`` (an iterable or
        param groups); ``lr`` may come by position, as torch's classes take it."""
        return self.optimizer_class(params, *args, **kwargs)


def _share_group_states(work, stepped, cols, donate: bool) -> None:
    """A leaf that did not step (no gradient) takes its group's new value of each state of
    one number per group (``Program.group_states``: Prodigy's d), in ``cols``: field ->
    leaves."""
    fresh = {}
    for program, ids in work:
        for name in program.group_states:
            fresh.setdefault(name, cols[name][ids[0]])
    if not fresh:
        return
    done = set(stepped)
    for name, value in fresh.items():
        for i, leaf in enumerate(cols[name]):
            if i not in done and isinstance(leaf, torch.Tensor):
                if donate:
                    leaf.copy_(value)
                else:
                    cols[name][i] = value.to(leaf.dtype).clone()


def _checked_shape(owner: str, shape) -> tuple[int, ...]:
    """A parameter shape given as sizes: whole numbers >= 0 (ints, numpy's, 0-d integer
    tensors) whose product a tensor's element count holds; ValueError naming it."""
    try:
        sizes = tuple(operator.index(n) for n in shape if not isinstance(n, bool))
        if len(sizes) != len(shape):
            raise TypeError
    except TypeError:
        raise ValueError(f"{owner}: shape={engine.shown(shape)} must be a sequence of whole "
                         "numbers >= 0") from None
    if any(n < 0 for n in sizes):
        raise ValueError(f"{owner}: shape={engine.shown(shape)} has a negative size")
    if math.prod(sizes) > 2**63 - 1 or any(n > 2**63 - 1 for n in sizes):
        raise ValueError(f"{owner}: shape={engine.shown(shape)} is too large: a tensor has at "
                         "most 2**63 - 1 elements")
    return sizes


def _unpaired(owner: str, name: str, tree, codes, scaled) -> None:
    """ValueError naming the first leaf of 8-bit state ``name`` (its ``tree``, flattened to
    ``codes``) whose codes (uint8) have no scales beside them (``scaled``: where they have),
    or that is a float tensor beside scales."""
    for i, (code, there) in enumerate(zip(codes, scaled)):
        if isinstance(code, torch.Tensor) and (code.dtype == torch.uint8) != there:
            path = _paths(tree, codes)[i]
            at = f".{path}" if path else ""
            if not there:
                raise ValueError(f"{owner}: state leaf '{name}{at}' holds 8-bit codes "
                                 f"(torch.uint8) without their scales: "
                                 f"'{name}{quant.SUFFIX}{at}' is None")
            raise ValueError(f"{owner}: state leaf '{name}{at}' is {code.dtype} beside 8-bit "
                             f"scales '{name}{quant.SUFFIX}{at}': 8-bit codes are torch.uint8; "
                             "make the state with the same state_dtype")


def _check_distinct_names(owner: str, params) -> None:
    """ValueError where two leaves of ``params`` have one name (``{1: a, "1": b}``): a state
    names each leaf by its keys joined with '.' (``vega.save``, ``get_leaf``), which would
    refuse the state only later. Once, at init (a step does not build the names)."""
    seen = set()
    for name in leaf_paths(params):
        if name in seen:
            raise ValueError(f"{owner}: two leaves of params are both named {name!r} (a "
                             "state names each leaf by its keys joined with '.'); rename a key")
        seen.add(name)


def flatten_pair(owner: str, params, grads):
    """The leaves of params and of grads, checked to share one structure, and that structure."""
    p_leaves, p_spec = flatten(params)
    _check_leaves(owner, "params", params, p_leaves)
    g_leaves, g_spec = flatten(grads)
    if g_spec != p_spec:
        where = _where_unlike("grads", grads, p_spec).replace("'grads' has", "grads have") \
            .replace("'grads' is", "grads are")
        raise ValueError(f"{owner}: grads do not have the structure of params "
                         f"({len(g_leaves)} leaves against {len(p_leaves)}){where}")
    return p_leaves, p_spec, g_leaves


def stepped(owner: str, params, p_leaves, g_leaves, check_state, states_ok=None,
            every_float: bool = False) -> list[int]:
    """The positions of the leaves a step updates: float or complex parameters with a
    gradient. Each gradient is checked, and ``check_state(i, name, p)`` checks its state;
    ``name()`` is the leaf's path, for a message (found only then: it costs more than the
    checks). ``states_ok(positions, params, shapes)``, where given, checks the states of
    all at once, or says False and leaves it to ``check_state``: the gradients are checked
    at once too, and tensor by tensor only when something is wrong, to say what.
    ``every_float``: every parameter is a floating-point tensor (``tensors.floats``), so
    that where every gradient and state is a tensor like its parameter (``tensors.like``)
    every leaf steps: ``states_ok(positions, params, None)`` then checks the states so."""
    if states_ok is not None and every_float and like(p_leaves, g_leaves) and floats(g_leaves):
        every = list(range(len(p_leaves)))
        if states_ok(every, p_leaves, None):
            return every
    idx = [i for i, (p, g) in enumerate(zip(p_leaves, g_leaves))
           if g is not None and is_steppable(p)]
    if states_ok is not None:
        ps, gs = [p_leaves[i] for i in idx], [g_leaves[i] for i in idx]
        all_dense = all(map(dense, ps))
        try:  # (a nested one has no shape, nor a lazy one: the checks below name it)
            shapes = [p.shape for p in ps] if all_dense else None
        except RuntimeError:
            all_dense, shapes = False, None
        if all_dense and all(isinstance(g, torch.Tensor) and dense(g) for g in gs) \
                and [g.shape for g in gs] == shapes \
                and on_one_device(ps + gs) \
                and [p.is_complex() for p in ps] == [g.is_complex() for g in gs] \
                and all(g.is_floating_point() or g.is_complex() for g in gs) \
                and states_ok(idx, ps, shapes):
            return idx
    paths: list[str] = []

    def name_of(i: int) -> str:
        if not paths:
            paths.extend(_paths(params, p_leaves))
        return paths[i]

    idx = []
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        if g is None or not is_steppable(p):
            continue
        name = partial(name_of, i)
        if uninitialized(p):
            raise ValueError(f"{owner}: params leaf '{name()}' {_LAZY_SHAPE}")
        if not dense(p):
            raise ValueError(f"{owner}: params leaf '{name()}' is {dense_words(p)}")
        _check_grad(owner, name, p, g)
        check_state(i, name, p)
        idx.append(i)
    return idx


def _own_ops(params, p_leaves, g_leaves, columns, names, idx):
    """(the leaf's label, the tensor) of the first leaf stepped (at a position of ``idx``)
    that is a tensor subclass with operations of its own
    (``vega.codegen.tensors.has_own_ops``), or None."""
    every = len(idx) == len(p_leaves)
    for what, leaves in (("params", p_leaves), ("grads", g_leaves),
                         *((n, columns[n]) for n in names)):
        k = first_with_own_ops(leaves if every else [leaves[i] for i in idx])
        if k is not None:
            k = k if every else idx[k]
            path = _paths(params, p_leaves)[k]
            label = f"{what} leaf '{path}'" if what in ("params", "grads") else \
                f"state leaf '{_label(what, lambda: path)}'"
            return label, leaves[k]
    return None


def _check_writes(owner, params, p_leaves, columns, work, step, g_leaves) -> None:
    """Raise ValueError, naming the leaf, where a step in place (``donate=True``) cannot write
    a parameter, state or the step counter, or read a gradient that shares memory with one
    (``vega.codegen.tensors.inplace_problem``): checked for every tensor before any is
    written."""
    written, where = [], []  # where: (field or None for params, positions) per run
    for program, ids in work:
        written += [p_leaves[i] for i in ids]
        where.append((None, ids))
        for n in program.state_names:
            written += [columns[n][i] for i in ids]
            where.append((n, ids))
    written.append(step)
    read = [i for _, ids in work for i in ids]
    problem = inplace_problem(written, [g_leaves[i] for i in read])
    if problem is None:
        return
    paths = _paths(params, p_leaves)

    def label(k: int) -> str:
        if k >= len(written):
            return f"grads leaf '{paths[read[k - len(written)]]}'"
        for field, ids in where:
            if k < len(ids):
                path = paths[ids[k]]
                return f"params leaf '{path}'" if field is None else \
                    f"state leaf '{_label(field, lambda: path)}'"
            k -= len(ids)
        return "state['step']"
    k, other, words = problem
    raise ValueError(f"{owner}: {label(k)} "
                     f"{words.format(other=label(other)) if other is not None else words}")


def _label(field: str, name) -> str:
    """A state leaf's name: its field and its parameter's path (``name()``)."""
    return f"{field}.{name()}".rstrip(".")


def _paths(tree, leaves) -> list[str]:
    """Names aligned with ``flatten``'s leaves (``None`` leaves get empty names)."""
    tensor_paths = iter(leaf_paths(tree))
    return [next(tensor_paths) if leaf is not None else "" for leaf in leaves]


def _check_leaves(owner, what, tree, leaves):
    if all(leaf is None or isinstance(leaf, torch.Tensor) for leaf in leaves):
        return
    for name, leaf in zip(_paths(tree, leaves), leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            label = f"leaf '{name}'" if name else "leaf"
            raise ValueError(f"{owner}: {what} {label} is a {type(leaf).__name__}, not a tensor")


_LAZY_SHAPE = f"{LAZY_WORDS}: its shape is not known yet; run a forward pass first"


def _check_dense(owner, params, leaves) -> None:
    """Raise ValueError, naming the leaf, for a sparse or nested parameter: its state could
    not be made like it (torch has no such operations for those layouts), nor stepped; and
    for a lazy module's parameter not yet initialized, whose shape is not known."""
    if all(leaf is None or dense(leaf) and not uninitialized(leaf) for leaf in leaves):
        return
    for name, leaf in zip(_paths(params, leaves), leaves):
        label = f"leaf '{name}'" if name else "leaf"
        if leaf is not None and uninitialized(leaf):
            raise ValueError(f"{owner}: params {label} {_LAZY_SHAPE}")
        if leaf is not None and not dense(leaf):
            raise ValueError(f"{owner}: params {label} is {dense_words(leaf)}")


def _same_device(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.is_cpu and b.is_cpu) or a.device == b.device


def _check_grad(owner, name, p, g):
    if isinstance(g, torch.Tensor) and dense(g) and g.shape == p.shape \
            and _same_device(g, p) and g.is_complex() == p.is_complex() \
            and (g.is_floating_point() or g.is_complex()):
        return
    label = f"'{name()}'" if name() else "(the single tensor)"
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"{owner}: grads leaf {label} is a {type(g).__name__}, not a tensor")
    if g.is_nested:
        raise ValueError(f"{owner}: grads leaf {label} is a nested tensor; vega steps dense "
                         f"gradients of the parameter's shape")
    if g.layout != torch.strided:
        raise ValueError(f"{owner}: grads leaf {label} is sparse ({g.layout}); vega steps "
                         f"dense gradients")
    if g.shape != p.shape:
        raise ValueError(f"{owner}: grads leaf {label} has shape {tuple(g.shape)}, but the "
                         f"parameter has shape {tuple(p.shape)}")
    if g.device != p.device:
        raise ValueError(f"{owner}: grads leaf {label} is on {g.device}, the parameter on "
                         f"{p.device}")
    if not (g.is_floating_point() or g.is_complex()):
        raise ValueError(f"{owner}: grads leaf {label} has dtype {g.dtype}; vega steps "
                         f"floating-point (or complex) gradients")
    raise ValueError(f"{owner}: grads leaf {label} has dtype {g.dtype}, the parameter "
                     f"{p.dtype}")


def _check_masters(owner, params, p_leaves, progs, columns) -> None:
    """ValueError where the state holds a master copy of a parameter that is no longer half
    (made float32 after init): the copy would be passed on untouched, stale, and the
    parameter step on from its rounded value."""
    # (one program for all, the field's: the common case)
    if engine.MASTER not in columns or same(progs, [progs[0]] * len(progs)):
        return
    col = columns[engine.MASTER]
    for i, prog in enumerate(progs):
        if prog is not None and col[i] is not None and engine.MASTER not in prog.state_names:
            path = _paths(params, p_leaves)[i]
            raise ValueError(
                f"{owner}: state leaf '{_label(engine.MASTER, lambda: path)}' is a master "
                f"copy, but params leaf '{path}' is {p_leaves[i].dtype}, its own master "
                "copy: to step on from the copy, set the parameter to it and the leaf to None")


def _check_state(owner, cspec, flags, names, state, p_spec, shaped=(), master=False):
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: state must be the dict that {cspec.name}_init returns, "
                         f"got {type(state).__name__}")
    want = set(names) | {"step"}
    if engine.MASTER not in want and set(state) == want | {engine.MASTER} \
            and engine.MASTER not in cspec._spec.state_names:
        # (with master_weights=True given, no parameter is half any more: the copies are
        # stale, and passing the flag is no remedy)
        remedy = "no parameter is bfloat16, float16 or complex32 now (each is its own " \
            "copy): set" if master else "pass master_weights=True to step with them; a " \
            "parameter that is not bfloat16, float16 or complex32 keeps none (it is its own " \
            "copy): where none is now, set"
        raise ValueError(f"{owner}: state holds master copies ('master'), but this step "
                         f"(master_weights={master}) keeps none: {remedy} each parameter to "
                         "its copy and drop the field to step on from them")
    if set(state) != want:
        master = engine.MASTER in want or engine.MASTER in state
        flags = ", ".join([*(f"{k}={v}" for k, v in sorted(flags.items())),
                           *([f"master_weights={engine.MASTER in want}"] if master else [])])
        made = f"{cspec.name}_init(params{', ' + flags if flags else ''})"
        also = (f" and the same {', '.join(shaped)} (it picks each tensor's program)"
                if shaped else "")
        raise ValueError(f"{owner}: state has fields {sorted(state)}, but this step "
                         f"({flags or 'no flags'}) needs {sorted(want)}; make it with {made}"
                         f"{also}")
    step = state["step"]
    if not (isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch.int32):
        raise ValueError(f"{owner}: state['step'] must be a 0-d int32 tensor, got {step!r}")
    columns = {}
    for n in names:
        columns[n], spec = flatten(state[n])
        if spec != p_spec:
            raise ValueError(f"{owner}: state field '{n}' does not have the structure of "
                             f"params{_where_unlike(n, state[n], p_spec)}")
    return columns


def _where_unlike(field: str, sub, p_spec) -> str:
    """Where a state field's tree first differs from the parameters', for a message: the
    same leaf paths in another order (a dict's keys), or the first leaf path (in order) that
    the two do not share, and what each holds there."""
    params = unflatten([None] * p_spec.num_leaves, p_spec)
    ours, theirs = _typed_paths(params), _typed_paths(sub)
    order, their_order = [path for path, _ in ours], [path for path, _ in theirs]
    if order != their_order and sorted(order) == sorted(their_order) \
            and len(set(order)) == len(order):
        shown_order = ", ".join(repr(path) for path, _ in theirs[:4]) + \
            (", ..." if len(theirs) > 4 else "")
        return (f": '{field}' has the leaves of params in another order ({shown_order}); "
                "a dict's keys are read in their order, as torch's pytrees read them, so "
                "they must come in the order of params' keys")
    for k in range(max(len(ours), len(theirs))):
        a = ours[k] if k < len(ours) else None
        b = theirs[k] if k < len(theirs) else None
        if a is None or b is None or a[0] != b[0]:
            said = [f"params {'have nothing more' if a is None else f'have {a[1]} at {a[0]!r}'}",
                    f"'{field}' {'has nothing more' if b is None else f'has {b[1]} at {b[0]!r}'}"]
            return f": {said[0]}, {said[1]}"
        if b[1] != "a leaf" and b[1] != "a tensor":
            return f": '{field}' has {b[1]} at {b[0]!r}, where params have a tensor"
    from torch.utils import _pytree as pytree
    node = _unlike_node(p_spec, pytree.tree_flatten(sub, is_leaf=lambda x: x is None)[1])
    if node is None:
        return ""
    where, ours, theirs = node
    if not where:
        return f": '{field}' is a {theirs.__name__}, params a {ours.__name__}"
    return f": '{field}' has a {theirs.__name__} at {where!r}, where params have a " \
           f"{ours.__name__}"


def _unlike_node(a, b, path: str = ""):
    """(dotted path, a's node type, b's) of the first node where the structures ``a`` and
    ``b`` (torch's TreeSpecs, of the same leaf paths) hold containers of different types (a
    list against a tuple, a dict against an OrderedDict); None where none does. Its paths
    name the nodes as ``_typed_paths`` names the leaves."""
    if a.type is not b.type:
        return path, a.type, b.type
    children = a.children()
    context = a.context
    for k, (x, y) in enumerate(zip(children, b.children())):
        if isinstance(context, (list, tuple)) and len(context) == len(children):
            key = context[k]  # (a dict's keys)
        elif hasattr(context, "_fields"):
            key = context._fields[k]  # (a namedtuple's)
        else:
            key = k
        found = _unlike_node(x, y, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _typed_paths(tree) -> list[tuple[str, str]]:
    """(dotted path, what is there) of each leaf of ``tree``, None counted as a leaf."""
    from torch.utils import _pytree as pytree

    pairs, _ = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    out = []
    for path, leaf in pairs:
        name = path_name(path) or "(the root)"
        what = "a leaf" if leaf is None else "a tensor" if isinstance(leaf, torch.Tensor) \
            else f"a {type(leaf).__name__}"
        out.append((name, what))
    return out


def _check_state_leaf(owner, name, p, s, dom="rc"):
    """``name()``: the leaf's name, for a message."""
    if s is None:
        raise ValueError(f"{owner}: state leaf '{name()}' is missing")
    if not isinstance(s, torch.Tensor):
        raise ValueError(f"{owner}: state leaf '{name()}' is {engine.shown(s)}, a "
                         f"{type(s).__name__}, not a tensor")
    if dom == "rc" and s.shape == p.shape and _same_device(s, p):
        return
    want = state_shape(p, dom)
    if tuple(s.shape) != want or s.device != p.device:
        whose = "its parameter has" if dom == "rc" else \
            f"its parameter {tuple(p.shape)} needs {ir.DOMAIN_WORDS[dom]}:"
        raise ValueError(f"{owner}: state leaf '{name()}' has shape {tuple(s.shape)} on "
                         f"{s.device}, but {whose} {want} on {p.device}")


def compile(source: str, filename: str = "<spec>") -> CompiledSpec:  # noqa: A001
    """Compile spec text; raises ``vega.SpecError`` naming the line and column of a mistake.
    A file's path given in place of the text (``vega.compile("mine.vega")``) is refused
    with the way to read it, ``vega.compile_file``."""
    if isinstance(source, os.PathLike):
        raise TypeError(f"compile: source={engine.shown(source)} is a path; vega.compile takes "
                        "a spec's text, and vega.compile_file(path) reads a spec file")
    try:
        return CompiledSpec(dsl.load(source, filename))
    except dsl.SpecError:
        if not _a_path(source):
            raise
    raise dsl.SpecError(f"{source.strip()!r} is a file's name, not a spec's text: "
                        f"vega.compile takes the text, and vega.compile_file({source.strip()!r}) "
                        "reads the file", filename=filename)


def _a_path(source) -> bool:
    """Whether text that is no spec is a spec file's name: one line, ending in ``.vega`` or
    naming a file that is there, and not begun as a spec is (``optimizer o(...) p = ...``
    on one line, its '{' left out, is a spec's text whatever its last word)."""
    text = source.strip() if isinstance(source, str) else ""
    if not text or "\n" in text or "{" in text or re.match(r"optimizer\s", text):
        return False
    try:
        return text.endswith(".vega") or os.path.isfile(text)
    except (OSError, ValueError):  # (a name the file system cannot take)
        return False


MAX_SPEC_BYTES = 1 << 20  # 1 MiB: the shipped specs are a few KiB


def compile_file(path) -> CompiledSpec:
    """Compile a ``.vega`` file; errors name the file.

    The file must be a regular file (not a directory, a FIFO or a device: nothing is
    opened that could block or never end) of at most 1 MiB of UTF-8 text; otherwise
    ``vega.SpecError`` ("FILE: error: ..."). A file that cannot be read at all (missing,
    unreadable) raises ``FileNotFoundError``, naming it; a ``path`` that is not a ``str`` or
    ``os.PathLike``, ``TypeError``, as ``compile`` of what is not text."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"compile_file: path={engine.shown(path)} must be a file's path (a str or "
                        "os.PathLike)")
    name = str(Path(path))
    return compile(read_spec_file(name), name)


def read_spec_file(name: str) -> str:
    """The text of spec file ``name``, its line ends made ``\\n`` (as ``open`` reads text);
    ``compile_file``'s checks."""
    def unreadable(err: OSError | ValueError):
        text = " (is it a spec's text? vega.compile(text) compiles one)" \
            if "{" in name or "\n" in name else ""
        why = getattr(err, "strerror", None) or str(err)  # (a name no file can have: a
        # ValueError, 'embedded null byte', or a lone surrogate's encoding error)
        return FileNotFoundError(f"{name}: error: cannot read spec file: {why}{text}")

    def refused(why: str):
        return dsl.SpecError(why, filename=name)
    try:
        mode = os.stat(name).st_mode  # (before opening: a FIFO would block the open)
    except (OSError, ValueError) as err:
        raise unreadable(err) from err
    _regular(mode, refused)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise unreadable(err) from err
    with os.fdopen(fd, "rb") as f:
        _regular(os.fstat(f.fileno()).st_mode, refused)  # (the file opened is the one seen)
        try:
            data = f.read(MAX_SPEC_BYTES + 1)
        except OSError as err:
            raise unreadable(err) from err
    if len(data) > MAX_SPEC_BYTES:
        raise refused(f"larger than {MAX_SPEC_BYTES} bytes (1 MiB), the most a spec file may "
                      "have; is it a spec?")
    try:
        # (a byte-order mark at the start, which editors may write, read as none)
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise refused(f"not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                      "a spec file is UTF-8 text") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _regular(mode: int, refused) -> None:
    kind = not_regular(mode)
    if kind is not None:
        raise refused(f"{kind}, not a regular file; a spec is read from a .vega file")
