"""L-BFGS at a fixed rate: ``lbfgs_init`` and ``lbfgs_step``, optax's ``lbfgs`` with no line search.

The two-loop recursion that applies the L-BFGS inverse-Hessian approximation
takes inner products over *all* parameters with each of the last ``memory_size``
curvature pairs, one pair after another, each step's coefficient depending on
the previous one. That is a sequence of global reductions over a history, which
the spec language (per-element programs, reductions over one tensor or one
global reduction per phase) cannot say. So L-BFGS is written here, in the
runtime, as eager tensor arithmetic over the same kind of state as the compiled
optimizers: a dict of named fields whose parameter-shaped leaves have the
parameters' structure, plus ``step``.

The rule is optax's ``lbfgs(learning_rate=lr, memory_size=m,
scale_init_precond=..., linesearch=None)`` (``optax/_src/transform.py``
``scale_by_lbfgs``), step for step:

1. with ``k`` the completed steps, the newest curvature pair
   ``s = params - params_prev``, ``y = grads - updates_prev`` and its weight
   ``rho = 1 / <y, s>`` (0 where ``<y, s> = 0``) are written at slot
   ``(k - 1) % m`` of the ring buffers; at ``k = 0`` they are all zero, so an
   unused slot contributes nothing to the recursion;
2. the initial inverse Hessian is ``gamma * I`` with ``gamma = <y, s> / <y, y>``
   (1 where ``<y, y> = 0``) -- or, at the first step, ``min(1, 1 / ||g||)``
   (a trust region of radius 1); ``gamma = 1`` with ``scale_init_precond=False``;
3. the two-loop recursion runs over the slots from the oldest, ``k % m``, to the
   newest;
4. ``params - lr(k) * direction``; the state keeps ``params`` and ``grads`` of
   this step (before the update) for the next pair.

State (``lbfgs_init``): ``diff_params`` and ``diff_updates`` are the ring
buffers, each leaf of shape ``(memory_size, *p.shape)``; ``weights`` the
``(memory_size,)`` vector of ``rho``; ``params_prev`` and ``updates_prev`` the
previous parameters and gradients (optax's ``params`` and ``updates``);
``step`` the int32 0-d counter of completed steps, a saturating add. Leaves are
named ``diff_params.w``, ..., ``weights``, ..., ``step``.

Everything is tensor arithmetic on the device: the slot is ``step % m`` as a
tensor (``index_copy``, ``index_select``), the first-step case is a
``torch.where``, and nothing is read back to the host, so a step compiles under
``torch.compile(fullgraph=True)`` and replays under CUDA graphs. The step is
pure by default; ``donate=True`` updates params and state in place.

Leaves that are neither float nor complex tensors pass through unchanged (their
state leaves are ``None``). A complex parameter steps as its two real
coordinates (``torch.view_as_real``) -- which is also what optax computes,
since it takes the real part of every inner product. Its state is complex: a real
``state_dtype`` keeps its complex counterpart for it (complex128 for float64), and a
complex one keeps its real counterpart for a real parameter. Half-precision parameters
keep float32 state by default (``state_dtype``), as vega's other optimizers do.
The inner products and ``weights`` are in float64 if any state leaf is float64,
else in float32. A float leaf whose gradient is ``None`` steps with a zero gradient,
as torch.optim.LBFGS takes it (the loss does not depend on it): the curvature pairs
span every leaf at every step, and a leaf that never has a gradient never moves.
DTensor parameters (FSDP2) are refused; under DDP or ZeroRedundancyOptimizer,
``reduce_group`` spans the ranks.
"""
from __future__ import annotations

import math
import numbers
import sys
import weakref
from functools import partial
from typing import Callable, TypeVar, overload

import torch

from vega.codegen.steps import advance_steps
from vega.codegen.tensors import (LAZY_LOAD_WORDS, dense, dense_words, inplace_problem,
                                  is_dtensor, not_dense, uninitialized)
from vega.runtime import sharded, torch_names
from vega.dsl.ast import Range
from vega.runtime.engine import (as_float, check_reach, check_state_dtype,
                                 loaded_state_dtype, saved_groups, scheduled, shown,
                                 state_dtype_for, under_transforms, zeros,
                                 class_step_transforms)
from vega.runtime.spec import (_check_dense, _check_leaves, _label, _paths, flatten_pair,
                               stepped)
from vega.runtime.tree import flatten, is_steppable, unflatten
from vega.schedule import Schedule

_Loss = TypeVar("_Loss")  # what a step's closure returns, and the step (its loss)
_Params = TypeVar("_Params")  # a pytree of parameters, and one of its structure

__all__ = ["LBFGS", "lbfgs_init", "lbfgs_step"]

MEMORY_FIELDS = ("diff_params", "diff_updates")
PREV_FIELDS = ("params_prev", "updates_prev")
TREE_FIELDS = ("diff_params", "diff_updates", "params_prev", "updates_prev")
# the settings of the class's group, each read by a step
_SETTINGS = ("lr", "memory_size", "scale_init_precond", "state_dtype")
FIELDS = ("diff_params", "diff_updates", "weights", "params_prev", "updates_prev", "step")


# -- arguments --------------------------------------------------------------------------

def _check_memory_size(owner: str, memory_size) -> int:
    if isinstance(memory_size, bool) or not isinstance(memory_size, numbers.Integral) \
            or memory_size < 1:
        raise ValueError(f"{owner}: memory_size={memory_size!r} must be a positive integer")
    return int(memory_size)


_LR_RANGE = Range(0.0, math.inf, True, False, None)  # (lr's: a finite number >= 0)


def _check_lr(owner: str, lr):
    """A float >= 0, a 0-d float tensor (taken as given: no host sync) or a schedule."""
    if isinstance(lr, torch.Tensor):
        if lr.dim() != 0 or not lr.is_floating_point():
            raise ValueError(f"{owner}: lr must be a 0-d float tensor, got shape "
                             f"{tuple(lr.shape)} and dtype {lr.dtype}")
        if lr.device.type == "meta":
            raise ValueError(f"{owner}: lr is a meta tensor, which has no value: give a "
                             "tensor on the parameters' device, or a float")
        return lr
    if callable(lr):
        if isinstance(lr, Schedule) and lr.elementwise():
            check_reach(owner, "lr", _LR_RANGE, lr)
        return lr
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise ValueError(f"{owner}: lr={lr!r} must be a float, a 0-d tensor or a schedule "
                         "(a callable of the step counter)")
    value = as_float(lr)
    if not 0 <= value <= sys.float_info.max:  # (compared, as dynamo traces a symbolic float)
        raise ValueError(f"{owner}: lr={shown(lr)} must be a finite number >= 0")
    return value


