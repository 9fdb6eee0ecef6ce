"""``vega bench``: one optimizer step, timed side by side with torch.optim and optax.

Two parameter sets: GPT-2-like (about 40M parameters in 51 tensors) and many
small tensors (1,000 tensors of at most 10k elements). Every row is the
median of several steps measured in this one run; ratios compare rows of the
same run. The rows of a table are timed in rounds, each round stepping every
row once in turn (``race``): a drift of the machine's speed touches them alike,
and a step finds little of its data still in the cache, as after a forward and
backward pass (the other optimizers of the second table race their counterpart
alone; optax, and vega's pure functional step raced with torch's fused step, run
in processes of their own, first). Also: the time to compile a spec cold and to
load it from the cache.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import vega
from vega.codegen.c import build as cbuild
from vega.codegen.c import native
from vega.dsl.ir import REDUCTIONS, Op, walk

# torch.optim or pytorch-optimizer counterparts of the other shipped specs:
# (vega hyperparameters, where the counterpart lives, its class, its kwargs)
OTHERS = {
    "sgd": ({"lr": 1e-2, "momentum": 0.9}, "torch", "SGD", {"lr": 1e-2, "momentum": 0.9}),
    "adam": ({}, "torch", "Adam", {}),
    "radam": ({}, "torch", "RAdam", {}),
    "adagrad": ({}, "torch", "Adagrad", {}),
    "rmsprop": ({}, "torch", "RMSprop", {}),
    "lamb": ({}, "pytorch_optimizer", "Lamb", {"max_grad_norm": 0.0}),
    "lars": ({}, "pytorch_optimizer", "LARS", {}),
    "lion": ({}, "pytorch_optimizer", "Lion", {}),
    "adan": ({}, "pytorch_optimizer", "Adan", {}),
    "adafactor": ({}, "torch", "Adafactor", {"lr": 1e-2}),
    "adamax": ({}, "torch", "Adamax", {}),
    "adadelta": ({}, "torch", "Adadelta", {}),
    "rprop": ({}, "torch", "Rprop", {}),
    "yogi": ({}, "pytorch_optimizer", "Yogi", {}),
    "adabelief": ({}, "pytorch_optimizer", "AdaBelief", {}),
    "adopt": ({}, "pytorch_optimizer", "ADOPT", {}),
    "ademamix": ({}, "pytorch_optimizer", "AdEMAMix", {}),
    "nadam": ({}, "torch", "NAdam", {}),
    "novograd": ({}, "pytorch_optimizer", "NovoGrad", {}),
    "prodigy": ({}, "pytorch_optimizer", "Prodigy", {}),
    "schedule_free_adamw": ({}, "pytorch_optimizer", "ScheduleFreeAdamW", {}),
}
MUON = "Muon on the set's matrices"


FUNCTIONAL = "vega adamw_step, functional and pure (own process)"
FUNCTIONAL_FUSED = "(torch AdamW fused, raced with the functional step)"


def gpt2_like() -> list[tuple[int, ...]]:
    """4 GPT-2 blocks of width 768 and a 15k-token embedding: 40M parameters, 51 tensors."""
    d = 768
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(15000, d), (1024, d)] + block * 4 + [(d,)]


def many_small(n: int = 1000, seed: int = 0) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(k),) for k in torch.randint(1, 10_001, (n,), generator=gen)]


def _tensors(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    return params, grads


def _leaves(shapes, grads):
    out = []
    for p, g in zip(_tensors(shapes)[0], grads):
        p.requires_grad_(True)
        p.grad = g.clone()
        out.append(p)
    return out


def race(fns: dict, budget: float = 6.0, max_rounds: int = 9, min_rounds: int = 3) -> dict:
    """Median seconds of each of ``fns`` (label -> callable), measured in rounds: each
    round calls every function once, in turn, so that a drift of the machine's speed
    touches every row alike and a step's data may have left the cache (the other rows'
    steps ran in between). One warm-up call each first."""
    for fn in fns.values():
        fn()
    times: dict = {label: [] for label in fns}
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (rounds < max_rounds and spent < budget):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[label].append(dt)
            spent += dt
        rounds += 1
    return {label: statistics.median(ts) for label, ts in times.items()}


# -- the memory-bandwidth bound --------------------------------------------------------

# An AdamW-like loop over p, g, m and v (reads 16 bytes an element, writes 12), timed on
# this run's threads: as a plain OpenMP split, and with each thread's share read as four
# quarters side by side (more loads in flight); the faster is the machine's bound. Beside
# it, the read-only pass raced with the rows, and the loops bench/reads.py races.
STREAM_C = r"""
#include <math.h>
#include <stdint.h>
const char *vega_key(void) { return "@KEY@"; }
static inline void one(float *restrict p, const float *restrict g, float *restrict m,
                       float *restrict v, int64_t i) {
    float gi = g[i];
    float mi = 0.9f * m[i] + 0.1f * gi;
    float vi = 0.999f * v[i] + 0.001f * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - 1e-3f * (mi / (sqrtf(vi) + 1e-8f) + 0.01f * p[i]);
}
void vega_stream_plain(float *restrict p, const float *restrict g, float *restrict m,
                       float *restrict v, int64_t n) {
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) one(p, g, m, v, i);
}
void vega_stream_quarters(float *restrict p, const float *restrict g, float *restrict m,
                          float *restrict v, int64_t n) {
    #pragma omp parallel
    {
        int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t lo = n * id / nt, hi = n * (id + 1) / nt, q = (hi - lo) / 4;
        #pragma omp simd
        for (int64_t i = 0; i < q; i++) {
            one(p, g, m, v, lo + i);
            one(p, g, m, v, lo + q + i);
            one(p, g, m, v, lo + 2 * q + i);
            one(p, g, m, v, lo + 3 * q + i);
        }
        for (int64_t i = lo + 4 * q; i < hi; i++) one(p, g, m, v, i);
    }
}
/* a read-only pass, the fused step's prelude's kind: the sum of squares of one array, each
   thread's share read as four quarters side by side, as the prelude reads each piece of
   65,536 values (one run a thread read 4 to 12% slower on an EPYC, where two to eight runs
   read alike) */
