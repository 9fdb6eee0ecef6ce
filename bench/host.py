"""Host time of a vega Triton step: GPT-2 small's 148 tensors, the kernels recorded instead of
run (``vega.codegen.triton_ptx.recording``), so what is timed is what the CPU does for a step.

    python bench/host.py [--steps 200] [--scale 4]

The tensors are GPT-2 small's shapes with each axis divided by ``--scale`` (the host's work
does not depend on their sizes: block maps and tables are cached), on the CPU under Triton's
interpreter. Rows: a plain class step, one with clipping and a skip of non-finite steps, one
with a dynamic loss scale too, the functional step, and torch's fused AdamW class step on
``meta`` tensors (its host side: meta kernels compute nothing); each for 148 tensors and for
two, three and four times as many, with the time a tensor adds: the least-squares slope over
the four sizes (a difference of two of them moves with this machine's noise).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")


COPIES = (1, 2, 3, 4)  # GPT-2 small's tensors, and as many again, twice and three times


def gpt2_shapes(scale: int) -> list[tuple[int, ...]]:
    d = 768
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    shapes = [(50257, d), (1024, d)] + block * 12 + [(d,), (d,)]
    return [tuple(max(1, n // scale) for n in s) for s in shapes]


def per_step(step, steps: int, rounds: int = 7) -> float:
    """The best over ``rounds`` of the mean time of ``steps`` calls, the launches recorded
    (each round's records dropped, so that later rounds hold no more memory)."""
    from vega.codegen import triton_ptx

    with triton_ptx.recording() as found:
        step()  # warm: block maps, tables
        return best_of(step, steps, rounds, before=found.clear)


def slope(sizes, times) -> float:
    """The least-squares slope of ``times`` over ``sizes``."""
    mx, my = sum(sizes) / len(sizes), sum(times) / len(times)
    return sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True)) / \
        sum((x - mx) ** 2 for x in sizes)


def best_of(step, steps: int, rounds: int, before=lambda: None) -> float:
    """The least over ``rounds`` of the mean seconds of ``steps`` calls of ``step``
    (``before()`` ahead of each round, untimed)."""
    best = float("inf")
    for _ in range(rounds):
        before()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def torch_fused_on_meta(shapes, steps: int, rounds: int = 7) -> float | None:
    """torch's fused AdamW class step on ``meta`` tensors, whose kernels check shapes and
    compute nothing: its host side (gathering the group, grouping by device and dtype, the
    dispatch of ``torch._fused_adamw_``), less the launches a GPU would add. torch refuses
    fused on meta, so its device checks are widened for the measurement; None where they
    are not found (another torch)."""
    import torch
    import torch.optim.adam as adam_module
    import torch.optim.optimizer as optimizer_module

    supported = getattr(optimizer_module, "_get_fused_kernels_supported_devices", None)
    if supported is None or not hasattr(adam_module, "_device_dtype_check_for_fused"):
        return None
    ws = [torch.nn.Parameter(torch.zeros(s, device="meta")) for s in shapes]
    for w in ws:
        w.grad = torch.zeros_like(w)
    saved = supported, adam_module._device_dtype_check_for_fused
    optimizer_module._get_fused_kernels_supported_devices = lambda: [*saved[0](), "meta"]
    adam_module._device_dtype_check_for_fused = lambda *a, **k: None
    try:
        opt = torch.optim.AdamW(ws, lr=1e-3, fused=True)
        opt.step()
        return best_of(opt.step, steps, rounds)
    finally:
        optimizer_module._get_fused_kernels_supported_devices = saved[0]
        adam_module._device_dtype_check_for_fused = saved[1]


def main(argv=None) -> int:
    import torch

    import vega

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--scale", type=int, default=4)
    args = ap.parse_args(argv)
    shapes = gpt2_shapes(args.scale)
    rows = {}
    for copies in COPIES:
        ws = [torch.nn.Parameter(torch.zeros(s)) for s in shapes * copies]
        for w in ws:
            w.grad = torch.zeros_like(w)
        kinds = {
            "class AdamW": dict(),
            "class AdamW, clip + skip": dict(max_grad_norm=1.0, skip_nonfinite=True),
            "class AdamW, clip + loss scale": dict(max_grad_norm=1.0,
                                                   loss_scale=vega.LossScale.dynamic()),
        }
        for label, kw in kinds.items():
            opt = vega.optim.AdamW(ws, lr=1e-3, backend="triton", **kw)
            rows.setdefault(label, []).append(per_step(opt.step, args.steps))
        params = {str(k): w.detach() for k, w in enumerate(ws)}
        grads = {k: torch.zeros_like(p) for k, p in params.items()}
        state = vega.adamw_init(params)
        rows.setdefault("functional adamw_step", []).append(per_step(
            lambda: vega.adamw_step(params, grads, state, lr=1e-3, backend="triton",
                                    donate=True), args.steps))
        meta = torch_fused_on_meta(shapes * copies, args.steps)
        if meta is not None:
            rows.setdefault("torch AdamW fused (meta tensors)", []).append(meta)
    n = len(shapes)
    sizes = [k * n for k in COPIES]
    print(f"host time a step, kernels recorded not run; GPT-2 small's {n} tensors "
          f"(axes / {args.scale}), and {', '.join(map(str, sizes[1:]))}; "
          f"torch {torch.__version__}")
    print(f"{'step':34} " + " ".join(f"{k:>5} tensors" for k in sizes) + "   per tensor")
    for label, times in rows.items():
        print(f"{label:34} " + " ".join(f"{t * 1e6:10.0f} us" for t in times) +
              f" {slope(sizes, times) * 1e6:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
