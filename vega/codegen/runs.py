"""The element runs of a program with matrix products, each as one loop of a backend.

Such a program runs on the reference's torch operations on every backend (its matrix
products are torch's BLAS). Its element lines before and after the products come in runs
(``vega.codegen.reference.Run``: Muon's momentum, Nesterov mix and rounding to bfloat16
before the Newton-Schulz steps; its decayed, updated parameter after them), which the
reference computes a few torch operations at a time (``reference._tiled``). A backend
computes each run instead in one loop over every element, all its values in registers: one
pass over memory for the run (the C backend's, ``vega.codegen.c.runs``; Triton's,
``vega.codegen.triton_runs``).

This module is what the backends share: ``plan``, a run as a list of operations (``Loop``),
and ``Runs``, which stands for ``reference._tiled`` and hands a run to its backend's loop
where the loop computes what torch's operations compute, bit for bit (a NaN stays a NaN,
whose sign and payload may differ from torch's). Each operation of a loop is one that torch
rounds correctly (``+ - * /``, the conversions between float32 and bfloat16, comparisons,
selections, ``abs``, ``sign``, ``min``, ``max`` as the reference writes them). A run with
another operation (torch's float32 ``sqrt`` on the CPU is not correctly rounded: it differs
from the rounded root in the last place for about one value in six), with a number divided
by a value (which the reference divides as a 0-d tensor, ``reference._over``), with
arithmetic on bfloat16 values, or with a value of a dtype it does not expect, stays on
torch's operations; so do tensors that are not plain and contiguous, of one shape,
on the backend's device, a step that records gradients, and a step dynamo traces.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from vega.codegen import reference
from vega.codegen.base import Linear, Renderer
from vega.codegen.tensors import PLAIN_TYPES, watched
from vega.dsl.ir import COMPARISONS, Kind, Op

ARITHMETIC = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV})


class Unsupported(Exception):
    """A run, or a run with these dtypes, that a backend's loops do not compute."""


@dataclass(frozen=True)
class Operand:
    """A value a loop reads: a name of the run (``dtype`` its dtype), or a number (``name``
    None; ``value`` a float, or a bool)."""
    name: str | None
    value: float | bool | None
    dtype: torch.dtype | None

    @property
    def number(self) -> bool:
        return self.name is None


@dataclass(frozen=True)
class Step:
    """One line of a loop: ``var = form(args)``, a value of ``dtype``. ``form`` is one of
    ``arith`` (``op`` one of ``+ - *``), ``divide``, ``min`` and ``max`` (as ``reference._minmax``:
    ``nan``, whether the first operand may be a NaN, which then wins), ``compare`` (``op``),
    ``and``, ``or``, ``not``, ``neg``, ``abs``, ``sign`` (NaN and -0.0 kept), ``where``,
    ``round`` (float32 to bfloat16, to nearest even), ``widen`` (bfloat16 to the compute
    dtype) and ``same`` (a conversion to the dtype the value has)."""
    var: str
    form: str
    op: Op
    args: tuple[Operand, ...]
    dtype: torch.dtype
    nan: bool = False


@dataclass(frozen=True)
class Loop:
    """A run as one loop over ``n`` elements: it reads ``full`` (values of every element,
    each (name, dtype)) and ``values`` (one value for all: 0-d tensors), computes ``steps``
    in the compute dtype ``compute``, and writes ``made`` (each (name, dtype))."""
    run: reference.Run
    compute: torch.dtype
    full: tuple[tuple[str, torch.dtype], ...]
    values: tuple[tuple[str, torch.dtype], ...]
    steps: tuple[Step, ...]
    made: tuple[tuple[str, torch.dtype], ...]


