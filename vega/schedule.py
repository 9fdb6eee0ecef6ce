"""Learning-rate schedules, evaluated on the device from the step counter.

A schedule maps a step counter ``k >= 0`` (completed steps: 0 for the first
update, optax's ``count`` convention) to a value. Every schedule is a small
picklable object with a readable ``repr``, callable two ways:

- on an integer step tensor (int32 or int64, 0-d, any device; a float one is a
  TypeError, as a float step is): a 0-d float64
  tensor on the same device (float32 on MPS, which has no float64; on a tensor of
  many steps, a tensor of their values, each equal to the value at that step
  alone), computed with tensor
  operations only -- no
  ``.item()``, no Python ``if`` on a tensor -- so that a step which calls it
  compiles under ``torch.compile(fullgraph=True)`` and replays under CUDA graphs
  as the counter advances. A float64 value reaches a float64 parameter's update
  whole; a kernel for lower precision rounds it as it rounds a Python float;
- on a Python int: a Python float, computed in double precision with ``math``.

The two agree to float64 rounding (the tensor path uses torch's ``cos`` and
``pow``, the Python path ``math``'s). A negative tensor step counts as 0 (it cannot
be checked without reading the tensor back); a negative Python int raises
``ValueError``. The formulas are written out in ``docs/conventions.md``; where
they differ from optax the function's docstring says how.

>>> from vega import schedule
>>> s = schedule.warmup_cosine_decay(init_value=0.0, peak_value=1e-3,
...                                  warmup_steps=1000, decay_steps=9000)
>>> s(500)
0.0005
"""
from __future__ import annotations

import math
import numbers
from typing import overload

import torch

from vega.errors import shown

__all__ = [
    "Schedule", "constant", "linear", "cosine_decay", "exponential_decay", "polynomial_decay",
    "warmup_cosine", "warmup_cosine_decay", "cosine_decay_restarts", "one_cycle",
    "piecewise_constant", "join",
]


LAST_STEP = 2**31 - 1  # the last count a state's step counter holds (int32, saturating)
# the attribute in which the runtime keeps a schedule's reach, checked against a range
# (``engine.check_reach``; not pickled or copied with the schedule)
KEPT_REACH = "_vega_reach"


# -- the two ways of computing: Python doubles and device tensors ----------------------

class _Host:
    """Operations on Python numbers, in double precision."""

    cos = staticmethod(math.cos)
    log1p = staticmethod(math.log1p)

    @staticmethod
    def floor(x):
        return float(math.floor(x))

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    @staticmethod
    def clamp(x, lo=None, hi=None):
        if lo is not None and x < lo:
            x = lo
        if hi is not None and x > hi:
            x = hi
        return x

    @staticmethod
    def pow(a, b):
        try:
            return float(a) ** b
        except OverflowError:  # torch gives inf; so do we
            return math.inf


_HOST = _Host()


class _Device:
    """The same operations on 0-d tensors of one device, at one float dtype."""

    cos = staticmethod(torch.cos)
    log1p = staticmethod(torch.log1p)
    floor = staticmethod(torch.floor)

    def __init__(self, device: torch.device):
        self.device = device
        self.dtype = torch.float32 if device.type == "mps" else torch.float64

    def tensor(self, x) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        # torch.full is a fill on the device, not a host-to-device copy (fine under capture).
        return torch.full((), float(x), dtype=self.dtype, device=self.device)

    def where(self, cond, a, b):
        return torch.where(cond, self.tensor(a), self.tensor(b))

    @staticmethod
    def clamp(x, lo=None, hi=None):
        return torch.clamp(x, min=lo, max=hi)

    @staticmethod
    def pow(a, b):
        """``a ** b``, each element by the scalar loop of torch's ``pow`` on a CPU (the
        one a 0-d tensor takes, and ``math.pow``'s bits): its vectorized loop, which
        contiguous operands take but for their last few elements (from 16 elements, with
        AVX-512), gives some another last bit than the same element alone, so that an
        optimizer class of 16 parameters or more stepped them at rates a unit in the last
        place off their functional steps', and off its last parameters', at the same
        count. An operand viewed with a stride of 2 is no loop's to vectorize (one
        suffices); a GPU's pow is one function of each element."""
        if _vectorized(b):
            b = _strided(b)
        elif _vectorized(a):
            a = _strided(a)
        return a ** b


