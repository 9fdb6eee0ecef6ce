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
from vega.codegen import native

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
}


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


def adamw_rows(shapes, grads, compile_torch=True):
    # the rows of processes of their own first, while this one holds little memory: on a
    # virtual machine, the fresh pages of a pure step cost up to 4x more when the memory
    # of other processes is large (pages the host has to find again)
    alone = {**functional_rows(shapes), **_optax_row(shapes)}
    fns = {}
    opt = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3)
    fns["vega AdamW"] = opt.step
    fused_opt = vega.optim.AdamW(_leaves(shapes, grads), lr=1e-3, max_grad_norm=1.0,
                                 loss_scale=vega.LossScale.dynamic(init=1.0,
                                                                   growth_interval=10**9))
    fns["vega AdamW + unscale, finite check, clip, skip"] = fused_opt.step
    for label, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}),
                      ("fused", {"fused": True})):
        fns[f"torch AdamW {label}"] = torch.optim.AdamW(_leaves(shapes, grads), lr=1e-3,
                                                        **kw).step
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
    rows = race(fns)
    rows.update(alone)
    if compile_secs is not None:
        rows["(torch.compile of AdamW: compile time, not a step)"] = compile_secs
    return rows


def functional_rows(shapes) -> dict:
    """vega's functional AdamW step, pure as optax's (new parameters and state each step),
    raced against torch's fused step in a process of their own, as optax's: the pure
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
                         text=True, timeout=900)
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


def _optax_row(shapes) -> dict:
    """optax's adamw under jax.jit, timed in a process of its own: XLA's worker threads
    keep spinning after a step, and slowed every row timed after them here (by 1.5-2x
    on the many-small set)."""
    secs, = _in_own_process("optax_seconds", shapes, 1)
    if math.isnan(secs):
        return {"optax adamw under jax.jit (not installed)": secs}
    return {"optax adamw under jax.jit (own process)": secs}


def optax_seconds(shapes) -> float:
    """Median seconds of optax's adamw step under jax.jit (NaN without jax and optax)."""
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        return float("nan")
    tx = optax.adamw(1e-3)
    params = [jnp.asarray(p.numpy()) for p in _tensors(shapes)[0]]
    grads = [jnp.asarray(g.numpy()) for g in _tensors(shapes)[1]]
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    box = [params, state]

    def run():
        box[0], box[1] = step(box[0], box[1], grads)
        jax.block_until_ready(box[0])
    return race({"optax": run})["optax"]


def other_rows(shapes, grads, names):
    rows = []
    for name in names:
        if name not in vega.builtin_names() or name not in OTHERS:
            continue
        hypers, module, cls, kwargs = OTHERS[name]
        opt = vega.builtin(name).optimizer(_leaves(shapes, grads), **hypers)
        try:
            mod = torch.optim if module == "torch" else __import__(module)
            ref_cls = getattr(mod, cls)
            extra = {"foreach": True} if module == "torch" else {}
            ref = ref_cls(_leaves(shapes, grads), **kwargs, **extra)
            label = f"{'torch.optim' if module == 'torch' else module}.{cls}" + (
                " foreach" if extra else "")
            times = race({"vega": opt.step, "theirs": ref.step}, budget=3.0)
            ours, theirs = times["vega"], times["theirs"]
        except ImportError:
            ours = race({"vega": opt.step}, budget=3.0)["vega"]
            theirs, label = float("nan"), f"{module} (not installed)"
        rows.append((name, ours, label, theirs))
    return rows


def compile_times() -> tuple[float, float]:
    """Seconds to compile adamw's float32 kernel cold, and to load it from the cache."""
    code = ("import time, vega; from vega import codegen; t = time.perf_counter(); "
            "k = codegen.kernel('c', vega.adamw.program()); k.library(('float32',) * 3); "
            "print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "VEGA_CACHE_DIR": cache}
        run = [sys.executable, "-c", code]
        cold = float(subprocess.run(run, env=env, capture_output=True, text=True,
                                    check=True).stdout)
        warm = float(subprocess.run(run, env=env, capture_output=True, text=True,
                                    check=True).stdout)
    return cold, warm


def _machine() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), "")
    except OSError:
        pass
    return (f"{cpu or 'unknown CPU'}, {torch.get_num_threads()} threads, torch {torch.__version__}"
            f", vega {vega.__version__}")


def main(quick: bool = False, compile_torch: bool = True, out=None) -> int:
    out = out or sys.stdout

    def say(text=""):
        print(text, file=out, flush=True)
    say(f"vega bench on {_machine()}")
    native.scanner(wait=True)  # built now if need be: no row is timed while it builds
    say(native.status())
    cold, warm = compile_times()
    say(f"spec compile: cold {cold:.2f} s, from the cache {1e3 * warm:.1f} ms\n")
    sets = {"GPT-2-like (40M params, 51 tensors)": gpt2_like(),
            "many-small (1,000 tensors <= 10k)": many_small(200 if quick else 1000)}
    for title, shapes in sets.items():
        _, grads = _tensors(shapes)
        say(f"== {title}: {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters")
        # torch.compile of 1,000 tensors takes minutes on 2 cores: the large set only
        rows = adamw_rows(shapes, grads, compile_torch=compile_torch and not quick
                          and len(shapes) < 100)
        fused = rows["torch AdamW fused"]
        say(f"{'AdamW step':<60} {'median ms':>10} {'/ torch fused':>14}")
        for label, secs in rows.items():
            if label == FUNCTIONAL_FUSED:
                continue
            if label.startswith("("):
                say(f"{label:<60} {secs:>10.1f} s")
                continue
            alone = label == FUNCTIONAL  # its ratio: to torch's fused step in its own race
            base = rows[FUNCTIONAL_FUSED] if alone else fused
            say(f"{label:<60} {1e3 * secs:>10.2f} {secs / base:>13.2f}x" + "*" * alone)
        say(f"* new parameters and state each step, as optax's; raced with torch's fused step "
            f"alone ({1e3 * rows[FUNCTIONAL_FUSED]:.2f} ms there)")
        ours_fused = rows["vega AdamW + unscale, finite check, clip, skip"]
        composite = rows["torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW"]
        say(f"vega's fused step is {composite / ours_fused:.2f}x faster than torch's "
            "GradScaler + clip + fused AdamW composite")
        say(f"\n{'optimizer':<10} {'vega ms':>9}   {'counterpart':<40} {'ms':>9} {'speed-up':>9}")
        names = [n for n in OTHERS if not quick or n in ("sgd", "lamb")]
        for name, ours, label, theirs in other_rows(shapes, grads, names):
            say(f"{name:<10} {1e3 * ours:>9.2f}   {label:<40} {1e3 * theirs:>9.2f} "
                f"{theirs / ours:>8.2f}x")
        say()
    return 0


if __name__ == "__main__":
    sys.exit(main())