def plan(run: reference.Run, lin: Linear, dtypes: dict[str, torch.dtype],
         divides_by_numbers: bool = True) -> Loop:
    """``run`` as a ``Loop`` for inputs of ``dtypes`` (each name of ``run.full`` and
    ``run.rest`` to its dtype; ``p``'s is the compute dtype's source). ``divides_by_numbers``
    False: a division by a number is not the loop's (CUDA's torch multiplies by the number's
    reciprocal instead). Raises Unsupported."""
    cd = dtypes["p"]
    if cd not in (torch.float32, torch.float64):
        raise Unsupported(f"compute dtype {cd}")
    kinds: dict[str, torch.dtype] = {}  # each value's dtype, by name
    for name in (*run.full, *(n for n in run.rest if n != "p")):
        dt = dtypes[name]
        if dt not in (cd, torch.bool, torch.bfloat16):
            raise Unsupported(f"{name}: {dt}")
        kinds[name] = dt

    def operand(node) -> Operand:
        if node.op is Op.CONST:
            v = node.arg
            if isinstance(v, bool):
                return Operand(None, v, None)
            if not isinstance(v, (int, float)):
                raise Unsupported(f"constant {v!r}")
            return Operand(None, float(v), None)
        name = lin.names.get(id(node))
        if name is None or name not in kinds:
            raise Unsupported("an operand from outside the run")
        return Operand(name, None, kinds[name])

    steps = []
    for line in run.lines:
        node = line.node
        if node.kind != Kind.ELEMENT:
            raise Unsupported("not an element value")
        args = tuple(operand(s) for s in node.src)
        types = [a.dtype for a in args]
        floats = all(d in (cd, None) for d in types)
        bools = all(d in (torch.bool, None) for d in types)
        op, nan = node.op, False
        if op is Op.DIV and args[0].number:
            # (a number over a tensor: the reference's ``_over``, left to torch's operations)
            raise Unsupported("a number divided by a value")
        if op is Op.DIV and args[1].number and not divides_by_numbers:
            raise Unsupported("a value divided by a number")
        if op in ARITHMETIC and floats:
            form, out = ("divide" if op is Op.DIV else "arith"), cd
        elif op in (Op.MIN, Op.MAX) and floats:
            x = node.src[0]
            form, out = ("min" if op is Op.MIN else "max"), cd
            nan = not (x.op is Op.CONST and x.arg == x.arg)
        elif op in COMPARISONS and floats:
            form, out = "compare", torch.bool
        elif op in (Op.AND, Op.OR, Op.NOT) and bools and not any(a.number for a in args):
            # (the language folds a logic operation with a constant: none reaches a loop)
            form, out = op.name.lower(), torch.bool
        elif op in (Op.NEG, Op.ABS, Op.SIGN) and floats:
            form, out = op.name.lower(), cd
        elif op is Op.WHERE and types[0] in (torch.bool, None):
            rest = types[1:]
            if node.dtype == "bool" and all(d in (torch.bool, None) for d in rest):
                out = torch.bool
            elif all(d in (cd, None) for d in rest):
                out = cd
            else:
                raise Unsupported("a selection of mixed dtypes")
            form = "where"
        elif op is Op.BF16 and types[0] == torch.bfloat16:
            form, out = "same", torch.bfloat16
        elif op is Op.BF16 and types[0] == torch.float32 == cd:
            form, out = "round", torch.bfloat16
        elif op is Op.WIDEN and types[0] == torch.bfloat16:
            form, out = "widen", cd
        elif op is Op.WIDEN and types[0] == cd:
            form, out = "same", cd
        else:
            raise Unsupported(f"{op.value} of {', '.join(map(str, types))}")
        kinds[line.var] = out
        steps.append(Step(line.var, form, op, args, out, nan))
    values = tuple((n, kinds[n]) for n in run.rest if n != "p")
    return Loop(run, cd, tuple((n, kinds[n]) for n in run.full), values, tuple(steps),
                tuple((n, kinds[n]) for n in run.made))


INFIX = Renderer.infix  # (the operators C, Python and Triton spell alike)


def expression(step: Step, forms: dict, number, **words) -> str:
    """``step`` in a backend's language, from its table ``forms``: each form (``Step``) to
    a format string over the operands' texts (``{0}``, ``{1}``, ``{2}``; a name as it is, a
    number as ``number(value)`` renders it, a bool or a float, NaN and infinities too),
    ``{op}`` (the infix operator), ``{cmp}`` (``<`` for min, ``>`` for max), ``{nan}``
    (whether min's or max's first operand may be a NaN: the ``nan`` entry of ``forms``
    with the texts, else nothing) and ``words``; or to a function of (the step, the texts),
    where the text depends on more."""
    t = [a.name if a.name is not None else number(a.value) for a in step.args]
    form = forms[step.form]
    if callable(form):
        return form(step, t)
    nan = forms["nan"].format(*t) if step.nan else ""
    return form.format(*t, op=INFIX.get(step.op, ""), cmp="<" if step.form == "min" else ">",
                       nan=nan, **words)


