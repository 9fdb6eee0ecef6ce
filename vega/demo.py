"""``vega demo``: a small classifier trained with vega's optimizers next to torch.optim.

The data is generated here (three interleaved spirals, fixed seed), so the demo
needs no download. Every run starts from the same weights; the table reports
final loss, accuracy and the median time of one optimizer step.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

import vega
import vega.codegen

ADABELIEF = """
# AdaBelief (Zhuang et al., 2020): Adam whose second moment tracks (g - mu)^2.
optimizer adabelief(lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-16, weight_decay = 0.0) {
    state mu = zeros
    state s = zeros
    mu = b1 * mu + (1 - b1) * g
    s = b2 * s + (1 - b2) * (g - mu) ^ 2 + eps
    d = (mu / (1 - b1 ^ t)) / (sqrt(s / (1 - b2 ^ t)) + eps)
    p = p - lr * (d + weight_decay * p)
}
"""


def spirals(n_per_class: int = 300, classes: int = 3, seed: int = 0):
    """Points on interleaved noisy spirals, and their class labels."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, n_per_class)
        theta = c * 2 * torch.pi / classes + 4.0 * r + 0.2 * torch.randn(n_per_class,
                                                                          generator=gen)
        xs.append(torch.stack([r * torch.sin(theta), r * torch.cos(theta)], dim=1))
        ys.append(torch.full((n_per_class,), c))
    return torch.cat(xs), torch.cat(ys)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 3))


def train(name, make_opt, x, y, steps, seed, out, batch=128):
    net = model(seed)
    opt = make_opt(net.parameters())
    gen = torch.Generator().manual_seed(seed + 1)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        loss = loss_fn(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
        if (i + 1) % max(1, steps // 5) == 0 or i + 1 == steps:
            print(f"  {name:<28} step {i + 1:>5}/{steps}  loss {loss.item():.4f}", file=out,
                  flush=True)
    with torch.no_grad():
        logits = net(x)
        final = loss_fn(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    return {"name": name, "loss": final, "acc": acc, "ms": 1e3 * statistics.median(times),
            "params": [p.detach().clone() for p in net.parameters()]}


def _native_ready(out) -> None:
    """Wait for the C backend's native operator where it is being built (once, in the
    background, on a fresh install): a step timed while it builds runs on the slower Python
    path, beside the compiler on the same cores."""
    from vega.codegen.c import native
    if native.module() is None and native.status() == "native operator still building":
        print("vega demo: building vega's native operator once (C++, about half a minute), "
              "so that no step is timed while it builds", file=out, flush=True)
    native.module(wait=True)


def main(steps: int = 400, seed: int = 0, out=None) -> int:
    out = out or sys.stdout
    if steps < 1:
        print(f"vega demo: --steps must be at least 1, got {steps}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    x, y = spirals(seed=seed)
    adabelief = vega.compile(ADABELIEF, "<demo: adabelief>")
    backend = vega.codegen.default_backend("cpu")
    runs = [
        ("vega.optim.AdamW", lambda ps: vega.optim.AdamW(ps, lr=1e-2, weight_decay=1e-4)),
        ("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-4)),
        ("vega.optim.SGD (nesterov)", lambda ps: vega.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                                nesterov=True)),
        ("adabelief (your own spec)", lambda ps: adabelief.optimizer(ps, lr=1e-2)),
    ]
    print(f"vega demo: {len(x)} points on 3 spirals, MLP 2-64-64-3, {steps} steps of batch 128,"
          f" vega backend '{backend}'", file=out)
    if backend == "c":
        _native_ready(out)
    results = [train(name, make, x, y, steps, seed, out=out) for name, make in runs]
    print(file=out)
    print(f"{'optimizer':<28} {'final loss':>10} {'accuracy':>9} {'step (median)':>14}", file=out)
    for r in results:
        print(f"{r['name']:<28} {r['loss']:>10.4f} {100 * r['acc']:>8.1f}% "
              f"{r['ms']:>11.3f} ms", file=out)
    gap = max((a - b).abs().max().item() for a, b in zip(results[0]["params"],
                                                         results[1]["params"]))
    print(f"\nlargest parameter difference, vega AdamW vs torch AdamW after {steps} steps: "
          f"{gap:.2e}", file=out)
    return 0
