"""The C backend: fused multi-tensor CPU kernels, compiled with OpenMP and SIMD.

One shared library per program and dtype group (parameter, gradient and state
dtypes). Its entry points each take the whole group at once -- a table with one
row per tensor (``numel, p, g, state..., step, hyperparameters, p out, state
out...`` as addresses) -- and split the work across threads by element ranges
over all tensors:

- ``vega_prelude``: adds the sum of squares of the unscaled gradients and the
  count of non-finite elements into ``pre``;
- ``vega_phase<k>``: per-tensor reductions (``norm``, ``sum``, ``mean``, ``max``)
  of phase k, into ``red``; values needed on both sides are recomputed;
- ``vega_update``: the spec's element program, skipping every write when
  ``pre`` counted a non-finite gradient. It reads p and the states at their
  addresses and writes them at the "out" ones: the same addresses for a step in
  place, new tensors for a pure step, which so takes one pass, not a copy and
  then a step (a skipped pure step copies the inputs there);
- ``vega_advance``: the step counters plus one, unless skipped.

Reductions combine per-thread partial results in thread order, so a step is
bitwise reproducible for a given thread count.

A program over a matrix view (row/column reductions or state, ``Program.uses_axes``)
gets ``vega_axes_step`` instead of the phases and the update: it steps the tensors
one at a time, each through a sequence of loops over one domain (see
``AxesSource``), and its results do not depend on the thread count. Its table
rows have the same columns, with the geometry before the outputs. A step with a
non-contiguous tensor runs on contiguous copies, in place.

Each value x of the program (``vega.codegen.base.linearize``: p, g, t, h_<hyperparameter>,
s_<state>, v_<value>) is ``v_x`` in the compute type, ``d_x`` in double (the scalar
phase) and ``m_x`` where it is kept in a buffer; no other identifier of a kernel, nor a
macro of the headers it includes, begins with v_, d_ or m_, so that no spec name can meet
a C keyword, a macro or a local.
"""
from __future__ import annotations

import ctypes
import itertools
import math
import operator
import threading
import weakref

import numpy as np
import torch
from torch.autograd.graph import increment_version

from vega.codegen import cbuild, native, record, reference
from vega.codegen.base import (HyperRows, Linear, Renderer, axis_geometry, check_states,
                               distinct, is_schedule, linearize, reduction_phases, state_var)
from vega.codegen.tensors import (has_own_ops, own_ops_words, refuse_inplace, resolved, roles,
                                  shared_pair)
from vega.dsl.check import matrix_axes
from vega.tracing import untraced
from vega.dsl.ir import (AXIS_REDUCTIONS, DOMAIN_WORDS, DOMAINS, LEAVES, REDUCTIONS, Kind, Node,
                        Op, Program, walk)

# dtype name -> (C storage type, load to compute type, store from compute type)
STORAGE = {
    "float32": ("float", "(CT)({x})", "(float)({x})"),
    "float64": ("double", "(CT)({x})", "(double)({x})"),
    "bfloat16": ("uint16_t", "(CT)bf16_to_f32({x})", "f32_to_bf16((float)({x}))"),
    "float16": ("_Float16", "(CT)({x})", "(_Float16)({x})"),
}

INCLUDES = """#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
"""

HEADER = r"""
const char *vega_key(void) { return "@KEY@"; }

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline CT vmin(CT a, CT b) { return (a < b || a != a) ? a : b; }  /* NaN wins */
static inline CT vmax(CT a, CT b) { return (a > b || a != a) ? a : b; }
static inline CT vsign(CT a) { return a > 0 ? (CT)1 : (a < 0 ? (CT)-1 : a); }
static inline double dmin(double a, double b) { return (a < b || a != a) ? a : b; }
static inline double dmax(double a, double b) { return (a > b || a != a) ? a : b; }
static inline double dsign(double a) { return a > 0 ? 1.0 : (a < 0 ? -1.0 : a); }
/* Whether x * (1 / c) stands for x / c (within two units in the last place) for every x:
   unless the reciprocal of a finite nonzero c is subnormal or overflows. */
static inline int recip_ok(CT c) {
    CT r = (CT)(1.0 / (double)c);
    return !(isfinite(c) && c != 0) || isnormal(r);
}

/* Split [0, total) into nth ranges; tensor i covers [start[i], start[i+1]). */
static int64_t locate(const int64_t *start, int64_t nt, int64_t x) {
    int64_t lo = 0, hi = nt;  /* last i with start[i] <= x */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (start[mid] <= x) lo = mid; else hi = mid;
    }
    return lo;
}
static int64_t *starts(int64_t nt, const int64_t *tab) {
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (nt + 1));
    start[0] = 0;
    for (int64_t i = 0; i < nt; i++) start[i + 1] = start[i] + tab[i * ROW + COL_NUMEL];
    return start;
}
#define PAR_MIN 32768  /* fewer elements than this run on one thread */
#define SPLIT_MIN 16384  /* a thread's share of a tensor at least this long is read as four
                            quarters at once: one run of loads alone does not keep enough of
                            them in flight to use the memory bandwidth */

void vega_prelude(int64_t nt, const int64_t *tab, double *pre, int nth) {
    /* pre[PRE_SUM_SQ] += sum of squares of g * pre[PRE_INV_SCALE];
       pre[PRE_NONFINITE] += count of non-finite elements */
    int64_t *start = starts(nt, tab);
    int64_t total = start[nt];
    const CT gs = (CT)pre[PRE_INV_SCALE];
    double *part = (double *)calloc(2 * (size_t)(nth > 0 ? nth : 1), sizeof(double));
    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN)
    {
        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;
        double sq = 0, bad = 0;
        int64_t i = lo < hi ? locate(start, nt, lo) : nt;
        while (lo < hi) {
            const int64_t *row = tab + i * ROW;
            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[COL_G];
            int64_t numel = row[COL_NUMEL];
            int64_t b = lo - start[i], e = numel < hi - start[i] ? numel : hi - start[i];
            /* blocks of 512 summed in the compute type at full SIMD width, the blocks in
               double; a non-finite element (NaN or inf) sets a flag, not the sum. Four
               quarters of the range are read at once: one stream alone does not keep
               enough loads in flight to use the memory bandwidth */
            int64_t q = (e - b) / 4;
            for (int64_t o = 0; o < q; o += 512) {
                int64_t n = q - o < 512 ? q - o : 512;
                const GSTORE *A = G_ + b + o, *B = A + q, *C = B + q, *D = C + q;
                CT part = 0;
                int nonfinite = 0;
                #pragma omp simd reduction(+:part) reduction(|:nonfinite)
                for (int64_t j = 0; j < n; j++) {
                    CT g0 = LOAD_G(A[j]) * gs, g1 = LOAD_G(B[j]) * gs;
                    CT g2 = LOAD_G(C[j]) * gs, g3 = LOAD_G(D[j]) * gs;
                    part += (g0 * g0 + g1 * g1) + (g2 * g2 + g3 * g3);
                    nonfinite |= !(FABS(g0) < (CT)INFINITY) | !(FABS(g1) < (CT)INFINITY)
                                 | !(FABS(g2) < (CT)INFINITY) | !(FABS(g3) < (CT)INFINITY);
                }
                sq += (double)part;
                bad += nonfinite;
            }
            for (int64_t j0 = b + 4 * q; j0 < e; j0 += 2048) {
                int64_t j1 = e < j0 + 2048 ? e : j0 + 2048;
                CT part = 0;
                int nonfinite = 0;
                #pragma omp simd reduction(+:part) reduction(|:nonfinite)
                for (int64_t j = j0; j < j1; j++) {
                    CT g = LOAD_G(G_[j]) * gs;
                    part += g * g;
                    nonfinite |= !(FABS(g) < (CT)INFINITY);
                }
                sq += (double)part;
                bad += nonfinite;
            }
            lo = start[i] + e; i++;
        }
        part[2 * tid] = sq; part[2 * tid + 1] = bad;
    }
    for (int t = 0; t < (nth > 0 ? nth : 1); t++) {
        pre[PRE_SUM_SQ] += part[2 * t];
        pre[PRE_NONFINITE] += part[2 * t + 1];
    }
    free(part); free(start);
}

void vega_advance(int64_t n, const int64_t *steps, const double *pre) {
    if (pre && pre[PRE_NONFINITE] != 0 && pre[PRE_CHECK] != 0)
        return;  /* a skipped step leaves the counters alone */
    for (int64_t k = 0; k < n; k++) {
        int32_t *s = (int32_t *)(intptr_t)steps[k];
        if (*s < INT32_MAX) *s += 1;
    }
}
"""


def _fn(element, scalar):
    """A call: the compute-type function in the element loop, the double one in the scalar phase."""
    return lambda self, node, phase, *a: \
        f"{scalar if phase == 'scalar' else element}({', '.join(a)})"


def _div(self, node, phase, a, b):
    """``a / b``, or ``a`` times the reciprocal of a per-tensor ``b`` computed once before
    the loop (a division costs several multiplications: adamw's bias corrections)."""
    recip = self.recip.get(id(node.src[1])) if phase == "element" else None
    return f"{a} * {recip}" if recip else f"{a} / {b}"


class CRenderer(Renderer):
    recip: dict[int, str] = {}  # id of a per-tensor divisor -> its reciprocal's variable

    code_for_op = {
        Op.DIV: _div,
        Op.NEG: lambda self, node, phase, a: f"-{a}",
        Op.POW: _fn("POW", "pow"),
        Op.AND: lambda self, node, phase, a, b: f"({a} && {b})",
        Op.OR: lambda self, node, phase, a, b: f"({a} || {b})",
        Op.NOT: lambda self, node, phase, a: f"(!{a})",
        Op.WHERE: lambda self, node, phase, c, a, b: f"({c} ? {a} : {b})",
        Op.SQRT: _fn("SQRT", "sqrt"),
        Op.RSQRT: lambda self, node, phase, a: (f"(1.0 / sqrt({a}))" if phase == "scalar"
                                                else f"((CT)1 / SQRT({a}))"),
        Op.EXP: _fn("EXP", "exp"),
        Op.LOG: _fn("LOG", "log"),
        Op.ABS: _fn("FABS", "fabs"),
        Op.SIGN: _fn("vsign", "dsign"),
        Op.MIN: _fn("vmin", "dmin"),
        Op.MAX: _fn("vmax", "dmax"),
    }

    def const(self, value) -> str:
        if isinstance(value, bool):
            return "1" if value else "0"
        if math.isnan(value):
            return "((CT)NAN)"
        if math.isinf(value):
            return "((CT)INFINITY)" if value > 0 else "((CT)-INFINITY)"
        return f"((CT){value!r})"

    def operand(self, linear: Linear, node: Node, phase: str = "element") -> str:
        if node.op is Op.CONST:
            return self.const(node.arg)
        if node.kind <= Kind.SCALAR:  # scalars: double in their phase, CT in the element loop
            return ("d_" if phase == "scalar" else "v_") + linear.ref(node)
        return "v_" + linear.ref(node)