def _vectorized(x) -> bool:
    """Whether ``x`` is a tensor that torch's CPU loops may take several elements at once."""
    return isinstance(x, torch.Tensor) and x.dim() > 0 and x.device.type == "cpu"


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a view with a stride of 2 (of a copy)."""
    return torch.stack((x, x), dim=-1)[..., 0]


def _cos_factor(r, ops):
    """``0.5 * (1 + cos(pi * r))``: 1 at r = 0, 0 at r = 1."""
    return 0.5 * (1 + ops.cos(math.pi * r))


def _ramp(start, end, k, n, ops):
    """Linear from ``start`` at k = 0 to ``end`` at k = n, then ``end`` exactly."""
    return ops.where(k < n, start + (end - start) * (ops.clamp(k, hi=n) / n), end)


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"a schedule takes an integer step (a Python int or an integer "
                        f"tensor), got {step!r}")
    if step < 0:
        raise ValueError(f"step={step!r} must be non-negative")
    return int(step)


class Schedule:
    """A schedule: ``s(step)`` is its value at a step counter (see the module docstring).

    Subclasses list their parameters in ``_fields`` (shown by ``repr``, compared by
    ``==``) and define ``_at(k, ops)``, the formula written once for both ways of
    computing: ``k`` is a Python int or a float tensor, ``ops`` the matching operations.
    """

    _name = "schedule"
    _fields: tuple[str, ...] = ()

    # (on a step tensor a tensor, on a Python int a float: typed so, a checker infers which)
    @overload
    def __call__(self, step: torch.Tensor) -> torch.Tensor: ...

    @overload
    def __call__(self, step: int) -> float: ...

    def __call__(self, step: torch.Tensor | int) -> torch.Tensor | float:
        if isinstance(step, torch.Tensor):
            if step.is_complex() or step.is_floating_point() or step.dtype == torch.bool:
                raise TypeError(f"a schedule takes an integer step tensor, got {step.dtype}")
            ops = _Device(step.device)
            k = torch.clamp(step.to(ops.dtype), min=0)
            return ops.tensor(self._at(k, ops)).to(ops.dtype).expand(step.shape)
        return float(self._at(_check_step(step), _HOST))

    def elementwise(self) -> bool:
        """True when a tensor of many steps gives each step's value: every schedule of
        this module, a ``join`` of them, and a subclass that defines only ``_at``."""
        return type(self).__call__ is Schedule.__call__

    def reach(self, first: int = 0, last: int = LAST_STEP) -> list[tuple[int, float]] | None:
        """``[(step, value), ...]``: steps in ``[first, last]`` with the values there (the
        Python path's), among which are the smallest and the largest value the schedule
        takes at those steps; None where it cannot tell (a subclass of its own, a ``join``
        with a callable that is not a schedule of this module). Every value listed is one
        the schedule takes. (``cosine_decay_restarts``: the first and last steps of each
        cycle where ``t_mul`` is above 1 and the cycles are at most 1024; else of its
        first two and last two cycles, where its extremes lie unless ``t_mul`` and
        ``m_mul`` are both above 1.) A step reads a schedule's values on the device only, so
        a hyperparameter's range is checked here, on the host, when a schedule is given for
        it: over every count a step counter holds, ``[0, 2**31 - 1]``."""
        steps = self._turns(first, last)
        if steps is None:
            return None
        return [(k, self(k)) for k in sorted({k for k in steps if first <= k <= last})]

    def _turns(self, first: int, last: int):
        """Steps at which the schedule's extremes over ``[first, last]`` lie (others outside
        that interval are dropped); None where unknown."""
        return None

    def _first_outside(self, within, inside: int, out: int) -> int:
        """The first step after ``inside`` and up to ``out``, two consecutive steps ``reach``
        lists, whose value is not ``within`` (a predicate true at ``inside``, false at
        ``out``): found by halves, the schedule being monotonic between the two."""
        while out - inside > 1:
            mid = (inside + out) // 2
            inside, out = (mid, out) if within(self(mid)) else (inside, mid)
        return out

    def _ends(self, first: int, last: int):
        """``_turns`` of a monotonic schedule: the two ends."""
        return (first, last)

    def _at(self, k, ops):
        """The value at step ``k`` (a Python int or a float tensor) with ``ops``."""
        raise TypeError(f"{type(self).__name__} defines neither _at(k, ops) nor __call__")

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={v!r}" for f, v in zip(self._fields, self._values()))
        return f"{self._name}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __getstate__(self):
        # (without what the runtime keeps on the object: ``reach``'s values, checked)
        return {k: v for k, v in self.__dict__.items() if k != KEPT_REACH}

    def __setstate__(self, state):
        """A schedule of this module unpickled (``pickle``, ``copy``, ``torch.load`` with its
        class among the safe globals) is made again by its constructor from its fields,
        checked as they are where given: a file's ``linear`` of ``steps=0`` or of a string
        value failed deep in a step, one of ``steps=-10`` stepped. A subclass of one's own
        takes its state as pickle would."""
        cls = type(self)
        if cls.__module__ != __name__ or not isinstance(state, dict):
            state, slots = state if isinstance(state, tuple) and len(state) == 2 else \
                (state, None)
            self.__dict__.update(state or {})
            for k, v in (slots or {}).items():
                setattr(self, k, v)
            return
        missing = [f for f in cls._fields if f not in state]
        if missing:
            raise ValueError(f"a pickled {cls._name} schedule has no {', '.join(missing)}; "
                             f"{cls._name} has {', '.join(cls._fields)}: the file or pickle "
                             "is not one a vega wrote")
        cls.__init__(self, **{f: state[f] for f in cls._fields})

    def _no_arithmetic(self, *other):
        # A torch LR scheduler scales a group's lr (StepLR: lr * gamma; CosineAnnealingLR:
        # lr - eta_min; ReduceLROnPlateau: float(lr)): say so, where Python would only say
        # that the operand types are unsupported.
        raise TypeError(f"{self!r} is a vega schedule, which a step evaluates on the "
                        "device at its step counter: it has no arithmetic and no float "
                        "value, so a torch LR scheduler cannot scale it. Give the optimizer "
                        "a number for lr and let the torch scheduler move it, or use the "
                        "vega schedule alone (vega.schedule.join chains schedules)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_arithmetic
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __float__ = _no_arithmetic


# -- argument checks --------------------------------------------------------------------

def _real(who: str, name: str, value) -> float:
    try:  # (an int past the float range, 10**400, is no float: OverflowError)
        x = float(value) if isinstance(value, numbers.Real) else math.nan
    except OverflowError:
        x = math.inf
    if isinstance(value, bool) or not math.isfinite(x):
        raise ValueError(f"{who}: {name}={shown(value)} must be a finite real number")
    return x


def _positive(who: str, name: str, value) -> float:
    x = _real(who, name, value)
    if x <= 0:
        raise ValueError(f"{who}: {name}={value!r} must be positive")
    return x


MAX_STEPS = 2**63 - 1  # the largest count of steps a schedule takes: an int64 step's


def _length(who: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0 \
            or value > MAX_STEPS:
        raise ValueError(f"{who}: {name}={value!r} must be a positive integer of at most "
                         f"2**63 - 1")
    return int(value)


# -- the schedules ----------------------------------------------------------------------

class Constant(Schedule):
    """The schedule that :func:`constant` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "constant", ("value",)
    _turns = Schedule._ends

    def __init__(self, value):
        self.value = _real(self._name, "value", value)

    def _at(self, k, ops):
        return self.value