def _check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name}={value!r} must be True or False")


def _tree_dtype(p: torch.Tensor, state_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of parameter ``p``'s state: ``state_dtype_for``'s, complex where ``p`` is and
    real where it is not (a real ``state_dtype`` given for a complex parameter its complex
    counterpart, complex128 for float64, else complex64; a complex one for a real parameter
    its real counterpart, as the spec optimizers take it)."""
    sd = state_dtype_for(p, state_dtype)
    if p.is_complex() and not sd.is_complex:
        sd = torch.complex128 if sd == torch.float64 else torch.complex64
    elif not p.is_complex() and sd.is_complex:
        sd = sd.to_real()
    return sd


def _scalar_dtype(state_dtypes) -> torch.dtype:
    """float64 if any (real) state dtype is float64, else float32."""
    return torch.float64 if any(d == torch.float64 for d in state_dtypes) else torch.float32


# -- init -------------------------------------------------------------------------------

def lbfgs_init(params, *, memory_size: int = 10, state_dtype: torch.dtype | None = None) -> dict:
    """A fresh L-BFGS state for ``params`` (any pytree of tensors).

    ``memory_size`` (a positive int) is the number of curvature pairs kept;
    ``state_dtype`` the dtype of the parameter-shaped state (default: the
    parameter's, float32 for bfloat16/float16 parameters).
    """
    owner = "lbfgs_init"
    m = _check_memory_size(owner, memory_size)
    check_state_dtype(owner, state_dtype)
    leaves, spec = flatten(params)
    _check_leaves(owner, "params", params, leaves)
    _check_dense(owner, params, leaves)  # (as the spec optimizers' inits: the step refuses it)
    steppable = [p for p in leaves if is_steppable(p)]
    first = steppable[0] if steppable else None
    device = torch.device("cpu") if first is None else first.device
    fields = {f: [] for f in TREE_FIELDS}
    real_dtypes = []
    with torch.no_grad():
        for p in leaves:
            if not is_steppable(p):
                for f in TREE_FIELDS:
                    fields[f].append(None)
                continue
            sd = _tree_dtype(p, state_dtype)
            real_dtypes.append(sd.to_real() if sd.is_complex else sd)
            for f in MEMORY_FIELDS:
                fields[f].append(zeros(p, (m, *p.shape), sd, p.device))
            for f in PREV_FIELDS:
                fields[f].append(zeros(p, p.shape, sd, p.device))
    return {
        "diff_params": unflatten(fields["diff_params"], spec),
        "diff_updates": unflatten(fields["diff_updates"], spec),
        "weights": zeros(first, (m,), _scalar_dtype(real_dtypes), device),
        "params_prev": unflatten(fields["params_prev"], spec),
        "updates_prev": unflatten(fields["updates_prev"], spec),
        "step": zeros(first, (), torch.int32, device),  # (vmap: each member's own)
    }


# -- step -------------------------------------------------------------------------------

def _check_state(owner: str, state, p_spec, memory_size) -> int:
    if not isinstance(state, dict):
        raise ValueError(f"{owner}: state must be the dict that lbfgs_init returns, "
                         f"got {type(state).__name__}")
    if set(state) != set(FIELDS):
        raise ValueError(f"{owner}: state has fields {sorted(state)}, but lbfgs needs "
                         f"{sorted(FIELDS)}; make it with lbfgs_init(params)")
    m = _check_weights_step(owner, state["weights"], state["step"], "state")
    if memory_size is not None:
        given = _check_memory_size(owner, memory_size)
        if given != m:
            raise ValueError(f"{owner}: memory_size={memory_size!r}, but the state was made "
                             f"with memory_size={m}")
    for f in TREE_FIELDS:
        if flatten(state[f])[1] != p_spec:
            raise ValueError(f"{owner}: state field '{f}' does not have the structure of params")
    return m


def _check_weights_step(owner: str, weights, step, where: str, m: int | None = None) -> int:
    """The memory size of the L-BFGS state whose ``weights`` and ``step`` are these (``where``
    they are: ``state`` or the first parameter's), or ValueError: ``weights`` a float32 or
    float64 tensor of shape (memory_size,) (``(m,)`` where given), ``step`` a 0-d int32
    tensor on its device."""
    size = f"({m},) (memory_size)" if m is not None else "(memory_size,)"
    if not (isinstance(weights, torch.Tensor) and weights.dim() == 1
            and weights.dtype in (torch.float32, torch.float64)
            and (weights.shape[0] == m if m is not None else weights.shape[0] >= 1)):
        raise ValueError(f"{owner}: {where}['weights'] must be a float32 or float64 tensor "
                         f"of shape {size}, got {shown(weights)}")
    if not (isinstance(step, torch.Tensor) and step.dim() == 0 and step.dtype == torch.int32
            and step.device == weights.device):
        raise ValueError(f"{owner}: {where}['step'] must be a 0-d int32 tensor on "
                         f"{weights.device}, got {shown(step)}")
    return weights.shape[0]


def _check_state_leaves(owner: str, name, p: torch.Tensor, leaves: dict, m: int) -> None:
    dtype = None
    for f, s in leaves.items():
        label = partial(_label, f, name)  # found only for a message
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{owner}: state leaf '{label()}' is missing")
        want = (m, *p.shape) if f in MEMORY_FIELDS else tuple(p.shape)
        if tuple(s.shape) != want or s.device != p.device:
            raise ValueError(f"{owner}: state leaf '{label()}' has shape {tuple(s.shape)} on "
                             f"{s.device}, but needs {want} on {p.device}")
        if s.is_complex() != p.is_complex() or not (s.is_floating_point() or s.is_complex()):
            raise ValueError(f"{owner}: state leaf '{label()}' has dtype {s.dtype}, the "
                             f"parameter {p.dtype}")
        if dtype is not None and s.dtype != dtype:
            raise ValueError(f"{owner}: state leaf '{label()}' has dtype {s.dtype}, the other "
                             f"state leaves of its parameter {dtype}")
        dtype = s.dtype


def _check_meta(owner: str, tensors: list, label) -> None:
    """ValueError where some of ``tensors`` (a step's parameters, then its ``weights``) are on
    meta and others are not: the inner products span every parameter, and a meta tensor has
    no values to add to the others' (torch failed inside the first product: "Cannot copy out
    of meta tensor; no data!"). ``label(k)`` names tensor ``k``."""
    sharded.check_meta(owner, tensors, label,
                       "L-BFGS's inner products span every parameter, so they step")


def _zero_for_none(p, g):
    """A gradient of ``None`` for a parameter that steps is a zero gradient (as
    torch.optim.LBFGS takes it): the loss does not depend on the parameter, and the curvature
    pairs span every parameter at every step. (Leaving it out of a step would pair its part
    of the ring buffers, written at another step, with this step's weight.)"""
    if g is None and isinstance(p, torch.Tensor) and is_steppable(p) and dense(p):
        return torch.zeros_like(p)
    return g


def _refuse_dtensors(owner: str, params) -> None:
    """ValueError for a DTensor parameter (FSDP2, tensor parallel), before any state is
    made: the two-loop recursion's inner products take whole parameters."""
    for i, p in enumerate(params):
        if is_dtensor(p):
            raise ValueError(f"{owner}: parameter {i} is a DTensor (placements "
                             f"{tuple(p.placements)}): L-BFGS does not step DTensors (its "
                             "inner products take whole tensors); under DDP or "
                             "ZeroRedundancyOptimizer give it reduce_group "
                             "(docs/distributed.md)")


def _real(x: torch.Tensor, resolve: bool = True) -> torch.Tensor:
    """A complex tensor's real view; a conjugate's, of a resolved copy (which a step in place
    writes, ``_write_back``), or, not ``resolve``, of itself, which torch refuses (while dynamo
    traces a step in place, which cannot ask which are conjugates: ``engine.as_real``)."""
    return torch.view_as_real(x.resolve_conj() if resolve else x) if x.is_complex() else x


def _write_back(tensors, reals) -> None:
    """After a step in place over ``_real``'s views of ``tensors``: each conjugate given the
    new values of the resolved copy that stepped, as the spec optimizers' steps give them
    (``engine.as_complex``); its update was lost, where the state's advanced."""
    if torch.compiler.is_compiling():
        return
    for t, r in zip(tensors, reals):
        if t.is_complex() and t.is_conj():
            t.copy_(torch.view_as_complex(r))


def _complex_like(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(x) if like.is_complex() else x


def _acc(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


# A float32 inner product on the CPU of leaves longer than this is the pairwise sum
# (torch.sum) of the products: torch.dot there adds them into a few float32 sums in turn,
# which stop growing as they get large (2**24 products of 0.1 and 0.3: 1% off on one
# thread; 2**27: 3% on two). It makes a temporary of the leaf's products.
DOT_LONG = 2**14


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """<x, y> of two flat tensors of one dtype (``DOT_LONG``)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > DOT_LONG:
        return (x * y).sum()
    return torch.dot(x, y)


def _tree_dot(xs, ys, dtype, device) -> torch.Tensor:
    """sum over leaves of <x, y>, each leaf's product in its own precision (at least
    float32), accumulated in ``dtype`` on ``device``."""
    total = None
    for x, y in zip(xs, ys):
        acc = _acc(x.dtype)
        d = _dot(x.reshape(-1).to(acc), y.reshape(-1).to(acc)).to(device, dtype)
        total = d if total is None else total + d
    return torch.zeros((), dtype=dtype, device=device) if total is None else total


def _dots(pairs, dtype, device, group) -> list[torch.Tensor]:
    """``_tree_dot`` of each ``(xs, ys)`` of ``pairs``, summed over the ranks of ``group``
    (a process group, or None) in one all-reduce for all of them: in float64 on the
    group's device (ranks whose parameters differ in dtype reduce one buffer alike), then
    in ``dtype`` on ``device``."""
    out = [_tree_dot(xs, ys, dtype, device) for xs, ys in pairs]
    if group is None:
        return out
    import torch.distributed as dist
    buf = torch.stack(out).to(sharded.group_device(group), torch.float64)
    dist.all_reduce(buf, group=group)
    return list(buf.to(device, dtype).unbind())


def _on(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.to(like.device, like.dtype)


def _lbfgs(P, G, DW, DU, PP, UP, weights, step, lr, m, scale_init, donate, group=None,
           restart=False):
    """One step over lists of real tensors (already viewed as real). Returns the new
    params, ring buffers, previous params/grads, weights and step. ``group``: the process
    group every inner product is summed over (each rank holding other parameters): one
    all-reduce for the curvature pair's products, one for each slot of the recursion.
    ``restart``: the step is a first step (no curvature pair of the last move, the first
    step's scale), the history's weights, zero, given by the caller (``LBFGS.step``)."""
    wd, dev = weights.dtype, weights.device
    if callable(lr) and not isinstance(lr, torch.Tensor):  # (evaluated and checked before
        lr = scheduled("lr", lr(step))                      # anything is written)
        if isinstance(lr, torch.Tensor):
            lr = lr.reshape(())  # (one element: a parameter keeps its shape)
    count = step.long()
    first = torch.ones((), dtype=torch.bool, device=dev) if restart else step == 0
    pos = ~first
    prev_slot = torch.remainder(count - 1, m).reshape(1)
    order = torch.remainder(count + torch.arange(m, device=dev), m)  # oldest slot first

    # 1. the newest curvature pair, zero at the first step
    S, Y = [], []
    for p, g, pp, up in zip(P, G, PP, UP):
        here = pos.to(pp.device)
        S.append(torch.where(here, p.to(pp.dtype) - pp, 0))
        Y.append(torch.where(here, g.to(up.dtype) - up, 0))
    if scale_init:
        sy, yy, gg = _dots([(Y, S), (Y, Y), (G, G)], wd, dev, group)
    else:
        sy, = _dots([(Y, S)], wd, dev, group)
    rho = torch.where(sy == 0, 0, sy.reciprocal())
    rho = torch.where(pos, rho, 0)
    if donate:
        for buf, new in zip(DW + DU, S + Y):
            buf.index_copy_(0, prev_slot.to(buf.device), new.unsqueeze(0))
        weights.index_copy_(0, prev_slot, rho.reshape(1))
        NDW, NDU, NW = DW, DU, weights
    else:
        NDW = [b.index_copy(0, prev_slot.to(b.device), s.unsqueeze(0)) for b, s in zip(DW, S)]
        NDU = [b.index_copy(0, prev_slot.to(b.device), y.unsqueeze(0)) for b, y in zip(DU, Y)]
        NW = weights.index_copy(0, prev_slot, rho.reshape(1))

    # 2. the scale of the initial inverse Hessian
    gamma = None
    if scale_init:
        gamma = torch.where(yy > 0, sy / yy, 1.0)
        gnorm = torch.sqrt(gg)
        gamma = torch.where(first, torch.clamp(gnorm.reciprocal(), max=1.0), gamma)

    # 3. the two-loop recursion, slots from the oldest to the newest
    OW = [b.index_select(0, order.to(b.device)) for b in NDW]
    OU = [b.index_select(0, order.to(b.device)) for b in NDU]
    rhos = NW.index_select(0, order)
    vec = [g.to(up.dtype) for g, up in zip(G, UP)]
    alphas = [None] * m
    for k in reversed(range(m)):
        a = rhos[k] * _dots([([w[k] for w in OW], vec)], wd, dev, group)[0]
        alphas[k] = a
        vec = [torch.addcmul(v, u[k], _on(-a, v)) for v, u in zip(vec, OU)]
    if gamma is not None:
        vec = [v * _on(gamma, v) for v in vec]
    for k in range(m):
        b = rhos[k] * _dots([([u[k] for u in OU], vec)], wd, dev, group)[0]
        vec = [torch.addcmul(v, w[k], _on(alphas[k] - b, v)) for v, w in zip(vec, OW)]

    # 4. the update at the rate lr(step)
    new_p = []
    for p, v in zip(P, vec):
        u = v * (-lr if not isinstance(lr, torch.Tensor) else _on(-lr, v))
        new_p.append((p.to(u.dtype) + u).to(p.dtype))
    if donate:
        for pp, up, p, g, n in zip(PP, UP, P, G, new_p):
            pp.copy_(p)
            up.copy_(g)
            p.copy_(n)
        NPP, NUP, new_p = PP, UP, P
    else:
        NPP = [p.to(pp.dtype, copy=True) for p, pp in zip(P, PP)]
        NUP = [g.to(up.dtype, copy=True) for g, up in zip(G, UP)]
    new_step = advance_steps([step], None, donate)[0]
    return new_p, NDW, NDU, NPP, NUP, NW, new_step


def lbfgs_step(params: _Params, grads, state, *, lr=1.0, memory_size: int | None = None,
               scale_init_precond: bool = True, donate: bool = False, reduce_group=None,
               **others) -> tuple[_Params, dict]:
    """One L-BFGS update at the rate ``lr``: returns (params, state). Pure unless ``donate=True``.

    optax's ``lbfgs(learning_rate=lr, memory_size, scale_init_precond,
    linesearch=None)``: ``params - lr * H g`` with ``H`` the L-BFGS inverse-Hessian
    approximation from the last ``memory_size`` pairs of parameter and gradient
    differences. ``lr`` is a float >= 0, a 0-d tensor or a schedule (called with
    the state's step tensor, the number of completed steps). ``memory_size`` is
    the state's (given here, it must agree with it). No line search: at a fixed
    rate the step is only as safe as the rate; with ``scale_init_precond`` the first step
    has norm at most ``lr`` (its direction is ``g / max(1, ||g||)``; without, ``g``).
    ``reduce_group``: a process group
    whose ranks each hold other parameters (``ZeroRedundancyOptimizer``'s): every inner
    product spans all of them, all-reduced over the group (``2 * memory_size + 1``
    all-reduces a step; every rank of the group must step).
    """
    owner = "lbfgs_step"
    _refuse_fused(owner, others, owner)  # (max_grad_norm, ...: the spec steps' options)
    sharded.check_group(owner, reduce_group)
    lr = _check_lr(owner, lr)
    _check_bool(owner, "scale_init_precond", scale_init_precond)
    _check_bool(owner, "donate", donate)
    under_transforms(owner, None, donate, backends=False)  # (grad refused; vmap, jvp pure)
    p_leaves, p_spec, g_leaves = flatten_pair(owner, params, grads)
    _refuse_dtensors(owner, p_leaves)
    g_leaves = [_zero_for_none(p, g) for p, g in zip(p_leaves, g_leaves)]
    m = _check_state(owner, state, p_spec, memory_size)
    cols = {f: flatten(state[f])[0] for f in TREE_FIELDS}
    idx = stepped(owner, params, p_leaves, g_leaves, lambda i, name, p: _check_state_leaves(
        owner, name, p, {f: cols[f][i] for f in TREE_FIELDS}, m))
    weights, step = state["weights"], state["step"]
    _check_meta(owner, [*(p_leaves[i] for i in idx), weights],  # (names found for a message)
                lambda k: f"params leaf '{_paths(params, p_leaves)[idx[k]]}'" if k < len(idx)
                else "state['weights']")
    if donate and not torch.compiler.is_compiling():  # (before any write)
        _check_donated(owner, params, p_leaves, g_leaves, cols, idx, weights, step)
    resolve = not (donate and torch.compiler.is_compiling())
    written = [[p_leaves[i] for i in idx], *([cols[f][i] for i in idx] for f in TREE_FIELDS)]
    reals = [[_real(x, resolve) for x in col] for col in written]
    with torch.no_grad():
        new_p, ndw, ndu, npp, nup, nw, new_step = _lbfgs(
            reals[0], [_real(g_leaves[i]) for i in idx], *reals[1:],
            weights, step, lr, m, scale_init_precond, donate, reduce_group)
        if donate:
            _write_back([x for col in written for x in col], [x for col in reals for x in col])
    out_p = list(p_leaves)
    out = {f: list(cols[f]) for f in TREE_FIELDS}
    for k, i in enumerate(idx):
        p = p_leaves[i]
        if not donate:
            out_p[i] = _complex_like(new_p[k], p)
            if p.requires_grad:
                out_p[i].requires_grad_(True)
            for f, new in zip(TREE_FIELDS, (ndw, ndu, npp, nup)):
                out[f][i] = _complex_like(new[k], p)
    return unflatten(out_p, p_spec), {
        "diff_params": unflatten(out["diff_params"], p_spec),
        "diff_updates": unflatten(out["diff_updates"], p_spec),
        "weights": nw,
        "params_prev": unflatten(out["params_prev"], p_spec),
        "updates_prev": unflatten(out["updates_prev"], p_spec),
        "step": new_step,
    }


def _check_donated(owner, params, p_leaves, g_leaves, cols, idx, weights, step) -> None:
    """ValueError, naming the leaf, where a step in place (``donate=True``) cannot write a
    parameter, a state leaf, the weights or the counter (an expanded parameter), or would read
    a gradient sharing memory with one (``vega.codegen.tensors.inplace_problem``), as the
    other functional steps check theirs: before anything is written."""
    fields = (None, *TREE_FIELDS)
    written = [(p_leaves if f is None else cols[f])[i] for f in fields for i in idx]
    written += [weights, step]
    problem = inplace_problem(written, [g_leaves[i] for i in idx])
    if problem is None:
        return
    paths = _paths(params, p_leaves)
    n = len(idx)

    def label(k: int) -> str:
        if k >= len(written):
            return f"grads leaf '{paths[idx[k - len(written)]]}'"
        if k < len(fields) * n:
            f, j = divmod(k, n)
            return f"params leaf '{paths[idx[j]]}'" if fields[f] is None else \
                f"state leaf '{_label(fields[f], lambda: paths[idx[j]])}'"
        return f"state['{('weights', 'step')[k - len(fields) * n]}']"
    k, other, words = problem
    raise ValueError(f"{owner}: {label(k)} "
                     f"{words.format(other=label(other)) if other is not None else words}")


# -- torch.optim ------------------------------------------------------------------------

_TORCH_LBFGS = ("history_size", "max_iter", "max_eval", "tolerance_grad", "tolerance_change",
                "line_search_fn")
# torch.optim.LBFGS's hyperparameters after lr, in its order (by position)
_TORCH_POSITIONAL = ("max_iter", "max_eval", "tolerance_grad", "tolerance_change",
                     "history_size", "line_search_fn")


# the fused options of the spec optimizers, which L-BFGS (no kernel of a spec) has not:
# what does each on the gradients before its step
_FUSED = {"max_grad_norm": "vega.clip_by_global_norm(grads, max_norm) clips them",
          "loss_scale": "LossScale.unscale(grads) unscales them and vega.grads_finite(grads) "
                        "checks them",
          "skip_nonfinite": "vega.grads_finite(grads) checks them"}


def _refuse_fused(owner: str, given: dict, call: str) -> None:
    """TypeError for a fused option of the spec optimizers (``max_grad_norm``, ...), saying
    that L-BFGS has none and what does it on the gradients, and for ``backend``, which it
    has not either; else Python's own words for an unexpected keyword."""
    for key in given:
        if key == "backend":
            raise TypeError(f"{owner}: backend={shown(given[key])} chooses the kernels of "
                            "vega's spec optimizers; L-BFGS, written in the runtime, steps in "
                            "torch's operations on the parameters' device, and has no backends")
        if key in _FUSED:
            raise TypeError(f"{owner}: {key}={shown(given[key])} is an option of vega's spec "
                            "optimizers, fused into their kernels; L-BFGS, written in the "
                            "runtime, takes none of max_grad_norm, loss_scale and "
                            f"skip_nonfinite: before its step, {_FUSED[key]}")
        raise TypeError(f"{call}() got an unexpected keyword argument {key!r}")


def _refuse_torch_keywords(owner: str, given: dict) -> None:
    """TypeError for a keyword the class does not take, saying what torch.optim.LBFGS's
    keywords are here: ``history_size`` is ``memory_size``; the others set its line search
    and inner loop, which this fixed-rate rule has not."""
    for key in given:
        if key == "history_size":
            raise TypeError(f"{owner}: history_size={shown(given[key])} is torch.optim.LBFGS's "
                            "name; give memory_size=..., the number of curvature pairs kept")
        if key in _TORCH_LBFGS:
            raise TypeError(f"{owner}: {key}={shown(given[key])} is a keyword of "
                            "torch.optim.LBFGS's line search and inner loop; vega's LBFGS is "
                            "optax's rule at a fixed rate: one update a step from the "
                            "gradients in p.grad, no line search (docs/optimizers.md)")
        _refuse_fused(owner, {key: given[key]}, f"{owner}.__init__")


def _refuse_torch_positional(owner: str, args: tuple) -> None:
    """TypeError for a hyperparameter given by position after ``lr``: in torch.optim.LBFGS's
    order it is ``max_iter`` (``LBFGS(params, 1, 20)``), a setting of its line search and
    inner loop, which by name is refused too; ``memory_size`` is taken by name only, as
    ``lbfgs_init`` and ``lbfgs_step`` take it."""
    if not args:
        return
    order = ("lr", *_TORCH_POSITIONAL)
    if len(args) > len(_TORCH_POSITIONAL):
        raise TypeError(f"{owner} takes {len(order)} hyperparameters by position "
                        f"({', '.join(order)}, torch.optim.LBFGS's), but {len(args) + 1} were "
                        "given; vega's LBFGS takes lr by position, and memory_size=... and "
                        "scale_init_precond=... by name")
    raise TypeError(f"{owner}: {shown(args[0])}, by position after lr, is torch.optim.LBFGS's "
                    f"{_TORCH_POSITIONAL[0]} (its order: {', '.join(order)}), a setting of its "
                    "line search and inner loop; vega's LBFGS is optax's rule at a fixed rate "
                    "(docs/optimizers.md) and takes lr by position, and memory_size=... (the "
                    "number of curvature pairs kept, torch's history_size) and "
                    "scale_init_precond=... by name")


def _check_class_step(params, states, shared: dict, m: int) -> None:
    """ValueError, naming the parameter, where the class's step would fail or write part of
    its tensors only: a state no longer fit for its parameter (``p.data`` given another
    shape, or made complex, after the first step: ``_check_state_leaves``), and a parameter,
    state or counter that a step in place cannot write, or a gradient sharing memory with one
    (an expanded parameter: ``vega.codegen.tensors.inplace_problem``), before anything is
    written; parameters on meta beside others (``_check_meta``)."""
    _check_meta("LBFGS", [*params, shared["weights"]],
                lambda k: f"parameter {k} of group 0" if k < len(params) else
                "state 'weights' of parameter 0 of group 0")
    for i, (p, st) in enumerate(zip(params, states)):
        try:
            _check_state_leaves("LBFGS", lambda: "", p, {f: st.get(f) for f in TREE_FIELDS},
                                m)
        except ValueError as e:
            raise ValueError(f"LBFGS: parameter {i} of group 0: "
                             f"{str(e).removeprefix('LBFGS: ')}") from None
    if torch.compiler.is_compiling():  # (as the other classes: not asked while dynamo
        return                          # traces, which cannot ask for inference tensors)
    written = [*params, *(st[f] for f in TREE_FIELDS for st in states), shared["weights"],
               shared["step"]]
    grads = [p.grad for p in params if p.grad is not None]
    problem = inplace_problem(written, grads)
    if problem is None:
        return
    n = len(params)

    def label(k: int) -> str:
        if k >= len(written):  # (a gradient: of the k-th parameter with one)
            i = [j for j, p in enumerate(params) if p.grad is not None][k - len(written)]
            return f"the gradient of parameter {i} of group 0"
        if k < n:
            return f"parameter {k} of group 0"
        if k < n * (1 + len(TREE_FIELDS)):
            f, i = divmod(k - n, n)
            return f"state '{TREE_FIELDS[f]}' of parameter {i} of group 0"
        return f"state '{('weights', 'step')[k - n * (1 + len(TREE_FIELDS))]}' of parameter 0 " \
            "of group 0"
    k, other, words = problem
    raise ValueError(f"LBFGS: {label(k)} "
                     f"{words.format(other=label(other)) if other is not None else words}")


class LBFGS(torch.optim.Optimizer):
    """L-BFGS at a fixed rate as a ``torch.optim.Optimizer``: the rule of ``lbfgs_step``.

    Not ``torch.optim.LBFGS``: there is no line search and no inner loop; ``step``
    makes one update from the gradients already in ``p.grad`` (a ``closure``, if
    given, is called once, before the update, and its loss returned). One
    parameter group (the curvature pairs span all parameters). Hyperparameters:
    ``lr=1.0`` (a float >= 0, a 0-d tensor or a schedule of the step counter),
    ``memory_size=10``, ``scale_init_precond=True``; ``state_dtype=None`` (float32
    state for bfloat16/float16 parameters); ``reduce_group=None`` (a process group whose
    ranks each hold other parameters, as under ``ZeroRedundancyOptimizer``: the inner
    products span all of them; every rank steps, with or without gradients). Each
    parameter's state holds its
    ``diff_params``, ``diff_updates``, ``params_prev`` and ``updates_prev``; the
    first parameter's state also holds the shared ``weights`` and ``step``. A change of
    which parameters the group holds after the first step (one added, removed or put back,
    or a state emptied) starts the history again, the step counter going on; a reorder
    keeps it. Not under a ``reduce_group`` nor in a step compiled with ``torch.compile``,
    which keep the history over such a change (``_restarts``).
    """

    def __init__(self, params, lr=1.0, *torch_positional, memory_size: int = 10,
                 scale_init_precond: bool = True, state_dtype: torch.dtype | None = None,
                 reduce_group=None, **torch_only):
        owner = "LBFGS"
        _refuse_torch_positional(owner, torch_positional)
        _refuse_torch_keywords(owner, torch_only)
        sharded.check_group(owner, reduce_group)
        self.reduce_group = reduce_group
        lr = _check_lr(owner, lr)
        memory_size = _check_memory_size(owner, memory_size)
        _check_bool(owner, "scale_init_precond", scale_init_precond)
        check_state_dtype(owner, state_dtype)
        super().__init__(params, {"lr": lr, "memory_size": memory_size,
                                  "scale_init_precond": scale_init_precond,
                                  "state_dtype": state_dtype})
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS does not support per-parameter options (parameter groups): "
                             "its curvature pairs span all parameters")

    def add_param_group(self, param_group: dict) -> None:
        """torch's, for the one group the constructor makes: a second is a ``ValueError``
        (the curvature pairs span all parameters), as is a tensor that is not float or
        complex, or not dense."""
        if self.param_groups:
            raise ValueError("LBFGS does not support per-parameter options (parameter groups): "
                             "its curvature pairs span all parameters")
        if isinstance(param_group, dict):
            sharded.warn_group_objects("LBFGS", self, param_group)
        super().add_param_group(param_group)
        for k, p in enumerate(self.param_groups[-1]["params"]):
            if not is_steppable(p):
                self.param_groups.pop()
                raise ValueError(f"LBFGS: parameter {k} of group 0 is of dtype {p.dtype}; "
                                 "LBFGS can only optimize float or complex tensors")
            if not dense(p):  # (as the spec optimizers' classes: the step refuses it)
                self.param_groups.pop()
                raise ValueError(f"LBFGS: parameter {k} of group 0 is {dense_words(p)}")

    def _shared(self, group) -> dict:
        """The state of the first parameter, which holds ``weights`` and ``step``."""
        head = group["params"][0]
        st = self.state.setdefault(head, {})  # (a plain dict assigned to state has no default)
        if "step" not in st and "weights" not in st:  # (one without the other: deleted, and
            # named by the step's check; made anew, it restarted the history at step 0)
            sds = [_tree_dtype(p, group["state_dtype"]) for p in group["params"]]
            st["weights"] = torch.zeros(group["memory_size"], device=head.device,
                                        dtype=_scalar_dtype([d.to_real() if d.is_complex else d
                                                             for d in sds]))
            st["step"] = torch.zeros((), dtype=torch.int32, device=head.device)
        return st

    def _move_shared(self, params) -> None:
        """The shared ``weights`` and ``step`` moved to the first parameter's state from the
        parameter that holds them, where the parameters were reordered since the last step
        (the group's list replaced, sorted or inserted into): the history goes on, its inner
        products being sums over all the parameters in any order. The first step made new
        ones instead, a restart with each parameter's history kept, and left the old ones
        where they were, to come back over that history when the order did. (Also before a
        state_dict, which a load refuses with them elsewhere.)"""
        head = self.state.get(params[0]) if params else None
        if not params:
            return
        last = self.__dict__.get("_vega_last")  # (the last step's: ``step``)
        was = last[1]() if last is not None else None
        held = self.state.get(was) if was is not None and was is not params[0] else None
        if held is not None and "step" in held and "weights" in held:
            # the last step's first parameter, wherever it is now (moved, or removed from
            # the group: the counter goes on; one put back holds none, old, to come back)
            self.state.setdefault(params[0], {}).update(
                {"weights": held["weights"], "step": held["step"]})
            del held["weights"], held["step"]
            return
        if head is not None and "step" in head:
            return
        for q in params[1:]:
            st = self.state.get(q)
            if st is not None and "step" in st and "weights" in st:
                got = {"weights": st["weights"], "step": st["step"]}
                # (the first's, then the other's dropped)
                self.state.setdefault(params[0], {}).update(got)
                del st["weights"], st["step"]
                return

    def _param_state(self, p, group) -> dict:
        st = self.state.setdefault(p, {})
        if "diff_params" not in st:
            sd = _tree_dtype(p, group["state_dtype"])
            m = group["memory_size"]
            # (all made, then set in one update: a state interrupted part way, with
            # diff_params and not the rest, was never made again, and refused every step)
            st.update({**{f: torch.zeros((m, *p.shape), dtype=sd, device=p.device)
                          for f in MEMORY_FIELDS},
                       **{f: torch.zeros(p.shape, dtype=sd, device=p.device)
                          for f in PREV_FIELDS}})
        return st

    # (without a closure None; with one, what it returned: typed so, a checker infers which)
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], _Loss]) -> _Loss: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], _Loss] | None = None) -> _Loss | None:
        """One update of every parameter (a ``None`` gradient is a zero one), unless none
        has a gradient; returns the closure's loss."""
        if not torch.compiler.is_compiling():  # (refused under torch.func.grad, jvp,
            class_step_transforms("LBFGS", "vega.lbfgs_step",  # functionalize; vmap of its own)
                                  self.param_groups)
        if len(self.param_groups) != 1:  # (add_param_group refuses a second: one put in the
            # list by hand was never stepped, the step reading the first group alone)
            raise ValueError(f"LBFGS: {len(self.param_groups)} parameter groups; LBFGS steps "
                             "one group (its curvature pairs span all parameters): put every "
                             "parameter in param_groups[0]['params']")
        # (each setting a step reads: one deleted from the group was a bare KeyError)
        missing = [k for k in _SETTINGS if k not in self.param_groups[0]]
        if missing:
            raise ValueError(f"LBFGS: group 0 has no {', '.join(map(repr, missing))}: a setting "
                             "deleted from it (the constructor sets each); put it back")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        if isinstance(group.get("state_dtype"), str):  # (a saved group's, as
            # ZeroRedundancyOptimizer.load_state_dict copies it: ``saved_state_dtype``)
            group["state_dtype"] = loaded_state_dtype(group["state_dtype"])
        lr = _check_lr("LBFGS", group["lr"])
        _check_bool("LBFGS", "scale_init_precond", group["scale_init_precond"])
        check_state_dtype("LBFGS", group["state_dtype"])  # (a first step makes state in it)
        params = group["params"]
        if self.reduce_group is None and all(p.grad is None for p in params):
            return loss  # (in a group, the others' products need this rank's collectives)
        if not params:  # (a rank of the group that holds none, ZeroRedundancyOptimizer's with
            # more ranks than parameters: its collectives, of sums over nothing, without a
            # state, which lives in the first parameter's)
            m = _check_memory_size("LBFGS", group["memory_size"])
            dev = sharded.group_device(self.reduce_group)
            _lbfgs([], [], [], [], [], [], torch.zeros(m, device=dev),
                   torch.zeros((), dtype=torch.int32, device=dev), lr, m,
                   group["scale_init_precond"], True, self.reduce_group)
            return loss
        _refuse_dtensors("LBFGS", params)
        for i, p in enumerate(params):
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"LBFGS does not support sparse gradients: the gradient of "
                                 f"parameter {i} of group 0 is {p.grad.layout}")
            if not is_steppable(p):  # (made so after it was given, which refuses it; its
                raise ValueError(    # values were truncated to integers)
                    f"LBFGS: parameter {i} of group 0 is of dtype {p.dtype}; LBFGS can only "
                    "optimize float or complex tensors")
        # (checked before a first step makes the state in its shape: memory_size=0 made an
        # empty history, which every later step refused)
        given = _check_memory_size("LBFGS", group["memory_size"])
        self._move_shared(params)
        made = {p: frozenset(self.state[p]) if p in self.state else None for k, p
                in enumerate(params) if "diff_params" not in self.state.get(p, ())
                or (k == 0 and "step" not in self.state.get(p, ()))}  # (what a step makes)
        restart = self._restarts(params)
        try:  # (refused: the state this step made is dropped, the rest is as it was)
            shared = self._shared(group)
            states = [self._param_state(p, group) for p in params]
            m = _check_weights_step("LBFGS", shared.get("weights"), shared.get("step"),
                                    "the first parameter's state")
            if given != m:
                raise ValueError(f"LBFGS: memory_size={group['memory_size']!r}, but the state "
                                 f"holds {m} curvature pairs: memory_size is fixed by the "
                                 "first step (a new LBFGS starts another history)")
            _check_class_step(params, states, shared, m)
        except BaseException:
            for p, had in made.items():
                if had is None:
                    self.state.pop(p, None)
                else:
                    for key in [k for k in self.state[p] if k not in had]:
                        del self.state[p][key]
            raise
        resolve = not torch.compiler.is_compiling()
        written = [params, *([st[f] for st in states] for f in TREE_FIELDS)]
        reals = [[_real(x, resolve) for x in col] for col in written]
        if restart:
            shared["weights"].zero_()
        _, _, _, _, _, _, shared["step"] = _lbfgs(
            reals[0], [_real(_zero_for_none(p, p.grad)) for p in params], *reals[1:],
            shared["weights"], shared["step"], lr, m, group["scale_init_precond"], True,
            self.reduce_group, restart)
        _write_back([x for col in written for x in col], [x for col in reals for x in col])
        if not torch.compiler.is_compiling():
            self.__dict__["_vega_last"] = (frozenset(map(id, params)), weakref.ref(params[0]))
        return loss

    def _restarts(self, params) -> bool:
        """Whether this step starts the history again: the curvature pairs are of the
        group's parameters together, each pair's weight the inverse of its inner product
        over all of them, so a parameter added since the last step (or put back, with its
        part of the ring buffers written at other steps), removed since (the weights are of
        products over it too), or without a history (its state emptied) makes the pairs
        the history holds pairs of no problem being solved. A restart is a new LBFGS's
        first step over the group's parameters, the step counter going on. Not under a
        ``reduce_group`` (the ranks' pairs are one history: a restart would be of one rank
        only) or while dynamo traces."""
        if self.reduce_group is not None or torch.compiler.is_compiling():
            return False
        last = self.__dict__.get("_vega_last")
        if last is not None and last[0] != frozenset(map(id, params)):
            return True
        return any("diff_params" not in self.state.get(p, ()) for p in params)

    def __getstate__(self) -> dict:
        """torch's (defaults, state, groups) and ``reduce_group``, which a step reads
        (copy.deepcopy, pickle)."""
        return {**super().__getstate__(), "reduce_group": self.reduce_group}

    def __setstate__(self, state: dict) -> None:
        """torch's, with ``reduce_group`` None where the pickle holds none (one written by a
        vega whose LBFGS pickled torch's entries alone), as the spec optimizers take one:
        the step read the missing attribute and failed on it."""
        super().__setstate__({"reduce_group": None, **state})

    def state_dict(self) -> dict:
        """torch's, without a ``reduce_group`` that ``ZeroRedundancyOptimizer`` put in the
        group (``sharded.without_group_objects``), which the state_dict post-hooks see so
        (``torch_names.saving``)."""
        return torch_names.saving(self, self._state_dict)

    def _state_dict(self) -> dict:
        self._move_shared(self.param_groups[0]["params"])  # (the first holds them, as loaded)
        torch_names.drop_strays("LBFGS.state_dict", self)
        out = sharded.without_group_objects(self, super().state_dict())
        out["param_groups"] = saved_groups(out["param_groups"])  # (its dtype by name)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, keeping the saved dtypes (torch would cast state to each
        parameter's dtype) and the step counter int32, on each parameter's device.

        Checked, each refusal a ``ValueError`` that leaves the optimizer as it was: a dict
        with ``state`` and ``param_groups``, dense entries, a group with this class's settings
        (torch.optim.LBFGS's has others), and each parameter's state as a step reads it: none,
        or its four buffers at the shapes ``memory_size`` and the parameter need, the first
        parameter's holding ``weights`` and a step counter too (``_check_loaded``). torch's
        load_state_dict hooks run as torch runs them (``torch_names.loading``)."""
        torch_names.loading(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        owner = "LBFGS.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys() \
                or not isinstance(state_dict["state"], dict) \
                or not all(isinstance(v, dict) for v in state_dict["state"].values()):
            raise ValueError(f"{owner}: a state_dict is a dict with 'state' (a dict of each "
                             "parameter's state dict) and 'param_groups', as state_dict() "
                             "returns")
        originals = {k: dict(v) for k, v in state_dict["state"].items()}
        for pid, entries in originals.items():
            for name, value in entries.items():  # (the caller's own as torch loads them)
                if name in FIELDS and isinstance(value, torch.Tensor) and not dense(value):
                    raise ValueError(f"{owner}: state {name!r} of parameter id "
                                     f"{pid!r} is {not_dense(value)}; L-BFGS keeps dense "
                                     "(strided) states")
        before = self.state, self.param_groups
        try:
            super().load_state_dict(state_dict)
            for group in self.param_groups:  # (saved by name: ``engine.saved_state_dtype``)
                if "state_dtype" in group:
                    group["state_dtype"] = loaded_state_dtype(group["state_dtype"])
            ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = [p for g in self.param_groups for p in g["params"]]
            for pid, p in zip(ids, params):
                if pid not in originals or p not in self.state:
                    continue
                for name, value in originals[pid].items():
                    # (the saved dtype kept; an entry of the caller's own as torch cast it)
                    if isinstance(value, torch.Tensor) and name in FIELDS:
                        self.state[p][name] = value.to(device=p.device, copy=True)
            self._check_loaded(owner)
        except BaseException:  # nothing changes
            self.state, self.param_groups = before
            raise
        self.__dict__.pop("_vega_last", None)  # (the state loaded is one history)

    def _check_loaded(self, owner: str) -> None:
        """ValueError where the loaded groups or states are not what a step reads."""
        group = self.param_groups[0]
        missing = sorted(set(_SETTINGS) - group.keys())
        if missing:
            raise ValueError(f"{owner}: the group of the state has no "
                             f"{', '.join(map(repr, missing))}: it is not the state of "
                             "vega.optim.LBFGS (torch.optim.LBFGS's has other settings)")
        _check_lr(owner, group["lr"])
        m = _check_memory_size(owner, group["memory_size"])
        _check_bool(owner, "scale_init_precond", group["scale_init_precond"])
        check_state_dtype(owner, group["state_dtype"])
        params = group["params"]
        buffers = False
        for i, p in enumerate(params):
            st = self.state.get(p) or {}
            # (an entry whose name is none of the rule's is the caller's own, loaded as
            # torch loads it; the shared ones belong to the first parameter alone)
            misplaced = sorted(st.keys() & {"weights", "step"}) if i else []
            if misplaced:
                raise ValueError(f"{owner}: the state of parameter {i} has "
                                 f"{sorted(map(str, st))}, but L-BFGS keeps "
                                 f"{list(TREE_FIELDS)}, and the first parameter's also "
                                 f"'weights' and 'step'; {misplaced} are the first "
                                 "parameter's alone")
            if not any(f in st for f in TREE_FIELDS):
                continue
            buffers = True
            if uninitialized(p):  # (torch loads its state unchecked)
                raise ValueError(f"{owner}: parameter {i} of group 0 {LAZY_LOAD_WORDS}")
            leaves = {f: st.get(f) for f in TREE_FIELDS}
            _check_state_leaves(owner, partial(str, i), p, leaves, m)
        head = self.state.get(params[0]) or {} if params else {}
        if buffers or "weights" in head or "step" in head:
            step = head.get("step")
            _check_weights_step(owner, head.get("weights"), step,
                                "the first parameter's state", m)
            if step.item() < 0:
                raise ValueError(f"{owner}: the first parameter's state['step'] is "
                                 f"{step.item()}; a step counter is a whole number in "
                                 "[0, 2**31 - 1]")
