"""Running the C kernels: ``Kernel`` builds a program's libraries (``build``) and steps
lists of tensors through the native operator (``native``) where it is built, else through
ctypes; the Python custom ops ``vega::c_step`` and ``vega::c_prelude`` carry a traced
step where the operator cannot be built."""
from __future__ import annotations

import ctypes
import itertools
import math
import operator
import struct
import threading
import weakref

import numpy as np
import torch
from torch.autograd.graph import increment_version

from vega.codegen import plan, record, reference
from vega.codegen.base import (HyperRows, axis_geometry, check_codes, check_states, distinct,
                               of_elements, reduction_phases, shard_geometries, state_key)
from vega.codegen.c import build as cbuild
from vega.codegen.c import native
from vega.codegen.c.render import Source
from vega.codegen.reference import global_keys
from vega.codegen.steps import (Done, axis_part, finish_combined, finished, run_staged,
                                shard_part, tensor_parts)
from vega.codegen.c.staged import NGEO, AxesSource, line_lengths, materialized
from vega.codegen.tensors import (as_runs, copy_back, has_own_ops, meeting, memory_order,
                                  own_ops_words, readable, refuse_inplace, roles, shared_pair,
                                  sorted_spans, wrapped)
from vega.dsl.ir import AXIS_REDUCTIONS, QBLOCK, SCALAR_STATE, Program
from vega.tracing import untraced

# -- running ------------------------------------------------------------------

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16", torch.uint8: "uint8"}  # (uint8: a state's 8-bit codes)
_GROUP_KEYS: dict[tuple, tuple[str, str, str]] = {}  # validated (p, g, state) dtypes
_ENTRY = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int
# a stage of a step over shards of a program over a matrix view (``vega_axes_stage<k>``)
_AXES_ENTRY = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_void_p, ctypes.c_int)


def _ptr(x: torch.Tensor | None):
    return ctypes.c_void_p(x.data_ptr()) if x is not None else None


def _check_record(pre: torch.Tensor | None) -> None:
    """ValueError for a prelude's record without memory (one made under FakeTensorMode for a
    step of real tensors), which the kernels would write at address 0; before any runs."""
    if pre is not None and pre.data_ptr() == 0:
        Kernel._check_readable([("the prelude's record", [pre])])


def _refuse_off_cpu(params) -> None:
    off = next((p for p in params if not p.is_cpu), None)
    if off is not None:
        raise ValueError(f"backend 'c' runs on CPU tensors, got parameters on {off.device}; "
                         "use backend='triton' or 'reference'")