double vega_stream_read(const float *restrict g, int64_t n) {
    double total = 0;
    #pragma omp parallel reduction(+:total)
    {
        int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t lo = n * id / nt, hi = n * (id + 1) / nt, q = (hi - lo) / 4;
        for (int64_t o = 0; o < q; o += 512) {
            int64_t m = q - o < 512 ? q - o : 512;
            const float *a = g + lo + o, *b = a + q, *c = b + q, *d = c + q;
            float part = 0;
            #pragma omp simd reduction(+:part)
            for (int64_t j = 0; j < m; j++)
                part += (a[j] * a[j] + b[j] * b[j]) + (c[j] * c[j] + d[j] * d[j]);
            total += part;
        }
        for (int64_t j = lo + 4 * q; j < hi; j++) total += g[j] * g[j];
    }
    return total;
}
/* bench/reads.py's loops: a sum of squares read as ``runs`` runs a thread side by side, and
   a += b (reads 8 bytes an element, writes 4) */
double vega_stream_read_runs(const float *restrict g, int64_t n, int runs) {
    double total = 0;
    #pragma omp parallel reduction(+:total)
    {
        int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t lo = n * id / nt, hi = n * (id + 1) / nt, q = (hi - lo) / runs;
        for (int64_t o = 0; o < q; o += 512) {
            int64_t m = q - o < 512 ? q - o : 512;
            float part = 0;
            for (int r = 0; r < runs; r++) {
                const float *a = g + lo + r * q + o;
                #pragma omp simd reduction(+:part)
                for (int64_t j = 0; j < m; j++) part += a[j] * a[j];
            }
            total += part;
        }
        for (int64_t j = lo + runs * q; j < hi; j++) total += g[j] * g[j];
    }
    return total;
}
void vega_stream_add(float *restrict a, const float *restrict b, int64_t n) {
    #pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] += b[i];
}
""".replace("#include <stdint.h>", "#include <stdint.h>\n#include <omp.h>")
STREAM_BYTES = 28  # a float32 element of the loop above: 4 reads and 3 writes


def bandwidth(elements: int = 1 << 24, repeats: int = 7) -> tuple[float, str]:
    """(bytes a second, which loop) of the faster of ``STREAM_C``'s two loops over four
    float32 arrays of ``elements`` each (256 MB in all by default), the best of
    ``repeats`` timings each, on torch's thread count; (NaN, why) without a C compiler."""
    if not cbuild.available():
        return float("nan"), "no C compiler"
    best, which = 0.0, ""
    for loop in ("plain", "quarters"):
        stream = Stream(loop, elements)
        stream()  # pages touched, threads started
        for _ in range(repeats):
            t0 = time.perf_counter()
            stream()
            rate = stream.nbytes / (time.perf_counter() - t0)
            if rate > best:
                best, which = rate, loop
    return best, which


