"""GPU benchmark: vega's Triton AdamW against torch's fused, foreach and compiled AdamW.

    python bench/gpu.py [--sets gpt2,1b,7b] [--steps 20] [--peak-tbps 4.8]
    python bench/gpu.py --cpu [--scale 64]   (a dry run of every row on the CPU)

For GPT-2-small (124M parameters), Llama-3.2-1B-shaped (1.2B) and
Llama-2-7B-shaped (6.7B) parameter sets in float32, one row per optimizer:
milliseconds per step, the host's share of it (the time the step's Python and
launches take before it returns), achieved bandwidth (bytes an AdamW step must
move, over the time) against a measured device-to-device copy and the card's
peak, the ratio to vega's step, and the CUDA kernel launches per step (counted
with torch.profiler). Each set also compares one vega step with one step of
torch's fused AdamW on its own parameters. Every number comes from this one
run. A set or a row that does not fit in memory next to the others is skipped
with a message. Without a CUDA device the script exits with a message; it
imports nothing that needs one.

``--cpu`` runs every row on CPU tensors (the Triton kernels under
``TRITON_INTERPRET=1``, the sets' axes divided by ``--scale``), timed by the
host's clock, without launch counts or graph capture: a check of the script
itself, not a measurement.

Bytes per element of an AdamW step: read p, g, m, v and write p, m, v, 28
bytes in float32; the fused prelude (clipping by the global norm, skipping a
non-finite step) reads g once more, 32 bytes, as torch's clip_grad_norm_ does.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

PEAK_TBPS = {"H200": 4.8, "H100 SXM": 3.35, "H100 PCIe": 2.0, "H100": 3.35, "A100-SXM4-80GB": 2.04,
             "A100": 1.555, "L40S": 0.864, "RTX 4090": 1.008}


def gpt2_small() -> list[tuple[int, ...]]:
    """GPT-2 small: 12 blocks of width 768, 50257-token embedding; 124M parameters."""
    d = 768
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
             (4 * d, d), (d,)]
    return [(50257, d), (1024, d)] + block * 12 + [(d,), (d,)]


def llama(d: int, layers: int, ffn: int, vocab: int, kv: int, tied: bool):
    block = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,)]
    return [(vocab, d)] + block * layers + [(d,)] + ([] if tied else [(vocab, d)])


SETS = {
    "gpt2": ("GPT-2 small", gpt2_small),
    "1b": ("Llama-3.2-1B-shaped", lambda: llama(2048, 16, 8192, 128256, 512, tied=True)),
    "7b": ("Llama-2-7B-shaped", lambda: llama(4096, 32, 11008, 32000, 4096, tied=False)),
}


def peak_bytes_per_s(override: float | None) -> tuple[float, str]:
    if override:
        return override * 1e12, "given"
    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS.items():
        if key.lower() in name.lower():
            return tbps * 1e12, name
    return 4.8e12, f"{name} (peak unknown: H200's 4.8 TB/s assumed)"


def time_step(step, steps: int, cpu: bool = False) -> tuple[float, float]:
    """(median milliseconds per step, median host milliseconds per step) over ``steps``
    steps, in 5 rounds, after warming up. The host's time is the wall time until the last
    call returns, before the device is waited for (a step that waits for its kernels, or a
    launch queue that fills, shows in it)."""
    for _ in range(3 if not cpu else 1):
        step()
    _sync(cpu)
    rounds, host = [], []
    for _ in range(5 if not cpu else 1):
        if cpu:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            rounds.append((time.perf_counter() - t) * 1e3 / steps)
            host.append(rounds[-1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        host.append((time.perf_counter() - t) * 1e3 / steps)
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / steps)
    return statistics.median(rounds), statistics.median(host)


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 1 << 31) -> float:
    """Bytes a second of a device-to-device copy of ``nbytes`` (read and written: twice
    ``nbytes`` moved), the median of 5: what a memory-bound step can reach on this card."""
    cpu = device == "cpu"
    nbytes = nbytes if not cpu else 1 << 24
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms, _ = time_step(lambda: dst.copy_(src), 10, cpu)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def launches(step, cpu: bool = False) -> tuple[int, int]:
    """(kernels, memory copies and sets) on the GPU during one step; (0, 0) on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if cpu:
        return 0, 0

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = sum(1 for e in events if e.name.startswith(("Memcpy", "Memset")))
    return len(events) - copies, copies