class Kernel:
    """The C kernels of one program: one library per dtype group, built on first use.

    The ctypes calls run inside two torch custom ops, ``vega::c_prelude`` and
    ``vega::c_step``, which update their tensor arguments in place: ``torch.compile``
    sees each as one opaque node (their fake implementations do nothing), so a
    compiled training step on this backend is one graph.
    """

    backend = "c"
    takes_rows = True  # values may come as a HyperRows table
    state_dtypes = frozenset(_DTYPES)  # (a class step checks its states' against them first)

    @property
    def checks_writes(self) -> bool:
        """Whether a step in place checks every tensor it writes before it writes any: the
        native operator does."""
        return native.module() is not None

    def __init__(self, program: Program):
        self.program = program
        self._reference = reference.Kernel(program)
        self._libs: dict[tuple[str, str, str], ctypes.CDLL] = {}
        self._phases = reduction_phases(program)
        self._nphases = len(self._phases)
        self._nred = sum(map(len, self._phases))
        self._axes = program.uses_axes  # one vega_axes_step instead of phases and update
        self._of_elements = not self._axes and of_elements(self._phases)  # (``stageable``)
        # a program over a matrix view: its stages and the values it keeps in buffers
        self._axis_plan = plan.axis_plan(program) if self._axes else None
        self._mats = materialized(program) if self._axes else []
        self.global_keys = global_keys(program)  # its reductions over a group, named
        self.columns = record.table_columns(len(program.states), NGEO if self._axes else 0)
        # how the custom ops find this kernel: a name never given to another (a counter,
        # not len(_KERNELS): two threads making kernels at once would take the same
        # number), held weakly (the kernel lives as long as its program, whose ``kernels``
        # holds it)
        self.id = next(_SERIAL)
        self.key = f"{program.name}/{self.id}"
        _KERNELS[self.key] = weakref.ref(self, lambda _, key=self.key: _KERNELS.pop(key, None))
        self._native = None  # the native operator's module this kernel is registered with
        self._native_libs: set[tuple[str, str, str]] = set()  # (and these libraries)
        self._native_lock = threading.Lock()
        self._hyp_cache: dict[bytes, torch.Tensor] = {}
        # the tables of the last calls: the optimizers and param groups that share this
        # kernel alternate, and each should find its own. A step plan is keyed by the
        # addresses of the tensors it writes, so two threads stepping their own tensors
        # never share one; the prelude's tables are keyed by sizes alone, so each thread
        # keeps its own (a launch runs without the GIL: another thread rewriting the
        # gradient column of a shared table would make this one read its gradients)
        self._plans: list[_Plan] = []  # most recent first, at most 64
        self._local = threading.local()  # .pre_plans: (sizes, dtypes, devices) -> tables

    def source(self, dtypes=("float32", "float32", "float32")) -> str:
        return (AxesSource if self._axes else Source)(self.program, *dtypes).text()

    def init(self, p, values, state_dtype):
        return self._reference.init(p, values, state_dtype)

    def library(self, dtypes: tuple[str, str, str]) -> ctypes.CDLL:
        if dtypes not in self._libs:
            lib = cbuild.library(self.source(dtypes))
            names = ["vega_prelude", "vega_axes_step"] if self._axes else \
                ["vega_prelude", "vega_update"] + [f"vega_phase{k}{how}" for k in range(
                    self._nphases) for how in ("", "_partial")] + (
                    ["vega_fused"] if self._nphases else [])
            staged = [f"vega_axes_stage{k}" for k in range(self._axis_plan.nstages)] + \
                ["vega_axes_write"] if self._axes else []
            for name in names + staged:
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = _AXES_ENTRY if name in staged else _ENTRY \
                    if name not in ("vega_prelude", "vega_axes_step") else (
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            lib.vega_advance.restype = None
            lib.vega_advance.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
            self._libs[dtypes] = lib
        return self._libs[dtypes]

    def _registered(self, mod) -> None:
        """Register this kernel, and each of its libraries built so far, with the native
        operator's module ``mod`` (``vega.codegen.c.native``), which calls their entry points;
        dropped from it when this kernel is released."""
        with self._native_lock:
            if self._native is not mod:
                p = self.program
                c = self.columns
                wants = [0] * len(p.states)  # (8 bits: codes uint8, scales float32)
                for name, (scale, _) in p.quant.items():
                    wants[p.state_names.index(name)] = 1
                    wants[p.state_names.index(scale)] = 2
                mod.add_kernel(self.id, p.name, len(p.states), self._nphases, self._nred,
                               len(p.float_hypers), self._axes, [_DOMS[s.dom] for s in p.states],
                               [c.numel, c.p, c.g, c.state, c.step, c.hyper, c.geo, c.p_out,
                                c.state_out, c.width], wants)
                self._native, self._native_libs = mod, set()
                weakref.finalize(self, mod.drop_kernel, self.id)
            for dtypes, lib in list(self._libs.items()):
                if dtypes in self._native_libs:
                    continue

                def at(name: str) -> int:
                    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                mod.add_library(
                    self.id, " ".join(dtypes), at("vega_prelude"), at("vega_advance"),
                    0 if self._axes else at("vega_update"),
                    at("vega_fused") if self._nphases and not self._axes else 0,
                    at("vega_axes_step") if self._axes else 0,
                    [] if self._axes else [at(f"vega_phase{k}") for k in range(self._nphases)])
                self._native_libs.add(dtypes)

    def _native_call(self, mod, call, *args) -> None:
        """``call(self.id, *args)``, a function of the native module, building the libraries
        it asks for (each call checks every tensor before it writes any)."""
        self._registered(mod)
        built = set()
        while True:  # (a library for each dtype group it meets, however many)
            try:
                return call(self.id, *args)
            except mod.MissingLibrary as e:
                key = tuple(str(e.args[0]).split())
                if key in built:  # (built and registered, yet missing: not to loop on)
                    raise
                built.add(key)
                self.library(key)
                self._registered(mod)

    def _group_key(self, p, g, s_dtype):
        """The dtype group of a parameter, its gradient and its states (``s_dtype``: their
        one dtype, or a tuple of each state's): (p, g, state) names, the state's
        ``state_key``."""
        if isinstance(s_dtype, tuple):
            if s_dtype.count(s_dtype[0]) == len(s_dtype):
                s_dtype = s_dtype[0]
            else:
                for d in s_dtype:
                    if d not in _DTYPES:
                        raise ValueError(f"backend 'c' does not support state of dtype {d}")
                p_name, g_name, _ = self._group_key(p, g, s_dtype[0])
                return p_name, g_name, state_key([_DTYPES[d] for d in s_dtype], p_name)
        key = (p.dtype, g.dtype, s_dtype)
        compiling = torch.compiler.is_compiling()
        # eagerly, the common case is checked once per dtype triple; not while tracing, where
        # reading the cache would guard on its contents (a first compiled step that filled
        # it would then recompile)
        if p.is_cpu and g.is_cpu and not compiling:
            found = _GROUP_KEYS.get(key)
            if found is not None:
                return found
        for x, what in ((p, "parameters"), (g, "gradients")):
            if x.dtype not in _DTYPES or x.dtype == torch.uint8:
                raise ValueError(f"backend 'c' does not support {what} of dtype {x.dtype}")
            if x.device.type != "cpu":
                raise ValueError(f"backend 'c' runs on CPU tensors, got {what} on {x.device}; "
                                 "use backend='triton' or 'reference'")
        if s_dtype not in _DTYPES:
            raise ValueError(f"backend 'c' does not support state of dtype {s_dtype}")
        found = (_DTYPES[p.dtype], _DTYPES[g.dtype], _DTYPES[s_dtype])
        if not compiling:
            _GROUP_KEYS[key] = found
        return found

    def prelude(self, grads, pre: torch.Tensor) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``."""
        if torch.compiler.is_compiling():  # traced as one opaque node
            for g in grads:
                self._group_key(g, g, g.dtype)
            # (the operators read contiguous tensors: a gradient in another layout as a
            # contiguous copy, as ``_traced_step`` takes it)
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
            if not untraced(_native_ready, self, tuple({(g.dtype,) * 3 for g in grads})):
                c_prelude(self.key, list(grads), pre)
                return
            torch.ops.vega_c.prelude(self.id, list(grads), pre)
            return
        mod = native.module()
        if mod is not None:  # the native operator, called directly
            try:
                return self._native_call(mod, mod.prelude, list(grads), pre)
            except ValueError:
                pass  # (the Python path says which tensor is wrong, or reads a copy)
            # a gradient stored in another order than its dimensions' (channels_last): its
            # sums read as the run of memory it is, as torch's norm of it reads it, where the
            # Python path read a contiguous copy made at every step
            runs = as_runs(grads)
            if runs is not None:
                try:
                    return self._native_call(mod, mod.prelude, runs, pre)
                except ValueError:
                    pass
        self._prelude(grads, pre)

    def _prelude(self, grads, pre: torch.Tensor) -> None:
        """The body of ``vega::c_prelude``. The tables of gradients of the same sizes, dtypes
        and devices as a recent call's serve again, with their addresses rewritten."""
        _check_record(pre)
        grads = readable(grads)
        ptrs = list(map(torch.Tensor.data_ptr, grads))
        if 0 in ptrs:  # (an empty tensor may have no address; a wrapper subclass has none)
            self._check_readable([("gradient", grads)])
        self._run_prelude(self._prelude_plan(grads), ptrs, pre)

    def _prelude_plan(self, grads) -> tuple[list, list]:
        """The prelude's (tables, views) for contiguous gradients of these sizes, dtypes and
        devices, kept for this thread's next calls."""
        sig = (tuple(map(torch.Tensor.numel, grads)), tuple(map(_DTYPE_OF, grads)),
               tuple(map(_DEVICE_OF, grads)))
        plans = getattr(self._local, "pre_plans", None)
        if plans is None:
            plans = self._local.pre_plans = {}
        found = plans.get(sig)
        if found is None:
            found = _remember(plans, sig, self._new_prelude_plan(grads))
        return found

    def _new_prelude_plan(self, grads) -> tuple[list, list]:
        """New prelude (tables, views) for contiguous gradients like these: the tables of one
        caller (a thread), whose gradient column it rewrites."""
        groups: dict[tuple, list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault(self._group_key(g, g, g.dtype), []).append(i)
        tables = []
        for key, idx in groups.items():
            rows = [_prelude_row(self.columns, grads[i].numel()) for i in idx]
            tables.append((self.library(key), _table(rows), None, idx))
        return tables, _views(tables)

    @staticmethod
    def _run_prelude(plan, grad_ptrs, pre: torch.Tensor) -> None:
        tables, views = plan
        _write_column(views, _G, grad_ptrs)
        nth = torch.get_num_threads()
        for lib, table, _, idx in tables:
            lib.vega_prelude(len(idx), _ptr(table), _ptr(pre), nth)

    def check_devices(self, params) -> None:
        """ValueError where a step of ``params`` would refuse their devices (``_tables``), for
        a caller that checks several calls before the first writes; a program handed to the
        reference's operations runs on any."""
        if not (self.program.spans_group and not self.stageable):
            _refuse_off_cpu(params)

    def __call__(self, params, grads, states, steps, values, donate, pre=None):
        if self.program.spans_group:  # its reductions over the group, between stages
            kern = self if self.stageable else _reference(self.program)
            return run_staged(kern, params, grads, states, steps, values, donate, pre)
        return self._call(params, grads, states, steps, values, donate, pre)

    def _call(self, params, grads, states, steps, values, donate, pre=None):
        """The same contract as ``vega.codegen.reference.Kernel.__call__``."""
        if self.program.quant and torch.compiler.is_compiling():
            # 8-bit codes and scales, each of its dtype (codes without scales: the library
            # refuses), checked in words while traced; eagerly, the operator checks them, and
            # what it refuses, the Python path (``_tables``) names
            check_states("c", self.program, params, states)
        unique, step_index = distinct(steps)  # the distinct step counters, by identity
        if not donate:
            unique = [s.clone() for s in unique]
        hyp, hyp_index = self._hyper_tables(values)
        grads = list(grads)
        flat = list(itertools.chain.from_iterable(states))
        compiling = torch.compiler.is_compiling()
        if not donate and not compiling and _as_stored([*params, *grads, *flat]) \
                and all(map(torch.Tensor.is_contiguous, hyp)):
            # pure, out of place: the kernel reads the old tensors and writes new ones
            new_p, new_flat = list(map(torch.empty_like, params)), list(map(torch.empty_like, flat))
            mod = native.module()
            done = False
            if mod is not None:
                try:
                    self._native_call(mod, mod.step, params, grads, flat, unique, step_index,
                                      hyp, hyp_index, pre, self._geometries(params),
                                      [*new_p, *new_flat])
                    done = True
                except ValueError:
                    pass  # (the Python path says which tensor is wrong)
            if not done:
                tables = self._tables(params, grads, flat, unique, step_index, hyp, hyp_index,
                                      [*new_p, *new_flat])
                self._launch(tables, _int64s(list(map(torch.Tensor.data_ptr, unique))), pre,
                             torch.get_num_threads())
            params, flat = new_p, new_flat
        else:
            if not donate:  # pure: in place on copies
                params = [p.clone() for p in params]
                flat = [s.clone() for s in flat]
            args = (params, grads, flat, unique, step_index, hyp, hyp_index, pre)
            if compiling:  # traced as one opaque node
                self._traced_step(*args)
            else:  # eagerly, directly (the operator's dispatch costs more a tensor)
                self._step(*args)
        n = len(params)
        if not donate:  # (in place: the lists as given, which engine.run copies)
            states = [flat[k * n:(k + 1) * n] for k in range(len(states))]
        finite = record.finite_of(pre)
        return params, states, unique if len(unique) == n else \
            [unique[k] for k in step_index], finite  # (n distinct: ``step_index`` is 0..n-1)

    @property
    def stageable(self) -> bool:
        """Whether its step over shards, and over a group's reductions, runs here
        (``staged``): every reduction per tensor, of per-element values, or a program over
        a matrix view (Adafactor's) without reductions over a group. Not a step that dynamo
        traces (``staged`` calls the kernels through ctypes, which dynamo cannot trace):
        the reference's staged step runs there."""
        return (self._of_elements or self._axes and not self.program.spans_group) \
            and not torch.compiler.is_compiling()

    def staged(self, params, grads, states, steps, values, donate, pre, views):
        """``vega.codegen.reference.Kernel.staged`` in these kernels (where ``stageable``):
        each phase of per-tensor reductions (``vega_phase{k}_partial``) leaves its partial
        results (a sum of squares, a sum, a maximum) in the reduction buffer; they are
        yielded, each times its tensor's ``ShardView.weight``, as ``[(how, float64
        tensor)]`` (one sum and one max tensor of every tensor's partials, per dtype group)
        and are sent back combined over all processes, finished here (a norm's square
        root, a mean's division by the whole tensor's count) for the next phase and the
        update to read. A program over a matrix view: ``_staged_axes``."""
        _check_record(pre)
        if self._axes:
            yield from self._staged_axes(params, grads, states, steps, values, donate, pre,
                                         views)
            return
        params, flat, unique, step_index, work_p, work_s, tables, _kept = self._staged_tables(
            params, grads, states, steps, values, donate)  # (_kept: see _staged_tables)
        nth = torch.get_num_threads()
        phases = self._phases
        # each table's reduction buffer as a grid (a row per tensor), the weight of each
        # tensor's partial sums and its whole count of elements
        grids = []
        whole = views.count(None) == len(views)  # (every tensor this process's, whole)
        for _, table, red, idx in tables:
            red.zero_()  # (a skipped step's phases write nothing)
            grid = red[:len(idx) * self._nred].view(len(idx), self._nred)
            if whole:  # (a weight of None: each 1; the counts, the rows' lengths)
                grids.append((grid, None, table[:, self.columns.numel].to(torch.float64)))
                continue
            grids.append((grid,
                          torch.tensor([views[i].weight if views[i] is not None else 1.0
                                        for i in idx], dtype=torch.float64, device="cpu"),
                          torch.tensor([math.prod(views[i].full.full if views[i] is not None
                                                  else params[i].shape) for i in idx],
                                       dtype=torch.float64, device="cpu")))
        at = 0
        for k, phase in enumerate(phases):
            cols = list(range(at, at + len(phase)))
            at += len(phase)
            parts, finish = [], []
            for (lib, table, red, _), (grid, weight, count) in zip(tables, grids):
                getattr(lib, f"vega_phase{k}_partial")(table.shape[0], _ptr(table), _ptr(pre),
                                                       _ptr(red), nth)
                for c, node in zip(cols, phase):
                    parts.append(shard_part(node.op, grid[:, c], weight,
                                            self.global_keys.get(id(node))))
                    finish.append((grid, c, node.op, count))
            combined = yield parts
            for (grid, c, op, count), value in zip(finish, combined):
                grid[:, c] = finished(op, value, count)
        for lib, table, red, _ in tables:
            lib.vega_update(table.shape[0], _ptr(table), _ptr(pre), _ptr(red), nth)
        yield _staged_answer(tables[-1][0] if tables else None, params, flat, unique,
                             step_index, work_p, work_s, len(states), pre)

    def _staged_tables(self, params, grads, states, steps, values, donate, geos=None):
        """What a staged step steps: (parameters, flat states and distinct step counters,
        copies where not ``donate``; the counters' index; the parameters and states the
        kernels read and write, contiguous; the tables, ``_tables``' with ``geos``; what
        else the tables hold addresses of, which the caller keeps until its last kernel has
        run: the hyperparameters' arrays and the gradients the kernels read (those of tensor
        hyperparameters are made for the step, as are contiguous copies of gradients that
        are not: freed when this returned, the kernels read freed memory; Prodigy's step
        with ``lr=torch.tensor(1.0)`` came out NaN, and with a transposed gradient its
        moments held 1e20))."""
        unique, step_index = distinct(steps)
        if not donate:
            unique = [s.clone() for s in unique]
        hyp, hyp_index = self._hyper_tables(values)
        hyp = [h.contiguous() for h in hyp]
        flat = [s for col in states for s in col]
        if not donate:
            params, flat = [p.clone() for p in params], [s.clone() for s in flat]
        if geos is None:
            tables = self._native_tables(params, grads, flat, unique, step_index, hyp,
                                         hyp_index)
            if tables is not None:  # (every tensor as the kernels read it: no work copies)
                return params, flat, unique, step_index, params, flat, tables, (hyp, grads)
        self._refuse_writes(params, flat, unique, grads)
        work_g = readable(grads)
        work_p, work_s = readable(params), readable(flat)
        tables = self._tables(work_p, work_g, work_s, unique, step_index, hyp, hyp_index,
                              geos=geos)
        return params, flat, unique, step_index, work_p, work_s, tables, (hyp, work_g)

    def _native_tables(self, params, grads, flat, unique, step_index, hyp, hyp_index):
        """``_tables`` of a staged step in place, by the native operator (``tables``: the
        checks and rows of its ``step``), where it is built and takes these tensors; else None
        (the Python path then says which tensor is wrong, or steps contiguous copies)."""
        mod = native.module()
        if mod is None or self._axes or torch.compiler.is_compiling():
            return None
        try:
            groups = self._native_call(mod, mod.tables, params, grads, flat, unique,
                                       step_index, hyp, hyp_index, [])
        except ValueError:
            return None
        return [(self.library(tuple(key.split())), table,
                 torch.empty(max(1, len(idx) * self._nred), dtype=torch.float64,
                             device="cpu"), idx)
                for key, table, idx in groups]

    def _staged_axes(self, params, grads, states, steps, values, donate, pre, views):
        """``staged`` of a program over a matrix view (``vega.codegen.c.staged``), stage by
        stage (``vega_axes_stage<k>``, over every tensor of a dtype group). A stage leaves
        its axis reductions' results in the buffers of its materialized values, made here
        so that they outlast it; where the shard holds part of the reduced axis, their
        partial results instead (a sum, or a maximum, in float64: the ``q_`` buffers). It
        leaves its per-tensor reductions' partial results in the reduction buffer. Those a
        shard splits are yielded, each times its tensor's ``ShardView.weight``, and sent
        back combined over all processes; every one is finished here (a mean divided by the
        whole axis's or tensor's count, a norm's square root) for the later stages to read.
        ``vega_axes_write`` then writes every output from the old values."""
        axes, mats = self._axis_plan, self._mats
        geos = shard_geometries("c", params, views, mats)
        spans = {(i, j): v.spans(AXIS_REDUCTIONS[m.op][0], m.src[0].dom)
                 for i, v in enumerate(views) if v is not None
                 for j, m in enumerate(mats) if m.op in AXIS_REDUCTIONS}
        # (tensor, materialized axis reduction) -> whether other processes hold part of
        # what it reduces
        params, flat, unique, step_index, work_p, work_s, tables, _kept = self._staged_tables(
            params, grads, states, steps, values, donate, geos)  # (_kept: see _staged_tables)
        nth = torch.get_num_threads()
        slots = {id(n): q for q, n in enumerate(axes.reductions)}
        at = {id(m): j for j, m in enumerate(mats)}
        work = []  # per dtype group: its library, table, buffers, reduction grid, positions
        for lib, table, _, idx in tables:
            # every materialized value of the group in one buffer, and the partial results
            # of those a shard splits in another (zeros: a skipped step's stages write
            # nothing, and are combined); views of them only where a split one is combined
            ct = torch.float64 if params[idx[0]].dtype == torch.float64 else torch.float32
            sizes = [[max(1, math.prod(geos[i].shape(m.dom))) for m in mats] for i in idx]
            split = [[bool(spans.get((i, j))) for j in range(len(mats))] for i in idx]
            buf = torch.empty(max(1, sum(map(sum, sizes))), dtype=ct, device="cpu")
            raw = torch.zeros(max(1, sum(n for ns, ss in zip(sizes, split)
                                         for n, s in zip(ns, ss) if s)), dtype=torch.float64,
                              device="cpu")
            esize, lo, q_lo = buf.element_size(), 0, 0  # (where the next value starts)
            addresses, bufs = [], {}
            for i, ns, ss in zip(idx, sizes, split):
                row = []
                for j, (n, s) in enumerate(zip(ns, ss)):
                    row += [buf.data_ptr() + esize * lo, raw.data_ptr() + 8 * q_lo if s else 0]
                    if s:
                        bufs[i, j] = (buf[lo:lo + n], raw[q_lo:q_lo + n])
                        q_lo += n
                    lo += n
                addresses.append(row or [0])
            mtab = torch.tensor(addresses, dtype=torch.int64, device="cpu")
            red = torch.zeros((len(idx), max(1, len(slots))), dtype=torch.float64,
                              device="cpu")
            work.append((lib, table, (buf, raw, bufs), mtab, red, idx))
        for k in range(axes.nstages):
            gathers, reds = axes.stage(k)
            parts, finish = [], []
            for lib, table, (_, _, bufs), mtab, red, idx in work:
                getattr(lib, f"vega_axes_stage{k}")(table.shape[0], _ptr(table), _ptr(pre),
                                                    _ptr(red), _ptr(mtab), nth)
                for m in gathers:
                    which, how = AXIS_REDUCTIONS[m.op]
                    for i in idx:
                        if (i, at[id(m)]) in bufs:
                            out, part = bufs[i, at[id(m)]]
                            v = views[i]
                            axis_part(how, part, out, v, v.full.full[v.local.axis(which)],
                                      parts, finish)
                for m in reds:
                    tensor_parts(m, red[:, slots[id(m)]], [views[i] for i in idx],
                                 [geos[i] for i in idx], parts, finish)
            if parts:
                finish_combined(finish, (yield parts))
        for lib, table, _, mtab, red, idx in work:
            lib.vega_axes_write(table.shape[0], _ptr(table), _ptr(pre), _ptr(red), _ptr(mtab),
                                nth)
        yield _staged_answer(work[-1][0] if work else None, params, flat, unique, step_index,
                             work_p, work_s, len(states), pre)

    def _traced_step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                     pre) -> None:
        """The step as torch.compile traces it: one call of the native operator
        ``vega_c::step`` (or, where it cannot be built, of the Python custom op
        ``vega::c_step``), after the libraries it needs are built."""
        n = len(params)
        sd = [tuple(flat_states[k * n + i].dtype for k in range(len(self.program.states)))
              for i in range(n)] if self.program.states else [(p.dtype,) for p in params]
        # the operators read contiguous tensors (the eager path makes copies of others): a
        # parameter, gradient or state in another layout (channels_last, transposed, a
        # slice) is stepped as a contiguous copy, written back (strides are static in a
        # trace: the contiguous ones take no copy)
        written = [*params, *flat_states]
        works = [t if t.is_contiguous() else t.contiguous() for t in written]
        params, flat_states = works[:n], works[n:]
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        if not untraced(_native_ready, self, tuple({(p.dtype, g.dtype, d) for p, g, d in
                                                    zip(params, grads, sd)})):
            c_step(self.key, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre)
        else:
            torch.ops.vega_c.step(self.id, params, grads, flat_states, steps, step_index, hyp,
                                  hyp_index, pre, self._geometries(params), [])
        for orig, work in zip(written, works):
            if work is not orig:
                orig.copy_(work)

    def _geometries(self, params) -> list[int]:
        """Each parameter's ``_geometry``, one after another (none for an element-wise
        program)."""
        return [x for p in params for x in self._geometry(p.shape)] if self._axes else []

    def _step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre):
        """The body of ``vega::c_step``: every tensor updated in place, by the native operator
        where it is built (it checks every tensor and builds the address tables), else here.
        What the operator refuses comes here too, which says which tensor is wrong, or steps
        contiguous copies of those not stored as the kernels read them."""
        mod = native.module()
        if mod is not None:
            # (None for one row of hyperparameters for all, which the operator makes, as it
            # does the counters' index where it is ``distinct``'s range: no int a parameter)
            one_row = len(hyp) == 1 and hyp[0].dim() == 1
            try:
                self._native_call(mod, mod.step, params, grads, flat_states, steps, step_index,
                                  hyp, None if one_row else hyp_index, pre,
                                  self._geometries(params), [])
                return  # (it advanced the parameters' versions: ``_written``)
            except ValueError:
                pass
        # a parameter stored in another order than its dimensions' (channels_last), with its
        # gradient and states: stepped as its memory, where the Python path copied each to a
        # contiguous tensor and back at every step (what is refused so, the tensors as
        # given are refused for below, by name)
        aliased = memory_order(self.program, params, grads, flat_states)
        if aliased is not None:
            try:
                if mod is not None:
                    self._native_call(mod, mod.step, *aliased, steps, step_index, hyp,
                                      None if one_row else hyp_index, pre, [], [])
                else:
                    self._python_step(*aliased, steps, step_index, hyp, hyp_index, pre)
                return  # (the aliases share the parameters' version counters)
            except ValueError:
                pass
        self._python_step(params, grads, flat_states, steps, step_index, hyp, hyp_index, pre)

    def _python_step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre):
        """``_step`` in Python: the address tables of a recent call serve again when the
        parameters, states and step counters are at the same addresses with the same sizes
        and dtypes (checked: a tensor freed and another made may take its address), and the
        gradients have the same sizes and dtypes: a backward pass makes new gradients, whose
        column is rewritten (as is the hyperparameters', when a schedule gave a new table).
        Where the native operator is built, it refused these tensors: the same checks here
        say which is wrong, in the order they always have."""
        nth = torch.get_num_threads()
        found = None
        if _as_stored([*params, *grads, *flat_states]) \
                and all(map(torch.Tensor.is_contiguous, hyp)):
            if not torch.is_inference_mode_enabled() and any(map(
                    torch.Tensor.is_inference, [*params, *flat_states, *steps])):
                self._refuse_writes(params, flat_states, steps, grads)
            ptr, numel = torch.Tensor.data_ptr, torch.Tensor.numel
            fixed = list(map(ptr, params)) + list(map(ptr, flat_states)) + list(map(ptr, steps))
            meta = ([p.shape for p in params] if self._axes else list(map(numel, params)),
                    [g.shape for g in grads] if self._axes else list(map(numel, grads)),
                    # (an 8-bit state's scales of another shape, a row, are refused by
                    # ``_tables``' check, not taken for the plan of the same lengths)
                    [s.shape for s in flat_states] if self.program.quant
                    else list(map(numel, flat_states)),
                    list(map(_DTYPE_OF, [*params, *grads, *flat_states, *steps])),
                    list(step_index), list(hyp_index), [h.shape for h in hyp])
            grad_ptrs = list(map(ptr, grads))
            if 0 in grad_ptrs:  # (an empty tensor may have no address; a wrapper, none)
                self._check_readable([("gradient", grads)])
            found = (self._plan_for(fixed, meta, params, grads, flat_states, steps, step_index,
                                    hyp, hyp_index), grad_ptrs)
        if found is not None:
            plan, grad_ptrs = found
            if plan.meets(grad_ptrs):  # (a gradient in memory the step writes: named)
                self._refuse_writes(params, flat_states, steps, grads)
            plan.point(grad_ptrs, hyp, hyp_index, self.columns.hyper)
            self._launch(plan.tables, plan.step_ptrs, pre, nth)
            _written(params)
            return
        # some tensor is not contiguous, or holds its values negated (a negative bit): work
        # on contiguous copies of the values, copied back at the end (every copy held until
        # the kernel has run: the table keeps only addresses). What is to be written is
        # checked first: a copy back that failed would leave a step half made.
        self._refuse_writes(params, flat_states, steps, grads)
        self._check_readable([("parameter", params), ("gradient", grads),
                              *((f"state '{s.name}'", flat_states[k * len(params):
                                                                  (k + 1) * len(params)])
                                for k, s in enumerate(self.program.states))])
        work_p, work_g, work_s = readable(params), readable(grads), readable(flat_states)
        work_h = [h.contiguous() for h in hyp]
        tables = self._tables(work_p, work_g, work_s, steps, step_index, work_h, hyp_index)
        self._launch(tables, _int64s([s.data_ptr() for s in steps]), pre, nth)
        copy_back([*params, *flat_states], [*work_p, *work_s])
        _written(params)

    def _refuse_writes(self, params, flat_states, steps, grads=()) -> None:
        """Raise ValueError where a step in place cannot write these parameters, states (flat,
        state by state) and step counters (``vega.codegen.tensors.inplace_problem``): an
        inference tensor outside inference mode, elements at one memory location, two that
        share memory, a gradient that shares memory with one."""
        refuse_inplace("c", self.program.state_names, params, flat_states, steps, grads)

    @staticmethod
    def _check_readable(named) -> None:
        """Raise ValueError for a tensor with elements but no address: a tensor subclass
        with operations of its own (a wrapper: DTensor), whose storage the kernels cannot
        read. ``named``: (what, tensors) pairs."""
        for what, tensors in named:
            for i, t in enumerate(tensors):
                if t.numel() and t.data_ptr() == 0:
                    words = own_ops_words(t) if has_own_ops(t) else \
                        "has no storage the kernels can read (its data_ptr() is 0)"
                    raise ValueError(f"backend 'c': {what} {i} {words}; use "
                                     f"backend='reference'")

    def _plan_for(self, fixed, meta, params, grads, flat_states, steps, step_index, hyp,
                  hyp_index) -> _Plan:
        """The recent plan made for ``fixed`` and ``meta``, or a new one (its tables check
        every tensor)."""
        plan = next((p for p in self._plans if p.fixed == fixed and p.meta == meta), None)
        if plan is None:
            plan = _Plan(fixed, meta, self._tables(params, grads, flat_states, steps,
                                                   step_index, hyp, hyp_index),
                         _int64s(list(map(torch.Tensor.data_ptr, steps))),
                         [*params, *flat_states, *steps], grads)
            self._plans.insert(0, plan)  # (each group of each optimizer has one)
            del self._plans[64:]
        return plan

    def _tables(self, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                outs=None, geos=None):
        """(library, address table, reduction buffer, positions) per dtype group; checks
        every tensor. ``outs``: the tensors an out-of-place step writes (the parameters',
        then the states' as in ``flat_states``), new contiguous tensors like the inputs; by
        default the step writes in place. ``geos``: each parameter's matrix view
        (``Geometry``) where it is not its shape's own (a shard's)."""
        n = len(params)
        states = [flat_states[k * n:(k + 1) * n] for k in range(len(self.program.states))]
        check_states("c", self.program, params, states, geos)
        check_codes("c", self.program, states)
        if list(map(_SHAPE_OF, params)) != list(map(_SHAPE_OF, grads)):
            raise ValueError("backend 'c': a gradient's shape differs from its parameter's")
        _refuse_off_cpu(params)  # (before their counters, which live where they do)
        for t in steps:
            if t.dtype != torch.int32 or t.dim() != 0 or not t.is_cpu:
                raise ValueError(f"backend 'c': a step counter must be a 0-d int32 tensor on "
                                 f"the CPU, got shape {tuple(t.shape)} and dtype {t.dtype} on "
                                 f"{t.device}")
        for col in states:
            bad = next((x for x in col if not x.is_cpu), None)
            if bad is not None:
                raise ValueError(f"backend 'c' runs on CPU tensors, got a state on {bad.device}")
        groups = self._dtype_groups(params, grads, states)
        ptr = torch.Tensor.data_ptr
        steps_at, hyp_at = list(map(ptr, steps)), _row_addresses(hyp)
        in_place = outs is None
        outs = [*params, *flat_states] if outs is None else outs
        cols = self.columns
        columns = cols.arrange(  # (each a list of columns, one value per tensor)
            numel=[list(map(torch.Tensor.numel, params))], p=[list(map(ptr, params))],
            g=[list(map(ptr, grads))], state=[list(map(ptr, col)) for col in states],
            step=[[steps_at[k] for k in step_index]], hyper=[[hyp_at[r] for r in hyp_index]],
            geo=np.array([self._geometry(p.shape) for p in params] if geos is None else
                         [self._geometry(geo.full, (geo.r, geo.c)) for geo in geos],
                         dtype=np.int64).reshape(n, cols.ngeo).T,
            p_out=[list(map(ptr, outs[:n]))],
            state_out=[list(map(ptr, outs[k * n:(k + 1) * n]))
                       for k in range(1, cols.nstate + 1)])
        every = np.array(columns, dtype=np.int64).reshape(len(columns), n).T
        # every tensor read has an address (a wrapper subclass has none); those written in
        # place share no memory (each is contiguous here: its span is its memory)
        read = every[:, cols.p:cols.step]  # p, g, states
        if n and not read.all():
            self._check_readable([("parameter", params), ("gradient", grads),
                                  *((f"state '{s.name}'", col)
                                    for s, col in zip(self.program.states, states))])
        # and the counters, the hyperparameter rows and the outputs a step out of place writes
        # (made by the step: under a mode such as FakeTensorMode, tensors without memory)
        if n and not (every[:, cols.step:cols.hyper + 1].all() and
                      (in_place or every[:, cols.p_out:].all())):
            self._check_readable([("step counter", steps), ("hyperparameter array", hyp),
                                  *([] if in_place else [("output", outs)])])
        if in_place:
            written = [*params, *flat_states, *steps]
            lo = np.array([*columns[cols.p], *(a for col in columns[cols.state:cols.step]
                                               for a in col),
                           *steps_at], dtype=np.int64)
            hi = lo + np.array([t.numel() * t.element_size() for t in written], dtype=np.int64)
            pair = shared_pair(written, lo, hi)
            if pair is not None:
                named = roles(self.program.state_names, n, len(steps))
                raise ValueError(f"backend 'c': {named[pair[0]]} "
                                 f"{pair[2].format(other=named[pair[1]])}")
        out = []
        for key, idx in groups:
            table = _from_numpy(every if len(idx) == n else every[idx])
            red = torch.empty(max(1, len(idx) * self._nred), dtype=torch.float64,
                              device="cpu")
            out.append((self.library(key), table, red, idx))
        return out

    def _dtype_groups(self, params, grads, states) -> list[tuple[tuple[str, str, str], list]]:
        """The (parameter, gradient, state) dtypes and the positions of the tensors of
        each, checked."""
        n = len(params)
        pd, gd = list(map(_DTYPE_OF, params)), list(map(_DTYPE_OF, grads))
        sd = [list(map(_DTYPE_OF, col)) for col in states]
        if any(a != sd[0] for a in sd[1:]):  # states of several dtypes: each its own
            sd = list(zip(*sd))
        else:
            sd = sd[0] if sd else pd
        if n and pd.count(pd[0]) == n and gd.count(gd[0]) == n and sd.count(sd[0]) == n:
            # one dtype group (the common case): the devices checked in one pass
            if all(map(_IS_CPU, params)) and all(map(_IS_CPU, grads)):
                return [(self._group_key(params[0], grads[0], sd[0]), list(range(n)))]
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            groups.setdefault(self._group_key(p, g, sd[i]), []).append(i)
        return list(groups.items())

    def _geometry(self, shape, axes=None) -> tuple[int, ...]:
        """The integers a table row of a program over a matrix view ends with; ``axes``:
        its (row, column) axes where they are not ``shape``'s own (a shard's view)."""
        if not self._axes:
            return ()
        if torch.compiler.is_compiling():  # not the cache: a traced read of it guards on its
            # contents, and a first compiled step that filled it would then recompile
            return (*axis_geometry(shape, axes), *line_lengths(shape, axes))
        key = shape if axes is None else (shape, axes)
        found = _GEOMETRY.get(key)
        if found is None:
            if len(_GEOMETRY) > 4096:
                _GEOMETRY.clear()
            found = _GEOMETRY[key] = (*axis_geometry(shape, axes), *line_lengths(shape, axes))
        return found

    def _launch(self, tables, step_ptrs, pre, nth):
        """Every phase and the update of each dtype group, then the step counters (at the
        addresses ``step_ptrs``)."""
        _check_record(pre)
        for lib, table, red, _ in tables:
            n = table.shape[0]
            if self._axes:
                lib.vega_axes_step(n, _ptr(table), _ptr(pre), nth)
                continue
            if self._nphases and _fused_fits(table, nth):  # (each tensor's phases, update)
                lib.vega_fused(n, _ptr(table), _ptr(pre), _ptr(red), nth)
                continue
            for k in range(self._nphases):
                getattr(lib, f"vega_phase{k}")(n, _ptr(table), _ptr(pre), _ptr(red), nth)
            lib.vega_update(n, _ptr(table), _ptr(pre), _ptr(red), nth)
        if tables:
            tables[-1][0].vega_advance(len(step_ptrs), _ptr(step_ptrs), _ptr(pre))

    def _hyper_tables(self, values):
        """float64 arrays of hyperparameter values (a row each, or a table of rows), and the
        row of each tensor, counting rows through the arrays in order: one array per
        distinct values dict, or the table of ``HyperRows``."""
        if isinstance(values, HyperRows):  # (on the counters' device: the CPU, as checked)
            return [values.table.cpu()], values.index
        uniq, index = distinct(values)
        return [self._hyper_array(vals) for vals in uniq], index

    def _hyper_array(self, vals) -> torch.Tensor:
        parts = [vals[n] for n in self.program.float_hypers]
        if not _NUMBERS.issuperset(map(type, parts)) and \
                any(isinstance(v, torch.Tensor) for v in parts):  # (a float as it is)
            return torch.stack([v.detach().to(device="cpu", dtype=torch.float64).reshape(())
                                if isinstance(v, torch.Tensor) else
                                torch.tensor(float(v), dtype=torch.float64, device="cpu")
                                for v in parts])
        numbers = tuple(map(float, parts)) or (0.0,)
        if torch.compiler.is_compiling():  # a graph constant: a cache filled while tracing
            return torch.tensor(numbers, dtype=torch.float64)  # would fail the next guards
        # plain numbers: one array per distinct setting, kept across steps; keyed by their
        # bits (the array's bytes), as -0.0 == 0.0 (and x / -0.0 is not x / 0.0). Room for
        # a group's each of hundreds of groups (layer-wise rates): where a step's settings
        # outnumbered it, every step emptied it and made every array again
        key = _BITS[len(numbers)].pack(*numbers) if len(numbers) < len(_BITS) else \
            struct.pack(f"<{len(numbers)}d", *numbers)
        arr = self._hyp_cache.get(key)
        if arr is None:
            # on the CPU whatever the default device (``with torch.device("meta")``); kept
            # only where it is a plain tensor with memory: one made under a mode or transform
            # (functionalize's wrapper, a FakeTensor) has none, and every later step of this
            # kernel, of any optimizer, read its hyperparameters at address 0
            arr = torch.tensor(numbers, dtype=torch.float64, device="cpu")
            if _keepable(arr):
                if len(self._hyp_cache) >= _HYP_CACHE:
                    self._hyp_cache.clear()
                self._hyp_cache[key] = arr
        return arr