class Stream:
    """``STREAM_C``'s faster loop over four float32 arrays of ``elements`` each, as a row
    to race beside the steps (``race``): the bandwidth bound measured in the same rounds as
    the rows it bounds, so that a drift of the machine's speed touches both alike.
    ``nbytes``: what one call moves. Calling it without a C compiler does nothing."""

    def __init__(self, loop: str, elements: int = 1 << 24):
        self.fn = None
        self.nbytes = STREAM_BYTES * elements
        if not cbuild.available() or loop not in ("plain", "quarters"):
            return
        import ctypes
        lib, _, _ = cbuild.build(STREAM_C)
        self.arrays = [torch.full((elements,), x) for x in (0.5, 0.01, 0.0, 0.0)]
        self.args = [ctypes.c_void_p(a.data_ptr()) for a in self.arrays] + [elements]
        self.fn = getattr(lib, f"vega_stream_{loop}")
        self.fn.restype = None
        self.fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64]

        self.read_fn = lib.vega_stream_read
        self.read_fn.restype = ctypes.c_double
        self.read_fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]

    def __call__(self) -> None:
        if self.fn is not None:
            self.fn(*self.args)

    def read(self) -> None:
        """A read-only pass over all four arrays (``read_bytes``): the rate of a pass that
        only reads, as the fused step's prelude does."""
        if self.fn is not None:
            for a in self.arrays:
                self.read_fn(a.data_ptr(), a.numel())

    @property
    def read_bytes(self) -> int:
        return 4 * 4 * (self.nbytes // STREAM_BYTES)


READ_BOUND = "(the read-only bound, raced with the rows: a sum of squares)"

BOUND = "(the bandwidth bound, raced with the rows: an AdamW-like loop)"


def bytes_per_param(name: str, hypers: dict | None = None, fused: bool = False,
                    itemsize: int = 4, state_itemsize: int | None = None) -> int:
    """The bytes a step of shipped spec ``name`` must move for each parameter, all tensors
    of ``itemsize`` bytes (the states of ``state_itemsize``, where given), counted from the
    rule: read p, g and every state, write p and every state the rule changes (Prodigy's
    ``p0`` is read, never written); a rule with per-tensor reductions (lamb's and lars's
    norms, adafactor's update RMS) reads once more, before the update, what its
    reductions read (lamb's norm of the update: p, g and both moments; lars's norms: p
    and g; novograd's: g alone); ``fused`` (loss scale, finite check, clip) reads the
    gradients once more before it."""
    hypers = hypers or {}
    spec = vega.builtin(name)
    flags = {h.name: hypers[h.name] for h in spec.hypers if h.type == "bool" and h.name in hypers}
    program = spec.program(shape=(768, 768), **flags, **{
        k: v for k, v in hypers.items() if k not in flags and k in spec._spec.shape_hypers})
    arrays = {st.name for st in program.states if st.dom == "rc"}
    ratio = (state_itemsize or itemsize) / itemsize  # a state's bytes, in tensors of itemsize
    written = {n for n, node in program.updates if n in arrays
               and not (node.op is Op.STATE and node.arg == n)}
    reads, writes = 2 + len(arrays) * ratio, 1 + len(written) * ratio
    reduced: set = set()  # what the reductions read, p and g and the states like p
    for node in walk(node for _, node in program.updates):
        if node.op in REDUCTIONS:
            reduced |= {"p" if x.op is Op.PARAM else "g" if x.op is Op.GRAD else x.arg
                        for x in walk(node.src) if x.op in (Op.PARAM, Op.GRAD)
                        or (x.op is Op.STATE and x.arg in arrays)}
    reads += sum(1 if x in ("p", "g") else ratio for x in reduced)
    return round((reads + writes + int(fused)) * itemsize)


# the configurations whose state bytes per parameter ``vega bench`` prints: (label,
# parameter dtype, adamw_init's keywords)
STATE_CONFIGS = (
    ("float32 parameters and state", torch.float32, {}),
    ("float32 parameters, bfloat16 state", torch.float32, {"state_dtype": torch.bfloat16}),
    ("float32 parameters, bfloat16 nu", torch.float32, {"state_dtype": {"nu": torch.bfloat16}}),
    ("bfloat16 parameters, float32 state", torch.bfloat16, {}),
    ("bfloat16 parameters, master weights", torch.bfloat16, {"master_weights": True}),
    ("bfloat16 parameters, master weights, bfloat16 state", torch.bfloat16,
     {"master_weights": True, "state_dtype": torch.bfloat16}),
    ("float32 parameters, 8-bit state (a matrix and a bias)", torch.float32,
     {"state_dtype": torch.uint8}),
)


def state_bytes() -> list[tuple[str, float]]:
    """(configuration, bytes of AdamW's state per parameter) of each of ``STATE_CONFIGS``,
    counted on the state ``adamw_init`` makes (docs/precision.md)."""
    out = []
    for label, dtype, kw in STATE_CONFIGS:  # (a GPT-2 layer's matrix and bias)
        params = {"w": torch.zeros(768, 768, dtype=dtype), "b": torch.zeros(768, dtype=dtype)}
        state = vega.adamw_init(params, **kw)
        total = sum(t.numel() * t.element_size() for field, tree in state.items()
                    if field != "step" for t in tree.values() if t is not None)
        out.append((label, total / sum(p.numel() for p in params.values())))
    return out


def _bound_note(secs: float, nbytes: int, nparams: int, rate: float) -> str:
    """``B/param`` and the time over the bound (bytes / bandwidth), for a row."""
    if not (rate > 0) or math.isnan(rate):
        return f"{nbytes:>4} B/param"
    return f"{nbytes:>4} B/param {secs / (nbytes * nparams / rate):>6.2f}x bound"


# the most two rows' parameters may be apart (``apart``) and agree: float32 steps rounded
# otherwise; Muon's, whose Newton-Schulz iterations each side runs in bfloat16 in its own
# order (1.5 to 1.8e-2 measured)
APART_TOL = 1e-2
APART_TOL_BF16 = 0.1


def apart_tol(label: str) -> float:
    return APART_TOL_BF16 if label == "muon" else APART_TOL


def apart(ours, theirs, start) -> float:
    """How far two lists of parameters, stepped from ``start``, are apart: the largest
    absolute difference over the largest change the steps made to ``theirs`` (NaN where
    either holds a NaN)."""
    diffs = [float((a.detach().double() - b.detach().double()).abs().max())
             for a, b in zip(ours, theirs, strict=True)]
    scale = max(float((b.detach().double() - s.double()).abs().max())
                for b, s in zip(theirs, start, strict=True))
    if any(math.isnan(d) for d in diffs) or math.isnan(scale):
        return float("nan")
    return max(diffs) / scale if scale > 0 else max(diffs)


def _params(opt) -> list:
    return [p for group in opt.param_groups for p in group["params"]]


def adamw_rows(shapes, grads, compile_torch=True, bound: Stream | None = None,
               checks: dict | None = None):
    # the rows of processes of their own first, while this one holds little memory: on a
    # virtual machine, the fresh pages of a pure step cost up to 4x more when the memory
    # of other processes is large (pages the host has to find again)
    alone = {**functional_rows(shapes), **_optax_row(shapes)}
    fns = {}
    opt = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3)
    fns["vega AdamW"] = opt.step
    fns_opts = {"vega AdamW": opt}
    fused_opt = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3, max_grad_norm=1.0,
                                 loss_scale=vega.LossScale.dynamic(init=1.0,
                                                                   growth_interval=10**9))
    fns["vega AdamW + unscale, finite check, clip, skip"] = fused_opt.step
    fns_opts["vega AdamW + unscale, finite check, clip, skip"] = fused_opt
    fns[BF16_STATE] = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                       state_dtype=torch.bfloat16).step
    fns[Q8_STATE] = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                     state_dtype=torch.uint8).step
    for label, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}),
                      ("fused", {"fused": True})):
        fns_opts[f"torch AdamW {label}"] = torch.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                                             **kw)
        fns[f"torch AdamW {label}"] = fns_opts[f"torch AdamW {label}"].step
    ps = _leaves(shapes, grads)
    t_opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor on first use

    def composite():
        scaler.unscale_(t_opt)
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        scaler.step(t_opt)
        scaler.update()
    fns["torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW"] = composite
    compile_secs = None
    if compile_torch:
        c_opt = torch.optim.AdamW(_leaves(shapes, grads), lr=1e-3, foreach=True)
        compiled = torch.compile(c_opt.step)
        t0 = time.perf_counter()
        compiled()
        compile_secs = time.perf_counter() - t0
        fns["torch.compile(AdamW.step)"] = compiled
    if bound is not None and bound.fn is not None:
        fns[BOUND] = bound
        fns[READ_BOUND] = bound.read
    rows = race(fns)  # (every row stepped as many times: its parameters can be compared)
    if checks is not None:
        fused_ps, start = _params(fns_opts["torch AdamW fused"]), _tensors(shapes)[0]
        for label, ref in (("vega AdamW", fused_ps), ("torch AdamW foreach", fused_ps),
                           ("torch AdamW for-loop", fused_ps),
                           ("vega AdamW + unscale, finite check, clip, skip", ps)):
            checks[label] = apart(_params(fns_opts[label]), ref, start)
    rows.update(alone)
    if compile_secs is not None:
        rows["(torch.compile of AdamW: compile time, not a step)"] = compile_secs
    return rows


