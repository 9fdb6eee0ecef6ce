"""What every backend shares: a program laid out as a list of lines, and a renderer.

``linearize`` orders a program's DAG into two phases -- the scalar phase (one
value per step: hyperparameters, ``t`` and what is computed from them, hoisted
out of the per-element loop) and the element phase (per element, with any
per-tensor reductions in it) -- and names every value. A backend subclasses
``Renderer`` and overrides only the ops it spells differently (tinygrad's
``code_for_op`` table).
"""
from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import torch

from vega.codegen.quant import scale_shape
from vega.codegen.tensors import native_passes
from vega.dsl.check import matrix_axes
from vega.dsl.ir import (AXIS_REDUCTIONS, DOMAINS, LEAVES, QBLOCK, REDUCTIONS, SCALAR_STATE,
                         Kind, Node, Op, Program, walk)


@dataclass(frozen=True)
class Line:
    var: str
    node: Node


@dataclass(frozen=True)
class Linear:
    program: Program
    hypers: tuple[str, ...]  # float hyperparameters, in header order (scalar-phase inputs)
    scalar_lines: tuple[Line, ...]
    scalar_outputs: tuple[str, ...]  # scalar values the element phase reads
    element_lines: tuple[Line, ...]
    outputs: tuple[tuple[str, Node], ...]  # ("p", node), (state name, node), ...
    names: dict[int, str]  # id(node) -> variable

    def ref(self, node: Node) -> str:
        return self.names[id(node)]


# Names, by construction rather than by a list of names to avoid: every identifier the
# backends make from a spec's names lives in a namespace of its own, which no other
# identifier of the generated code enters, so that no spec name can meet a name a
# backend uses for itself (a keyword of the target language, a library's function or
# macro, a pointer, a table column, a helper) nor another spec name. A value of a
# program is named by ``linearize``:
#
# - ``p``, ``g``, ``t``: the builtins (no spec may declare these names);
# - ``h_<name>``: a hyperparameter, ``s_<name>``: a state's old value;
# - ``v_<name>``: a value the spec names (deduplicated: ``v_u``, ``v_u_1``, ...), and
#   ``v_<k>`` (a digit: no spec name starts with one) a value it does not.
#
# In the reference's and the Triton kernels' Python, no other identifier is p, g or t
# or begins with ``h_``, ``s_``, ``v_``, ``p_``, ``g_`` or ``t_`` (a name made from a
# value's for the same value elsewhere, Triton's ``p_k``, begins with it); a name made
# from a value's for something else (an address, a table column) is a prefix of its own
# and the value's name (Triton's ``ptr_s_mu``): distinct prefixes, distinct names. C's
# identifiers for values are ``v_``, ``d_`` or ``m_`` and the value's name, and no other
# begins so. The optimizer's name is never an identifier of its own: Triton's kernels
# are ``vega_<name>_<what>``.
HYPER_PREFIX, STATE_PREFIX, VALUE_PREFIX = "h_", "s_", "v_"


def hyper_var(name: str) -> str:
    """The identifier of float hyperparameter ``name`` in generated code."""
    return HYPER_PREFIX + name


def state_var(name: str) -> str:
    """The identifier of the old value of state ``name`` in generated code."""
    return STATE_PREFIX + name


