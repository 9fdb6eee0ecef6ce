"""GPU benchmark: vega's Triton AdamW against torch's fused, foreach and compiled AdamW.

    python bench/gpu.py [--sets gpt2,1b,7b] [--steps 20] [--peak-tbps 4.8]

For GPT-2-small (124M parameters), Llama-3.2-1B-shaped (1.2B) and
Llama-2-7B-shaped (6.7B) parameter sets in float32, one row per optimizer:
milliseconds per step, achieved bandwidth (bytes an AdamW step must move,
over the time) against the card's peak, the ratio to vega's step, and the
CUDA kernel launches per step (counted with torch.profiler). Every number
comes from this one run. A set or a row that does not fit in memory next to
the others is skipped with a message. Without a CUDA device the script exits
with a message; it imports nothing that needs one.

Bytes per element of an AdamW step: read p, g, m, v and write p, m, v, 28
bytes in float32; the fused prelude (clipping by the global norm, skipping a
non-finite step) reads g once more, 32 bytes.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys

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


def time_step(step, steps: int) -> float:
    """Median milliseconds per step over ``steps`` steps, in 5 rounds, after warming up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / steps)
    return statistics.median(rounds)


def launches(step) -> tuple[int, int]:
    """(kernels, memory copies and sets) on the GPU during one step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

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


def agreement() -> float:
    """Largest difference between one vega and one torch fused AdamW step on GPT-2 small,
    relative to the largest parameter (the two write the decay differently: ~1e-7)."""
    vega = _vega()
    gen = torch.Generator(device="cuda").manual_seed(1)
    params = {f"p{i}": torch.randn(s, device="cuda", generator=gen)
              for i, s in enumerate(gpt2_small())}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    leaves = [torch.nn.Parameter(v.clone()) for v in params.values()]
    for leaf, g in zip(leaves, grads.values()):
        leaf.grad = g
    torch.optim.AdamW(leaves, lr=1e-3, weight_decay=0.01, fused=True).step()
    new, _ = vega.adamw_step(params, grads, vega.adamw_init(params), lr=1e-3,
                             weight_decay=0.01, backend="triton")
    diff = max((new[k] - leaf).abs().max().item() for k, leaf in zip(new, leaves))
    return diff / max(v.abs().max().item() for v in params.values())


def vega_rows(params, grads):
    """Vega's steps, in place (donate=True), as a list of (name, bytes per element, step)."""
    vega = _vega()

    names = [f"p{i}" for i in range(len(params))]
    ptree = dict(zip(names, params))
    gtree = dict(zip(names, grads))
    state = vega.adamw_init(ptree)
    lr = torch.tensor(1e-4, device="cuda")  # a device scalar, as a schedule would give

    def plain():
        vega.adamw_step(ptree, gtree, state, lr=lr, donate=True, backend="triton")

    def fused():
        vega.adamw_step(ptree, gtree, state, lr=lr, donate=True, backend="triton",
                        max_grad_norm=1.0, skip_nonfinite=True)

    rows = [("vega triton AdamW", 28, plain), ("vega triton AdamW + clip + skip", 32, fused)]
    graph = captured(fused)
    if graph is not None:
        rows.append(("vega, clip + skip, CUDA graph replay", 32, graph.replay))
    return rows, state


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


def torch_rows(params, grads):
    leaves = [torch.nn.Parameter(p, requires_grad=True) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g
    for kind in ("fused", "foreach", "compiled"):
        opts = {"fused": {"fused": True}, "foreach": {"foreach": True},
                "compiled": {"foreach": True}}[kind]
        opt = torch.optim.AdamW(leaves, lr=1e-4, weight_decay=0.01, **opts)
        step = opt.step
        if kind == "compiled":
            step = torch.compile(opt.step)
        yield f"torch AdamW ({kind})", 28, step
        del opt, step
        gc.collect()
        torch.cuda.empty_cache()


def run_set(key: str, steps: int, peak: float) -> None:
    title, shapes_fn = SETS[key]
    shapes = shapes_fn()
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"\n{title}: {numel / 1e6:,.0f}M parameters in {len(shapes)} tensors, float32")
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        grads = [torch.randn(s, device="cuda", generator=gen) * 1e-3 for s in shapes]
    except torch.OutOfMemoryError:
        print("  skipped: the parameters and gradients do not fit")
        return
    print(f"  {'':40} {'ms/step':>9} {'GB/s':>8} {'of peak':>8} {'vs vega':>8} "
          f"{'kernels':>8} {'copies':>7}")
    base = None

    def report(name, bytes_per, step):
        nonlocal base
        try:
            ms = time_step(step, steps)
            kernels, copies = launches(step)
        except torch.OutOfMemoryError:
            print(f"  {name:40} skipped: out of memory next to the parameters")
            return
        except Exception as err:  # noqa: BLE001  (one failing row must not hide the others)
            print(f"  {name:40} failed: {type(err).__name__}: {str(err)[:200]}")
            return
        gbps = bytes_per * numel / (ms * 1e-3) / 1e9
        base = base or ms
        print(f"  {name:40} {ms:9.3f} {gbps:8.0f} {gbps * 1e9 / peak:8.1%} {ms / base:8.2f}x "
              f"{kernels:8d} {copies:7d}")

    state = None
    try:
        rows, state = vega_rows(params, grads)
        for row in rows:
            report(*row)
    except torch.OutOfMemoryError:
        print("  vega rows skipped: out of memory")
    del state
    gc.collect()
    torch.cuda.empty_cache()
    try:
        for row in torch_rows(params, grads):
            report(*row)
            del row
    except torch.OutOfMemoryError:
        print("  torch rows skipped: out of memory")
    del params, grads
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="gpt2,1b,7b", help="comma-separated: gpt2, 1b, 7b")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing round")
    parser.add_argument("--peak-tbps", type=float, default=None,
                        help="the card's peak memory bandwidth in TB/s (default: by name)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is "
              "False); `vega bench` measures the CPU backends.", file=sys.stderr)
        return 1
    peak, card = peak_bytes_per_s(args.peak_tbps)
    print(f"{card}: peak {peak / 1e12:.2f} TB/s; torch {torch.__version__}")
    print(f"vega against torch fused AdamW, one step: {agreement():.1e} of the largest parameter")
    for key in args.sets.split(","):
        if key not in SETS:
            parser.error(f"unknown set {key!r}; choose from {', '.join(SETS)}")
        run_set(key, args.steps, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