def functional_rows(shapes) -> dict:
    """vega's functional AdamW step, pure as optax's pure row (new parameters and state each
    step), raced against torch's fused step in a process of their own, as optax's: the pure
    step's allocations slowed the rows timed beside it (the allocator returns freed memory
    to the system, and takes it back at a cost a step later), and were slowed by theirs."""
    ours, fused = _in_own_process("functional_seconds", shapes, 2)
    return {FUNCTIONAL: ours, FUNCTIONAL_FUSED: fused}


def _in_own_process(function: str, shapes, count: int) -> list[float]:
    """The ``count`` numbers ``vega.bench.<function>(shapes)`` returns, run in a new
    Python process."""
    code = (f"import json, sys; from vega.bench import {function}; "
            f"out = {function}([tuple(s) for s in json.loads(sys.argv[1])]); "
            "print(json.dumps(list(out) if isinstance(out, tuple) else [out]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(shapes)], capture_output=True,
                         text=True, timeout=900, env=native.checkout_env())
    if out.returncode != 0:
        raise RuntimeError(f"{function} failed:\n{out.stderr[-2000:]}")
    numbers = json.loads(out.stdout.strip().splitlines()[-1])  # (NaN: json's NaN)
    assert len(numbers) == count, numbers
    return [float(x) for x in numbers]


def functional_seconds(shapes) -> tuple[float, float]:
    """Median seconds of vega's pure adamw_step and of torch's fused AdamW, raced."""
    _, grads = _tensors(shapes)
    box = [list(_tensors(shapes)[0]), None]
    box[1] = vega.adamw_init(box[0])

    def functional():
        box[0], box[1] = vega.adamw_step(box[0], grads, box[1], lr=1e-3)
    fused = torch.optim.AdamW(_leaves(shapes, grads), lr=1e-3, fused=True).step
    times = race({"vega": functional, "fused": fused})
    return times["vega"], times["fused"]


OPTAX_DONATED = "optax adamw under jax.jit, donated (own process)"
OPTAX_PURE = "optax adamw under jax.jit, pure (own process)"


def _optax_row(shapes) -> dict:
    """optax's adamw under jax.jit, donated and pure, timed in a process of its own: XLA's
    worker threads keep spinning after a step, and slowed every row timed after them here
    (by 1.5-2x on the many-small set)."""
    donated, pure = _in_own_process("optax_seconds", shapes, 2)
    if math.isnan(donated):
        return {"optax adamw under jax.jit (not installed)": donated}
    return {OPTAX_DONATED: donated, OPTAX_PURE: pure}


