"""The C source of a program that steps every tensor alike (``Source``): the header every
library shares (the prelude, the counters' advance, the record's slots and the table's
columns), the renderer of values (``CRenderer``), and the entries over a dtype group's
address table: ``vega_phase<k>``, ``vega_update`` and ``vega_fused``."""
from __future__ import annotations

import functools
import math
import os
import struct

from vega.codegen import precision, quant, record
from vega.codegen.c import build as cbuild
from vega.codegen.base import (Linear, Renderer, codes_without_scales, linearize,
                               reduction_phases, state_dtype_names, state_var)
from vega.codegen.plan import element_plan
from vega.dsl.ir import QBLOCK, REDUCTIONS, SCALAR_STATE, Kind, Node, Op, Program

_MAP = {True: "signed", False: "unsigned"}  # an 8-bit state's map (vega.codegen.quant)

# dtype name -> (C storage type, load to compute type, store from compute type)
STORAGE = {
    "float32": ("float", "(CT)({x})", "(float)({x})"),
    "float64": ("double", "(CT)({x})", "(double)({x})"),
    "bfloat16": ("uint16_t", "(CT)bf16_to_f32({x})", "f32_to_bf16((float)({x}))"),
    # (a double through float, as torch casts float64 to float16: rounded twice)
    "float16": ("_Float16", "(CT)({x})", "(_Float16)(float)({x})"),
    # an 8-bit state's codes: read and written with their block's scale (vega.codegen.quant)
    "uint8": ("uint8_t", "(CT)({x})", "(uint8_t)({x})"),
}