# how each reduction accumulates its values, and how partial results combine
_HOW = {Op.AMAX: "max", Op.NORM: "sumsq", Op.SUM: "sum", Op.MEAN: "sum"}
_PARTIALS = {Op.AMAX: "max", Op.NORM: "sum", Op.SUM: "sum", Op.MEAN: "sum"}


def _combine(how: str, acc: str, x: str) -> str:
    """The statement adding value ``x`` into the double accumulator ``acc``."""
    if how == "max":  # NaN propagates, as torch.amax
        return f"{acc} = ({x} > {acc} || {x} != {x}) ? {x} : {acc};"
    if how == "sumsq":
        return f"{acc} += (double){x} * (double){x};"
    return f"{acc} += (double){x};"


def _finish(op: Op, acc: str, count: str) -> str:
    """A per-tensor reduction's value from its combined accumulator over ``count`` values."""
    return {Op.NORM: f"sqrt({acc})", Op.SUM: acc, Op.MEAN: f"{acc} / {count}",
            Op.AMAX: acc}[op]


class Source:
    """The C source of one program for one dtype group."""

    def __init__(self, program: Program, pdt: str, gdt: str, sdt: str):
        self.program, self.lin = program, linearize(program)
        self.r = CRenderer()
        self.phases = reduction_phases(program)
        self.slots = {id(n): j for j, n in enumerate(n for ph in self.phases for n in ph)}
        self.dtypes = (pdt, gdt, sdt)

    @property
    def nstate(self) -> int:
        return len(self.program.states)

    def text(self) -> str:
        pdt, gdt, sdt = self.dtypes
        ct = "double" if pdt == "float64" else "float"
        suffix = "" if ct == "double" else "f"
        flags = ", ".join(f"{k}={str(v).lower()}" for k, v in self.program.flags) or "none"
        out = [f"/* vega C kernel: {self.program.name} (flags: {flags}); params {pdt}, grads "
               f"{gdt}, state {sdt}, arithmetic in {ct} */",
               INCLUDES, f"typedef {ct} CT;"]
        for tag, dt in (("P", pdt), ("G", gdt), ("S", sdt)):
            store, load, save = STORAGE[dt]
            out.append(f"typedef {store} {tag}STORE;")
            out.append(f"#define LOAD_{tag}(x) {load.format(x='x')}")
            out.append(f"#define SAVE_{tag}(x) {save.format(x='x')}")
        for name in ("SQRT", "EXP", "LOG", "POW"):
            out.append(f"#define {name} {name.lower()}{suffix}")
        out.append(f"#define FABS fabs{suffix}")
        out.append(f"#define NRED {len(self.slots)}")
        out += record.c_defines()  # the prelude's record
        out += self.columns.c_defines()  # the address table's row
        out.append(HEADER)
        out += self._entries()
        return "\n".join(out)

    @property
    def columns(self) -> record.Columns:
        """The address table's columns (``vega.codegen.record.TABLE_COLUMNS``). Those the
        update writes come after the hyperparameters, so that a step out of place reads its
        inputs and writes new tensors (the same addresses as the inputs' for a step in
        place)."""
        return record.table_columns(self.nstate)

    def _entries(self) -> list[str]:
        """The program's entry points (beside the prelude and the step counters')."""
        self.early = self._early_stores()
        out = []
        for k, phase in enumerate(self.phases):
            out += self._phase(k, phase)
        return out + self._update() + self._fused()

    def _early_stores(self) -> list[list[tuple[str, Node]]]:
        """Per reduction phase, the state updates it writes: a new state value computed in
        a phase anyway (lamb's moments, which its norms read) is stored there and loaded
        by the later loops rather than computed again from the gradient and the old value
        (which those loops then do not read). Only where the storage holds the compute
        type exactly, and only where no later loop reads the old value."""
        pdt, _, sdt = self.dtypes
        if not self.phases or not (sdt == "float64" or (sdt == "float32" and pdt != "float64")):
            return [[] for _ in self.phases]
        banned: set[str] = set()
        while True:
            plan, stored, ok = [], {}, True
            for phase in self.phases:
                nodes = {id(n) for n in self._element_nodes(phase, stored)[0]}
                here = [(t, n) for t, n in self.program.updates
                        if t != "p" and t not in banned and id(n) in nodes
                        and id(n) not in stored]
                plan.append(here)
                stored.update({id(n): t for t, n in here})
            # the old values each later loop reads, with what the loops before it stored
            later = [self._element_nodes(self.phases[j], _stores_of(plan[:j]))[2]
                for j in range(1, len(self.phases))]
            later.append(self._element_nodes(self._update_roots(stored), stored)[2])
            for k, here in enumerate(plan):
                for t, node in here:
                    if any(t in reads for reads in later[k:]):
                        # and every state whose new value is the same node: the update
                        # writes none of a node's states once one of them is stored
                        banned.update(u for u, m in self.program.updates if m is node)
                        ok = False
            if ok:
                return plan

    def _stored(self, upto: int) -> dict[int, str]:
        """The values stored by the phases before ``upto``: id -> state name."""
        return _stores_of(self.early[:upto])

    def _update_roots(self, stored) -> list[Node]:
        return [n for t, n in self.program.updates if not (t != "p" and id(n) in stored)]

    # -- pieces ---------------------------------------------------------------
    def _var(self, node: Node) -> str:
        return "v_" + self.lin.ref(node)

    def _block_start(self, uses: list[Node]) -> list[str]:
        """Per tensor: the scalar phase, the reductions already known, the pointers."""
        lin, r = self.lin, self.r
        out = ["            const double *H_ = (const double *)(intptr_t)row[COL_HYPER];",
               "            const double d_t = "
               "(double)(*(const int32_t *)(intptr_t)row[COL_STEP]) + 1;"]
        for k, h in enumerate(lin.hypers):
            out.append(f"            const double d_{h} = H_[{k}];")
        for line in lin.scalar_lines:  # the scalar phase, in double like the reference
            ctype = "int" if line.node.dtype == "bool" else "double"
            out.append(f"            const {ctype} d_{line.var} = "
                       f"{r.expr(lin, line.node, 'scalar').replace('(CT)', '(double)')};")
        for var in ("t", *lin.hypers, *(ln.var for ln in lin.scalar_lines)):
            node_dtype = next((ln.node.dtype for ln in lin.scalar_lines if ln.var == var), "float")
            ctype = "int" if node_dtype == "bool" else "CT"
            out.append(f"            const {ctype} v_{var} = ({ctype})d_{var};")
        for node in uses:
            out.append(f"            const CT {self._var(node)} = "
                       f"(CT)red[i * NRED + {self.slots[id(node)]}];")
        out += ["            const PSTORE *P_ = (const PSTORE *)(intptr_t)row[COL_P];",
                "            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[COL_G];",
                "            PSTORE *PO_ = (PSTORE *)(intptr_t)row[COL_P_OUT];"]
        for k in range(self.nstate):
            out.append(f"            const SSTORE *S{k}_ = (const SSTORE *)(intptr_t)"
                       f"row[COL_STATE + {k}];")
            out.append(f"            SSTORE *SO{k}_ = (SSTORE *)(intptr_t)"
                       f"row[COL_STATE_OUT + {k}];")
        return out

    def _element_nodes(self, roots: list[Node], stored=None) \
            -> tuple[list[Node], list[Node], set[str]]:
        """The element-phase values reaching ``roots`` in order, the earlier reductions they
        read, and the states whose old values they read. ``stored``: values an earlier
        loop stored (id -> state), loaded here (among the values), not computed."""
        stored = stored or {}
        nodes, used, reads = [], [], set()
        seen: set[int] = set()
        stack = list(roots)
        needed = []
        while stack:  # collect, stopping at reductions of earlier phases
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            needed.append(node)
            if node.op is Op.STATE:
                reads.add(node.arg)
            if (node.op in REDUCTIONS and node not in roots) or id(node) in stored:
                continue
            stack.extend(node.src)
        order = {id(n): k for k, n in enumerate(walk(roots))}
        for node in sorted(needed, key=lambda n: order[id(n)]):
            if node.op in REDUCTIONS and node not in roots:
                used.append(node)
            elif node.kind >= Kind.TENSOR and node.op not in (Op.PARAM, Op.GRAD, Op.STATE) \
                    and node.op is not Op.CONST and node.op not in REDUCTIONS:
                nodes.append(node)
        return nodes, used, reads

    def _element_lines(self, nodes: list[Node], stored=None) -> list[str]:
        lines = []
        for node in nodes:
            ctype = "int" if node.dtype == "bool" else "CT"
            if stored and id(node) in stored:
                value = f"LOAD_S(SO{self.program.state_names.index(stored[id(node)])}_[j])"
            else:
                value = self.r.expr(self.lin, node, 'element')
            lines.append(f"                const {ctype} {self._var(node)} = {value};")
        return lines

    def _load(self, node: Node, index: str) -> str:
        """The declaration loading leaf ``node`` (p, g or a state) at ``index``."""
        if node.op is Op.PARAM:
            return f"const CT v_p = LOAD_P(P_[{index}]);"
        if node.op is Op.GRAD:
            return f"const CT v_g = LOAD_G(G_[{index}]) * gs * coef;"
        k = self.program.state_names.index(node.arg)
        return f"const CT v_{state_var(node.arg)} = LOAD_S(S{k}_[{index}]);"

    def _loads(self) -> list[str]:
        leaves = [Node(Op.PARAM), Node(Op.GRAD)] + [Node(Op.STATE, arg=s.name)
                                                    for s in self.program.states]
        return ["                " + self._load(leaf, "j") for leaf in leaves]

    def _store(self, target: str, value: str, index: str) -> str:
        """The statement writing ``value`` to output ``target`` ("p" or a state) at ``index``."""
        if target == "p":
            return f"PO_[{index}] = SAVE_P({value});"
        return f"SO{self.program.state_names.index(target)}_[{index}] = SAVE_S({value});"

    @staticmethod
    def _prologue(skip: str = "return;") -> list[str]:
        """The gradient scale and clip coefficient from ``pre``, or a skipped step."""
        return ["    CT gs = 1, coef = 1;",
                "    if (pre) {",
                f"        if (pre[PRE_NONFINITE] != 0 && pre[PRE_CHECK] != 0) {skip}  "
                "/* non-finite gradients: skip */",
                "        gs = (CT)pre[PRE_INV_SCALE];",
                "        if (pre[PRE_MAX_NORM] > 0)",
                "            coef = (CT)(pre[PRE_MAX_NORM] / fmax(sqrt(pre[PRE_SUM_SQ]), "
                "pre[PRE_MAX_NORM]));",
                "    }"]

    def _parallel(self, name: str, skip: str, before=()) -> list[str]:
        """An entry point's head: the prologue, the tensors' starts, and a thread's share
        [lo, hi) of all their elements, from tensor i (the one holding lo) on."""
        return [
            f"void {name}(int64_t nt, const int64_t *tab, const double *pre, double *red, "
            "int nth) {",
            *self._prologue(skip),
            "    int64_t *start = starts(nt, tab);",
            "    int64_t total = start[nt];",
            *before,
            "    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN) "
            "firstprivate(gs, coef)",
            "    {",
            "        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();",
            "        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;",
            "        int64_t i = lo < hi ? locate(start, nt, lo) : nt;"]

    def _loop(self, name, before, uses, block_init, nodes, tail, block_end, finish, simd="",
              stored=None, skip="return;"):
        return [
            *self._parallel(name, skip, before),
            "        while (lo < hi) {",
            "            const int64_t *row = tab + i * ROW;",
            "            int64_t b = lo - start[i];",
            "            int64_t e = row[COL_NUMEL] < hi - start[i] ? row[COL_NUMEL] : "
            "hi - start[i];",
            *self._block_start(uses),
            *block_init,
            *self._versions(nodes, tail, simd, stored),
            *block_end,
            "            lo = start[i] + e; i++;",
            "        }",
            "    }",
            *finish,
            "    free(start);",
            "}",
            "",
        ]

    def _versions(self, nodes: list[Node], tail: list[str], simd, stored) -> list[str]:
        """The element loop computing ``nodes``, then ``tail``. Where it divides by
        per-tensor values, two versions: one multiplying by their reciprocals, taken when
        every reciprocal is a normal number (``recip_ok``), and one dividing."""
        pragma = [f"            #pragma omp simd{simd}"] if simd is not None else []
        # values of the tensor, not of an element (a trust ratio): once, before the loops,
        # where gcc would not vectorize a select on them in four quarters
        # (not one that reads a value stored by an earlier phase: loaded per element)
        inside, out = {id(n) for n in nodes}, set()
        for n in nodes:
            if n.kind == Kind.TENSOR and not (stored and id(n) in stored) \
                    and all(id(s) in out or id(s) not in inside for s in n.src):
                out.add(id(n))
        hoisted = [n for n in nodes if id(n) in out]
        head = [line[4:] for line in self._element_lines(hoisted, stored)]
        nodes = [n for n in nodes if id(n) not in out]

        def loop(indent: str) -> list[str]:
            body = [*self._loads(), *self._element_lines(nodes, stored), *tail]
            quarters = []
            for k in range(4):
                quarters += ["                {",
                             f"                    const int64_t j = j0 + {k} * q_;",
                             *("    " + line for line in body), "                }"]
            lines = ["            int64_t r_ = b;  /* [b, r_) done a quarter at a time */",
                     "            if (e - b >= SPLIT_MIN) {",
                     "                const int64_t q_ = (e - b) / 4;",
                     *("    " + line for line in pragma),
                     "                for (int64_t j0 = b; j0 < b + q_; j0++) {",
                     *("    " + line for line in quarters),
                     "                }",
                     "                r_ = b + 4 * q_;",
                     "            }",
                     *pragma, "            for (int64_t j = r_; j < e; j++) {", *body,
                     "            }"]
            return [indent + line for line in lines]
        divisors = {id(n.src[1]): n.src[1] for n in nodes
                    if n.op is Op.DIV and n.src[1].kind == Kind.SCALAR
                    and not (stored and id(n) in stored)}
        if not divisors:
            return head + loop("")
        names = {k: f"r{q}_" for q, k in enumerate(divisors)}
        values = {k: self.r.operand(self.lin, d) for k, d in divisors.items()}
        out = [f"            const CT {names[k]} = (CT)(1.0 / (double){values[k]});"
               for k in divisors]
        self.r.recip = names
        try:
            fast = loop("    ")
        finally:
            self.r.recip = {}
        ok = " && ".join(f"recip_ok({v})" for v in values.values())
        return head + out + [f"            if ({ok}) {{", *fast, "            } else {",
                      *loop("    "), "            }"]

    def _phase_parts(self, k: int, phase: list[Node]):
        """(stored, nodes, used, identities, loop tail, simd clause) of phase ``k``."""
        stored = self._stored(k)
        nodes, used, _ = self._element_nodes(phase, stored)
        ident = ["-INFINITY" if n.op is Op.AMAX else "0" for n in phase]
        tail = ["                " + self._store(t, self._var(n), "j") for t, n in self.early[k]]
        for q, node in enumerate(phase):
            tail.append("                " + _combine(_HOW[node.op], f"acc{q}",
                                                      self.r.operand(self.lin, node.src[0])))
        sums = [f"acc{q}" for q, n in enumerate(phase) if n.op is not Op.AMAX]
        # a NaN-propagating max is no OpenMP reduction: such a phase runs without simd
        simd = None if len(sums) < len(phase) else f" reduction(+:{', '.join(sums)})"
        return stored, nodes, used, ident, tail, simd

    def _phase(self, k: int, phase: list[Node]) -> list[str]:
        """Per-tensor reductions: per-thread partials, combined in thread order."""
        stored, nodes, used, ident, tail, simd = self._phase_parts(k, phase)
        nr = len(phase)
        nthr = "(size_t)(nth > 0 ? nth : 1)"
        before = [f"    static const double ident[{nr}] = {{{', '.join(ident)}}};",
                  f"    size_t nslots = {nthr} * (size_t)nt * {nr};",
                  "    double *part = (double *)malloc(sizeof(double) * (nslots ? nslots : 1));",
                  f"    for (size_t q = 0; q < nslots; q++) part[q] = ident[q % {nr}];"]
        block_init = ["            double " + ", ".join(
            f"acc{q} = {ident[q]}" for q in range(nr)) + ";"]
        block_end = [f"            part[((size_t)tid * nt + i) * {nr} + {q}] = acc{q};"
                     for q in range(nr)]
        finish = ["    for (int64_t i = 0; i < nt; i++) {"]
        for q, node in enumerate(phase):
            finish.append(f"        double r{q} = {ident[q]};")
            finish.append(f"        for (size_t t = 0; t < {nthr}; t++) {{")
            finish.append(f"            double x = part[(t * nt + i) * {nr} + {q}];")
            finish.append(f"            {_combine(_PARTIALS[node.op], f'r{q}', 'x')}")
            finish.append("        }")
            value = _finish(node.op, f"r{q}", "(double)tab[i * ROW + COL_NUMEL]")
            finish.append(f"        red[i * NRED + {self.slots[id(node)]}] = {value};")
        finish += ["    }", "    free(part);"]
        return self._loop(f"vega_phase{k}", before, used, block_init, nodes, tail, block_end,
                          finish, simd, stored)

    def _fused(self) -> list[str]:
        """``vega_fused``, for tables of small tensors only (``FUSED_MAX``): each thread takes
        whole tensors and runs every phase and then the update on one tensor before the
        next, so that the update reads what the phases read from the cache, not from
        memory. A tensor's reductions are summed by one thread, in one pass."""
        if not self.phases:
            return []
        body = []
        for k, phase in enumerate(self.phases):
            stored, nodes, used, ident, tail, simd = self._phase_parts(k, phase)
            body += ["            {  /* phase %d */" % k, *self._block_start(used),
                     "            double " + ", ".join(
                         f"acc{q} = {ident[q]}" for q in range(len(phase))) + ";",
                     *self._versions(nodes, tail, simd, stored)]
            for q, node in enumerate(phase):
                body += [f"            double r{q} = {ident[q]};",
                         f"            {_combine(_PARTIALS[node.op], f'r{q}', f'acc{q}')}",
                         f"            red[i * NRED + {self.slots[id(node)]}] = "
                         f"{_finish(node.op, f'r{q}', '(double)row[COL_NUMEL]')};"]
            body.append("            }")
        stored, nodes, used, stores = self._update_parts()
        body += ["            {  /* the update */", *self._block_start(used),
                 *self._versions(nodes, stores, "", stored), "            }"]
        return [
            *self._parallel("vega_fused", "{ pass_through(nt, tab); return; }"),
            "        if (i < nt && start[i] < lo) i++;  /* the tensors that start in [lo, hi) */",
            "        for (; i < nt && start[i] < hi; i++) {",
            "            const int64_t *row = tab + i * ROW;",
            "            const int64_t b = 0, e = row[COL_NUMEL];",
            *body,
            "        }",
            "    }",
            "    free(start);",
            "}",
            "",
        ]

    def _count(self, dom: str) -> str:
        """The number of values of a state of domain ``dom`` in a table row: numel."""
        return "row[COL_NUMEL]"

    def _pass_through(self) -> list[str]:
        """A skipped step out of place: each output (p out, state out) a copy of its input."""
        copies = [("row[COL_NUMEL]", "COL_P_OUT", "COL_P", "PSTORE")] + [
            (self._count(st.dom), f"COL_STATE_OUT + {k}", f"COL_STATE + {k}", "SSTORE")
            for k, st in enumerate(self.program.states)]
        out = ["/* A skipped step out of place: each output a copy of its input. */",
               "static void pass_through(int64_t nt, const int64_t *tab) {",
               "    for (int64_t i = 0; i < nt; i++) {",
               "        const int64_t *row = tab + i * ROW;"]
        if any(n.startswith("geo") for n, *_ in copies):
            out.append("        const int64_t *geo = row + COL_GEO;  /* axis_geometry */")
        for n, to, src, store in copies:
            out += [f"        if ({n} > 0 && row[{to}] != row[{src}])",
                    f"            memcpy((void *)(intptr_t)row[{to}],",
                    f"                   (const void *)(intptr_t)row[{src}], (size_t){n} * "
                    f"sizeof({store}));"]
        return out + ["    }", "}", ""]

    def _update_parts(self):
        """(stored, nodes, used, stores) of the update."""
        stored = self._stored(len(self.phases))
        roots = self._update_roots(stored)
        nodes, used, _ = self._element_nodes(roots, stored)
        # a per-tensor reduction that is itself a new value (s = norm(g)): from its phase too
        for n in roots:
            if n.op in REDUCTIONS and all(u is not n for u in used):
                used.append(n)
        stores = ["                " + self._store(target, self.r.operand(self.lin, node), "j")
                  for target, node in self.program.updates
                  if target == "p" or id(node) not in stored]
        return stored, nodes, used, stores

    def _update(self) -> list[str]:
        stored, nodes, used, stores = self._update_parts()
        return self._pass_through() + self._loop(
            "vega_update", [], used, [], nodes, stores, [], [], "", stored,
            skip="{ pass_through(nt, tab); return; }")




