"""The typed IR: the contract between the front end and every backend.

A program is a DAG of small frozen nodes. Each node has a dtype (float or bool)
and a *kind* that says how it varies:

- ``CONST``: a compile-time constant (folded away wherever possible);
- ``SCALAR``: one value per step (hyperparameters, ``t`` and what is computed
  from them) -- hoisted out of the per-element loop;
- ``TENSOR``: one value per parameter tensor (the result of a reduction such as
  ``norm(p)``);
- ``ELEMENT``: one value per element (``p``, ``g``, state, and what uses them).

An ``ELEMENT`` node also has a *domain* (``dom``): which axes of the tensor's
matrix view it keeps. Every tensor is viewed as a batch of matrices whose row
and column axes are its two largest (the column axis the largest; a vector is
one row, a scalar a 1x1 matrix). ``"rc"`` is one value per element, ``"r"``
one per row (the column axis reduced away), ``"c"`` one per column, ``""``
one per matrix. A value of a smaller domain broadcasts into a larger one.

Nodes compare by identity (``eq=False``), so a DAG with shared subtrees is
cheap to hash and walk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import numpy as np

from vega.errors import Span


class Kind(IntEnum):
    CONST = 0
    SCALAR = 1
    TENSOR = 2
    ELEMENT = 3


class Op(Enum):
    # leaves
    CONST = "const"
    HYPER = "hyper"  # a float hyperparameter (arg: name)
    T = "t"  # the 1-based index of this update
    PARAM = "p"
    GRAD = "g"
    STATE = "state"  # the state's value before this step (arg: name)
    # arithmetic
    NEG = "neg"
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"
    POW = "^"
    # comparisons and logic
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    EQ = "=="
    NE = "!="
    AND = "and"
    OR = "or"
    NOT = "not"
    WHERE = "where"
    # elementwise functions
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    EXP = "exp"
    LOG = "log"
    ABS = "abs"
    SIGN = "sign"
    MIN = "min"
    MAX = "max"
    ATAN2 = "atan2"
    TANH = "tanh"
    SIN = "sin"
    COS = "cos"
    ERF = "erf"
    LOG1P = "log1p"
    EXPM1 = "expm1"
    SIGMOID = "sigmoid"
    FLOOR = "floor"
    ROUND = "round"
    # per-tensor reductions: one value per tensor
    NORM = "norm"
    SUM = "sum"
    MEAN = "mean"
    AMAX = "amax"
    # axis reductions over the matrix view: row_* reduce the column axis (one value
    # per row), col_* the row axis (one value per column)
    ROW_SUM = "row_sum"
    ROW_MEAN = "row_mean"
    ROW_MAX = "row_max"
    COL_SUM = "col_sum"
    COL_MEAN = "col_mean"
    COL_MAX = "col_max"
    # matrices (the matrix view): a product, a transpose; the tensor's size along an axis;
    # a value rounded to bfloat16 (what is computed from it stays there, as torch's types do)
    MATMUL = "@"
    MATMUL_ADD = "@+"  # x + a @ b, one node of the reference's (vega.codegen.reference)
    MATMUL_SHIFT = "@s"  # s * b + a @ b, a square: (a + s I) @ b, one node of the reference's
    SHIFT = "+sI"  # b + s I (b square, in b's and x's dtype): the Gram form's (vega.codegen.gram)
    TRANSPOSE = "transpose"
    SIZE = "size"
    BF16 = "bfloat16"
    WIDEN = "widen"  # a value (of bfloat16) in the step's compute type again


LEAVES = frozenset({Op.CONST, Op.HYPER, Op.T, Op.PARAM, Op.GRAD, Op.STATE})
REDUCTIONS = frozenset({Op.NORM, Op.SUM, Op.MEAN, Op.AMAX})
# axis reduction -> (the axis it removes, how it combines: "sum" | "mean" | "max")
AXIS_REDUCTIONS = {Op.ROW_SUM: ("c", "sum"), Op.ROW_MEAN: ("c", "mean"), Op.ROW_MAX: ("c", "max"),
                   Op.COL_SUM: ("r", "sum"), Op.COL_MEAN: ("r", "mean"), Op.COL_MAX: ("r", "max")}
DOMAINS = ("rc", "r", "c", "")  # per element, per row, per column, per matrix
# a state's shape beside the domains: one number per tensor (``state d: scalar``), a 0-d
# tensor; read as a TENSOR value
SCALAR_STATE = "s"
QBLOCK = "q"  # a state of one value per block of 256 (vega.codegen.quant's scales)
# the mark (``Node.arg``) of a reduction over every tensor of a group (``global_sum``):
# a per-tensor reduction to every backend's kernels, whose per-tensor results the step
# combines over the group (and across processes) between stages
GLOBAL = "global"
# the matrices a product or a transpose makes of the matrix view (rows x columns, "rc"):
# rows x rows ("rr", x @ transpose(x)), columns x columns ("cc"), columns x rows ("cr")
MATRIX_DOMAINS = ("rr", "cc", "cr")
MATRIX_OPS = frozenset({Op.MATMUL, Op.TRANSPOSE, Op.MATMUL_ADD, Op.MATMUL_SHIFT})
# what only the reference kernels compute (a program with any runs there on every backend)
TORCH_ONLY_OPS = frozenset({Op.MATMUL, Op.TRANSPOSE, Op.SIZE, Op.BF16, Op.WIDEN})
DOMAIN_WORDS = {"rr": "a rows x rows matrix", "cc": "a columns x columns matrix",
                "cr": "a columns x rows matrix (a transpose)",
                "rc": "one value per element", "r": "one value per row",
                "c": "one value per column", "": "one value per matrix",
                SCALAR_STATE: "one number per tensor (a 0-d tensor)",
                QBLOCK: "one value per block of 256 (an 8-bit state's scales)"}


def join(*doms: str) -> str:
    """The smallest domain every one of ``doms`` broadcasts into (a matrix of a product:
    that matrix, which the checks let meet only its own kind)."""
    for d in doms:
        if d in MATRIX_DOMAINS:
            return d
    return "".join(a for a in "rc" if any(a in d for d in doms))
COMPARISONS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
LOGIC = frozenset({Op.AND, Op.OR, Op.NOT})

def _ieee(fn):
    """``fn`` on float64 values as the kernels compute it: inf or NaN where Python's
    arithmetic would raise (0 ^ -1, exp(1000)) or turn complex ((-8) ^ 0.5)."""
    def run(*args):
        with np.errstate(all="ignore"):
            return float(fn(*(np.float64(a) for a in args)))
    return run


# Python meaning of each foldable op, used for constant folding: what a kernel computes
# (NaN propagates through min, max and sign; signed zeros and infinities as IEEE has them).
_FOLD = {
    Op.NEG: lambda a: -a,
    Op.ADD: lambda a, b: a + b,
    Op.SUB: lambda a, b: a - b,
    Op.MUL: lambda a, b: a * b,
    Op.DIV: _ieee(np.divide),
    Op.POW: _ieee(np.power),
    Op.LT: lambda a, b: a < b,
    Op.LE: lambda a, b: a <= b,
    Op.GT: lambda a, b: a > b,
    Op.GE: lambda a, b: a >= b,
    Op.EQ: lambda a, b: a == b,
    Op.NE: lambda a, b: a != b,
    Op.AND: lambda a, b: a and b,
    Op.OR: lambda a, b: a or b,
    Op.NOT: lambda a: not a,
    Op.SQRT: _ieee(np.sqrt),
    Op.RSQRT: _ieee(lambda a: 1 / np.sqrt(a)),
    Op.EXP: _ieee(np.exp),
    Op.LOG: _ieee(np.log),
    Op.ABS: abs,
    Op.SIGN: lambda a: a if a != a or a == 0 else math.copysign(1.0, a),
    Op.MIN: lambda a, b: a if a < b or a != a else b,
    Op.MAX: lambda a, b: a if a > b or a != a else b,
    Op.ATAN2: _ieee(np.arctan2),
    Op.TANH: _ieee(np.tanh),
    Op.SIN: _ieee(np.sin),
    Op.COS: _ieee(np.cos),
    Op.ERF: lambda a: math.erf(a) if a == a else a,
    Op.LOG1P: _ieee(np.log1p),
    Op.EXPM1: _ieee(np.expm1),
    Op.SIGMOID: _ieee(lambda a: 1 / (1 + np.exp(-a))),
    Op.FLOOR: _ieee(np.floor),
    Op.ROUND: _ieee(np.rint),  # half to even, as torch.round
}


@dataclass(frozen=True, eq=False)
class Node:
    op: Op
    src: tuple[Node, ...] = ()
    arg: object = None
    dtype: str = "float"  # "float" | "bool"
    kind: Kind = Kind.CONST
    span: Span | None = field(default=None, repr=False)
    name: str | None = None  # the spec's name for this value, for readable output
    dom: str = "rc"  # for ELEMENT nodes: the axes of the matrix view the value keeps

    def __repr__(self) -> str:
        if self.op is Op.CONST:
            return repr(self.arg)
        if self.op in LEAVES:
            return str(self.arg or self.op.value)
        return f"{self.op.value}({', '.join(map(repr, self.src))})"


def const(value, span: Span | None = None) -> Node:
    dtype = "bool" if isinstance(value, bool) else "float"
    return Node(Op.CONST, (), value if dtype == "bool" else float(value), dtype, Kind.CONST, span)


def leaf(op: Op, kind: Kind, arg=None, span: Span | None = None, dom: str = "rc") -> Node:
    return Node(op, (), arg, "float", kind, span, dom=dom)


def _result_dtype(op: Op, src: tuple[Node, ...]) -> str:
    if op in COMPARISONS or op in LOGIC:
        return "bool"
    if op is Op.WHERE:
        return src[1].dtype
    return "float"


def apply(op: Op, *src: Node, span: Span | None = None) -> Node:
    """A new node, folded when its value is known at compile time."""
    dtype = _result_dtype(op, src)
    if op is Op.POW and src[1].op is Op.CONST:  # (a number's too: (-0.0) ^ -0.5 is -inf,
        special = _power(src[0], src[1].arg, span)  # as p ^ -0.5 at p = -0.0, not pow's inf)
        if special is not None:
            return special
    if all(s.op is Op.CONST for s in src) and op in _FOLD:
        return const(_FOLD[op](*(s.arg for s in src)), span)
    if op is Op.WHERE and src[0].op is Op.CONST:
        return src[1] if src[0].arg else src[2]
    if op in (Op.AND, Op.OR):
        for a, b in ((src[0], src[1]), (src[1], src[0])):
            if a.op is Op.CONST:
                if a.arg == (op is Op.AND):  # true and x / false or x
                    return b
                return const(op is Op.OR, span)
    kind = max((s.kind for s in src), default=Kind.CONST)
    dom = join(*(s.dom for s in src if s.kind == Kind.ELEMENT))
    if op in REDUCTIONS:
        kind, dom = Kind.TENSOR, "rc"
    elif op is Op.MATMUL:  # (rows x k) @ (k x cols): the left's rows, the right's columns
        dom = src[0].dom[0] + src[1].dom[1]
    elif op is Op.TRANSPOSE:
        dom = src[0].dom[::-1]
    elif op in AXIS_REDUCTIONS:
        dom = dom.replace(AXIS_REDUCTIONS[op][0], "")
    if kind != Kind.ELEMENT:
        dom = "rc"
    return Node(op, tuple(src), None, dtype, kind, span, dom=dom)


def _power(x: Node, b: float, span: Span | None) -> Node | None:
    """``x ^ b`` for the exponents torch's pow computes without pow (and so must every
    backend, to agree with it and to be fast): 1, 2, 0.5, -0.5, -1 and -2."""
    if b == 1:
        return x
    if b == 2:
        return apply(Op.MUL, x, x, span=span)
    if b == 0.5:
        return apply(Op.SQRT, x, span=span)
    if b == -0.5:
        return apply(Op.RSQRT, x, span=span)
    if b == -1:
        return apply(Op.DIV, const(1.0), x, span=span)
    if b == -2:
        return apply(Op.DIV, const(1.0), apply(Op.MUL, x, x, span=span), span=span)
    return None


def global_reduction(op: Op, x: Node, span: Span | None = None) -> Node:
    """``op`` (norm, sum or max) over the values ``x`` has in every tensor of a group."""
    assert op in REDUCTIONS and op is not Op.MEAN
    return Node(op, (x,), GLOBAL, "float", Kind.TENSOR, span)


def is_global(node: Node) -> bool:
    return node.op in REDUCTIONS and node.arg == GLOBAL


def named(node: Node, name: str) -> Node:
    """The node labelled with a spec name, unless it is a leaf or already named."""
    if node.op in LEAVES or node.name is not None:
        return node
    return Node(node.op, node.src, node.arg, node.dtype, node.kind, node.span, name, node.dom)


@dataclass(frozen=True)
class HyperParam:
    name: str
    type: str  # "float" | "bool"
    default: float | bool
    range: object | None  # vega.dsl.ast.Range
    span: Span | None = None


@dataclass(frozen=True)
class StateVar:
    name: str
    init: Node  # of p, constants and hyperparameters
    span: Span | None = None
    dom: str = "rc"  # "rc": shaped like p; "r": one value per row; "c": one per column;
    # SCALAR_STATE: one number per tensor; QBLOCK: one per block of 256 values (8-bit state's
    # scales, vega.codegen.quant)

@dataclass(frozen=True, eq=False)
class Program:
    """One specialization of a spec: its bool hyperparameters fixed, and the outcome
    of each shape condition (``if ndim(p) >= 2``) for the tensors it steps.

    Compared and hashed by identity (specs cache their programs), so looking up
    a program's compiled kernel costs nothing per step.
    """

    name: str
    hypers: tuple[HyperParam, ...]
    flags: tuple[tuple[str, bool], ...]
    states: tuple[StateVar, ...]
    updates: tuple[tuple[str, Node], ...]  # ("p", node), ("mu", node), ...
    shapes: tuple[bool, ...] = ()  # the outcomes of the spec's shape conditions, in order
    # the spec's modes (``mode eval { p = ... }``): (name, the parameter's new value), each a
    # value of p, the states as stored and the hyperparameters
    modes: tuple[tuple[str, Node], ...] = ()
    def __post_init__(self):
        # Not fields, so neither compared nor hashed; computed here, not lazily, because a
        # cached_property takes a lock that torch.compile cannot trace.
        # kernels: the compiled kernels of this program, by backend (vega.codegen.kernel);
        # uses_axes: whether any value is not one per element (axis reductions, row or
        # column state).
        object.__setattr__(self, "kernels", {})
        # the float hyperparameters' names and the states', read by each step (a tuple
        # made at each read cost about a microsecond, for each group or leaf)
        object.__setattr__(self, "_float_hypers",
                           tuple(h.name for h in self.hypers if h.type == "float"))
        object.__setattr__(self, "_state_names", tuple(s.name for s in self.states))
        # vega.codegen.precision: its variants by (master, seed); whether it keeps a float32
        # master copy of the parameter; the seed of its stochastic rounding (None: none)
        object.__setattr__(self, "variants", {})
        object.__setattr__(self, "master", False)
        object.__setattr__(self, "rounding", None)
        # vega.codegen.quant: its 8-bit states, {state: (its scales' state, signed map)}
        object.__setattr__(self, "quant", {})
        # (the modes' and the initial values' nodes too: what they compute is rendered
        # beside the update, with the same helpers)
        nodes = walk([*(node for _, node in self.updates), *(node for _, node in self.modes),
                      *(st.init for st in self.states)])
        object.__setattr__(self, "uses_axes", any(
            s.dom not in ("rc", SCALAR_STATE, QBLOCK) for s in self.states) or any(
            n.op in AXIS_REDUCTIONS or n.op in TORCH_ONLY_OPS for n in nodes))
        # spans_group: a reduction over every tensor of a group (global_sum ...), which the
        # step combines between stages (vega.runtime.sharded.fused); torch_only: what only
        # the reference kernels compute (matrices), which every backend runs there
        # (vega.codegen.kernel)
        object.__setattr__(self, "spans_group", any(is_global(n) for n in nodes))
        object.__setattr__(self, "torch_only", any(n.op in TORCH_ONLY_OPS for n in nodes))
        # a state of one number per tensor: the C and Triton kernels store it once a tensor
        # (vega.codegen.triton.Source); the reference's run a program over a matrix view
        # with one (vega.codegen.kernel)
        object.__setattr__(self, "scalar_states", any(
            s.dom == SCALAR_STATE for s in self.states))
        object.__setattr__(self, "has_matrices", any(n.op in MATRIX_OPS for n in nodes))
        object.__setattr__(self, "group_states", _group_states(self))
        # what a DTensor's shard cannot compute alone: a matrix needs it whole, size(p, k)
        # the whole tensor's length
        object.__setattr__(self, "needs_whole", any(
            n.op in MATRIX_OPS or n.op is Op.SIZE for n in nodes))

    @property
    def float_hypers(self) -> tuple[str, ...]:
        return self._float_hypers

    @property
    def state_names(self) -> tuple[str, ...]:
        return self._state_names


def _group_states(program: Program) -> tuple[str, ...]:
    """The states of one number per tensor that hold one number per group: updated from a
    reduction over the group, and otherwise only from hyperparameters, ``t`` and such
    states (Prodigy's d), so the same in every tensor of a group that steps (NovoGrad's
    nu is not: it reads the tensor's own norm)."""
    new = dict(program.updates)
    scalar = {s.name for s in program.states if s.dom == SCALAR_STATE}
    found = set(scalar)
    while True:  # (the largest set closed under: reads only found states)
        def ok(node: Node, seen: set) -> bool:
            if id(node) in seen or is_global(node):
                return True
            seen.add(id(node))
            if node.op is Op.STATE:
                return node.arg in found
            if node.op in (Op.PARAM, Op.GRAD) or node.op in REDUCTIONS \
                    or node.op in AXIS_REDUCTIONS or node.op is Op.SIZE:
                return False
            return all(ok(s, seen) for s in node.src)
        keep = {name for name in found if ok(new[name], set())}
        if keep == found:
            break
        found = keep
    # of those, the ones a reduction over the group feeds (those of hyperparameters and t
    # alone, NAdam's mu_product, follow each tensor's own step counter, as torch's do)
    fed: set[str] = set()
    while True:
        more = {name for name in found if name not in fed and any(
            is_global(n) or (n.op is Op.STATE and n.arg in fed) for n in walk([new[name]]))}
        if not more:
            return tuple(name for name in program.state_names if name in fed)
        fed |= more


def with_src(node: Node, src: tuple[Node, ...]) -> Node:
    """``node`` with the operands ``src``: ``node`` itself where each is its own already."""
    if all(a is b for a, b in zip(src, node.src)):
        return node
    return Node(node.op, src, node.arg, node.dtype, node.kind, node.span, node.name, node.dom)


def replaced(node: Node, swaps: dict[int, Node], memo: dict[int, Node]) -> Node:
    """``node`` with each node below it (itself too) whose id ``swaps`` holds replaced by its
    value there; each node rebuilt once (``memo``, shared across the roots of a program)."""
    done = memo.get(id(node))
    if done is None:
        done = swaps.get(id(node))
        if done is None:
            done = with_src(node, tuple(replaced(s, swaps, memo) for s in node.src))
        memo[id(node)] = done
    return done


def with_updates(program: Program, updates) -> Program:
    """``program`` with ``updates`` for its own, its precision (``master``, ``rounding``) and
    its 8-bit states (``quant``) kept: a rewriting of its values."""
    out = Program(program.name, program.hypers, program.flags, program.states, tuple(updates),
                  program.shapes, program.modes)
    for attr in ("master", "rounding", "quant"):
        object.__setattr__(out, attr, getattr(program, attr))
    return out


def cse(program: Program) -> Program:
    """The same program with structurally equal subexpressions shared (one node each)."""
    canon: dict[tuple, Node] = {}
    memo: dict[int, Node] = {}
    for node in walk(node for _, node in program.updates):
        src = tuple(memo[id(s)] for s in node.src)
        arg = node.arg  # (-0.0 == 0.0, and hashes alike: a constant's sign is its own)
        if type(arg) is float:
            arg = (arg, math.copysign(1.0, arg))
        key = (node.op, tuple(id(s) for s in src), arg, node.dtype, node.dom)
        if key not in canon:
            canon[key] = node if src == node.src else Node(
                node.op, src, node.arg, node.dtype, node.kind, node.span, node.name, node.dom)
        memo[id(node)] = canon[key]
    updates = tuple((target, memo[id(node)]) for target, node in program.updates)
    return Program(program.name, program.hypers, program.flags, program.states, updates,
                   program.shapes, program.modes)


def walk(roots) -> list[Node]:
    """Every node reachable from ``roots``, each once, operands before users."""
    seen: set[int] = set()
    order: list[Node] = []
    stack = [(r, False) for r in reversed(list(roots))]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((s, False) for s in reversed(node.src) if id(s) not in seen)
    return order