def linearize(program: Program) -> Linear:
    roots = [node for _, node in program.updates]
    order = walk(roots)
    names: dict[int, str] = {}
    taken: set[str] = set()
    # base -> the suffix to try first: each below it is taken already (and stays so), so
    # that a name assigned n times is named in time linear in n, not quadratic
    tried: dict[str, int] = {}

    def fresh(base: str) -> str:
        if base not in taken:
            taken.add(base)
            return base
        i = tried.get(base, 1)
        while f"{base}_{i}" in taken:
            i += 1
        tried[base] = i + 1
        taken.add(f"{base}_{i}")
        return f"{base}_{i}"

    leaf_names = {Op.PARAM: "p", Op.GRAD: "g", Op.T: "t"}
    scalar_lines, element_lines = [], []
    for node in order:
        if node.op is Op.CONST:
            continue
        if node.op in LEAVES:
            names[id(node)] = hyper_var(node.arg) if node.op is Op.HYPER else \
                state_var(node.arg) if node.op is Op.STATE else leaf_names[node.op]
            continue
        scalar = node.kind <= Kind.SCALAR
        lines = scalar_lines if scalar else element_lines
        var = fresh(VALUE_PREFIX + (node.name or str(len(scalar_lines) + len(element_lines))))
        names[id(node)] = var
        lines.append(Line(var, node))
    needed = []
    for line in element_lines:
        for s in line.node.src:
            if s.kind <= Kind.SCALAR and s.op is not Op.CONST and id(s) in names:
                needed.append(names[id(s)])
    for _, node in program.updates:
        if node.kind <= Kind.SCALAR and node.op is not Op.CONST:
            needed.append(names[id(node)])
    scalar_outputs = tuple(dict.fromkeys(needed))
    return Linear(program, tuple(hyper_var(h) for h in program.float_hypers),
                  tuple(scalar_lines), scalar_outputs, tuple(element_lines), program.updates,
                  names)


class Renderer(ABC):
    """Renders one IR node as an expression of its operands' names."""

    infix = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.LT: "<", Op.LE: "<=",
             Op.GT: ">", Op.GE: ">=", Op.EQ: "==", Op.NE: "!="}
    code_for_op: dict = {}

    @abstractmethod
    def const(self, value) -> str:
        """A literal in the target language."""

    def operand(self, linear: Linear, node: Node, phase: str = "element") -> str:
        return self.const(node.arg) if node.op is Op.CONST else linear.ref(node)

    def expr(self, linear: Linear, node: Node, phase: str) -> str:
        args = [self.operand(linear, s, phase) for s in node.src]
        if node.op in self.code_for_op:
            return self.code_for_op[node.op](self, node, phase, *args)
        if node.op in self.infix:
            return f"{args[0]} {self.infix[node.op]} {args[1]}"
        raise KeyError(f"{type(self).__name__} cannot render {node.op}")


def leveled(program: Program, ops) -> tuple[dict[int, int], list[list[Node]]]:
    """(the level of each node, by id; the nodes of ``ops`` at each level): a node of
    ``ops`` sits at the level of its arguments and its value at the next one, so that it
    runs after those its argument uses."""
    level: dict[int, int] = {}
    phases: list[list[Node]] = []
    for node in walk(node for _, node in program.updates):
        lv = max((level[id(s)] for s in node.src), default=0)
        if node.op in ops:
            while len(phases) <= lv:
                phases.append([])
            phases[lv].append(node)
            lv += 1
        level[id(node)] = lv
    return level, phases


def reduction_phases(program: Program) -> list[list[Node]]:
    """The per-tensor reductions of each phase: a reduction runs after those its argument
    uses (``leveled``)."""
    return leveled(program, REDUCTIONS)[1]


def of_elements(phases: list[list[Node]]) -> bool:
    """Whether every per-tensor reduction of ``phases`` (``reduction_phases``) reduces values
    of one per element: what the C and Triton kernels' phases compute, so what their step
    over shards (``staged``) runs there."""
    return all(n.src[0].kind == Kind.ELEMENT and n.src[0].dom == "rc"
               for phase in phases for n in phase)


def is_schedule(v) -> bool:
    """Whether a hyperparameter value is a schedule (a callable of the step counter)."""
    return callable(v) and not isinstance(v, torch.Tensor)


def distinct(items: list) -> tuple[list, Sequence[int]]:
    """The distinct objects of ``items`` (by identity) and the position of each item among
    them: ``range(len(items))`` where each is its own (a class's step counters: no int made
    an item), else a list. Under torch.compile by ``is`` (``id()`` would guard on every
    object's address), a list."""
    uniq, index = [], []
    if torch.compiler.is_compiling():
        for x in items:
            j = next((k for k, u in enumerate(uniq) if u is x), len(uniq))
            if j == len(uniq):
                uniq.append(x)
            index.append(j)
        return uniq, index
    if not items:
        return [], []
    mod = native_passes()  # (one pass of 1-20 ns an item, where those below take 30-130 ns)
    if mod is not None:
        return mod.distinct(items)
    if all(map(operator.is_, items, repeat(items[0]))):  # all one (a group's hyperparameters)
        return [items[0]], [0] * len(items)
    if len(set(map(id, items))) == len(items):  # each its own (a class's step counters)
        return list(items), range(len(items))
    at: dict[int, int] = {}
    for x, k in zip(items, map(id, items)):
        if k not in at:
            at[k] = len(uniq)
            uniq.append(x)
        index.append(at[k])
    return uniq, index