# -- programs over a matrix view ---------------------------------------------------

NGEO = 13  # the integers after a table row's hyperparameters: axis_geometry, line_lengths

AXES_HEADER = r"""
#define CHUNK 4096  /* positions a task of a loop over one domain takes (one partial sum) */
#define GB 1024  /* outputs an axis reduction of strided sources combines side by side */

/* the position, among the values of a smaller domain, that position i reads: i with an
   axis of length n and inner stride inner taken out (vega.codegen.base.axis_geometry) */
static inline int64_t drop(int64_t i, int64_t inner, int64_t n) {
    return (i / (inner * n)) * inner + i % inner;
}
"""

# a domain in C names: n_rc, n_r, n_c, n_m count its values
_TAG = {"rc": "rc", "r": "r", "c": "c", "": "m"}
# (domain of a loop, smaller domain) -> the index into the smaller one's values at position {i}
_MAPS = {("rc", "r"): "drop({i}, fc, Sc)", ("rc", "c"): "drop({i}, fr, Sr)",
         ("rc", ""): "drop(drop({i}, fc, Sc), rr, Sr)", ("r", ""): "drop({i}, rr, Sr)",
         ("c", ""): "drop({i}, cc, Sc)"}
# (domain of an axis reduction's source, the axis it reduces) -> (inner stride, length)
_AXIS = {("rc", "c"): ("fc", "Sc"), ("rc", "r"): ("fr", "Sr"), ("r", "r"): ("rr", "Sr"),
         ("c", "c"): ("cc", "Sc")}
