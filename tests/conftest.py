"""Test session set-up: Triton's interpreter for the triton backend on machines without CUDA."""
import os

import torch

# triton.language reads TRITON_INTERPRET when triton is first imported (torch._dynamo imports it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
