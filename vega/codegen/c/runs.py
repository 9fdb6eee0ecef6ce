"""The element runs of a program with matrix products as C loops.

Such a program runs on the reference's torch operations on every backend (its matrix
products are torch's BLAS). Its element lines before and after the products come in runs
(``vega.codegen.reference.Run``: Muon's momentum, Nesterov mix and rounding to bfloat16
before the Newton-Schulz steps; its decayed, updated parameter after them), which the
reference computes a few torch operations at a time over parts of the tensors
(``reference._tiled``). On the C backend each run is one loop in C instead, over every
element, all its values in registers (``tiled_for``): one pass over memory for the run.

A loop computes what the torch operations compute, bit for bit (a NaN stays a NaN, whose
sign and payload may differ from torch's): each of its operations is one that torch rounds
correctly (``+ - * /``, the conversions between float32 and
bfloat16, comparisons, selections, ``abs``, ``sign``, ``min``, ``max`` as the reference
writes them). A run with another operation (torch's float32 ``sqrt`` on the CPU is not
correctly rounded: it differs from the rounded root in the last place for about one value
in six), with a number divided by a value (Python's ``/`` computes ``3.0 / x`` as
``x.reciprocal() * 3.0``, rounded twice), with arithmetic on bfloat16 values, or with a
value of a dtype it does not expect, stays on torch's operations; so do tensors that are not plain, contiguous CPU
tensors of one shape, a step that records gradients, and a step dynamo traces.
"""
from __future__ import annotations

import ctypes
import math

import torch

from vega.codegen import reference
from vega.codegen.base import Linear
from vega.codegen.c import build as cbuild
from vega.codegen.tensors import PLAIN_TYPES
from vega.dsl.ir import COMPARISONS, Kind, Op

PAR_MIN = 32768  # a run over fewer elements than this runs on one thread

_C_TYPES = {torch.float32: "float", torch.float64: "double", torch.bfloat16: "uint16_t",
            torch.bool: "uint8_t"}
_INFIX = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.LT: "<", Op.LE: "<=",
          Op.GT: ">", Op.GE: ">=", Op.EQ: "==", Op.NE: "!=", Op.AND: "&&", Op.OR: "||"}
_ARITHMETIC = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MIN, Op.MAX})

HEADER = r"""/* vega: an element run of a program with matrix products (vega.codegen.c.runs) */
#include <math.h>
#include <stdint.h>
#include <string.h>

const char *vega_key(void) { return "@KEY@"; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even (a NaN: a NaN) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
"""


class Unsupported(Exception):
    """A run, or a run with these dtypes, that the loops do not compute."""


