"""Test session set-up: Triton's interpreter for the triton backend on machines without CUDA,
and the C backend's native operator built before the first test, so that every C step that
can go through it does, on every run (not only once a background build has finished)."""
import os
import warnings

# Under pytest-xdist each worker takes its share of the cores. Otherwise torch's and the
# kernels' OpenMP teams of every worker spin on every core, and all of them slow down (the
# tests that need two threads set them, and the teams then wait without spinning).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))

# triton.language reads TRITON_INTERPRET when triton is first imported (torch._dynamo imports it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    from vega.codegen.c import native
    native.module(wait=True)  # None where it cannot be built: the Python path then


# torch warns once a process (TORCH_WARN_ONCE) the first time a sparse CSR, a nested or a
# complex32 tensor is made: "Sparse CSR tensor support is in beta state", "The PyTorch API
# of nested tensors is in prototype stage", "ComplexHalf support is experimental". The tests
# make the first two to see them refused, and complex32 parameters to step them; made here
# first, with the notice ignored, they make none under the tests, so that the suite runs with
# warnings as errors (-W error::UserWarning) whichever test makes the first.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.zeros(1, 1).to_sparse_csr()
    torch.nested.nested_tensor([torch.zeros(1)])
    torch.zeros(1, dtype=torch.complex32)