_IDENT = {"max": "-INFINITY", "sum": "0", "sumsq": "0", "mean": "0"}


def line_lengths(shape) -> tuple[int, int, int]:
    """For the loops over the values per element, per row and per column of a tensor of
    ``shape``: a length L such that along every run of L positions that starts at a
    multiple of L, each index map into a smaller domain (``_MAPS``) is affine with step 0
    or 1. It is the size of the domain's axes after its last matrix axis where that is
    above 1, else the size of that axis; a domain without a matrix axis maps to the others
    one to one."""
    shape = tuple(int(n) for n in shape)
    r, c = matrix_axes(shape)
    out = []
    for dom in ("rc", "r", "c"):
        kept = [a for a in range(len(shape))
                if not (a == r and "r" not in dom) and not (a == c and "c" not in dom)]
        last = max((a for a in kept if a in (r, c)), default=None)
        if last is None:
            out.append(max(1, math.prod(shape[a] for a in kept)))
            continue
        after = math.prod(shape[a] for a in kept if a > last)
        out.append(max(1, after if after > 1 else shape[last]))
    return tuple(out)


class AxesSource(Source):
    """The C source of a program over a matrix view (``Program.uses_axes``).

    ``vega_axes_step`` steps the tensors of the table one at a time. Per tensor, after
    the scalar phase, come stages of loops, each over the values of one domain (per
    element, row, column or matrix: ``vega.dsl.ir``); every loop is an OpenMP loop over
    its outputs with a static schedule, so a step does not depend on the thread count:

    - an axis reduction (``row_mean`` ...) is *materialized*: computed into a buffer of
      its domain, each output combining its sources in order (in double; across rows, in
      up to 8 fixed parts of the rows, each in order, the parts then in order);
    - so is any other value that a value of a larger domain reads (a broadcast), or
      that is written to an output of a larger domain;
    - a per-tensor reduction (``norm`` ...) accumulates over its argument's domain, in
      partials of CHUNK positions combined in order;
    - everything else is computed where it is used, in a loop over its own domain.

    A stage runs once what it reads is done. Every output is computed from the old
    values: a last pass writes them, by a loop per element (p, state like p), then per
    row, then per column; a position there reads its own old values, materialized ones,
    and state of a smaller domain, which only a later loop writes.
    """

    @property
    def columns(self) -> record.Columns:
        """The address table's columns, with the geometry."""
        return record.table_columns(self.nstate, NGEO)

    def __init__(self, program: Program, pdt: str, gdt: str, sdt: str):
        super().__init__(program, pdt, gdt, sdt)
        self.nodes = walk(node for _, node in program.updates)
        self.order = {id(n): k for k, n in enumerate(self.nodes)}
        self.doms = {"p": "rc", **{s.name: s.dom for s in program.states}}
        self.mat: dict[int, Node] = {}  # materialized values, by id
        for node in self.nodes:
            if node.op in AXIS_REDUCTIONS:
                self.mat[id(node)] = node
            elif node.kind == Kind.ELEMENT:
                for s in node.src:
                    if s.kind == Kind.ELEMENT and s.op not in LEAVES and s.dom != node.dom:
                        self.mat[id(s)] = s
        for target, node in program.updates:
            if node.kind == Kind.ELEMENT and node.op not in LEAVES \
                    and node.dom != self.doms[target]:
                self.mat[id(node)] = node
        # the stage computing each materialized value and reduction; ``ready``: the stage
        # after which a value can be read
        self.stage: dict[int, int] = {}
        self.ready: dict[int, int] = {}
        for node in self.nodes:
            level = max((self.ready[id(s)] for s in node.src), default=0)
            if id(node) in self.mat or node.op in REDUCTIONS:
                level += 1
                self.stage[id(node)] = level
            self.ready[id(node)] = level

    def _buf(self, node: Node) -> str:
        return "m_" + self.lin.ref(node)

    def _body(self, roots, dom: str, index, compute=frozenset()) -> list[str]:
        """Statements computing ``roots`` at one position of a loop over ``dom``: the leaves
        and materialized values they read, loaded (``index(d)``: the position's index into
        the values of domain ``d``), and the values in between, computed. ``compute``:
        materialized roots to compute here rather than load."""
        found: dict[int, Node] = {}
        stack = [n for n in roots if n.kind == Kind.ELEMENT]
        while stack:
            node = stack.pop()
            if id(node) in found:
                continue
            found[id(node)] = node
            if node.op not in LEAVES and (id(node) not in self.mat or id(node) in compute):
                stack.extend(s for s in node.src if s.kind == Kind.ELEMENT)
        out = []
        for node in sorted(found.values(), key=lambda n: self.order[id(n)]):
            ctype = "int" if node.dtype == "bool" else "CT"
            if node.op in LEAVES:
                out.append(self._load(node, index(node.dom)))
            elif id(node) in self.mat and id(node) not in compute:
                value = f"{self._buf(node)}[{index(node.dom)}]"
                out.append(f"const {ctype} {self._var(node)} = "
                           f"{value + ' != 0' if ctype == 'int' else value};")
            else:
                out.append(f"const {ctype} {self._var(node)} = "
                           f"{self.r.expr(self.lin, node, 'element')};")
        return out

    def _over(self, dom: str, roots, after, what: str, compute=frozenset(),
              reduce=()) -> list[str]:
        """A loop over the values of ``dom``: ``roots`` at each position ``j``, then the
        statements ``after``; ``reduce``: per-tensor reductions of the roots, accumulated
        in a partial per CHUNK positions, combined in order into their variables."""
        n, maps = f"n_{_TAG[dom]}", []

        def index(d: str) -> str:
            if d == dom:
                return "j"
            if d not in maps:
                maps.append(d)
            return f"b_{_TAG[d]} + (j - lo) * s_{_TAG[d]}"

        nr = len(reduce)

        def render(index) -> list[str]:
            return self._body(roots, dom, index, compute) + list(after) + [
                _combine(_HOW[node.op], f"acc{q}", self.r.operand(self.lin, node.src[0]))
                for q, node in enumerate(reduce)]
        body = render(index)
        idents = [_IDENT[_HOW[node.op]] for node in reduce]
        out = [f"{{  /* {what} */", f"    const int64_t nch = ({n} + CHUNK - 1) / CHUNK;"]
        if reduce:
            out.append(f"    double *part = (double *)malloc(sizeof(double) * {nr} * "
                       "(size_t)(nch ? nch : 1));")
        out += [f"    #pragma omp parallel for schedule(static) num_threads(nth) "
                f"if ({n} >= PAR_MIN)",
                "    for (int64_t ch = 0; ch < nch; ch++) {"]
        if reduce:
            out.append("        double " + ", ".join(f"acc{q} = {idents[q]}"
                                                     for q in range(nr)) + ";")
        out += [f"        const int64_t hi = {n} < (ch + 1) * CHUNK ? {n} : (ch + 1) * CHUNK;",
                "        for (int64_t lo = ch * CHUNK, e; lo < hi; lo = e) {"]
        if maps:
            L = f"L_{_TAG[dom]}"
            out.append(f"            e = (lo / {L} + 1) * {L} < hi ? (lo / {L} + 1) * {L} : hi;"
                       "  /* a line: the index maps are affine */")
            for d in maps:
                m, t = _MAPS[dom, d], _TAG[d]
                out += [f"            const int64_t b_{t} = {m.format(i='lo')};",
                        f"            const int64_t s_{t} = e - lo > 1 ? "
                        f"{m.format(i='lo + 1')} - b_{t} : 0;"]
        else:
            out.append("            e = hi;")
        sums = [f"acc{q}" for q, node in enumerate(reduce) if node.op is not Op.AMAX]
        # a NaN-propagating max is no OpenMP reduction: no simd
        pragma = ["#pragma omp simd" + (f" reduction(+:{', '.join(sums)})" if sums else "")
                  ] if len(sums) == nr else []

        def loop(lines: list[str], indent: str) -> list[str]:
            return [indent + line for line in (*pragma, "for (int64_t j = lo; j < e; j++) {",
                                               *("    " + line for line in lines), "}")]
        # a value of a smaller domain is read along a line with stride 0 (the line runs
        # along its axis) or 1 (across it): versions of the loop for those strides read
        # it as one value or contiguously, not gathered
        tags = [_TAG[d] for d in maps]
        strides = {1: [(0,), (1,)], 2: [(0, 1), (1, 0)]}.get(len(tags), [])
        for v, version in enumerate(strides):
            def fixed(d: str, version=version) -> str:
                if d == dom:
                    return "j"
                k = maps.index(d)
                return f"b_{tags[k]}" + (" + (j - lo)" if version[k] else "")
            test = " && ".join(f"s_{t} == {x}" for t, x in zip(tags, version))
            out.append(f"            {'} else if' if v else 'if'} ({test}) {{")
            out += loop(render(fixed), "                ")
        if strides:
            out += ["            } else {", *loop(body, "                "), "            }"]
        else:
            out += loop(body, "            ")
        out.append("        }")
        out += [f"        part[ch * {nr} + {q}] = acc{q};" for q in range(nr)]
        out.append("    }")
        for q, node in enumerate(reduce):
            out += [f"    double r{q} = {idents[q]};",
                    "    for (int64_t k = 0; k < nch; k++) {",
                    f"        double x = part[k * {nr} + {q}];",
                    f"        {_combine(_PARTIALS[node.op], f'r{q}', 'x')}",
                    "    }",
                    f"    {self._var(node)} = (CT)({_finish(node.op, f'r{q}', f'(double){n}')});"]
        if reduce:
            out.append("    free(part);")
        return out + ["}"]

    def _gather(self, node: Node) -> list[str]:
        """The loop materializing an axis reduction: output o combines its source at
        ``(o / inner * len + k) * inner + o % inner`` for k < len, in order (where
        ``inner > 1``: in up to 8 fixed parts of the k, combined in order)."""
        src = node.src[0]
        axis, how = AXIS_REDUCTIONS[node.op]
        inner, length = _AXIS[src.dom, axis]
        nout, buf, x = f"n_{_TAG[node.dom]}", self._buf(node), self.r.operand(self.lin, src)

        def at(acc: str, indent: str) -> list[str]:  # the source at x, into acc
            body = self._body([src], src.dom, lambda d: "x" if d == src.dom
                              else _MAPS[src.dom, d].format(i="x"))
            body.append(_combine("max" if how == "max" else "sum", acc, x))
            return [indent + line for line in body]
        value = "{} / (double)len" if how == "mean" else "{}"
        ident = _IDENT[how]
        par = (f"#pragma omp parallel for schedule(static) num_threads(nth) "
               f"if ({nout} * len >= PAR_MIN)")
        return [
            f"{{  /* {buf} = {node.op.value}({x}) */",
            f"    const int64_t inner = {inner}, len = {length};",
            "    if (inner == 1) {  /* the sources of an output: one run */",
            f"        {par}",
            f"        for (int64_t o = 0; o < {nout}; o++) {{",
            f"            double acc = {ident};",
            *([] if how == "max" else ["            #pragma omp simd reduction(+:acc)"]),
            "            for (int64_t x = o * len; x < (o + 1) * len; x++) {",
            *at("acc", " " * 16),
            "            }",
            f"            {buf}[o] = (CT)({value.format('acc')});",
            "        }",
            "    } else if (inner > 1) {  /* GB outputs side by side, their sources by rows,",
            "        read a row of a tile at a time; with few tiles, the rows in nk parts */",
            f"        const int64_t nb = (inner + GB - 1) / GB, na = {nout} / inner;",
            "        const int64_t nk = na * nb >= 8 || len < 2 ? 1 : (len < 8 ? len : 8);",
            "        const int64_t kc = (len + nk - 1) / nk;",
            "        const int64_t tw = inner < GB ? inner : GB;  /* a tile's width */",
            "        double *part = (double *)malloc(sizeof(double) * (size_t)(na * nb * nk) "
            "* (size_t)tw);",
            f"        {par}",
            "        for (int64_t task = 0; task < na * nb * nk; task++) {",
            "            const int64_t tile = task / nk, k0 = task % nk * kc;",
            "            const int64_t a = tile / nb, b0 = tile % nb * GB;",
            "            const int64_t bn = inner - b0 < GB ? inner - b0 : GB;",
            "            const int64_t k1 = k0 + kc < len ? k0 + kc : len;",
            "            double *acc = part + task * tw;",
            f"            for (int64_t b = 0; b < bn; b++) acc[b] = {ident};",
            "            for (int64_t k = k0; k < k1; k++) {",
            "                #pragma omp simd",
            "                for (int64_t b = 0; b < bn; b++) {",
            "                    const int64_t x = (a * len + k) * inner + b0 + b;",
            *at("acc[b]", " " * 20),
            "                }",
            "            }",
            "        }",
            "        for (int64_t tile = 0; tile < na * nb; tile++) {  /* the parts, in order */",
            "            const int64_t a = tile / nb, b0 = tile % nb * GB;",
            "            const int64_t bn = inner - b0 < GB ? inner - b0 : GB;",
            "            for (int64_t b = 0; b < bn; b++) {",
            "                double r = part[tile * nk * tw + b];",
            "                for (int64_t q = 1; q < nk; q++) {",
            "                    const double y = part[(tile * nk + q) * tw + b];",
            f"                    {_combine('max' if how == 'max' else 'sum', 'r', 'y')}",
            "                }",
            f"                {buf}[a * inner + b0 + b] = (CT)({value.format('r')});",
            "            }",
            "        }",
            "        free(part);",
            "    }",
            "}",
        ]

    def _count(self, dom: str) -> str:
        """The number of values of a state of domain ``dom`` (``geo``: axis_geometry)."""
        return f"geo[{DOMAINS.index(dom)}]"

    def _entries(self) -> list[str]:
        lin, r = self.lin, self.r
        body = [line[12:] for line in self._block_start([])]
        body += ["const int64_t *geo = row + COL_GEO;  /* axis_geometry, line_lengths */",
                 "const int64_t n_rc = geo[0], n_r = geo[1], n_c = geo[2], n_m = geo[3];",
                 "const int64_t Sr = geo[4], Sc = geo[5], fr = geo[6], fc = geo[7];",
                 "const int64_t rr = geo[8], cc = geo[9];",
                 "const int64_t L_rc = geo[10], L_r = geo[11], L_c = geo[12];"]
        mats = sorted(self.mat.values(), key=lambda n: self.order[id(n)])
        for m in mats:
            n = f"n_{_TAG[m.dom]}"
            body.append(f"CT *{self._buf(m)} = (CT *)malloc(sizeof(CT) * (size_t)({n} > 0 ? "
                        f"{n} : 1));  /* {DOMAIN_WORDS[m.dom]} */")
        for level in range(1, max(self.stage.values(), default=0) + 1):
            here = [n for n in self.nodes if self.stage.get(id(n)) == level]
            reds = [n for n in here if n.op in REDUCTIONS]
            body.append(f"/* stage {level} */")
            body += [f"CT {self._var(n)};" for n in reds]
            for n in here:
                if n.op in AXIS_REDUCTIONS:
                    body += self._gather(n)
            for dom in DOMAINS:
                ns = [n for n in here if n.dom == dom and n.op not in AXIS_REDUCTIONS
                      and n.op not in REDUCTIONS]
                if ns:
                    body += self._over(dom, ns, [f"{self._buf(n)}[j] = (CT){self._var(n)};"
                                                 for n in ns],
                                       f"{', '.join(map(self._buf, ns))}: "
                                       f"{DOMAIN_WORDS[dom]}, kept", compute={id(n) for n in ns})
                rs = [n for n in reds if n.src[0].dom == dom]
                if rs:
                    body += self._over(dom, [n.src[0] for n in rs], [], ", ".join(
                        f"{self._var(n)} = {n.op.value}({r.operand(lin, n.src[0])})"
                        for n in rs) + f": over {DOMAIN_WORDS[dom]}", reduce=rs)
            for n in self.nodes:  # per-tensor values, now known
                if n.kind == Kind.TENSOR and n.op not in REDUCTIONS \
                        and self.ready[id(n)] == level:
                    ctype = "int" if n.dtype == "bool" else "CT"
                    body.append(f"const {ctype} {self._var(n)} = {r.expr(lin, n, 'element')};")
        body.append("/* the writes, from the old values */")
        for dom in ("rc", "r", "c"):
            outs = [(t, n) for t, n in self.program.updates if self.doms[t] == dom]
            if outs:
                body += self._over(dom, [n for _, n in outs],
                                   [self._store(t, r.operand(lin, n), "j") for t, n in outs],
                                   f"write {', '.join(t for t, _ in outs)}: "
                                   f"{DOMAIN_WORDS[dom]}")
        body += [f"free({self._buf(m)});" for m in mats]
        return [AXES_HEADER,
                *self._pass_through(),
                "void vega_axes_step(int64_t nt, const int64_t *tab, const double *pre, "
                "int nth) {",
                *self._prologue("{ pass_through(nt, tab); return; }"),
                "    for (int64_t i = 0; i < nt; i++) {  /* one tensor at a time */",
                "        const int64_t *row = tab + i * ROW;",
                *("        " + line if line else "" for line in body),
                "    }",
                "}",
                ""]


