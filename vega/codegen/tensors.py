"""What a step may read and write of a tensor, shared by the backends and the runtime.

- A tensor subclass with operations of its own (``__torch_dispatch__``: DTensor, a wrapper
  such as ``TwoTensor``) holds no storage of its own that a compiled kernel could read (its
  ``data_ptr()`` is 0): only the reference backend, which steps it through its own
  operations, takes it.
- A tensor with its negative or conjugate bit set (``x.conj().imag``, ``x.conj()``) stores
  its values negated or conjugated: a kernel that reads its memory reads it resolved
  (``resolve_neg``, ``resolve_conj``), and one that writes it in place writes a resolved
  copy that is copied back (``copy_`` negates or conjugates on the way).
"""
from __future__ import annotations

import torch

_PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_PLAIN_OR_NONE = _PLAIN_TYPES | {type(None)}
_NO_DISPATCH = torch.Tensor.__torch_dispatch__


def has_own_ops(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with operations of its own (``__torch_dispatch__``)."""
    cls = type(t)
    return cls not in _PLAIN_TYPES and \
        getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH


def first_with_own_ops(tensors) -> int | None:
    """The position of the first tensor with operations of its own (``has_own_ops``), or None
    (one pass over the types, in the common case of plain tensors and parameters). ``None``
    items are skipped."""
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    if _PLAIN_OR_NONE.issuperset(map(type, tensors)):
        return None
    return next((i for i, t in enumerate(tensors)
                 if t is not None and has_own_ops(t)), None)


def own_ops_words(t: torch.Tensor) -> str:
    """What is wrong with a tensor ``has_own_ops`` finds, for a compiled backend's message."""
    return (f"is a {type(t).__name__}, a tensor subclass with operations of its own, whose "
            f"storage vega's compiled kernels cannot read")


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values as stored: itself, or a copy without the conjugate and negative
    bits (asked by resolving, which returns ``t`` itself where neither is set: dynamo
    cannot trace ``is_conj()``)."""
    return t.resolve_conj().resolve_neg()