def optax_stepper(shapes, donate: bool):
    """(step, box): optax's adamw step under jax.jit with torch's and vega's AdamW
    hyperparameters (lr 1e-3, weight decay 0.01, where optax's default decay is 1e-4) from
    ``_tensors(shapes)``; ``box[0]`` the parameters, ``box[1]`` the state, each call one
    step, waited for. With ``donate`` the step is given the parameters and state to write
    its new ones over (``donate_argnums``: in place, optax's fastest path), else it
    writes new ones each step (pure, as vega's functional step without ``donate``)."""
    import jax
    import jax.numpy as jnp
    import optax
    tx = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    params, grads = _tensors(shapes)
    params = [jnp.asarray(p.numpy()) for p in params]
    grads = [jnp.asarray(g.numpy()) for g in grads]

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    jitted = jax.jit(update, donate_argnums=(0, 1) if donate else ())
    box = [params, tx.init(params)]

    def step():
        box[0], box[1] = jitted(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    return step, box


def optax_seconds(shapes) -> tuple[float, float]:
    """Median seconds of optax's adamw step under jax.jit, donated and pure, each raced
    alone, the donated first (NaN, NaN without jax and optax)."""
    import importlib.util
    if any(importlib.util.find_spec(name) is None for name in ("jax", "optax")):
        return float("nan"), float("nan")
    donated, _ = optax_stepper(shapes, donate=True)
    donated_secs = race({"optax": donated})["optax"]
    del donated
    pure, _ = optax_stepper(shapes, donate=False)
    return donated_secs, race({"optax": pure})["optax"]


def _torch_fastest(cls, shapes, grads, kwargs):
    """(a torch.optim ``cls`` over new leaves, "fused" or "foreach"): its fastest CPU step,
    fused where the class has a fused step that runs on these tensors (SGD, Adam, AdamW and
    Adagrad in torch 2.13), else foreach."""
    import inspect
    if "fused" in inspect.signature(cls.__init__).parameters:
        try:
            return cls(_leaves(shapes, grads), **kwargs, fused=True), "fused"
        except RuntimeError:  # no fused step for this device or dtype
            pass
    return cls(_leaves(shapes, grads), **kwargs, foreach=True), "foreach"


# counterparts whose defaults are another setting of the rule than vega's (torch's
# Adafactor: the relative step on, every matrix factored over its last two axes): their
# parameters are not compared
UNLIKE = {"adafactor"}


def other_rows(shapes, grads, names, bound: Stream | None = None, checks: dict | None = None):
    """Per optimizer: (name, vega's median seconds, the counterpart's label, its seconds,
    the seconds of ``bound`` raced with them: NaN without one). ``checks``: filled with
    each name's ``apart`` of vega's parameters and the counterpart's after the race (the
    same steps on both), where the two compute one rule."""
    rows, start = [], []  # (the parameters the races start from, made at the first check)
    raced = {"bound": bound} if bound is not None and bound.fn is not None else {}
    for name in names:
        if name not in vega.builtin_names() or name not in OTHERS:
            continue
        hypers, module, cls, kwargs = OTHERS[name]
        opt = vega.builtin(name).optimizer(_leaves(shapes, grads), **hypers)
        try:
            mod = torch.optim if module == "torch" else __import__(module)
            ref_cls = getattr(mod, cls)
            if module == "torch":
                ref, path = _torch_fastest(ref_cls, shapes, grads, kwargs)
                label = f"torch.optim.{cls} {path}"
            else:
                ref = ref_cls(_leaves(shapes, grads), **kwargs)
                label = f"{module}.{cls}"
            times = race({"vega": opt.step, "theirs": ref.step, **raced}, budget=3.0)
            ours, theirs = times["vega"], times["theirs"]
            if checks is not None and name not in UNLIKE:
                start = start or _tensors(shapes)[0]
                checks[name] = apart(_params(opt), _params(ref), start)
        except (ImportError, AttributeError) as err:  # not installed, or no such class
            times = race({"vega": opt.step, **raced}, budget=3.0)
            ours = times["vega"]
            missing = "not installed" if isinstance(err, ImportError) else f"no {cls}"
            theirs, label = float("nan"), f"{module} ({missing})"
        rows.append((name, ours, label, theirs, times.get("bound", float("nan"))))
    return rows


def muon_rows(shapes, grads, checks: dict | None = None) -> tuple[float, float, int, int]:
    """(vega's Muon, torch.optim.Muon: median seconds of a step, both with their defaults,
    Newton-Schulz in bfloat16; the number of matrices; their parameters) over the 2-d
    tensors of ``shapes`` (torch's Muon takes no other); ``checks["muon"]``: the two
    steps' parameters after the race, ``apart``."""
    keep = [k for k, s in enumerate(shapes) if len(s) == 2]
    mats = [shapes[k] for k in keep]
    mgrads = [grads[k] for k in keep]
    ours = vega.optim.Muon(_leaves(mats, mgrads))
    theirs = torch.optim.Muon(_leaves(mats, mgrads))
    times = race({"vega": ours.step, "torch": theirs.step}, budget=6.0, min_rounds=3)
    if checks is not None:
        checks["muon"] = apart(_params(ours), _params(theirs), _tensors(mats)[0])
    return times["vega"], times["torch"], len(mats), sum(torch.Size(s).numel() for s in mats)


HOST_TENSORS = 1000


def host_costs() -> dict[str, float]:
    """What a step costs around its kernels, a tensor: each step timed on 1,000 parameters
    of one element (where the kernels' own work is a few nanoseconds), divided by 1,000.
    Label -> seconds a tensor."""
    shapes = [(1,)] * HOST_TENSORS
    _, grads = _tensors(shapes)
    fns = {"vega AdamW": vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3).step,
           "vega AdamW + unscale, finite check, clip, skip": vega.optim.AdamW(
               _leaves(shapes, grads), lr=1e-3, max_grad_norm=1.0,
               loss_scale=vega.LossScale.dynamic(init=1.0, growth_interval=10**9)).step,
           "torch AdamW fused": torch.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                                  fused=True).step}
    return {label: secs / HOST_TENSORS for label, secs in race(fns, budget=3.0).items()}


