"""The reference backend: the IR rendered as eager torch code, any float dtype.

This is the executable meaning of the language and the oracle every other
backend is tested against. Each program becomes two Python functions, shown
by ``vega show --backend reference``:

- ``scalars(t, <hyperparameters>)``: the scalar phase, on 0-d tensors;
- ``update(p, g, <state>, <scalars>)``: the element phase, returning the new
  parameter and state values.

A spec's names appear as ``h_<hyperparameter>``, ``s_<state>`` and ``v_<value>``
(``vega.codegen.base.linearize``): no spec name can meet the module's own names
(``torch``, ``math``, ``geo``, the helpers) nor a Python keyword.

The scalar phase runs in float64 (as torch.optim computes its step constants
in Python floats); each scalar is rounded once to the *compute dtype*, in which
the element phase runs: float64 for float64 parameters, float32 otherwise
(bfloat16 and float16 parameters are upcast, and rounded to nearest even on
the way back).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from vega.codegen import precision, quant
from vega.codegen.gram import Gram, gram_form
from vega.codegen.base import (Geometry, Linear, Renderer, ShardView, check_codes, check_counters,
                               check_dtypes, check_state_devices, check_states, geometry,
                               hyper_var, leveled, linearize, split_result, state_var)
from vega.codegen.record import Pre, finite_of
from vega.codegen.steps import Done, advance_steps, memo, run_staged
from vega.codegen.tensors import (PLAIN_TYPES, in_memory_order, like_layout, refuse_inplace,
                                  transformed, watched, wrapped)
from vega.dsl.ir import (AXIS_REDUCTIONS, COMPARISONS, LOGIC, MATRIX_OPS, REDUCTIONS,
                        SCALAR_STATE, Kind, Node, Op, Program, is_global, walk, with_src,
                        with_updates)


def _fn(name):
    return lambda self, node, phase, *a: f"{name}({', '.join(a)})"


def _product_ops(call) -> dict:
    """The three products' renderings: ``call(name, arguments)`` writes one (``name`` one
    of ``_operands``'): a call of ``_<name>``, or, for ``render_batched``, a yield."""
    return {
        Op.MATMUL: lambda self, node, phase, a, b:
            call("matmul", f"{a}, {b}, geo, {node.src[0].dom!r}, {node.src[1].dom!r}"),
        Op.MATMUL_ADD: lambda self, node, phase, x, a, b:
            call("matmul_add", f"{x}, {a}, {b}, geo, "
                               f"{', '.join(repr(s.dom) for s in node.src)}"),
        Op.MATMUL_SHIFT: lambda self, node, phase, s, a, b, *alpha:
            call("matmul_shift", f"{s}, {a}, {b}, geo, {node.src[1].dom!r}, "
                                 f"{node.src[2].dom!r}{''.join(', ' + x for x in alpha)}"),
    }


def _minmax(which):
    # a where, as the C and Triton kernels: a NaN in either wins, and of two equal values
    # (0.0 and -0.0) the second (torch.minimum and clamp differ between 0-d tensors and
    # vectors there)
    cmp = "<" if which == "min" else ">"

    def render(self, node, phase, a, b):
        x = node.src[0]
        if x.op is Op.CONST and x.arg == x.arg:  # a number: a NaN b fails the test
            return f"torch.where({a} {cmp} {b}, {a}, {b})"
        return f"torch.where(({a} {cmp} {b}) | ({a} != {a}), {a}, {b})"
    return render


def _where(self, node, phase, c, a, b):
    if node.src[1].op is Op.CONST and node.src[2].op is Op.CONST:
        like = "p" if phase == "element" else "t"
        kind = ", dtype=torch.bool" if node.dtype == "bool" else ""
        a = f"{like}.new_full((), {a}{kind})"
    return f"torch.where({c}, {a}, {b})"


def _div(self, node, phase, a, b):
    # (a number over a value: Python's ``/`` would give ``b.reciprocal() * a``, rounded twice,
    # and NaN for 0 over a value whose reciprocal overflows)
    if node.src[0].op is Op.CONST and node.src[1].op is not Op.CONST:
        return f"_over({a}, {b})"
    return f"{a} / {b}"


class TorchRenderer(Renderer):
    code_for_op = {
        Op.DIV: _div,
        Op.NEG: lambda self, node, phase, a: f"-{a}",
        # (parenthesized: a negative number's literal, -2.0, is -(2.0 ** b) in Python)
        Op.POW: lambda self, node, phase, a, b: f"({a}) ** ({b})",
        Op.AND: _fn("torch.logical_and"),
        Op.OR: _fn("torch.logical_or"),
        Op.NOT: _fn("torch.logical_not"),
        Op.WHERE: _where,
        Op.SQRT: _fn("torch.sqrt"),
        Op.RSQRT: _fn("torch.rsqrt"),
        Op.EXP: _fn("torch.exp"),
        Op.LOG: _fn("torch.log"),
        Op.ABS: _fn("torch.abs"),
        Op.SIGN: _fn("_sign"),
        Op.MIN: _minmax("min"),
        Op.MAX: _minmax("max"),
        Op.ATAN2: _fn("_atan2"),
        Op.TANH: _fn("torch.tanh"),
        Op.SIN: _fn("torch.sin"),
        Op.COS: _fn("torch.cos"),
        Op.ERF: _fn("torch.erf"),
        Op.LOG1P: _fn("torch.log1p"),
        Op.EXPM1: _fn("torch.expm1"),
        Op.SIGMOID: _fn("torch.sigmoid"),
        Op.FLOOR: _fn("torch.floor"),
        Op.ROUND: _fn("torch.round"),
        Op.NORM: _fn("_norm"),
        Op.SUM: _fn("_sum"),
        Op.MEAN: _fn("_mean"),
        Op.AMAX: lambda self, node, phase, a: f"_amax({a})",
        **_product_ops(lambda name, args: f"_{name}({args})"),
        Op.TRANSPOSE: lambda self, node, phase, a: f"_transpose({a}, geo, {node.src[0].dom!r})",
        Op.SHIFT: _fn("_shift"),
        Op.SIZE: lambda self, node, phase: f"_size(p, geo, {node.arg})",
        # (``p``, or in the scalar phase ``t``: the device of a number made a tensor)
        Op.BF16: lambda self, node, phase, a: f"_bf16({a}, {'p' if phase == 'element' else 't'})",
        Op.WIDEN: lambda self, node, phase, a:
            f"_widen({a}, {'p' if phase == 'element' else 't'})",
        **{op: (lambda axis, how: lambda self, node, phase, a:
                f"_reduce({a}, geo, {node.src[0].dom!r}, {axis!r}, {how!r})")(*spec)
           for op, spec in AXIS_REDUCTIONS.items()},
    }

    def expr(self, linear: Linear, node: Node, phase: str) -> str:
        if node.kind != Kind.ELEMENT or node.op in REDUCTIONS or node.op in AXIS_REDUCTIONS \
                or node.op in MATRIX_OPS or node.op is Op.SHIFT \
                or all(s.kind != Kind.ELEMENT or s.dom == node.dom for s in node.src):
            return super().expr(linear, node, phase)
        # operands of a smaller domain (one value per row, ...) broadcast into this one
        args = [self.operand(linear, s, phase) if s.kind != Kind.ELEMENT or s.dom == node.dom
                else f"_broadcast({self.operand(linear, s, phase)}, geo, {s.dom!r}, "
                     f"{node.dom!r})" for s in node.src]
        if node.op in self.code_for_op:
            return self.code_for_op[node.op](self, node, phase, *args)
        return f"{args[0]} {self.infix[node.op]} {args[1]}"

    def const(self, value) -> str:
        if isinstance(value, bool):
            return repr(value)
        if math.isnan(value):
            return "math.nan"
        if math.isinf(value):
            return "math.inf" if value > 0 else "-math.inf"
        return repr(float(value))

    def operand(self, linear: Linear, node: Node, phase: str = "element") -> str:
        if node.op is Op.CONST and phase == "element":
            return self.number(node.arg)
        return super().operand(linear, node, phase)

    def number(self, value) -> str:
        """A literal of the element phase: one beyond float32's range as the element type
        rounds it (inf in float32, as the kernels' cast; torch refuses it in clamp, where
        and full)."""
        if not isinstance(value, bool) and math.isfinite(value) and abs(value) > _F32_MAX:
            return f"_fit({self.const(value)}, p)"
        return self.const(value)

    def output(self, linear: Linear, node: Node, dom: str = "rc", axes: bool = False) -> str:
        """An update's value, shaped like the parameter (or its rows, columns: ``dom``; one
        number, ``SCALAR_STATE``)."""
        if dom == SCALAR_STATE:
            if node.op is Op.CONST:
                return f"p.new_full((), {self.number(node.arg)})"
            return linear.ref(node)
        if not axes:  # no axis in the program: every value is shaped like p
            if node.op is Op.CONST:
                return f"torch.full_like(p, {self.number(node.arg)})"
            ref = linear.ref(node)
            return ref if node.kind == Kind.ELEMENT else f"{ref}.expand_as(p)"
        if node.op is Op.CONST:
            return f"p.new_full(geo.shape({dom!r}), {self.number(node.arg)})"
        ref = linear.ref(node)
        if node.kind == Kind.ELEMENT and node.dom == dom:
            return ref
        if node.kind == Kind.ELEMENT:
            ref = f"_broadcast({ref}, geo, {node.dom!r}, {dom!r})"
        return f"{ref}.expand(geo.shape({dom!r}))"


