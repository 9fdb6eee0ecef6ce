"""What the compiled backends plan alike, in one place: the C and the Triton renderers read
it and differ only in how they spell it.

- **Which element values a loop computes** (``element_plan``): the values reaching a set
  of roots, operands first, stopping at the per-tensor reductions of earlier phases (read,
  not recomputed) and at values an earlier loop stored.
- **The geometry of a tensor's matrix view** (``GEOMETRY``): the integers a table row of
  a program over a matrix view carries after its hyperparameters, in order
  (``vega.codegen.base.axis_geometry``, then ``vega.codegen.c.staged.line_lengths``); the
  C kernels name them as they are, Triton's table columns in capitals (``column_name``).
- **The stages of a program over a matrix view** (``axis_plan``): which reductions, per
  tensor and along an axis, each stage computes, the stage at which each value is known,
  and the launches of Triton's staged path (``Launch``); the C kernels run the same stages
  as loops in one function (``vega.codegen.c.staged``).
- **How an index of one domain reads a value of a smaller one** (``DROP``,
  ``drop_path``), and **how an axis reduction walks its source** (``AXIS``, ``PUT``):
  ``drop(i, inner, n) = (i / (inner * n)) * inner + i % inner`` takes out an axis of length
  ``n`` and inner stride ``inner``; ``put(o, inner, n, k) = (o / inner) * inner * n +
  k * inner + o % inner`` puts it back at position ``k``.
"""
from __future__ import annotations

from dataclasses import dataclass

from vega.codegen.base import state_var
from vega.dsl.ir import (AXIS_REDUCTIONS, DOMAINS, REDUCTIONS, SCALAR_STATE, Kind, Node, Op,
                         Program, walk)

DOMS = DOMAINS  # per element, per row, per column, per matrix: axis_geometry's counts' order
TAG = {"rc": "rc", "r": "r", "c": "c", "": "m"}  # a domain in identifiers

# the geometry integers of a row, in order, with what each is
GEOMETRY = (
    ("n_rc", "number of elements"),
    ("n_r", "number of rows (values of one per row)"),
    ("n_c", "number of columns (values of one per column)"),
    ("n_m", "number of matrices"),
    ("Sr", "length of the row axis (1 if none)"),
    ("Sc", "length of the column axis (1 if none)"),
    ("fr", "inner stride of the row axis"),
    ("fc", "inner stride of the column axis"),
    ("rr", "inner stride of the row axis in a value of one per row"),
    ("cc", "inner stride of the column axis in a value of one per column"),
    ("L_rc", "run length of a loop over the elements (line_lengths)"),
    ("L_r", "run length of a loop over the rows"),
    ("L_c", "run length of a loop over the columns"),
)
NGEO = len(GEOMETRY)
COUNT = {dom: f"n_{TAG[dom]}" for dom in DOMS}  # the geometry integer counting a domain

# (domain of an index, the next smaller domain) -> (inner stride, length) of the axis dropped
DROP = {("rc", "r"): ("fc", "Sc"), ("rc", "c"): ("fr", "Sr"), ("r", ""): ("rr", "Sr"),
        ("c", ""): ("cc", "Sc")}
# (domain of an axis reduction's source, the axis it reduces) -> (inner stride, length)
AXIS = {("rc", "c"): ("fc", "Sc"), ("rc", "r"): ("fr", "Sr"), ("r", "r"): ("rr", "Sr"),
        ("c", "c"): ("cc", "Sc")}
# (domain of an axis reduction's output, domain of its source) -> (inner stride, length)
PUT = {(src.replace(axis, ""), src): how for (src, axis), how in AXIS.items()}


# the two index maps, in integer arithmetic with ``//`` for the division (C writes ``/``)
DROP_EXPR = "(i // (inner * n)) * inner + i % inner"  # drop(i, inner, n)
PUT_EXPR = "(o // inner) * inner * n + k * inner + o % inner"  # put(o, inner, n, k)


def in_c(expr: str) -> str:
    """An index map's expression in C (integer division is ``/`` there)."""
    return expr.replace("//", "/")


def column_name(name: str) -> str:
    """A geometry integer's name as a Triton table column (``fc`` -> ``FC``)."""
    return name.upper()


def drop_path(dom: str, smaller: str) -> tuple[tuple[str, str], ...]:
    """The drops, in order, that take an index of ``dom`` to one of ``smaller``: one a
    domain step, per element to per row (or column) to per matrix."""
    if dom == smaller:
        return ()
    if (dom, smaller) in DROP:
        return (DROP[dom, smaller],)
    if dom == "rc" and smaller == "":
        return DROP["rc", "r"], DROP["r", ""]
    raise ValueError(f"no index map from domain {dom!r} to {smaller!r}")


@dataclass(frozen=True)
class ElementPlan:
    """The element values a loop computes for its roots (``element_plan``)."""

    lines: tuple[Node, ...]  # values computed, operands first
    earlier: tuple[Node, ...]  # per-tensor reductions of earlier phases they read
    reads: frozenset[str]  # the states whose old values they read
    reached: tuple[Node, ...]  # every node reached, in order


