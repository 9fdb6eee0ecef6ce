"""The element runs of a program with matrix products as C loops (``vega.codegen.runs``).

On the C backend each run of element lines around a program's matrix products is one loop
in C over every element, all its values in registers, run on the CPU's threads: one pass
over memory for the run. A loop computes what torch's operations on the CPU compute, bit for
bit (``vega.codegen.runs`` says which runs, and which tensors, it takes).
"""
from __future__ import annotations

import ctypes
import math

import torch

from vega.codegen import runs
from vega.codegen.c import build as cbuild

PAR_MIN = 32768  # a run over fewer elements than this runs on one thread

_C_TYPES = {torch.float32: "float", torch.float64: "double", torch.bfloat16: "uint16_t",
            torch.bool: "uint8_t"}

HEADER = r"""/* vega: an element run of a program with matrix products (vega.codegen.c.runs) */
#include <fenv.h>
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


# the C of each form of a loop's steps (``vega.codegen.runs.expression``)
_FORMS = {
    "arith": "{0} {op} {1}", "divide": "{0} / {1}", "compare": "{0} {op} {1}",
    "min": "(({0} {cmp} {1}){nan}) ? {0} : {1}", "max": "(({0} {cmp} {1}){nan}) ? {0} : {1}",
    "nan": " || {0} != {0}",  # (as reference._minmax: a NaN first operand wins)
    "and": "{0} && {1}", "or": "{0} || {1}", "not": "!{0}", "neg": "-{0}",
    "abs": "{fabs}({0})", "sign": "{0} > 0 ? ({ct})1 : ({0} < 0 ? ({ct})-1 : {0})",
    "where": "{0} ? {1} : {2}", "round": "f32_to_bf16({0})",
    "widen": "({ct})bf16_to_f32({0})", "same": "{0}",
}


def _expr(step: runs.Step, loop: runs.Loop) -> str:
    """The C expression of one step of ``loop``."""
    ct = _C_TYPES[loop.compute]

    def number(v) -> str:
        if isinstance(v, bool):
            return "1" if v else "0"
        lit = "NAN" if v != v else ("INFINITY" if v == math.inf else "(-INFINITY)"
                                    if v == -math.inf else repr(v))
        return f"(({ct}){lit})"
    return runs.expression(step, _FORMS, number, ct=ct,
                           fabs="fabsf" if loop.compute == torch.float32 else "fabs")


def source(loop: runs.Loop) -> str:
    """The C source of ``loop``: it defines ``vega_run(n, args, nth)``, ``args`` the
    addresses of the full inputs, then of the values (0-d tensors), then of the outputs,
    each full input and output of ``n`` elements."""
    full, values, made = loop.full, loop.values, loop.made
    first = len(full) + len(values)
    pointers = [f"    const {_C_TYPES[d]} *A{k} = (const {_C_TYPES[d]} *)a[{k}];"
                for k, (_, d) in enumerate(full)]
    ones = [f"    const {_C_TYPES[d]} {n} = *(const {_C_TYPES[d]} *)a[{len(full) + k}];"
            for k, (n, d) in enumerate(values)]
    outs = [f"    {_C_TYPES[d]} *O{k} = ({_C_TYPES[d]} *)a[{first + k}];"
            for k, (_, d) in enumerate(made)]
    body = [f"        const {_C_TYPES[d]} {n} = A{k}[i];" for k, (n, d) in enumerate(full)]
    body += [f"        const {_C_TYPES[s.dtype]} {s.var} = {_expr(s, loop)};"
             for s in loop.steps]
    stores = [f"        O{k}[i] = {n};" for k, (n, _) in enumerate(made)]
    args = [n for n, _ in (*full, *values)]
    return cbuild.share_fenv("\n".join([
        HEADER,
        f"/* {loop.run.name}: {', '.join(n for n, _ in made)} from {', '.join(args)} */",
        "void vega_run(int64_t n, void *const *a, int nth) {",
        *pointers, *ones, *outs,
        f"    #pragma omp parallel for simd num_threads(nth) if (n >= {PAR_MIN}) "
        "schedule(static)",
        "    for (int64_t i = 0; i < n; i++) {",
        *body, *stores,
        "    }",
        "}",
        ""]))


class CRuns(runs.Runs):
    """The runs of one linear program's functions as C loops on the CPU's threads."""

    NOTE = ("\n# The C backend computes each run of element lines given to _tiled in one C "
            "loop\n# where its operations and its tensors' dtypes allow "
            "(vega.codegen.c.runs).\n")

    def device_ok(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def build(self, loop: runs.Loop):
        lib = cbuild.library(source(loop))
        fn = lib.vega_run
        fn.restype = None
        fn.argtypes = (ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
        return fn

    def call(self, built, loop: runs.Loop, n: int, full: tuple, values: list,
             outs: list) -> None:
        addresses = (ctypes.c_void_p * (len(full) + len(values) + len(outs)))(
            *(t.data_ptr() for t in (*full, *values, *outs)))
        built(n, addresses, torch.get_num_threads())
