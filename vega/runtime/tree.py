"""Pytrees of tensors, by torch's own pytree utilities, and the names of their leaves."""
from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
from torch.utils import _pytree as pytree

from vega.codegen.tensors import PLAIN_OR_NONE


def flatten(tree):
    """Leaves (``None`` counted as a leaf, so structures stay aligned) and the structure.

    A dict, list or tuple whose items are all plain tensors, parameters or None (the common
    tree of a functional step: names to tensors, or a list of them) is flattened without
    torch's walk over its leaves (a Python call a leaf, several microseconds a tensor), to
    the leaves and the structure that walk gives: its items in order, and one spec per
    tuple of keys (a list's or a tuple's: its length), made once (eagerly: not while
    dynamo traces, which would guard on the cache)."""
    kind = type(tree)
    if kind in _FLAT_KINDS and not torch.compiler.is_compiling():
        values = list(tree.values()) if kind is dict else list(tree)
        if PLAIN_OR_NONE.issuperset(map(type, values)):  # (leaves whatever is registered)
            keys = (kind, tuple(tree), _types(tree)) if kind is dict else (kind, len(values))
            return _cached(keys, tree, values)
        leaves: list = []
        shape = _nested(tree, leaves)
        if shape is not None:
            return _cached((shape, len(leaves)), tree, leaves)
    return pytree.tree_flatten(tree, is_leaf=_is_none)


def _cached(keys, tree, leaves: list):
    """(leaves, the spec cached for ``keys``), the spec made by torch's walk the first time;
    torch's walk's own (leaves, spec) where it gives other leaves (a torch whose dicts
    flatten in another order)."""
    spec = _FLAT_SPECS.get(keys)
    if spec is None:
        found, spec = pytree.tree_flatten(tree, is_leaf=_is_none)
        if len(found) != len(leaves) or any(map(operator.is_not, found, leaves)):
            return found, spec
        if len(_FLAT_SPECS) >= 64:
            _FLAT_SPECS.clear()
            _FLAT_KEYS.clear()
        _FLAT_SPECS[keys] = spec
        _FLAT_KEYS[id(spec)] = keys
    return leaves, spec


def _nested(tree, leaves: list):
    """The shape of a tree of dicts, lists and tuples whose leaves are all plain tensors,
    parameters or None (a model's layers, a list of dicts of tensors), its leaves appended to
    ``leaves`` in the order of torch's walk; None where something else is in it (a
    namedtuple, a registered node, a number), which torch's walk then flattens. A shape is
    (kind, its keys or length, the shape of each item: None for a leaf, its keys' types
    where one is not a string: ``_types``), hashable: a
    structure's spec is made once by torch's walk, where that walk made a node a container
    and a call a leaf at every step (18 us a leaf in a list of dicts of two tensors)."""
    kind = type(tree)
    items = tree.values() if kind is dict else tree
    subs = []
    for item in items:
        of = type(item)
        if of in PLAIN_OR_NONE:
            leaves.append(item)
            subs.append(None)
        elif of in _FLAT_KINDS:
            sub = _nested(item, leaves)
            if sub is None:
                return None
            subs.append(sub)
        else:
            return None
    if kind is dict:
        return kind, tuple(tree), tuple(subs), _types(tree)
    return kind, len(subs), tuple(subs), None


def _types(d: dict):
    """A dict's keys' types, where one is not a string: keys equal in value but not in type
    (1, 1.0 and True) are other trees (torch's walk keeps each key as it is), which a spec
    cached by the keys' values alone gave back the first one's keys."""
    types = set(map(type, d))
    return None if types <= {str} else tuple(map(type, d))


def _built(shape, leaves):
    """The tree of ``shape`` (``_nested``'s) holding the next items of iterator
    ``leaves``."""
    kind, names, subs, _ = shape
    items = [next(leaves) if sub is None else _built(sub, leaves) for sub in subs]
    if kind is dict:
        return dict(zip(names, items))
    return items if kind is list else tuple(items)


def unflatten(leaves, spec):
    keys = None if torch.compiler.is_compiling() else _FLAT_KEYS.get(id(spec))
    if keys is not None and _FLAT_SPECS.get(keys) is spec:  # (a flat one's: ``flatten``)
        leaves = list(leaves)
        kind, names = keys[:2]
        if type(kind) is tuple:  # (a nested one's: its shape, its count of leaves)
            if len(leaves) == names:
                return _built(kind, iter(leaves))
        elif kind is dict and len(leaves) == len(names):
            return dict(zip(names, leaves))
        if kind is not dict and len(leaves) == names:
            return leaves if kind is list else tuple(leaves)
    return pytree.tree_unflatten(list(leaves), spec)


def _is_none(x) -> bool:
    return x is None


_FLAT_KINDS = frozenset({dict, list, tuple})
# containers that torch's pytree takes as one leaf where it is not a registered node (a dict
# subclass, a UserDict, a tuple subclass not a namedtuple): their tensors are not walked
CONTAINERS = (Mapping, list, tuple)


def holds_tensor(x) -> bool:
    """Whether ``x``, a leaf of torch's pytree, is a container (``CONTAINERS``) with a tensor
    somewhere in it (not a torch.Size, a tuple of ints)."""
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, CONTAINERS):
        return any(map(holds_tensor, x.values() if isinstance(x, Mapping) else x))
    return False


def refuse_unwalked(who: str, grads) -> None:
    """ValueError naming the first leaf of ``grads`` that is a container torch's pytree does
    not walk into (``CONTAINERS``) holding a tensor, if any: its gradients would be
    left out unseen (an overflow read as finite, a norm as 0, clipping and unscaling
    passing them unchanged)."""
    pairs, _ = pytree.tree_flatten_with_path(grads)
    for path, g in pairs:
        if isinstance(g, CONTAINERS) and holds_tensor(g):
            where = f"grads leaf {path_name(path)!r}" if path else "grads"
            raise ValueError(
                f"{who}: {where} is a {type(g).__name__}, which torch's pytree takes as one "
                "leaf, not walking into it (it walks dict, list, tuple, OrderedDict, "
                "defaultdict, namedtuple and registered types, not their subclasses): its "
                "gradients would be left out. Give a dict, list or tuple of them, or register "
                "the type with torch.utils._pytree.register_pytree_node")


# (dict, its keys), (list or tuple, its length), or (a nested tree's shape, its count of
# leaves: ``_nested``) -> its TreeSpec (made by torch's walk, once); the id of such a spec
# -> those (checked against _FLAT_SPECS on use)
_FLAT_SPECS: dict = {}
_FLAT_KEYS: dict = {}


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_name(path) -> str:
    """A pytree path's dotted name (``'layer1.weight'``; ``''`` for the root)."""
    return ".".join(_key(k) for k in path)


def leaf_paths(tree) -> list[str]:
    """Dotted paths of the tensor leaves: ``['layer1.weight', 'layer1.bias', ...]``."""
    pairs, _ = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [path_name(path) for path, leaf in pairs if leaf is not None]


def state_names(state: dict) -> list[str]:
    """Names of a state's leaves, ``field.param_path``: ``['mu.w', 'mu.b', ..., 'step']``."""
    if not isinstance(state, dict):
        raise TypeError(f"vega.state_names: a state is the dict of fields that <name>_init "
                        f"returns, got {type(state).__name__}")
    names = []
    for field, sub in state.items():
        paths = leaf_paths(sub)
        names += [f"{field}.{p}" if p else str(field) for p in paths]
    return names


def is_steppable(x) -> bool:
    """Float and complex tensors step; every other leaf passes through unchanged."""
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())