def render(program: Program, linear: Linear | None = None) -> str:
    """The Python source of the reference kernel for ``program``."""
    lin = linear or linearize(program)
    r = TorchRenderer()
    flags = ", ".join(f"{k}={str(v).lower()}" for k, v in program.flags) or "none"
    out = [f"# {program.name}: reference kernel (flags: {flags})"]
    if program.shapes:
        out.append(f"# conditions on the shape or hyperparameter values, in source order: "
                   f"{', '.join(str(s).lower() for s in program.shapes)}")
    out.append("")
    out.append(f"def scalars({', '.join(('t',) + lin.hypers)}):")
    out.append('    """The scalar phase: once per step, on 0-d tensors."""')
    for line in lin.scalar_lines:
        out.append(f"    {line.var} = {r.expr(lin, line.node, 'scalar')}")
    out.append(f"    return ({''.join(v + ', ' for v in lin.scalar_outputs)})")
    out.append("")
    state = [state_var(s) for s in program.state_names]
    axes = program.uses_axes
    geo = ["geo"] if axes else []
    out.append(f"def update({', '.join(['p', 'g', *state, *lin.scalar_outputs, *geo])}):")
    out.append('    """The element phase: new values of p and of each state."""')
    if axes:
        out.append('    # geo: the matrix view of this tensor (its row and column axes)')
    if _has_products(lin):
        out += _element_body(lin, r)
    else:
        out += [f"    {line.var} = {r.expr(lin, line.node, 'element')}"
                for line in lin.element_lines]
    doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
    results = [r.output(lin, node, doms[target], axes) for target, node in lin.outputs]
    out.append(f"    return ({''.join(v + ', ' for v in results)})")
    out.append("")
    for s in program.states:
        out += _init_function(s.name, s.init, lin.hypers, r, s.dom, axes)
    for name, node in program.modes:
        out += _mode_function(name, node, program, r)
    return "\n".join(out)


PRODUCTS = MATRIX_OPS - {Op.TRANSPOSE}


def _has_products(lin: Linear) -> bool:
    return any(line.node.op in PRODUCTS for line in lin.element_lines)


# ``_element_body``: the element operations whose value is always a tensor of its own, and
# those that read an operand without keeping it or a view of it
_OVER = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/"}
_FRESH = frozenset(_OVER) | {Op.NEG}
_CONVERSIONS = {Op.BF16: "_bf16", Op.WIDEN: "_widen"}  # fresh when asked (``fresh=True``)
_READERS = _FRESH | REDUCTIONS


@dataclass(frozen=True)
class Run:
    """A run of element lines that ``_element_body`` makes a function of its own,
    ``name(*full, *rest)``, returning ``made``: ``full``, the values of the whole matrix view
    it reads; ``rest``, the per-tensor values (0-d tensors) and ``p``, whose dtype the
    conversions read; ``lines``, its ``Line``s (``_tile_runs``); ``later``, the values of
    ``made`` that later lines read (the others are only returned)."""
    name: str
    lines: tuple
    full: tuple[str, ...]
    rest: tuple[str, ...]
    made: tuple[str, ...]
    later: tuple[str, ...] = ()


def _element_plan(lin: Linear) -> tuple[list, set, dict, dict, list[tuple[int, int, Run]]]:
    """The element lines of a program with matrix products as ``_element_body`` writes
    them: (the lines, in order (``_late``); the values returned; each value's last reader;
    whether every reader of a value only reads it (``_READERS``); the runs, each with its
    lines' positions)."""
    lines = _late(lin.element_lines)
    mine = {lin.ref(line.node) for line in lines}
    returned = {lin.names.get(id(node)) for _, node in lin.outputs}
    last: dict[str, int] = {}  # each element value's last reader
    readers: dict[str, bool] = {}  # whether every reader only reads it (``_READERS``)
    for k, line in enumerate(lines):
        for src in line.node.src:
            name = lin.names.get(id(src))
            if name in mine:
                last[name] = k
                readers[name] = readers.get(name, True) and line.node.op in _READERS
    runs = []
    for lo, hi in _tile_runs(lines):
        run = {line.var for line in lines[lo:hi]}
        read = [s for line in lines[lo:hi] for s in line.node.src
                if s.op is not Op.CONST and lin.names.get(id(s)) not in run]
        full = list(dict.fromkeys(lin.names[id(s)] for s in read if s.kind == Kind.ELEMENT))
        rest = list(dict.fromkeys([*(lin.names[id(s)] for s in read
                                     if s.kind != Kind.ELEMENT), "p"]))
        rest = [v for v in rest if v not in full]  # (p: as the lines make numbers tensors)
        made = [line.var for line in lines[lo:hi]
                if line.var in returned or last.get(line.var, -1) >= hi]
        later = [v for v in made if last.get(v, -1) >= hi]
        runs.append((lo, hi, Run(f"_tile_{lo}", tuple(lines[lo:hi]), tuple(full),
                                 tuple(rest), tuple(made), tuple(later))))
    return lines, returned, last, readers, runs


def element_runs(lin: Linear) -> list[Run]:
    """The runs of element lines of ``lin`` (a program with matrix products) that its
    ``update`` computes as functions of their own (``_element_body``)."""
    if not _has_products(lin):
        return []
    return [run for _, _, run in _element_plan(lin)[-1]]


def _element_body(lin: Linear, r: TorchRenderer) -> list[str]:
    """The element lines of a program with matrix products, each value deleted after its
    last use (a suspended ``update_batched`` holds only what it still needs), and each
    ``+ - * /`` of a value of its own domain written over an operand that dies there
    (``_into``) where that operand is a temporary of its own (an arithmetic value) that no
    product, transpose, conversion or output reads: a matrix's temporaries are large, and
    on the CPU a new tensor's pages cost more than the pass that fills them. A run of two or
    more element lines over the whole matrix view (``_tile_runs``, after ``_late`` has put
    each beside its readers) is a function of its own (``Run``), which ``_tiled`` calls on
    a part of the tensors at a time (a backend's, ``vega.codegen.runs``: one loop of the
    backend where it can)."""
    lines, returned, last, readers, runs = _element_plan(lin)
    mine = {lin.ref(line.node) for line in lines}

    def over(k: int, node: Node) -> str | None:  # the operand to write the value over
        if node.op not in _OVER or node.kind != Kind.ELEMENT or any(
                s.kind == Kind.ELEMENT and s.dom != node.dom for s in node.src):
            return None  # (not an infix expression: an operand broadcasts)
        for s in node.src:
            name = lin.names.get(id(s))
            if s.kind == Kind.ELEMENT and (s.op in _FRESH or s.op in _CONVERSIONS) \
                    and name in mine and last[name] == k and readers[name] \
                    and name not in returned:
                return name
        return None
    deads = [over(k, line.node) for k, line in enumerate(lines)]

    def line_of(k: int, indent: str) -> str:
        line, dead = lines[k], deads[k]
        node = line.node
        if node.op in _CONVERSIONS and line.var in deads:  # a tensor of its own, written over
            x = r.operand(lin, node.src[0], "element")
            return f"{indent}{line.var} = {_CONVERSIONS[node.op]}({x}, p, True)"
        if dead is None:
            return f"{indent}{line.var} = {r.expr(lin, node, 'element')}"
        a, b = (r.operand(lin, s, "element") for s in node.src)
        return f"{indent}{line.var} = _into({dead}, {_OVER[node.op]!r}, {a}, {b})"
    out = []
    k = 0
    for lo, hi, run in runs:
        for j in range(k, lo):  # (the lines before the run, one by one)
            out.append(line_of(j, "    "))
            done = sorted(n for n, at in last.items() if at == j and n not in returned)
            if done:
                out.append(f"    del {', '.join(done)}")
        full, rest, made = run.full, run.rest, run.made
        fn = run.name  # (no closure: every name it reads is an argument)
        out.append(f"    def {fn}({', '.join(full + rest)}):")
        out += [line_of(j, "        ") for j in range(lo, hi)]
        out.append(f"        return ({''.join(v + ', ' for v in made)})")
        out.append(f"    ({''.join(v + ', ' for v in made)}) = _tiled({fn}, "
                   f"({''.join(v + ', ' for v in full)}), ({''.join(v + ', ' for v in rest)}))")
        inside = {line.var for line in run.lines}
        done = sorted(n for n, at in last.items()
                      if lo <= at < hi and n not in returned and n not in inside)
        out.append(f"    del {', '.join([fn, *done])}")
        k = hi
    for j in range(k, len(lines)):
        out.append(line_of(j, "    "))
        done = sorted(n for n, at in last.items() if at == j and n not in returned)
        if done:
            out.append(f"    del {', '.join(done)}")
    return out


def _late(lines) -> list:
    """``lines`` with each of ``_tiled``'s operations (``_tile_runs``) moved to just before
    its first reader (an output's to the end), the others in their order: the decayed
    parameter of Muon's update (``p * (1 - lr * weight_decay)``) is made beside the rest of
    the update, after the products, in one run with it, not before them and held."""
    placed: list = []
    for line in reversed(lines):
        at = 0  # (in its place: before every line that came after it)
        if _tiles(line.node):
            at = next((k for k, later in enumerate(placed)
                       if any(s is line.node for s in later.node.src)), len(placed))
        placed.insert(at, line)
    return placed


