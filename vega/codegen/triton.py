"""The Triton backend: fused multi-tensor GPU kernels, one launch per phase per dtype group.

Each program and dtype group (parameter, gradient and state dtypes) renders to
one Python module of ``@triton.jit`` kernels (``vega show --backend triton``),
from the Jinja2 template ``templates/triton.py.j2``. A launch covers every
tensor of the group: a device table holds each tensor's addresses (numel, p,
g, state..., step counter, hyperparameters, outputs) and a block map gives
each program BLOCK consecutive elements of one tensor. A step is:

- ``vega_<name>_prelude``: the gradients' sum of squares and non-finite count, unscaled,
  added into ``pre`` (or, at a step's first launch, the whole record written), the launch's
  last program to finish combining every program's partial sums;
- ``vega_<name>_scalars``: the scalar phase, once a step (float64, as in the reference):
  every scalar the kernels read (``b1 ^ t``, the hyperparameters), the inverse loss scale,
  the clip coefficient and the finite flag, per tensor, rounded to the arithmetic's dtype;
  and the states of one number per tensor: their old values read and kept for the other
  kernels; where no new value reads a reduction of the elements (NAdam's ``mu_product``),
  the new ones computed in the arithmetic's dtype, written (the old where the step is
  skipped) and kept too (otherwise the update computes them, and writes them in each
  tensor's first block);
- ``vega_<name>_phase<k>`` and ``vega_<name>_finish<k>``: per-tensor reductions
  (``norm``, ``sum``, ``mean``, ``max``), per block then per tensor in block order
  (deterministic); values needed on both sides are recomputed;
- ``vega_<name>_update``: the element program; every write is the new value where the step
  is finite, the old bits where it is skipped; its program 0 then advances the step counters
  (saturating, unless skipped). ``vega_<name>_advance`` does that alone where no update
  launch can (the stages of a program over the matrix view, a step whose tensors are all
  empty).

The update and phase kernels advance each pointer to their block once, index within it in
int32, take full blocks without a mask and, where the host found every address a multiple of
16 bytes (``ALIGNED``), tell the compiler so: their loads and stores are 128 bits wide on a
GPU (``docs/gpu.md`` has the figures of an offline compile).

A program with values per row, column or matrix of the tensors' matrix view
(``Program.uses_axes``: axis reductions, row and column state) runs instead
as stages: ``vega_<name>_stage<k>_<domain>`` kernels over the rows, columns,
matrices or elements of every tensor compute the axis reductions (a loop over
the reduced axis per output) into temporaries and per-tensor reductions (with
``vega_<name>_finish<k>_<domain>``), and ``vega_<name>_write_<domain>`` kernels write
the new values, computed from the old ones (see ``axis_plan``).

Nothing is read back to the host: the learning rate, step, loss scale, clip
coefficient and finite flag are device values, so a step replays under CUDA
graphs. The step runs as the torch custom op ``vega::triton_step`` (see
``vega.codegen.triton_runtime``), so ``torch.compile(fullgraph=True)`` traces it.

On CPU tensors the kernels run under Triton's interpreter: set
``TRITON_INTERPRET=1`` before the first step (``@triton.jit`` reads it when
the kernels are loaded); without it, CPU tensors raise a ValueError that says
so. The interpreter truncates
float32 -> bfloat16 casts, so bfloat16 results are rounded to nearest even by
``to_bf16`` explicitly; ``b ^ t`` is ``exp2(t * log2(b))`` (``vpow``), since
``libdevice.pow`` does not run under the interpreter.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import math
from functools import cache
from importlib.resources import files

import numpy as np
import torch

from vega.codegen import plan, precision, quant, reference, triton_runtime
from vega.codegen.base import Linear, Renderer, linearize, state_dtype_names, state_var
from vega.codegen.base import codes_without_scales, of_elements, reduction_phases
from vega.codegen.record import PRE_SLOTS, named
from vega.codegen.steps import run_staged
from vega.dsl.ir import (AXIS_REDUCTIONS, DOMAIN_WORDS, REDUCTIONS, SCALAR_STATE, Kind, Node,
                         Op, Program, walk)

TL = {"float32": "tl.float32", "float64": "tl.float64", "bfloat16": "tl.bfloat16",
      "float16": "tl.float16", "uint8": "tl.uint8"}

# Names (see vega.codegen.base): a value of the program is p, g, t, h_<hyperparameter>,
# s_<state> or v_<value>, and a value computed at other indices (a state read per row in a
# loop over the elements) that name with a suffix (s_v_row_r, p_k); every other identifier
# of a module is the kernels' own, none of which is p, g or t or begins with h_, s_, v_,
# p_, g_ or t_. Those made for a value x: its table columns C_x (its address) and O_x (the
# address of its new value), the locals ptr_x and out_x (those addresses) and old_x (its
# old value, as stored); T_x, the column of an axis reduction's offset in the temporaries,
# and off_x, the local holding it. The kernels are vega_<optimizer name>_<what>.


def _call(name):
    return lambda self, node, phase, *a: f"{name}({', '.join(a)})"


def _minmax(which):
    # a where, as the C kernels and the reference: a NaN in either wins, and of two equal
    # values (0.0 and -0.0) the second
    cmp = "<" if which == "minimum" else ">"

    def render(self, node, phase, a, b):
        nan = node.src[0].op is not Op.CONST or node.src[0].arg != node.src[0].arg
        a, b = (self.number(s, x, phase) for s, x in zip(node.src, (a, b)))
        # (two wheres, not an or: the interpreter cannot or a scalar bool with a block)
        return f"tl.where({a} != {a}, {a}, tl.where({a} {cmp} {b}, {a}, {b}))" if nan else \
            f"tl.where({a} {cmp} {b}, {a}, {b})"  # (a NaN b fails the test: b)
    return render


def _where(self, node, phase, c, a, b):
    a, b = (self.number(s, x, phase) for s, x in zip(node.src[1:], (a, b)))
    if node.kind == Kind.ELEMENT and node.dtype == "bool":
        a, b = (_bool_of(s, x) for s, x in zip(node.src[1:], (a, b)))
    return f"tl.where({c}, {a}, {b})"


def _bool_of(node, text):
    """A bool of one value per step or tensor as a where's value beside blocks: through a
    where of literals (the interpreter keeps a comparison's result typed as its operands,
    and a where of a block's bools and such a one made floats, which its & refused)."""
    return text if node.kind == Kind.ELEMENT or node.op is Op.CONST else \
        f"tl.where({text}, True, False)"


def _compare(op):
    # (Triton makes a bare literal beside a comparison a tensor of its own type: float32
    # where float32 holds it as a normal number, else float64; so 0.1 beside float64 values
    # would be 0.1 rounded to float32, and 1e39 beside float32 values not inf)
    def render(self, node, phase, a, b):
        a, b = (self.number(s, x, phase) for s, x in zip(node.src, (a, b)))
        return f"{a} {op} {b}"
    return render


def _logic(node, a, b, op, mixed):
    """``a & b`` where both are blocks or both scalars; the interpreter cannot combine a
    block of bools with a scalar bool, so mixed operands go through ``tl.where``."""
    blocks = {s.kind == Kind.ELEMENT for s in node.src}
    return f"{a} {op} {b}" if len(blocks) == 1 else mixed


# Functions Triton has no form of that runs both on a GPU and under the interpreter
# (libdevice's do not run there), written with tl's arithmetic; each follows torch's edge
# cases (NaN in, NaN out; signed zeros; infinities). name -> (source, helpers it calls).
_HELPERS = {
    "vsignbit": ('''
@triton.jit
def vsignbit(x):
    """Whether x's sign bit is set (-0.0 included)."""
    if x.dtype == tl.float64:
        r = x.to(tl.int64, bitcast=True) < 0
    else:
        r = x.to(tl.int32, bitcast=True) < 0
    return r
''', ()),
    "vexpm1": ('''
@triton.jit
def vexpm1(x):
    """e^x - 1, exact near 0: Kahan's (u - 1) x / log(u) with u = e^x (in float64, rounded:
    float32's tl.exp is an approximation on a GPU, tens of units off for large x)."""
    u = tl.exp(x.to(tl.float64)).to(x.dtype)
    um1 = u - 1.0
    r = tl.where(um1 == 0.0, x, um1 * (x / tl.log(u)))
    r = tl.where(um1 == -1.0, -1.0, r)
    return tl.where(u == float("inf"), u, r)
''', ()),
    "vlog1p": ('''
@triton.jit
def vlog1p(x):
    """log(1 + x), exact near 0: Kahan's log(u) x / (u - 1) with u = 1 + x."""
    u = 1.0 + x
    r = tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
    return tl.where(u == float("inf"), u, r)
''', ()),
    "vtanh": ('''
@triton.jit
def vtanh(x):
    """tanh(x) = e / (e + 2) with e = e^(2|x|) - 1, signed; 1 past |x| = 22."""
    a = tl.abs(x)
    e = vexpm1(2.0 * a)
    r = tl.where(a > 22.0, 1.0, e / (e + 2.0))
    r = tl.where(x < 0, r * -1.0, r)
    return tl.where(a == 0.0, x, r)
''', ("vexpm1",)),
    "vatan2": ('''
@triton.jit
def vatan2(y, x):
    """atan2(y, x) as torch: the angle of (x, y) in [-pi, pi], signed zeros and infinities
    included. atan(z), 0 <= z <= 1, by three half-angle steps (z / (1 + sqrt(1 + z^2)),
    down to 0.0985) and nine terms of its series."""
    ax = tl.abs(x)
    ay = tl.abs(y)
    mx = tl.where(ax > ay, ax, ay)
    mn = tl.where(ax > ay, ay, ax)
    z = tl.where(mx == 0.0, 0.0, tl.where(mx == mn, 1.0, mn / mx))
    z = z / (1.0 + tl.sqrt(1.0 + z * z))
    z = z / (1.0 + tl.sqrt(1.0 + z * z))
    z = z / (1.0 + tl.sqrt(1.0 + z * z))
    s = z * z
    c = 1.0 / 17.0
    c = c * s - 1.0 / 15.0
    c = c * s + 1.0 / 13.0
    c = c * s - 1.0 / 11.0
    c = c * s + 1.0 / 9.0
    c = c * s - 1.0 / 7.0
    c = c * s + 1.0 / 5.0
    c = c * s - 1.0 / 3.0
    a = 8.0 * (z + z * (s * c))
    a = tl.where(ay > ax, 1.5707963267948966 - a, a)
    a = tl.where(vsignbit(x), 3.141592653589793 - a, a)
    a = tl.where(vsignbit(y), a * -1.0, a)  # (-a is 0 - a: +0.0 for a = 0.0)
    # (wheres, not an or: the interpreter cannot or two scalar bools of the scalars kernel)
    return tl.where(x != x, x + y, tl.where(y != y, x + y, a))
''', ("vsignbit",)),
    "vrsqrt": ('''
@triton.jit
def vrsqrt(x):
    """1 / sqrt(x) of float32 values, a subnormal x included: on a GPU Triton's float32
    rsqrt (rsqrt.approx.ftz) flushes it to zero (inf, where 1e-40 gives 1e20); such an x is
    scaled by 2^24 into the normal numbers and its result by 2^12 (both exact)."""
    tiny = tl.abs(x) < 1.1754943508222875e-38
    return tl.where(tiny, tl.rsqrt(x * 16777216.0) * 4096.0, tl.rsqrt(x))
''', ()),
    "vround": ('''
@triton.jit
def vround(x):
    """x rounded to the nearest integer, halves to even (torch.round); x - floor(x) is exact."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(0.5 * f)) == 1.0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d == 0.5, tl.where(odd, f + 1.0, f), f))
    return tl.where(r == 0.0, x * 0.0, r)
''', ()),
}
_HELPER_OF = {Op.EXPM1: "vexpm1", Op.LOG1P: "vlog1p", Op.TANH: "vtanh", Op.ATAN2: "vatan2",
              Op.ROUND: "vround", Op.RSQRT: "vrsqrt"}


def _helpers(nodes) -> list[str]:
    """The sources of the helpers the nodes' functions need, callees first."""
    out: list[str] = []

    def add(name):
        if name not in out:
            for dep in _HELPERS[name][1]:
                add(dep)
            out.append(name)
    for n in nodes:
        if n.op in _HELPER_OF:
            add(_HELPER_OF[n.op])
    return [_HELPERS[name][0].strip("\n") for name in out]


def _wide(name):
    """``name`` (``tl.exp``, ``tl.log``) of a float32 value of the element phase computed in
    float64 and rounded to float32: on a GPU, Triton's float32 ``tl.exp`` is ``ex2.approx`` of
    ``x * log2(e)`` rounded to float32 (64 units in the last place off near ``exp(87)``) and
    its ``tl.log`` flushes a subnormal to zero (``-inf``), where the interpreter's numpy is
    within a unit; float64's are libdevice's, within a unit."""
    def render(self, node, phase, a):
        if phase != "element" or self.ct != "tl.float32":
            return f"{name}({a})"
        return f"{name}({self.tensor(node.src[0], a, phase)}.to(tl.float64)).to(tl.float32)"
    return render


def _sigmoid(self, node, phase, a):
    return f"1.0 / (1.0 + {_wide('tl.exp')(self, node, phase, f'(-{a})')})"


def _pow(self, node, phase, a, b):
    base, expo = node.src
    if expo.op is Op.CONST and expo.arg == 2.0:
        return f"{a} * {a}"
    if expo.op is Op.CONST and expo.arg == 0.5:
        return self.code_for_op[Op.SQRT](self, node, phase, a)
    if expo.op is Op.CONST:  # (as written: float32 would make 16777217 even, 1e-320 0)
        b = self.const(float(expo.arg) or 0.0)  # (x ^ -0.0 is x ^ 0.0: 1)
        return f"vpow({self.tensor(base, a, phase)}, tl.full((), {b}, tl.float64))"
    return f"vpow({self.tensor(base, a, phase)}, {self.tensor(expo, b, phase)})"


class TritonRenderer(Renderer):
    """Triton expressions; the scalar phase in float64, the element phase in ``ct``."""

    code_for_op = {
        # (Triton's -x is 0 - x: +0.0 for x = 0.0, where C and torch give -0.0)
        Op.NEG: lambda self, node, phase, a: f"{a} * -1.0",
        Op.POW: _pow,
        Op.AND: lambda self, node, phase, a, b: _logic(
            node, a, b, "&", f"tl.where({a}, {_bool_of(node.src[1], b)}, False)"),
        Op.OR: lambda self, node, phase, a, b: _logic(
            node, a, b, "|", f"tl.where({a}, True, {_bool_of(node.src[1], b)})"),
        Op.NOT: lambda self, node, phase, a: f"~{a}",
        Op.WHERE: _where,
        Op.SQRT: lambda self, node, phase, a: (
            f"tl.sqrt_rn({a})" if phase == "element" and self.ct == "tl.float32"
            else f"tl.sqrt({a})"),
        Op.RSQRT: lambda self, node, phase, a: (
            f"1.0 / tl.sqrt({a})" if phase != "element" else
            f"vrsqrt({a})" if self.ct == "tl.float32" else f"tl.rsqrt({a})"),
        Op.EXP: _wide("tl.exp"),
        Op.LOG: _wide("tl.log"),
        Op.ABS: _call("tl.abs"),
        **{op: _compare(sym) for op, sym in
           ((Op.LT, "<"), (Op.LE, "<="), (Op.GT, ">"), (Op.GE, ">="), (Op.EQ, "=="),
            (Op.NE, "!="))},
        Op.SIGN: lambda self, node, phase, a:
            f"tl.where({a} > 0, 1.0, tl.where({a} < 0, -1.0, {a}))",
        Op.MIN: _minmax("minimum"),
        Op.MAX: _minmax("maximum"),
        Op.ATAN2: lambda self, node, phase, a, b:
            f"vatan2({self.tensor(node.src[0], a, phase)}, {self.tensor(node.src[1], b, phase)})",
        Op.TANH: _call("vtanh"),
        Op.SIN: _call("tl.sin"),
        Op.COS: _call("tl.cos"),
        Op.ERF: _call("tl.erf"),
        Op.LOG1P: _call("vlog1p"),
        Op.EXPM1: _call("vexpm1"),
        Op.SIGMOID: _sigmoid,
        Op.FLOOR: _call("tl.floor"),
        Op.ROUND: _call("vround"),
    }

    def __init__(self, ct: str):
        self.ct = ct

    def const(self, value) -> str:
        if isinstance(value, bool):
            return repr(value)
        if negative_zero(value):  # (Triton makes a constant -0.0 +0.0: a product)
            return "(tl.full((), 0.0, tl.float32) * -1.0)"
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(float(value))

    def operand(self, linear: Linear, node: Node, phase: str = "element") -> str:
        if node.op is Op.CONST:
            return self.const(node.arg)
        return linear.ref(node)

    def number(self, node: Node, text: str, phase: str) -> str:
        """``tensor`` for a number literal where float32 would round it (float64 values);
        a bool one as it is, and one beside float32 values rounded to float32 (Triton would
        make one it cannot hold as a normal float32 number a float64: 1e39 or 1e-40)."""
        if node.dtype == "bool" or node.op is not Op.CONST:
            return text
        if phase != "element" or self.ct != "tl.float32":
            return self.tensor(node, text, phase)
        x = node.arg
        if x == 0 or not math.isfinite(x) or _F32_TINY <= abs(x) <= _F32_MAX:
            return text  # (Triton takes it as a float32 as it is)
        with np.errstate(over="ignore"):
            value = float(np.float32(x))
        if value == 0 or math.isinf(value):
            return self.const(value)
        return repr(value) if abs(value) >= _F32_TINY else self.tensor(node, repr(value), phase)

    def tensor(self, node: Node, text: str, phase: str) -> str:
        """An operand as a Triton value: a literal becomes a 0-d tensor of the phase's type
        (a bare literal is float32 to tl.minimum, tl.where and the like: 1e-3 would lose
        digits beside float64 values)."""
        if node.op is not Op.CONST:
            return text
        return f"tl.full((), {text}, {'tl.float64' if phase == 'scalar' else self.ct})"


_F32_TINY = torch.finfo(torch.float32).tiny  # float32's smallest normal number
_F32_MAX = reference._F32_MAX


def _as_block(value: str, ct: str) -> str:
    """A value of one number per step or tensor as a block: added to a block of -0.0, which
    leaves every value as it is (a block of 0.0 made -0.0 +0.0: p = -b at b = 0)."""
    return f"(tl.zeros([BLOCK], dtype={ct}) * -1.0 + {value})"


def negative_zero(value) -> bool:
    """Whether ``value`` is -0.0 (which Triton's constants, ``tl.full`` among them, make
    +0.0)."""
    return not isinstance(value, bool) and value == 0 and math.copysign(1.0, value) < 0


def _needed(roots: list[Node], computed: list[Node]) -> tuple[list[Node], list[Node], list[Node]]:
    """The element-phase lines reaching ``roots`` (operands first), the reductions of earlier
    phases they read (values are recomputed, reductions are not), and every node reached
    (``vega.codegen.plan.element_plan``). ``computed``: the reductions of this phase (a root
    of the update may be an earlier phase's reduction: s = norm(g))."""
    found = plan.element_plan(roots, computed=computed)
    return list(found.lines), list(found.earlier), list(found.reached)


_WHAT = {Op.NORM: "norm", Op.SUM: "sum", Op.MEAN: "mean", Op.AMAX: "max"}

# -- the staged path: programs with values per row, column or matrix -----------------------
#
# A program that uses the matrix view (``Program.uses_axes``) runs as a sequence of launches,
# each over the values of one domain (``vega.dsl.ir``) of every tensor of a dtype group:
# stage ``s`` computes the reductions whose arguments need only those of earlier stages (axis
# reductions into temporaries, one loop over the reduced axis per output; per-tensor ones as
# per-block partials and a finish); the write launches then compute every new value from the
# old ones and the temporaries. The write over the elements runs first: the writes of
# per-row and per-column state read only that state, at the index they write.

DOMS, TAG = plan.DOMS, plan.TAG  # the domains in axis_geometry's order, and in identifiers
# table columns: the geometry of vega.codegen.plan but the elements' count (NUMEL) and the
# run lengths (which only the C kernels read), in capitals
GEOMETRY = {plan.column_name(name): what for name, what in plan.GEOMETRY[1:10]}
COUNT = {dom: "NUMEL" if dom == "rc" else plan.column_name(plan.COUNT[dom]) for dom in DOMS}
# a value of domain b read at an index of domain a: drop(index, inner, n)
DROP = {doms: tuple(map(plan.column_name, how)) for doms, how in plan.DROP.items()}
# an axis reduction into domain a of a value of domain b: put(index, inner, n, k) for k < n
PUT = {doms: tuple(map(plan.column_name, how)) for doms, how in plan.PUT.items()}


Launch, Plan, axis_plan = plan.Launch, plan.AxisPlan, plan.axis_plan


class _Ctx:
    """A block of indices of one domain where values are computed (``index``, ``mask``);
    a value of a smaller domain is computed at the indices it maps to (``subs``). In a loop
    over a reduced axis, ``outer`` is the block of outputs: a value of a domain it has is
    the one computed there, outside the loop."""

    def __init__(self, dom: str, index: str, mask: str, tag: str, lines: list[str],
                 outer: _Ctx | None = None, root: _Ctx | None = None):
        self.dom, self.index, self.mask, self.tag, self.lines = dom, index, mask, tag, lines
        self.outer, self.root = outer, root or self
        self.names: dict[int, str] = {}
        self.subs: dict[str, _Ctx] = {}


class _Refs:
    """What ``Renderer.expr`` asks of a Linear: each operand's name."""

    def __init__(self, names: dict[int, str]):
        self.names = names

    def ref(self, node: Node) -> str:
        return self.names[id(node)]


class _Emitter:
    """The body of one kernel of the staged path, over the values of domain ``dom``."""

    def __init__(self, src: Source, dom: str):
        self.src = src
        self.rx = TritonRenderer(src.ct)
        self.taken = set(src.taken)
        self.root = _Ctx(dom, "offsets", "mask", "", [])
        self.top: list[str] = []  # per-tensor values: reductions of earlier stages, and so on
        self.tensors: dict[int, str] = {}
        self.rounded: dict[int, Node] = {}  # scalars read (rounded once to ct)
        self.used: set[str] = set()  # p, g, states read
        self.stored: set[str] = set()  # targets whose old value is loaded at offsets
        self.columns: dict = {}
        self.column_lines: list[str] = []

    def fresh(self, base: str) -> str:
        new, k = base, 0
        while new in self.taken:
            k += 1
            new = f"{base}_{k}"
        self.taken.add(new)
        return new

    def column(self, key) -> str:
        """A local holding an integer column of this tensor's row: a geometry column (``key``
        its name, the local's in lower case) or the offset of temporary ``q`` (``key``:
        ("T", q); the local off_x, x the temporary's value)."""
        if key not in self.columns:
            col = self.src.col[key]
            self.columns[key] = name = key.lower() if isinstance(key, str) else \
                "off_" + self.src.lin.ref(self.src.plan.temps[key[1]])
            self.column_lines.append(f"{name} = index(tl.load(row + {col}), I32)")
        return self.columns[key]

    def sub(self, ctx: _Ctx, dom: str) -> _Ctx:
        """The indices of domain ``dom`` that the indices of ``ctx`` (a root) map to."""
        if dom not in ctx.subs:
            base = ctx if (ctx.dom, dom) in DROP else self.sub(ctx, "r")  # rc -> r -> matrix
            inner, n = DROP[(base.dom, dom)]
            index = self.fresh(f"{ctx.index}_{TAG[dom]}")
            ctx.lines.append(f"{index} = drop({base.index}, {self.column(inner)}, "
                             f"{self.column(n)})")
            ctx.subs[dom] = _Ctx(dom, index, ctx.mask, ctx.tag + TAG[dom], ctx.lines, ctx.outer,
                                 ctx)
        return ctx.subs[dom]

    def value(self, node: Node, ctx: _Ctx | None = None) -> str:
        """The name (or literal) of ``node``'s value at the indices of ``ctx``."""
        src = self.src
        if node.op is Op.CONST:
            return src.r.const(node.arg)
        if node.kind <= Kind.SCALAR:
            self.rounded[id(node)] = node
            return src.lin.ref(node)
        if node.kind == Kind.TENSOR:
            return self.tensor(node)
        root = ctx.root
        if node.dom != ctx.dom:
            if root.outer is not None and set(node.dom) <= set(root.outer.dom):
                return f"{self.value(node, root.outer)}[:, None]"
            return self.value(node, self.sub(root, node.dom))
        if id(node) in ctx.names:
            return ctx.names[id(node)]
        if node.op in (Op.PARAM, Op.GRAD, Op.STATE):
            x = src.lin.ref(node)
            self.used.add(x)
            if ctx is self.root and x in self.stored:
                text = f"{src.stored[x]}.to({src.ct})"
            else:
                text = f"tl.load({src.ptr[x]} + {ctx.index}, mask={ctx.mask}).to({src.ct})"
                if x == "g":
                    text += " * inv_scale * coef"
        elif node.op in AXIS_REDUCTIONS:  # the temporary of an earlier stage
            q = next(q for q, n in enumerate(src.plan.temps) if n is node)
            text = (f"tl.load(tmp_ptr + {self.column(('T', q))} + {ctx.index}, "
                    f"mask={ctx.mask})")
        else:
            names = {id(s): self.value(s, ctx) for s in node.src if s.op is not Op.CONST}
            text = self.rx.expr(_Refs(names), node, "element")
        base = src.lin.ref(node)
        name = base if ctx is self.root else self.fresh(f"{base}_{ctx.tag}")
        ctx.lines.append(f"{name} = {text}")
        ctx.names[id(node)] = name
        return name

    def tensor(self, node: Node) -> str:
        """A per-tensor value, computed once at the top of the kernel."""
        if id(node) not in self.tensors:
            src = self.src
            name = src.lin.ref(node)
            if node.op in REDUCTIONS:
                stage = next(launch.stage for launch in src.plan.launches
                             if any(n is node for n in launch.reductions))
                line = (f"{name} = tl.load(red_ptr + i * NRED + {src.slots[id(node)]})"
                        f".to({src.ct})  # {_WHAT[node.op]} from stage {stage}")
            else:
                names = {id(s): self.value(s) for s in node.src if s.op is not Op.CONST}
                line = f"{name} = {self.rx.expr(_Refs(names), node, 'element')}"
            self.top.append(line)
            self.tensors[id(node)] = name
        return self.tensors[id(node)]

    def gather(self, nodes: tuple[Node, ...]) -> list[str]:
        """Axis reductions into the root's domain: for each output, a loop over the reduced
        axis, KBLOCK values at a time (one loop per argument domain). Their names."""
        root, ct, out = self.root, self.src.ct, {}
        by_dom: dict[str, list[Node]] = {}
        for node in nodes:
            by_dom.setdefault(node.src[0].dom, []).append(node)
        for dom, group in by_dom.items():
            inner, n = (self.column(c) for c in PUT[(root.dom, dom)])
            k0, k, idx, kmask = (self.fresh(x) for x in ("k0", "k", "idx", "kmask"))
            body: list[str] = []
            ctx = _Ctx(dom, idx, kmask, "k", body, outer=root)
            xs = [self.value(node.src[0], ctx) for node in group]
            init, steps, done = [], [], []
            for node, x in zip(group, xs):
                name = self.src.lin.ref(node)
                how = AXIS_REDUCTIONS[node.op][1]
                if how == "max":
                    init.append(f"{name} = tl.full([BLOCK], float(\"-inf\"), {ct})")
                    steps.append(f"{name} = max_rows({name}, {x}, {kmask})")
                else:
                    init.append(f"{name} = tl.zeros([BLOCK], dtype={ct})")
                    steps.append(f"{name} += tl.sum(tl.where({kmask}, {x}, 0.0), axis=1)")
                if how == "mean":  # (RAW: a step over shards divides the combined sums)
                    done += ["if not RAW:", f"    {name} = {name} / {n}.to({ct})"]
                root.names[id(node)] = out[id(node)] = name
            what = ", ".join(f"{n.op.value}({x})" for n, x in zip(group, xs))
            root.lines += [f"# {what}", *init,
                           f"for {k0} in range(0, {n}, KBLOCK):",
                           f"    {k} = {k0} + tl.arange(0, KBLOCK)",
                           f"    {idx} = put({root.index}[:, None], {inner}, {n}, {k}[None, :])",
                           f"    {kmask} = {root.mask}[:, None] & ({k} < {n})[None, :]",
                           *(f"    {line}" for line in body + steps), *done]
        return [out[id(node)] for node in nodes]

    def kernel(self, tail_pointers: list[str], loads: list[str], nparts: int) -> dict:
        """The header macro's fields, once the body is generated."""
        src = self.src
        pointers = [src._pointer(x) for x in ("p", "g", *src.targets[1:])
                    if x in self.used or x in self.stored] + tail_pointers
        return {"pointers": pointers + self.column_lines,
                "scalar": src._scalar_reads(list(self.rounded.values())),
                "loads": loads, "lines": self.top + self.root.lines,
                "part": nparts > 0, "nparts": nparts, "tmp": True, "kblock": False,
                "count": COUNT[self.root.dom], "rebased": False, "advance": False}


class Source:
    """The Triton source of one program for one dtype group."""

    def __init__(self, program: Program, pdt: str, gdt: str, sdt: str):
        self.program, self.lin = program, linearize(program)
        self.dtypes = (pdt, gdt, sdt)
        # each value's storage dtype: p, g and each state's (s_<name>)
        self.storage = {"p": pdt, "g": gdt, **{
            state_var(name): dt for name, dt in zip(
                program.state_names, state_dtype_names(sdt, len(program.states)))}}
        # 8-bit states (vega.codegen.quant): codes, and their scales (whatever the key says:
        # the prelude's module is made for the gradients' dtype; a step checks its states)
        self.quant = {state_var(n): (state_var(sc), signed)
                      for n, (sc, signed) in program.quant.items()}
        self.scales = {sc for sc, _ in self.quant.values()}
        for name in program.state_names:  # (codes without scales: no kernel for them)
            if self.storage[state_var(name)] == "uint8" and name not in program.quant:
                raise codes_without_scales("triton", name)
        for x in self.quant:
            self.storage[x] = "uint8"
        for x in self.scales:
            self.storage[x] = "float32"
        self.ct = "tl.float64" if pdt == "float64" else "tl.float32"
        self.phases = reduction_phases(program)
        self.slots = {id(n): j for j, n in enumerate(n for ph in self.phases for n in ph)}
        self.plan = axis_plan(program) if program.uses_axes else None
        # states of one number per tensor: the scalars kernel reads their old values, which
        # the other kernels read from the step's scalars. Where every new value reads only
        # such old values, t and the hyperparameters (NAdam's product of momenta:
        # ``plan.per_step_states``, the nodes), it computes and writes the new values too,
        # and the other kernels read them from there; otherwise (NovoGrad's reads a norm of
        # g) the update computes them, and the program of each tensor's first block writes
        # them (``first_block``)
        self.scalar_targets = {state_var(s.name) for s in program.states
                               if s.dom == SCALAR_STATE}
        self.per_tensor = plan.per_step_states(program) or {}
        self.first_block = first_block(program)
        self.from_scal = dict(self.per_tensor)  # (ids of the values read from the scalars)
        for node in walk(n for _, n in program.updates):
            if node.op is Op.STATE and state_var(node.arg) in self.scalar_targets:
                self.from_scal[id(node)] = node
        self._names()
        self.r = TritonRenderer(self.ct)

    # -- names ----------------------------------------------------------------
    def _names(self) -> None:
        """The table's columns and the names made for the program's values (see the names
        above, and ``vega.codegen.base``): each the value's name behind a prefix of its own."""
        lin, prog = self.lin, self.program
        self.targets = ["p", *(state_var(s) for s in prog.state_names)]  # table order
        # the columns, keyed ("in", x) and ("out", x) for value x's, ("T", q) for the offset
        # of temporary q, by their own names for the others
        self.cols: list[dict] = [{"name": "NUMEL", "comment": "number of elements"}]
        self.col = {}

        def column(key, name, comment):
            self.col[key] = name
            self.cols.append({"name": name, "comment": comment})

        what = {"p": "parameter", "g": "gradient", **{state_var(s): f"state {s}"
                                                      for s in prog.state_names}}
        for x in ("p", "g", *self.targets[1:]):
            column(("in", x), f"C_{x}", what[x])
        column("STEP", "STEP", "int32 step counter (completed steps)")
        column("HYPER", "HYPER", "float64 hyperparameters: "
               f"{', '.join(prog.float_hypers) or 'none'}")
        for x in self.targets:
            column(("out", x), f"O_{x}", f"new {what[x]} (= C_{x} in place)")
        if self.plan is not None:
            for key, comment in GEOMETRY.items():
                column(key, key, comment)
            for q, node in enumerate(self.plan.temps):
                column(("T", q), f"T_{lin.ref(node)}", f"offset in tmp of {lin.ref(node)}, "
                       f"{DOMAIN_WORDS[node.dom]}")
        for k, col in enumerate(self.cols):
            col["index"] = k
        self.ptr = {x: f"ptr_{x}" for x in ("p", "g", *self.targets[1:])}
        self.out_ptr = {x: f"out_{x}" for x in self.targets}
        self.stored = {x: f"old_{x}" for x in self.targets}
        width = max(map(len, self.phases), default=0) if self.plan is None else \
            max((len(launch.reductions) for launch in self.plan.launches), default=0)
        self.partname = [f"part{q}" for q in range(width)]
        self.acc = [f"acc{q}" for q in range(width)]
        # the values' names: the emitter's names for values at other indices avoid them
        self.taken = set(lin.names.values())

    def _pointer(self, x: str, out: bool = False, rebased: bool = False) -> str:
        """The line that reads the address of ``x`` (p, g, a state; or its new value);
        ``rebased``: advanced to the block's first element (``at_block``)."""
        dt = self.storage[x]
        name, col = (self.out_ptr[x], self.col["out", x]) if out else \
            (self.ptr[x], self.col["in", x])
        if x in self.scales:  # one a block of quant.BLOCK values: from the block's first
            return (f"{name} = tl.load(row + {col}).to(tl.pointer_type(tl.float32)) + "
                    f"start // {quant.BLOCK}")
        if rebased:
            return f"{name} = at_block(row + {col}, {TL[dt]}, start, ALIGNED)"
        return f"{name} = tl.load(row + {col}).to(tl.pointer_type({TL[dt]}))"

    def _scalar_reads(self, rounded: list[Node]) -> list[str]:
        """The lines that read the scalars ``rounded`` a kernel's element phase reads, each
        from its slot of this step's scalars (``_scalars`` computes them once a step)."""
        lines = []
        for n in rounded:
            name = self.r.operand(self.lin, n)
            if id(n) not in self.scal:
                self.scal[id(n)] = (f"SCAL_{name}", n)
            read = f"tl.load(scal + {self.scal[id(n)][0]})"
            lines.append(f"{name} = {read} != 0" if n.dtype == "bool" else f"{name} = {read}")
        return lines

    def _scalars(self) -> dict:
        """The scalars kernel's lines: every scalar a kernel reads, computed in float64 from
        t and the hyperparameters over a block of tensors, and stored rounded to ct."""
        lin, r = self.lin, self.r
        wanted = [n for _, n in self.scal.values()]
        # the states of one number per tensor: every one's new value, whoever reads it
        news = {x: n for x, n in self._new_values().items()
                if x in self.scalar_targets and not self.first_block}
        scalar_nodes = {id(n): n for n in walk([*wanted, *news.values()])
                        if n.op is not Op.CONST}
        hyper_names = {n.arg for n in scalar_nodes.values() if n.op is Op.HYPER}
        hypers = [(k, h) for k, h in enumerate(self.program.float_hypers) if h in hyper_names]
        need_t = any(n.op is Op.T for n in scalar_nodes.values())
        lines = []
        if need_t:
            lines += ["step_ptr = tl.load(row + STEP, mask=rmask, other=0)"
                      ".to(tl.pointer_type(tl.int32))",
                      "t = tl.load(step_ptr, mask=rmask, other=0).to(tl.float64) + 1.0"]
        if hypers:
            lines.append("hyper_ptr = tl.load(row + HYPER, mask=rmask, other=0)"
                         ".to(tl.pointer_type(tl.float64))")
        for k, h in hypers:
            lines.append(f"{lin.hypers[k]} = tl.load(hyper_ptr + {k}, mask=rmask, other=0.0)")
        for line in lin.scalar_lines:
            if id(line.node) in scalar_nodes:
                lines.append(f"{line.var} = {r.expr(lin, line.node, 'scalar')}")
        if self._rounded():  # the generator's key of each tensor (vega.codegen.precision)
            lines += ["sr_step = tl.load(tl.load(row + STEP, mask=rmask, other=0)"
                      ".to(tl.pointer_type(tl.int32)), mask=rmask, other=0)",
                      f"sr_key = mix(mix(mix(tl.full([BLOCK], {self.program.rounding}, "
                      "tl.uint32)) ^ sr_step.to(tl.uint32)) ^ rows.to(tl.uint32))"]
        lines += self._per_tensor_lines(scalar_nodes, news)
        slots = []
        for k, (slot, n) in enumerate(self.scal.values()):
            name = r.operand(lin, n)
            slots.append({"name": slot, "index": 3 + k, "comment": name})
            value = f"tl.where({name}, 1.0, 0.0)" if n.dtype == "bool" else name  # (1 or 0)
            lines.append(f"keep(scal + {slot}, {value}, rmask)")
        if self._rounded():  # (the key, for the update kernels: two 16-bit halves)
            at = 3 + len(slots)
            slots += [{"name": "SCAL_KEY_HI", "index": at, "comment": "generator key, high half"},
                      {"name": "SCAL_KEY_LO", "index": at + 1,
                       "comment": "generator key, low half"}]
            lines += [f"tl.store(scal + SCAL_KEY_HI, (sr_key >> 16).to({self.ct}), mask=rmask)",
                      f"tl.store(scal + SCAL_KEY_LO, (sr_key & 0xFFFF).to({self.ct}), "
                      "mask=rmask)"]
        return {"lines": lines, "slots": slots}

    def _as_stored(self, value: str, x: str) -> str:
        """``value`` (in ct) as output ``x`` stores it: bfloat16 rounded to nearest even,
        another dtype converted (stochastic rounding aside: ``_stores``)."""
        st = self.storage[x]
        if st == "bfloat16":
            return f"to_bf16({value})"
        if st == "float16" and self.ct == "tl.float64":  # (through float32, as torch casts)
            return f"{value}.to(tl.float32).to(tl.float16)"
        return f"{value}.to({TL[st]})" if TL[st] != self.ct else value

    def _scalar_pointer(self, x: str, out: bool, masked: bool) -> str:
        """The line reading the address of state ``x`` of one number per tensor (``out``: of
        its new value) from the table row(s); ``masked``: rows of the scalars kernel."""
        name, col = (f"out_{x}", self.col["out", x]) if out else (f"ptr_{x}", self.col["in", x])
        rows = ", mask=rmask, other=0" if masked else ""
        return (f"{name} = tl.load(row + {col}{rows})"
                f".to(tl.pointer_type({TL[self.storage[x]]}))")

    def _kept(self, x: str, node: Node | None) -> bool:
        """Whether the program keeps state ``x`` as it is (no new value, or its old one)."""
        return node is None or (node.op is Op.STATE and self.lin.ref(node) == x)

    def _per_tensor_lines(self, nodes: dict, news: dict) -> list[str]:
        """The scalars kernel's lines for the states of one number per tensor: each one's
        old value read, the values of one per tensor computed from them in the arithmetic's
        dtype (ct, as the other kernels compute values of one per tensor: the scalars they
        read rounded once to it), and each new value written where the step is finite (the
        old one, as it was, where it is skipped)."""
        lin, r = self.lin, self.r
        lines = []
        read = {lin.ref(n) for n in nodes.values() if n.op is Op.STATE}
        olds = [x for x in self.targets if x in self.scalar_targets
                and (not self.first_block or x in read)]
        for x in olds:  # (the bits as stored, and the value in ct)
            lines += [self._scalar_pointer(x, out=False, masked=True),
                      f"raw_{x} = tl.load(ptr_{x}, mask=rmask, other=0.0)",
                      f"{x} = raw_{x}.to({self.ct})"]
        names = dict(lin.names)  # the scalars they read, rounded to ct under names of their own
        computed = [line for line in lin.element_lines
                    if id(line.node) in self.per_tensor and id(line.node) in nodes]
        for line in computed:
            for src in line.node.src:
                if src.kind <= Kind.SCALAR and src.op is not Op.CONST \
                        and not names[id(src)].endswith("_ct"):
                    names[id(src)] = f"{lin.ref(src)}_ct"
                    lines.append(f"{names[id(src)]} = {lin.ref(src)}.to({self.ct})")
        refs = _Refs(names)
        for line in computed:
            lines.append(f"{line.var} = {r.expr(refs, line.node, 'element')}")
        for x in [] if self.first_block else olds:
            node = news.get(x)
            lines.append(self._scalar_pointer(x, out=True, masked=True))
            if self._kept(x, node):  # (copied: a step out of place writes it)
                lines.append(f"tl.store(out_{x}, raw_{x}, mask=rmask)")
                continue
            value = r.operand(refs, node)
            if node.op is Op.CONST:
                value = f"tl.full([BLOCK], {value}, {self.ct})"
            stored = (f"to_bf16_sr({value}, mix(sr_key + {self._slot(x)}), "
                      "tl.zeros([BLOCK], dtype=tl.uint32))") if x in self._rounded() else \
                self._as_stored(value, x)  # (a number's element index j is 0)
            lines.append(f"tl.store(out_{x}, tl.where(finite, {stored}, raw_{x}), mask=rmask)")
        return lines

    # -- kernels --------------------------------------------------------------
    def _kernel(self, roots: list[Node], update: bool) -> dict:
        lin, r = self.lin, self.r
        lines, earlier, needed = _needed(roots, [] if update else roots)
        once = self.from_scal  # (read from the scalars kernel's slots)
        lines = [n for n in lines if id(n) not in once]
        used = {lin.ref(n) for n in needed if n.op in (Op.PARAM, Op.GRAD, Op.STATE)
                and id(n) not in once}
        used |= {self.quant[x][0] for x in used if x in self.quant}  # (and their scales)
        # the scalars the element lines read (rounded once to ct), and the scalar lines they need
        readers = [n for n in needed if n.kind >= Kind.TENSOR and not any(n is e for e in earlier)
                   and id(n) not in once]
        rounded = {id(s): s for m in readers for s in m.src
                   if (s.kind <= Kind.SCALAR or id(s) in once) and s.op is not Op.CONST}
        if update:
            rounded.update({id(n): n for x, n in self._new_values().items()
                            if (n.kind <= Kind.SCALAR or id(n) in once) and n.op is not Op.CONST
                            and (x not in self.scalar_targets or self.first_block)})
        rounded = list(rounded.values())
        written = [x for x in self.targets if x not in self.scalar_targets]
        pointers = [self._pointer(x, rebased=True) for x in ("p", "g", *written[1:])
                    if x in used or (update and x != "g")]
        if update:
            pointers += [self._pointer(x, out=True, rebased=True) for x in written]
        scalar = self._scalar_reads(rounded)
        loads = []
        for x in written if update else []:
            at = f"offsets // {quant.BLOCK}" if x in self.scales else "offsets"
            loads.append(f"{self.stored[x]} = tl.load({self.ptr[x]} + {at}, mask=mask)")
        for x in ("p", "g", *self.targets[1:]):
            if x not in used:
                continue
            if x in self.quant:  # 8 bits: each code with its block's scale
                sc, signed = self.quant[x]
                codes, scale = (self.stored[x], self.stored[sc]) if update else (
                    f"tl.load({self.ptr[x]} + offsets, mask=mask)",
                    f"tl.load({self.ptr[sc]} + offsets // {quant.BLOCK}, mask=mask)")
                loads.append(f"{x} = q8_{'signed' if signed else 'unsigned'}({codes}, "
                             f"{scale}).to({self.ct})")
            elif x in self.scales and not update:
                continue
            elif x == "g":
                loads.append(f"g = tl.load({self.ptr['g']} + offsets, mask=mask)"
                             f".to({self.ct}) * inv_scale * coef")
            elif update:
                loads.append(f"{x} = {self.stored[x]}.to({self.ct})")
            else:
                loads.append(f"{x} = tl.load({self.ptr[x]} + offsets, mask=mask)"
                             f".to({self.ct})")
        body = []
        for n in earlier:
            body.append(f"{r.operand(lin, n)} = tl.load(red_ptr + i * NRED + "
                        f"{self.slots[id(n)]}).to({self.ct})  # {_WHAT[n.op]} from phase "
                        f"{self._phase_of(n)}")
        for n in lines:
            body.append(f"{r.operand(lin, n)} = {r.expr(lin, n, 'element')}")
        return {"pointers": pointers, "scalar": scalar, "loads": loads, "lines": body,
                "part": not update, "nparts": len(roots) if not update else 0, "tmp": False,
                "kblock": False, "count": "NUMEL", "rebased": True, "advance": update,
                "tail": [], "comment": "this block's share of each reduction"}

    def _phase_of(self, node: Node) -> int:
        return next(k for k, ph in enumerate(self.phases) if any(n is node for n in ph))

    def _phase(self, k: int, phase: list[Node]) -> dict:
        kernel = self._kernel(phase, update=False)
        xs = [self.r.operand(self.lin, node.src[0]) for node in phase]
        red = self._reductions(phase, xs, "NUMEL")
        kernel["tail"] = red["partials"]
        return {"k": k, "kernel": kernel, **red}

    def _reductions(self, phase: list[Node], xs: list[str], count: str) -> dict:
        """Per-tensor reductions of the values ``xs`` of one block: each block's partial
        results, and the finish kernel's lines (``count``: the column of the tensor's
        number of values)."""
        lin, r, np_ = self.lin, self.r, len(phase)
        partials, acc_init, acc_step, results = [], [], [], []
        for q, (node, x) in enumerate(zip(phase, xs)):
            name, part, acc = r.operand(lin, node), self.partname[q], self.acc[q]
            at = f"part_ptr + pid * {np_} + {q}"
            if node.op is Op.AMAX:
                partials.append(f"{part} = tl.where(mask, {x}, float(\"-inf\")).to(tl.float64)")
                partials.append(f"tl.store({at}, nanmax({part}))  # {name}: max({x})")
                acc_init.append(f"{acc} = tl.full([BLOCK], float(\"-inf\"), tl.float64)")
                acc_step.append(f"part = tl.load(part_ptr + blocks * {np_} + {q}, mask=mask, "
                                "other=float(\"-inf\"))")
                acc_step.append(f"{acc} = tl.maximum({acc}, part, "
                                "propagate_nan=tl.PropagateNan.ALL)")
            else:
                partials.append(f"{part} = tl.where(mask, {x}, 0.0).to(tl.float64)")
                total = f"{part} * {part}" if node.op is Op.NORM else part
                partials.append(f"tl.store({at}, tl.sum({total}))  # {name}: "
                                f"{_WHAT[node.op]}({x})")
                acc_init.append(f"{acc} = tl.zeros([BLOCK], dtype=tl.float64)")
                acc_step.append(f"{acc} += tl.load(part_ptr + blocks * {np_} + {q}, mask=mask, "
                                "other=0.0)")
            raw = f"nanmax({acc})" if node.op is Op.AMAX else f"tl.sum({acc})"
            value = {Op.NORM: f"tl.sqrt({raw})", Op.MEAN: f"{raw} / numel"}.get(node.op, raw)
            at = f"red_ptr + i * NRED + {self.slots[id(node)]}"
            results += ([f"if RAW:  # {name}", f"    tl.store({at}, {raw})", "else:",
                         f"    tl.store({at}, {value})"] if value != raw else
                        [f"tl.store({at}, {value})  # {name}"])
        if any(n.op is Op.MEAN for n in phase):
            results.insert(0, f"numel = tl.load(table_ptr + i * ROW + {count}).to(tl.float64)")
        what = ", ".join(f"{_WHAT[n.op]}" for n in phase)
        return {"partials": partials, "acc_init": acc_init, "acc_step": acc_step,
                "results": results, "what": what}

    def _update(self) -> dict:
        kernel = self._kernel([n for _, n in self.program.updates], update=True)
        lin, r = self.lin, self.r
        new = self._new_values()
        kernel["tail"] = self._stores([x for x in self.targets if x not in self.scalar_targets],
                                      new,
                                      {x: r.operand(lin, n) for x, n in new.items()},
                                      "start + offsets") + self._first_block_stores(new)
        kernel["scalar"] = kernel["scalar"] + self._keys()
        kernel["comment"] = ("new values where the step is finite; a skipped step writes the "
                             "old bits")
        return kernel

    def _first_block_stores(self, new: dict) -> list[str]:
        """Where the update computes the new values of the states of one number per tensor
        (``first_block``): the program of each tensor's first block writes them (the old
        bits where the step is skipped). Every program read the old values from the
        scalars, so none reads one already replaced."""
        if not self.first_block:
            return []
        lines = ["if start == 0:  # this tensor's numbers, once"]
        for x in sorted(self.scalar_targets, key=self.targets.index):
            node = new.get(x)
            lines += ["    " + self._scalar_pointer(x, out=False, masked=False),
                      "    " + self._scalar_pointer(x, out=True, masked=False)]
            if self._kept(x, node):
                lines.append(f"    tl.store(out_{x}, tl.load(ptr_{x}))")
                continue
            value = self.r.operand(self.lin, node)
            if node.op is Op.CONST:
                value = f"tl.full((), {value}, {self.ct})"
            stored = f"to_bf16_sr({value}, key_{x}, tl.zeros((), dtype=tl.uint32))" \
                if x in self._rounded() else self._as_stored(value, x)
            lines += ["    if finite:",
                      f"        tl.store(out_{x}, {stored})",
                      "    else:",
                      f"        tl.store(out_{x}, tl.load(ptr_{x}))"]
        return lines

    def _new_values(self) -> dict[str, Node]:
        return {state_var(t) if t != "p" else "p": n for t, n in self.program.updates}

    def _slot(self, x: str) -> int:
        """The generator's slot of output ``x`` (0: p, 1 + k: state k; ``precision``)."""
        return self.targets.index(x)

    def _rounded(self) -> list[str]:
        """The outputs stored stochastically rounded: the bfloat16 ones, where the program
        rounds so."""
        if self.program.rounding is None:
            return []
        return [x for x in self.targets if self.storage[x] == "bfloat16"]

    def _keys(self) -> list[str]:
        """The lines that read this tensor's generator key (two 16-bit halves from the
        scalars) and make each rounded output's (``precision``)."""
        if not self._rounded():
            return []
        return ["key = (tl.load(scal + SCAL_KEY_HI).to(tl.uint32) << 16) | "
                "tl.load(scal + SCAL_KEY_LO).to(tl.uint32)",
                *(f"key_{x} = mix(key + {self._slot(x)})" for x in self._rounded())]

    def _stores(self, targets, new: dict, values: dict, index: str = "offsets") -> list[str]:
        """The lines that write each target's new value (``new[x]``, named ``values[x]``) at
        ``offsets`` where the step is finite; a skipped step copies the old bits (read again
        there, so that they are not held through the arithmetic)."""
        finite, skipped = [], []
        for x in targets:
            node, value = new.get(x), values.get(x, "")
            if x in self.scales:  # written with the codes; a skipped step copies them
                q = f"tl.arange(0, BLOCK // {quant.BLOCK})"
                skipped += [f"    qs = {q}",
                            f"    tl.store({self.out_ptr[x]} + qs, tl.load({self.ptr[x]} + qs, "
                            f"mask=qs * {quant.BLOCK} < n), mask=qs * {quant.BLOCK} < n)"]
                continue
            old = f"tl.load({self.ptr[x]} + offsets, mask=mask)"
            skipped.append(f"    tl.store({self.out_ptr[x]} + offsets, {old}, mask=mask)")
            if x in self.quant:
                sc, signed = self.quant[x]
                if node.kind < Kind.ELEMENT or node.op is Op.CONST:
                    value = _as_block(value, self.ct)
                finite.append(f"    q8_store({value}.to(tl.float32), mask, n, "
                              f"{self.out_ptr[x]}, {self.out_ptr[sc]}, {signed}, BLOCK)")
                continue
            if node is None:  # not updated by the program: the old value, as it was
                finite.append(f"    tl.store({self.out_ptr[x]} + offsets, {self.stored[x]}, "
                              "mask=mask)")
                continue
            if node.op is Op.CONST:
                value = f"tl.full([BLOCK], {value}, {self.ct})"
            elif node.kind < Kind.ELEMENT:  # one value per tensor: as a block (an expression:
                # a name bound before the branch keeps its type in it, on a GPU)
                value = _as_block(value, self.ct)
            value = f"to_bf16_sr({value}, key_{x}, {index})" if x in self._rounded() \
                else self._as_stored(value, x)
            finite.append(f"    tl.store({self.out_ptr[x]} + offsets, {value}, mask=mask)")
        return ["if finite:", *finite, "else:  # a skipped step: the old bits, as they were",
                *skipped]

    def _axes(self) -> list[dict]:
        """The kernels of the staged path, in launch order (see ``axis_plan``)."""
        out, finishes, new = [], {}, self._new_values()
        for launch in self.plan.launches:
            entry = {"fn": launch.fn, "finish": launch.kind == "finish", "dom": launch.dom}
            what = [f"{n.op.value}({self.lin.ref(n.src[0])})"
                    for n in launch.gathers]
            if launch.kind == "finish":
                out.append({**entry, **finishes[launch.stage, launch.dom],
                            "nparts": len(launch.reductions)})
                continue
            em = _Emitter(self, launch.dom)
            tail = []
            if launch.kind == "stage":
                names = em.gather(launch.gathers)
                for node, name in zip(launch.gathers, names):
                    q = next(q for q, n in enumerate(self.plan.temps) if n is node)
                    tail.append(f"tl.store(tmp_ptr + {em.column(('T', q))} + offsets, {name}, "
                                "mask=mask)")
                if launch.reductions:
                    xs = [em.value(n.src[0], em.root) for n in launch.reductions]
                    red = self._reductions(list(launch.reductions), xs,
                                           COUNT[launch.dom])
                    finishes[launch.stage, launch.dom] = red
                    tail += red["partials"]
                    what += [f"{_WHAT[n.op]}({x})" for n, x in zip(launch.reductions, xs)]
                kernel = em.kernel([], [], len(launch.reductions))
                kernel["kblock"] = launch.wide
                comment = "; ".join(
                    ([f"the temporaries, {DOMAIN_WORDS[launch.dom]}"] if launch.gathers else [])
                    + (["this block's share of each reduction"] if launch.reductions else []))
            else:
                em.stored = set(launch.targets)
                values = {x: em.value(new[x], em.root) for x in launch.targets if x in new}
                tail += self._stores(launch.targets, new, values)
                loads = [f"{self.stored[x]} = tl.load({self.ptr[x]} + offsets, mask=mask)"
                         for x in launch.targets]
                kernel = em.kernel([self._pointer(x, out=True) for x in launch.targets], loads, 0)
                kernel["scalar"] = kernel["scalar"] + self._keys()
                comment = "new values where the step is finite; a skipped step writes the old bits"
                what = [f"new {', '.join(launch.targets)}"]
            kernel["tail"], kernel["comment"] = tail, comment
            out.append({**entry, "kernel": kernel, "what": ", ".join(what)})
        return out

    def text(self) -> str:
        pdt, gdt, sdt = self.dtypes
        prog = self.program
        flags = ", ".join(f"{k}={str(v).lower()}" for k, v in prog.flags) or "none"
        nodes = walk(n for _, n in prog.updates)
        axes = self.plan is not None
        self.scal = {}  # id -> (slot, node): the scalars the kernels read, in order
        phases = [] if axes else [self._phase(k, ph) for k, ph in enumerate(self.phases)]
        update = None if axes else self._update()
        staged = self._axes() if axes else None
        return _template().render(
            name=kernel_prefix(prog), optimizer=prog.name, flags=flags, pdt=pdt, gdt=gdt,
            sdt=sdt, ct=self.ct[3:], ctl=self.ct,
            gct="tl.float64" if gdt == "float64" else "tl.float32", gtl=TL[gdt],
            columns=self.cols, nred=len(self.slots), pre_slots=named("PRE", PRE_SLOTS),
            needs_pow=any(n.op is Op.POW for n in nodes), helpers=_helpers(nodes),
            needs_bf16="bfloat16" in (pdt, *self.storage.values()),
            to_bf16=precision.TRITON_TO_BF16,
            rounding=(precision.TRITON_HELPERS if self._rounded() else "")
            + (quant.TRITON_HELPERS if self.quant else ""),
            needs_nanmax=any(n.op is Op.AMAX for n in nodes),
            needs_rowmax=any(n.op in (Op.ROW_MAX, Op.COL_MAX) for n in nodes),
            phases=phases, update=update, axes=staged, scalars=self._scalars(), doms=TAG,
            drop_expr=plan.DROP_EXPR,
            put_expr=plan.PUT_EXPR)


_SERIAL = itertools.count()


# the dtypes of a loss scale's tensors (``LossScale.tensors()``: the scale, its good and
# skipped steps, its floor) as the update that adjusts it reads them (the template's advance)
_SCALE_DTYPES = (torch.float32, torch.int32, torch.int32, torch.float32)


def first_block(program: Program) -> bool:
    """Whether the update computes the new values of ``program``'s states of one number per
    tensor (a new value reads a reduction of the elements: ``plan.per_step_states``), and
    the program of each tensor's first block writes them; otherwise the scalars kernel
    does, once a step."""
    return program.scalar_states and plan.per_step_states(program) is None


def kernel_prefix(program: Program) -> str:
    """What the names of a program's kernels begin with (``vega_adamw_update``)."""
    return f"vega_{program.name}"


@cache
def _template():
    import jinja2

    text = files("vega.codegen").joinpath("templates", "triton.py.j2").read_text()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    return env.from_string(text)


class Kernel:
    """The Triton kernels of one program: one module per dtype group, built on first use."""

    backend = "triton"
    takes_rows = True  # values may come as a HyperRows table
    state_dtypes = frozenset(triton_runtime.DTYPES)  # (a class step checks states' first)
    # a step in place refuses, before its first launch, any tensor it cannot write
    # (triton_runtime: the native table builder's checks, or refuse_inplace)
    checks_writes = True

    def __init__(self, program: Program):
        self.program = program
        self._reference = reference.Kernel(program)
        self.phases = reduction_phases(program)
        self.phase_sizes = [len(p) for p in self.phases]
        self.nred = sum(self.phase_sizes)
        self.global_keys = reference.global_keys(program)  # its reductions over a group
        # the update writes the states of one number per tensor, in each tensor's first
        # block: an empty tensor gets a block too
        self.first_block = first_block(program)
        # the staged path's launches (kind, kernel, domain, wide, partial results, stage),
        # and its stages (``axes``)
        self.plan = self.axes = None
        self._of_elements = not program.uses_axes and of_elements(self.phases)
        if program.uses_axes:
            self.axes = staged = axis_plan(program)
            self.plan = ([(x.kind, x.fn, DOMS.index(x.dom), x.wide, len(x.reductions),
                           x.stage) for x in staged.launches],
                         [DOMS.index(n.dom) for n in staged.temps])
        text = self.source()
        self.prefix = kernel_prefix(program)  # of the kernels' names
        # the modules' name, by their source; the custom ops' name for this kernel, its own
        self.module_name = f"{program.name}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"
        serial = next(_SERIAL)
        self.key = f"{self.module_name}-{serial}"
        # its number, the first argument of the C++ operator's table builder (``triton_rows``,
        # which reads nothing of it: it keeps nothing between steps; the C kernels' numbers
        # are 0 and up)
        self.native_id = -2 - serial
        self._modules: dict[tuple, dict] = {}
        triton_runtime.register(self)

    def source(self, dtypes=("float32", "float32", "float32")) -> str:
        return Source(self.program, *dtypes).text()

    def module(self, dtypes: tuple[str, str, str]) -> dict:
        """The namespace of the loaded module for a dtype group (interpreted or not)."""
        key = (dtypes, triton_runtime.interpreting())
        if key not in self._modules:
            self._modules[key] = triton_runtime.load_module(
                self.source(dtypes), f"{self.module_name}-{'-'.join(dtypes).replace(',', '_')}")
        return self._modules[key]

    def init(self, p, values, state_dtype):
        return self._reference.init(p, values, state_dtype)

    writes_record = True  # its prelude can write a new record whole (``prelude``'s init)

    def prelude(self, grads, pre: torch.Tensor, init=None) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``;
        given ``init`` (``(inverse loss scale or None, max_norm, check, loss scale or
        None)``), ``pre`` is new and this writes all of it, no copy of a blank record
        first."""
        triton_runtime.check_mode()
        triton_runtime.prelude(self, grads, pre, init)

    def adjusts(self, params, donate: bool, loss_scale) -> bool:
        """Whether a step of ``params`` (``donate``: in place) adjusts ``loss_scale`` itself
        (``__call__``'s ``adjust``), in its last launch: eagerly, a dynamic scale on the
        parameters' device, at least one parameter, each of the scale's tensors one value
        of the dtype the kernel reads it as (``_SCALE_DTYPES``: the constructor takes
        others, which ``LossScale.adjust_`` adjusts in torch)."""
        return (donate and bool(params) and loss_scale is not None and loss_scale.is_dynamic
                and not torch.compiler.is_compiling() and not self.program.spans_group
                and all(t.device == params[0].device and t.dtype == dt and t.numel() == 1
                        for t, dt in zip(loss_scale.tensors(), _SCALE_DTYPES)))

    def check_devices(self, params) -> None:
        """ValueError where a step of ``params`` would refuse their devices when it launches
        (``triton_runtime.check_device``), for a caller that checks several calls before the
        first writes; a program handed to the reference's operations runs on any."""
        if not (self.program.spans_group and not self.stageable):
            for device in {p.device for p in params}:
                triton_runtime.check_device(device)

    def __call__(self, params, grads, states, steps, values, donate, pre=None, adjust=None):
        """The same contract as ``vega.codegen.reference.Kernel.__call__``; ``adjust``: a
        ``LossScale`` to adjust in place, where ``adjusts`` said so."""
        triton_runtime.check_mode()
        if self.program.spans_group:  # its reductions over the group, between phases
            kern = self if self.stageable else self._reference
            return run_staged(kern, params, grads, states, steps, values, donate, pre)
        return triton_runtime.step(self, params, grads, states, steps, values, donate, pre,
                                   adjust)

    @property
    def stageable(self) -> bool:
        """Whether ``staged`` runs this program here: its reductions are per tensor, each of
        per-element values, or it is a program over a matrix view without reductions over
        a group (``vega.codegen.c.Kernel.stageable``). Not a step that dynamo traces
        (``staged`` launches the kernels itself, not through ``vega::triton_step``, which is
        what a traced step calls): the reference's staged step runs there."""
        return (self._of_elements or self.plan is not None and not self.program.spans_group) \
            and not torch.compiler.is_compiling()

    def staged(self, params, grads, states, steps, values, donate, pre, views):
        """``vega.codegen.reference.Kernel.staged`` in these kernels (where ``stageable``):
        ``triton_runtime.staged``."""
        triton_runtime.check_mode()
        return triton_runtime.staged(self, params, grads, states, steps, values, donate, pre,
                                     views)


def available() -> bool:
    """Whether triton is installed here (without importing it)."""
    return importlib.util.find_spec("triton") is not None