INCLUDES = """#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <fenv.h>
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
static inline double sq_d(CT x) { return (double)x * (double)x; }
static inline CT vmin(CT a, CT b) { return (a < b || a != a) ? a : b; }  /* NaN wins */
static inline CT vmax(CT a, CT b) { return (a > b || a != a) ? a : b; }
static inline CT vsign(CT a) { return a > 0 ? (CT)1 : (a < 0 ? (CT)-1 : a); }
static inline double dmin(double a, double b) { return (a < b || a != a) ? a : b; }
static inline double dmax(double a, double b) { return (a > b || a != a) ? a : b; }
static inline double dsign(double a) { return a > 0 ? 1.0 : (a < 0 ? -1.0 : a); }
static inline CT vsigmoid(CT a) { return (CT)1 / ((CT)1 + EXP(-a)); }
static inline double dsigmoid(double a) { return 1.0 / (1.0 + exp(-a)); }
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
static int64_t first_from(const int64_t *start, int64_t nt, int64_t x) {
    int64_t lo = 0, hi = nt;  /* first i with start[i] >= x (nt if none) */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (start[mid] < x) lo = mid + 1; else hi = mid;
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
#define SPLIT_MIN @SPLIT_MIN@  /* a thread's share of a tensor at least this long is read as
                            four quarters at once, where one run of loads alone does not keep
                            enough of them in flight to use the memory bandwidth (split_min) */
#define PRE_PIECE 65536  /* the prelude's and the phases' sums: a tensor's pieces, each
                                 one thread's, added in order */
static int64_t *piece_slots(int64_t nt, const int64_t *tab) {
    /* tensor i's pieces of PRE_PIECE values take slots [slot[i], slot[i + 1]) */
    int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(nt + 1));
    slot[0] = 0;
    for (int64_t i = 0; i < nt; i++)
        slot[i + 1] = slot[i] + (tab[i * ROW + COL_NUMEL] + PRE_PIECE - 1) / PRE_PIECE;
    return slot;
}

void vega_prelude(int64_t nt, const int64_t *tab, double *pre, int nth) {
    /* pre[PRE_SUM_SQ] += sum of squares of g * pre[PRE_INV_SCALE];
       pre[PRE_NONFINITE] += count of blocks holding a non-finite element.
       Each tensor is taken in pieces of PRE_PIECE elements from its start, each piece summed
       by one thread into a slot of its own, and the slots added in order after the threads:
       the same bits on any number of threads */
    int64_t *start = starts(nt, tab);
    int64_t total = start[nt];
    const CT gs = (CT)pre[PRE_INV_SCALE];
    int64_t *slot = piece_slots(nt, tab);
    double *sums = (double *)calloc(2 * (size_t)(slot[nt] > 0 ? slot[nt] : 1),
                                   sizeof(double));
    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN)
    {
        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;
        int64_t i = lo < hi ? locate(start, nt, lo) : nt;
        for (; i < nt && start[i] < hi; i++) {  /* the pieces that start in [lo, hi) */
            const int64_t *row = tab + i * ROW;
            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[COL_G];
            int64_t numel = row[COL_NUMEL];
            int64_t k = lo > start[i] ? (lo - start[i] + PRE_PIECE - 1) / PRE_PIECE : 0;
            for (; k * PRE_PIECE < numel && start[i] + k * PRE_PIECE < hi; k++) {
                int64_t b = k * PRE_PIECE, e = numel < b + PRE_PIECE ? numel : b + PRE_PIECE;
                double sq = 0, bad = 0;
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
                    if (!nonfinite && !(part < (CT)INFINITY)) {  /* finite values whose squares
                        overflow the compute type: summed again in double, as the reference */
                        double d = 0;
                        for (int64_t j = 0; j < n; j++)
                            d += sq_d(LOAD_G(A[j]) * gs) + sq_d(LOAD_G(B[j]) * gs)
                                 + sq_d(LOAD_G(C[j]) * gs) + sq_d(LOAD_G(D[j]) * gs);
                        sq += d;
                    } else
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
                    if (!nonfinite && !(part < (CT)INFINITY)) {  /* (as above) */
                        double d = 0;
                        for (int64_t j = j0; j < j1; j++) d += sq_d(LOAD_G(G_[j]) * gs);
                        sq += d;
                    } else
                        sq += (double)part;
                    bad += nonfinite;
                }
                sums[2 * (slot[i] + k)] = sq; sums[2 * (slot[i] + k) + 1] = bad;
            }
        }
    }
    for (int64_t t = 0; t < slot[nt]; t++) {
        pre[PRE_SUM_SQ] += sums[2 * t];
        pre[PRE_NONFINITE] += sums[2 * t + 1];
    }
    free(sums); free(slot); free(start);
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


def split_min() -> str:
    """``SPLIT_MIN``, chosen per CPU (the source, and so the cache key, differs with it):
    16384 where reading four quarters of a long tensor side by side keeps more loads in
    flight (Intel Xeon), no split on AMD Zen, whose prefetchers keep up with one run and lose
    pace with 28 streams a core (plain AdamW 0.98-1.00x torch's fused step against 1.04-1.11x
    with quarters, on an EPYC). ``VEGA_C_QUARTERS=1`` (or ``0``) decides instead."""
    forced = os.environ.get("VEGA_C_QUARTERS")
    if forced not in ("0", "1"):
        forced = "0" if _zen() else "1"
    return "16384" if forced == "1" else "INT64_MAX"


def q8_codes() -> str:
    """How the 8-bit kernels form their codes, chosen per CPU (the source, and so the cache
    key, differs with it): ``"table"``, a gather from a table of the boundaries between
    codes (``quant.C_TABLE``), on an Intel Xeon faster than the roots (the two maps' loops
    0.70-0.95 ns a value against 0.97-1.18); ``"code"``, the maps' square roots, on AMD Zen,
    whose gathers are slow (one Zen 4 thread, the two maps' loops in L1: 0.60 ns a value
    against 0.88 from the table). The codes are the same. ``VEGA_C_Q8_TABLE=1`` (or ``0``)
    decides instead."""
    forced = os.environ.get("VEGA_C_Q8_TABLE")
    if forced not in ("0", "1"):
        forced = "0" if _zen() else "1"
    return "table" if forced == "1" else "code"


@functools.cache
def _zen() -> bool:
    """Whether the kernels are built for an AMD Zen CPU: ``-march=native`` means znver*, or
    (where the compiler does not say) /proc/cpuinfo names AMD (``build.target_cpu``)."""
    target = cbuild.target_cpu()
    return "znver" in target or "AuthenticAMD" in target


def _fn(element, scalar):
    """A call: the compute-type function in the element loop, the double one in the scalar phase."""
    return lambda self, node, phase, *a: \
        f"{scalar if phase == 'scalar' else element}({', '.join(a)})"


def _float32_holds(x: float) -> bool:
    """Whether float32 holds the number ``x`` exactly."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0] == x
    except OverflowError:  # (past float32's range)
        return False