def report_host(costs: dict[str, float], say) -> None:
    say(f"== the cost of a step around its kernels ({HOST_TENSORS:,} one-element tensors)")
    for label, secs in costs.items():
        say(f"{label:<60} {1e6 * secs:>10.2f} us a tensor")
    say()


def compile_times() -> tuple[float, float]:
    """Seconds to compile adamw's float32 kernel cold, and to load it from the cache."""
    code = ("import time, vega; from vega import codegen; spec = vega.adamw; "  # (the spec:
            "t = time.perf_counter(); "  # compiled on first use, before the kernel's clock)
            "k = codegen.kernel('c', spec.program()); k.library(('float32',) * 3); "
            "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = {**(native.checkout_env() or os.environ), "VEGA_CACHE_DIR": cache}
        run = [sys.executable, "-c", code]
        cold = float(subprocess.run(run, env=env, capture_output=True, text=True,
                                    check=True).stdout)
        warm = float(subprocess.run(run, env=env, capture_output=True, text=True,
                                    check=True).stdout)
    return cold, warm


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "") or "unknown CPU"
    except OSError:
        return "unknown CPU"


def _caches() -> str:
    """This CPU's caches as the kernel lists them for cpu0: ``L1d 48K, L2 2048K, ...``;
    with how many CPUs share each, where more than one."""
    out = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return "caches unknown"
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            def read(name, entry=entry):
                with open(os.path.join(base, entry, name)) as f:
                    return f.read().strip()
            level, kind, size = read("level"), read("type"), read("size")
            shared = read("shared_cpu_list")
        except OSError:
            continue
        if kind == "Instruction":
            continue
        label = f"L{level}" + ("d" if kind == "Data" else "")
        n = sum(int(b) - int(a) + 1 if "-" in part else 1
                for part in shared.split(",") for a, _, b in [part.partition("-")])
        out.append(f"{label} {size}" + (f" (shared by {n} CPUs)" if n > 1 else ""))
    return ", ".join(out) or "caches unknown"


def _machine() -> str:
    return (f"{_cpu_model()}; {_caches()}; {torch.get_num_threads()} threads; "
            f"torch {torch.__version__}, vega {vega.__version__}")


BF16_STATE = "vega AdamW, bfloat16 state"
Q8_STATE = "vega AdamW, 8-bit state"
ADAMW_BYTES = {"vega AdamW": ("adamw", False), "torch AdamW fused": ("adamw", False),
               "vega AdamW + unscale, finite check, clip, skip": ("adamw", True),
               BF16_STATE: ("adamw", False, 2), Q8_STATE: ("adamw", False, 1)}


def eight_bit_rows(shapes, grads) -> dict:
    """8-bit AdamW: vega's, torchao's ``AdamW8bit`` and bitsandbytes' ``AdamW8bit`` where
    they are installed (``pip install -e '.[compare]'``) and run on the CPU, and vega's
    float32-state step, raced: label -> median seconds, NaN for one that is missing or
    fails (its label says why); and ``(... first step)``: each one's first step, which
    for torchao includes compiling its kernels."""
    import logging
    import warnings
    fns, firsts, out = {}, {}, {}
    fns["vega AdamW, float32 state"] = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3).step
    fns[Q8_STATE] = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                     state_dtype=torch.uint8).step
    for label, module, path in (("torchao AdamW8bit", "torchao.optim", "AdamW8bit"),
                                ("bitsandbytes AdamW8bit", "bitsandbytes.optim", "AdamW8bit")):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                logging.disable(logging.WARNING)  # (their import says which GPU kernels miss)
                try:
                    cls = getattr(__import__(module, fromlist=[path]), path)
                finally:
                    logging.disable(logging.NOTSET)
                opt = cls(_leaves(shapes, grads), lr=1e-3)
                t0 = time.perf_counter()
                opt.step()
                firsts[label] = time.perf_counter() - t0
            fns[label] = opt.step
        except Exception as err:  # not installed, or not on this CPU: the row says so
            why = "not installed" if isinstance(err, ImportError) else type(err).__name__
            out[f"{label} ({why})"] = float("nan")
    out.update(race(fns, budget=6.0, min_rounds=3))
    for label, secs in firsts.items():
        out[f"({label}: first step, compiling included)"] = secs
    return out


def measure(quick: bool, compile_torch: bool, bound: Stream | None = None) -> dict:
    """One run of the comparison: per parameter set, its parameter count, the AdamW rows
    (label -> median seconds) and the other optimizers' rows; with ``bound``, raced with
    each table's rows (and the bytes one call of it moves)."""
    small = 200 if quick else 1000
    sets = {"GPT-2-like (40M params, 51 tensors)": gpt2_like(),
            f"many-small ({small:,} tensors <= 10k)": many_small(small)}
    out = {}
    for title, shapes in sets.items():
        _, grads = _tensors(shapes)
        checks: dict = {}
        # torch.compile of 1,000 tensors takes minutes on 2 cores: the large set only
        rows = adamw_rows(shapes, grads, compile_torch=compile_torch and not quick
                          and len(shapes) < 100, bound=bound, checks=checks)
        names = [n for n in OTHERS if not quick or n in ("sgd", "lamb")]
        out[title] = {"nparams": sum(torch.Size(s).numel() for s in shapes), "rows": rows,
                      "others": other_rows(shapes, grads, names, bound, checks),
                      "apart": checks,
                      "muon": muon_rows(shapes, grads, checks)
                      if not quick and any(len(s) == 2 for s in shapes) else None,
                      "eight_bit": eight_bit_rows(shapes, grads)
                      if not quick and len(shapes) < 100 else None,
                      "bound_bytes": bound.nbytes if bound is not None else 0,
                      "read_bytes": bound.read_bytes if bound is not None else 0}
    return out


