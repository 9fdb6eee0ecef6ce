"""``bench/gpu_check.py`` with ``VEGA_CHECK_DRY=1``: the GPU probe on the CPU (the kernels under
Triton's interpreter, tiny sizes). The sections that can run there do (correctness, the warps
varied, the bandwidth rows, the tensor past 2**31 elements at a small size, torch.compile), so
that a run on a GPU meets no mistake of the script's own nor internals of vega it reaches into
that have since changed; those that need CUDA (launches, host synchronizations, CUDA graphs,
the block-map cache probe) return at once."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["device", "correctness vs reference", "variants agree", "bandwidth",
            "launches per step", "host synchronization", "CUDA graph capture and replay",
            "tensor past 2**31 elements", "torch.compile(fullgraph=True)",
            "graph after block-map cache eviction (destructive, last)"]


def test_every_section_of_the_gpu_probe_runs_in_a_dry_run(tmp_path):
    out = tmp_path / "out" / "probe"  # not there yet: the probe makes it
    env = {**os.environ, "VEGA_CHECK_DRY": "1", "OUT": str(out), "VEGA_PY_BUDGET": "600"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((out / "vega_gpu_check.json").read_text())
    outcome = results["sections"]
    assert sorted(outcome) == sorted(SECTIONS), outcome
    assert all(v.startswith("ran in") for v in outcome.values()), outcome
    # what a section found wrong is printed as FAIL or DIFF, not raised
    bad = [line for line in run.stdout.splitlines() if " FAIL" in line or " DIFF" in line]
    assert not bad, bad
    assert results["int64"]["nonfinite_count"] == 0
    assert {r["step"] for r in results["bandwidth"]} >= {"vega plain", "vega clip+skip"}


def test_the_shell_wrapper_runs_the_probe_of_this_repository():
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "$PY bench/gpu_check.py" in text
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0