class Geometry:
    """The matrix view of one tensor shape: which axes are its rows and columns, and the
    shape of a value of each domain (``vega.dsl.ir``)."""

    def __init__(self, shape, axes: tuple[int | None, int | None] | None = None):
        self.full = tuple(shape)
        # ``axes``: the (row, column) axes, where they are not this shape's own: a shard's
        # are those of the whole tensor it is part of
        self.r, self.c = matrix_axes(self.full) if axes is None else axes
        self._shapes = {d: tuple(n for a, n in enumerate(self.full) if self.keeps(d, a))
                        for d in ("rc", "r", "c", "")}

    def keeps(self, dom: str, a: int) -> bool:
        return not ((a == self.r and "r" not in dom) or (a == self.c and "c" not in dom))

    def shape(self, dom: str) -> tuple[int, ...]:
        return self._shapes[dom]

    def axis(self, which: str) -> int | None:
        return self.r if which == "r" else self.c

    def position(self, axis: int, dom: str) -> int:
        """Where ``axis`` sits in the shape of a value of ``dom``."""
        return sum(self.keeps(dom, a) for a in range(axis))


_GEOMETRIES: dict[tuple[int, ...], Geometry] = {}


def geometry(shape) -> Geometry:
    """The ``Geometry`` of ``shape``, kept for the next steps (not while dynamo traces: a
    traced lookup would guard on what the cache holds, and recompile once it holds it)."""
    key = tuple(shape)
    if torch.compiler.is_compiling():
        return Geometry(key)
    found = _GEOMETRIES.get(key)
    if found is None:
        if len(_GEOMETRIES) > 4096:
            _GEOMETRIES.clear()
        found = _GEOMETRIES[key] = Geometry(key)
    return found


@dataclass(frozen=True)
class ShardView:
    """Where one tensor's local values lie in a tensor spread over processes (a DTensor's
    shard): the matrix view of the local values (``local``, with the whole tensor's row and
    column axes), that of the whole tensor (``full``), the axes of the whole tensor that
    the local values hold only part of (``split``), and the weight of this copy's partial
    sums (1 / the number of processes that hold the same values)."""
    local: Geometry
    full: Geometry
    split: frozenset[int]
    weight: float = 1.0

    def splits(self, dom: str) -> bool:
        """Whether a value of domain ``dom`` (``vega.dsl.ir``) holds part of a split axis."""
        return any(self.local.keeps(dom, a) for a in self.split)

    def spans(self, which: str | None, dom: str) -> bool:
        """Whether a reduction of a value of domain ``dom`` over all its values (``which``
        None) or along its row or column axis (``which``: "r", "c") reads values that other
        processes hold."""
        if which is None:
            return self.splits(dom)
        return self.local.axis(which) in self.split


def split_result(op: Op, view: ShardView) -> ValueError:
    """The error of a reduction along an axis whose result a shard splits too."""
    return ValueError(
        f"a {op.value} of a tensor of shape {view.full.full} split over processes along "
        f"axes {sorted(view.split)}: its result is split too, which vega's reductions "
        "across processes do not combine; shard such a tensor along one axis")


def check_views(backend: str, params, views) -> None:
    """Raise ValueError where a parameter's ``ShardView`` describes other local values than
    the parameter holds: a kernel sized from the view would read and write past them."""
    for i, (p, v) in enumerate(zip(params, views)):
        if v is not None and tuple(v.local.full) != tuple(p.shape):
            raise ValueError(f"backend '{backend}': parameter {i} has shape {tuple(p.shape)}, "
                             f"but its shard's view holds local values of shape "
                             f"{tuple(v.local.full)}")