def _vega():
    import vega
    from vega import codegen
    from vega.codegen import triton as triton_backend

    codegen.BACKENDS.setdefault("triton", triton_backend)  # where vega.codegen does not yet
    return vega


def agreement(params, grads) -> float:
    """Largest difference between one vega step and one step of torch's fused AdamW from
    the same parameters and gradients, relative to the largest parameter (the two write the
    decay differently: ~1e-7); the set's own tensors, so at its scale."""
    vega = _vega()
    names = [f"p{i}" for i in range(len(params))]
    ptree = {k: p.clone() for k, p in zip(names, params)}
    gtree = dict(zip(names, grads))
    vega.adamw_step(ptree, gtree, vega.adamw_init(ptree), lr=1e-3, weight_decay=0.01,
                    backend="triton", donate=True)
    diff, largest = 0.0, 0.0
    for k, (p, g) in zip(names, zip(params, grads)):  # one tensor at a time: little memory
        leaf = torch.nn.Parameter(p.clone())
        leaf.grad = g
        torch.optim.AdamW([leaf], lr=1e-3, weight_decay=0.01, fused=True).step()
        diff = max(diff, (ptree[k] - leaf).abs().max().item())
        largest = max(largest, p.abs().max().item())
        del leaf
    return diff / largest


def vega_rows(params, grads, cpu: bool = False):
    """Vega's steps, in place (donate=True), as a list of (name, bytes per element, step)."""
    vega = _vega()

    names = [f"p{i}" for i in range(len(params))]
    ptree = dict(zip(names, params))
    gtree = dict(zip(names, grads))
    state = vega.adamw_init(ptree)
    lr = torch.tensor(1e-4, device=params[0].device)  # a device scalar, as a schedule gives

    def plain():
        vega.adamw_step(ptree, gtree, state, lr=1e-4, donate=True, backend="triton")

    def tensor_lr():
        vega.adamw_step(ptree, gtree, state, lr=lr, donate=True, backend="triton")

    def fused():
        vega.adamw_step(ptree, gtree, state, lr=lr, donate=True, backend="triton",
                        max_grad_norm=1.0, skip_nonfinite=True)

    rows = [("vega triton AdamW (float lr)", 28, plain),
            ("vega triton AdamW (tensor lr)", 28, tensor_lr),
            ("vega triton AdamW + clip + skip", 32, fused)]
    graph = captured(fused) if not cpu else None
    if graph is not None:
        rows.append(("vega, clip + skip, CUDA graph replay", 32, graph.replay))
    return rows, state


def vega_class_row(params, grads):
    """The ``vega.optim.AdamW`` class step over the same tensors (the parameters shared, a
    state of its own): (row, the optimizer, to be freed after the row)."""
    vega = _vega()
    leaves = [torch.nn.Parameter(p) for p in params]  # (the parameters' own storage)
    for leaf, g in zip(leaves, grads):
        leaf.grad = g
    opt = vega.optim.AdamW(leaves, lr=1e-4, backend="triton")
    return ("vega triton AdamW class step", 28, opt.step), opt