class _Plan:
    """The address tables of one call of a kernel, for the next calls with the same
    tensors (``Kernel._step``): ``fixed``, the addresses of the parameters, states and
    step counters; ``meta``, their sizes and dtypes (and the gradients'), and the step
    counter and hyperparameter row of each tensor."""

    def __init__(self, fixed, meta, tables, step_ptrs, written=(), grads=()):
        self.fixed, self.meta, self.tables, self.step_ptrs = fixed, meta, tables, step_ptrs
        self.hyp_ptrs: list[int] = []
        self.hyp_index: list[int] = []
        self.views = _views(tables)
        # the written tensors' spans by their starts, and how far those so far reach
        lo = np.array([t.data_ptr() for t in written], dtype=np.int64)
        hi = lo + np.array([t.numel() * t.element_size() for t in written], dtype=np.int64)
        _, self.starts, self.reach = sorted_spans(lo, hi)
        # the gradients' bytes (their sizes and dtypes are the plan's: ``meta``)
        self.grad_bytes = np.array([g.numel() * g.element_size() for g in grads],
                                   dtype=np.int64)

    def meets(self, grad_ptrs: list[int]) -> bool:
        """Whether a gradient's span meets a written tensor's (a new gradient each step, at
        ``grad_ptrs``; contiguous, as the plan's step reads them)."""
        if not len(self.starts) or not len(grad_ptrs):
            return False
        glo = np.array(grad_ptrs, dtype=np.int64)
        first, last = meeting(self.starts, self.reach, glo, glo + self.grad_bytes)
        return bool((last > first).any())

    def point(self, grad_ptrs: list[int], hyp, hyp_index, hyp_col: int) -> None:
        """Write the gradients' addresses, and the hyperparameter rows' where they moved or
        the tensors read other rows (a direct step's schedule table after a plain one)."""
        _write_column(self.views, _G, grad_ptrs)
        hyp_ptrs = [h.data_ptr() for h in hyp]
        if hyp_ptrs != self.hyp_ptrs or (hyp_index is not self.hyp_index
                                         and hyp_index != self.hyp_index):
            if 0 in hyp_ptrs:  # (made under a mode: no memory; named)
                Kernel._check_readable([("hyperparameter array", hyp)])
            at = _row_addresses(hyp)
            _write_column(self.views, hyp_col, [at[r] for r in hyp_index])
            self.hyp_ptrs, self.hyp_index = hyp_ptrs, hyp_index


