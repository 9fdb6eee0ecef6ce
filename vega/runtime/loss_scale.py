"""Loss scales for float16 training, after the seeds and JAX's jmp.

A :class:`LossScale` is a value: two 0-d tensors, the scale factor
``loss_scale`` (float32) and ``good_steps`` (int32: the finite steps since the
scale last changed; -1 for a static scale), plus its configuration
(``growth_interval``, ``growth_factor``, ``backoff_factor``, and whether it is
dynamic). It is registered as a torch pytree node whose two leaves are those
tensors and whose context is the configuration, so a compiled training step takes
it as input and returns the adjusted one as output; a float captured instead would
be burned into the trace as a constant.

Names: the tensor field is ``loss_scale`` (jmp's name) and the method that
multiplies the loss is ``scale`` (jmp's, and the seeds' ``scale ls x``); the
seeds' record field ``scale`` is renamed so the two do not collide.

``adjust`` is exactly ``torch._amp_update_scale_`` (what ``torch.amp.GradScaler``
runs): on a finite step the counter advances and on reaching ``growth_interval``
the scale is multiplied by ``growth_factor`` -- unless that overflows float32, when
the scale is kept -- and the counter restarts; on an overflow the scale is
multiplied by ``backoff_factor`` and the counter restarts. The products are
formed in double precision and rounded to float32, as torch's kernels do. There is
no minimum scale (jmp's ``DynamicLossScale`` floors the backed-off scale at
``min_loss_scale``, 1 by default). Everything is tensor arithmetic with
``torch.where``: no value is read back to the host.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch.utils import _pytree as pytree

__all__ = ["LossScale", "grads_finite"]


def _at_dtype(x: torch.Tensor, s: torch.Tensor, op) -> torch.Tensor:
    """``op(x, s)`` with the result at ``x``'s dtype.

    Half-precision ``x`` is computed in float32 and rounded back once (torch's
    GradScaler also works in float32: the scale itself may not fit in float16); a
    complex ``x`` meets the scale at its real dtype.
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        return op(x.float(), s.float()).to(x.dtype)
    real = x.dtype.to_real() if x.dtype.is_complex else x.dtype
    return op(x, s.to(real))


