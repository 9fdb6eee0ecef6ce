"""The syntax tree of a spec. Every node carries the span of its source text."""
from __future__ import annotations

import math
from dataclasses import dataclass

from vega.errors import Span

# the numbers a spec may write by name, in expressions, defaults and range bounds; their
# names are reserved (no hyperparameter, state or value may take one)
CONSTANTS = {"inf": math.inf, "nan": math.nan, "pi": math.pi}


def number_text(v: float) -> str:
    """A number of a spec as a message shows it: ``inf`` and ``pi`` by name (3.14159 would
    hide that a bound is exact), others to every digit that tells it apart (``{:g}``'s six
    would show 0.999999999 as 1), without a trailing ``.0`` (``1``, ``1e-08``)."""
    for name in ("inf", "pi"):
        if abs(v) == CONSTANTS[name]:
            return name if v > 0 else "-" + name
    text = repr(float(v))
    return text[:-2] if text.endswith(".0") else text


@dataclass(frozen=True)
class Num:
    value: float
    span: Span


@dataclass(frozen=True)
class Bool:
    value: bool
    span: Span


@dataclass(frozen=True)
class Name:
    id: str
    span: Span


@dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]
    span: Span
    fn_span: Span


@dataclass(frozen=True)
class Unary:
    op: str  # "-" | "not"
    x: Expr
    span: Span


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / @ ^ < <= > >= == != and or
    a: Expr
    b: Expr
    span: Span
    op_span: Span


Expr = Num | Bool | Name | Call | Unary | Binary


# the dtypes a state declaration may name (`state nu: bfloat16 = zeros`): its default
# state_dtype (vega.runtime.engine.state_dtype_of); uint8 is 8-bit blockwise (codegen.quant)
STATE_DTYPE_WORDS = ("float32", "float64", "bfloat16", "float16", "uint8")


@dataclass(frozen=True)
class StateDecl:
    name: str
    init: Expr
    span: Span
    name_span: Span
    shape: str | None = None  # "rows" | "cols" (one value per row / column), "scalar" (one
    # number per tensor); None: like p
    shape_span: Span | None = None
    dtype: str | None = None  # the dtype it is kept in by default ("bfloat16", "uint8", ...)
    dtype_span: Span | None = None


@dataclass(frozen=True)
class Assign:
    name: str
    value: Expr
    span: Span
    name_span: Span


@dataclass(frozen=True)
class Mode:
    """``mode NAME { ... }``: the parameter's value in mode NAME (``p = ...``)."""
    name: str
    body: tuple[Stmt, ...]
    span: Span
    name_span: Span


@dataclass(frozen=True)
class Repeat:
    """``repeat N { ... }``: the body N times (unrolled before the checks: ``unroll``)."""
    count: Num | Name
    body: tuple[Stmt, ...]
    span: Span


@dataclass(frozen=True)
class If:
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]
    span: Span
    # where ``unroll`` wrote this if for ``repeat N`` on a hyperparameter: N's name (the
    # messages then speak of the repeat, which is what the spec wrote)
    repeat: str | None = None


Stmt = StateDecl | Assign | If | Mode | Repeat


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool
    span: Span

    def contains(self, x: float) -> bool:
        above = x >= self.lo if self.lo_closed else x > self.lo
        below = x <= self.hi if self.hi_closed else x < self.hi
        return above and below

    def __str__(self) -> str:
        return (f"{'[' if self.lo_closed else '('}{number_text(self.lo)}, "
                f"{number_text(self.hi)}{']' if self.hi_closed else ')'}")


@dataclass(frozen=True)
class Hyper:
    name: str
    type: str  # "float" | "bool"
    default: float | bool
    range: Range | None
    span: Span
    type_span: Span | None
    default_span: Span


@dataclass(frozen=True)
class Spec:
    name: str
    class_name: str | None
    hypers: tuple[Hyper, ...]
    body: tuple[Stmt, ...]
    doc: str
    span: Span
    name_span: Span
