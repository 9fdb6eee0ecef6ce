"""A step compiles on its first call: ``torch.compile(step, fullgraph=True)`` of a
function that calls ``vega.adamw_step(..., lr=schedule)``, and of ``opt.step`` on a class,
with no eager step before and no ``backend=`` (vega looks up its default backend, and
builds the kernel, while dynamo traces), in a fresh process with an empty kernel cache.
dynamo's ``explain`` finds no graph break, and the compiled steps match eager ones."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vega.codegen import c as c_backend

SCRIPT = Path(__file__).with_name("first_compile_script.py")


@pytest.mark.skipif(not c_backend.available(), reason="no C compiler: no C backend")
def test_first_call_compiles_with_no_graph_break(tmp_path):
    # (VEGA_NATIVE=0: a first run's traces find no native operator, as here, and its build in
    # the background, half a minute of a CPU, would only slow this process down)
    env = {**os.environ, "VEGA_CACHE_DIR": str(tmp_path / "vega"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "VEGA_NATIVE": "0"}
    try:
        run = subprocess.run([sys.executable, str(SCRIPT), "hand", "init", "class"],
                             capture_output=True, text=True, env=env, timeout=480)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the compiled steps did not finish in {err.timeout} s")
    assert run.returncode == 0, run.stderr[-4000:]
    assert not (tmp_path / "vega").exists() or any((tmp_path / "vega").iterdir())
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for case, (nbreaks, ngraphs, reasons, diff, steps) in found.items():
        assert (nbreaks, reasons) == (0, []), f"{case}: graph breaks: {reasons}"
        assert ngraphs == 1, case
        assert steps == 3, case
        assert diff <= 1e-6, f"{case}: compiled and eager steps differ by {diff}"