def element_plan(roots, computed=(), stored=frozenset()) -> ElementPlan:
    """The element values reaching ``roots``, in order. ``computed``: the reductions this
    loop computes itself (it reads their arguments); any other reduction is an earlier
    phase's, read. ``stored``: ids of values an earlier loop stored, read (they are among
    the lines, but their operands are not)."""
    roots = list(roots)
    seen: set[int] = set()
    stack, reached, reads = list(roots), [], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        reached.append(node)
        if node.op is Op.STATE:
            reads.add(node.arg)
        if (node.op in REDUCTIONS and not any(node is r for r in computed)) \
                or id(node) in stored:
            continue
        stack.extend(node.src)
    order = {id(n): k for k, n in enumerate(walk(roots))}
    reached.sort(key=lambda n: order[id(n)])
    lines = tuple(n for n in reached if n.kind >= Kind.TENSOR and n.op not in REDUCTIONS
                  and n.op not in (Op.PARAM, Op.GRAD, Op.STATE, Op.CONST))
    earlier = tuple(n for n in reached if n.op in REDUCTIONS
                    and not any(n is r for r in computed))
    return ElementPlan(lines, earlier, frozenset(reads), tuple(reached))


def per_step_states(program) -> dict[int, Node] | None:
    """Where every state of one number per tensor (``SCALAR_STATE``: NAdam's product of
    momenta) has a new value computed from the old values of such states, ``t``, the
    hyperparameters and constants alone: the nodes of one value per tensor those new values
    and the states' old values are (by id), which a backend may compute once a step, before
    the loops over the elements. None where a new value reads anything else (a reduction
    over the elements, as NovoGrad's norm of g), or there is no such state."""
    names = {s.name for s in program.states if s.dom == SCALAR_STATE}
    if not names:
        return None
    out: dict[int, Node] = {}
    for node in walk(node for _, node in program.updates):
        if node.op is Op.STATE and node.arg in names:
            out[id(node)] = node
    for target, root in program.updates:
        if target not in names:
            continue
        for node in walk([root]):
            if node.kind > Kind.TENSOR or node.op in REDUCTIONS or node.op in AXIS_REDUCTIONS \
                    or (node.op is Op.STATE and node.arg not in names):
                return None
            if node.kind == Kind.TENSOR:
                out[id(node)] = node
    return out


@dataclass(frozen=True, eq=False)
class Launch:
    """One step of a program over a matrix view, over the values of domain ``dom``: in
    Triton's staged path one kernel launch (``fn``), in the C kernels one loop or more."""

    kind: str  # "stage" | "finish" (a stage's per-tensor reductions) | "write"
    stage: int
    dom: str
    gathers: tuple[Node, ...] = ()  # axis reductions into dom, stored as temporaries
    reductions: tuple[Node, ...] = ()  # per-tensor reductions of values of dom
    targets: tuple[str, ...] = ()  # write: p and the states of dom

    @property
    def fn(self) -> str:
        return f"write_{TAG[self.dom]}" if self.kind == "write" else \
            f"{self.kind}{self.stage}_{TAG[self.dom]}"

    @property
    def wide(self) -> bool:
        """Whether its programs loop over a reduced axis (smaller blocks, KBLOCK)."""
        return bool(self.gathers)


@dataclass(frozen=True, eq=False)
class AxisPlan:
    """The stages of a program over a matrix view (``axis_plan``)."""

    launches: tuple[Launch, ...]
    temps: tuple[Node, ...]  # the axis reductions' results, in the order of their T_ columns
    level: dict[int, int]  # by node id: the stage from which its value is known
    nstages: int  # stages that end in reductions

    def stage(self, k: int) -> tuple[list[Node], list[Node]]:
        """Stage ``k``'s axis reductions and per-tensor reductions, in launch order."""
        found = [launch for launch in self.launches if launch.kind == "stage"
                 and launch.stage == k]
        return ([n for launch in found for n in launch.gathers],
                [n for launch in found for n in launch.reductions])

    @property
    def reductions(self) -> tuple[Node, ...]:
        """Every per-tensor reduction, stage by stage in launch order: a step over shards
        keeps their results in this order (the C kernels' ``vega_axes_stage<k>``)."""
        return tuple(n for k in range(self.nstages) for n in self.stage(k)[1])


def axis_plan(program: Program) -> AxisPlan:
    """The stages of a program that uses the matrix view, and their launches in order: a
    reduction (per tensor, or along an axis) sits at the stage of its argument, and its
    value is known from the next one; after the last stage, the writes, per element first
    (they read the old rows and columns), then per row, then per column."""
    level: dict[int, int] = {}
    stages: list[dict[str, tuple[list, list]]] = []
    for node in walk(node for _, node in program.updates):
        lv = max((level[id(s)] for s in node.src), default=0)
        if node.op in REDUCTIONS or node.op in AXIS_REDUCTIONS:
            while len(stages) <= lv:
                stages.append({})
            axis = node.op in AXIS_REDUCTIONS
            gathers, reds = stages[lv].setdefault(node.dom if axis else node.src[0].dom, ([], []))
            (gathers if axis else reds).append(node)
            lv += 1
        level[id(node)] = lv
    launches = []
    for k, doms in enumerate(stages):
        found = [(d, *doms[d]) for d in DOMS if d in doms]
        launches += [Launch("stage", k, d, tuple(g), tuple(r)) for d, g, r in found]
        launches += [Launch("finish", k, d, tuple(g), tuple(r)) for d, g, r in found if r]
    var_doms = {"p": "rc", **{state_var(s.name): s.dom for s in program.states}}
    for dom in ("rc", "r", "c"):  # the elements first: they read the old rows and columns
        targets = tuple(x for x, d in var_doms.items() if d == dom)
        if targets:
            launches.append(Launch("write", len(stages), dom, targets=targets))
    temps = tuple(n for launch in launches if launch.kind == "stage" for n in launch.gathers)
    return AxisPlan(tuple(launches), temps, level, len(stages))
