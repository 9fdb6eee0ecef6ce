"""``bench/gpu.py --cpu``: every row of the GPU benchmark runs (on CPU tensors, the Triton
kernels under the interpreter), so that a lent GPU's one run meets no mistake of the script's
own; and without a GPU and without ``--cpu`` it says what it needs."""
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"
ROWS = ["vega triton AdamW (float lr)", "vega triton AdamW (tensor lr)",
        "vega triton AdamW + clip + skip", "vega triton AdamW class step", "torch AdamW (fused)",
        "torch AdamW (clip_grad_norm_ + fused)", "torch AdamW (foreach)"]


def _run(*args, interpret: bool = True):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_every_row_runs_in_a_dry_run_on_the_cpu():
    run = _run("--cpu", "--sets", "gpt2", "--steps", "1", "--scale", "128")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "measured device-to-device copy" in out
    found = re.search(r"one step: ([0-9.e+-]+) of the largest parameter", out)
    assert found and float(found.group(1)) < 1e-5, out
    for row in ROWS:
        line = next((x for x in out.splitlines() if x.strip().startswith(row)), None)
        assert line is not None, (row, out)
        numbers = line.strip()[len(row):].split()
        assert len(numbers) == 8 and float(numbers[0]) > 0, line  # (not "failed: ...")


def test_it_says_what_it_needs():
    import torch

    if not torch.cuda.is_available():
        run = _run("--sets", "gpt2", interpret=False)
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr
    run = _run("--cpu", interpret=False)
    assert run.returncode == 1 and "TRITON_INTERPRET=1" in run.stderr
    run = _run("--sets", "nope", interpret=False)
    assert run.returncode == 2 and "unknown set 'nope'" in run.stderr
