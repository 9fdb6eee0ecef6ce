"""Pytrees of tensors, by torch's own pytree utilities, and the names of their leaves."""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def flatten(tree):
    """Leaves (``None`` counted as a leaf, so structures stay aligned) and the structure."""
    return pytree.tree_flatten(tree, is_leaf=lambda x: x is None)


def unflatten(leaves, spec):
    return pytree.tree_unflatten(list(leaves), spec)


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> list[str]:
    """Dotted paths of the tensor leaves: ``['layer1.weight', 'layer1.bias', ...]``."""
    pairs, _ = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [".".join(_key(k) for k in path) for path, leaf in pairs if leaf is not None]


def state_names(state: dict) -> list[str]:
    """Names of a state's leaves, ``field.param_path``: ``['mu.w', 'mu.b', ..., 'step']``."""
    if not isinstance(state, dict):
        raise TypeError(f"a state is a dict of fields, got {type(state).__name__}")
    names = []
    for field, sub in state.items():
        paths = leaf_paths(sub)
        names += [f"{field}.{p}" if p else field for p in paths]
    return names


def is_steppable(x) -> bool:
    """Float and complex tensors step; every other leaf passes through unchanged."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