def _tiles(node: Node) -> bool:
    """Whether ``_tiled`` may compute ``node`` a part of the tensor at a time."""
    elems = [s for s in node.src if s.kind == Kind.ELEMENT]
    return node.kind == Kind.ELEMENT and node.dom == "rc" and node.op in _TILED_OPS \
        and bool(elems) and all(s.dom == "rc" for s in elems)


# ``_tiled``: the element operations whose value is the same whatever part of a tensor they
# are given (each correctly rounded, or exact), and the size of a part
_TILED_OPS = frozenset(_OVER) | {Op.NEG, Op.BF16, Op.WIDEN, Op.MIN, Op.MAX, Op.WHERE, Op.ABS,
                                 Op.SIGN, Op.SQRT} | COMPARISONS | LOGIC
TILE = 1 << 18


def _tile_runs(lines) -> list[tuple[int, int]]:
    """The runs ``[lo, hi)`` of two or more element lines of the whole matrix view (``rc``,
    no operand of another domain), each of ``_TILED_OPS`` with an operand of the view: those
    ``_tiled`` computes a part of the tensor at a time."""
    runs, lo = [], None
    for k, line in enumerate([*lines, None]):
        if line is not None and _tiles(line.node):
            lo = k if lo is None else lo
            continue
        if lo is not None and k - lo >= 2:
            runs.append((lo, k))
        lo = None
    return runs


def _tiled(fn, full: tuple, rest: tuple) -> tuple:
    """``fn(*full, *rest)``: a run of element lines (``_element_body``) over tensors of the
    whole matrix view ``full`` (and per-tensor values and numbers ``rest``), computed
    ``TILE`` values at a time where they are plain, contiguous CPU tensors of one shape of
    at least two parts (torch not watching: ``watched``), each result written into
    a tensor of the whole shape. Its temporaries are a part's, which the caches hold, not
    the tensor's: a pass over memory and a new tensor's pages less for each, and each value
    the same (``_TILED_OPS``). (On a GPU each part would be kernel launches more: whole.)"""
    t0 = full[0]
    n = t0.numel()
    if n < 2 * TILE or t0.device.type != "cpu" or watched() or any(
                type(t) not in PLAIN_TYPES or t.shape != t0.shape or t.device != t0.device
                or not t.is_contiguous() for t in full):
        return fn(*full, *rest)
    flat = [t.view(-1) for t in full]
    outs = None
    for a in range(0, n, TILE):
        part = fn(*(f[a:a + TILE] for f in flat), *rest)
        if outs is None:
            outs = [torch.empty(t0.shape, dtype=q.dtype, device=q.device) for q in part]
        for o, q in zip(outs, part):
            o.view(-1)[a:a + TILE].copy_(q)
    return tuple(outs)


_INTO = {"+": (operator.add, torch.add), "-": (operator.sub, torch.sub),
         "*": (operator.mul, torch.mul), "/": (operator.truediv, torch.div)}


def _into(dead, how: str, a, b):
    """``a <how> b`` (``+ - * /``), written over ``dead``, a temporary of the update that
    nothing reads again (``_element_body``), where it fits: plain tensors (a number as an
    operand of ``+`` or ``*``, or as ``b``) of the result's shape, dtype and device, each
    tensor operand 0-d or laid out as ``dead``, torch not watching (``watched``).
    Else a new tensor, as ``a <how> b`` makes. Both run the same kernel and give a result
    of the same layout: the same values, and the same sums over them later."""
    op, fn = _INTO[how]
    if how in "+*" and type(a) in (float, int):  # (the same values either way round)
        a, b = b, a
    if type(dead) not in PLAIN_TYPES or type(a) not in PLAIN_TYPES \
            or (type(b) not in PLAIN_TYPES and type(b) not in (float, int)) \
            or watched():
        return op(a, b)
    if isinstance(b, torch.Tensor):
        if dead.shape != torch.broadcast_shapes(a.shape, b.shape) or b.device != dead.device:
            return op(a, b)
    elif dead.shape != a.shape:
        return op(a, b)
    if a.device != dead.device or dead.dtype != torch.result_type(a, b):
        return op(a, b)
    # the layout a new tensor would take: each operand of the result's shape laid out as
    # ``dead`` (a 0-d one aside), or a later sum or product would add in another order
    stride = dead.stride()
    for x in (a, b):
        if isinstance(x, torch.Tensor) and x.dim() and (x.shape != dead.shape
                                                        or x.stride() != stride):
            return op(a, b)
    return fn(a, b, out=dead)


class _AskingRenderer(TorchRenderer):
    """The element phase with each matrix product asked of the caller: ``(yield (name,
    arguments))`` (``render_batched``)."""
    code_for_op = {**TorchRenderer.code_for_op,
                   **_product_ops(lambda name, args: f"(yield ({name!r}, ({args})))")}


def render_batched(program: Program, linear: Linear | None = None) -> str | None:
    """``update_batched``: ``update`` as a generator that yields each matrix product it
    needs, ``(name, arguments)``, and is sent its value: the products of tensors of one
    shape run as one batched product (``Kernel._batched``), the elementwise work tensor by
    tensor as in ``update``. Each value is deleted after its last use, so that a suspended
    generator holds only what it still needs. None where the program has no product, or no
    ``bfloat16(...)``: only bfloat16 products are batched (``_products``), and the compute
    dtype is float32 or float64."""
    lin = linear or linearize(program)
    if not _has_products(lin) or Op.BF16 not in {line.node.op for line in lin.element_lines}:
        return None
    r = _AskingRenderer()
    state = [state_var(s) for s in program.state_names]
    out = [f"def update_batched({', '.join(['p', 'g', *state, *lin.scalar_outputs, 'geo'])}):",
           '    """The element phase, each matrix product yielded to the caller."""']
    out += _element_body(lin, r)
    doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
    results = [r.output(lin, node, doms[target], True) for target, node in lin.outputs]
    out.append(f"    return ({''.join(v + ', ' for v in results)})")
    return "\n".join(out) + "\n"


def _value_function(fn: str, doc: str, node: Node, args, r: TorchRenderer, dom: str,
                    axes: bool) -> list[str]:
    """A function ``fn(*args)`` computing one value ``node`` (of ``dom``) on its own."""
    lin = linearize(Program(fn, (), (), (), (("p", node),)))
    out = [f"def {fn}({', '.join(args)}):", f'    """{doc}"""']
    for line in lin.scalar_lines + lin.element_lines:
        out.append(f"    {line.var} = {r.expr(lin, line.node, 'element')}")
    out.append(f"    return {r.output(lin, node, dom, axes)}")
    return out + [""]


def _init_function(name: str, node: Node, hypers, r: TorchRenderer, dom: str = "rc",
                   axes: bool = False) -> list[str]:
    """``init_s_<name>(p, <hyperparameters>[, geo])``: a state's initial value."""
    args = ("p",) + tuple(hypers) + (("geo",) if axes else ())
    return _value_function(f"init_{state_var(name)}", f"The initial value of state {name}.",
                           node, args, r, dom, axes)


def _mode_function(name: str, node: Node, program: Program, r: TorchRenderer) -> list[str]:
    """``mode_<name>(p, <states>, <hyperparameters>[, geo])``: the parameter in mode ``name``
    (``mode eval { p = ... }``), in the compute dtype."""
    args = ("p", *(state_var(s) for s in program.state_names),
            *(hyper_var(h) for h in program.float_hypers)) + \
        (("geo",) if program.uses_axes else ())
    return _value_function(f"mode_{name}", f"The parameter in mode {name}.", node, args, r,
                           "rc", program.uses_axes)


def stages(program: Program) -> tuple[dict[int, int], list[list[Node]]]:
    """(the stage of each node, by id; the reductions of each stage, per tensor and along
    an axis alike): a reduction belongs to the stage of its argument, and its value to the
    next one. A step over shards ends each stage by combining its reductions' partial
    results across processes."""
    return leveled(program, REDUCTIONS | AXIS_REDUCTIONS.keys())


def render_staged(program: Program, linear: Linear | None = None) -> str:
    """``update_staged``: ``update`` as a generator that stops at the end of each stage
    (``stages``) and yields its reductions, ``(op, argument, argument's domain)`` each, to
    be given their values back: the step over shards (``Kernel.staged``). Its last yield
    is ``update``'s values (not a return, whose value dynamo cannot read back from the
    StopIteration in a traced step)."""
    lin = linear or linearize(program)
    r = TorchRenderer()
    level, phases = stages(program)
    keys = global_keys(program)
    state = [state_var(s) for s in program.state_names]
    out = [f"def update_staged({', '.join(['p', 'g', *state, *lin.scalar_outputs, 'geo'])}):",
           '    """The element phase, stage by stage: each reduction is yielded."""']
    reductions = {id(n) for phase in phases for n in phase}
    lines = sorted(lin.element_lines, key=lambda line: level[id(line.node)])
    for k in range(len(phases) + 1):
        out += [f"    {line.var} = {r.expr(lin, line.node, 'element')}" for line in lines
                if level[id(line.node)] == k and id(line.node) not in reductions]
        if k < len(phases):
            asked = ", ".join(f"({n.op.value!r}, {r.operand(lin, n.src[0], 'element')}, "
                              f"{n.src[0].dom if n.src[0].kind == Kind.ELEMENT else None!r}, "
                              f"{keys.get(id(n))!r})" for n in phases[k])
            out.append(f"    {''.join(lin.ref(n) + ', ' for n in phases[k])}= "
                       f"yield ({asked},)")
    doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
    results = [r.output(lin, node, doms[target], True) for target, node in lin.outputs]
    out.append(f"    yield ({''.join(v + ', ' for v in results)})")
    return "\n".join(out) + "\n"


