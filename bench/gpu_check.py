"""vega on a CUDA GPU, in one run: correctness against the reference backend, a tensor past
2**31 elements, launches per step, host synchronizations, CUDA graphs, torch.compile, and
AdamW bandwidth against torch's fused AdamW (with the launches' warps a program varied).

Run by bench/gpu_check.sh (from the repository root), or alone: ``python bench/gpu_check.py``.
Results: a table on stdout and $OUT/vega_gpu_check.json. VEGA_CHECK_DRY=1 runs the logic on
the CPU under Triton's interpreter with tiny sizes (a smoke test of this script, not of the
GPU; ``tests/test_bench_gpu_check.py`` runs it).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings

DRY = os.environ.get("VEGA_CHECK_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

DEV = "cpu" if DRY else "cuda"
START = time.time()
BUDGET = float(os.environ.get("VEGA_PY_BUDGET", "330"))
OUT = os.environ.get("OUT") or "."
PEAK = float(os.environ.get("VEGA_PEAK_TBPS", "4.8")) * 1e12
RESULTS: dict = {"sections": {}}


def left() -> float:
    return BUDGET - (time.time() - START)


def say(*a):
    print(f"[{time.time() - START:6.1f}s]", *a, flush=True)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def section(name, need_s):
    """Run the section if at least need_s seconds of the budget are left; record its outcome."""
    def deco(fn):
        def run():
            if left() < need_s:
                say(f"== {name}: SKIPPED (budget: {left():.0f}s left, needs ~{need_s}s)")
                RESULTS["sections"][name] = "skipped (time)"
                return
            say(f"== {name}")
            t = time.time()
            try:
                fn()
                RESULTS["sections"][name] = f"ran in {time.time() - t:.1f}s"
            except Exception as err:  # noqa: BLE001 (one section must not hide the others)
                tb = traceback.format_exc()
                say(f"   {name} FAILED: {type(err).__name__}: {str(err)[:600]}")
                print("\n".join(tb.splitlines()[-12:]), flush=True)
                RESULTS["sections"][name] = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
            finally:
                gc.collect()
                if DEV == "cuda":
                    torch.cuda.empty_cache()
        return run
    return deco


import vega  # noqa: E402
from vega import codegen  # noqa: E402
from vega.codegen import triton_runtime as tr  # noqa: E402
from vega.runtime.tree import flatten, leaf_paths, state_names  # noqa: E402

# -- parameter sets ------------------------------------------------------------------------


def gpt2(d=768, vocab=50257, layers=12):
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(vocab, d), (1024, d)] + block * layers + [(d,), (d,)]


def llama(d, layers, ffn, vocab, kv):
    block = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]
    return [(vocab, d)] + block * layers + [(d,)]


SETS = {  # name: (label, shapes)
    "10M": ("GPT-2-shaped d=256 (148 tensors)", lambda: gpt2(256, 16384)),
    "124M": ("GPT-2 small (148 tensors)", gpt2),
    "1.2B": ("Llama-3.2-1B-shaped (146 tensors)", lambda: llama(2048, 16, 8192, 128256, 512)),
}
if DRY:
    SETS = {"tiny": ("tiny GPT-2-shaped", lambda: gpt2(16, 64, 2))}


def numel(shapes):
    return sum(math.prod(s) for s in shapes)


def make(shapes, seed=0, dtype=torch.float32, scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(s, device=DEV, generator=gen) * scale).to(dtype) for s in shapes]


def tree(xs):
    return {f"p{i}": x for i, x in enumerate(xs)}


# -- 0. the card ---------------------------------------------------------------------------


@section("device", 5)
def device_info():
    import triton

    from vega.codegen.c import native
    native.module(wait=True)  # (built now, as a class step would use it: no row waits for it)
    info = {"torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0], "native": native.status()}
    if DEV == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, sms=p.multi_processor_count, mem_gb=round(p.total_memory / 2**30),
                    cuda=torch.version.cuda, cc=f"{p.major}.{p.minor}")
        n = 1 << 29  # 2 GiB of float32: well past the L2
        x = torch.empty(n, device=DEV).uniform_()
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        sync()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            y.copy_(x)
        b.record()
        sync()
        ms = a.elapsed_time(b) / 10
        info["copy_TBps"] = round(2 * 4 * n / (ms * 1e-3) / 1e12, 3)
        del x, y
    RESULTS["device"] = info
    say("  ", info)


# -- 1. correctness against the reference backend ------------------------------------------


def leaves(params, state):
    """(name, tensor) of each parameter ("p.<key>") and each state leaf ("mu.<key>",
    "step"), as vega.save names them (None leaves left out)."""
    for names, tree in ((["p." + n for n in leaf_paths(params)], params),
                        (state_names(state), state)):
        yield from zip(names, (v for v in flatten(tree)[0] if v is not None), strict=True)


def compare(tri, ref, dtype):
    """(worst relative error, failures) of tri against ref, leaf by leaf."""
    rtol, atol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2),
                  torch.float64: (1e-12, 1e-14)}[dtype]
    worst, bad = 0.0, []
    for (name, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs "
                       f"{tuple(b.shape)} {b.dtype}")
            continue
        if name == "step":
            if not torch.equal(a, b):
                bad.append(f"step {a.tolist()} vs {b.tolist()}")
            continue
        if b.numel() == 0:
            continue
        a64, b64 = a.double(), b.double()
        scale = b64.abs().nan_to_num(posinf=0, neginf=0).max().item()
        err = ((a64 - b64).abs().nan_to_num(nan=0.0).max().item()) / max(scale, 1e-30)
        nan_ok = torch.equal(a64.isnan(), b64.isnan())
        worst = max(worst, err)
        try:
            torch.testing.assert_close(a64, b64, rtol=rtol, atol=atol * max(1.0, scale),
                                       equal_nan=True)
        except AssertionError:
            bad.append(f"{name}: rel err {err:.2e}{'' if nan_ok else ' (NaN pattern differs)'}")
    return worst, bad


def same_bits(x, y):
    return all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for (_, a), (_, b) in zip(leaves(*x), leaves(*y)))


def correctness_params(dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEV)
    # (dry: the interpreter's programs take 4096 elements each, and cost their time each:
    # 4097 still ends in a part of a block)
    big = randn(4099 * 3 + 1 if not DRY else 4097 + 1)
    p = {"vector": randn(1000), "matrix": randn(37, 41), "scalar": randn(()), "one": randn(1),
         "empty": randn(0, 3), "transposed": randn(9, 13).t(), "factored": randn(256, 384),
         "batch": randn(3, 130, 200), "odd": randn(4097 * 5 + 3),
         "misaligned": big[1:]}  # a view 4 bytes past a 16-byte boundary
    if DRY:
        p.update(factored=randn(12, 20), batch=randn(2, 5, 7), odd=randn(4097 + 3))
    return p


def grads_like(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: (scale * torch.randn(v.shape, generator=gen, dtype=torch.float64))
            .to(v.dtype).to(DEV) for k, v in params.items()}


CASES = [("adamw", {}), ("lamb", {}), ("sgd", {"momentum": 0.9}),
         ("adafactor", {"min_dim_size_to_factor": 8.0, "use_momentum": True}),
         ("adafactor", {"min_dim_size_to_factor": 8.0, "factored": False})]


@section("correctness vs reference", 60)
def correctness():
    rows = []
    for name, hypers in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for fused in (False, True):
                spec = vega.builtin(name)
                opts = {"max_grad_norm": 1.0, "skip_nonfinite": True} if fused else {}
                params = correctness_params(dtype, 0)
                ref = (params, spec.init(params, **hypers))
                tri = (params, spec.init(params, **hypers))
                worst, bad, skip_ok = 0.0, [], True
                for step in range(4):
                    grads = grads_like(params, step)
                    if fused and step == 2:
                        grads["matrix"][5, 7] = float("nan")
                    ref = spec.step(*ref[:1], grads, ref[1], backend="reference", **opts, **hypers)
                    before = tri
                    tri = spec.step(*tri[:1], grads, tri[1], backend="triton", **opts, **hypers)
                    w, b = compare(tri, ref, dtype)
                    worst = max(worst, w)
                    bad += [f"step {step} {x}" for x in b]
                    if fused and step == 2:
                        skip_ok = same_bits(tri, before)
                ok = not bad and skip_ok
                rows.append({"spec": name, "hypers": hypers, "dtype": str(dtype), "fused": fused,
                             "worst_rel_err": worst, "ok": ok, "skip_bitwise": skip_ok,
                             "failures": bad[:5]})
                say(f"   {'ok  ' if ok else 'FAIL'} {name:9} {str(hypers):52.52} "
                    f"{str(dtype)[6:]:8} {'fused' if fused else 'plain'}  worst rel err "
                    f"{worst:.1e}" + ("" if skip_ok else "  SKIPPED STEP CHANGED STATE")
                    + (f"  {bad[:2]}" if bad else ""))
    # clipping without skipping, and a NaN gradient: the reference's coefficient is
    # max_norm / torch.maximum(NaN, max_norm) = NaN (every parameter becomes NaN); Triton's
    # read_prelude uses tl.maximum (PTX max: the non-NaN operand on a GPU, np.maximum's NaN
    # under the interpreter)
    spec = vega.builtin("adamw")
    params = correctness_params(torch.float32, 0)
    grads = grads_like(params, 0)
    grads["matrix"][5, 7] = float("nan")
    ref = spec.step(params, grads, spec.init(params), backend="reference", max_grad_norm=1.0)
    tri = spec.step(params, grads, spec.init(params), backend="triton", max_grad_norm=1.0)
    nan_ref = sum(int(v.isnan().sum()) for v in ref[0].values())
    nan_tri = sum(int(v.isnan().sum()) for v in tri[0].values())
    rows.append({"spec": "adamw", "hypers": {"max_grad_norm": 1.0, "nan_grad": True},
                 "ok": nan_ref == nan_tri, "nan_params_reference": nan_ref,
                 "nan_params_triton": nan_tri})
    say(f"   {'ok  ' if nan_ref == nan_tri else 'DIFF'} adamw clip (no skip), one NaN gradient: "
        f"NaN parameters reference {nan_ref}, triton {nan_tri}")
    RESULTS["correctness"] = rows


# -- 2. past 2**31 elements ----------------------------------------------------------------


@section("tensor past 2**31 elements", 30)
def int64_offsets():
    n = (1 << 31) + 4099 if not DRY else 3 * 4096 + 7
    need = n * 4 * 4 * 1.15
    if DEV == "cuda" and torch.cuda.mem_get_info()[0] < need:
        say(f"   skipped: needs {need / 2**30:.0f} GiB free")
        return
    gen = torch.Generator(device=DEV).manual_seed(3)
    p = torch.randn(n, device=DEV, generator=gen)
    g = torch.randn(n, device=DEV, generator=gen) * 1e-3
    state = vega.adamw_init({"w": p})
    k = 1 << 20 if not DRY else 100
    mid = slice((1 << 31) - k // 2, (1 << 31) + k // 2) if not DRY else slice(4096 - 50, 4096 + 50)
    idx = [slice(0, k), mid, slice(n - k, n)]
    # the reference on slices (AdamW is elementwise): the same first step from the same state
    ref = []
    for s in idx:
        sp = {"w": p[s].clone()}
        ref.append(vega.adamw_step(sp, {"w": g[s].clone()}, vega.adamw_init(sp), lr=1e-3,
                                   backend="reference")[0]["w"])
    # the fused prelude's sum of squares over all of g, against a chunked float64 sum
    from vega.codegen.record import Pre, make_pre
    kern = codegen.kernel("triton", vega.builtin("adamw").program())
    pre = make_pre(torch.device(DEV), None, 1.0, True)
    kern.prelude([g], pre)
    want = sum(g[i:i + (1 << 28)].double().square().sum() for i in range(0, n, 1 << 28))
    vega.adamw_step({"w": p}, {"w": g}, state, lr=1e-3, donate=True, backend="triton")
    sync()
    errs = [((p[s] - r).abs().max() / r.abs().max()).item() for s, r in zip(idx, ref)]
    sumsq_rel = abs(pre[Pre.SUM_SQ].item() - want.item()) / want.item()
    RESULTS["int64"] = {"numel": n, "rel_err_head_mid_tail": errs,
                        "prelude_sumsq_rel_err": sumsq_rel,
                        "nonfinite_count": pre[Pre.NONFINITE].item()}
    ok = max(errs) < 1e-6 and sumsq_rel < 1e-9 and pre[Pre.NONFINITE].item() == 0
    say(f"   {'ok' if ok else 'FAIL'}: {n} elements; head/mid/tail rel err "
        f"{['%.1e' % e for e in errs]}; prelude sum of squares rel err {sumsq_rel:.1e}")


# -- shared: steps to measure --------------------------------------------------------------


def vega_steps(params, grads):
    """(name, bytes per element, step) for vega; the state lives in the closures."""
    P, G = tree(params), tree(grads)
    st = vega.adamw_init(P)
    lr_t = torch.tensor(1e-4, device=DEV)

    def plain():
        vega.adamw_step(P, G, st, lr=1e-4, donate=True, backend="triton")

    def plain_tensor_lr():
        vega.adamw_step(P, G, st, lr=lr_t, donate=True, backend="triton")

    def fused():
        vega.adamw_step(P, G, st, lr=1e-4, donate=True, backend="triton", max_grad_norm=1.0,
                        skip_nonfinite=True)
    return [("vega plain", 28, plain), ("vega plain, 0-d tensor lr", 28, plain_tensor_lr),
            ("vega clip+skip", 32, fused)], st


def torch_leaves(params, grads):
    leaves = [torch.nn.Parameter(p) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g
    return leaves


# -- 3. launches per step ------------------------------------------------------------------


def gpu_events(fn, steps=1):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [n for n in names if n.startswith(("Memcpy", "Memset"))]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset"))]
    return len(kernels) / steps, len(copies) / steps, kernels


@section("launches per step", 40)
def launches():
    if DEV != "cuda":
        return
    rows = []
    for label, shapes in [("148 tensors", gpt2(256, 16384)),
                          ("3 tensors", [(4096, 256), (256,), (77,)])]:
        params, grads = make(shapes), make(shapes, 1, scale=1e-3)
        steps, _ = vega_steps(params, grads)
        ws = torch_leaves([p.clone() for p in params], grads)
        opt = vega.optim.AdamW(ws, lr=1e-4, backend="triton", max_grad_norm=1.0)
        opt_ls = vega.optim.AdamW(ws, lr=1e-4, backend="triton", max_grad_norm=1.0,
                                  loss_scale=vega.LossScale.dynamic(device=DEV))
        tws = torch_leaves([p.clone() for p in params], grads)
        topt = torch.optim.AdamW(tws, lr=1e-4, fused=True)

        def torch_clip(tws=tws, topt=topt):
            torch.nn.utils.clip_grad_norm_(tws, 1.0, foreach=True)
            topt.step()
        todo = [(n, f) for n, _, f in steps] + [
            ("vega AdamW class, max_grad_norm", opt.step),
            ("vega AdamW class, max_grad_norm + LossScale", opt_ls.step),
            ("torch AdamW fused", topt.step), ("torch clip_grad_norm_ + AdamW fused", torch_clip)]
        for name, fn in todo:
            for _ in range(3):
                fn()
            k, c, kn = gpu_events(fn, steps=2)
            rows.append({"set": label, "step": name, "kernels": k, "copies": c,
                         "kernel_names": sorted(set(kn))[:40]})
            say(f"   {label:12} {name:45} kernels/step {k:5.1f}  copies+sets/step {c:4.1f}")
            if name == "vega clip+skip" and label == "148 tensors":
                say("      kernels: " + ", ".join(sorted(set(kn)))[:700])
        del params, grads, steps, ws, tws, opt, opt_ls, topt
    RESULTS["launches"] = rows


# -- 4. host synchronization ---------------------------------------------------------------


@section("host synchronization", 20)
def host_sync():
    if DEV != "cuda":
        return
    shapes = gpt2(256, 16384)
    rows = []

    def check(name, make_fn):
        try:
            check_one(name, make_fn)
        except Exception as err:  # noqa: BLE001 (a step that fails outright: say so, go on)
            torch.cuda.set_sync_debug_mode(0)
            rows.append({"step": name, "warm_sync_free": None,
                         "error": f"{type(err).__name__}: {err}"[:300]})
            say(f"   FAIL {name:50} raised {type(err).__name__}: {str(err)[:200]}")

    def check_one(name, make_fn):
        fn = make_fn()
        with warnings.catch_warnings(record=True) as cold:  # the first step: tables, block maps
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for _ in range(2):
            fn()
        sync()
        err = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
            fn()
        except RuntimeError as e:
            err = str(e).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sync()
        cold_msgs = sorted({str(w.message).splitlines()[0][:120] for w in cold
                            if "synchroniz" in str(w.message)})
        rows.append({"step": name, "warm_sync_free": err is None, "warm_error": err,
                     "cold_first_step_sync_warnings": cold_msgs})
        say(f"   {'ok  ' if err is None else 'SYNC'} {name:50} warm: {err or 'no sync'}; "
            f"first step: {len(cold_msgs)} sync warning(s) {cold_msgs[:2]}")

    def functional(**kw):
        def mk():
            params, grads = make(shapes), make(shapes, 1, scale=1e-3)
            P, G = tree(params), tree(grads)
            st = vega.adamw_init(P)
            return lambda: vega.adamw_step(P, G, st, donate=True, backend="triton", **kw)
        return mk

    def cls(**kw):
        def mk():
            ws = torch_leaves(make(shapes), make(shapes, 1, scale=1e-3))
            opt = vega.optim.AdamW(ws, backend="triton", **kw)
            return opt.step
        return mk
    sched = vega.schedule.warmup_cosine_decay(0.0, 1e-3, 10, 100)
    check("functional, float lr", functional(lr=1e-4))
    check("functional, 0-d cuda tensor lr", functional(lr=torch.tensor(1e-4, device=DEV)))
    check("functional, clip+skip", functional(lr=1e-4, max_grad_norm=1.0, skip_nonfinite=True))
    check("functional, clip+skip, schedule lr", functional(lr=sched, max_grad_norm=1.0,
                                                            skip_nonfinite=True))
    check("class AdamW, max_grad_norm", cls(lr=1e-4, max_grad_norm=1.0))
    check("class AdamW, schedule lr + clip", cls(lr=sched, max_grad_norm=1.0))
    check("class AdamW, LossScale.dynamic(device='cuda')",
          cls(lr=1e-4, max_grad_norm=1.0, loss_scale=vega.LossScale.dynamic(device=DEV)))
    check("class AdamW, LossScale.dynamic() (CPU default)",
          cls(lr=1e-4, max_grad_norm=1.0, loss_scale=vega.LossScale.dynamic()))
    check("class LAMB, clip+skip", lambda: vega.optim.LAMB(
        torch_leaves(make(shapes), make(shapes, 1, scale=1e-3)), backend="triton",
        max_grad_norm=1.0, skip_nonfinite=True).step)
    RESULTS["sync"] = rows


# -- 5. CUDA graphs ------------------------------------------------------------------------


@section("CUDA graph capture and replay", 20)
def graphs():
    if DEV != "cuda":
        return
    shapes = gpt2(128, 4096, 2)
    params, grads = make(shapes), make(shapes, 1, scale=1e-2)
    out = {}

    def functional_pair():
        P = [tree([p.clone() for p in params]) for _ in range(2)]
        S = [vega.adamw_init(x) for x in P]
        G = tree(grads)
        return [(lambda P=P[i], S=S[i]: vega.adamw_step(
            P, G, S, lr=1e-3, donate=True, backend="triton", max_grad_norm=1.0,
            skip_nonfinite=True)) for i in range(2)], P, S

    def class_pair():
        W = [torch_leaves([p.clone() for p in params], grads) for _ in range(2)]
        opts = [vega.optim.AdamW(w, lr=1e-3, backend="triton", max_grad_norm=1.0,
                                 loss_scale=vega.LossScale.dynamic(2.0**4, device=DEV))
                for w in W]
        return [o.step for o in opts], W, opts

    def pinned_batch_freed():
        # what a DataLoader(pin_memory=True) leaves behind: a pinned buffer, copied from without
        # blocking and freed, so the host allocator holds an event to query on its next allocation
        x = torch.randn(1 << 20).pin_memory()
        y = x.to(DEV, non_blocking=True)
        del x, y
        return functional_pair()

    for label, pair in [("functional clip+skip", functional_pair),
                        ("class AdamW + LossScale", class_pair),
                        ("functional clip+skip, after a pinned batch was freed",
                         pinned_batch_freed)]:
        try:
            (eager, graphed), A, B = pair()
            for _ in range(4):
                eager()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                graphed()  # warm-up: step 1
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graphed()  # captured, not run
            for _ in range(3):
                g.replay()  # steps 2, 3, 4
            sync()
            if label.startswith("functional"):
                def flat(k):
                    return [*A[k].values(),
                            *(t for f, d in B[k].items() if f != "step" for t in d.values()),
                            B[k]["step"]]
                a, b = flat(0), flat(1)
            else:  # the class
                a = [w.detach() for w in A[0]] + [t for w in A[0] for t in B[0].state[w].values()]
                b = [w.detach() for w in A[1]] + [t for w in A[1] for t in B[1].state[w].values()]
            same = all(torch.equal(x, y) for x, y in zip(a, b))
            if label.startswith("class"):  # a replaced (not mutated) state: the scale
                out.setdefault("notes", []).append(
                    f"{label}: loss scale good_steps eager {int(B[0].loss_scale.good_steps)} vs "
                    f"graph {int(B[1].loss_scale.good_steps)} (replays do not feed a replaced "
                    "LossScale back)")
            worst = max(((x.double() - y.double()).abs().max()
                         / y.double().abs().max().clamp_min(1e-30)).item()
                        for x, y in zip(a, b) if x.numel() and x.is_floating_point())
            out[label] = {"captured": True, "bitwise_equal_to_eager": same, "worst_rel": worst}
            say(f"   {'ok  ' if same else 'DIFF'} {label}: 4 steps eager vs 1 + 3 graph replays: "
                f"bitwise {same}, worst rel {worst:.1e}")
        except Exception as err:  # noqa: BLE001
            out[label] = {"captured": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
            say(f"   FAIL {label}: {type(err).__name__}: {str(err)[:300]}")
            with contextlib.suppress(Exception):
                sync()
    RESULTS["graphs"] = out


# -- 6. torch.compile ----------------------------------------------------------------------


@section("torch.compile(fullgraph=True)", 60)
def compiled():
    import torch._dynamo
    shapes = [(300, 64), (64,), (7, 3), (1000,), (129, 33), ()]
    params, grads = make(shapes), make(shapes, 1, scale=1e-2)
    sched = vega.schedule.warmup_cosine_decay(0.0, 1e-3, 3, 10)
    out = {}
    for donate in (False, True):
        def step(P, G, S):
            return vega.adamw_step(P, G, S, lr=sched, max_grad_norm=1.0, skip_nonfinite=True,
                                   backend="triton", donate=donate)
        torch._dynamo.reset()
        cstep = torch.compile(step, fullgraph=True)
        E = tree([p.clone() for p in params])
        C = tree([p.clone() for p in params])
        SE, SC = vega.adamw_init(E), vega.adamw_init(C)
        G = tree(grads)
        t = time.time()
        for _ in range(3):
            E, SE = step(E, G, SE)
            C, SC = cstep(C, G, SC)
        sync()
        compile_s = time.time() - t
        same = same_bits((C, SC), (E, SE))
        w, bad = compare((C, SC), (E, SE), torch.float32)
        k = c = None
        names = []
        if DEV == "cuda":
            box = {"C": C, "SC": SC}

            def one():
                box["C"], box["SC"] = cstep(box["C"], G, box["SC"])
            k, c, names = gpu_events(one, steps=2)
        out["donate" if donate else "pure"] = {"bitwise_equal_to_eager": same, "worst_rel": w,
                                               "compile_s": compile_s, "kernels": k, "copies": c,
                                               "kernel_names": sorted(set(names))[:40]}
        say(f"   {'ok  ' if not bad else 'DIFF'} donate={donate}: bitwise equal to eager {same} "
            f"(worst rel {w:.1e}); first 3 calls {compile_s:.0f}s; kernels/step {k} "
            f"copies/step {c}")
        if names:
            say("      kernels: " + ", ".join(sorted(set(names)))[:600])
    if DEV == "cuda" and left() > 60:
        torch._dynamo.reset()

        def pure(P, G, S):
            return vega.adamw_step(P, G, S, lr=1e-3, max_grad_norm=1.0, skip_nonfinite=True,
                                   backend="triton")
        cg = torch.compile(pure, fullgraph=True, mode="reduce-overhead")
        E = tree([p.clone() for p in params])
        C = tree([p.clone() for p in params])
        SE, SC = vega.adamw_init(E), vega.adamw_init(C)
        G = tree(grads)
        try:
            for _ in range(5):
                E, SE = pure(E, G, SE)
                C, SC = cg(C, G, SC)
                # (a CUDA graph's outputs are overwritten by its next replay)
                C = {k: v.clone() for k, v in C.items()}
                SC = {f: (v.clone() if f == "step" else {k: x.clone() for k, x in v.items()})
                      for f, v in SC.items()}
            sync()
            w, bad = compare((C, SC), (E, SE), torch.float32)
            out["reduce-overhead"] = {"ok": not bad, "worst_rel": w}
            say(f"   {'ok  ' if not bad else 'DIFF'} mode='reduce-overhead' (CUDA graphs): "
                f"5 steps, worst rel {w:.1e}")
        except Exception as err:  # noqa: BLE001
            out["reduce-overhead"] = {"ok": False,
                                      "error": f"{type(err).__name__}: {str(err)[:300]}"}
            say(f"   FAIL mode='reduce-overhead': {type(err).__name__}: {str(err)[:300]}")
    RESULTS["compile"] = out


# -- 7. bandwidth --------------------------------------------------------------------------


@contextlib.contextmanager
def kernel_variant(warps):
    """vega's Triton launches with ``warps`` warps a program: an elementwise launch's BLOCK
    follows (32 threads a warp, 16 bytes a thread: ``triton_runtime.block_size``), so 4 warps
    give 512 float32 elements a program, 8 give 1024, 16 give 2048."""
    real = tr.WARPS_GPU
    tr.WARPS_GPU = warps
    try:
        yield
    finally:
        tr.WARPS_GPU = real


VARIANTS = [(f"{w} warps{' (as shipped)' if w == tr.WARPS_GPU else ''}", w) for w in (8, 4, 16)]


def time_step(fn, rounds=5, steps=10):
    """(median GPU ms per step from CUDA events, host ms per step)."""
    for _ in range(3 if not DRY else 1):  # (dry: one step checks the row runs)
        fn()
    sync()
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3, float("nan")
    gpu, host = [], []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        host.append((time.perf_counter() - t) * 1e3 / steps)
        b.synchronize()
        gpu.append(a.elapsed_time(b) / steps)
    return statistics.median(gpu), statistics.median(host)


@section("variants agree", 30)
def variants_agree():
    """Each kernel variant gives the same bits as the generated kernel (fresh inputs, a few
    tensors of odd sizes, all 16-byte aligned)."""
    shapes = [(4099,), (2048 * 3,), (37, 41), (1,), (5000, 3)]
    params, grads = make(shapes), make(shapes, 1)
    outs = {}
    for name, warps in VARIANTS:
        with kernel_variant(warps):
            P = tree([p.clone() for p in params])
            S = vega.adamw_init(P)
            for _ in range(2):
                P, S = vega.adamw_step(P, tree(grads), S, lr=1e-2, backend="triton",
                                       max_grad_norm=1.0, skip_nonfinite=True)
            sync()
            outs[name] = (P, S)
    base = outs[VARIANTS[0][0]]
    res = {}
    for name in outs:
        same = same_bits(outs[name], base)
        w, bad = compare(outs[name], base, torch.float32)
        res[name] = {"bitwise": same, "worst_rel": w}
        say(f"   {'ok  ' if not bad else 'DIFF'} {name:40} bitwise equal to the shipped: {same} "
            f"(rel {w:.1e})")
    RESULTS["variants_agree"] = res


@section("bandwidth", 90)
def bandwidth():
    rows = []
    copy_tbps = RESULTS.get("device", {}).get("copy_TBps")
    for key, (label, shapes_fn) in SETS.items():
        if left() < 45:
            say(f"   {key}: skipped (time)")
            continue
        shapes = shapes_fn()
        n = numel(shapes)
        say(f"   {key}: {label}, {n / 1e6:,.1f}M parameters")
        params, grads = make(shapes), make(shapes, 1, scale=1e-3)

        def report(name, bpe, fn):
            ms, host = time_step(fn)
            gbps = bpe * n / (ms * 1e-3) / 1e9
            row = {"set": key, "params": n, "step": name, "bytes_per_param": bpe, "ms": ms,
                   "host_ms": host, "GBps": gbps, "frac_peak": gbps * 1e9 / PEAK,
                   "frac_copy": gbps / 1e3 / copy_tbps if copy_tbps else None}
            rows.append(row)
            say(f"     {name:46} {ms:8.3f} ms  host {host:6.3f} ms  {gbps:7.0f} GB/s  "
                f"{row['frac_peak']:6.1%} of {PEAK / 1e12:.1f} TB/s"
                + (f"  {row['frac_copy']:6.1%} of copy" if copy_tbps else ""))
            return ms
        steps, st = vega_steps(params, grads)
        for name, bpe, fn in steps:
            report(name, bpe, fn)
        if DEV == "cuda":
            fused = steps[2][2]
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fused()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fused()
                report("vega clip+skip, CUDA graph replay", 32, g.replay)
                del g
            except Exception as err:  # noqa: BLE001
                say(f"     graph capture failed: {type(err).__name__}: {str(err)[:200]}")
        if key != "10M" or DRY:
            for name, warps in VARIANTS[1:]:
                with kernel_variant(warps):
                    report(f"vega plain [{name}]", 28, steps[0][2])
        del steps, st
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
            leaves = torch_leaves(params, grads)
            topt = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.01, fused=True)
            report("torch AdamW fused", 28, topt.step)

            def torch_clip():
                torch.nn.utils.clip_grad_norm_(leaves, 1.0, foreach=True)
                topt.step()
            report("torch clip_grad_norm_(foreach) + AdamW fused", 40, torch_clip)
            del topt, leaves
        del params, grads
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    RESULTS["bandwidth"] = rows


@section("graph after block-map cache eviction (destructive, last)", 20)
def graph_maps():
    """A graph captured over cached block maps (triton_runtime._MAPS), then more than 64 other
    parameter sets stepped (the cache is cleared), the freed memory reused, the graph replayed.
    Expected if the hazard is real: wrong results or an illegal memory access."""
    if DEV != "cuda":
        return
    shapes = [(1000 + 7 * i,) for i in range(5)]
    params, grads = make(shapes), make(shapes, 1, scale=1e-2)
    P = [tree([p.clone() for p in params]) for _ in range(2)]
    S = [vega.adamw_init(x) for x in P]
    G = tree(grads)
    steps = [lambda P=P[i], S=S[i]: vega.adamw_step(P, G, S, lr=1e-3, donate=True,
                                                    backend="triton") for i in range(2)]
    for _ in range(2):
        steps[0]()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        steps[1]()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        steps[1]()
    before = len(tr._MAPS)
    for k in range(70):  # 70 other parameter sets: 70 new block maps, the cache cleared once
        q = {"w": torch.zeros(3000 + k, device=DEV)}
        vega.adamw_step(q, {"w": torch.ones_like(q["w"])}, vega.adamw_init(q), backend="triton")
    sync()
    junk = [torch.full((64,), 2**30, dtype=torch.int32, device=DEV) for _ in range(2000)]
    try:
        g.replay()
        sync()
        same = all(torch.equal(P[0][k], P[1][k]) for k in P[0])
        msg = f"replay after eviction: params equal to eager: {same}"
    except Exception as err:  # noqa: BLE001
        same, msg = False, f"replay after eviction raised {type(err).__name__}: {str(err)[:200]}"
    RESULTS["graph_maps"] = {"maps_before": before, "maps_after": len(tr._MAPS), "ok": same,
                             "msg": msg}
    say(f"   {'ok  ' if same else 'FAIL'} {msg} (block-map cache {before} -> {len(tr._MAPS)})")
    del junk


def summary():
    say("== summary")
    for name, status in RESULTS["sections"].items():
        print(f"   {name:34} {status}")
    bw = RESULTS.get("bandwidth", [])
    for key in SETS:
        by = {r["step"]: r for r in bw if r["set"] == key}
        v, t = by.get("vega plain"), by.get("torch AdamW fused")
        vf, tf = by.get("vega clip+skip"), by.get("torch clip_grad_norm_(foreach) + AdamW fused")
        if v and t:
            print(f"   {key:6} vega plain {v['ms']:.3f} ms ({v['frac_peak']:.0%} of peak) vs "
                  f"torch fused "
                  f"{t['ms']:.3f} ms: vega {t['ms'] / v['ms']:.2f}x"
                  + (f"; clip+skip {vf['ms']:.3f} vs torch clip+fused {tf['ms']:.3f} ms"
                     if vf and tf else ""))
    for r in RESULTS.get("launches", []):
        if r["step"] in ("vega plain", "vega clip+skip", "torch AdamW fused"):
            print(f"   launches/step {r['set']:12} {r['step']:20} kernels {r['kernels']:.0f}, "
                  f"copies+sets {r['copies']:.0f}")
    for r in RESULTS.get("sync", []):
        print(f"   sync-free when warm: {str(r.get('warm_sync_free')):5}  {r['step']}")
    for k, v in RESULTS.get("graphs", {}).items():
        print(f"   CUDA graph {k}: {v}")
    with open(os.path.join(OUT, "vega_gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


if __name__ == "__main__":
    only = set(filter(None, os.environ.get("VEGA_SECTIONS", "").split(",")))
    todo = [("device", device_info), ("correctness", correctness), ("variants", variants_agree),
            ("bandwidth", bandwidth), ("launches", launches), ("sync", host_sync),
            ("graphs", graphs), ("int64", int64_offsets), ("compile", compiled),
            ("graph_maps", graph_maps)]
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (VEGA_CHECK_DRY=1 smoke-tests this script on CPU)")
        sys.exit(2)
    os.makedirs(OUT, exist_ok=True)  # now, not after every section has run (gpu_check.sh's too)
    for key, fn in todo:
        if not only or key in only:
            fn()
    summary()