def _wide(device: torch.device) -> torch.dtype:
    """Where to form the scale's products: float64, except on MPS which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def _positive_real(who: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{who}: {name}={value!r} must be a positive number")
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{who}: {name}={value!r} must be positive and finite")
    return x


def _scale_value(who: str, name: str, value) -> float:
    x = _positive_real(who, name, value)
    as32 = float(torch.tensor(x, dtype=torch.float32))
    if not (math.isfinite(as32) and as32 > 0):
        raise ValueError(f"{who}: {name}={value!r} is not a positive finite float32")
    return x


def _check_config(who: str, growth_interval, growth_factor, backoff_factor) -> tuple:
    if (isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral)
            or growth_interval <= 0):
        raise ValueError(f"{who}: growth_interval={growth_interval!r} must be a positive "
                         "integer")
    return (int(growth_interval), _positive_real(who, "growth_factor", growth_factor),
            _positive_real(who, "backoff_factor", backoff_factor))


def _float_leaf(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def grads_finite(grads) -> torch.Tensor:
    """A 0-d bool tensor: every element of every float leaf of ``grads`` is finite.

    No host sync: one ``isfinite(...).all()`` per leaf, combined on the device.
    Non-float leaves are ignored; with no float leaf at all the answer is ``True``
    (on the CPU).
    """
    flags = [torch.isfinite(g).all() for g in pytree.tree_leaves(grads) if _float_leaf(g)]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


class LossScale:
    """A loss scale: build it with :meth:`static` or :meth:`dynamic`."""

    __slots__ = ("loss_scale", "good_steps", "growth_interval", "growth_factor",
                 "backoff_factor", "is_dynamic")

    def __init__(self, loss_scale: torch.Tensor, good_steps: torch.Tensor, *,
                 growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, dynamic: bool = True):
        self.loss_scale = loss_scale
        self.good_steps = good_steps
        (self.growth_interval, self.growth_factor,
         self.backoff_factor) = _check_config("LossScale", growth_interval, growth_factor,
                                              backoff_factor)
        self.is_dynamic = bool(dynamic)

    # -- construction ----------------------------------------------------------------

    @classmethod
    def static(cls, s: float, device=None) -> LossScale:
        """The fixed scale ``s`` (positive): ``adjust`` returns it unchanged.

        ``static(1.0)`` makes the loss-scaling plumbing the identity, while
        :meth:`step` still skips the steps whose gradients are not finite.
        """
        s = _scale_value("LossScale.static", "s", s)
        return cls(torch.full((), s, dtype=torch.float32, device=device),
                   torch.full((), -1, dtype=torch.int32, device=device), dynamic=False)

    @classmethod
    def dynamic(cls, init: float = 2.0**15, growth_interval: int = 2000,
                growth_factor: float = 2.0, backoff_factor: float = 0.5,
                device=None) -> LossScale:
        """A fresh adaptive scale, starting at ``init`` with its counter at 0."""
        init = _scale_value("LossScale.dynamic", "init", init)
        _check_config("LossScale.dynamic", growth_interval, growth_factor, backoff_factor)
        return cls(torch.full((), init, dtype=torch.float32, device=device),
                   torch.zeros((), dtype=torch.int32, device=device),
                   growth_interval=growth_interval, growth_factor=growth_factor,
                   backoff_factor=backoff_factor, dynamic=True)

    def _config(self) -> tuple:
        return (self.growth_interval, self.growth_factor, self.backoff_factor, self.is_dynamic)

    @classmethod
    def _from(cls, leaves, config) -> LossScale:
        """Unchecked: pytree maps may put anything in the leaves."""
        self = object.__new__(cls)
        self.loss_scale, self.good_steps = leaves
        (self.growth_interval, self.growth_factor, self.backoff_factor,
         self.is_dynamic) = config
        return self

    def __repr__(self) -> str:
        def show(t):
            try:
                return repr(t.item())
            except Exception:  # a fake or meta tensor, under tracing
                return repr(t)
        kind = "dynamic" if self.is_dynamic else "static"
        cfg = (f", growth_interval={self.growth_interval}, growth_factor={self.growth_factor}, "
               f"backoff_factor={self.backoff_factor}") if self.is_dynamic else ""
        return (f"LossScale({kind}, loss_scale={show(self.loss_scale)}, "
                f"good_steps={show(self.good_steps)}{cfg})")

    # -- use -------------------------------------------------------------------------

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the current scale, at ``x``'s dtype (formed in float32 for halves).

        Apply it to the loss, inside the differentiated objective.
        """
        return _at_dtype(x, self.loss_scale, torch.mul)

    def unscale(self, grads):
        """Every float leaf of ``grads`` (any pytree) divided by the scale, at its dtype.

        Half-precision leaves are divided in float32 and rounded back (as torch's
        GradScaler does); other leaves pass through unchanged.
        """
        def one(g):
            return _at_dtype(g, self.loss_scale, torch.div) if _float_leaf(g) else g
        return pytree.tree_map(one, grads)

    def adjust(self, finite) -> LossScale:
        """The scale for the next step, given whether this step's gradients were finite.

        ``finite`` is a 0-d bool tensor (from :func:`grads_finite`). A static scale is
        returned unchanged.
        """
        if not self.is_dynamic:
            return self
        s, n = self.loss_scale, self.good_steps
        if not isinstance(finite, torch.Tensor):
            finite = torch.tensor(bool(finite), device=s.device)
        elif finite.dtype != torch.bool:
            finite = finite != 0
        wide = _wide(s.device)
        grown = (s.to(wide) * self.growth_factor).to(torch.float32)
        grown = torch.where(torch.isfinite(grown), grown, s)
        backed = (s.to(wide) * self.backoff_factor).to(torch.float32)
        successful = n + 1
        at_interval = successful == self.growth_interval
        new_s = torch.where(finite, torch.where(at_interval, grown, s), backed)
        new_n = torch.where(finite & ~at_interval, successful, torch.zeros_like(n))
        return LossScale._from((new_s, new_n), self._config())

    def step(self, grads, step_fn, state):
        """One loss-scaled step: ``(new state, next loss scale)``.

        Divides ``grads`` by the scale, checks them with :func:`grads_finite`, computes
        ``step_fn(unscaled grads)`` -- the new state, a pytree shaped like ``state`` --
        and keeps every leaf of ``state`` exactly as it was if the gradients were not
        finite (``torch.where``, no host sync). Call it as
        ``(params, st), ls = ls.step(grads, step_fn, (params, st))`` or
        ``vega.LossScale.step(ls, grads, step_fn, (params, st))``.
        """
        unscaled = self.unscale(grads)
        finite = grads_finite(unscaled)
        new = step_fn(unscaled)
        new_leaves, new_spec = pytree.tree_flatten(new)
        old_leaves, old_spec = pytree.tree_flatten(state)
        if new_spec != old_spec:
            raise ValueError(f"LossScale.step: step_fn returned a structure {new_spec} "
                             f"different from the state's {old_spec}")
        kept = [torch.where(finite.to(o.device), nw, o)
                if isinstance(o, torch.Tensor) and isinstance(nw, torch.Tensor) else nw
                for nw, o in zip(new_leaves, old_leaves)]
        return pytree.tree_unflatten(kept, old_spec), self.adjust(finite)


def _flatten(ls: LossScale):
    return [ls.loss_scale, ls.good_steps], ls._config()


def _flatten_with_keys(ls: LossScale):
    return ([(pytree.GetAttrKey("loss_scale"), ls.loss_scale),
             (pytree.GetAttrKey("good_steps"), ls.good_steps)], ls._config())


def _unflatten(leaves, config) -> LossScale:
    return LossScale._from(list(leaves), config)


pytree.register_pytree_node(LossScale, _flatten, _unflatten,
                            serialized_type_name="vega.LossScale",
                            flatten_with_keys_fn=_flatten_with_keys)
