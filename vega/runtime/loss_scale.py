"""Loss scales for float16 training, after the OCaml library Vega and JAX's jmp.

A :class:`LossScale` is a value: four 0-d tensors, the scale factor
``loss_scale`` (float32), ``good_steps`` (int32: the finite steps since the
scale last changed; -1 for a static scale), ``skipped_steps`` (int32: how many
steps ``adjust`` saw overflow, saturating at 2**31 - 1; a static scale keeps 0)
and ``min_scale`` (float32: the floor of backing off; 0 for none but TINY), plus its configuration
(``growth_interval``, ``growth_factor``, ``backoff_factor``, and whether it is
dynamic). It is registered as a torch pytree node whose four leaves are those
tensors and whose context is the configuration, so a compiled training step takes
it as input and returns the adjusted one as output; a float captured instead would
be burned into the trace as a constant.

Names: the tensor field is ``loss_scale`` (jmp's name) and the method that
multiplies the loss is ``scale`` (jmp's, and the OCaml library's ``scale ls x``);
that library's record field ``scale`` is renamed so the two do not collide.

``adjust`` is ``torch._amp_update_scale_`` (what ``torch.amp.GradScaler`` runs) but
for its floor (below): on a finite step the counter advances and on reaching
``growth_interval`` the scale is multiplied by ``growth_factor`` -- unless that
overflows float32, when the scale is kept -- and the counter restarts; on an
overflow the scale is multiplied by ``backoff_factor`` and the counter restarts. The
products are formed in double precision and rounded to float32, as torch's kernels
do. The backed-off scale is floored at ``dynamic(min_scale=...)`` where given (jmp's
``DynamicLossScale`` floors it at ``min_loss_scale``, 1 by default), and in any case
at the smallest normal float32, ``TINY`` (2**-126), where torch's would go on to 0
and skip every later step (a scale already below it stays as it is). Everything is
tensor arithmetic with ``torch.where``: no value is read back to the host.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, TypeVar

import torch
from torch.utils import _pytree as pytree

from vega.runtime.engine import as_float, positive_finite
from vega.runtime.tree import CONTAINERS, path_name, refuse_unwalked

__all__ = ["LossScale", "grads_finite"]

_Tree = TypeVar("_Tree")  # a pytree of gradients, and the one of the same structure made of it
_State = TypeVar("_State")  # the pytree a step makes of its state (LossScale.step)

TINY = torch.finfo(torch.float32).tiny  # the floor of backing off where min_scale is lower


def _at_dtype(x: torch.Tensor, s: torch.Tensor, op) -> torch.Tensor:
    """``op(x, s)`` with the result at ``x``'s dtype.

    Half-precision ``x`` is computed in float32 and rounded back once (torch's
    GradScaler also works in float32: the scale itself may not fit in float16); a
    complex ``x`` meets the scale at its real dtype.
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        return op(x.float(), s.float()).to(x.dtype)
    real = x.real.dtype  # (not dtype's to_real(), which dynamo cannot trace, nor
    # view_as_real's, which refuses a conjugate view)
    return op(x, s.to(real))


def _wide(device: torch.device) -> torch.dtype:
    """Where to form the scale's products: float64, except on MPS which has none."""
    return torch.float32 if device.type == "mps" else torch.float64


