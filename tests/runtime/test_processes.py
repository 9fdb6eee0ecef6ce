"""Optimizers in processes made by fork after steps (a DataLoader's worker, a pool's process):
a child that takes one thread (``torch.set_num_threads(1)``, as DataLoader's workers do)
steps its inherited optimizer, and a new spec it compiles, bitwise as the parent would, and
the parent steps on after it. Each run is a child process with a timeout, and its own fork
is waited for with a deadline: a hung child fails the test at once."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import vega
from vega.codegen import c as c_backend

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="needs a C compiler")
REPO = Path(vega.__file__).resolve().parents[1]

FORKED = r"""
import copy, hashlib, json, os, sys, time
import torch, vega
torch.set_num_threads(2)
SHAPES = [(40000,), (300, 150), (7,)]  # (the longest past one thread's share: PAR_MIN)

def grads(k):
    gen = torch.Generator().manual_seed(100 + k)
    return [torch.randn(s, generator=gen) for s in SHAPES]

def steps(opt, ks):
    params = [p for group in opt.param_groups for p in group["params"]]
    for k in ks:
        for p, g in zip(params, grads(k)):
            p.grad = g
        opt.step()
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            digest.update(state[key].detach().numpy().tobytes())
    return digest.hexdigest()

def new_spec():
    spec = vega.compile("optimizer forked_rule(lr = 0.01) { state m = zeros\n"
                        "m = 0.5 * m + g\n p = p - lr * m }")
    gen = torch.Generator().manual_seed(7)
    return spec.optimizer([torch.nn.Parameter(torch.randn(s, generator=gen))
                           for s in SHAPES], backend="c")

gen = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
opt = vega.optim.AdamW(params, lr=1e-2, max_grad_norm=1.0, backend="c")
steps(opt, range(3))  # (kernels run on two threads: OpenMP's threads started)
twin = copy.deepcopy(opt)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        torch.set_num_threads(1)
        os.write(w, json.dumps([steps(opt, range(3, 6)), steps(new_spec(), range(2))]).encode())
    finally:
        os._exit(0)
os.close(w)
deadline = time.monotonic() + 60
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:  # a hung child fails the run at once
        os.kill(pid, 9)
        sys.exit("the child hung")
    time.sleep(0.05)
child = json.loads(os.read(r, 4096).decode())
print(json.dumps({"child": child, "parent": [steps(twin, range(3, 6)), steps(new_spec(), range(2))],
                  "after": steps(opt, range(3, 6))}))
"""


def test_a_forked_child_on_one_thread_steps_as_its_parent():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ran = subprocess.run([sys.executable, "-c", FORKED], env=env, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    out = json.loads(ran.stdout)
    assert out["child"] == out["parent"]
    assert out["after"] == out["parent"][0]  # the parent's own steps after the fork