def refuse_split_results(nodes, views) -> None:
    """Raise ``split_result`` where a reduction along an axis (of ``nodes``, a program's)
    reads values other processes hold (a shard splits the axis it runs along) and its
    result would be split too (the shard splits the other axis as well)."""
    for v in views:
        if v is None:
            continue
        for m in nodes:
            if m.op in AXIS_REDUCTIONS and v.spans(AXIS_REDUCTIONS[m.op][0], m.src[0].dom) \
                    and v.splits(m.dom):
                raise split_result(m.op, v)


def shard_geometries(backend: str, params, views, nodes) -> list[Geometry]:
    """Each parameter's matrix view in a compiled kernel's step over shards of a program
    over a matrix view (a shard's keeps the whole tensor's row and column axes:
    ``ShardView.local``), after ``check_views`` and ``refuse_split_results`` of the
    program's ``nodes`` (its axis reductions among them)."""
    check_views(backend, params, views)
    refuse_split_results(nodes, views)
    return [v.local if v is not None else geometry(p.shape) for v, p in zip(views, params)]


@dataclass(frozen=True)
class HyperRows:
    """Each tensor's float hyperparameters, evaluated: tensor ``i`` reads row ``index[i]``
    of ``table`` (float64, a column per name of ``names``; one column of zeros when there
    are none). What ``vega.runtime.engine.run`` gives a kernel when a value is a schedule:
    one row per distinct (values, step counter)."""
    names: tuple[str, ...]
    table: torch.Tensor
    index: list[int]

    def dicts(self) -> list[dict]:
        """The values of each tensor as a dict of 0-d float64 tensors (views of the table)."""
        rows = [dict(zip(self.names, row.unbind())) for row in self.table.unbind()]
        return [rows[r] for r in self.index]


def state_shape(p: torch.Tensor, dom: str) -> tuple[int, ...]:
    """The shape of a state of domain ``dom`` (``vega.dsl.ir``) for parameter ``p``."""
    if dom == SCALAR_STATE:
        return ()
    if dom == QBLOCK:  # an 8-bit state's scales: one per block (vega.codegen.quant)
        return scale_shape(p)
    return tuple(p.shape) if dom == "rc" else geometry(p.shape).shape(dom)


def check_codes(backend: str, program: Program, states) -> None:
    """Raise ValueError for a state of 8-bit codes (torch.uint8) that ``program`` does not
    read as codes: its scales are missing. (The compiled kernels refuse to be built for
    one; the reference and the C kernels' Python path call this.)"""
    for st, col in zip(program.states, states):
        if st.name not in program.quant and any(x.dtype == torch.uint8 for x in col):
            raise codes_without_scales(backend, st.name)


def check_dtypes(backend: str, program: Program, params, grads, states) -> None:
    """Raise ValueError for a parameter, gradient or state tensor whose dtype is not a
    floating-point (or complex) one, 8-bit codes aside (a state ``program`` keeps in 8
    bits): a step computes in floats, and its values written into an integer or bool tensor
    would be truncated without a word. (The compiled kernels refuse such dtypes too.)"""
    def bad(tensors) -> int | None:
        dtypes = {x.dtype for x in tensors if x is not None}
        if all(d.is_floating_point or d.is_complex for d in dtypes):
            return None
        return next(i for i, x in enumerate(tensors) if x is not None
                    and not (x.dtype.is_floating_point or x.dtype.is_complex))
    for what, tensors in (("parameters", params), ("gradients", grads)):
        i = bad(tensors)
        if i is not None:
            raise ValueError(f"backend '{backend}' does not step {what} of dtype "
                             f"{tensors[i].dtype}: only floating-point (or complex) ones")
    for st, col in zip(program.states, states):
        i = None if st.name in program.quant else bad(col)
        if i is not None:
            raise ValueError(f"backend '{backend}': state '{st.name}' has a tensor of dtype "
                             f"{col[i].dtype}; a step keeps its states in floating-point (or "
                             f"complex) tensors, or in 8 bits (state_dtype=torch.uint8)")
    check_complexness(f"backend '{backend}'", program, params, states, every=False)


