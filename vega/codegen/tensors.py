"""What a step may read and write of a tensor, shared by the backends and the runtime.

- A tensor with its negative or conjugate bit set (``x.conj().imag``, ``x.conj()``) stores
  its values negated or conjugated: a kernel that reads its memory reads it resolved
  (``resolve_neg``, ``resolve_conj``), and one that writes it in place writes a resolved
  copy that is copied back (``copy_`` negates or conjugates on the way).
"""
from __future__ import annotations

import torch


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values as stored: itself, or a copy without the conjugate and negative
    bits (asked by resolving, which returns ``t`` itself where neither is set: dynamo
    cannot trace ``is_conj()``)."""
    return t.resolve_conj().resolve_neg()