def global_keys(program: Program) -> dict[int, str]:
    """The name of each reduction over every tensor of a group, by node id: its place in
    the spec and, for the copies ``repeat`` makes of one place, which copy (in the order
    they are computed), so the same in every program of the spec."""
    out: dict[int, str] = {}
    seen: dict[str, int] = {}
    for node in walk(node for _, node in program.updates):
        if is_global(node):
            place = f"{node.op.value}@{node.span.line}:{node.span.column}" if node.span \
                else f"{node.op.value}@?"
            seen[place] = seen.get(place, 0) + 1
            out[id(node)] = f"{place}#{seen[place]}"
    return out


def _global_partial(op: Op, x, view: ShardView | None):
    """A reduction over every tensor of a group: this tensor's part of it (how parts
    combine, its part in float64, the function that finishes the total)."""
    xd = x.double()
    weight = view.weight if view is not None else 1.0
    if op is Op.AMAX:
        part = xd.amax() if xd.numel() else xd.new_full((), -math.inf)
        return "max", part, lambda v: v.to(x.dtype)
    part = (xd * xd).sum() if op is Op.NORM else xd.sum()
    finish = torch.sqrt if op is Op.NORM else (lambda v: v)
    return "sum", part * weight if weight != 1 else part, lambda v: finish(v).to(x.dtype)


def _local_reduction(op: Op, x, geo: Geometry, dom):
    """A reduction of values that are all here: the reference's own expression of it."""
    if op is Op.NORM:
        return _norm(x)
    if op is Op.SUM:
        return _sum(x)
    if op is Op.MEAN:
        return _mean(x)
    if op is Op.AMAX:
        return _amax(x)
    which, how = AXIS_REDUCTIONS[op]
    return _reduce(x, geo, dom, which, how)


def _partial(op: Op, x: torch.Tensor, view: ShardView, dom: str):
    """A reduction of values of which this process holds a part: (how partial results
    combine, "sum" or "max"; this process's partial result, float64; the function that
    finishes the combined result). ValueError where the result itself would be split."""
    xd = x.double()
    if op in REDUCTIONS:
        count = math.prod(view.full.shape(dom))
        if op is Op.AMAX:
            part = xd.amax() if xd.numel() else xd.new_full((), -math.inf)
            return "max", part, lambda v: v.to(x.dtype)
        part = (xd * xd).sum() if op is Op.NORM else xd.sum()
        finish = {Op.NORM: torch.sqrt, Op.SUM: lambda v: v, Op.MEAN: lambda v: v / count}[op]
        return "sum", part * view.weight if view.weight != 1 else part, \
            lambda v: finish(v).to(x.dtype)
    which, how = AXIS_REDUCTIONS[op]
    out_dom = dom.replace(which, "")
    if view.splits(out_dom):
        raise split_result(op, view)
    axis = view.local.axis(which)
    dim = view.local.position(axis, dom)
    if how == "max":
        part = xd.amax(dim) if xd.shape[dim] else \
            xd.new_full(xd.shape[:dim] + xd.shape[dim + 1:], -math.inf)
        return "max", part, lambda v: v.to(x.dtype)
    part = xd.sum(dim)
    length = view.full.full[axis]
    return "sum", part * view.weight if view.weight != 1 else part, \
        lambda v: (v / length if how == "mean" else v).to(x.dtype)


def _broadcast(x, geo: Geometry, frm: str, to: str):
    """A value of domain ``frm`` with the axes of ``to`` it lacks put back, of length 1."""
    for axis in sorted(a for a in (geo.axis(w) for w in to if w not in frm) if a is not None):
        x = x.unsqueeze(geo.position(axis, to))
    return x


def _reduce(x, geo: Geometry, dom: str, which: str, how: str):
    """``x`` (of domain ``dom``) reduced over its row (``which='r'``) or column axis."""
    assert which in dom, f"reducing axis {which!r} of a value of domain {dom!r}"
    axis = geo.axis(which)
    if axis is None:  # a vector's row axis, a scalar's axes: one element long
        return x
    dim = geo.position(axis, dom)
    if how == "sum":
        return x.sum(dim)
    if how == "mean":
        return x.mean(dim)
    if x.shape[dim] == 0:
        return x.new_full(x.shape[:dim] + x.shape[dim + 1:], -math.inf)
    return x.amax(dim)


def _matrix_axes(geo: Geometry) -> tuple[list[int], int, int]:
    """(the order of a tensor's axes that puts its batch axes first, then its row axis, then
    its column axis; its number of rows; its number of columns): its matrix view."""
    shape = geo.full
    order = [a for a in range(len(shape)) if a not in (geo.r, geo.c)]
    order += [a for a in (geo.r, geo.c) if a is not None]
    rows = shape[geo.r] if geo.r is not None else 1
    cols = shape[geo.c] if geo.c is not None else 1
    return order, rows, cols


def _as_matrices(x, geo: Geometry):
    """A value of one per element as its batch of matrices (batch, rows, columns), or as its
    one matrix (rows, columns) where the batch is one: there a product is torch.mm, which
    reads a transposed operand in place (torch.bmm may copy it)."""
    order, rows, cols = _matrix_axes(geo)
    batch = math.prod([geo.full[a] for a in order[:len(order) - (geo.r is not None)
                                                    - (geo.c is not None)]])
    return x.permute(order).reshape((batch, rows, cols) if batch != 1 else (rows, cols))


def _from_matrices(m, geo: Geometry):
    """``_as_matrices``'s inverse: the batch of matrices shaped like the tensor again."""
    order, _, _ = _matrix_axes(geo)
    shaped = m.reshape([geo.full[a] for a in order])
    back = [0] * len(order)
    for k, a in enumerate(order):
        back[a] = k
    return shaped.permute(back)


def _promoted(*xs):
    """``xs`` in one dtype, torch's promotion of theirs (a bfloat16 matrix meeting one of the
    compute type widens, as an elementwise operation would)."""
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return [x if x.dtype == dt else x.to(dt) for x in xs]


def _matmul(a, b, geo: Geometry, da: str, db: str):
    """``a @ b`` of the matrix view: one product per matrix of the batch (torch.matmul)."""
    return _product(*_operands("matmul", (a, b, geo, da, db)))


def _matmul_add(x, a, b, geo: Geometry, dx: str, da: str, db: str):
    """``x + a @ b`` in one product (torch.addmm, torch.baddbmm): the sum rounded once."""
    return _product(*_operands("matmul_add", (x, a, b, geo, dx, da, db)))


def _product(m, a, b, geo: Geometry | None, beta=1, alpha=1):
    """One tensor's product from its ``_operands``, shaped back with ``geo`` where given."""
    out = _multiplied(m, a, b, beta, alpha)
    return _from_matrices(out, geo) if geo is not None else out


def _multiplied(m, a, b, beta=1, alpha=1):
    """``beta * m + alpha * (a @ b)`` (``a @ b`` where ``m`` is None) of matrices, or of
    batches of them (any number of leading axes, ``_products``' stacked ones among them);
    ``beta`` and ``alpha`` numbers, which torch.addmm takes as they are (in bfloat16 too;
    ``alpha`` is 1 but for ``_matmul_shift``'s, whose ``m`` has ``a``'s dtype)."""
    if m is None:
        return torch.matmul(a, b)
    if m.dtype != a.dtype:  # (addmm takes one dtype: the sum promotes, as x + a @ b would)
        return (m if beta == 1 else beta * m) + torch.matmul(a, b)
    if m.dim() == 2:  # one product, the sum rounded once
        return torch.addmm(m, a, b, beta=beta, alpha=alpha)
    return torch.baddbmm(*(x.flatten(0, -3) for x in (m, a, b)), beta=beta,
                         alpha=alpha).view(m.shape)


def _matmul_shift(s, a, b, geo: Geometry, da: str, db: str, alpha=1):
    """``s * b + alpha * (a @ b)`` (``a`` square, ``s`` one number; ``alpha`` one number,
    ``fuse_products``' where the program multiplies ``a`` by one) in one product, no pass
    over ``b``'s size (Newton-Schulz's ``a * x + B @ x``: its ``x`` is the large matrix;
    its ``B = b * A + c * A @ A``): where ``s`` and ``alpha`` are numbers (``Kernel._args``'
    ``exact``), torch.addmm's ``beta`` and ``alpha``, exact, as torch.optim.Muon's; where
    ``s`` is a tensor, ``(alpha a + s I) @ b``, ``s`` added on the diagonal in the
    product's dtype (rounded there to bfloat16); where ``alpha`` is, ``alpha a`` first, as
    the program wrote it."""
    return _product(*_operands("matmul_shift", (s, a, b, geo, da, db, alpha)))


def _shifted(s, a, b):
    """``a + s I`` for ``_matmul_shift``: ``s`` added to the diagonal in the product's dtype
    (a bfloat16 ``a`` meeting a float32 ``b`` widens first, as the product would)."""
    dt = torch.promote_types(a.dtype, b.dtype)  # (a square: a matrix value, a copy here)
    shifted = a.to(dt, memory_format=torch.contiguous_format, copy=True)
    shifted.diagonal(0, -2, -1).add_(s.to(dt) if isinstance(s, torch.Tensor) else s)
    return shifted