def _made_on(device):
    """Where a scale made with ``device`` puts its tensors: there, or without one the default
    device, but the CPU where that is the meta device (``with torch.device("meta")`` around
    a model and its optimizer): a tensor there holds no value, and the optimizer that takes
    the scale moves it to its parameters' device (``device_given`` stays False)."""
    if device is None and torch.get_default_device().type == "meta":
        return torch.device("cpu")
    return device


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _positive_real(who: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{who}: {name}={_shown(value)} must be a positive number")
    x = as_float(value)
    if not positive_finite(x):  # (compared, as dynamo traces a symbolic float)
        raise ValueError(f"{who}: {name}={_shown(value)} must be positive and finite")
    return x


def _scale_value(who: str, name: str, value) -> float:
    x = _positive_real(who, name, value)
    as32 = float(torch.tensor(x, dtype=torch.float32, device="cpu"))  # (not a default meta)
    if not (math.isfinite(as32) and as32 > 0):
        raise ValueError(f"{who}: {name}={value!r} is not a positive finite float32")
    return x


_INT32_MAX = 2**31 - 1


def _check_config(who: str, growth_interval, growth_factor, backoff_factor) -> tuple:
    """The settings of a dynamic scale, as ``torch.amp.GradScaler`` takes them: a positive
    interval, a growth factor above 1 (growing that does not grow), a backoff factor in
    (0, 1) (backing off that does not shrink the scale would skip step after step)."""
    if (isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral)
            or growth_interval <= 0):
        raise ValueError(f"{who}: growth_interval={_shown(growth_interval)} must be a "
                         "positive integer")
    if growth_interval > _INT32_MAX:  # (compared with the int32 count of good steps, a
        raise ValueError(                # larger one wrapped: the scale grew every step)
            f"{who}: growth_interval={growth_interval} must be at most 2**31 - 1 (the good "
            "steps are counted in int32); for a scale that never grows, use "
            "LossScale.static or growth_interval=2**31 - 1")
    grow = _positive_real(who, "growth_factor", growth_factor)
    back = _positive_real(who, "backoff_factor", backoff_factor)
    if not grow > 1.0:
        raise ValueError(f"{who}: growth_factor={growth_factor!r} must be above 1 (growing "
                         "multiplies the scale by it; torch.amp.GradScaler asks the same)")
    if not back < 1.0:
        raise ValueError(f"{who}: backoff_factor={backoff_factor!r} must be below 1 (backing "
                         "off after an overflow multiplies the scale by it; "
                         "torch.amp.GradScaler asks the same)")
    return int(growth_interval), grow, back


def _float_leaf(x) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def grads_finite(grads, *, reduce_group=None) -> torch.Tensor:
    """A 0-d bool tensor: every element of every float leaf of ``grads`` is finite.

    No host sync: one ``isfinite(...).all()`` per leaf, combined on the device.
    Non-float leaves are ignored; with no float leaf at all the answer is ``True``
    (on the CPU). DTensor leaves are checked on their local shards, the non-finite
    count all-reduced over their mesh, and over ``reduce_group`` where one is given (a
    process group whose ranks each hold other leaves): every rank then gets the same
    answer, and every rank of the group must call it.
    """
    from vega.runtime import sharded
    from vega.runtime.transforms import float_leaves
    sharded.check_group("grads_finite", reduce_group)
    leaves = float_leaves("grads_finite", grads)
    if sharded.involved(leaves, reduce_group):
        bad = sharded.spanning_sum("grads_finite", leaves, lambda x: (~torch.isfinite(x)).sum(
            dtype=torch.float64), reduce_group)
        return bad == 0
    flags = [torch.isfinite(g).all() for g in leaves]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


