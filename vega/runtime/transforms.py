"""Gradient transformations: functions from a gradient pytree to another.

They go between the backward pass and the step, after the OCaml library Vega's
``clip_by_global_norm``, ``clip_by_value`` and the joint norm. Pure tensor
arithmetic over ``torch.utils._pytree`` structures: no value is read back to the
host, so they trace under ``torch.compile`` and replay under CUDA graphs. Leaves
that are not float or complex tensors (indices, RNG keys) pass through unchanged
and do not count in the norm; a complex leaf counts as its two real coordinates.
"""
from __future__ import annotations

import math
import numbers
from typing import TypeVar

import torch
from torch.utils import _pytree as pytree

from vega.codegen.tensors import dense, not_dense
from vega.errors import shown
from vega.runtime.engine import as_float
from vega.runtime.tree import CONTAINERS, path_name, refuse_unwalked

__all__ = ["clip_by_global_norm", "clip_by_value", "global_norm"]

_Tree = TypeVar("_Tree")  # a pytree of gradients, and the one of the same structure made of it


def _float_leaf(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def float_leaves(who: str, grads) -> list:
    """The float (and complex) leaves of ``grads``; ValueError naming one that is sparse or
    nested, which torch's norms and finite checks have no kernel for (a NotImplementedError
    from deep inside torch), or a container torch's pytree does not walk into
    (``tree.refuse_unwalked``)."""
    found = pytree.tree_leaves(grads)
    leaves = [g for g in found if _float_leaf(g)]
    if len(leaves) != len(found) and any(isinstance(g, CONTAINERS) for g in found):
        refuse_unwalked(who, grads)
    if not all(map(dense, leaves)):
        pairs, _ = pytree.tree_flatten_with_path(grads)
        path, g = next((p, g) for p, g in pairs if _float_leaf(g) and not dense(g))
        _refuse(who, path, g)
    return leaves


def _refuse(who: str, path, g: torch.Tensor):
    name = path_name(path)
    which = f"the gradient {name!r}" if name else "the gradient"
    raise ValueError(f"{who}: {which} is {not_dense(g)}; {who} takes dense (strided) tensors")


def _real_view(g: torch.Tensor) -> torch.Tensor:
    """A complex leaf's values as real pairs (of a conjugate view, which torch.view_as_real
    refuses, its values' copy); a real leaf as it is."""
    return torch.view_as_real(g.resolve_conj()) if g.is_complex() else g


def _positive(who: str, name: str, value):
    """A Python number must be positive: returned as a float (an int past the float range,
    10**400, as inf: beyond every value); a tensor is taken as given (no host sync)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{who}: {name}={shown(value)} must be a positive number")
    x = as_float(value)
    if math.isnan(x) or x <= 0:
        raise ValueError(f"{who}: {name}={shown(value)} must be a positive number")
    return x


def _within(x: float, dtype: torch.dtype) -> float:
    """A bound as ``dtype`` holds it: rounded to it where past its range (``torch.clamp``
    refuses a bound a float16 tensor cannot hold, 1e5; every value of the tensor is within
    it, and an infinite one becomes what the bound rounds to)."""
    info = torch.finfo(dtype)
    if x <= info.max:
        return x
    ulp = info.max * info.eps / (2 - info.eps)  # (of the largest value; on the host, exact)
    return info.max if x < info.max + ulp / 2 else math.inf  # (a tie rounds to inf, even)


# A float32 norm on the CPU of a leaf longer than NORM_LONG is taken over chunks of
# NORM_CHUNK values: torch's CPU norm of one long run adds the squares into a few float32
# sums in turn, which stop growing as they get large (the norm of 2**24 values of 0.1 came
# out 0.9% low on one thread, of 2**29 values 37% low on two). The chunks' norms are
# squared and summed by torch.sum (pairwise: accurate), in float32 as before; a shorter
# leaf (off by some units in the last place at most) takes one call.
NORM_CHUNK, NORM_LONG = 256, 2**14


def _leaf_norm(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The L2 norm of one leaf in ``dtype`` (in chunks where it is a long float32 one on the
    CPU, ``NORM_LONG``: a leaf whose elements are not one run of memory in any order of its
    dimensions, a slice with a step, is copied into one)."""
    n = g.numel()
    if dtype != torch.float32 or g.device.type != "cpu" or n <= NORM_LONG:
        return torch.linalg.vector_norm(g, dtype=dtype)
    flat = g.reshape(-1) if g.is_contiguous() or torch.compiler.is_compiling() else \
        _stored_order(g)
    k = n // NORM_CHUNK
    parts = torch.linalg.vector_norm(flat[:k * NORM_CHUNK].view(k, NORM_CHUNK), dim=1,
                                     dtype=dtype)
    if n > k * NORM_CHUNK:
        tail = torch.linalg.vector_norm(flat[k * NORM_CHUNK:], dtype=dtype)
        parts = torch.cat([parts, tail.reshape(1)])
    return _fixed_sum(parts * parts).sqrt()


def _fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of a 1-d tensor, the same bits on any number of threads: torch's CPU sum of
    more than 32,768 values (its grain) adds each thread's share apart and then the shares,
    so that a leaf of more than 2**23 values (as many chunks) had a norm that changed in its
    last bit with ``torch.set_num_threads``. Longer ones are summed a row of NORM_CHUNK at a
    time (each row by one thread), the rows' sums then in turn."""
    while x.numel() > NORM_LONG:
        k = x.numel() // NORM_CHUNK
        rows = x[:k * NORM_CHUNK].view(k, NORM_CHUNK).sum(dim=1)
        if x.numel() > k * NORM_CHUNK:
            rows = torch.cat([rows, x[k * NORM_CHUNK:].sum().reshape(1)])
        x = rows
    return x.sum()


def _stored_order(g: torch.Tensor) -> torch.Tensor:
    """``g``'s elements flat in the order its memory holds them (a norm does not depend on
    the order): a view where they are one run, as for a channels_last or a transposed
    tensor's gradient, which ``reshape(-1)`` in its own order would copy."""
    order = sorted(range(g.dim()), key=g.stride, reverse=True)
    return g.permute(order).reshape(-1)


def global_norm(grads, *, reduce_group=None) -> torch.Tensor:
    """The joint L2 norm of all float leaves: a 0-d tensor, no host sync.

    Computed in float32 (half-precision leaves are widened), or in float64 if any
    leaf is float64 (or complex128). ``0.0`` (float32, CPU) if there is no float leaf.
    A long float32 leaf on the CPU is taken in chunks (``NORM_LONG``), whose norms are
    summed pairwise: torch's CPU norm of one long run loses digits.

    Across processes: DTensor leaves (FSDP2's gradients) count each value once, their
    local shards' sums of squares all-reduced over their mesh; ``reduce_group`` (a
    process group, as for ``ZeroRedundancyOptimizer``, whose ranks each hold other
    leaves) all-reduces the sum of squares over that group too. One collective each,
    and every rank of the group must call it.
    """
    return _global_norm("global_norm", grads, reduce_group)


def _global_norm(who: str, grads, reduce_group) -> torch.Tensor:
    from vega.runtime import sharded
    sharded.check_group(who, reduce_group)
    leaves = [_real_view(g) for g in float_leaves(who, grads)]
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in leaves) else torch.float32
    if sharded.involved(leaves, reduce_group):
        # the sum of squares in float64 on every rank (ranks may hold other dtypes), the
        # norm then in this rank's precision, as without a group
        return sharded.spanning_sum("global_norm", leaves, lambda x: torch.linalg.vector_norm(
            x, dtype=torch.float64).square(), reduce_group).sqrt().to(dtype)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    norms = [_leaf_norm(g, dtype) for g in leaves]
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def clip_by_global_norm(grads: _Tree, max_norm: float | torch.Tensor, *,
                        reduce_group=None) -> _Tree:
    """Rescale all float leaves together so that their joint L2 norm is at most ``max_norm``.

    Each leaf becomes ``g * max_norm / max(norm, max_norm)`` (optax's rule: the identity
    when the norm is below ``max_norm``), the coefficient formed at the norm's precision
    and applied at the leaf's dtype (in float32 for half-precision leaves). A non-finite
    norm makes the result non-finite too, so a finite check after clipping still sees
    the overflow (and finite float32 gradients whose sum of squares passes float32's
    range, a norm above about 1.8e19, whose norm is infinite there, are scaled to 0, as
    optax and torch's ``clip_grad_norm_`` do; the fused ``max_grad_norm=`` sums the
    squares in float64 and clips them). ``max_norm`` is
    a positive number (``inf``: no clipping) or a 0-d tensor.
    The norm is :func:`global_norm`'s, over ``reduce_group`` too where one is given (and
    over the mesh of DTensor leaves, which stay DTensors).
    """
    from vega.runtime import sharded
    max_norm = _positive("clip_by_global_norm", "max_norm", max_norm)
    sharded.check_group("clip_by_global_norm", reduce_group)
    if not isinstance(max_norm, torch.Tensor) and math.isinf(max_norm):
        return grads
    norm = _global_norm("clip_by_global_norm", grads, reduce_group)
    if isinstance(max_norm, torch.Tensor):
        coef = max_norm / torch.maximum(norm, max_norm.to(norm.device, norm.dtype))
    elif max_norm > torch.finfo(norm.dtype).max:  # (past the norm's range, 1e300 for a
        # float32 norm, which torch.clamp refuses: every finite norm is within it, and an
        # infinite one scales by 0, as by any bound; NaN stays NaN. Not the largest float32
        # as the bound: a number over a tensor is its reciprocal times the number, and the
        # largest's reciprocal is subnormal)
        coef = torch.where(torch.isinf(norm), 0.0, norm * 0 + 1)
    else:  # a scalar bound: no host-to-device copy (not allowed under CUDA graph capture)
        coef = max_norm / torch.clamp(norm, min=max_norm)

    def scaled(g):
        if g.dtype in (torch.float16, torch.bfloat16):
            return (g.float() * coef.to(g.device, torch.float32)).to(g.dtype)
        real = g.real.dtype  # (not dtype's to_real(), which dynamo cannot trace, nor
        return g * coef.to(g.device, real)  # view_as_real's, which refuses a conjugate view)

    def one(g):
        if not _float_leaf(g):
            return g
        if sharded.is_dtensor(g):  # (the coefficient is a plain tensor, the same on every rank)
            return sharded.rewrapped(scaled(g.to_local()), g)
        return scaled(g)
    return pytree.tree_map(one, grads)


def clip_by_value(grads: _Tree, max: float | torch.Tensor) -> _Tree:  # (max: the OCaml name)
    """Clamp every element of every float leaf to ``[-max, max]`` (``max`` positive).

    A complex leaf has its real and imaginary parts clamped separately; NaN stays NaN.
    """
    max = _positive("clip_by_value", "max", max)

    def one(path, g):
        if not _float_leaf(g):
            if isinstance(g, CONTAINERS):
                refuse_unwalked("clip_by_value", grads)
            return g
        if not dense(g):
            _refuse("clip_by_value", path, g)
        x = _real_view(g)
        m = max if isinstance(max, torch.Tensor) else _within(max, x.dtype)
        if g.is_complex():
            return torch.view_as_complex(torch.clamp(x, -m, m))
        return torch.clamp(g, -m, m)
    return pytree.tree_map_with_path(one, grads)
