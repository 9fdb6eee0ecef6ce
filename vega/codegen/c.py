"""The C backend: fused multi-tensor CPU kernels, compiled with OpenMP and SIMD.

One shared library per program and dtype group (parameter, gradient and state
dtypes). Its entry points each take the whole group at once -- a table with one
row per tensor (``numel, p, g, state..., step, hyperparameters`` as addresses)
-- and split the work across threads by element ranges over all tensors:

- ``vega_prelude``: adds the sum of squares of the unscaled gradients and the
  count of non-finite elements into ``pre``;
- ``vega_phase<k>``: per-tensor reductions (``norm``, ``sum``, ``mean``, ``max``)
  of phase k, into ``red``; values needed on both sides are recomputed;
- ``vega_update``: the spec's element program, skipping every write when
  ``pre`` counted a non-finite gradient;
- ``vega_advance``: the step counters plus one, unless skipped.

Reductions combine per-thread partial results in thread order, so a step is
bitwise reproducible for a given thread count.
"""
from __future__ import annotations

import ctypes
import math

import torch

from vega.codegen import cbuild, reference
from vega.codegen.base import Linear, Renderer, distinct, linearize, reduction_phases, safe
from vega.dsl.ir import REDUCTIONS, Kind, Node, Op, Program, walk

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
    for (int64_t i = 0; i < nt; i++) start[i + 1] = start[i] + tab[i * ROW];
    return start;
}
#define PAR_MIN 32768  /* fewer elements than this run on one thread */

void vega_prelude(int64_t nt, const int64_t *tab, double *pre, int nth) {
    /* pre[0] += sum of squares of g * pre[2]; pre[1] += count of non-finite elements */
    int64_t *start = starts(nt, tab);
    int64_t total = start[nt];
    const CT gs = (CT)pre[2];
    double *part = (double *)calloc(2 * (size_t)(nth > 0 ? nth : 1), sizeof(double));
    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN)
    {
        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;
        double sq = 0, bad = 0;
        int64_t i = lo < hi ? locate(start, nt, lo) : nt;
        while (lo < hi) {
            const int64_t *row = tab + i * ROW;
            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[2];
            int64_t b = lo - start[i], e = row[0] < hi - start[i] ? row[0] : hi - start[i];
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
        pre[0] += part[2 * t];
        pre[1] += part[2 * t + 1];
    }
    free(part); free(start);
}