class LossScale:
    """A loss scale: build it with :meth:`static` or :meth:`dynamic`.

    Its state is four 0-d tensors (``loss_scale``, ``good_steps``, ``skipped_steps``,
    ``min_scale``; :meth:`tensors`), its configuration plain attributes; the module
    docstring says how :meth:`adjust` moves them.
    """

    # (a dict: each attribute's docstring, which help() shows)
    __slots__ = {
        "loss_scale": "The scale factor, a 0-d float32 tensor.",
        "good_steps": "The finite steps since the scale last changed, a 0-d int32 tensor "
                      "(-1 for a static scale).",
        "skipped_steps": "How many steps adjust saw overflow, a 0-d int32 tensor saturating "
                         "at 2**31 - 1 (a static scale keeps 0).",
        "min_scale": "The floor of backing off, a 0-d float32 tensor (0: none but the "
                     "smallest normal float32).",
        "growth_interval": "The finite steps after which the scale grows (an int).",
        "growth_factor": "What growing multiplies the scale by (above 1).",
        "backoff_factor": "What an overflow multiplies the scale by (in (0, 1)).",
        "is_dynamic": "True for a scale made by dynamic(), False for static()'s.",
        "device_given": "Whether the scale's device was chosen (device= given, its tensors "
                        "given, to_()): an optimizer moves one made without a device to "
                        "its parameters'.",
    }

    def __init__(self, loss_scale: torch.Tensor, good_steps: torch.Tensor,
                 skipped_steps: torch.Tensor | None = None, min_scale: torch.Tensor | None = None,
                 *, growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, dynamic: bool = True):
        self.loss_scale = loss_scale
        self.good_steps = good_steps
        self.skipped_steps = skipped_steps if skipped_steps is not None else torch.zeros(
            (), dtype=torch.int32, device=loss_scale.device)
        self.min_scale = min_scale if min_scale is not None else torch.zeros(
            (), dtype=torch.float32, device=loss_scale.device)
        self.growth_interval, self.growth_factor = growth_interval, growth_factor
        self.backoff_factor = backoff_factor
        self._check()
        self.is_dynamic = bool(dynamic)
        n = good_steps
        if isinstance(n, torch.Tensor) and n.numel() == 1 and n.device.type != "meta" \
                and (int(n) == -1) == self.is_dynamic:  # (a state dict tells them so)
            raise ValueError(f"LossScale: good_steps={int(n)} with dynamic={dynamic!r}: a "
                             "static scale's good_steps is -1 (LossScale.static(s) makes "
                             "one), a dynamic one's counts its good steps from 0")
        self.device_given = True  # (its tensors were given: where they are is meant)

    def __setstate__(self, state) -> None:
        """The slots as pickled (``copy``, ``pickle``); a scale pickled by a vega before
        ``device_given`` takes True, its tensors staying where they are, as that vega kept
        them: its optimizer's first step failed on the missing attribute."""
        extra, slots = state if isinstance(state, tuple) else (state, None)
        values = {**(extra or {}), **(slots or {})}
        values.setdefault("device_given", True)
        missing = [k for k in self.__slots__ if k not in values]
        if missing:
            raise ValueError(f"a pickled LossScale has no {', '.join(missing)}: the file or "
                             "pickle is not one a vega wrote")
        for key, value in values.items():
            setattr(self, key, value)
        # (checked as the constructor checks them: a pickle from elsewhere holding a negative
        # scale stepped every parameter uphill, a NaN one skipped every step)
        self._check()

    def _check(self) -> None:
        """The constructor's checks of the settings (each kept as ``_check_config`` gives it)
        and of the tensors' values, for a scale made or unpickled."""
        (self.growth_interval, self.growth_factor,
         self.backoff_factor) = _check_config("LossScale", self.growth_interval,
                                              self.growth_factor, self.backoff_factor)
        check_scale_values("LossScale", self.tensors(), dtypes=False)

    # -- construction ----------------------------------------------------------------

    @classmethod
    def static(cls, s: float, device=None) -> LossScale:
        """The fixed scale ``s`` (positive): ``adjust`` returns it unchanged. ``device``: where
        its tensors are made (without one, torch's default device; an optimizer given the
        scale moves it to its parameters').

        ``static(1.0)`` makes the loss-scaling plumbing the identity, while
        :meth:`step` still skips the steps whose gradients are not finite.
        """
        s = _scale_value("LossScale.static", "s", s)
        # (its values checked above: made without the constructor's check, which reads them
        # back from the device)
        at = _made_on(device)
        out = cls._from([torch.full((), s, dtype=torch.float32, device=at),
                         torch.full((), -1, dtype=torch.int32, device=at),
                         torch.zeros((), dtype=torch.int32, device=at),
                         torch.zeros((), dtype=torch.float32, device=at)],
                        (2000, 2.0, 0.5, False))  # (the constructor's defaults)
        out.device_given = device is not None
        return out

    @classmethod
    def dynamic(cls, init: float = 2.0**15, growth_interval: int = 2000,
                growth_factor: float = 2.0, backoff_factor: float = 0.5,
                min_scale: float | None = None, device=None) -> LossScale:
        """A fresh adaptive scale, starting at ``init`` with its counter at 0.

        ``min_scale`` (optional, positive): backing off never takes the scale below
        it (jmp's ``min_loss_scale``; DeepSpeed's ``min_loss_scale``). ``device`` as for
        :meth:`static`.
        """
        init = _scale_value("LossScale.dynamic", "init", init)
        config = _check_config("LossScale.dynamic", growth_interval, growth_factor,
                               backoff_factor)
        floor = 0.0 if min_scale is None else _scale_value("LossScale.dynamic", "min_scale",
                                                            min_scale)
        if floor > init:
            raise ValueError(f"LossScale.dynamic: min_scale={min_scale!r} is above "
                             f"init={init!r}")
        at = _made_on(device)
        out = cls._from([torch.full((), init, dtype=torch.float32, device=at),
                         torch.zeros((), dtype=torch.int32, device=at),
                         torch.zeros((), dtype=torch.int32, device=at),
                         torch.full((), floor, dtype=torch.float32, device=at)],
                        (*config, True))  # (checked above, as in static)
        out.device_given = device is not None
        return out

    def _config(self) -> tuple:
        return (self.growth_interval, self.growth_factor, self.backoff_factor, self.is_dynamic)

    def check_settings(self, who: str) -> None:
        """ValueError where this scale's settings, as they are now (an attribute set after
        it was made, ``ls.growth_interval = 0``), are ones ``adjust`` refuses: a step checks
        them before it writes anything, rather than adjusting the scale after its update."""
        _check_config(who, self.growth_interval, self.growth_factor, self.backoff_factor)

    @classmethod
    def _from(cls, leaves, config) -> LossScale:
        """Unchecked: pytree maps may put anything in the leaves."""
        self = object.__new__(cls)
        self.loss_scale, self.good_steps, self.skipped_steps, self.min_scale = leaves
        (self.growth_interval, self.growth_factor, self.backoff_factor,
         self.is_dynamic) = config
        self.device_given = True
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
        floor = f", min_scale={show(self.min_scale)}" if self.is_dynamic else ""
        return (f"LossScale({kind}, loss_scale={show(self.loss_scale)}, "
                f"good_steps={show(self.good_steps)}, "
                f"skipped_steps={show(self.skipped_steps)}{cfg}{floor})")

    # -- traversals (the OCaml library's map, map2, iter) ------------------------------

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state tensors, in order: loss_scale, good_steps, skipped_steps, min_scale."""
        return (self.loss_scale, self.good_steps, self.skipped_steps, self.min_scale)

    def map(self, f) -> LossScale:
        """``f`` applied to every state tensor (e.g. ``ls.map(lambda t: t.to(device))``)."""
        return LossScale._from([f(t) for t in self.tensors()], self._config())

    def map2(self, f, other: LossScale) -> LossScale:
        """``self`` and ``other`` combined tensor by tensor with ``f``."""
        if not isinstance(other, LossScale) or other._config() != self._config():
            raise ValueError("LossScale.map2: the other value must be a LossScale configured "
                             "alike")
        return LossScale._from([f(a, b) for a, b in zip(self.tensors(), other.tensors())],
                               self._config())

    def iter(self, f) -> None:
        """``f`` called on every state tensor."""
        for t in self.tensors():
            f(t)

    # -- use -------------------------------------------------------------------------

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times the current scale, at ``x``'s dtype (formed in float32 for halves).

        Apply it to the loss, inside the differentiated objective.
        """
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
            got = f"a tensor of dtype {x.dtype}" if isinstance(x, torch.Tensor) else \
                f"{x!r}, a {type(x).__name__}"
            raise ValueError(f"LossScale.scale: x is {got}; it scales a float tensor (the "
                             f"loss, before backward())")
        return _at_dtype(x, self.loss_scale, torch.mul)

    def unscale(self, grads: _Tree) -> _Tree:
        """Every float leaf of ``grads`` (any pytree) divided by the scale, at its dtype.

        Half-precision leaves are divided in float32 and rounded back (as torch's
        GradScaler does); other leaves pass through unchanged (a container torch's pytree
        does not walk into, a dict subclass, is refused: ``ValueError``).
        """
        def one(g):
            if _float_leaf(g):
                return _at_dtype(g, self.loss_scale, torch.div)
            if isinstance(g, CONTAINERS):
                refuse_unwalked("unscale", grads)
            return g
        return pytree.tree_map(one, grads)

    def adjust(self, finite, *, growth_interval: int | None = None,
               growth_factor: float | None = None,
               backoff_factor: float | None = None) -> LossScale:
        """The scale for the next step, given whether this step's gradients were finite.

        ``finite`` is a 0-d bool tensor (from :func:`grads_finite`). A static scale is
        returned unchanged. ``growth_interval``, ``growth_factor`` and
        ``backoff_factor``, where given, replace the scale's own settings for this call
        only (the returned scale keeps its own); as the scale's own, the interval must be
        a positive integer, the growth factor above 1 and the backoff factor in (0, 1)
        (``ValueError``).
        With a shorter interval than the counter has reached, the scale grows at once.
        """
        got = self._adjusted(finite, growth_interval, growth_factor, backoff_factor)
        if got is None:
            return self
        scale, backed, finite, reset, counted = got
        return LossScale._from((torch.where(finite, scale, backed),
                                (self.good_steps + 1).masked_fill_(reset, 0),
                                self.skipped_steps + counted, self.min_scale), self._config())

    def adjust_(self, finite, *, growth_interval: int | None = None,
                growth_factor: float | None = None,
                backoff_factor: float | None = None) -> LossScale:
        """:meth:`adjust`, written into this scale's own tensors (in place, each after every
        value is found): the same tensors, on the same device, step after step, so that a
        CUDA graph that captured a step keeps adjusting the scale it replays. Returns
        ``self``."""
        got = self._adjusted(finite, growth_interval, growth_factor, backoff_factor)
        if got is not None:
            scale, backed, finite, reset, counted = got
            out = self.loss_scale
            if out.dtype == scale.dtype and finite.device == out.device:
                torch.where(finite, scale, backed, out=out)
            else:  # (where's out= takes neither a scale of another dtype, which the
                # constructor takes, nor, on meta, a flag on the CPU: written by copy_)
                out.copy_(torch.where(finite, scale, backed))
            self.good_steps.add_(1).masked_fill_(reset, 0)
            self.skipped_steps.add_(counted)
        return self

    def _adjusted(self, finite, growth_interval, growth_factor, backoff_factor):
        """What ``adjust`` and ``adjust_`` write, from this scale's values before either
        writes: (the scale where the step is finite, the scale backed off, ``finite`` as a
        0-d bool tensor, where the good steps go back to 0 (their count where they do not:
        n + 1), the 0 or 1 the skipped steps advance by); None for a static scale. The
        settings and ``finite`` are checked first."""
        interval, grow, back = _check_config(
            "LossScale.adjust",
            self.growth_interval if growth_interval is None else growth_interval,
            self.growth_factor if growth_factor is None else growth_factor,
            self.backoff_factor if backoff_factor is None else backoff_factor)
        if isinstance(finite, bool):
            finite = torch.tensor(finite, device=self.loss_scale.device)
        elif not isinstance(finite, torch.Tensor) or finite.dim() != 0 or \
                finite.is_floating_point() or finite.is_complex():
            raise ValueError(f"LossScale.adjust: finite={finite!r} must be a 0-d bool tensor "
                             "(vega.grads_finite) or a Python bool")
        elif finite.dtype != torch.bool:
            finite = finite != 0
        if not self.is_dynamic:
            return None
        s, n = self.loss_scale, self.good_steps
        wide = s.to(_wide(s.device))
        grown = (wide * grow).to(torch.float32)
        backed = (wide * back).to(torch.float32)
        # floored at min_scale, and at least at the smallest normal float32 (TINY): a scale
        # of 0 would skip every later step, and no state could hold it; a scale already
        # below the floor (a subnormal init) stays as it is, never raised by backing off
        floor = torch.minimum(torch.clamp(self.min_scale, min=TINY), s)
        backed = torch.maximum(backed, floor)
        # (n against interval - 1, not n + 1 against interval: a count of 2**31 - 1, which a
        # scale made or loaded may hold, wrapped to -2**31 in int32 and never grew; reset
        # there, its n + 1 is not kept. The count of skipped steps saturates there, as the
        # step counters do, and stays loadable)
        at_interval = n >= interval - 1
        # (grown where at the interval, unless growing overflowed float32 to inf)
        scale = torch.where(at_interval & torch.isfinite(grown), grown, s)
        bad = ~finite
        return scale, backed, finite, at_interval | bad, \
            bad & (self.skipped_steps < _INT32_MAX)

    def to_(self, device) -> LossScale:
        """This scale's tensors moved to ``device``, in place of the old ones (before a step
        uses them: a captured graph holds the tensors it was captured with). Returns
        ``self``."""
        self.loss_scale, self.good_steps, self.skipped_steps, self.min_scale = (
            t.to(device) for t in self.tensors())
        self.device_given = True
        return self

    def step(self, grads: _Tree, step_fn: Callable[[_Tree], _State], state: _State, *,
             reduce_group=None) -> tuple[_State, LossScale]:
        """One loss-scaled step: ``(new state, next loss scale)``.

        Divides ``grads`` by the scale, checks them with :func:`grads_finite` (over
        ``reduce_group`` too, where one is given: a non-finite gradient on any rank
        skips the step on every rank), computes
        ``step_fn(unscaled grads)`` -- the new state, a pytree shaped like ``state`` --
        and keeps every leaf of ``state`` exactly as it was if the gradients were not
        finite (``torch.where``, no host sync). Call it as
        ``(params, st), ls = ls.step(grads, step_fn, (params, st))`` or
        ``vega.LossScale.step(ls, grads, step_fn, (params, st))``.
        """
        unscaled = self.unscale(grads)
        finite = grads_finite(unscaled, reduce_group=reduce_group)
        old_leaves, old_spec = pytree.tree_flatten(state)
        # (each state tensor's version counter: one written in place advanced it; not while
        # dynamo traces, where versions are no values to compare)
        versions = [None] * len(old_leaves) if torch.compiler.is_compiling() else \
            [o._version if isinstance(o, torch.Tensor) and not o.is_inference() else None
             for o in old_leaves]  # (an inference tensor keeps no version counter)
        new = step_fn(unscaled)
        written = next((k for k, (o, v) in enumerate(zip(old_leaves, versions))
                        if v is not None and o._version != v), None)
        if written is not None:  # (its old values are gone: an overflow could not be undone)
            path = pytree.tree_flatten_with_path(state)[0][written][0]  # (its name: '0.w')
            raise ValueError(
                f"LossScale.step: step_fn wrote state leaf {path_name(path) or written!r} "
                "in place (a step with donate=True?), so a step whose gradients are not "
                "finite could not be undone; the state now holds the step's values. Give it "
                "a pure step, or use the step's own loss_scale= (fused: it skips such a step "
                "in place)")
        new_leaves, new_spec = pytree.tree_flatten(new)
        if new_spec != old_spec:
            raise ValueError(f"LossScale.step: step_fn returned a structure {new_spec} "
                             f"different from the state's {old_spec}")
        kept = [torch.where(finite.to(o.device), nw, o)
                if isinstance(o, torch.Tensor) and isinstance(nw, torch.Tensor) else nw
                for nw, o in zip(new_leaves, old_leaves)]
        return pytree.tree_unflatten(kept, old_spec), self.adjust(finite)


