"""Test session set-up: Triton's interpreter for the triton backend on machines without CUDA,
and the C backend's native operator built before the first test, so that every C step that
can go through it does, on every run (not only once a background build has finished)."""
import os

import torch

# triton.language reads TRITON_INTERPRET when triton is first imported (torch._dynamo imports it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    from vega.codegen.c import native
    native.module(wait=True)  # None where it cannot be built: the Python path then