def captured(step):
    """``step`` captured in a CUDA graph, or None with a message."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph
    except Exception as err:  # noqa: BLE001  (report it, and carry on with the other rows)
        print(f"  (CUDA graph capture of the vega step failed: {type(err).__name__}: {err})")
        return None


def torch_rows(params, grads, cpu: bool = False):
    leaves = [torch.nn.Parameter(p, requires_grad=True) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g
    for kind in ("fused", "clip_grad_norm_ + fused", "foreach", "compiled"):
        opts = {"foreach": {"foreach": True}, "compiled": {"foreach": True}}.get(
            kind, {"fused": True})
        opt = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.01, **opts)
        step = opt.step
        if kind == "compiled":
            if cpu:  # (a compile of the step is minutes on the CPU: not part of a dry run)
                continue
            step = torch.compile(opt.step)
        if kind == "clip_grad_norm_ + fused":  # what vega's fused step replaces
            def step(opt=opt):
                torch.nn.utils.clip_grad_norm_(leaves, 1.0, foreach=True)
                opt.step()
        yield f"torch AdamW ({kind})", 32 if "clip" in kind else 28, step
        del opt, step
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def run_set(key: str, steps: int, peak: float, copy: float, cpu: bool = False,
            scale: int = 1) -> None:
    title, shapes_fn = SETS[key]
    shapes = [tuple(max(1, n // scale) for n in s) for s in shapes_fn()]
    numel = sum(torch.Size(s).numel() for s in shapes)
    device = "cpu" if cpu else "cuda"
    print(f"\n{title}: {numel / 1e6:,.4g}M parameters in {len(shapes)} tensors, float32"
          + (f" (axes / {scale})" if scale > 1 else ""))
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        params = [torch.randn(s, device=device, generator=gen) for s in shapes]
        grads = [torch.randn(s, device=device, generator=gen) * 1e-3 for s in shapes]
    except torch.OutOfMemoryError:
        print("  skipped: the parameters and gradients do not fit")
        return
    try:
        print(f"  vega against torch fused AdamW, one step: "
              f"{agreement(params, grads):.1e} of the largest parameter")
    except torch.OutOfMemoryError:
        print("  vega against torch fused AdamW: skipped, out of memory")
    print(f"  {'':40} {'ms/step':>9} {'host ms':>8} {'GB/s':>8} {'of copy':>8} {'of peak':>8} "
          f"{'vs vega':>8} {'kernels':>8} {'copies':>7}")
    base = None

    def report(name, bytes_per, step):
        nonlocal base
        try:
            ms, host_ms = time_step(step, steps, cpu)
            kernels, copies = launches(step, cpu)
        except torch.OutOfMemoryError:
            print(f"  {name:40} skipped: out of memory next to the parameters")
            return
        except Exception as err:  # noqa: BLE001  (one failing row must not hide the others)
            print(f"  {name:40} failed: {type(err).__name__}: {str(err)[:200]}")
            return
        gbps = bytes_per * numel / (ms * 1e-3) / 1e9
        base = base or ms
        print(f"  {name:40} {ms:9.3f} {host_ms:8.3f} {gbps:8.0f} {gbps * 1e9 / copy:8.1%} "
              f"{gbps * 1e9 / peak:8.1%} {ms / base:8.2f}x {kernels:8d} {copies:7d}")

    state = None
    try:
        rows, state = vega_rows(params, grads, cpu)
        for row in rows:
            report(*row)
    except torch.OutOfMemoryError:
        print("  vega rows skipped: out of memory")
    del state
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    opt = None
    try:
        row, opt = vega_class_row(params, grads)
        report(*row)
    except torch.OutOfMemoryError:
        print("  vega class row skipped: out of memory")
    del opt
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    try:
        for row in torch_rows(params, grads, cpu):
            report(*row)
            del row
    except torch.OutOfMemoryError:
        print("  torch rows skipped: out of memory")
    del params, grads
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gpt2,1b,7b", help="comma-separated: gpt2, 1b, 7b")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing round")
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="the card's peak memory bandwidth in TB/s (default: by name)")
    parser.add_argument("--cpu", action="store_true",
                        help="a dry run of every row on CPU tensors (Triton's interpreter)")
    parser.add_argument("--scale", type=int, default=None,
                        help="divide each axis of the sets by this (default: 1, or 64 with "
                             "--cpu)")
    args = parser.parse_args(argv)
    for key in args.sets.split(","):
        if key not in SETS:
            parser.error(f"unknown set {key!r}; choose from {', '.join(SETS)}")
    scale = args.scale or (64 if args.cpu else 1)
    if args.cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("bench/gpu.py --cpu needs TRITON_INTERPRET=1 in the environment (set before "
                  "triton is imported)", file=sys.stderr)
            return 1
        peak, card = 1e11, "CPU dry run (peak: a nominal 100 GB/s)"
    elif not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is "
              "False); `vega bench` measures the CPU backends, and --cpu dry-runs this "
              "script.", file=sys.stderr)
        return 1
    else:
        peak, card = peak_bytes_per_s(args.peak_tbps)
    copy = copy_bandwidth("cpu" if args.cpu else "cuda")
    print(f"{card}: peak {peak / 1e12:.2f} TB/s, a measured device-to-device copy "
          f"{copy / 1e12:.2f} TB/s ({copy / peak:.0%}); torch {torch.__version__}")
    for key in args.sets.split(","):
        run_set(key, args.steps, peak, copy, args.cpu, scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