class Runs(abc.ABC):
    """The runs of one linear program's functions as loops of a backend: ``tiled`` stands
    for ``reference._tiled`` in them. A backend says where its loops run (``device_ok``),
    which runs they compute (``DIVIDES_BY_NUMBERS``), how a loop is built
    from its plan (``build``) and how it is called (``call``)."""

    NOTE = ""  # what ``reference.Kernel.source`` says of the runs
    DIVIDES_BY_NUMBERS = True

    def __init__(self, lin: Linear):
        self.lin = lin
        self.runs = {run.name: run for run in reference.element_runs(lin)}
        self._loops: dict = {}  # (run name, dtypes) -> (built loop, its Loop) or None

    @abc.abstractmethod
    def device_ok(self, device: torch.device) -> bool:
        """Whether the loops run on tensors of ``device``."""

    @abc.abstractmethod
    def build(self, loop: Loop):
        """The backend's callable loop of ``loop``."""

    @abc.abstractmethod
    def call(self, built, loop: Loop, n: int, full: tuple, values: list, outs: list) -> None:
        """Run ``built`` over ``n`` elements of ``full`` with ``values``, into ``outs``."""

    def _loop(self, run: reference.Run, dtypes: dict):
        key = (run.name, tuple(sorted((n, str(d)) for n, d in dtypes.items())))
        if key not in self._loops:
            try:
                loop = plan(run, self.lin, dtypes, self.DIVIDES_BY_NUMBERS)
            except Unsupported:
                self._loops[key] = None
            else:
                self._loops[key] = (self.build(loop), loop)
        return self._loops[key]

    def tiled(self, fn, full: tuple, rest: tuple) -> tuple:
        """``reference._tiled(fn, full, rest)``, in one loop where ``fn`` is a run this
        program's loops compute for these tensors (see the module's notes)."""
        run = self.runs.get(fn.__name__)
        if run is None or not full or len(full) != len(run.full) \
                or len(rest) != len(run.rest) or watched():
            return reference._tiled(fn, full, rest)  # (under vmap: whole, by torch)
        t0 = full[0]
        if not self.device_ok(t0.device):
            return reference._tiled(fn, full, rest)
        dtypes = {}
        for name, t in zip(run.full, full):
            if type(t) not in PLAIN_TYPES or t.device != t0.device or t.shape != t0.shape \
                    or t.is_neg() or t.is_conj():
                return reference._tiled(fn, full, rest)
            dtypes[name] = t.dtype
        if not all(t.is_contiguous() for t in full):
            # (a tall matrix's products come out transposed: where the run's values are only
            # returned, never read by a later line (whose sums could follow their layout),
            # each such tensor is copied into a contiguous one first: one pass of its own,
            # where torch's operations over mixed layouts take several slow ones)
            if run.later:
                return reference._tiled(fn, full, rest)
            full = tuple(t.contiguous() for t in full)
        for name, x in zip(run.rest, rest):
            # (a number is a guard's case: ``reference.Kernel`` gives numbers to its products
            # alone, never to a run)
            if type(x) not in PLAIN_TYPES or x.is_neg() or (
                    name != "p" and (x.dim() != 0 or x.device != t0.device)):
                return reference._tiled(fn, full, rest)
            dtypes[name] = x.dtype
        if "p" not in dtypes:
            return reference._tiled(fn, full, rest)
        found = self._loop(run, dtypes)
        if found is None:
            return reference._tiled(fn, full, rest)
        built, loop = found
        outs = [torch.empty(t0.shape, dtype=d, device=t0.device) for _, d in loop.made]
        values = [x for name, x in zip(run.rest, rest) if name != "p"]
        self.call(built, loop, t0.numel(), full, values, outs)
        COUNTS[type(self).__name__] = COUNTS.get(type(self).__name__, 0) + 1
        return tuple(outs)


COUNTS: dict[str, int] = {}  # runs computed in loops, by the class of ``Runs`` (tests read it)