def source(run: reference.Run, lin: Linear,
           dtypes: dict[str, torch.dtype]) -> tuple[str, list[torch.dtype]]:
    """(the C source of ``run`` for inputs of ``dtypes``, the dtypes of its outputs):
    ``dtypes`` maps each name of ``run.full`` and ``run.rest`` to its dtype (``p``'s is the
    compute dtype). The source defines ``vega_run(n, args, nth)``: ``args`` the addresses
    of the full inputs, then of the per-tensor values (0-d tensors), then of the outputs
    (``run.made``), each full input and output of ``n`` elements. Raises Unsupported."""
    cd = dtypes["p"]
    if cd not in (torch.float32, torch.float64):
        raise Unsupported(f"compute dtype {cd}")
    kinds: dict[str, torch.dtype] = {}  # each value's dtype, by name
    body: list[str] = []
    args = [n for n in run.full] + [n for n in run.rest if n != "p"]
    for k, name in enumerate(args):
        dt = dtypes[name]
        if dt not in _C_TYPES or (dt not in (cd, torch.bool) and dt != torch.bfloat16):
            raise Unsupported(f"{name}: {dt}")
        kinds[name] = dt
        ctype = _C_TYPES[dt]
        if k < len(run.full):
            body.append(f"        const {ctype} {name} = A{k}[i];")
    ct = _C_TYPES[cd]

    def operand(node) -> tuple[str, torch.dtype | None]:  # (C expression, dtype; None: number)
        if node.op is Op.CONST:
            v = node.arg
            if isinstance(v, bool):
                return ("1" if v else "0"), None
            if not isinstance(v, (int, float)):
                raise Unsupported(f"constant {v!r}")
            v = float(v)
            text = "NAN" if v != v else ("INFINITY" if v == math.inf else "(-INFINITY)"
                                         if v == -math.inf else repr(v))
            return f"(({ct}){text})", None
        name = lin.names.get(id(node))
        if name is None or name not in kinds:
            raise Unsupported("an operand from outside the run")
        return name, kinds[name]

    for line in run.lines:
        node = line.node
        if node.kind != Kind.ELEMENT:
            raise Unsupported("not an element value")
        ops = [operand(s) for s in node.src]
        texts = [t for t, _ in ops]
        types = [d for _, d in ops]
        floats = all(d in (cd, None) for d in types)
        bools = all(d in (torch.bool, None) for d in types)
        op = node.op
        if op is Op.DIV and node.src[0].op is Op.CONST:
            # (a number over a tensor: Python's ``/`` gives ``b.reciprocal() * a``, rounded
            # twice, where the loop would divide once)
            raise Unsupported("a number divided by a value")
        if op in _ARITHMETIC and floats:
            a, b = texts
            if op in (Op.MIN, Op.MAX):  # as reference._minmax
                cmp = "<" if op is Op.MIN else ">"
                x = node.src[0]
                nan = "" if x.op is Op.CONST and x.arg == x.arg else f" || {a} != {a}"
                expr = f"(({a} {cmp} {b}){nan}) ? {a} : {b}"
            else:
                expr = f"{a} {_INFIX[op]} {b}"
            out = cd
        elif op in COMPARISONS and floats:
            expr, out = f"{texts[0]} {_INFIX[op]} {texts[1]}", torch.bool
        elif op in (Op.AND, Op.OR) and bools:
            expr, out = f"{texts[0]} {_INFIX[op]} {texts[1]}", torch.bool
        elif op is Op.NOT and bools:
            expr, out = f"!{texts[0]}", torch.bool
        elif op is Op.NEG and floats:
            expr, out = f"-{texts[0]}", cd
        elif op is Op.ABS and floats:
            expr, out = f"{'fabsf' if cd == torch.float32 else 'fabs'}({texts[0]})", cd
        elif op is Op.SIGN and floats:  # as reference._sign: NaN and -0.0 kept
            x = texts[0]
            expr, out = f"{x} > 0 ? ({ct})1 : ({x} < 0 ? ({ct})-1 : {x})", cd
        elif op is Op.WHERE and types[0] in (torch.bool, None):
            rest = types[1:]
            if node.dtype == "bool" and all(d in (torch.bool, None) for d in rest):
                out = torch.bool
            elif all(d in (cd, None) for d in rest):
                out = cd
            else:
                raise Unsupported("a selection of mixed dtypes")
            expr = f"{texts[0]} ? {texts[1]} : {texts[2]}"
        elif op is Op.BF16 and types[0] == torch.bfloat16:
            expr, out = texts[0], torch.bfloat16
        elif op is Op.BF16 and types[0] == torch.float32 == cd:
            expr, out = f"f32_to_bf16({texts[0]})", torch.bfloat16
        elif op is Op.WIDEN and types[0] == torch.bfloat16:
            expr, out = f"({ct})bf16_to_f32({texts[0]})", cd
        elif op is Op.WIDEN and types[0] == cd:
            expr, out = texts[0], cd
        else:
            raise Unsupported(f"{op.value} of {', '.join(map(str, types))}")
        kinds[line.var] = out
        body.append(f"        const {_C_TYPES[out]} {line.var} = {expr};")
    first = len(args)
    pointers = [f"    const {_C_TYPES[kinds[n]]} *A{k} = (const {_C_TYPES[kinds[n]]} *)a[{k}];"
                for k, n in enumerate(run.full)]
    values = [f"    const {_C_TYPES[kinds[n]]} {n} = *(const {_C_TYPES[kinds[n]]} *)a[{k}];"
              for k, n in enumerate(args) if k >= len(run.full)]
    outs = [f"    {_C_TYPES[kinds[n]]} *O{k} = ({_C_TYPES[kinds[n]]} *)a[{first + k}];"
            for k, n in enumerate(run.made)]
    stores = [f"        O{k}[i] = {n};" for k, n in enumerate(run.made)]
    text = "\n".join([
        HEADER,
        f"/* {run.name}: {', '.join(run.made)} from {', '.join(args)} */",
        "void vega_run(int64_t n, void *const *a, int nth) {",
        *pointers, *values, *outs,
        f"    #pragma omp parallel for simd num_threads(nth) if (n >= {PAR_MIN}) "
        "schedule(static)",
        "    for (int64_t i = 0; i < n; i++) {",
        *body, *stores,
        "    }",
        "}",
        ""])
    return text, [kinds[n] for n in run.made]