def _rate(res: dict, secs: float | None, rate: float) -> float:
    """The bandwidth a row is bounded by: the raced loop's (its bytes over its median
    ``secs``) where it ran, else ``rate`` (measured once at the start of the run)."""
    if secs is None or not secs > 0 or not res.get("bound_bytes"):
        return rate
    return res["bound_bytes"] / secs


def _mixed_bound(res: dict, label: str, nparams: int, rate: float) -> float | None:
    """The fused step's bound with its pass over the gradients (4 bytes a parameter) at the
    read-only rate raced with the rows, the rest at ``rate``: seconds, or None for another
    row or where no read-only loop ran. (A pass that only reads runs below the bound of a
    loop that reads and writes on some machines: the rate a core draws from memory.)"""
    secs = res["rows"].get(READ_BOUND)
    if label not in ADAMW_BYTES or not ADAMW_BYTES[label][1] or not secs or \
            not res.get("read_bytes") or not rate > 0:
        return None
    read_rate = res["read_bytes"] / secs
    return (_adamw_bytes(label) - 4) * nparams / rate + 4 * nparams / read_rate


def _adamw_bytes(label: str) -> int:
    """The bytes a parameter an AdamW row's step moves (``ADAMW_BYTES``)."""
    name, with_prelude, *state_itemsize = ADAMW_BYTES[label]
    return bytes_per_param(name, fused=with_prelude,
                           state_itemsize=state_itemsize[0] if state_itemsize else None)


def report_state_bytes(say) -> None:
    """The bytes of AdamW's state per parameter of each configuration."""
    say("AdamW state, bytes per parameter:")
    for label, nbytes in state_bytes():
        say(f"  {label:<58} {nbytes:>5g}")


def report_apart(checks: dict | None, say) -> None:
    """Each row's parameters after its race against its counterpart's (``apart``); a row
    past ``apart_tol`` (or NaN) called out: its time is not one of the same computation."""
    if not checks:
        return
    say("\nparameters after the races, apart from the counterpart's (max |difference| / "
        "max |change|): " + ", ".join(f"{label} {value:.1e}" for label, value in checks.items()))
    for label, value in checks.items():
        if not value <= apart_tol(label):
            say(f"!! {label}: its parameters are {value:.1e} apart from its counterpart's, "
                f"beyond {apart_tol(label):g}: its ratio compares two computations")


def report(run: dict, rate: float, say) -> None:
    """Print one run's tables: each row's median, its ratio, its bytes a parameter and its
    time over the bandwidth bound."""
    for title, res in run.items():
        rows, nparams = res["rows"], res["nparams"]
        say(f"== {title}: {nparams / 1e6:.1f}M parameters")
        table_rate = _rate(res, rows.get(BOUND), rate)
        if BOUND in rows:
            say(f"bandwidth bound raced with the AdamW rows: {table_rate / 1e9:.1f} GB/s "
                f"(its median call, {1e3 * rows[BOUND]:.2f} ms for "
                f"{res['bound_bytes'] / 1e6:.0f} MB)")
        if rows.get(READ_BOUND) and res.get("read_bytes"):
            read_rate = res["read_bytes"] / rows[READ_BOUND]
            say(f"a read-only pass raced with them: {read_rate / 1e9:.1f} GB/s")
        fused = rows["torch AdamW fused"]
        say(f"{'AdamW step':<60} {'median ms':>10} {'/ torch fused':>14}   bytes and bound")
        for label, secs in rows.items():
            if label in (FUNCTIONAL_FUSED, BOUND, READ_BOUND):
                continue
            if label.startswith("("):
                say(f"{label:<60} {secs:>10.1f} s")
                continue
            if math.isnan(secs):  # a library that is not installed
                say(f"{label:<60} {'-':>10} {'-':>14}")
                continue
            alone = label == FUNCTIONAL  # its ratio: to torch's fused step in its own race
            base = rows[FUNCTIONAL_FUSED] if alone else fused
            note = ""
            if label in ADAMW_BYTES:
                note = "   " + _bound_note(secs, _adamw_bytes(label), nparams,
                                           table_rate)
                mixed = _mixed_bound(res, label, nparams, table_rate)
                if mixed:
                    note += f"; {secs / mixed:.2f}x with its gradient pass at the read rate"
            say(f"{label:<60} {1e3 * secs:>10.2f} {secs / base:>13.2f}x" + "*" * alone + note)
        say(f"* new parameters and state each step, as optax's pure row; raced with torch's "
            f"fused step "
            f"alone ({1e3 * rows[FUNCTIONAL_FUSED]:.2f} ms there)")
        ours_fused = rows["vega AdamW + unscale, finite check, clip, skip"]
        composite = rows["torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW"]
        say(f"vega's fused step is {composite / ours_fused:.2f}x faster than torch's "
            "GradScaler + clip + fused AdamW composite")
        say(f"\n{'optimizer':<10} {'vega ms':>9}   {'counterpart':<40} {'ms':>9} {'speed-up':>9}"
            "   vega's bytes and bound")
        for name, ours, label, theirs, bsecs in res["others"]:
            note = _bound_note(ours, bytes_per_param(name, OTHERS[name][0]), nparams,
                               _rate(res, bsecs, rate))
            if math.isnan(theirs):  # the counterpart's library is not installed
                say(f"{name:<10} {1e3 * ours:>9.2f}   {label:<40} {'-':>9} {'-':>9}   {note}")
            else:
                say(f"{name:<10} {1e3 * ours:>9.2f}   {label:<40} {1e3 * theirs:>9.2f} "
                    f"{theirs / ours:>8.2f}x   {note}")
        if res.get("eight_bit"):
            q8 = res["eight_bit"]
            say(f"\n{'8-bit AdamW (state: 2.03 B/param; float32: 8)':<60} {'median ms':>10} "
                f"{'/ vega 8-bit':>14}")
            for label, secs in q8.items():
                if label.startswith("("):
                    say(f"{label:<60} {secs:>10.1f} s")
                elif math.isnan(secs):
                    say(f"{label:<60} {'-':>10}")
                else:
                    say(f"{label:<60} {1e3 * secs:>10.2f} {secs / q8[Q8_STATE]:>13.2f}x")
        report_apart(res.get("apart"), say)
        if res.get("muon"):
            ours, theirs, count, nmat = res["muon"]
            say(f"\n{MUON} ({count} matrices, {nmat / 1e6:.1f}M parameters; Newton-Schulz in "
                f"bfloat16): vega {1e3 * ours:.1f} ms, torch.optim.Muon {1e3 * theirs:.1f} ms, "
                f"vega / torch {ours / theirs:.2f}x")
        say()


