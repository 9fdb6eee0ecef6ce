"""Host time of a vega Triton step: GPT-2 small's 148 tensors, the kernels recorded instead of
run (``vega.codegen.triton_ptx.recording``), so what is timed is what the CPU does for a step.

    python bench/host.py [--steps 200] [--scale 4]

The tensors are GPT-2 small's shapes with each axis divided by ``--scale`` (the host's work
does not depend on their sizes: block maps and tables are cached), on the CPU under Triton's
interpreter. Rows: a plain class step, one with clipping and a skip of non-finite steps, one
with a dynamic loss scale too, and the functional step; each for 148 tensors and for twice as
many, with the time a tensor adds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")


def gpt2_shapes(scale: int) -> list[tuple[int, ...]]:
    d = 768
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    shapes = [(50257, d), (1024, d)] + block * 12 + [(d,), (d,)]
    return [tuple(max(1, n // scale) for n in s) for s in shapes]


def per_step(step, steps: int) -> float:
    from vega.codegen import triton_ptx

    with triton_ptx.recording():
        step()  # warm: block maps, tables
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(steps):
                step()
            best = min(best, (time.perf_counter() - t) / steps)
    return best


def main(argv=None) -> int:
    import torch

    import vega

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--scale", type=int, default=4)
    args = ap.parse_args(argv)
    shapes = gpt2_shapes(args.scale)
    rows = {}
    for copies in (1, 2):
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
    n = len(shapes)
    print(f"host time a step, kernels recorded not run; GPT-2 small's {n} tensors "
          f"(axes / {args.scale}) and {2 * n}; torch {torch.__version__}")
    print(f"{'step':34} {n:>5} tensors {2 * n:>5} tensors   per tensor")
    for label, (one, two) in rows.items():
        print(f"{label:34} {one * 1e6:9.0f} us {two * 1e6:9.0f} us {(two - one) / n * 1e6:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