def _shift(s, b, like):
    """``b + s I`` (``b`` a square or a batch of squares, ``s`` one number; the number 0:
    ``b`` alone), a tensor of its own in the dtype of ``b``'s product with ``like``: the
    Gram form's ``P`` (``vega.codegen.gram``), ``_shifted``'s for the step."""
    if isinstance(s, torch.Tensor) or s != 0.0:
        return _shifted(s, b, like)
    return b.to(torch.promote_types(b.dtype, like.dtype), memory_format=torch.contiguous_format,
                copy=True)


# bfloat16 products batched over the tensors of one shape (``Kernel._batched``): on the
# CPU a batched bfloat16 product of several matrices takes markedly less time than one
# product a matrix (docs/performance.md). The elementwise work stays tensor by tensor.
BATCH_ELEMENTS = 1 << 24  # the most values of a parameter shape a batch holds
_KEPT = 8  # stacked operands and products kept for the next products to find


def _number(x) -> bool:
    """Whether ``x`` is a plain number (a hyperparameter given as one: ``Kernel._args``)."""
    return type(x) in (float, int)


def _operands(name: str, args) -> tuple:
    """One tensor's product ``name`` (``render_batched``'s) as ``(addend or None, left,
    right, geometry to shape the result back with or None[, the addend's factor])``, its
    operands matrices."""
    if name == "matmul_shift":
        s, a, b, geo, da, db, *alpha = args
        alpha = alpha[0] if alpha else 1
        exact = _factor(s, a, b)  # (beta, and alpha with it: exact)
        if not (_number(alpha) and alpha == 1 or exact and _factor(alpha, a, b)):
            a, alpha = alpha * a, 1  # (alpha times a, as the program wrote it)
        if exact:
            left, right = _promoted(_matrices(a, geo, da), _matrices(b, geo, db))
            return right, left, right, geo if da[0] + db[1] == "rc" else None, s, alpha
        name, args = "matmul", (_shifted(s, a, b), b, geo, da, db)
    if name == "matmul":
        a, b, geo, da, db = args
        return (None, *_promoted(_matrices(a, geo, da), _matrices(b, geo, db)),
                geo if da[0] + db[1] == "rc" else None)
    x, a, b, geo, dx, da, db = args
    return (_matrices(x, geo, dx), *_promoted(_matrices(a, geo, da), _matrices(b, geo, db)),
            geo if dx == "rc" else None)


_F32_MAX = 3.4028234663852886e38


def _factor(v, a, b) -> bool:
    """Whether ``v`` may be torch.addmm's exact ``beta`` or ``alpha`` for matrices ``a`` and
    ``b``: a number (``Kernel._args``' ``exact``), not 0 (a factor 0 makes torch.addmm ignore
    its operand, a NaN in it too, where ``0 * x`` is NaN), within float32's range unless the
    product is float64 (torch.addmm refuses it; the tensor's way gives inf or NaN)."""
    return _number(v) and v != 0 and (abs(v) <= _F32_MAX or (
        a.dtype == torch.float64 and b.dtype == torch.float64))


def _matrices(x, geo: Geometry, dom: str):
    """A product's operand as matrices: a value of one per element as its matrix view's."""
    return _as_matrices(x, geo) if dom == "rc" else x


def _layout(ts) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in ts)


def _keep(kept: dict, key: tuple, stacked: torch.Tensor, items) -> None:
    """Remember ``stacked`` as the batch of ``items`` (held, so that no other tensor takes
    their memory while the entry lives); the oldest entry goes past ``_KEPT``."""
    kept[key] = (stacked, items)
    while len(kept) > _KEPT:
        del kept[next(iter(kept))]


def _stack(ts, kept: dict) -> torch.Tensor:
    """``torch.stack(ts)``, or a batch ``kept`` already holds them as (a product's results,
    its stacked operands; or their transposes): no copy then."""
    key = _layout(ts)
    hit = kept.get(key)
    if hit is not None:
        return hit[0]
    if ts[0].dim() >= 2:
        hit = kept.get(_layout([t.mT for t in ts]))
        if hit is not None:
            return hit[0].mT
    out = torch.stack(ts)
    _keep(kept, key, out, list(ts))
    return out


def _products(asked, kept: dict) -> list:
    """The value of each tensor's product ``asked`` (``(name, arguments)`` each, all of one
    shape), computed as one batched product where the operands are bfloat16; one product a
    tensor otherwise (on the CPU a batched float32 or float16 product took longer than
    one product a matrix: docs/performance.md)."""
    found = [_operands(name, args) for name, args in asked]
    factors = {tuple(operands[4:]) or (1, 1) for operands in found}  # (beta, alpha)
    if found[0][1].dtype != torch.bfloat16 or len(factors) > 1:
        return [_product(*operands) for operands in found]
    ms, as_, bs, geos = (list(x) for x in zip(*(operands[:4] for operands in found)))
    out = _multiplied(None if ms[0] is None else _stack(ms, kept), _stack(as_, kept),
                      _stack(bs, kept), *factors.pop())
    items = out.unbind(0)
    _keep(kept, _layout(items), out, None)
    return [_from_matrices(o, geo) if geo is not None else o for o, geo in zip(items, geos)]


def fuse_products(program: Program) -> Program:
    """``program`` with each sum of a value and a product used nowhere else (``x + a @ b``,
    Newton-Schulz's) one node, ``_matmul_add``'s: one pass over the result, not two; and
    where the value is one number times the product's right operand and the left one is
    square (``s * x + a @ x``), ``_matmul_shift``'s: no pass over ``x``'s size at all."""
    if not program.has_matrices:
        return program
    roots = [node for _, node in program.updates]
    users: dict[int, int] = {}
    for node in walk(roots):
        for s in node.src:
            users[id(s)] = users.get(id(s), 0) + 1
    memo: dict[int, Node] = {}

    def swap(node: Node) -> Node:
        done = memo.get(id(node))
        if done is not None:
            return done
        src = tuple(swap(s) for s in node.src)
        out = with_src(node, src)
        if node.op is Op.ADD and node.kind == Kind.ELEMENT:
            for k in (0, 1):
                m, x = node.src[k], node.src[1 - k]
                if m.op is Op.MATMUL and users.get(id(m)) == 1 and x.kind == Kind.ELEMENT \
                        and x.dom == node.dom:
                    scale = _scaled_copy(x, m.src[1])
                    if scale is not None and m.src[0].dom in ("rr", "cc") \
                            and users.get(id(x)) == 1:
                        left, right = src[k].src
                        # (``s * b + (c * a) @ b`` of two squares: ``c`` the product's alpha,
                        # where nothing else reads ``c * a``, as torch.optim.Muon's ``B``;
                        # a step of the iteration, whose ``b`` is not square, keeps its
                        # form for vega.codegen.gram)
                        alpha = _scaled(m.src[0]) if users.get(id(m.src[0])) == 1 \
                            and m.src[1].dom in ("rr", "cc") else None
                        more = ()
                        if alpha is not None:
                            left, more = swap(alpha[1]), (swap(alpha[0]),)
                        out = Node(Op.MATMUL_SHIFT, (swap(scale), left, right, *more), None,
                                   "float", node.kind, node.span, node.name, node.dom)
                    else:
                        out = Node(Op.MATMUL_ADD, (src[1 - k], *src[k].src), None, "float",
                                   node.kind, node.span, node.name, node.dom)
                    break
        memo[id(node)] = out
        return out
    return with_updates(program, ((target, swap(node)) for target, node in program.updates))


def _scaled(x: Node) -> tuple[Node, Node] | None:
    """(``s``, ``y``) where ``x`` is ``s * y`` or ``y * s``, ``s`` one value per tensor and
    ``y`` a value per element, else None."""
    if x.op is not Op.MUL:
        return None
    for k in (0, 1):
        s, y = x.src[k], x.src[1 - k]
        if s.kind != Kind.ELEMENT and y.kind == Kind.ELEMENT:
            return s, y
    return None


def _scaled_copy(x: Node, b: Node) -> Node | None:
    """The number ``s`` where ``x`` is ``s * b`` or ``b * s`` (``s`` one value per tensor),
    else None."""
    if x.op is not Op.MUL:
        return None
    for k in (0, 1):
        s, y = x.src[k], x.src[1 - k]
        if y is b and s.kind != Kind.ELEMENT:
            return s
    return None


def _transpose(x, geo: Geometry, dom: str):
    out = (_as_matrices(x, geo) if dom == "rc" else x).transpose(-1, -2)
    return _from_matrices(out, geo) if dom == "cr" else out


def _size(p, geo: Geometry, axis: int):
    """The length of the tensor's axis ``axis`` (1 where it has fewer), a 0-d tensor."""
    return p.new_full((), float(geo.full[axis]) if axis < len(geo.full) else 1.0)


def _bf16(x, like, fresh: bool = False):
    """``x`` rounded to bfloat16 (a number: a 0-d tensor on ``like``'s device); a tensor of
    its own where ``fresh``, which ``_into`` may write over (``x`` itself where it is
    bfloat16 already, else)."""
    if not isinstance(x, torch.Tensor):
        x = like.new_full((), x)
    return x.to(torch.bfloat16, copy=fresh)


def _widen(x, like, fresh: bool = False):
    """``x`` in the step's compute type (``like``'s: the parameter's, as the step reads it);
    a tensor of its own where ``fresh`` (``_bf16``)."""
    return x.to(like.dtype, copy=fresh) if isinstance(x, torch.Tensor) else x


def _amax(x):
    return torch.amax(x) if x.numel() else x.new_full((), -math.inf)