LEAVES = ("loss_scale", "good_steps", "skipped_steps", "min_scale")  # (tensors()' order)
# each leaf's dtype and the values it may hold (a negative scale flips every update's sign,
# a NaN one skips every step)
_RULES = {
    "loss_scale": (torch.float32, lambda x: math.isfinite(x) and x > 0, "positive and finite"),
    "good_steps": (torch.int32, lambda x: x >= -1, "at least -1 (-1: a static scale)"),
    "skipped_steps": (torch.int32, lambda x: x >= 0, "at least 0"),
    "min_scale": (torch.float32, lambda x: math.isfinite(x) and x >= 0,
                  "at least 0 and finite (0: no floor)"),
}


def check_scale_values(owner: str, leaves, label: str = "", dtypes: bool = True) -> None:
    """ValueError naming the first of a loss scale's four leaves (``LEAVES``' order) that
    is not a 0-d tensor of its dtype holding a value a scale can take, or a floor above the
    scale. Reads the values (outside any step: a state loaded, a leaf set, a scale made);
    meta tensors, which hold none, are taken as they are. ``dtypes=False``: the values of
    0-d tensors only, of any dtype (the constructor's, which has always taken others)."""
    values = {}
    for name, x in zip(LEAVES, leaves):
        dtype, ok, words = _RULES[name]
        if not dtypes and not (isinstance(x, torch.Tensor) and x.dim() == 0):
            continue
        if dtypes and (not isinstance(x, torch.Tensor) or x.dim() != 0 or x.dtype != dtype):
            raise ValueError(f"{owner}: {label}'{name}' is {_shown(x)}; it must be a 0-d "
                             f"{dtype} tensor")
        if x.device.type == "meta":
            continue
        values[name] = x.item()
        if not ok(values[name]):
            raise ValueError(f"{owner}: {label}'{name}' is {values[name]!r}; it must be {words}")
    if values.get("min_scale", -math.inf) > values.get("loss_scale", math.inf):
        raise ValueError(f"{owner}: {label}'min_scale' is {values['min_scale']!r}, above the "
                         f"scale, {values['loss_scale']!r}")


def _flatten(ls: LossScale):
    return list(ls.tensors()), ls._config()


def _flatten_with_keys(ls: LossScale):
    return ([(pytree.GetAttrKey(name), t) for name, t in zip(LEAVES, ls.tensors())],
            ls._config())


def _unflatten(leaves, config) -> LossScale:
    return LossScale._from(list(leaves), config)


pytree.register_pytree_node(LossScale, _flatten, _unflatten,
                            serialized_type_name="vega.LossScale",
                            flatten_with_keys_fn=_flatten_with_keys)
