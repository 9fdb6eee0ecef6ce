"""The typed IR: the contract between the front end and every backend.

A program is a DAG of small frozen nodes. Each node has a dtype (float or bool)
and a *kind* that says how it varies:

- ``CONST``: a compile-time constant (folded away wherever possible);
- ``SCALAR``: one value per step (hyperparameters, ``t`` and what is computed
  from them) -- hoisted out of the per-element loop;
- ``TENSOR``: one value per parameter tensor (the result of a reduction such as
  ``norm(p)``);
- ``ELEMENT``: one value per element (``p``, ``g``, state, and what uses them).

Nodes compare by identity (``eq=False``), so a DAG with shared subtrees is
cheap to hash and walk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, IntEnum

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
    # per-tensor reductions: one value per tensor
    NORM = "norm"
    SUM = "sum"
    MEAN = "mean"
    AMAX = "amax"


LEAVES = frozenset({Op.CONST, Op.HYPER, Op.T, Op.PARAM, Op.GRAD, Op.STATE})
REDUCTIONS = frozenset({Op.NORM, Op.SUM, Op.MEAN, Op.AMAX})
COMPARISONS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
LOGIC = frozenset({Op.AND, Op.OR, Op.NOT})

# Python meaning of each foldable op, used for constant folding.
_FOLD = {
    Op.NEG: lambda a: -a,
    Op.ADD: lambda a, b: a + b,
    Op.SUB: lambda a, b: a - b,
    Op.MUL: lambda a, b: a * b,
    Op.DIV: lambda a, b: a / b if b != 0 else math.copysign(math.inf, a) if a else math.nan,
    Op.POW: lambda a, b: float(a) ** b,
    Op.LT: lambda a, b: a < b,
    Op.LE: lambda a, b: a <= b,
    Op.GT: lambda a, b: a > b,
    Op.GE: lambda a, b: a >= b,
    Op.EQ: lambda a, b: a == b,
    Op.NE: lambda a, b: a != b,
    Op.AND: lambda a, b: a and b,
    Op.OR: lambda a, b: a or b,
    Op.NOT: lambda a: not a,
    Op.SQRT: lambda a: math.sqrt(a) if a >= 0 else math.nan,
    Op.RSQRT: lambda a: 1 / math.sqrt(a) if a > 0 else (math.inf if a == 0 else math.nan),
    Op.EXP: math.exp,
    Op.LOG: lambda a: math.log(a) if a > 0 else (-math.inf if a == 0 else math.nan),
    Op.ABS: abs,
    Op.SIGN: lambda a: float((a > 0) - (a < 0)),
    Op.MIN: min,
    Op.MAX: max,
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

    def __repr__(self) -> str:
        if self.op is Op.CONST:
            return repr(self.arg)
        if self.op in LEAVES:
            return str(self.arg or self.op.value)
        return f"{self.op.value}({', '.join(map(repr, self.src))})"


def const(value, span: Span | None = None) -> Node:
    dtype = "bool" if isinstance(value, bool) else "float"
    return Node(Op.CONST, (), value if dtype == "bool" else float(value), dtype, Kind.CONST, span)


def leaf(op: Op, kind: Kind, arg=None, span: Span | None = None) -> Node:
    return Node(op, (), arg, "float", kind, span)


def _result_dtype(op: Op, src: tuple[Node, ...]) -> str:
    if op in COMPARISONS or op in LOGIC:
        return "bool"
    if op is Op.WHERE:
        return src[1].dtype
    return "float"


def apply(op: Op, *src: Node, span: Span | None = None) -> Node:
    """A new node, folded when its value is known at compile time."""
    dtype = _result_dtype(op, src)
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
    if op in REDUCTIONS:
        kind = Kind.TENSOR
    return Node(op, tuple(src), None, dtype, kind, span)


def named(node: Node, name: str) -> Node:
    """The node labelled with a spec name, unless it is a leaf or already named."""
    if node.op in LEAVES or node.name is not None:
        return node
    return Node(node.op, node.src, node.arg, node.dtype, node.kind, node.span, name)


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


@dataclass(frozen=True, eq=False)
class Program:
    """One specialization of a spec: its bool hyperparameters fixed.

    Compared and hashed by identity (specs cache their programs), so looking up
    a program's compiled kernel costs nothing per step.
    """

    name: str
    hypers: tuple[HyperParam, ...]
    flags: tuple[tuple[str, bool], ...]
    states: tuple[StateVar, ...]
    updates: tuple[tuple[str, Node], ...]  # ("p", node), ("mu", node), ...

    @property
    def float_hypers(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hypers if h.type == "float")

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)


def cse(program: Program) -> Program:
    """The same program with structurally equal subexpressions shared (one node each)."""
    canon: dict[tuple, Node] = {}
    memo: dict[int, Node] = {}
    for node in walk(node for _, node in program.updates):
        src = tuple(memo[id(s)] for s in node.src)
        key = (node.op, tuple(id(s) for s in src), node.arg, node.dtype)
        if key not in canon:
            canon[key] = node if src == node.src else Node(
                node.op, src, node.arg, node.dtype, node.kind, node.span, node.name)
        memo[id(node)] = canon[key]
    updates = tuple((target, memo[id(node)]) for target, node in program.updates)
    return Program(program.name, program.hypers, program.flags, program.states, updates)


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