# A tensor's norm, sum and mean, accumulated in float64 (complex128) and rounded once to its
# dtype, as the C and Triton kernels and the reductions over a group accumulate: in float32,
# the norm of values of 1e30 overflowed to inf, and a sum of 20,000 values lost digits.
def _wide(x):
    return torch.complex128 if x.is_complex() else torch.float64


def _norm(x):  # (x.real's dtype: dynamo does not trace dtype.to_real)
    n = torch.linalg.vector_norm(x, dtype=_wide(x))
    return n.to(x.real.dtype if x.is_complex() else x.dtype)


def _sum(x):
    return torch.sum(x, dtype=_wide(x)).to(x.dtype)


def _mean(x):
    return torch.mean(x, dtype=_wide(x)).to(x.dtype)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of one storage (not empty). Under torch.compile,
    whether they are one tensor: there the writes are functionalized, views and all. A
    tensor subclass without a storage of its own (a wrapper: DTensor) is taken to share."""
    if torch.compiler.is_compiling():
        return a is b
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):  # (no storage: its operations make copies)
        return True


def _over(number: float, x: torch.Tensor) -> torch.Tensor:
    """``number / x``, one correctly rounded division, as the C and Triton kernels divide:
    torch computes a Python number over a tensor as ``x.reciprocal() * number`` (a unit in
    the last place off for about a third of the values; 0 over a subnormal, whose reciprocal
    overflows, NaN; 0.1 over 1e-39 inf in float32, where the quotient is 1e38)."""
    return torch.div(x.new_full((), number), x)


def _filled(state, axes: bool):
    """The number a state starts at where its initial value is one and ``init_<name>`` is
    ``torch.full_like(p, <number>)`` (``TorchRenderer.output``: a state shaped like its
    parameter, in a program without axes; the literal as ``TorchRenderer.const`` writes it,
    not one beyond float32's range, which ``_fit`` rounds to p's dtype); else None."""
    node = state.init
    if axes or state.dom == SCALAR_STATE or node.op is not Op.CONST:
        return None
    value = node.arg
    if isinstance(value, bool):
        return value
    if math.isnan(value):
        return math.nan
    if math.isfinite(value) and abs(value) > _F32_MAX:
        return None
    return float(value)


def _fit(value: float, like: torch.Tensor) -> float:
    """``value`` rounded to ``like``'s dtype (float32: inf beyond its range)."""
    if like.dtype == torch.float64:
        return value
    return float(torch.tensor(value, dtype=torch.float64).to(like.dtype))


def _sign(x):
    """1 above zero, -1 below, x itself otherwise: NaN stays NaN (torch.sign gives 0) and
    -0.0 stays -0.0, as in the C and Triton kernels (and numpy's and jax's sign)."""
    return torch.where(x > 0, 1.0, torch.where(x < 0, -1.0, x))


def _atan2(y, x):
    """torch.atan2 where either argument may be a number."""
    like = y if isinstance(y, torch.Tensor) else x
    return torch.atan2(torch.as_tensor(y, dtype=like.dtype, device=like.device),
                       torch.as_tensor(x, dtype=like.dtype, device=like.device))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _hyper_tensor(v, dtype, device) -> torch.Tensor:
    """``v`` (a number) as a 0-d tensor of ``dtype``, rounded as a tensor is (one past the
    range of ``dtype`` infinite, where ``torch.full`` in ``dtype`` refuses it): made in
    float64 and rounded only where it is not within that range (a further operation, 10 us
    a number a step on a CPU), and while dynamo traces (where ``v`` may be symbolic)."""
    top = _TOP.get(dtype)
    if top is None or torch.compiler.is_compiling() or not -top <= v <= top:
        return torch.full((), v, dtype=torch.float64, device=device).to(dtype)
    return torch.full((), v, dtype=dtype, device=device)


_TOP = {torch.float32: _F32_MAX, torch.float64: math.inf}


