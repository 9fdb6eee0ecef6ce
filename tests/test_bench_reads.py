"""``bench/reads.py``: its loops read what they say (every element, in any number of runs a
thread), and a short run prints every loop and the floor it derives."""
import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vega import bench
from vega.codegen.c import build

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "reads.py"
needs_cc = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


@needs_cc
def test_the_read_loop_sums_every_square_in_any_number_of_runs():
    lib, _, _ = build.build(bench.STREAM_C)
    lib.vega_stream_read_runs.restype = ctypes.c_double
    lib.vega_stream_read_runs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 1031, 100003):
        a = torch.rand(n, generator=gen)
        want = float((a.double() ** 2).sum())
        for runs in (1, 2, 4, 8):
            got = lib.vega_stream_read_runs(a.data_ptr(), n, runs)
            assert abs(got - want) <= 1e-5 * want, (n, runs)


@needs_cc
def test_a_short_run_prints_every_loop_and_the_floor():
    run = subprocess.run([sys.executable, str(SCRIPT), "--mb", "1", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for label in ("AdamW-like", "a += b", *(f"sum of squares, {k} run" for k in (1, 2, 4, 8))):
        assert any(line.startswith(label) for line in run.stdout.splitlines()), run.stdout
    assert "a fused step's floor against a plain one" in run.stdout


def test_it_refuses_a_size_that_is_not_positive():
    run = subprocess.run([sys.executable, str(SCRIPT), "--mb", "0"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "--mb 0.0" in run.stderr