class Runs:
    """The runs of one linear program's functions as C loops: ``tiled`` stands for
    ``reference._tiled`` in them."""

    def __init__(self, lin: Linear):
        self.lin = lin
        self.runs = {run.name: run for run in reference.element_runs(lin)}
        self._loops: dict = {}  # (run name, dtypes) -> (ctypes function, output dtypes) or None

    def _loop(self, run: reference.Run, dtypes: dict):
        key = (run.name, tuple(sorted((n, str(d)) for n, d in dtypes.items())))
        if key not in self._loops:
            try:
                text, made = source(run, self.lin, dtypes)
            except Unsupported:
                self._loops[key] = None
            else:
                lib, _, _ = cbuild.build(text)
                fn = lib.vega_run
                fn.restype = None
                fn.argtypes = (ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
                self._loops[key] = (fn, made)
        return self._loops[key]

    def tiled(self, fn, full: tuple, rest: tuple) -> tuple:
        """``reference._tiled(fn, full, rest)``, in one C loop where ``fn`` is a run this
        program's loops compute for these tensors (see the module's notes)."""
        run = self.runs.get(fn.__name__)
        if run is None or not full or len(full) != len(run.full) \
                or len(rest) != len(run.rest) or torch.is_grad_enabled() \
                or torch.compiler.is_compiling():
            return reference._tiled(fn, full, rest)
        t0 = full[0]
        dtypes = {}
        for name, t in zip(run.full, full):
            if type(t) not in PLAIN_TYPES or t.device.type != "cpu" or t.shape != t0.shape \
                    or not t.is_contiguous() or t.is_neg() or t.is_conj():
                return reference._tiled(fn, full, rest)
            dtypes[name] = t.dtype
        numbers = False
        for name, x in zip(run.rest, rest):
            if type(x) in (float, int):  # (a number: of the compute dtype, as torch takes it)
                numbers = True
                continue
            if type(x) not in PLAIN_TYPES or x.device.type != "cpu" or x.is_neg() or (
                    name != "p" and x.dim() != 0):
                return reference._tiled(fn, full, rest)
            dtypes[name] = x.dtype
        if "p" not in dtypes:
            return reference._tiled(fn, full, rest)
        if numbers:
            given = {name for name, x in zip(run.rest, rest) if type(x) in (float, int)}
            if any(line.node.op is Op.DIV and self.lin.names.get(id(line.node.src[0])) in given
                   for line in run.lines):  # (a number over a tensor: see source)
                return reference._tiled(fn, full, rest)
            rest = tuple(torch.tensor(x, dtype=dtypes["p"]) if type(x) in (float, int) else x
                         for x in rest)
            for name, x in zip(run.rest, rest):
                dtypes[name] = x.dtype
        found = self._loop(run, dtypes)
        if found is None:
            return reference._tiled(fn, full, rest)
        loop, out_dtypes = found
        outs = [torch.empty(t0.shape, dtype=d, device=t0.device) for d in out_dtypes]
        values = [x for name, x in zip(run.rest, rest) if name != "p"]
        addresses = (ctypes.c_void_p * (len(full) + len(values) + len(outs)))(
            *(t.data_ptr() for t in (*full, *values, *outs)))
        loop(t0.numel(), addresses, torch.get_num_threads())
        COUNTS["loops"] += 1
        return tuple(outs)


COUNTS = {"loops": 0}  # runs computed in C (a test reads it)


def tiled_for(lin: Linear):
    """``reference.Kernel``'s ``runs``: the ``_tiled`` of the functions rendered from
    ``lin``."""
    return Runs(lin).tiled