# -- running ------------------------------------------------------------------

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}
_GROUP_KEYS: dict[tuple, tuple[str, str, str]] = {}  # validated (p, g, state) dtypes
_ENTRY = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int


def _ptr(x: torch.Tensor | None):
    return ctypes.c_void_p(x.data_ptr()) if x is not None else None


class Kernel:
    """The C kernels of one program: one library per dtype group, built on first use.

    The ctypes calls run inside two torch custom ops, ``vega::c_prelude`` and
    ``vega::c_step``, which update their tensor arguments in place: ``torch.compile``
    sees each as one opaque node (their fake implementations do nothing), so a
    compiled training step on this backend is one graph.
    """

    backend = "c"
    takes_rows = True  # values may come as a HyperRows table

    def __init__(self, program: Program):
        self.program = program
        self._reference = reference.Kernel(program)
        self._libs: dict[tuple[str, str, str], ctypes.CDLL] = {}
        self._nphases = len(reduction_phases(program))
        self._nred = sum(len(p) for p in reduction_phases(program))
        self._axes = program.uses_axes  # one vega_axes_step instead of phases and update
        self.columns = record.table_columns(len(program.states), NGEO if self._axes else 0)
        # how the custom ops find this kernel: a name never given to another (a counter,
        # not len(_KERNELS): two threads making kernels at once would take the same
        # number), held weakly (the kernel lives as long as its program, whose ``kernels``
        # holds it)
        self.id = next(_SERIAL)
        self.key = f"{program.name}/{self.id}"
        _KERNELS[self.key] = weakref.ref(self, lambda _, key=self.key: _KERNELS.pop(key, None))
        self._native = None  # the native operator's module this kernel is registered with
        self._native_libs: set[tuple[str, str, str]] = set()  # (and these libraries)
        self._native_lock = threading.Lock()
        self._hyp_cache: dict[tuple[float, ...], torch.Tensor] = {}
        # the tables of the last calls: the optimizers and param groups that share this
        # kernel alternate, and each should find its own. A step plan is keyed by the
        # addresses of the tensors it writes, so two threads stepping their own tensors
        # never share one; the prelude's tables are keyed by sizes alone, so each thread
        # keeps its own (a launch runs without the GIL: another thread rewriting the
        # gradient column of a shared table would make this one read its gradients)
        self._plans: list[_Plan] = []  # most recent first, at most 64
        self._local = threading.local()  # .pre_plans: (sizes, dtypes, devices) -> tables

    def source(self, dtypes=("float32", "float32", "float32")) -> str:
        return (AxesSource if self._axes else Source)(self.program, *dtypes).text()

    def init(self, p, values, state_dtype):
        return self._reference.init(p, values, state_dtype)

    def library(self, dtypes: tuple[str, str, str]) -> ctypes.CDLL:
        if dtypes not in self._libs:
            lib, _, _ = cbuild.build(self.source(dtypes))
            names = ["vega_prelude", "vega_axes_step"] if self._axes else \
                ["vega_prelude", "vega_update"] + [f"vega_phase{k}" for k in range(
                    self._nphases)] + (["vega_fused"] if self._nphases else [])
            for name in names:
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = _ENTRY if name not in ("vega_prelude", "vega_axes_step") else (
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            lib.vega_advance.restype = None
            lib.vega_advance.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
            self._libs[dtypes] = lib
        return self._libs[dtypes]

    def _registered(self, mod) -> None:
        """Register this kernel, and each of its libraries built so far, with the native
        operator's module ``mod`` (``vega.codegen.native``), which calls their entry points;
        dropped from it when this kernel is released."""
        with self._native_lock:
            if self._native is not mod:
                p = self.program
                c = self.columns
                mod.add_kernel(self.id, p.name, len(p.states), self._nphases, self._nred,
                               len(p.float_hypers), self._axes, [_DOMS[s.dom] for s in p.states],
                               [c.numel, c.p, c.g, c.state, c.step, c.hyper, c.geo, c.p_out,
                                c.state_out, c.width])
                self._native, self._native_libs = mod, set()
                weakref.finalize(self, mod.drop_kernel, self.id)
            for dtypes, lib in list(self._libs.items()):
                if dtypes in self._native_libs:
                    continue

                def at(name: str) -> int:
                    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                mod.add_library(
                    self.id, " ".join(dtypes), at("vega_prelude"), at("vega_advance"),
                    0 if self._axes else at("vega_update"),
                    at("vega_fused") if self._nphases and not self._axes else 0,
                    at("vega_axes_step") if self._axes else 0,
                    [] if self._axes else [at(f"vega_phase{k}") for k in range(self._nphases)])
                self._native_libs.add(dtypes)

    def _native_call(self, mod, call, *args) -> None:
        """``call(self.id, *args)``, a function of the native module, building the libraries
        it asks for (each call checks every tensor before it writes any)."""
        self._registered(mod)
        for _ in range(8):  # (a library for each dtype group it meets)
            try:
                return call(self.id, *args)
            except mod.MissingLibrary as e:
                self.library(tuple(str(e.args[0]).split()))
                self._registered(mod)
        return call(self.id, *args)

    def _group_key(self, p, g, s_dtype):
        key = (p.dtype, g.dtype, s_dtype)
        compiling = torch.compiler.is_compiling()
        # eagerly, the common case is checked once per dtype triple; not while tracing, where
        # reading the cache would guard on its contents (a first compiled step that filled
        # it would then recompile)
        if p.is_cpu and g.is_cpu and not compiling:
            found = _GROUP_KEYS.get(key)
            if found is not None:
                return found
        for x, what in ((p, "parameters"), (g, "gradients")):
            if x.dtype not in _DTYPES:
                raise ValueError(f"backend 'c' does not support {what} of dtype {x.dtype}")
            if x.device.type != "cpu":
                raise ValueError(f"backend 'c' runs on CPU tensors, got {what} on {x.device}; "
                                 "use backend='triton' or 'reference'")
        if s_dtype not in _DTYPES:
            raise ValueError(f"backend 'c' does not support state of dtype {s_dtype}")
        found = (_DTYPES[p.dtype], _DTYPES[g.dtype], _DTYPES[s_dtype])
        if not compiling:
            _GROUP_KEYS[key] = found
        return found

    def prelude(self, grads, pre: torch.Tensor) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``."""
        if torch.compiler.is_compiling():  # traced as one opaque node
            for g in grads:
                self._group_key(g, g, g.dtype)
            if not untraced(_native_ready, self, tuple({(g.dtype,) * 3 for g in grads})):
                c_prelude(self.key, list(grads), pre)
                return
            torch.ops.vega_c.prelude(self.id, list(grads), pre)
            return
        mod = native.module()
        if mod is not None:  # the native operator, called directly
            try:
                return self._native_call(mod, mod.prelude, list(grads), pre)
            except ValueError:
                pass  # (the Python path says which tensor is wrong, or reads a copy)
        self._prelude(grads, pre)

    def _prelude(self, grads, pre: torch.Tensor) -> None:
        """The body of ``vega::c_prelude``. The tables of gradients of the same sizes, dtypes
        and devices as a recent call's serve again, with their addresses rewritten."""
        grads = [g if g.is_contiguous() and not g.is_neg() else resolved(g).contiguous()
                 for g in grads]
        ptrs = list(map(torch.Tensor.data_ptr, grads))
        if 0 in ptrs:  # (an empty tensor may have no address; a wrapper subclass has none)
            self._check_readable([("gradient", grads)])
        self._run_prelude(self._prelude_plan(grads), ptrs, pre)

    def _prelude_plan(self, grads) -> tuple[list, list]:
        """The prelude's (tables, views) for contiguous gradients of these sizes, dtypes and
        devices, kept for this thread's next calls."""
        sig = (tuple(map(torch.Tensor.numel, grads)), tuple(map(_DTYPE_OF, grads)),
               tuple(map(_DEVICE_OF, grads)))
        plans = getattr(self._local, "pre_plans", None)
        if plans is None:
            plans = self._local.pre_plans = {}
        found = plans.get(sig)
        if found is None:
            found = _remember(plans, sig, self._new_prelude_plan(grads))
        return found

    def _new_prelude_plan(self, grads) -> tuple[list, list]:
        """New prelude (tables, views) for contiguous gradients like these: the tables of one
        caller (a thread), whose gradient column it rewrites."""
        groups: dict[tuple, list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault(self._group_key(g, g, g.dtype), []).append(i)
        tables = []
        for key, idx in groups.items():
            rows = [_prelude_row(self.columns, grads[i].numel()) for i in idx]
            tables.append((self.library(key), _table(rows), None, idx))
        return tables, _views(tables)

    @staticmethod
    def _run_prelude(plan, grad_ptrs, pre: torch.Tensor) -> None:
        tables, views = plan
        _write_column(views, _G, grad_ptrs)
        nth = torch.get_num_threads()
        for lib, table, _, idx in tables:
            lib.vega_prelude(len(idx), _ptr(table), _ptr(pre), nth)

    def __call__(self, params, grads, states, steps, values, donate, pre=None):
        """The same contract as ``vega.codegen.reference.Kernel.__call__``."""
        unique, step_index = distinct(steps)  # the distinct step counters, by identity
        if not donate:
            unique = [s.clone() for s in unique]
        hyp, hyp_index = self._hyper_tables(values)
        grads = list(grads)
        flat = [s for col in states for s in col]
        compiling = torch.compiler.is_compiling()
        if not donate and not compiling and _as_stored([*params, *grads, *flat]) \
                and all(map(torch.Tensor.is_contiguous, hyp)):
            # pure, out of place: the kernel reads the old tensors and writes new ones
            new_p, new_flat = list(map(torch.empty_like, params)), list(map(torch.empty_like, flat))
            mod = native.module()
            done = False
            if mod is not None:
                try:
                    self._native_call(mod, mod.step, params, grads, flat, unique, step_index,
                                      hyp, hyp_index, pre, self._geometries(params),
                                      [*new_p, *new_flat])
                    done = True
                except ValueError:
                    pass  # (the Python path says which tensor is wrong)
            if not done:
                tables = self._tables(params, grads, flat, unique, step_index, hyp, hyp_index,
                                      [*new_p, *new_flat])
                self._launch(tables, _int64s(list(map(torch.Tensor.data_ptr, unique))), pre,
                             torch.get_num_threads())
            params, flat = new_p, new_flat
        else:
            if not donate:  # pure: in place on copies
                params = [p.clone() for p in params]
                flat = [s.clone() for s in flat]
            args = (params, grads, flat, unique, step_index, hyp, hyp_index, pre)
            if compiling:  # traced as one opaque node
                self._traced_step(*args)
            else:  # eagerly, directly (the operator's dispatch costs more a tensor)
                self._step(*args)
        n = len(params)
        states = [flat[k * n:(k + 1) * n] for k in range(len(states))]
        finite = record.finite_of(pre)
        return params, states, [unique[k] for k in step_index], finite

    def _traced_step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                     pre) -> None:
        """The step as torch.compile traces it: one call of the native operator
        ``vega_c::step`` (or, where it cannot be built, of the Python custom op
        ``vega::c_step``), after the libraries it needs are built."""
        sd = [s.dtype for s in flat_states[:len(params)]] if self.program.states else \
            [p.dtype for p in params]
        if not untraced(_native_ready, self, tuple({(p.dtype, g.dtype, d) for p, g, d in
                                                    zip(params, grads, sd)})):
            c_step(self.key, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre)
            return
        torch.ops.vega_c.step(self.id, params, grads, flat_states, steps, step_index, hyp,
                              hyp_index, pre, self._geometries(params), [])

    def _geometries(self, params) -> list[int]:
        """Each parameter's ``_geometry``, one after another (none for an element-wise
        program)."""
        return [x for p in params for x in self._geometry(p.shape)] if self._axes else []

    def _step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre):
        """The body of ``vega::c_step``: every tensor updated in place, by the native operator
        where it is built (it checks every tensor and builds the address tables), else here.
        What the operator refuses comes here too, which says which tensor is wrong, or steps
        contiguous copies of those not stored as the kernels read them."""
        mod = native.module()
        if mod is not None:
            try:
                self._native_call(mod, mod.step, params, grads, flat_states, steps, step_index,
                                  hyp, hyp_index, pre, self._geometries(params), [])
                _written(params)
                return
            except ValueError:
                pass
        self._python_step(mod, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                          pre)

    def _python_step(self, mod, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                     pre):
        """``_step`` in Python: the address tables of a recent call serve again when the
        parameters, states and step counters are at the same addresses with the same sizes
        and dtypes (checked: a tensor freed and another made may take its address), and the
        gradients have the same sizes and dtypes: a backward pass makes new gradients, whose
        column is rewritten (as is the hyperparameters', when a schedule gave a new table).
        Where the native operator ``mod`` is built (and refused these tensors), only the
        checks and the copies."""
        nth = torch.get_num_threads()
        found = None
        if mod is None and _as_stored([*params, *grads, *flat_states]) \
                and all(map(torch.Tensor.is_contiguous, hyp)):
            if not torch.is_inference_mode_enabled() and any(map(
                    torch.Tensor.is_inference, [*params, *flat_states, *steps])):
                self._refuse_writes(params, flat_states, steps)
            ptr, numel = torch.Tensor.data_ptr, torch.Tensor.numel
            fixed = list(map(ptr, params)) + list(map(ptr, flat_states)) + list(map(ptr, steps))
            meta = ([p.shape for p in params] if self._axes else list(map(numel, params)),
                    [g.shape for g in grads] if self._axes else list(map(numel, grads)),
                    list(map(numel, flat_states)),
                    list(map(_DTYPE_OF, [*params, *grads, *flat_states, *steps])),
                    list(step_index), list(hyp_index), [h.shape for h in hyp])
            grad_ptrs = list(map(ptr, grads))
            if 0 in grad_ptrs:  # (an empty tensor may have no address; a wrapper, none)
                self._check_readable([("gradient", grads)])
            found = (self._plan_for(fixed, meta, params, grads, flat_states, steps, step_index,
                                    hyp, hyp_index), grad_ptrs)
        if found is not None:
            plan, grad_ptrs = found
            plan.point(grad_ptrs, hyp, hyp_index, self.columns.hyper)
            self._launch(plan.tables, plan.step_ptrs, pre, nth)
            _written(params)
            return
        # some tensor is not contiguous, or holds its values negated (a negative bit): work
        # on contiguous copies of the values, copied back at the end (every copy held until
        # the kernel has run: the table keeps only addresses). What is to be written is
        # checked first: a copy back that failed would leave a step half made.
        self._refuse_writes(params, flat_states, steps)
        self._check_readable([("parameter", params), ("gradient", grads),
                              *((f"state '{s.name}'", flat_states[k * len(params):
                                                                  (k + 1) * len(params)])
                                for k, s in enumerate(self.program.states))])
        work_p = [resolved(p).contiguous() for p in params]
        work_g = [resolved(g).contiguous() for g in grads]
        work_s = [resolved(s).contiguous() for s in flat_states]
        work_h = [h.contiguous() for h in hyp]
        tables = self._tables(work_p, work_g, work_s, steps, step_index, work_h, hyp_index)
        self._launch(tables, _int64s([s.data_ptr() for s in steps]), pre, nth)
        for orig, work in zip([*params, *flat_states], [*work_p, *work_s]):
            if work is not orig:
                orig.copy_(work)
        _written(params)

    def _refuse_writes(self, params, flat_states, steps) -> None:
        """Raise ValueError where a step in place cannot write these parameters, states (flat,
        state by state) and step counters (``vega.codegen.tensors.inplace_problem``): an
        inference tensor outside inference mode, elements at one memory location, two that
        share memory."""
        refuse_inplace("c", self.program.state_names, params, flat_states, steps)

    @staticmethod
    def _check_readable(named) -> None:
        """Raise ValueError for a tensor with elements but no address: a tensor subclass
        with operations of its own (a wrapper: DTensor), whose storage the kernels cannot
        read. ``named``: (what, tensors) pairs."""
        for what, tensors in named:
            for i, t in enumerate(tensors):
                if t.numel() and t.data_ptr() == 0:
                    words = own_ops_words(t) if has_own_ops(t) else \
                        "has no storage the kernels can read (its data_ptr() is 0)"
                    raise ValueError(f"backend 'c': {what} {i} {words}; use "
                                     f"backend='reference'")

    def _plan_for(self, fixed, meta, params, grads, flat_states, steps, step_index, hyp,
                  hyp_index) -> _Plan:
        """The recent plan made for ``fixed`` and ``meta``, or a new one (its tables check
        every tensor)."""
        plan = next((p for p in self._plans if p.fixed == fixed and p.meta == meta), None)
        if plan is None:
            plan = _Plan(fixed, meta, self._tables(params, grads, flat_states, steps,
                                                   step_index, hyp, hyp_index),
                         _int64s(list(map(torch.Tensor.data_ptr, steps))))
            self._plans.insert(0, plan)  # (each group of each optimizer has one)
            del self._plans[64:]
        return plan

    def _tables(self, params, grads, flat_states, steps, step_index, hyp, hyp_index,
                outs=None):
        """(library, address table, reduction buffer, positions) per dtype group; checks
        every tensor. ``outs``: the tensors an out-of-place step writes (the parameters',
        then the states' as in ``flat_states``), new contiguous tensors like the inputs; by
        default the step writes in place."""
        n = len(params)
        states = [flat_states[k * n:(k + 1) * n] for k in range(len(self.program.states))]
        check_states("c", self.program, params, states)
        if list(map(_SHAPE_OF, params)) != list(map(_SHAPE_OF, grads)):
            raise ValueError("backend 'c': a gradient's shape differs from its parameter's")
        for t in steps:
            if t.dtype != torch.int32 or t.dim() != 0 or not t.is_cpu:
                raise ValueError(f"backend 'c': a step counter must be a 0-d int32 tensor on "
                                 f"the CPU, got shape {tuple(t.shape)} and dtype {t.dtype} on "
                                 f"{t.device}")
        for col in states:
            bad = next((x for x in col if not x.is_cpu), None)
            if bad is not None:
                raise ValueError(f"backend 'c' runs on CPU tensors, got a state on {bad.device}")
        groups = self._dtype_groups(params, grads, states)
        ptr = torch.Tensor.data_ptr
        steps_at, hyp_at = list(map(ptr, steps)), _row_addresses(hyp)
        in_place = outs is None
        outs = [*params, *flat_states] if outs is None else outs
        cols = self.columns
        columns = cols.arrange(  # (each a list of columns, one value per tensor)
            numel=[list(map(torch.Tensor.numel, params))], p=[list(map(ptr, params))],
            g=[list(map(ptr, grads))], state=[list(map(ptr, col)) for col in states],
            step=[[steps_at[k] for k in step_index]], hyper=[[hyp_at[r] for r in hyp_index]],
            geo=np.array([self._geometry(p.shape) for p in params],
                         dtype=np.int64).reshape(n, cols.ngeo).T,
            p_out=[list(map(ptr, outs[:n]))],
            state_out=[list(map(ptr, outs[k * n:(k + 1) * n]))
                       for k in range(1, cols.nstate + 1)])
        every = np.array(columns, dtype=np.int64).reshape(len(columns), n).T
        # every tensor read has an address (a wrapper subclass has none); those written in
        # place share no memory (each is contiguous here: its span is its memory)
        read = every[:, cols.p:cols.step]  # p, g, states
        if n and not read.all():
            self._check_readable([("parameter", params), ("gradient", grads),
                                  *((f"state '{s.name}'", col)
                                    for s, col in zip(self.program.states, states))])
        if in_place:
            written = [*params, *flat_states, *steps]
            lo = np.array([*columns[cols.p], *(a for col in columns[cols.state:cols.step]
                                               for a in col),
                           *steps_at], dtype=np.int64)
            hi = lo + np.array([t.numel() * t.element_size() for t in written], dtype=np.int64)
            pair = shared_pair(written, lo, hi)
            if pair is not None:
                named = roles(self.program.state_names, n, len(steps))
                raise ValueError(f"backend 'c': {named[pair[0]]} "
                                 f"{pair[2].format(other=named[pair[1]])}")
        out = []
        for key, idx in groups:
            table = _from_numpy(every if len(idx) == n else every[idx])
            red = torch.empty(max(1, len(idx) * self._nred), dtype=torch.float64)
            out.append((self.library(key), table, red, idx))
        return out

    def _dtype_groups(self, params, grads, states) -> list[tuple[tuple[str, str, str], list]]:
        """The (parameter, gradient, state) dtypes and the positions of the tensors of
        each, checked."""
        n = len(params)
        pd, gd = list(map(_DTYPE_OF, params)), list(map(_DTYPE_OF, grads))
        sd = [list(map(_DTYPE_OF, col)) for col in states]
        if any(a != sd[0] for a in sd[1:]):
            raise ValueError("backend 'c' needs every state tensor of a parameter in one "
                             "dtype")
        sd = sd[0] if sd else pd
        if n and pd.count(pd[0]) == n and gd.count(gd[0]) == n and sd.count(sd[0]) == n:
            # one dtype group (the common case): the devices checked in one pass
            if all(map(_IS_CPU, params)) and all(map(_IS_CPU, grads)):
                return [(self._group_key(params[0], grads[0], sd[0]), list(range(n)))]
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            groups.setdefault(self._group_key(p, g, sd[i]), []).append(i)
        return list(groups.items())

    def _geometry(self, shape) -> tuple[int, ...]:
        """The integers a table row of a program over a matrix view ends with."""
        if not self._axes:
            return ()
        found = _GEOMETRY.get(shape)
        if found is None:
            if len(_GEOMETRY) > 4096:
                _GEOMETRY.clear()
            found = _GEOMETRY[shape] = (*axis_geometry(shape), *line_lengths(shape))
        return found

    def _launch(self, tables, step_ptrs, pre, nth):
        """Every phase and the update of each dtype group, then the step counters (at the
        addresses ``step_ptrs``)."""
        for lib, table, red, _ in tables:
            n = table.shape[0]
            if self._axes:
                lib.vega_axes_step(n, _ptr(table), _ptr(pre), nth)
                continue
            if self._nphases and _fused_fits(table, nth):  # (each tensor's phases, update)
                lib.vega_fused(n, _ptr(table), _ptr(pre), _ptr(red), nth)
                continue
            for k in range(self._nphases):
                getattr(lib, f"vega_phase{k}")(n, _ptr(table), _ptr(pre), _ptr(red), nth)
            lib.vega_update(n, _ptr(table), _ptr(pre), _ptr(red), nth)
        if tables:
            tables[-1][0].vega_advance(len(step_ptrs), _ptr(step_ptrs), _ptr(pre))

    def _hyper_tables(self, values):
        """float64 arrays of hyperparameter values (a row each, or a table of rows), and the
        row of each tensor, counting rows through the arrays in order: one array per
        distinct values dict, or the table of ``HyperRows``."""
        if isinstance(values, HyperRows):  # (on the counters' device: the CPU, as checked)
            return [values.table.cpu()], values.index
        uniq, index = distinct(values)
        return [self._hyper_array(vals) for vals in uniq], index

    def _hyper_array(self, vals) -> torch.Tensor:
        parts = [vals[n] for n in self.program.float_hypers]
        if any(isinstance(v, torch.Tensor) for v in parts):  # (a float as it is, not float32)
            return torch.stack([v.detach().to(device="cpu", dtype=torch.float64).reshape(())
                                if isinstance(v, torch.Tensor) else
                                torch.tensor(float(v), dtype=torch.float64) for v in parts])
        numbers = tuple(float(v) for v in parts) or (0.0,)
        if torch.compiler.is_compiling():  # a graph constant: a cache filled while tracing
            return torch.tensor(numbers, dtype=torch.float64)  # would fail the next guards
        # plain numbers: one array per distinct setting, kept across steps; keyed by their
        # spelling, as -0.0 == 0.0 (and x / -0.0 is not x / 0.0)
        key = tuple(map(float.hex, numbers))
        arr = self._hyp_cache.get(key)
        if arr is None:
            if len(self._hyp_cache) > 64:
                self._hyp_cache.clear()
            arr = self._hyp_cache[key] = torch.tensor(numbers, dtype=torch.float64)
        return arr