class Linear(Schedule):
    """The schedule that :func:`linear` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "linear", ("init_value", "end_value", "steps")
    _turns = Schedule._ends

    def __init__(self, init_value, end_value, steps):
        self.init_value = _real(self._name, "init_value", init_value)
        self.end_value = _real(self._name, "end_value", end_value)
        self.steps = _length(self._name, "steps", steps)

    def _at(self, k, ops):
        return _ramp(self.init_value, self.end_value, k, self.steps, ops)


class CosineDecay(Schedule):
    """The schedule that :func:`cosine_decay` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "cosine_decay", ("init_value", "decay_steps", "alpha")
    _turns = Schedule._ends

    def __init__(self, init_value, decay_steps, alpha=0.0):
        self.init_value = _real(self._name, "init_value", init_value)
        self.decay_steps = _length(self._name, "decay_steps", decay_steps)
        self.alpha = _real(self._name, "alpha", alpha)

    def _at(self, k, ops):
        cf = _cos_factor(ops.clamp(k, hi=self.decay_steps) / self.decay_steps, ops)
        return self.init_value * ((1 - self.alpha) * cf + self.alpha)


class ExponentialDecay(Schedule):
    """The schedule that :func:`exponential_decay` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "exponential_decay", ("init_value", "decay_rate", "decay_steps")
    _turns = Schedule._ends

    def __init__(self, init_value, decay_rate, decay_steps):
        self.init_value = _real(self._name, "init_value", init_value)
        self.decay_rate = _positive(self._name, "decay_rate", decay_rate)
        self.decay_steps = _length(self._name, "decay_steps", decay_steps)

    def _at(self, k, ops):
        return self.init_value * ops.pow(self.decay_rate, k / self.decay_steps)


class PolynomialDecay(Schedule):
    """The schedule that :func:`polynomial_decay` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "polynomial_decay", ("init_value", "end_value", "decay_steps", "power")
    _turns = Schedule._ends

    def __init__(self, init_value, end_value, decay_steps, power=1.0):
        self.init_value = _real(self._name, "init_value", init_value)
        self.end_value = _real(self._name, "end_value", end_value)
        self.decay_steps = _length(self._name, "decay_steps", decay_steps)
        self.power = _positive(self._name, "power", power)

    def _at(self, k, ops):
        frac = 1 - ops.clamp(k, hi=self.decay_steps) / self.decay_steps
        return self.end_value + (self.init_value - self.end_value) * ops.pow(frac, self.power)