FUSED_MAX = 65536  # vega_fused steps tables of tensors no longer than this


def _fused_fits(table: torch.Tensor, nth: int) -> bool:
    """Whether vega_fused suits an address table: every tensor has at most FUSED_MAX
    elements, and there are enough of them that ``nth`` threads taking whole tensors each
    get about as much work (at least four of the largest's worth each)."""
    sizes = table.numpy()[:, 0]
    largest = int(sizes.max(initial=0))
    return largest <= FUSED_MAX and int(sizes.sum()) >= 4 * max(nth, 1) * largest


def _views(tables) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each dtype group's address table as a numpy array (a view), and its positions."""
    return [(table.numpy(), np.asarray(idx, dtype=np.int64)) for _, table, _, idx in tables]


_G = record.table_columns(0).g  # the gradient's column (before any column per state)


def _prelude_row(columns: record.Columns, numel: int) -> list[int]:
    """A table row for the prelude: the gradient's size, its address written at each call."""
    row = [0] * columns.width
    row[columns.numel] = numel
    return row


def _write_column(views, col: int, values: list[int]) -> None:
    """Column ``col`` of every table: ``values`` (one per tensor) at each row's position."""
    values = np.asarray(values, dtype=np.int64)
    for view, idx in views:
        view[:, col] = values[idx]