class _Plan:
    """The address tables of one call of a kernel, for the next calls with the same
    tensors (``Kernel._step``): ``fixed``, the addresses of the parameters, states and
    step counters; ``meta``, their sizes and dtypes (and the gradients'), and the step
    counter and hyperparameter row of each tensor."""

    def __init__(self, fixed, meta, tables, step_ptrs):
        self.fixed, self.meta, self.tables, self.step_ptrs = fixed, meta, tables, step_ptrs
        self.hyp_ptrs: list[int] = []
        self.hyp_index: list[int] = []
        self.views = _views(tables)

    def point(self, grad_ptrs: list[int], hyp, hyp_index, hyp_col: int) -> None:
        """Write the gradients' addresses, and the hyperparameter rows' where they moved or
        the tensors read other rows (a direct step's schedule table after a plain one)."""
        _write_column(self.views, _G, grad_ptrs)
        hyp_ptrs = [h.data_ptr() for h in hyp]
        if hyp_ptrs != self.hyp_ptrs or (hyp_index is not self.hyp_index
                                         and hyp_index != self.hyp_index):
            at = _row_addresses(hyp)
            _write_column(self.views, hyp_col, [at[r] for r in hyp_index])
            self.hyp_ptrs, self.hyp_index = hyp_ptrs, hyp_index