class WarmupCosine(Schedule):
    """The schedule that :func:`warmup_cosine` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "warmup_cosine", ("init_value", "peak_value", "warmup_steps")
    _turns = Schedule._ends

    def __init__(self, init_value, peak_value, warmup_steps):
        self.init_value = _real(self._name, "init_value", init_value)
        self.peak_value = _real(self._name, "peak_value", peak_value)
        self.warmup_steps = _length(self._name, "warmup_steps", warmup_steps)

    def _at(self, k, ops):
        n = self.warmup_steps
        cf = _cos_factor(ops.clamp(k, hi=n) / n, ops)
        rising = self.init_value + (self.peak_value - self.init_value) * (1 - cf)
        return ops.where(k < n, rising, self.peak_value)


def _cosine_tail(start, end, j, n, ops):
    """From ``start`` at j = 0 down (cosine) to ``end`` at j = n, then ``end``."""
    cf = _cos_factor(ops.clamp(j, lo=0, hi=n) / n, ops)
    return ops.where(j < n, end + (start - end) * cf, end)


class WarmupCosineDecay(Schedule):
    """The schedule that :func:`warmup_cosine_decay` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name = "warmup_cosine_decay"
    _fields = ("init_value", "peak_value", "warmup_steps", "decay_steps", "end_value")

    def __init__(self, init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
        self.init_value = _real(self._name, "init_value", init_value)
        self.peak_value = _real(self._name, "peak_value", peak_value)
        self.warmup_steps = _length(self._name, "warmup_steps", warmup_steps)
        self.decay_steps = _length(self._name, "decay_steps", decay_steps)
        self.end_value = _real(self._name, "end_value", end_value)

    def _turns(self, first, last):
        return (first, last, self.warmup_steps)  # (rising, or falling, to the peak, then back)

    def _at(self, k, ops):
        w = self.warmup_steps
        warm = _ramp(self.init_value, self.peak_value, k, w, ops)
        tail = _cosine_tail(self.peak_value, self.end_value, k - w, self.decay_steps, ops)
        return ops.where(k <= w, warm, tail)


_FAR = 2.0 ** 100  # past any step a counter or a Python int of 64 bits holds
_CYCLES_LISTED = 1024  # (``_turns``: the most cycles listed one by one)


class CosineDecayRestarts(Schedule):
    """The schedule that :func:`cosine_decay_restarts` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name = "cosine_decay_restarts"
    _fields = ("init_value", "decay_steps", "t_mul", "m_mul", "alpha")

    def __init__(self, init_value, decay_steps, t_mul=1.0, m_mul=1.0, alpha=0.0):
        self.init_value = _real(self._name, "init_value", init_value)
        self.decay_steps = _length(self._name, "decay_steps", decay_steps)
        self.t_mul = _real(self._name, "t_mul", t_mul)
        if self.t_mul < 1:
            raise ValueError(f"{self._name}: t_mul={t_mul!r} must be at least 1 (cycles that "
                             "shrink would end after finitely many steps)")
        self.m_mul = _positive(self._name, "m_mul", m_mul)
        self.alpha = _real(self._name, "alpha", alpha)

    def _start(self, c, ops):
        """The first step of cycle ``c``: the whole step it is within rounding of (1e-12,
        relative), where it is (``t_mul=1.2`` is 1.19999999999999996 in binary: cycle 1 of
        ``decay_steps=10`` lasts 12 steps, and cycle 2 starts at step 22, not at
        22.000000000000004 one step later; a start that is not whole stays as it is, up to
        the 2**31 steps a counter holds)."""
        d, t = self.decay_steps, self.t_mul
        if t == 1:
            return d * c
        # (past any step, 2**100, where t ** c overflows: a huge t_mul's next cycle)
        s = ops.clamp(d * (ops.pow(t, c) - 1) / (t - 1), hi=_FAR)
        whole = ops.floor(s + 0.5)
        tol = 1e-12 * (1 + whole)
        return ops.where(s - whole <= tol, ops.where(whole - s <= tol, whole, s), s)

    def _turns(self, first, last):
        # A cycle's extremes are at its first and last steps. With t_mul > 1 (at most
        # _CYCLES_LISTED cycles in the interval, as for any t_mul not within a hair of 1),
        # those of every cycle: a cycle's last step falls short of its end by a fraction
        # that changes from cycle to cycle (t_mul=1.5), and so does the value there, not
        # monotonically. Else the cycles are whole steps long, their amplitude changes
        # monotonically, and the value at a cycle's last step with its length: the extremes
        # are in the first two cycles of the interval and the last two (but where the
        # amplitude and the length both grow). Cycles found from the closed form's cycle of
        # a step, not counted one by one.
        ca, cb = (int(self._cycle(k, _HOST)) for k in (first, last))
        steps = [first, last]
        every = self.t_mul != 1 and cb - ca <= _CYCLES_LISTED
        for c in range(ca, cb + 1) if every else {ca, ca + 1, cb - 1, cb}:
            if c >= 0:
                start, end = (self._start(float(x), _HOST) for x in (c, c + 1))
                steps += [math.ceil(start), math.ceil(end) - 1]
        return steps

    def _first_outside(self, within, inside: int, out: int) -> int:
        # Cycles of one length (t_mul = 1) between the two and unlisted: a step's value
        # moves monotonically from cycle to cycle at a given place in the cycle, so once a
        # cycle has a step outside (one of its two ends: a cycle is monotonic), every later
        # one has. The first such cycle found by halves over cycles, then its step.
        d = self.decay_steps
        lo, hi = inside // d, out // d
        if self.t_mul != 1 or hi - lo < 2:
            return super()._first_outside(within, inside, out)

        def clear(c: int) -> bool:
            return within(self(c * d)) and within(self(c * d + d - 1))
        while hi - lo > 1:  # (cycle lo holds inside, within, and its ends are listed)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if clear(mid) else (lo, mid)
        start = hi * d
        if not within(self(start)):
            return start
        return super()._first_outside(within, start, min(start + d - 1, out))

    def _cycle(self, k, ops):
        """The cycle that step ``k`` is in."""
        d, t = self.decay_steps, self.t_mul
        if t == 1:
            c = ops.floor(k / d)
        else:
            # (k * (t - 1) capped where it would overflow, with a huge t_mul: there, cycle 1
            # or 2 of the estimate, which the checks below put right)
            c = ops.floor(ops.log1p(ops.clamp(k * (t - 1) / d, hi=_FAR)) / math.log(t))
        # The closed form may be off by one at a cycle boundary through rounding.
        c = ops.where(k < self._start(c, ops), c - 1, c)
        return ops.where(k >= self._start(c + 1, ops), c + 1, c)

    def _at(self, k, ops):
        d, t = self.decay_steps, self.t_mul
        c = self._cycle(k, ops)
        length = d * ops.pow(t, c)
        amp = self.init_value * ops.pow(self.m_mul, c)
        cf = _cos_factor((k - self._start(c, ops)) / length, ops)
        return amp * ((1 - self.alpha) * cf + self.alpha)


class OneCycle(Schedule):
    """The schedule that :func:`one_cycle` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name = "one_cycle"
    _fields = ("max_value", "total_steps", "div_factor", "final_div_factor", "pct_start")

    def __init__(self, max_value, total_steps, div_factor=25.0, final_div_factor=1e4,
                 pct_start=0.3):
        who = self._name
        self.max_value = _real(who, "max_value", max_value)
        self.total_steps = _length(who, "total_steps", total_steps)
        self.div_factor = _positive(who, "div_factor", div_factor)
        self.final_div_factor = _positive(who, "final_div_factor", final_div_factor)
        self.pct_start = _real(who, "pct_start", pct_start)
        if not 0 < self.pct_start < 1:
            raise ValueError(f"{who}: pct_start={pct_start!r} must lie in (0, 1)")
        if self._warmup() < 1:
            raise ValueError(f"{who}: pct_start={pct_start!r} with total_steps={total_steps!r} "
                             "leaves no warmup step (floor(pct_start * total_steps) is 0)")

    def _warmup(self) -> int:
        return math.floor(self.pct_start * self.total_steps)

    def _turns(self, first, last):
        return (first, last, self._warmup())

    def _at(self, k, ops):
        w, peak = self._warmup(), self.max_value
        warm = _ramp(peak / self.div_factor, peak, k, w, ops)
        final = peak / self.final_div_factor
        tail = _cosine_tail(peak, final, k - w, self.total_steps - w, ops)
        return ops.where(k <= w, warm, tail)


class PiecewiseConstant(Schedule):
    """The schedule that :func:`piecewise_constant` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "piecewise_constant", ("boundaries", "values")

    def __init__(self, boundaries, values):
        who = self._name
        try:
            bounds, vals = tuple(boundaries), tuple(values)
        except TypeError:
            raise ValueError(f"{who}: boundaries={boundaries!r} and values={values!r} must be "
                             "sequences") from None
        for b in bounds:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0 \
                    or b > MAX_STEPS:
                raise ValueError(f"{who}: boundaries={boundaries!r} must be non-negative "
                                 f"integers of at most 2**63 - 1, got {b!r}")
        if any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
            raise ValueError(f"{who}: boundaries={boundaries!r} must be strictly increasing")
        if len(vals) != len(bounds) + 1:
            raise ValueError(f"{who}: values={values!r} must have len(boundaries) + 1 = "
                             f"{len(bounds) + 1} entries, got {len(vals)}")
        self.boundaries = tuple(int(b) for b in bounds)
        self.values = tuple(_real(who, "values", v) for v in vals)

    def _turns(self, first, last):
        return (first, last, *(b + 1 for b in self.boundaries))  # (each value's first step)

    def _at(self, k, ops):
        out = self.values[-1]
        for b, v in zip(reversed(self.boundaries), reversed(self.values[:-1])):
            out = ops.where(k <= b, v, out)
        return out


class Join(Schedule):
    """The schedule that :func:`join` makes (see it); the class is named for
    ``torch.serialization.add_safe_globals`` and ``isinstance``."""

    _name, _fields = "join", ("segments",)

    def __init__(self, segments):
        who = self._name
        try:
            segs = tuple(segments)
        except TypeError:
            raise ValueError(f"{who}: segments={segments!r} must be a sequence of "
                             "(steps, schedule) pairs") from None
        if not segs:
            raise ValueError(f"{who}: segments={segments!r} must not be empty")
        checked = []
        for seg in segs:
            if not (isinstance(seg, (tuple, list)) and len(seg) == 2):
                raise ValueError(f"{who}: segment {seg!r} must be a (steps, schedule) pair")
            n, s = seg
            n = _length(who, "steps of a segment", n)
            if isinstance(s, numbers.Real) and not isinstance(s, bool):
                s = Constant(s)
            if not callable(s):
                raise ValueError(f"{who}: segment schedule {s!r} must be a schedule or a number")
            checked.append((n, s))
        self.segments = tuple(checked)

    def __repr__(self) -> str:
        return f"join([{', '.join(f'({n}, {s!r})' for n, s in self.segments)}])"

    def elementwise(self) -> bool:
        """:meth:`Schedule.elementwise`: True where every segment's schedule is."""
        return all(isinstance(s, Schedule) and s.elementwise() for _, s in self.segments)

    def reach(self, first: int = 0, last: int = LAST_STEP) -> list[tuple[int, float]] | None:
        """:meth:`Schedule.reach`, from each segment's: None where a segment's schedule is
        not one of this module (a callable of one's own)."""
        # each segment's, over the steps of the interval it runs (the last, to the end)
        out = []
        offsets = self._offsets()
        for i, (off, (_, s)) in enumerate(zip(offsets, self.segments)):
            end = last if i + 1 == len(offsets) else min(last, offsets[i + 1] - 1)
            lo = max(first, off)
            if lo > end:
                continue
            mine = s.reach(lo - off, end - off) if isinstance(s, Schedule) else None
            if mine is None:
                return None
            out += [(k + off, v) for k, v in mine]
        return out

    def _first_outside(self, within, inside: int, out: int) -> int:
        # (both in the segment of ``out``: ``reach`` lists each segment's first step)
        offsets = self._offsets()
        i = max(j for j, off in enumerate(offsets) if off <= out)
        off, s = offsets[i], self.segments[i][1]
        if inside < off:  # (the segment's first step, listed, is the one)
            return out
        return off + s._first_outside(within, inside - off, out - off)

    def _offsets(self) -> list[int]:
        out, total = [], 0
        for n, _ in self.segments:
            out.append(total)
            total += n
        return out

    def __call__(self, step):
        offsets = self._offsets()
        scheds = [s for _, s in self.segments]
        if isinstance(step, torch.Tensor):
            ops = _Device(step.device)
            # in int64 (an int32 step beside an offset past 2**31 wrapped); the segments no
            # step reaches (from an offset past 2**63 - 1) left out; each segment sees its
            # own step count, 0 before it starts (every one is evaluated, the step's picked)
            k = step.to(torch.int64)
            last = max(i for i, off in enumerate(offsets) if off <= MAX_STEPS)

            def at(i):
                mine = torch.clamp(k - offsets[i], min=0).to(step.dtype)
                return ops.tensor(scheds[i](mine)).to(ops.dtype)

            out = at(last)
            for i in reversed(range(last)):
                out = torch.where(k < offsets[i + 1], at(i), out)
            return out.expand(step.shape)
        k = _check_step(step)
        i = max(i for i, off in enumerate(offsets) if off <= k)
        return float(scheds[i](k - offsets[i]))


# -- the public constructors ------------------------------------------------------------

def constant(value) -> Schedule:
    """``value`` at every step."""
    return Constant(value)


def linear(init_value, end_value, steps) -> Schedule:
    """``init + (end - init) * k / steps`` for ``k < steps``, then ``end_value``."""
    return Linear(init_value, end_value, steps)


def cosine_decay(init_value, decay_steps, alpha=0.0) -> Schedule:
    """``init * ((1 - alpha) * 0.5 * (1 + cos(pi * k / decay_steps)) + alpha)`` for
    ``k < decay_steps``, then ``alpha * init_value`` (optax's ``cosine_decay_schedule``)."""
    return CosineDecay(init_value, decay_steps, alpha)


def exponential_decay(init_value, decay_rate, decay_steps) -> Schedule:
    """``init * decay_rate ** (k / decay_steps)``, continuous (no staircase).

    ``decay_rate`` must be positive; above 1 the value grows.
    """
    return ExponentialDecay(init_value, decay_rate, decay_steps)


def polynomial_decay(init_value, end_value, decay_steps, power=1.0) -> Schedule:
    """``end + (init - end) * (1 - k / decay_steps) ** power`` for ``k < decay_steps``,
    then ``end_value``. ``power`` must be positive."""
    return PolynomialDecay(init_value, end_value, decay_steps, power)


def warmup_cosine(init_value, peak_value, warmup_steps) -> Schedule:
    """A half-cosine rise from ``init_value`` to ``peak_value`` over ``warmup_steps``,
    then ``peak_value``."""
    return WarmupCosine(init_value, peak_value, warmup_steps)


def warmup_cosine_decay(init_value, peak_value, warmup_steps, decay_steps,
                        end_value=0.0) -> Schedule:
    """Linear ``init -> peak`` for ``k <= warmup_steps``, then a cosine decay to
    ``end_value`` over ``decay_steps`` more steps, then ``end_value``.

    Unlike optax's ``warmup_cosine_decay_schedule``, ``decay_steps`` counts the steps
    *after* the warmup: the whole schedule lasts ``warmup_steps + decay_steps``.
    """
    return WarmupCosineDecay(init_value, peak_value, warmup_steps, decay_steps, end_value)


def cosine_decay_restarts(init_value, decay_steps, t_mul=1.0, m_mul=1.0,
                          alpha=0.0) -> Schedule:
    """SGDR (Loshchilov & Hutter): cosine cycles restarting from the top.

    Cycle ``c`` lasts ``decay_steps * t_mul ** c`` steps (``t_mul >= 1``) and has
    amplitude ``amp = init_value * m_mul ** c``; at position ``j`` in it the value is
    ``amp * ((1 - alpha) * 0.5 * (1 + cos(pi * j / length)) + alpha)``. Unlike
    TensorFlow's ``CosineDecayRestarts``, the floor ``alpha`` scales with the amplitude.
    """
    return CosineDecayRestarts(init_value, decay_steps, t_mul, m_mul, alpha)


def one_cycle(max_value, total_steps, div_factor=25.0, final_div_factor=1e4,
              pct_start=0.3) -> Schedule:
    """One cycle (Smith): with ``w = floor(pct_start * total_steps)``, linear from
    ``max_value / div_factor`` to ``max_value`` for ``k <= w``, then a cosine decay to
    ``max_value / final_div_factor`` over ``total_steps - w`` steps, then that value.

    Unlike torch's ``OneCycleLR`` and optax's ``cosine_onecycle_schedule``, the warmup
    is linear and the final value is ``max_value / final_div_factor`` (they use
    ``max_value / (div_factor * final_div_factor)``).
    """
    return OneCycle(max_value, total_steps, div_factor, final_div_factor, pct_start)


def piecewise_constant(boundaries, values) -> Schedule:
    """``values[i]`` for the first ``i`` with ``k <= boundaries[i]``, else ``values[-1]``.

    ``boundaries`` are strictly increasing non-negative integers and
    ``len(values) == len(boundaries) + 1`` (TensorFlow's ``PiecewiseConstantDecay``).
    Unlike optax's ``piecewise_constant_schedule``, these are the values themselves,
    not multiplicative scales, and the value changes after a boundary, not at it.
    """
    return PiecewiseConstant(boundaries, values)


def join(segments) -> Schedule:
    """Schedules one after another: ``segments`` is ``[(n, schedule), ...]``.

    Each schedule runs for its ``n`` steps, seeing the step number restart at 0 within
    its segment (``k - sum of earlier n``); the last one continues past the total. A
    number in place of a schedule is a constant. As optax's ``join_schedules``, but
    given segment lengths rather than cumulative boundaries.
    """
    return Join(segments)