def check_complexness(who: str, program: Program, params, states, every: bool = True) -> None:
    """Raise ValueError (``who``: the caller, for the message) for a state whose complexness
    is not its parameter's: one shaped like its parameter is complex where the parameter is
    (a real one of a complex parameter, its real view say, would pass as the parameter's
    real view does), one of one number (or 8-bit scales) real, for any parameter (the
    imaginary part of a complex one would be dropped). ``every``: every state (a step over
    complex parameters, before their real views); else only the states holding a complex
    tensor (a backend's check, whose parameters are real views where they were complex).
    Objects that are not tensors are left to the checks of what a step writes."""
    for st, col in zip(program.states, states):
        if not every and not any(isinstance(x, torch.Tensor) and x.is_complex() for x in col):
            continue
        i = next((i for i, (p, x) in enumerate(zip(params, col)) if isinstance(x, torch.Tensor)
                  and x.is_complex() != (st.dom == "rc" and p.is_complex())), None)
        if i is not None:
            raise ValueError(f"{who}: state '{st.name}' of parameter {i} is of dtype "
                             f"{col[i].dtype}, but its parameter is of dtype {params[i].dtype}: "
                             + like_words(st.dom, params[i]))


def like_words(dom: str, p: torch.Tensor) -> str:
    """What a state of domain ``dom`` of parameter ``p`` must be, complex or real."""
    if dom != "rc":
        return "a state of one number is real"
    return ("complex like it" if p.is_complex() else "real like it") + " where shaped like it"


def check_counters(backend: str, steps) -> None:
    """Raise ValueError for a step counter that is not one number (a 0-d tensor): the
    reference reads one of any dtype (the compiled kernels an int32's), but one of shape (1,)
    set by hand made the values it scales tensors of that shape, which a state of one number
    cannot take (Prodigy's d: torch's raw error, midway through a step)."""
    i = next((i for i, t in enumerate(steps) if isinstance(t, torch.Tensor) and t.dim() != 0),
             None)  # (one that is not a tensor: named with what a step writes)
    if i is not None:
        raise ValueError(f"backend '{backend}': a step counter must be a 0-d tensor (one "
                         f"number), got shape {tuple(steps[i].shape)} for parameter {i}")


def codes_without_scales(backend: str, name: str) -> ValueError:
    return ValueError(f"backend '{backend}': state '{name}' holds 8-bit codes (torch.uint8) "
                      f"without their scales '{name}_absmax': make the state with "
                      "state_dtype=torch.uint8 and keep its scales with it")


def check_state_devices(backend: str, program: Program, params, states) -> None:
    """Raise ValueError unless every state tensor is on its parameter's device (a state on
    ``meta`` has no address: a Triton kernel read address 0; the reference's torch
    operations raised a RuntimeError of their own). The compiled backends' native checks
    take each tensor's device with its address; this is the reference's check, the Triton
    step's where its quick pass over the devices fails (``triton_runtime._check_all``), and
    a class's (``_check_work``), which names the parameter."""
    devices = [p.device for p in params]
    for s, col in zip(program.states, states):
        if [x.device for x in col] != devices:
            i, x = next((i, x) for i, x in enumerate(col) if x.device != devices[i])
            raise ValueError(f"backend '{backend}': state '{s.name}' of parameter {i} is on "
                             f"{x.device}, but its parameter is on {devices[i]}")


def check_states(backend: str, program: Program, params, states, geos=None) -> None:
    """Raise ValueError unless every state tensor has the shape its parameter needs
    (``states``: one list per state variable): a kernel would read and write past a
    smaller one. ``geos``: each parameter's matrix view (``Geometry``) where it is not its
    shape's own (a shard's: ``ShardView.local``)."""
    shapes = None
    for name, (scale, _) in program.quant.items():  # 8 bits: codes and their scales
        names = program.state_names
        for st, want in ((name, torch.uint8), (scale, torch.float32)):
            col = states[names.index(st)]
            if any(x.dtype != want for x in col):
                bad = next(x.dtype for x in col if x.dtype != want)
                raise ValueError(f"backend '{backend}': state '{st}' is kept in 8 bits "
                                 f"(state_dtype torch.uint8), as {want}, but a tensor of it is "
                                 f"{bad}: make the state with the same state_dtype")
    for s, col in zip(program.states, states):
        if s.dom == "rc":  # like the parameter: the shapes compared in one pass
            shapes = [p.shape for p in params] if shapes is None else shapes
            if [x.shape for x in col] == shapes:  # (a map of an attrgetter: not traceable)
                continue
        for i, (p, x) in enumerate(zip(params, col)):
            want = geos[i].shape(s.dom) if geos is not None and s.dom in DOMAINS \
                and s.dom != "rc" else state_shape(p, s.dom)
            if tuple(x.shape) != want:
                raise ValueError(f"backend '{backend}': state '{s.name}' of parameter {i} has "
                                 f"shape {tuple(x.shape)}, but its parameter, of shape "
                                 f"{tuple(p.shape)}, needs {want}")