def _pow(self, node, phase, a, b):
    """``a ^ b``; a written exponent that the compute type would round to another number
    (float32: 16777217 to the even 16777216, 1e-320 to 0) is a power of the exponent as
    written, computed in double as torch computes a power by a number (``x ** 16777217.0``
    of -1 is -1), and rounded."""
    expo = node.src[1]
    if phase != "scalar" and expo.op is Op.CONST and math.isfinite(expo.arg) \
            and not _float32_holds(expo.arg):
        return f"((CT)pow((double){a}, {float(expo.arg)!r}))"
    return f"{'pow' if phase == 'scalar' else 'POW'}({a}, {b})"


def _div(self, node, phase, a, b):
    """``a / b``, or ``a`` times the reciprocal of a ``b`` of the scalar phase (of the
    hyperparameters and the step alone) computed once before the loop (a division costs
    several multiplications: adamw's bias corrections)."""
    recip = self.recip.get(id(node.src[1])) if phase == "element" else None
    return f"{a} * {recip}" if recip else f"{a} / {b}"


class CRenderer(Renderer):
    recip: dict[int, str] = {}  # id of a scalar phase's divisor -> its reciprocal's variable

    code_for_op = {
        Op.DIV: _div,
        Op.NEG: lambda self, node, phase, a: f"-{a}",
        Op.POW: _pow,
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
        Op.ATAN2: _fn("ATAN2", "atan2"),
        Op.TANH: _fn("TANH", "tanh"),
        Op.SIN: _fn("SIN", "sin"),
        Op.COS: _fn("COS", "cos"),
        Op.ERF: _fn("ERF", "erf"),
        Op.LOG1P: _fn("LOG1P", "log1p"),
        Op.EXPM1: _fn("EXPM1", "expm1"),
        Op.SIGMOID: _fn("vsigmoid", "dsigmoid"),
        Op.FLOOR: _fn("FLOOR", "floor"),
        Op.ROUND: _fn("RINT", "rint"),  # half to even in the default rounding mode, as torch
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
        self.split = split_min()  # (read once: the header's SPLIT_MIN and the loops agree)
        self.sdts = state_dtype_names(sdt, len(program.states))  # each state's
        for k, dt in enumerate(self.sdts):  # (codes without scales: no kernel for them)
            if dt == "uint8" and program.state_names[k] not in program.quant:
                raise codes_without_scales("c", program.state_names[k])
        for name, (scale, _) in program.quant.items():  # 8 bits: codes, float32 scales
            # (whatever the key says: the prelude's library is built for the gradients'
            # dtype; Kernel._call checks a step's states first)
            self.sdts[program.state_names.index(name)] = "uint8"
            self.sdts[program.state_names.index(scale)] = "float32"

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
        for tag, dt in (("P", pdt), ("G", gdt),
                        *((f"S{k}", dt) for k, dt in enumerate(self.sdts))):
            store, load, save = STORAGE[dt]
            out.append(f"typedef {store} {tag}STORE;")
            out.append(f"#define LOAD_{tag}(x) {load.format(x='x')}")
            out.append(f"#define SAVE_{tag}(x) {save.format(x='x')}")
        for name in ("SQRT", "EXP", "LOG", "POW", "ATAN2", "TANH", "SIN", "COS", "ERF", "LOG1P",
                     "EXPM1", "FLOOR", "RINT"):
            out.append(f"#define {name} {name.lower()}{suffix}")
        out.append(f"#define FABS fabs{suffix}")
        out.append(f"#define NRED {len(self.slots)}")
        out += record.c_defines()  # the prelude's record
        out += self.columns.c_defines()  # the address table's row
        out.append(HEADER.replace("@SPLIT_MIN@", self.split))
        if self.program.rounding is not None:
            out.append(precision.C_HELPERS)
        if self.program.quant:
            out.append(quant.C_HELPERS)
            if q8_codes() == "table":
                out.append(quant.C_TABLE)
        out += self._entries()
        return cbuild.share_fenv("\n".join(out))

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
        pdt = self.dtypes[0]
        if not self.phases or not all(dt == "float64" or (dt == "float32" and pdt != "float64")
                                      for dt in self.sdts):
            return [[] for _ in self.phases]
        banned: set[str] = set()
        while True:
            plan, stored, ok = [], {}, True
            for phase in self.phases:
                nodes = {id(n) for n in self._element_nodes(phase, stored)[0]}
                here = [(t, n) for t, n in self.program.updates
                        if t != "p" and t not in banned and id(n) in nodes
                        and id(n) not in stored and t not in self._scalar_targets]
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
        return [n for t, n in self.program.updates if not (t != "p" and id(n) in stored)
                and t not in self._scalar_targets and t not in self._scales]

    # -- pieces ---------------------------------------------------------------
    def _var(self, node: Node) -> str:
        return "v_" + self.lin.ref(node)

    def _block_start(self, uses: list[Node]) -> list[str]:
        """Per tensor: the scalar phase, the reductions already known, the pointers."""
        lin = self.lin
        out = ["            const double *H_ = (const double *)(intptr_t)row[COL_HYPER];",
               "            const double d_t = "
               "(double)(*(const int32_t *)(intptr_t)row[COL_STEP]) + 1;"]
        for k, h in enumerate(lin.hypers):
            out.append(f"            const double d_{h} = H_[{k}];")
        out += self._scalar_phase()
        for var in ("t", *lin.hypers, *(ln.var for ln in lin.scalar_lines)):
            node_dtype = next((ln.node.dtype for ln in lin.scalar_lines if ln.var == var), "float")
            ctype = "int" if node_dtype == "bool" else "CT"
            out.append(f"            const {ctype} v_{var} = ({ctype})d_{var};")
        for node in uses:
            out.append(f"            const CT {self._var(node)} = "
                       f"(CT)red[i * NRED + {self.slots[id(node)]}];")
        if self.program.rounding is not None and self._rounded():
            # stochastic rounding: the generator's key of this tensor (vega.codegen.precision)
            out.append("            const uint32_t KB_ = vega_mix(vega_mix(vega_mix("
                       f"{self.program.rounding}u) ^ (uint32_t)(*(const int32_t *)(intptr_t)"
                       "row[COL_STEP])) ^ (uint32_t)i);")
            for slot in self._rounded():
                out.append(f"            const uint32_t K{slot}_ = vega_mix(KB_ + {slot}u);")
        out += ["            const PSTORE *P_ = (const PSTORE *)(intptr_t)row[COL_P];",
                "            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[COL_G];",
                "            PSTORE *PO_ = (PSTORE *)(intptr_t)row[COL_P_OUT];"]
        for k in range(self.nstate):
            out.append(f"            const S{k}STORE *S{k}_ = (const S{k}STORE *)(intptr_t)"
                       f"row[COL_STATE + {k}];")
            out.append(f"            S{k}STORE *SO{k}_ = (S{k}STORE *)(intptr_t)"
                       f"row[COL_STATE_OUT + {k}];")
        for k, st in enumerate(self.program.states):  # one number a tensor: read once
            if st.dom == SCALAR_STATE:
                out.append(f"            const CT v_{state_var(st.name)} = LOAD_S{k}(S{k}_[0]);")
        return out

    def _scalar_phase(self) -> list[str]:
        """The scalar phase of one tensor, in double like the reference. It reads the step
        and the hyperparameters alone: where they are bit for bit the last tensor's of this
        thread here (a group's tensors, whose counters step together), its values are taken
        again (``pow`` and the like cost more than the loop over a small tensor)."""
        lin, r = self.lin, self.r
        lines = lin.scalar_lines
        if not lines:
            return []
        key = ["d_t", *(f"d_{h}" for h in lin.hypers)]
        out = [f"            static _Thread_local double MK_[{len(key)}], MV_[{len(lines)}];",
               "            static _Thread_local int MS_ = 0;",
               f"            const double KEY_[{len(key)}] = {{{', '.join(key)}}};"]
        types = ["int" if ln.node.dtype == "bool" else "double" for ln in lines]
        out += [f"            {t} d_{ln.var};" for t, ln in zip(types, lines)]
        out.append("            if (MS_ && memcmp(MK_, KEY_, sizeof KEY_) == 0) {  "
                   "/* the last tensor's step and hyperparameters */")
        out += [f"                d_{ln.var} = ({t})MV_[{k}];"
                for k, (t, ln) in enumerate(zip(types, lines))]
        out.append("            } else {")
        out += [f"                d_{ln.var} = "
                f"{r.expr(lin, ln.node, 'scalar').replace('(CT)', '(double)')};" for ln in lines]
        out += [f"                MV_[{k}] = (double)d_{ln.var};" for k, ln in enumerate(lines)]
        out += ["                memcpy(MK_, KEY_, sizeof KEY_);", "                MS_ = 1;",
                "            }"]
        return out

    @property
    def _scales(self) -> frozenset[str]:
        """The scale states of 8-bit states: written by ``_blocked`` beside the codes."""
        return quant.scale_names(self.program)

    @property
    def _scalar_targets(self) -> frozenset[str]:
        """The states of one number per tensor: stored once a tensor, after its loops
        (``_scalar_stores``), never in an element loop."""
        return frozenset(s.name for s in self.program.states if s.dom == SCALAR_STATE)

    def _scalar_stores(self) -> list[str]:
        """After every thread's loops, on the calling thread, tensor by tensor: the new
        values of the states of one number per tensor, from the tensor's reductions
        (``red``), its scalar phase and the old values (which no loop reads any more)."""
        targets = [(t, n) for t, n in self.program.updates if t in self._scalar_targets]
        if not targets:
            return []
        # (every reduction is an earlier loop's, in red: a state assigned a reduction of
        # per-element values does not compute those values here)
        found = element_plan([n for _, n in targets])
        nodes, used = list(found.lines), list(found.earlier)
        lines = ["    /* the states of one number per tensor, once each tensor */",
                 "    for (int64_t i = 0; i < nt; i++) {",
                 "        {",
                 "            const int64_t *row = tab + i * ROW;",
                 *self._block_start(used),
                 *(line[4:] for line in self._element_lines(nodes))]
        for t, n in targets:
            lines.append("            " + self._store(t, self.r.operand(self.lin, n), "0"))
        return lines + ["        }", "    }"]

    def _element_nodes(self, roots: list[Node], stored=None) \
            -> tuple[list[Node], list[Node], set[str]]:
        """The element-phase values reaching ``roots`` in order, the earlier reductions they
        read, and the states whose old values they read (``vega.codegen.plan.element_plan``).
        ``stored``: values an earlier loop stored (id -> state), loaded here (among the
        values), not computed."""
        found = element_plan(roots, computed=roots, stored=(stored or {}).keys())
        return list(found.lines), list(found.earlier), set(found.reads)

    def _element_lines(self, nodes: list[Node], stored=None) -> list[str]:
        lines = []
        for node in nodes:
            ctype = "int" if node.dtype == "bool" else "CT"
            if stored and id(node) in stored:
                k = self.program.state_names.index(stored[id(node)])
                value = f"LOAD_S{k}(SO{k}_[j])"
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
        names = self.program.state_names
        k = names.index(node.arg)
        if node.arg in self.program.quant:  # 8 bits: the code with its block's scale
            scale, signed = self.program.quant[node.arg]
            at = f"A{k}_" if self._in_blocks else f"S{names.index(scale)}_[{index} / QBLOCK]"
            return (f"const CT v_{state_var(node.arg)} = (CT)q8_{_MAP[signed]}(S{k}_[{index}], "
                    f"{at});")
        return f"const CT v_{state_var(node.arg)} = LOAD_S{k}(S{k}_[{index}]);"

    def _loads(self) -> list[str]:
        leaves = [Node(Op.PARAM), Node(Op.GRAD)] + [Node(Op.STATE, arg=s.name)
                                                    for s in self.program.states
                                                    if s.dom not in (SCALAR_STATE, QBLOCK)]
        return ["                " + self._load(leaf, "j") for leaf in leaves]

    def _store(self, target: str, value: str, index: str) -> str:
        """The statement writing ``value`` to output ``target`` ("p" or a state) at ``index``;
        a bfloat16 value stochastically rounded where the program says so."""
        slot = 0 if target == "p" else 1 + self.program.state_names.index(target)
        if target in self.program.quant:  # 8 bits: into the block's buffer (_blocked)
            k = slot - 1  # (the largest magnitude's bits: a NaN's are above all others)
            return (f"{{ union {{ float f; int32_t i; }} b_ = {{(float)({value})}}; "
                    f"B{k}_[{index} - jb_] = b_.f; const int32_t a_ = b_.i & 0x7FFFFFFF; "
                    f"M{k}_ = a_ > M{k}_ ? a_ : M{k}_; }}")
        to, save = ("PO_", "SAVE_P") if target == "p" else (f"SO{slot - 1}_", f"SAVE_S{slot - 1}")
        if slot in self._rounded():
            return (f"{to}[{index}] = f32_to_bf16_sr((float)({value}), "
                    f"vega_mix(K{slot}_ ^ (uint32_t){index}));")
        return f"{to}[{index}] = {save}({value});"

    def _rounded(self) -> list[int]:
        """The outputs (0: p, 1 + k: state k) stored stochastically rounded: the bfloat16
        ones, where the program rounds so."""
        if self.program.rounding is None:
            return []
        dts = [self.dtypes[0], *self.sdts]
        return [k for k, dt in enumerate(dts) if dt == "bfloat16"]

    @staticmethod
    def _prologue(skip: str = "return;") -> list[str]:
        """The gradient scale and clip coefficient from ``pre``, or a skipped step."""
        return ["    CT gs = 1, coef = 1;",
                "    if (pre) {",
                f"        if (pre[PRE_NONFINITE] != 0 && pre[PRE_CHECK] != 0) {skip}  "
                "/* non-finite gradients: skip */",
                "        gs = (CT)pre[PRE_INV_SCALE];",
                "        if (pre[PRE_MAX_NORM] > 0)",
                "            coef = (CT)(pre[PRE_MAX_NORM] / dmax(sqrt(pre[PRE_SUM_SQ]), "
                "pre[PRE_MAX_NORM]));",
                "    }"]

    def _parallel(self, name: str, skip: str, before=(), raw: bool = False) -> list[str]:
        """An entry point's head: the prologue, the tensors' starts, and a thread's share
        [lo, hi) of all their elements, from tensor i (the one holding lo) on. ``raw``: a
        static function with one more argument, ``raw`` (``_phase``'s)."""
        head = f"static void {name}(" if raw else f"void {name}("
        return [
            f"{head}int64_t nt, const int64_t *tab, const double *pre, double *red, "
            f"int nth{', int raw' if raw else ''}) {{",
            *self._prologue(skip),
            f"    int64_t *start = {'starts_q' if self.program.quant else 'starts'}(nt, tab);",
            "    int64_t total = start[nt];",
            *before,
            "    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN) "
            "firstprivate(gs, coef)",
            "    {",
            "        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();",
            "        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;",
            *(["        lo -= lo % QBLOCK; hi -= hi % QBLOCK;  /* whole blocks a thread */",
               "        if (tid == nthr - 1) hi = total;"] if self.program.quant else []),
            "        int64_t i = lo < hi ? locate(start, nt, lo) : nt;"]

    def _loop(self, name, before, uses, block_init, nodes, tail, block_end, finish, simd="",
              stored=None, skip="return;", raw=False, blocked=False, pieces=False):
        if pieces:  # (a phase's: its reductions the same on any number of threads)
            return [
                *self._parallel(name, skip, before, raw),
                "        for (; i < nt && start[i] < hi; i++) {  /* pieces starting in [lo, hi) */",
                "            const int64_t *row = tab + i * ROW;",
                "            int64_t k_ = lo > start[i] ? (lo - start[i] + PRE_PIECE - 1) / "
                "PRE_PIECE : 0;",
                "            for (; k_ * PRE_PIECE < row[COL_NUMEL] && start[i] + k_ * PRE_PIECE "
                "< hi; k_++) {",
                "            int64_t b = k_ * PRE_PIECE;",
                "            int64_t e = row[COL_NUMEL] < b + PRE_PIECE ? row[COL_NUMEL] : "
                "b + PRE_PIECE;",
                *self._block_start(uses),
                *block_init,
                *self._versions(nodes, tail, simd, stored, blocked),
                *block_end,
                "            }",
                "        }",
                "    }",
                *finish,
                "    free(start);",
                "}",
                "",
            ]
        return [
            *self._parallel(name, skip, before, raw),
            "        while (lo < hi) {",
            "            const int64_t *row = tab + i * ROW;",
            "            int64_t b = lo - start[i];",
            "            int64_t e = row[COL_NUMEL] < hi - start[i] ? row[COL_NUMEL] : "
            "hi - start[i];",
            *self._block_start(uses),
            *block_init,
            *self._versions(nodes, tail, simd, stored, blocked),
            *block_end,
            # (past a tensor's padding to whole blocks, where they are: starts_q)
            "            lo = e == row[COL_NUMEL] ? start[i + 1] : start[i] + e; i++;"
            if self.program.quant else "            lo = start[i] + e; i++;",
            "        }",
            "    }",
            *finish,
            "    free(start);",
            "}",
            "",
        ]

    def _versions(self, nodes: list[Node], tail: list[str], simd, stored,
                  blocked: bool = False) -> list[str]:
        """The element loop computing ``nodes``, then ``tail``. Where it divides by values
        of the scalar phase, two versions: one multiplying by their reciprocals, taken when
        every reciprocal is a normal number (``recip_ok``), and one dividing. ``blocked``:
        the update of a program with 8-bit states, a block at a time (``_blocked``)."""
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
            if blocked:
                self._in_blocks = True
                try:
                    body = [*self._loads(), *self._element_lines(nodes, stored), *tail]
                finally:
                    self._in_blocks = False
                return [indent + line for line in self._blocked(body)]
            body = [*self._loads(), *self._element_lines(nodes, stored), *tail]
            if self.split == "INT64_MAX":  # no split: the loop alone (a third less to compile)
                return [indent + line for line in [
                    *pragma, "            for (int64_t j = b; j < e; j++) {", *body,
                    "            }"]]
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

    _in_blocks = False  # rendering _blocked's loop: a block's scales are read before it

    def _blocked(self, body: list[str]) -> list[str]:
        """The update's loop over [b, e) a block of ``quant.BLOCK`` values at a time (b is
        a block's start, ``starts_q``): each 8-bit state's scale read once, its new values
        into a buffer (in the cache), then their largest magnitude (NaN wins), the block's
        scale and its codes written; each loop a SIMD loop."""
        names = self.program.state_names
        qs = [(names.index(n), names.index(sc), _MAP[signed])
              for n, (sc, signed) in self.program.quant.items()]
        lines = ["            for (int64_t jb_ = b; jb_ < e; jb_ += QBLOCK) {",
                 "                const int64_t je_ = e < jb_ + QBLOCK ? e : jb_ + QBLOCK;",
                 "                const int nb_ = (int)(je_ - jb_);"]
        for k, ks, _ in qs:
            lines.append(f"                const float A{k}_ = S{ks}_[jb_ / QBLOCK]; "
                         f"float B{k}_[QBLOCK]; int32_t M{k}_ = 0;")
        maxes, codes = ", ".join(f"M{k}_" for k, _, _ in qs), q8_codes()
        lines += [f"                #pragma omp simd reduction(max:{maxes})",
                  "                for (int64_t j = jb_; j < je_; j++) {",
                  *("    " + line for line in body), "                }"]
        for k, ks, how in qs:
            lines += ["                {",
                      f"                    union {{ int32_t i; float f; }} mag_ = {{M{k}_}};",
                      "                    /* a NaN wins, in its own state */",
                      f"                    SO{ks}_[jb_ / QBLOCK] = "
                      "mag_.i > 0x7F800000 ? NAN : mag_.f;",
                      f"                    const float i_ = q8_tiny(B{k}_, nb_, mag_.f);",
                      f"                    uint8_t *c_ = SO{k}_ + jb_;",
                      "                    #pragma omp simd",
                      "                    for (int q = 0; q < nb_; q++)",
                      f"                        c_[q] = q8_{codes}_{how}(B{k}_[q], i_);",
                      "                }"]
        return lines + ["            }"]

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
        """Per-tensor reductions: each tensor in pieces of PRE_PIECE values from its start,
        each piece's partials by one thread into slots of its own, combined in order after
        the threads (the same bits on any number of threads)."""
        stored, nodes, used, ident, tail, simd = self._phase_parts(k, phase)
        nr = len(phase)
        before = [f"    static const double ident[{nr}] = {{{', '.join(ident)}}};",
                  "    int64_t *slot = piece_slots(nt, tab);",
                  f"    size_t nslots = (size_t)slot[nt] * {nr};",
                  "    double *part = (double *)malloc(sizeof(double) * (nslots ? nslots : 1));"]
        block_init = ["            double " + ", ".join(
            f"acc{q} = {ident[q]}" for q in range(nr)) + ";"]
        block_end = [f"            part[(size_t)(slot[i] + k_) * {nr} + {q}] = acc{q};"
                     for q in range(nr)]
        finish = ["    for (int64_t i = 0; i < nt; i++) {"]
        for q, node in enumerate(phase):
            finish.append(f"        double r{q} = {ident[q]};")
            finish.append("        for (int64_t t = slot[i]; t < slot[i + 1]; t++) {")
            finish.append(f"            double x = part[(size_t)t * {nr} + {q}];")
            finish.append(f"            {_combine(_PARTIALS[node.op], f'r{q}', 'x')}")
            finish.append("        }")
            value = _finish(node.op, f"r{q}", "(double)tab[i * ROW + COL_NUMEL]")
            finish.append(f"        red[i * NRED + {self.slots[id(node)]}] = "
                          f"raw ? r{q} : {value};")
        finish += ["    }", "    free(part); free(slot);"]
        args = "nt, tab, pre, red, nth"
        sig = "int64_t nt, const int64_t *tab, const double *pre, double *red, int nth"
        return self._loop(f"phase{k}", before, used, block_init, nodes, tail, block_end,
                          finish, simd, stored, raw=True, pieces=True) + [
            f"void vega_phase{k}({sig}) {{ phase{k}({args}, 0); }}",
            "/* each reduction's partial result, its threads' combined but not finished (a sum",
            "   of squares for a norm, a sum for a mean): vega.runtime.sharded combines those",
            "   of all processes, finishes them, and gives them to the next phase */",
            f"void vega_phase{k}_partial({sig}) {{ phase{k}({args}, 1); }}", ""]

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
                 *self._versions(nodes, stores, "", stored, bool(self.program.quant)),
                 "            }"]
        return [
            *self._parallel("vega_fused", "{ pass_through(nt, tab); return; }"),
            # the tensors that start in [lo, hi), and the last thread's those that start at
            # the end (empty ones), each tensor on one thread: locate's tensor holding lo
            # passes over empty ones that start there
            "        const int64_t end_ = tid == nthr - 1 ? INT64_MAX : hi;",
            "        for (i = first_from(start, nt, lo); i < nt && start[i] < end_; i++) {",
            "            const int64_t *row = tab + i * ROW;",
            "            const int64_t b = 0, e = row[COL_NUMEL];",
            *body,
            "        }",
            "    }",
            *self._scalar_stores(),
            "    free(start);",
            "}",
            "",
        ]

    def _count(self, dom: str) -> str:
        """The number of values of a state of domain ``dom`` in a table row: numel (one, for
        a state of one number per tensor)."""
        if dom == QBLOCK:
            return "((row[COL_NUMEL] + QBLOCK - 1) / QBLOCK)"
        return "1" if dom == SCALAR_STATE else "row[COL_NUMEL]"

    def _pass_through(self) -> list[str]:
        """A skipped step out of place: each output (p out, state out) a copy of its input."""
        copies = [("row[COL_NUMEL]", "COL_P_OUT", "COL_P", "PSTORE")] + [
            (self._count(st.dom), f"COL_STATE_OUT + {k}", f"COL_STATE + {k}", f"S{k}STORE")
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
                  if (target == "p" or id(node) not in stored)
                  and target not in self._scalar_targets and target not in self._scales]
        return stored, nodes, used, stores

    def _update(self) -> list[str]:
        stored, nodes, used, stores = self._update_parts()
        return self._pass_through() + self._loop(
            "vega_update", [], used, [], nodes, stores, [], self._scalar_stores(), "", stored,
            skip="{ pass_through(nt, tab); return; }", blocked=bool(self.program.quant))


def _stores_of(plan) -> dict[int, str]:
    """The values a plan of early stores writes (``Source._early_stores``): id -> state."""
    return {id(n): t for here in plan for t, n in here}