def ratios(run: dict, rate: float) -> dict:
    """The figures a repeated run summarizes: (set, what) -> a number."""
    out = {}
    for title, res in run.items():
        rows, nparams = res["rows"], res["nparams"]
        fused = rows["torch AdamW fused"]
        table_rate = _rate(res, rows.get(BOUND), rate)
        for label, secs in rows.items():
            if label.startswith("(") or label == FUNCTIONAL_FUSED or math.isnan(secs):
                continue
            base = rows[FUNCTIONAL_FUSED] if label == FUNCTIONAL else fused
            out[(title, f"{label} / torch fused")] = secs / base
            if label in ADAMW_BYTES and table_rate > 0:
                out[(title, f"{label} / bound")] = secs / (
                    _adamw_bytes(label) * nparams / table_rate)
                mixed = _mixed_bound(res, label, nparams, table_rate)
                if mixed:
                    out[(title, f"{label} / bound, gradient pass at the read rate")] = \
                        secs / mixed
        composite = rows["torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW"]
        out[(title, "composite / vega fused step")] = composite / rows[
            "vega AdamW + unscale, finite check, clip, skip"]
        if res.get("muon"):
            out[(title, "muon: vega / torch.optim.Muon")] = res["muon"][0] / res["muon"][1]
        for label, secs in (res.get("eight_bit") or {}).items():
            if not label.startswith("(") and not math.isnan(secs) and label != Q8_STATE:
                out[(title, f"8-bit: {label} / vega 8-bit")] = \
                    secs / res["eight_bit"][Q8_STATE]
        for name, ours, _, theirs, bsecs in res["others"]:
            if not math.isnan(theirs):
                out[(title, f"{name}: speed-up")] = theirs / ours
            row_rate = _rate(res, bsecs, rate)
            if row_rate > 0:
                out[(title, f"{name} / bound")] = ours / (
                    bytes_per_param(name, OTHERS[name][0]) * nparams / row_rate)
    return out


def main(quick: bool = False, compile_torch: bool = True, out=None, repeat: int = 1) -> int:
    out = out or sys.stdout

    def say(text=""):
        print(text, file=out, flush=True)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat={repeat!r} must be a positive integer")
    say(f"vega bench on {_machine()}")
    native.module(wait=True)  # built now if need be: no row is timed while it builds
    say(native.status())
    cold, warm = compile_times()
    say(f"spec compile: cold {cold:.2f} s, from the cache {1e3 * warm:.1f} ms")
    report_state_bytes(say)
    summary: dict = {}
    for k in range(repeat):
        rate, loop = bandwidth()
        say(f"\nbandwidth bound{f' (run {k + 1} of {repeat})' if repeat > 1 else ''}: "
            + (f"{rate / 1e9:.1f} GB/s, an AdamW-like float32 loop over 256 MB ({loop} "
               f"split), {STREAM_BYTES} B an element, the best of 7 calls; the tables "
               "race the same loop with their rows, and bound each row by its median "
               "there" if rate > 0 else loop) + "\n")
        run = measure(quick, compile_torch, Stream(loop))
        report(run, rate, say)
        costs = host_costs()
        report_host(costs, say)
        for key, value in ratios(run, rate).items():
            summary.setdefault(key, []).append(value)
        for label, secs in costs.items():
            summary.setdefault(("step cost around the kernels",
                                f"{label}: us a tensor"), []).append(1e6 * secs)
    if repeat > 1:
        say(f"== {repeat} runs: median [min, max] of each ratio")
        for (title, what), values in summary.items():
            say(f"{title[:20]:<20} {what:<68} {statistics.median(values):>7.2f} "
                f"[{min(values):.2f}, {max(values):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