void vega_advance(int64_t n, const int64_t *steps, const double *pre) {
    if (pre && pre[1] != 0 && pre[4] != 0) return;  /* a skipped step leaves the counters alone */
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


class CRenderer(Renderer):
    code_for_op = {
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
        out.append(f"#define NSTATE {self.nstate}")
        out.append(f"#define NRED {len(self.slots)}")
        out.append("#define ROW (5 + NSTATE)  /* numel, p, g, state..., step, hyperparameters */")
        out.append(HEADER)
        for k, phase in enumerate(self.phases):
            out += self._phase(k, phase)
        out += self._update()
        return "\n".join(out)

    # -- pieces ---------------------------------------------------------------
    def _var(self, node: Node) -> str:
        return "v_" + self.lin.ref(node)

    def _block_start(self, uses: list[Node]) -> list[str]:
        """Per tensor: the scalar phase, the reductions already known, the pointers."""
        lin, r = self.lin, self.r
        out = ["            const double *H_ = (const double *)(intptr_t)row[4 + NSTATE];",
               "            const double d_t = "
               "(double)(*(const int32_t *)(intptr_t)row[3 + NSTATE]) + 1;"]
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
        out += ["            PSTORE *P_ = (PSTORE *)(intptr_t)row[1];",
                "            const GSTORE *G_ = (const GSTORE *)(intptr_t)row[2];"]
        for k in range(self.nstate):
            out.append(f"            SSTORE *S{k}_ = (SSTORE *)(intptr_t)row[{3 + k}];")
        return out

    def _element_lines(self, roots: list[Node]) -> tuple[list[str], list[Node]]:
        """Element-phase lines reaching ``roots``, and the earlier reductions they read."""
        lin, r = self.lin, self.r
        lines, used = [], []
        seen: set[int] = set()
        stack = list(roots)
        needed = []
        while stack:  # collect, stopping at reductions of earlier phases
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            needed.append(node)
            if node.op in REDUCTIONS and node not in roots:
                continue
            stack.extend(node.src)
        order = {id(n): k for k, n in enumerate(walk(roots))}
        for node in sorted(needed, key=lambda n: order[id(n)]):
            if node.op in REDUCTIONS and node not in roots:
                used.append(node)
            elif node.kind >= Kind.TENSOR and node.op not in (Op.PARAM, Op.GRAD, Op.STATE) \
                    and node.op is not Op.CONST and node.op not in REDUCTIONS:
                ctype = "int" if node.dtype == "bool" else "CT"
                lines.append(f"                const {ctype} {self._var(node)} = "
                             f"{r.expr(lin, node, 'element')};")
        return lines, used

    def _loads(self) -> list[str]:
        out = ["                const CT v_p = LOAD_P(P_[j]);",
               "                const CT v_g = LOAD_G(G_[j]) * gs * coef;"]
        for k, s in enumerate(self.program.states):
            out.append(f"                const CT v_{safe(s.name)} = LOAD_S(S{k}_[j]);")
        return out

    def _loop(self, name, before, uses, block_init, body, block_end, finish, simd=""):
        return [
            f"void {name}(int64_t nt, const int64_t *tab, const double *pre, double *red, "
            "int nth) {",
            "    CT gs = 1, coef = 1;",
            "    if (pre) {",
            "        if (pre[1] != 0 && pre[4] != 0) return;  /* non-finite gradients: skip */",
            "        gs = (CT)pre[2];",
            "        if (pre[3] > 0) coef = (CT)(pre[3] / fmax(sqrt(pre[0]), pre[3]));",
            "    }",
            "    int64_t *start = starts(nt, tab);",
            "    int64_t total = start[nt];",
            *before,
            "    #pragma omp parallel num_threads(nth) if (total >= PAR_MIN) "
            "firstprivate(gs, coef)",
            "    {",
            "        int tid = omp_get_thread_num(), nthr = omp_get_num_threads();",
            "        int64_t lo = total * tid / nthr, hi = total * (tid + 1) / nthr;",
            "        int64_t i = lo < hi ? locate(start, nt, lo) : nt;",
            "        while (lo < hi) {",
            "            const int64_t *row = tab + i * ROW;",
            "            int64_t b = lo - start[i];",
            "            int64_t e = row[0] < hi - start[i] ? row[0] : hi - start[i];",
            *self._block_start(uses),
            *block_init,
            *([f"            #pragma omp simd{simd}"] if simd is not None else []),
            "            for (int64_t j = b; j < e; j++) {",
            *self._loads(),
            *body,
            "            }",
            *block_end,
            "            lo = start[i] + e; i++;",
            "        }",
            "    }",
            *finish,
            "    free(start);",
            "}",
            "",
        ]

    def _phase(self, k: int, phase: list[Node]) -> list[str]:
        """Per-tensor reductions: per-thread partials, combined in thread order."""
        lines, used = self._element_lines(phase)
        nr = len(phase)
        ident = ["-INFINITY" if n.op is Op.AMAX else "0" for n in phase]
        body = list(lines)
        for q, node in enumerate(phase):
            x = self.r.operand(self.lin, node.src[0])
            if node.op is Op.AMAX:
                body.append(f"                acc{q} = ({x} > acc{q} || {x} != {x}) "
                            f"? {x} : acc{q};")
            elif node.op is Op.NORM:
                body.append(f"                acc{q} += (double){x} * (double){x};")
            else:
                body.append(f"                acc{q} += (double){x};")
        sums = [f"acc{q}" for q, n in enumerate(phase) if n.op is not Op.AMAX]
        # a NaN-propagating max is no OpenMP reduction: such a phase runs without simd
        simd = None if len(sums) < nr else f" reduction(+:{', '.join(sums)})"
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
            if node.op is Op.AMAX:
                finish.append(f"            r{q} = (x > r{q} || x != x) ? x : r{q};")
            else:
                finish.append(f"            r{q} += x;")
            finish.append("        }")
            value = {Op.NORM: f"sqrt(r{q})", Op.SUM: f"r{q}",
                     Op.MEAN: f"r{q} / (double)tab[i * ROW]", Op.AMAX: f"r{q}"}[node.op]
            finish.append(f"        red[i * NRED + {self.slots[id(node)]}] = {value};")
        finish += ["    }", "    free(part);"]
        return self._loop(f"vega_phase{k}", before, used, block_init, body, block_end, finish,
                          simd)

    def _update(self) -> list[str]:
        outs = [node for _, node in self.program.updates]
        lines, used = self._element_lines(outs)
        stores = []
        for target, node in self.program.updates:
            v = self.r.operand(self.lin, node)
            if target == "p":
                stores.append(f"                P_[j] = SAVE_P({v});")
            else:
                idx = self.program.state_names.index(target)
                stores.append(f"                S{idx}_[j] = SAVE_S({v});")
        return self._loop("vega_update", [], used, [], lines + stores, [], [])


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

    def __init__(self, program: Program):
        self.program = program
        self._reference = reference.Kernel(program)
        self._libs: dict[tuple[str, str, str], ctypes.CDLL] = {}
        self._nphases = len(reduction_phases(program))
        self._nred = sum(len(p) for p in reduction_phases(program))
        self.key = f"{program.name}/{len(_KERNELS)}"  # how the custom ops find this kernel
        _KERNELS[self.key] = self
        self._hyp_cache: dict[tuple[float, ...], torch.Tensor] = {}
        self._plan = None  # (addresses, tables) of the last call

    def source(self, dtypes=("float32", "float32", "float32")) -> str:
        return Source(self.program, *dtypes).text()

    def init(self, p, values, state_dtype):
        return self._reference.init(p, values, state_dtype)

    def library(self, dtypes: tuple[str, str, str]) -> ctypes.CDLL:
        if dtypes not in self._libs:
            lib, _, _ = cbuild.build(self.source(dtypes))
            for name in ["vega_prelude", "vega_update"] + [f"vega_phase{k}"
                                                           for k in range(self._nphases)]:
                fn = getattr(lib, name)
                fn.restype = None
                fn.argtypes = _ENTRY if name != "vega_prelude" else (
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
            lib.vega_advance.restype = None
            lib.vega_advance.argtypes = (ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)
            self._libs[dtypes] = lib
        return self._libs[dtypes]

    def _group_key(self, p, g, s_dtype):
        key = (p.dtype, g.dtype, s_dtype)
        if p.is_cpu and g.is_cpu:  # the common case, checked once per dtype triple
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
        found = _GROUP_KEYS[key] = (_DTYPES[p.dtype], _DTYPES[g.dtype], _DTYPES[s_dtype])
        return found

    def prelude(self, grads, pre: torch.Tensor) -> None:
        """Add the gradients' sum of squares and non-finite count, unscaled, into ``pre``."""
        for g in grads:
            self._group_key(g, g, g.dtype)
        if torch.compiler.is_compiling():  # traced as one opaque node
            c_prelude(self.key, list(grads), pre)
        else:  # eagerly, directly: the op's dispatch costs about 0.7 us a tensor
            self._prelude(grads, pre)

    def _prelude(self, grads, pre: torch.Tensor) -> None:
        """The body of ``vega::c_prelude``."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            g = g.contiguous()
            groups.setdefault(self._group_key(g, g, g.dtype), []).append(g)
        nth = torch.get_num_threads()
        for key, gs in groups.items():
            rows = [[g.numel(), 0, g.data_ptr()] + [0] * (self._row - 3) for g in gs]
            table = torch.tensor(rows, dtype=torch.int64).reshape(len(gs), -1)
            self.library(key).vega_prelude(len(gs), _ptr(table), _ptr(pre), nth)

    @property
    def _row(self) -> int:
        return 5 + len(self.program.states)

    def __call__(self, params, grads, states, steps, values, donate, pre=None):
        """The same contract as ``vega.codegen.reference.Kernel.__call__``."""
        if not donate:  # pure: run in place on copies
            params = [p.clone() for p in params]
            states = [[s.clone() for s in col] for col in states]
        unique, step_index = distinct(steps)  # the distinct step counters, by identity
        if not donate:
            unique = [s.clone() for s in unique]
        hyp, hyp_index = self._hyper_tables(values)
        args = (params, list(grads), [s for col in states for s in col], unique, step_index,
                hyp, hyp_index, pre)
        if torch.compiler.is_compiling():  # traced as one opaque node
            c_step(self.key, *args)
        else:  # eagerly, directly: the op's dispatch costs about 0.7 us a tensor
            self._step(*args)
        finite = ((pre[1] == 0) | (pre[4] == 0)) if pre is not None else None
        return params, states, [unique[k] for k in step_index], finite

    def _step(self, params, grads, flat_states, steps, step_index, hyp, hyp_index, pre):
        """The body of ``vega::c_step``: every tensor updated in place."""
        nth = torch.get_num_threads()
        everything = (*params, *grads, *flat_states, *hyp)
        if all(map(torch.Tensor.is_contiguous, everything)):
            # the tables of the last call serve again when every address is the same
            ptr = torch.Tensor.data_ptr
            key = (tuple(map(ptr, everything)), tuple(map(ptr, steps)), tuple(step_index),
                   tuple(hyp_index), tuple(map(torch.Tensor.numel, params)),
                   tuple(t.dtype for t in everything))
            if self._plan is None or self._plan[0] != key:
                self._plan = (key, self._tables(params, grads, flat_states, steps, step_index,
                                                hyp, hyp_index))
            self._launch(self._plan[1], steps, pre, nth)
            return
        # some tensor is not contiguous: work on contiguous copies, copied back at the end
        work_p = [p.contiguous() for p in params]
        work_s = [s.contiguous() for s in flat_states]
        tables = self._tables(work_p, [g.contiguous() for g in grads], work_s, steps,
                              step_index, [h.contiguous() for h in hyp], hyp_index)
        self._launch(tables, steps, pre, nth)
        for orig, work in zip([*params, *flat_states], [*work_p, *work_s]):
            if work is not orig:
                orig.copy_(work)

    def _tables(self, params, grads, flat_states, steps, step_index, hyp, hyp_index):
        """(library, address table, reduction buffer) per dtype group; checks every tensor."""
        n = len(params)
        states = [flat_states[k * n:(k + 1) * n] for k in range(len(self.program.states))]
        groups: dict[tuple[str, str, str], list[int]] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            sdt = states[0][i].dtype if states else p.dtype
            if any(col[i].dtype != sdt for col in states):
                raise ValueError("backend 'c' needs every state tensor of a parameter in one "
                                 "dtype")
            groups.setdefault(self._group_key(p, g, sdt), []).append(i)
        out = []
        for key, idx in groups.items():
            rows = [[params[i].numel(), params[i].data_ptr(), grads[i].data_ptr(),
                     *(col[i].data_ptr() for col in states),
                     steps[step_index[i]].data_ptr(),
                     hyp[hyp_index[i]].data_ptr()] for i in idx]
            table = torch.tensor(rows, dtype=torch.int64).reshape(len(idx), -1)
            red = torch.empty(max(1, len(idx) * self._nred), dtype=torch.float64)
            out.append((self.library(key), table, red))
        return out

    def _launch(self, tables, steps, pre, nth):
        for lib, table, red in tables:
            n = table.shape[0]
            for k in range(self._nphases):
                getattr(lib, f"vega_phase{k}")(n, _ptr(table), _ptr(pre), _ptr(red), nth)
            lib.vega_update(n, _ptr(table), _ptr(pre), _ptr(red), nth)
        if tables:
            ptrs = torch.tensor([s.data_ptr() for s in steps], dtype=torch.int64)
            tables[-1][0].vega_advance(len(steps), _ptr(ptrs), _ptr(pre))

    def _hyper_tables(self, values):
        """A float64 array of hyperparameter values per distinct values dict, and the index
        of each tensor's array."""
        uniq, index = distinct(values)
        return [self._hyper_array(vals) for vals in uniq], index

    def _hyper_array(self, vals) -> torch.Tensor:
        parts = [vals[n] for n in self.program.float_hypers]
        if any(isinstance(v, torch.Tensor) for v in parts):
            return torch.stack([torch.as_tensor(v).detach().to(torch.float64).reshape(())
                                for v in parts])
        numbers = tuple(float(v) for v in parts) or (0.0,)
        if torch.compiler.is_compiling():  # a graph constant: a cache filled while tracing
            return torch.tensor(numbers, dtype=torch.float64)  # would fail the next guards
        # plain numbers: one array per distinct setting, kept across steps
        arr = self._hyp_cache.get(numbers)
        if arr is None:
            if len(self._hyp_cache) > 64:
                self._hyp_cache.clear()
            arr = self._hyp_cache[numbers] = torch.tensor(numbers, dtype=torch.float64)
        return arr


_KERNELS: dict[str, Kernel] = {}


@torch.library.custom_op("vega::c_prelude", mutates_args=("pre",), device_types="cpu")
def c_prelude(key: str, grads: list[torch.Tensor], pre: torch.Tensor) -> None:
    """Add the sum of squares and the non-finite count of ``grads`` into ``pre``."""
    _KERNELS[key]._prelude(grads, pre)


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
    _KERNELS[key]._step(params, grads, states, steps, step_index, hypers, hyper_index, pre)


@c_step.register_fake
def _(key, params, grads, states, steps, step_index, hypers, hyper_index, pre):
    return None


def available() -> bool:
    return cbuild.available()