def _row_addresses(hyp: list[torch.Tensor]) -> list[int]:
    """The address of each row of these contiguous float64 arrays (a 1-d array is a row)."""
    out = []
    for h in hyp:
        if h.dim() == 1:
            out.append(h.data_ptr())
        else:
            out += range(h.data_ptr(), h.data_ptr() + h.numel() * 8, h.shape[1] * 8)
    return out


def _keepable(t: torch.Tensor) -> bool:
    """Whether a tensor a kernel made for itself may serve later calls: a plain CPU tensor
    with memory of its own, not one a mode or transform made in its place (a FakeTensor, a
    functionalized or batched wrapper, whose address is 0 or refused)."""
    return type(t) is torch.Tensor and t.is_cpu and not wrapped(t) and t.data_ptr() != 0
    # (a functionalized tensor's address is 0: asked before, a batched one's is refused)


def _remember(cache: dict, key, value, size: int = 8):
    """``cache[key] = value``, dropping the oldest entry beyond ``size``; the value."""
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def _int64s(values: list) -> torch.Tensor:
    """Addresses, kept across calls and rewritten in place (a table's gradient column): a
    normal tensor even when made under torch.inference_mode (an inference tensor could
    not be written outside it)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.int64, device="cpu")


def _table(rows: list[list[int]]) -> torch.Tensor:
    return _int64s(rows).reshape(len(rows), -1)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """An int64 table as a contiguous tensor (a normal one, as ``_int64s``)."""
    with torch.inference_mode(False):
        return torch.from_numpy(np.ascontiguousarray(a))


def _as_stored(tensors) -> bool:
    """Whether a kernel may read (and write) each of these tensors at its address: each is
    contiguous and holds its values as they are (no negative bit: a real view of a complex
    tensor's conjugate, ``x.conj().imag``, stores them negated)."""
    return all(map(torch.Tensor.is_contiguous, tensors)) \
        and not any(map(torch.Tensor.is_neg, tensors))


def _staged_answer(lib, params, flat, unique, step_index, work_p, work_s, nstates: int,
                   pre) -> Done:
    """The end of a staged step (``Kernel.staged``), its updates written: the step counters
    advanced (by ``lib``, the last dtype group's library; none without tensors), the work
    copies written back, and the step's answer."""
    if lib is not None:
        step_ptrs = _int64s([s.data_ptr() for s in unique])  # (alive through the call)
        lib.vega_advance(len(unique), _ptr(step_ptrs), _ptr(pre))
    if work_p is not params or work_s is not flat:  # (the same lists: no copies made)
        copy_back([*params, *flat], [*work_p, *work_s])
    _written(params)
    n = len(params)
    return Done((params, [flat[k * n:(k + 1) * n] for k in range(nstates)],
                 unique if len(unique) == n else [unique[k] for k in step_index],
                 record.finite_of(pre)))  # (n distinct: ``step_index`` is 0..n-1)


def _written(params) -> None:
    """Tell autograd that a step in place wrote these parameters (their version counters
    advance, as an in-place torch operation's would): a graph that saved one of them (``loss
    = (w * w).sum()``) then refuses to run backward through its old value, as after
    torch.optim's step. The parameters only: they are what graphs save, and advancing the
    states' and step counters' versions too costs about a tenth of a step over a thousand
    small tensors (the counters of tensors the kernel has just evicted from the cache)."""
    if not torch.compiler.is_compiling():
        increment_version(params)


# key -> a weak reference to the Kernel, for the custom ops: a kernel is released with its
# program (a kernel a torch.compile'd step uses is held by ``vega.tracing``)
_KERNELS: dict[str, weakref.ref] = {}
_SERIAL = itertools.count()
# the most arrays of plain hyperparameter values a kernel keeps (``_hyper_array``)
_HYP_CACHE = 4096
# the types of a hyperparameter value taken as a number (``_hyper_array``), and the packing of
# n float64 values into the bytes that key their array
_NUMBERS = frozenset({float, int})
_BITS = [struct.Struct(f"<{n}d") for n in range(33)]
_DTYPE_OF = operator.attrgetter("dtype")
_DEVICE_OF = operator.attrgetter("device")
_SHAPE_OF = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")
_GEOMETRY: dict[tuple, tuple[int, ...]] = {}  # shape (or shape, axes) -> Kernel._geometry


# a state's domain -> its length in a geometry row (4: one number, a 0-d tensor)
_DOMS = {"rc": 0, "r": 1, "c": 2, "": 3, SCALAR_STATE: 4, QBLOCK: 5}  # 5: one a block


def _native_ready(kernel: Kernel, triples) -> bool:
    """Whether the native operator is built (waiting for it), with ``kernel`` and its
    libraries for these (parameter, gradient, state) dtype triples registered: what a traced
    call of the operator needs, since it cannot build them."""
    mod = native.module(wait=True)
    if mod is None:
        return False
    for triple in triples:
        p, g, s = triple
        s = s if isinstance(s, tuple) else (s,)
        if any(d not in _DTYPES for d in (p, g, *s)):
            raise ValueError(f"backend 'c' does not support tensors of dtypes {triple}")
        kernel.library((_DTYPES[p], _DTYPES[g], state_key([_DTYPES[d] for d in s], "")))
    kernel._registered(mod)
    return True


def _reference(program: Program):
    from vega import codegen
    return codegen.kernel("reference", program)


def kernel_of(key: str) -> Kernel:
    """The live kernel named ``key``."""
    ref = _KERNELS.get(key)
    found = ref() if ref is not None else None
    if found is None:
        raise RuntimeError(f"vega: the C kernel {key!r} was released with its optimizer")
    return found


@torch.library.custom_op("vega::c_prelude", mutates_args=("pre",), device_types="cpu")
def c_prelude(key: str, grads: list[torch.Tensor], pre: torch.Tensor) -> None:
    """Add the sum of squares and the non-finite count of ``grads`` into ``pre``."""
    kernel_of(key)._prelude(grads, pre)


@c_prelude.register_fake
def _(key, grads, pre):
    return None


@torch.library.custom_op("vega::c_step", mutates_args=("params", "states", "steps"),
                         device_types="cpu")
def c_step(key: str, params: list[torch.Tensor], grads: list[torch.Tensor],
           states: list[torch.Tensor], steps: list[torch.Tensor], step_index: list[int],
           hypers: list[torch.Tensor], hyper_index: list[int],
           pre: torch.Tensor | None) -> None:
    """One step of the kernel named ``key``, in place. ``states`` is flat, state by state;
    parameter ``i`` counts on ``steps[step_index[i]]`` with ``hypers[hyper_index[i]]``."""
    kernel_of(key)._step(params, grads, states, steps, step_index, hypers, hyper_index, pre)


@c_step.register_fake
def _(key, params, grads, states, steps, step_index, hypers, hyper_index, pre):
    return None


def available() -> bool:
    return cbuild.available()

