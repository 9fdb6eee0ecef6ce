"""How fast this machine reads memory in a pass that only reads, against passes that read
and write: the floor under a fused step, whose prelude reads the gradients once before the
update reads and writes everything.

    python bench/reads.py [--mb 163] [--rounds 21]

Loops over float32 arrays of ``--mb`` MB each (163 MB: the GPT-2-like set's 40.7M
gradients), on torch's thread count, taken in turn for ``--rounds`` rounds: an AdamW-like
loop (28 bytes an element), ``a += b`` (12), and a sum of squares (4) reading each thread's
share as 1, 2, 4 or 8 runs side by side. Prints each loop's median and best GB/s, and the
fused step's floor against a plain step at the AdamW loop's rate: (28 + 4 at the best read
rate) / 28.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

def main(argv=None) -> int:
    import torch

    from vega import bench
    from vega.codegen.c import build

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=163.0)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args(argv)
    if args.mb <= 0 or args.rounds < 1:
        ap.error(f"--mb {args.mb} and --rounds {args.rounds} must be positive")
    if build.compiler() is None:
        print("no C compiler: nothing to measure")
        return 1
    lib, _, _ = build.build(bench.STREAM_C)  # (the bench's bound's loops, and these)
    n = int(args.mb * 1e6) // 4
    p, g, m, v = (torch.full((n,), x) for x in (0.5, 0.01, 0.0, 0.0))
    at = [ctypes.c_void_p(t.data_ptr()) for t in (p, g, m, v)]
    lib.vega_stream_read_runs.restype = ctypes.c_double
    lib.vega_stream_read_runs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    loops = {"AdamW-like (28 B an element)":
             (28, lambda: lib.vega_stream_plain(*at, ctypes.c_int64(n))),
             "a += b (12 B)": (12, lambda: lib.vega_stream_add(at[2], at[1], ctypes.c_int64(n)))}
    for runs in (1, 2, 4, 8):
        loops[f"sum of squares, {runs} run{'s' * (runs > 1)} a thread (4 B)"] = (
            4, lambda runs=runs: lib.vega_stream_read_runs(at[1], n, runs))
    rates: dict[str, list[float]] = {label: [] for label in loops}
    for _ in range(args.rounds + 1):  # (the first round touches the pages: not counted)
        for label, (nbytes, fn) in loops.items():
            t0 = time.perf_counter()
            fn()
            rates[label].append(nbytes * n / (time.perf_counter() - t0))
    print(f"{torch.get_num_threads()} threads, arrays of {4 * n / 1e6:.0f} MB, "
          f"{args.rounds} rounds; GB/s")
    print(f"{'loop':44} {'median':>8} {'best':>8}")
    for label, got in rates.items():
        got = got[1:]
        print(f"{label:44} {statistics.median(got) / 1e9:8.1f} {max(got) / 1e9:8.1f}")
    rw = statistics.median(rates["AdamW-like (28 B an element)"][1:])
    read = max(statistics.median(got[1:]) for label, got in rates.items()
               if label.startswith("sum"))
    print(f"a fused step's floor against a plain one, the medians: (28 + 4 x {rw / 1e9:.1f} / "
          f"{read / 1e9:.1f}) / 28 = {(28 + 4 * rw / read) / 28:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