FUSED_MAX = 65536  # vega_fused steps tables of tensors no longer than this


def _fused_fits(table: torch.Tensor, nth: int) -> bool:
    """Whether vega_fused suits an address table: every tensor has at most FUSED_MAX
    elements, and there are enough of them that ``nth`` threads taking whole tensors each
    get about as much work (at least four of the largest's worth each)."""
    sizes = table.numpy()[:, 0]
    largest = int(sizes.max(initial=0))
    return largest <= FUSED_MAX and int(sizes.sum()) >= 4 * max(nth, 1) * largest


def _views(tables) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each dtype group's address table as a numpy array (a view), and its positions."""
    return [(table.numpy(), np.asarray(idx, dtype=np.int64)) for _, table, _, idx in tables]


_G = record.table_columns(0).g  # the gradient's column (before any column per state)


def _prelude_row(columns: record.Columns, numel: int) -> list[int]:
    """A table row for the prelude: the gradient's size, its address written at each call."""
    row = [0] * columns.width
    row[columns.numel] = numel
    return row


def _write_column(views, col: int, values: list[int]) -> None:
    """Column ``col`` of every table: ``values`` (one per tensor) at each row's position."""
    values = np.asarray(values, dtype=np.int64)
    for view, idx in views:
        view[:, col] = values[idx]


