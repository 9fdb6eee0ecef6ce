"""The Triton kernels of every shipped spec compiled offline for sm_90a: registers, spills,
128-bit accesses and libdevice calls, one row per kernel (no GPU needed).

    python bench/ptx.py [--specs adamw,lamb] [--dtypes float32,bfloat16]

Each spec steps once (plain, then with clipping and a skip of non-finite steps) on
``vega.codegen.triton_ptx.SHAPES`` under Triton's interpreter with its launches recorded, not
run; every distinct kernel is compiled by Triton's own tool chain for ``sm_90a`` (see
``vega.codegen.triton_ptx``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # recording runs where kernels are interpreted

COLUMNS = ("spec", "dtype", "kernel", "warps", "BLOCK", "regs", "spill", "v4 ld", "v4 st",
           "ld", "st", "libdevice", "f64 ops", "max drops NaN", "max keeps NaN")


def main(argv=None) -> int:
    import vega
    from vega.codegen import triton_ptx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=",".join(vega.builtin_names()))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    if triton_ptx.ptxas() is None:
        print("triton (with its ptxas) is not installed: nothing to compile")
        return 1
    import triton

    t0 = time.time()
    rows, worst = [], {"regs": 0, "spill": 0}
    for name in args.specs.split(","):
        for dtype in args.dtypes.split(","):
            launches = triton_ptx.distinct(
                triton_ptx.spec_launches(name, dtype) + triton_ptx.spec_launches(name, dtype,
                                                                                 fused=True))
            for f in triton_ptx.compile_launches(launches):
                spill = f.spill_stores + f.spill_loads
                worst["spill"] = max(worst["spill"], spill)
                if f.kernel.endswith("_update"):
                    worst["regs"] = max(worst["regs"], f.registers)
                rows.append((name, dtype, f.kernel.removeprefix(f"vega_{name}_"), f.num_warps,
                             f.block, f.registers, spill, f.v4_loads, f.v4_stores, f.loads,
                             f.stores, len(f.libdevice), f.f64_ops, f.max_dropping_nan, f.max_nan))
    widths = [max(len(str(r[k])) for r in rows + [COLUMNS]) for k in range(len(COLUMNS))]
    print(f"triton {triton.__version__}, offline compile for {triton_ptx.ARCH}, "
          f"{len(rows)} kernels in {time.time() - t0:.0f} s")
    for r in [COLUMNS] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))
    print(f"most registers of an update kernel: {worst['regs']}; most bytes spilled: "
          f"{worst['spill']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