class Kernel:
    """The reference kernel of one program, callable on lists of tensors."""

    backend = "reference"

    def __init__(self, program: Program, runs=None):
        """``runs``: where given, a ``vega.codegen.runs.Runs`` class, whose
        ``runs(linear).tiled`` is the ``_tiled`` of the functions rendered from ``linear``
        (a backend's loops: ``vega.codegen.c.runs``, ``vega.codegen.triton_runs``), which
        computes the same values; else ``_tiled``."""
        self.program = program
        self._runs = runs
        shown = fuse_products(program)  # (the program as the functions compute it)
        self.linear = linearize(shown)
        self.text = render(shown, self.linear)
        namespace = {"torch": torch, "math": math, "_amax": _amax, "_sign": _sign,
                     "_norm": _norm, "_sum": _sum, "_mean": _mean,
                     "_atan2": _atan2,
                     "_fit": _fit, "_over": _over, "_broadcast": _broadcast, "_reduce": _reduce,
                     "_matmul": _matmul, "_transpose": _transpose, "_size": _size,
                     "_bf16": _bf16, "_widen": _widen, "_matmul_add": _matmul_add,
                     "_matmul_shift": _matmul_shift, "_into": _into, "_shift": _shift,
                     "_tiled": _tiled}
        found = gram_form(shown)
        self._gram = self._gram_form(found, dict(namespace))
        if runs is not None:
            namespace["_tiled"] = runs(self.linear).tiled
        # the hyperparameters a product adds times its operand (``_matmul_shift``, ``_shift``:
        # Newton-Schulz's a and b), by their places among the scalars: given as numbers,
        # they reach the products as numbers (``_args``)
        roots = [n for _, n in shown.updates] + \
            ([n for _, n in found.program.updates] if self._gram is not None else [])
        nodes = walk(roots)
        shifted = {s.arg for n in nodes if n.op in (Op.MATMUL_SHIFT, Op.SHIFT)
                   for s in (n.src[0], *n.src[3:]) if s.op is Op.HYPER}
        # (only a hyperparameter the program uses nowhere else: elsewhere a number does not
        # give the value a 0-d tensor gives: ``a / x`` is ``x.reciprocal() * a``, and a
        # float32 0-d tensor times a bfloat16 matrix is rounded to bfloat16 first)
        for n in nodes:
            if n.op not in (Op.MATMUL_SHIFT, Op.SHIFT):
                shifted -= {s.arg for s in n.src if s.op is Op.HYPER}
        names = {hyper_var(h): h for h in shifted}
        self._exact = [(k, names[out]) for k, out in enumerate(self.linear.scalar_outputs)
                       if out in names]
        self._staged_text = render_staged(shown, self.linear)
        exec(compile(self._staged_text, f"<vega reference, staged: {program.name}>", "exec"),
             namespace)
        self._update_staged = namespace["update_staged"]
        batched = render_batched(shown, self.linear)
        self._update_batched = None
        if batched is not None:
            exec(compile(batched, f"<vega reference, batched: {program.name}>", "exec"),
                 namespace)
            self._update_batched = namespace["update_batched"]
        self.nstages = len(stages(shown)[1])  # stages that end in reductions
        self.global_keys = global_keys(shown)  # (vega.codegen.steps.drive's needs)
        exec(compile(self.text, f"<vega reference: {program.name}>", "exec"), namespace)
        self._scalars = namespace["scalars"]
        self._update = namespace["update"]
        self._inits = [namespace[f"init_{state_var(s.name)}"] for s in program.states]
        # each state's initial value where it is a number (``_filled``), else None; and
        # whether any other reads a hyperparameter (else ``init`` makes none of them)
        self._fills = [_filled(s, program.uses_axes) for s in shown.states]
        self._init_hypers = any(n.op is Op.HYPER for s, c in zip(shown.states, self._fills)
                                if c is None for n in walk([s.init]))
        self._modes = {name: namespace[f"mode_{name}"] for name, _ in program.modes}

    def _gram_form(self, gram: Gram | None, namespace: dict):
        """(the Gram form, its ``update`` and ``update_batched`` (or None)):
        ``vega.codegen.gram``; None where the program has no Newton-Schulz chain, or where
        the form's ``update`` is not given the scalars the program's is, in its order (it
        reads the same ones: called with the same arguments)."""
        if gram is None:
            return None
        lin = linearize(gram.program)
        named = {name: key for key, name in lin.names.items()}
        if tuple(self.linear.names.get(named[name]) for name in lin.scalar_outputs) \
                != self.linear.scalar_outputs:
            return None
        if self._runs is not None:
            namespace["_tiled"] = self._runs(lin).tiled
        text = render(gram.program, lin)
        exec(compile(text, f"<vega reference, Gram form: {self.program.name}>", "exec"),
             namespace)
        batched = render_batched(gram.program, lin)
        if batched is not None:
            exec(compile(batched, f"<vega reference, Gram form, batched: "
                                  f"{self.program.name}>", "exec"), namespace)
        start = text.index("def update(")
        end = text.find("\n\n", start)
        self.gram_text = text[start:end if end >= 0 else None].rstrip()  # (its update alone)
        return gram, namespace["update"], namespace.get("update_batched") if batched else None

    def _form(self, geo: Geometry | None):
        """(``update``, ``update_batched``) for a tensor of matrix view ``geo``: the Gram
        form's where it pays (``Gram.pays``)."""
        if self._gram is None or geo is None:
            return self._update, self._update_batched
        gram, update, batched = self._gram
        _, rows, cols = _matrix_axes(geo)
        if not gram.pays(rows, cols):
            return self._update, self._update_batched
        return update, batched

    def source(self) -> str:
        text = self.text
        if self._gram is not None:
            text = (f"{text}\n# For a tensor whose matrix view is wide enough "
                    f"(vega.codegen.gram.Gram.pays), update with its Newton-Schulz steps in "
                    f"the Gram form:\n\n{self.gram_text}\n")
        if self._runs is not None and "_tiled(" in text:
            text += self._runs.NOTE
        return text

    def _hyper_args(self, values: dict, dtype, device):
        """The float hyperparameters as 0-d tensors of ``dtype``; a number made one by
        ``torch.full``, which dynamo traces with the number an input of the graph (with
        ``torch.as_tensor`` it is a constant: a new value, a torch LR scheduler's, compiled
        the step again, step after step). A number is rounded to ``dtype`` as a tensor is:
        one past its range (1e39 for float32) is infinite, as the kernels round it, where
        ``torch.full`` in ``dtype`` refuses it."""
        return [v if isinstance(v, torch.Tensor) and v.dtype == dtype and v.device == device
                else v.to(dtype=dtype, device=device) if isinstance(v, torch.Tensor)
                else _hyper_tensor(v, dtype, device)
                for v in (values[h] for h in self.program.float_hypers)]

    def init(self, p: torch.Tensor, values: dict, state_dtype,
             geo: Geometry | None = None) -> list[torch.Tensor]:
        """Initial state tensors for a (real, floating) parameter (``geo``: its matrix view,
        where it is not its own shape's: a shard's); ``state_dtype``: one dtype for all, or
        a list, one per state."""
        if not self._inits:  # (no state: no copy of p in the compute dtype, which for a
            return []        # half parameter of 2**31 values was 8 GB made for nothing)
        cd = compute_dtype(p.dtype)
        # (a subclass, TwoTensor's wrapper, makes its states by its own full_like, and so
        # does a torch.func one, whose type is torch.Tensor's: under vmap, torch.full of its
        # shape would be one tensor that every member of the batch saw, in stride 0)
        fills = self._fills if type(p) in PLAIN_TYPES and not wrapped(p) \
            else [None] * len(self._fills)
        if all(c is not None for c in fills):  # (numbers: neither p's values nor a
            pc = hv = None                      # hyperparameter read)
        else:
            pc = p.detach().to(cd)
            hv = self._hyper_args(values, cd, p.device) if self._init_hypers else \
                [None] * len(self.program.float_hypers)
            if self.program.uses_axes:
                hv.append(geo or geometry(p.shape))
        sds = state_dtype if isinstance(state_dtype, (list, tuple)) else \
            [state_dtype] * len(self._inits)
        # 8 bits: each state's codes and scales made from its values at once (one state's
        # float32 values alive at a time); the scales' own inits (values like p) not run
        names, quantized = self.program.state_names, self.program.quant
        out, scales, skip = {}, {}, quant.scale_names(self.program)
        laid_out = in_memory_order(self.program)
        for name, fn, sd, fill in zip(names, self._inits, sds, fills):
            if fill is not None and name not in quantized and name not in skip \
                    and sd != torch.uint8:
                # ``torch.full_like(p, fill)`` in the compute dtype, as ``fn`` gives it, but
                # in contiguous strides already: a tensor of its own, not copied again
                x = torch.full(p.shape, fill, dtype=cd, device=p.device).to(sd)
                out[name] = like_layout(x, p) if laid_out and not p.is_contiguous() else x
                continue
            if pc is None:
                pc, hv = p.detach().to(cd), self._hyper_args(values, cd, p.device)
            if name in quantized:
                scale, signed = quantized[name]
                out[name], scales[scale] = quant.quantize_t(
                    fn(pc, *hv).to(torch.float32).expand(p.shape), signed)
            elif name not in skip:
                x = fn(pc, *hv)
                # (a state of its own: in contiguous strides, as like_layout's also are where
                # it keeps no other layout; a constant expanded to no element keeps stride 0
                # through contiguous(), which view_as_complex refuses)
                out[name] = x if sd == torch.uint8 else like_layout(x.to(sd), p) \
                    if laid_out else \
                    x.to(sd).clone(memory_format=torch.contiguous_format)
        return [scales[name] if name in scales else out[name] for name in names]

    def mode(self, name: str, params, states, values) -> None:
        """Set each parameter (in place) to its value in mode ``name`` (``mode NAME {...}``),
        from the states as stored; ``values``: each tensor's hyperparameters, evaluated.
        With a master copy (``precision``), from the master's value, which is kept as it is
        (the step's state: the mode's value is the parameter's alone)."""
        fn = self._modes[name]
        names = self.program.state_names
        master = names.index(precision.MASTER) if self.program.master else None
        for i, p in enumerate(params):
            cd = compute_dtype(p.dtype)
            hv = self._hyper_args(values[i], cd, p.device)
            extra = (geometry(p.shape),) if self.program.uses_axes else ()
            src = p if master is None else states[master][i]  # (the master copy's value)
            new = fn(src.to(cd), *self._olds(states, i, cd), *hv, *extra)
            p.copy_(new.to(p.dtype))

    def prelude(self, grads, pre: torch.Tensor) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``."""
        add_prelude(grads, pre)

    def _scalar_phase(self, step, values, cd, device):
        """The scalar phase in float64, each result rounded once to the compute dtype."""
        t = step.to(torch.float64) + 1  # (in int32, 2**31 - 1 + 1 wrapped to -2**31)
        scal = self._scalars(t, *self._hyper_args(values, torch.float64, device))
        # (a number made no tensor, ``widen(2)``: one of the compute dtype)
        return [torch.as_tensor(x, dtype=cd, device=device) if not isinstance(x, torch.Tensor)
                else x.to(cd) if x.is_floating_point() else x for x in scal]

    def __call__(self, params, grads, states, steps, values, donate, pre=None):
        """One fused step of every tensor: (new params, new states, new steps, finite).

        ``states`` is a list (one per state variable) of lists of tensors,
        ``steps`` the 0-d int32 step counter of each tensor (a tensor may repeat),
        ``values`` the hyperparameter values (0-d tensors or floats) of each tensor.

        ``pre`` (``vega.codegen.record``), when given, holds what the prelude gathered
        over all gradients: gradients are multiplied by the inverse loss scale,
        then by the clip coefficient ``max_norm / max(norm, max_norm)``; when it
        asks for the check, a step whose gradients are not all finite leaves
        every parameter, state and step counter as it was. ``finite`` is that
        flag as a 0-d bool tensor (None without ``pre``).
        """
        check_state_devices("reference", self.program, params, states)
        check_states("reference", self.program, params, states)
        check_codes("reference", self.program, states)
        check_dtypes("reference", self.program, params, grads, states)
        check_counters("reference", steps)
        if self.program.spans_group:  # its reductions over the group, between stages
            return run_staged(self, params, grads, states, steps, values, donate, pre)
        finite, gscale = self._begin(params, grads, states, steps, donate, pre)
        cache: dict = {}
        new_params, new_states = [None] * len(params), [[None] * len(params) for _ in states]
        keys = self._rounding_keys(params, grads, states, steps)
        for ids in self._batches(params, grads, states):
            if len(ids) > 1:  # tensors of one shape: their products batched
                geo = geometry(params[ids[0]].shape)
                batched = self._form(geo)[1]
                outs = self._batched(batched, [self._args(cache, i, params[i], grads[i],
                                                          states, steps, values, gscale)
                                               for i in ids], geo)
                for i, out in zip(ids, outs):
                    self._write(i, params[i], grads[i], states, out, finite, donate,
                                new_params, new_states, keys[i])
                continue
            i = ids[0]
            p, g = params[i], grads[i]
            args = self._args(cache, i, p, g, states, steps, values, gscale)
            extra = (geometry(p.shape),) if self.program.uses_axes else ()
            update = self._form(extra[0] if extra else None)[0]
            self._write(i, p, g, states, update(*args, *extra), finite, donate, new_params,
                        new_states, keys[i])
        return new_params, new_states, advance_steps(steps, finite, donate), finite

    def _batches(self, params, grads, states) -> list[list[int]]:
        """The tensors stepped together, by position: where the program has bfloat16 matrix
        products (``render_batched``) and dynamo is not tracing, those of one shape, device
        and dtypes, up to ``BATCH_ELEMENTS`` values a batch; one by one otherwise, and a
        tensor that is not a plain tensor with values in memory of the CPU or a CUDA device
        (a subclass, such as TwoTensor, whose data_ptr() is 0; a meta or lazy tensor), or
        has no values: ``_stack`` finds stacked operands by their addresses."""
        if self._update_batched is None or len(params) < 2 or torch.compiler.is_compiling():
            return [[i] for i in range(len(params))]
        alike: dict = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.device.type not in ("cpu", "cuda") or not p.numel() or \
                    not PLAIN_TYPES.issuperset(map(type, (p, g, *(col[i] for col in states)))):
                alike[i] = [i]  # (a key of its own)
                continue
            key = (p.shape, p.dtype, p.device, g.dtype, g.shape,
                   *((col[i].dtype, col[i].shape) for col in states))
            alike.setdefault(key, []).append(i)
        out = []
        for ids in alike.values():
            size = max(1, BATCH_ELEMENTS // max(1, params[ids[0]].numel()))
            out += [ids[k:k + size] for k in range(0, len(ids), size)]
        return out

    def _batched(self, update_batched, args: list, geo: Geometry) -> list[tuple]:
        """``update``'s values for tensors of one shape (``args``: each one's arguments),
        their generators (``update_batched``) run side by side: at each matrix product all
        ask for the same product, computed as one (``_products``)."""
        gens = [update_batched(*a, geo) for a in args]
        asked = [next(gen) for gen in gens]  # (every generator asks at least once)
        kept: dict = {}
        while True:
            values = _products(asked, kept)
            outs = []
            for k, gen in enumerate(gens):
                try:
                    asked[k] = gen.send(values[k])
                except StopIteration as done:
                    outs.append(done.value)
            if outs:  # (one code path, no branch: all end together)
                if len(outs) != len(gens):
                    raise RuntimeError(f"vega: {self.program.name}: tensors stepped side by "
                                       "side took different paths; please report it")
                return outs

    def staged(self, params, grads, states, steps, values, donate, pre, views):
        """``__call__`` over shards of tensors spread over processes, as a generator: at the
        end of each stage (``stages``) it yields the partial results of its reductions
        that span processes, ``[(how, float64 tensor), ...]`` (how: "sum" or "max"), and
        is sent them back combined over all processes; it returns ``__call__``'s answer.
        ``views``: each tensor's ``ShardView`` (its states' shapes are checked against a
        shard's own matrix view, ``ShardView.local``; their devices and dtypes as
        ``__call__`` checks them)."""
        geos = [v.local if v is not None else geometry(p.shape) for v, p in zip(views, params)]
        check_state_devices("reference", self.program, params, states)
        check_states("reference", self.program, params, states, geos)
        check_codes("reference", self.program, states)
        check_dtypes("reference", self.program, params, grads, states)
        check_counters("reference", steps)
        finite, gscale = self._begin(params, grads, states, steps, donate, pre)
        cache: dict = {}
        gens, asked, outs = [], [], [None] * len(params)
        for i, (p, g) in enumerate(zip(params, grads)):
            args = self._args(cache, i, p, g, states, steps, values, gscale)
            gens.append(self._update_staged(*args, geos[i]))
            asked.append(gens[-1].send(None) if self.nstages else None)
        for stage in range(self.nstages):
            parts, finishes, answers = [], [], []
            for i, requests in enumerate(asked):
                mine = []
                for op, x, dom, key in requests:
                    op = Op(op)
                    which = AXIS_REDUCTIONS[op][0] if op in AXIS_REDUCTIONS else None
                    if key is not None:
                        how, part, finish = _global_partial(op, x, views[i])
                        mine.append(len(parts))
                        parts.append((how, part, key))
                        finishes.append(finish)
                        continue
                    if dom is None or views[i] is None or not views[i].spans(which, dom):
                        mine.append(_local_reduction(op, x, geos[i], dom))
                        continue
                    how, part, finish = _partial(op, x, views[i], dom)
                    mine.append(len(parts))
                    parts.append((how, part))
                    finishes.append(finish)
                answers.append(mine)
            combined = (yield parts) if parts else []
            for i, mine in enumerate(answers):
                values_i = tuple(finishes[a](combined[a]) if isinstance(a, int) else a
                                 for a in mine)
                got = gens[i].send(values_i)  # (after the last stage: the values)
                if stage == self.nstages - 1:
                    outs[i] = got
                else:
                    asked[i] = got
        if not self.nstages:
            outs = [next(gen) for gen in gens]
        new_params, new_states = [None] * len(params), [[None] * len(params) for _ in states]
        keys = self._rounding_keys(params, grads, states, steps)
        for i, (p, g) in enumerate(zip(params, grads)):
            self._write(i, p, g, states, outs[i], finite, donate, new_params, new_states,
                        keys[i])
        yield Done((new_params, new_states, advance_steps(steps, finite, donate), finite))

    def _begin(self, params, grads, states, steps, donate, pre):
        """(the all-finite flag, (inverse loss scale, clip coefficient)), None each without
        ``pre``; in place, every write checked first."""
        if donate and not torch.compiler.is_compiling():  # all checked before any is written
            refuse_inplace("reference", self.program.state_names, params,
                           [s for col in states for s in col],
                           list({id(s): s for s in steps}.values()), grads)
        if pre is None:
            return None, None
        max_norm = pre[Pre.MAX_NORM]
        coef = torch.where(max_norm > 0,
                           max_norm / torch.maximum(pre[Pre.SUM_SQ].sqrt(), max_norm), 1.0)
        return finite_of(pre), (pre[Pre.INV_SCALE], coef)

    def _args(self, cache, i, p, g, states, steps, values, gscale) -> list:
        """The element phase's arguments for tensor ``i``, geometry aside."""
        cd = compute_dtype(p.dtype)
        scalars = memo(cache, (steps[i], values[i]), (cd, p.device),
                       self._scalar_phase, steps[i], values[i], cd, p.device)
        if self._exact:
            given = [(k, values[i][h]) for k, h in self._exact if _number(values[i][h])]
            if given:
                scalars = list(scalars)
                for k, v in given:
                    scalars[k] = float(v)
        gc = g.to(cd)
        if gscale is not None:  # (the product a new tensor, then scaled in place: one copy)
            gc = gc * gscale[0].to(cd)
            gc = gc * gscale[1].to(cd) if transformed() else gc.mul_(gscale[1].to(cd))
        # on contiguous values: a reduction sums in the same order whether the tensors
        # are the caller's (donated, maybe transposed) or a pure step's fresh outputs
        return [p.to(cd).contiguous(), gc.contiguous(), *self._olds(states, i, cd), *scalars]

    def _olds(self, states, i, cd) -> list:
        """Tensor ``i``'s states as values of dtype ``cd``, contiguous: an 8-bit state's from
        its codes and scales (``quant``)."""
        olds = [s[i].to(cd).contiguous() for s in states]
        names = self.program.state_names
        for name, (scale, signed) in self.program.quant.items():
            k = names.index(name)
            olds[k] = quant.dequantize_t(states[k][i], states[names.index(scale)][i], signed, cd)
        return olds

    def _rounding_keys(self, params, grads, states, steps) -> list:
        """Each tensor's key of the stochastic rounding's generator (``precision``), None
        each where the program rounds to nearest even."""
        seed = self.program.rounding
        if seed is None:
            return [None] * len(params)
        groups = [(p.dtype, g.dtype, *(col[i].dtype for col in states))
                  for i, (p, g) in enumerate(zip(params, grads))]
        return [precision.base_t(seed, steps[i], k)
                for i, k in enumerate(precision.group_positions(groups))]

    def _write(self, i, p, g, states, outs, finite, donate, new_params, new_states,
               key=None) -> None:
        """Tensor ``i``'s new values ``outs``, written in place (``donate``) or collected,
        at position ``i`` of ``new_params`` and of each of ``new_states``; ``key``: the
        generator's key where bfloat16 values round stochastically."""
        olds = [s[i] for s in states]
        if self.program.quant:  # 8-bit states: the new codes, and their scales beside them
            outs = list(outs)
            names = self.program.state_names
            for name, (scale, signed) in self.program.quant.items():
                k = names.index(name)
                outs[1 + k], outs[1 + names.index(scale)] = quant.quantize_t(
                    outs[1 + k].expand(olds[k].shape), signed)
        # every new value first, then the writes: a new value may be an input itself
        # (s = p), which an earlier write in place would change
        inputs, news = [p, g, *olds], []

        def kept(new) -> bool:
            # donated, a new value that is no input, nor another's, is chosen from at the
            # write, into the old tensor: no copy of each output a step (vmap takes no out=)
            return not transformed() and not any(_shares(new, x) for x in (*inputs, *news))
        for slot, (old, new) in enumerate(zip([p, *olds], outs)):
            if key is not None and old.dtype == torch.bfloat16:
                new = precision.round_bf16_t(new.expand(old.shape), precision.bits_t(
                    key, slot, old.numel())).reshape(old.shape)
            new = new.to(old.dtype)
            if finite is not None and not (donate and kept(new)):
                new = torch.where(finite, new, old)
            elif any(_shares(new, x) for x in (*inputs, *news)) or (
                    not donate and not new.is_contiguous()):
                # an input or another output, or a view of one (s = p; v = m; col_sum
                # of a vector; a per-row state spread over p): a tensor of its own;
                # fresh and contiguous when pure (an expanded scalar update is a view)
                new = new.clone(memory_format=torch.contiguous_format)
            news.append(new)
        for old, new, sink in zip([p, *olds], news, [new_params, *new_states]):
            if donate:
                if finite is not None and not _shares(new, old) and (
                        old.is_contiguous() or not torch.compiler.is_compiling()):
                    torch.where(finite, new, old, out=old)
                elif finite is not None and not _shares(new, old):
                    # (dynamo refuses an out= tensor that is not contiguous: channels_last,
                    # a slice)
                    old.copy_(torch.where(finite, new, old))
                else:
                    old.copy_(new)
                sink[i] = old
            else:
                sink[i] = new


def add_prelude(grads, pre: torch.Tensor) -> None:
    # each gradient's scaled copy counted first, then squared in place (in float64, a copy
    # of its own where the compute dtype is narrower): one or two tensors its size, not five
    for g in grads:
        gc = g.to(compute_dtype(g.dtype)) * pre[Pre.INV_SCALE].to(compute_dtype(g.dtype))
        pre[Pre.NONFINITE] += torch.isfinite(gc).logical_not_().sum()
        wide = gc.double()
        pre[Pre.SUM_SQ] += wide.mul_(wide).sum()