def _row_addresses(hyp: list[torch.Tensor]) -> list[int]:
    """The address of each row of these contiguous float64 arrays (a 1-d array is a row)."""
    out = []
    for h in hyp:
        if h.dim() == 1:
            out.append(h.data_ptr())
        else:
            out += range(h.data_ptr(), h.data_ptr() + h.numel() * 8, h.shape[1] * 8)
    return out


def _stores_of(plan) -> dict[int, str]:
    """The values a plan of early stores writes (``Source._early_stores``): id -> state."""
    return {id(n): t for here in plan for t, n in here}


def _remember(cache: dict, key, value, size: int = 8):
    """``cache[key] = value``, dropping the oldest entry beyond ``size``; the value."""
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def _int64s(values: list) -> torch.Tensor:
    """Addresses, kept across calls and rewritten in place (a table's gradient column): a
    normal tensor even when made under torch.inference_mode (an inference tensor could
    not be written outside it)."""
    with torch.inference_mode(False):
        return torch.tensor(values, dtype=torch.int64)


def _table(rows: list[list[int]]) -> torch.Tensor:
    return _int64s(rows).reshape(len(rows), -1)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """An int64 table as a contiguous tensor (a normal one, as ``_int64s``)."""
    with torch.inference_mode(False):
        return torch.from_numpy(np.ascontiguousarray(a))


def _as_stored(tensors) -> bool:
    """Whether a kernel may read (and write) each of these tensors at its address: each is
    contiguous and holds its values as they are (no negative bit: a real view of a complex
    tensor's conjugate, ``x.conj().imag``, stores them negated)."""
    return all(map(torch.Tensor.is_contiguous, tensors)) \
        and not any(map(torch.Tensor.is_neg, tensors))


def _written(params) -> None:
    """Tell autograd that a step in place wrote these parameters (their version counters
    advance, as an in-place torch operation's would): a graph that saved one of them (``loss
    = (w * w).sum()``) then refuses to run backward through its old value, as after
    torch.optim's step. The parameters only: they are what graphs save, and advancing the
    states' and step counters' versions too costs about a tenth of a step over a thousand
    small tensors (the counters of tensors the kernel has just evicted from the cache)."""
    if not torch.compiler.is_compiling():
        increment_version(params)


# key -> a weak reference to the Kernel, for the custom ops: a kernel is released with its
# program (a kernel a torch.compile'd step uses is held by ``vega.tracing``)
_KERNELS: dict[str, weakref.ref] = {}
_SERIAL = itertools.count()
_DTYPE_OF = operator.attrgetter("dtype")
_DEVICE_OF = operator.attrgetter("device")
_SHAPE_OF = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")
_GEOMETRY: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> Kernel._geometry


_DOMS = {"rc": 0, "r": 1, "c": 2, "": 3}  # a state's domain -> its length in a geometry row


def _native_ready(kernel: Kernel, triples) -> bool:
    """Whether the native operator is built (waiting for it), with ``kernel`` and its
    libraries for these (parameter, gradient, state) dtype triples registered: what a traced
    call of the operator needs, since it cannot build them."""
    mod = native.module(wait=True)
    if mod is None:
        return False
    for triple in triples:
        if any(d not in _DTYPES for d in triple):
            raise ValueError(f"backend 'c' does not support tensors of dtypes {triple}")
        kernel.library(tuple(_DTYPES[d] for d in triple))
    kernel._registered(mod)
    return True


def kernel_of(key: str) -> Kernel:
    """The live kernel named ``key``."""
    ref = _KERNELS.get(key)
    found = ref() if ref is not None else None
    if found is None:
        raise RuntimeError(f"vega: the C kernel {key!r} was released with its optimizer")
    return found


@torch.library.custom_op("vega::c_prelude", mutates_args=("pre",), device_types="cpu")
def c_prelude(key: str, grads: list[torch.Tensor], pre: torch.Tensor) -> None:
    """Add the sum of squares and the non-finite count of ``grads`` into ``pre``."""
    kernel_of(key)._prelude(grads, pre)


@c_prelude.register_fake
def _(key, grads, pre):
    return None


@torch.library.custom_op("vega::c_step", mutates_args=("params", "states", "steps"),
                         device_types="cpu")
def c_step(key: str, params: list[torch.Tensor], grads: list[torch.Tensor],
           states: list[torch.Tensor], steps: list[torch.Tensor], step_index: list[int],
           hypers: list[torch.Tensor], hyper_index: list[int],
           pre: torch.Tensor | None) -> None:
    """One step of the kernel named ``key``, in place. ``states`` is flat, state by state;
    parameter ``i`` counts on ``steps[step_index[i]]`` with ``hypers[hyper_index[i]]``."""
    kernel_of(key)._step(params, grads, states, steps, step_index, hypers, hyper_index, pre)


@c_step.register_fake
def _(key, params, grads, states, steps, step_index, hypers, hyper_index, pre):
    return None


def available() -> bool:
    return cbuild.available()