def axis_geometry(shape, axes: tuple[int | None, int | None] | None = None) \
        -> tuple[int, ...]:
    """The integers a compiled kernel needs to walk a tensor's matrix view (see
    ``vega.dsl.ir``): ``(n_rc, n_r, n_c, n_, Sr, Sc, fr, fc, rr, cc)``.

    ``n_<dom>`` is the number of values of each domain (per element, per row, per
    column, per matrix); ``Sr``/``Sc`` the lengths of the row and column axes (1 for
    a missing one); ``fr``/``fc`` their inner strides in the contiguous full tensor;
    ``rr`` the row axis's inner stride in a per-row value (the full shape without the
    column axis), ``cc`` the column axis's in a per-column value. With
    ``drop(i, inner, n) = (i / (inner * n)) * inner + i % inner`` and
    ``put(o, inner, n, k) = (o / inner) * inner * n + k * inner + o % inner``:

    - element ``i`` reads per-row values at ``drop(i, fc, Sc)``, per-column ones at
      ``drop(i, fr, Sr)``, per-matrix ones at ``drop(drop(i, fc, Sc), rr, Sr)``;
    - per-row ``j`` reads per-matrix values at ``drop(j, rr, Sr)``, per-column ``j``
      at ``drop(j, cc, Sc)``;
    - ``row_*`` of a full value at row ``o`` combines ``put(o, fc, Sc, k)`` for
      ``k < Sc``; ``col_*`` of a full value, ``put(o, fr, Sr, k)`` for ``k < Sr``;
      ``col_*`` of a per-row value, ``put(o, rr, Sr, k)``; ``row_*`` of a per-column
      value, ``put(o, cc, Sc, k)``.

    ``axes``: the (row, column) axes where they are not ``shape``'s own (a shard's are
    those of the whole tensor: ``ShardView.local``).
    """
    shape = tuple(int(n) for n in shape)
    geo = geometry(shape) if axes is None else Geometry(shape, axes)
    r, c = geo.r, geo.c
    row_shape, col_shape = geo.shape("r"), geo.shape("c")  # per-row, per-column values
    def inner(shape, axis):  # the stride of ``axis`` in a contiguous ``shape``
        return math.prod(shape[axis + 1:]) if axis is not None else 1
    sr = geo.full[r] if r is not None else 1
    sc = geo.full[c] if c is not None else 1
    rr = inner(row_shape, None if r is None else geo.position(r, "r"))
    cc = inner(col_shape, None if c is None else geo.position(c, "c"))
    return (math.prod(geo.full), math.prod(row_shape), math.prod(col_shape),
            math.prod(geo.shape("")), sr, sc, inner(geo.full, r), inner(geo.full, c), rr, cc)


def state_key(dtypes, default: str) -> str:
    """The state part of a dtype group's key (``(params, grads, state)``): the one dtype of
    a parameter's states, or theirs joined by commas where they differ (``"float32,bfloat16"``;
    ``default``, the parameter's, where there is no state)."""
    dtypes = list(dtypes)
    if not dtypes:
        return default
    return dtypes[0] if dtypes.count(dtypes[0]) == len(dtypes) else ",".join(dtypes)


def state_dtype_names(sdt: str, nstate: int) -> list[str]:
    """Each state's dtype name from the state part of a group's key (``state_key``)."""
    parts = sdt.split(",")
    return parts * nstate if len(parts) == 1 else parts
