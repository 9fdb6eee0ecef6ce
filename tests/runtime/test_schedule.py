"""vega.schedule against optax (float64) where the definitions coincide, and against the
formulas of docs/conventions.md, written out by hand, where they do not."""
import io
import math
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch._dynamo.testing

import vega
from vega import schedule

jax.config.update("jax_enable_x64", True)


def optax_values(fn, n):
    return np.asarray(jax.vmap(fn)(jnp.arange(n, dtype=jnp.int64)), dtype=np.float64)


def device_values(s, n):
    """The tensor path at steps 0..n-1, alternating int32 and int64 step tensors."""
    out = []
    for k in range(n):
        v = s(torch.tensor(k, dtype=torch.int32 if k % 2 else torch.int64))
        assert isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 0
        out.append(v.item())
    return np.array(out)


def check(s, expected):
    """Python-int path and tensor path (float64 both) to 1e-12, against ``expected``."""
    expected = np.asarray(expected, dtype=np.float64)
    n = len(expected)
    scale = max(np.abs(expected).max(), 1e-300)
    host = [s(k) for k in range(n)]
    assert all(type(v) is float for v in host)
    np.testing.assert_allclose(host, expected, rtol=1e-12, atol=1e-12 * scale)
    np.testing.assert_allclose(device_values(s, n), expected, rtol=1e-12, atol=1e-12 * scale)


def sgdr_kwargs(init, decay_steps, t_mul, m_mul, alpha, cycles):
    """optax.sgdr_schedule's cycles (warmup-free warmup_cosine_decay) for vega's SGDR."""
    return [dict(init_value=init * m_mul**c, peak_value=init * m_mul**c, warmup_steps=0,
                 decay_steps=int(decay_steps * t_mul**c), end_value=alpha * init * m_mul**c)
            for c in range(cycles)]


# (id, vega schedule, optax schedule, steps): the definitions coincide.
AGREE = [
    ("constant", schedule.constant(0.3), optax.constant_schedule(0.3), 10),
    ("linear", schedule.linear(0.1, 1.7, 37), optax.linear_schedule(0.1, 1.7, 37), 60),
    ("linear-down", schedule.linear(1e-3, 0.0, 20), optax.linear_schedule(1e-3, 0.0, 20), 30),
    ("cosine_decay", schedule.cosine_decay(2e-3, 40, alpha=0.05),
     optax.cosine_decay_schedule(2e-3, 40, alpha=0.05), 60),
    ("exponential_decay", schedule.exponential_decay(1.0, 0.3, 17),
     optax.exponential_decay(1.0, transition_steps=17, decay_rate=0.3), 80),
    ("exponential_growth", schedule.exponential_decay(0.5, 1.5, 9),
     optax.exponential_decay(0.5, transition_steps=9, decay_rate=1.5), 40),
    ("polynomial_decay", schedule.polynomial_decay(1.0, 0.01, 45, power=2.5),
     optax.polynomial_schedule(1.0, 0.01, 2.5, 45), 60),
    # optax's cosine interpolation from init to init * scale is the same half-cosine rise.
    ("warmup_cosine", schedule.warmup_cosine(0.01, 1.0, 25),
     optax.piecewise_interpolate_schedule("cosine", 0.01, {25: 100.0}), 40),
    # optax's decay_steps counts the warmup; vega's counts after it: 30 here is optax's 40.
    ("warmup_cosine_decay", schedule.warmup_cosine_decay(0.0, 1e-3, 10, 30, end_value=1e-5),
     optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 40, end_value=1e-5), 60),
    # SGDR: optax's sgdr_schedule takes the cycles one by one; its last cycle does not
    # restart, so compare over the cycles given (10 + 20 + 40 steps).
    ("cosine_decay_restarts", schedule.cosine_decay_restarts(1.0, 10, 2.0, 0.5, alpha=0.1),
     optax.sgdr_schedule(sgdr_kwargs(1.0, 10, 2.0, 0.5, 0.1, 3)), 70),
    ("cosine_decay_restarts-t1", schedule.cosine_decay_restarts(0.5, 7, m_mul=0.8),
     optax.sgdr_schedule(sgdr_kwargs(0.5, 7, 1.0, 0.8, 0.0, 6)), 42),
    # optax.join_schedules restarts the step number too; it takes cumulative boundaries
    # (10, 30) where vega takes segment lengths (10, 20, ...).
    ("join", schedule.join([(10, schedule.linear(0.0, 1.0, 10)),
                            (20, schedule.cosine_decay(1.0, 20)),
                            (5, schedule.linear(0.1, 0.0, 50))]),
     optax.join_schedules([optax.linear_schedule(0.0, 1.0, 10),
                           optax.cosine_decay_schedule(1.0, 20),
                           optax.linear_schedule(0.1, 0.0, 50)], [10, 30]), 90),
    # Values, not scales, and the change after a boundary rather than at it: vega's
    # boundaries (5, 12) with values (1, 0.5, 0.05) are optax's {6: 0.5, 13: 0.1}.
    ("piecewise_constant", schedule.piecewise_constant([5, 12], [1.0, 0.5, 0.05]),
     optax.piecewise_constant_schedule(1.0, {6: 0.5, 13: 0.1}), 20),
]


@pytest.mark.parametrize("s,ref,n", [a[1:] for a in AGREE], ids=[a[0] for a in AGREE])
def test_matches_optax(s, ref, n):
    check(s, optax_values(ref, n))


c, pi = math.cos, math.pi

# Where docs/conventions.md differs from optax: its formulas, written out step by step.
BY_HAND = [
    # warmup_cosine_decay: decay_steps=4 *after* a warmup of 2 (optax would end at step 4).
    ("warmup_cosine_decay", schedule.warmup_cosine_decay(0.1, 1.0, 2, 4, end_value=0.2),
     [0.1, 0.55, 1.0,
      0.2 + 0.8 * 0.5 * (1 + c(pi / 4)), 0.2 + 0.8 * 0.5 * (1 + c(pi / 2)),
      0.2 + 0.8 * 0.5 * (1 + c(3 * pi / 4)), 0.2, 0.2]),
    # piecewise_constant: the values themselves; k <= boundary keeps the earlier value
    # (optax: multiplicative scales, switching at the boundary).
    ("piecewise_constant", schedule.piecewise_constant([0, 2, 3], [5.0, 4.0, 3.0, 2.0]),
     [5.0, 4.0, 4.0, 3.0, 2.0, 2.0]),
    # join: each segment sees its own step from 0; the last continues past the total.
    ("join", schedule.join([(2, schedule.constant(7.0)), (3, schedule.linear(1.0, 0.0, 4)),
                            (1, schedule.linear(9.0, 8.0, 2))]),
     [7.0, 7.0, 1.0, 0.75, 0.5, 9.0, 8.5, 8.0, 8.0]),
    # one_cycle: w = floor(0.4 * 10) = 4; linear 0.1 -> 1 for k <= 4, then a cosine from
    # 1 down to max / final_div_factor = 0.01 over 6 steps. torch's OneCycleLR and optax's
    # cosine_onecycle_schedule warm up by a cosine and end at max / (div * final_div).
    ("one_cycle", schedule.one_cycle(1.0, 10, div_factor=10.0, final_div_factor=100.0,
                                     pct_start=0.4),
     [0.1, 0.325, 0.55, 0.775, 1.0]
     + [0.01 + 0.99 * 0.5 * (1 + c(pi * j / 6)) for j in range(1, 6)] + [0.01, 0.01]),
    # cosine_decay_restarts with cycle lengths 4, 6, 9 (t_mul = 1.5), amplitude halving.
    ("cosine_decay_restarts", schedule.cosine_decay_restarts(2.0, 4, t_mul=1.5, m_mul=0.5,
                                                             alpha=0.25),
     [2.0 * (0.75 * 0.5 * (1 + c(pi * j / 4)) + 0.25) for j in range(4)]
     + [1.0 * (0.75 * 0.5 * (1 + c(pi * j / 6)) + 0.25) for j in range(6)]
     + [0.5 * (0.75 * 0.5 * (1 + c(pi * j / 9)) + 0.25) for j in range(9)]
     + [0.25 * (0.75 * 0.5 * (1 + c(pi * j / 13.5)) + 0.25) for j in range(3)]),
]


@pytest.mark.parametrize("s,expected", [a[1:] for a in BY_HAND], ids=[a[0] for a in BY_HAND])
def test_semantics_by_hand(s, expected):
    check(s, expected)


def test_restarts_far_out_match_a_running_sum():
    """The closed form for the cycle (log, then corrected by one) against cycle starts
    accumulated one by one, over many boundaries, on both paths."""
    s = schedule.cosine_decay_restarts(1.0, 8, t_mul=1.5, m_mul=0.9, alpha=0.1)
    expected, start, length, amp = [], 0.0, 8.0, 1.0
    for k in range(3000):
        while k >= start + length:
            start, length, amp = start + length, length * 1.5, amp * 0.9
        expected.append(amp * (0.9 * 0.5 * (1 + c(pi * (k - start) / length)) + 0.1))
    check(s, expected)


@pytest.mark.parametrize("decay,t_mul,restart", [(10, 1.2, 22), (5, 1.2, 11), (100, 1.1, 331),
                                                 (50, 1.4, 120)])
def test_restarts_at_a_whole_step_a_decimal_t_mul_puts_them_on(decay, t_mul, restart):
    """10 * 1.2 is 12 steps: cycle 2 starts at step 22, though in binary 1.2 puts its start at
    22.000000000000004 (the step ran at the old cycle's floor, a step late to restart)."""
    s = schedule.cosine_decay_restarts(1.0, decay, t_mul=t_mul, alpha=0.25)
    assert s(restart) == 1.0 and float(s(torch.tensor(restart))) == 1.0
    assert s(restart - 1) < 0.5 and float(s(torch.tensor(restart - 1))) < 0.5


def test_restarts_far_out_keep_a_start_that_is_not_whole():
    """t_mul = 1.25 is exact: cycle 2 of decay_steps=400000001 starts at 900000002.25, and
    step 900000002 is still cycle 1's last (a tolerance of 1e-9 snapped it to the restart)."""
    s = schedule.cosine_decay_restarts(1.0, 400000001, t_mul=1.25)
    assert s(900000002) < 1e-9 and float(s(torch.tensor(900000002))) < 1e-9
    assert s(900000003) == 1.0 and float(s(torch.tensor(900000003))) == 1.0


@pytest.mark.parametrize("t_mul", [1e20, 1e154, 1e200, 1e300])
def test_restarts_with_a_huge_t_mul_stay_in_cycle_one(t_mul):
    """With decay_steps=1, cycle 1 starts at step 1 and lasts t_mul steps: every step a
    counter holds is in it. t_mul ** 2 and k * t_mul overflow a double past 1.3e154 and
    1e299: the value went NaN on the device and the host path raised OverflowError."""
    s = schedule.cosine_decay_restarts(1.0, 1, t_mul=t_mul, alpha=0.1)
    for k in (1, 2, 1000, 2**31 - 1, 2**62):
        want = 0.9 * 0.5 * (1 + c(pi * (k - 1) / t_mul)) + 0.1
        assert s(k) == pytest.approx(want, rel=1e-12), k
        if k < 2**31:
            assert float(s(torch.tensor(k, dtype=torch.int32))) == pytest.approx(want, rel=1e-12)


ALL = [a[1] for a in AGREE + BY_HAND]


def test_repr_pickle_and_eval():
    for s in ALL:
        assert pickle.loads(pickle.dumps(s)) == s
        assert eval(repr(s), vars(schedule)) == s
    assert repr(schedule.linear(0.0, 1.0, 10)) == \
        "linear(init_value=0.0, end_value=1.0, steps=10)"


def _crafted(cls, **fields) -> bytes:
    """The pickle of a ``cls`` holding ``fields`` as they are (a file's, written by anyone)."""
    s = cls.__new__(cls)
    s.__dict__.update(fields)
    return pickle.dumps(s)


def test_a_pickled_schedule_is_checked_by_its_constructor_when_loaded():
    """A schedule read back from a pickle or a file (an optimizer's state_dict through
    torch.load, weights_only with the class allowed) is made again by its constructor:
    values it refuses are refused at the load, naming them, not a ZeroDivisionError or a
    TypeError from inside a step (steps=0; a string), nor a schedule that steps
    (steps=-10; boundaries out of order). One of a subclass of one's own loads as it was."""
    for cls, fields, words in [
            (schedule.Linear, dict(init_value=1e-3, end_value=0.0, steps=0), "steps=0"),
            (schedule.Linear, dict(init_value=1e-3, end_value=0.0, steps=-10), "steps=-10"),
            (schedule.Linear, dict(init_value="1e-3", end_value=0.0, steps=10),
             "init_value='1e-3'"),
            (schedule.Linear, dict(init_value=1e-3, end_value=0.0), "has no steps"),
            (schedule.PiecewiseConstant, dict(boundaries=(5, 2), values=(1.0, 0.1, 0.01)),
             "strictly increasing"),
            (schedule.Join, dict(segments=((5, "x"),)), "segment schedule 'x'")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            pickle.loads(_crafted(cls, **fields))
    model = torch.nn.Linear(3, 2)
    opt = vega.optim.AdamW(model.parameters(), lr=schedule.linear(1e-3, 0.0, 10))
    state = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with torch.serialization.safe_globals([schedule.Linear]):
        buffer.seek(0)
        assert torch.load(buffer, weights_only=True)["param_groups"][0]["lr"] == \
            schedule.linear(1e-3, 0.0, 10)
        state["param_groups"][0]["lr"] = pickle.loads(_crafted(
            schedule.Linear, init_value=1e-3, end_value=0.0, steps=10))
        object.__setattr__(state["param_groups"][0]["lr"], "steps", 0)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        with pytest.raises(ValueError, match=re.escape("linear: steps=0 must be a positive")):
            torch.load(buffer, weights_only=True)
    mine = Halved.__new__(Halved)
    mine.__dict__.update(init_value=1.0, end_value=0.0, steps=4, note="mine")
    back = pickle.loads(pickle.dumps(mine))
    assert back.note == "mine" and back(2) == pytest.approx(0.25)


class Halved(schedule.Linear):
    """A subclass of one's own (of another module), with a field of its own."""

    def _at(self, k, ops):
        return super()._at(k, ops) / 2


def test_tensor_step_keeps_device_and_negative_counts_as_zero():
    s = schedule.warmup_cosine_decay(0.5, 1.0, 4, 10)
    assert s(torch.tensor(-3)).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match=re.escape("step=-1")):
        s(-1)
    with pytest.raises(TypeError):
        s(1.5)
    with pytest.raises(TypeError):
        s(torch.tensor(True))
    for dtype in (torch.float32, torch.float64):  # (a step of 2.5, as 2.5 is refused)
        with pytest.raises(TypeError, match=rf"integer step tensor, got {dtype}"):
            s(torch.tensor(2.5, dtype=dtype))


def test_a_tensor_of_steps_gives_each_steps_value_bitwise():
    """What the optimizer classes rely on to evaluate a schedule once for all parameters
    (each has its own counter): the values on a 1-d tensor of steps are, bit for bit,
    those of each step alone."""
    steps = torch.tensor([-2, 0, 1, 2, 3, 5, 9, 10, 11, 17, 29, 30, 31, 64, 99, 1000, 5000,
                          2**31 - 1], dtype=torch.int32)
    for s in ALL:
        assert s.elementwise()
        many = s(steps)
        assert many.shape == steps.shape and many.dtype == torch.float64
        one = torch.stack([s(k) for k in steps])
        assert torch.equal(many.view(torch.int64), one.view(torch.int64)), repr(s)
    assert not schedule.join([(5, schedule.constant(1.0)), (5, lambda k: 0.5 * k)]).elementwise()

    class Own(schedule.Linear):  # its own __call__: vega cannot know it is elementwise
        def __call__(self, step):
            return super().__call__(step)
    assert not Own(1.0, 0.0, 10).elementwise()


POWERS = [schedule.exponential_decay(1.0, 0.5, 1000), schedule.exponential_decay(3e-4, 0.999, 7),
          schedule.polynomial_decay(1.0, 0.1, 5000, 0.7),
          schedule.polynomial_decay(1.0, 0.0, 2**31 - 1, 2.5),
          schedule.cosine_decay_restarts(1.0, 10, 1.0, 0.9),
          schedule.cosine_decay_restarts(1.0, 3, 1.0000001),
          schedule.cosine_decay_restarts(1.0, 7, 2.0, 0.5, 0.1)]


@pytest.mark.parametrize("s", POWERS, ids=repr)
def test_the_powers_of_a_tensor_of_many_steps_are_each_steps_alone(s):
    """The schedules that take powers on a tensor of thousands of steps, and on a tensor of
    40 equal ones: each value, bit for bit, that step's alone (torch's CPU pow gave the
    elements of its vectorized loop another last bit than the same step alone: an
    optimizer class of 16 parameters or more stepped them at a rate a unit in the last
    place off its functional step's, and off its last parameters', at the same count), and
    within rounding of the Python path's."""
    steps = torch.cat([torch.arange(0, 3000), torch.arange(2**31 - 3000, 2**31, 7)])
    many = s(steps)
    one = torch.stack([s(k) for k in steps])
    assert torch.equal(many.view(torch.int64), one.view(torch.int64))
    for k in (181, 2**31 - 5):
        same = s(torch.full((40,), k, dtype=torch.int32))
        assert torch.equal(same, s(torch.tensor(k, dtype=torch.int32)).expand(40))
    host = torch.tensor([s(int(k)) for k in steps], dtype=torch.float64)
    torch.testing.assert_close(many, host, rtol=1e-13, atol=1e-15)


def test_a_class_of_many_parameters_steps_each_at_its_functional_rate():
    """A class of 20 parameters at one count with a decaying power for lr steps each as its
    functional step does, bit for bit (the first 16 were a unit in the last place off)."""
    import vega
    lr = schedule.exponential_decay(1.0, 0.5, 1000)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, dtype=torch.float64, generator=gen))
              for _ in range(20)]
    opt = vega.optim.AdamW(params, lr=lr, backend="reference", weight_decay=0.0)
    for p in params:
        p.grad = torch.zeros(5, dtype=torch.float64)
    opt.step()
    for k in (181, 193, 301):
        for p in params:
            p.grad = torch.randn(5, dtype=torch.float64, generator=gen)
            opt.state[p]["step"].fill_(k)
        before = [(p.detach().clone(), {n: t.clone() for n, t in opt.state[p].items()})
                  for p in params]
        opt.step()
        for p, (q, st) in zip(params, before):
            alone, _ = vega.adamw_step(q, p.grad, st, lr=lr, backend="reference",
                                       weight_decay=0.0)
            assert torch.equal(p.detach(), alone), k


def test_compiles_fullgraph_once():
    """Every schedule on a step tensor in one compiled frame: no graph break, no
    recompilation as the step changes, and the eager values. (aot_eager traces what
    inductor would; a cold inductor compile costs 10-20 s on a small CPU.)"""
    def f(step):
        return torch.stack([s(step) for s in ALL])

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for k in [0, 3, 11, 29, 64, 1000]:
        step = torch.tensor(k, dtype=torch.int32)
        torch.testing.assert_close(compiled(step), f(step), rtol=1e-6, atol=1e-9)
    assert counter.frame_count == 1


def _cases_bad():
    S = schedule
    return [
        (lambda: S.constant(float("nan")), "value=nan"),
        (lambda: S.linear(float("inf"), 0.0, 10), "init_value=inf"),
        (lambda: S.linear(0.0, 1.0, 0), "steps=0"),
        (lambda: S.linear(0.0, 1.0, -5), "steps=-5"),
        (lambda: S.linear(0.0, 1.0, 2.5), "steps=2.5"),
        (lambda: S.linear(0.0, 1.0, 10.0), "steps=10.0"),
        (lambda: S.linear(0.0, 1.0, True), "steps=True"),
        (lambda: S.cosine_decay(1.0, 0), "decay_steps=0"),
        (lambda: S.cosine_decay(1.0, 10, alpha="x"), "alpha='x'"),
        (lambda: S.exponential_decay(1.0, 0.0, 10), "decay_rate=0.0"),
        (lambda: S.exponential_decay(1.0, -0.5, 10), "decay_rate=-0.5"),
        (lambda: S.exponential_decay(1.0, 0.5, 0), "decay_steps=0"),
        (lambda: S.polynomial_decay(1.0, 0.0, 10, power=0), "power=0"),
        (lambda: S.polynomial_decay(1.0, 0.0, 10, power=-1.0), "power=-1.0"),
        (lambda: S.polynomial_decay(1.0, 0.0, -10), "decay_steps=-10"),
        (lambda: S.warmup_cosine(0.0, 1.0, 0), "warmup_steps=0"),
        (lambda: S.warmup_cosine_decay(0.0, 1.0, 0, 10), "warmup_steps=0"),
        (lambda: S.warmup_cosine_decay(0.0, 1.0, 10, -1), "decay_steps=-1"),
        (lambda: S.cosine_decay_restarts(1.0, 0), "decay_steps=0"),
        (lambda: S.cosine_decay_restarts(1.0, 10, t_mul=0.5), "t_mul=0.5"),
        (lambda: S.cosine_decay_restarts(1.0, 10, m_mul=0.0), "m_mul=0.0"),
        (lambda: S.one_cycle(1.0, 0), "total_steps=0"),
        (lambda: S.one_cycle(1.0, 100, pct_start=0.0), "pct_start=0.0"),
        (lambda: S.one_cycle(1.0, 100, pct_start=1.0), "pct_start=1.0"),
        (lambda: S.one_cycle(1.0, 100, pct_start=-0.1), "pct_start=-0.1"),
        (lambda: S.one_cycle(1.0, 10, pct_start=0.05), "pct_start=0.05"),
        (lambda: S.one_cycle(1.0, 100, div_factor=0.0), "div_factor=0.0"),
        (lambda: S.one_cycle(1.0, 100, final_div_factor=-1.0), "final_div_factor=-1.0"),
        (lambda: S.piecewise_constant([5, 3], [1.0, 2.0, 3.0]), "boundaries=[5, 3]"),
        (lambda: S.piecewise_constant([5, 5], [1.0, 2.0, 3.0]), "boundaries=[5, 5]"),
        (lambda: S.piecewise_constant([5], [1.0]), "values=[1.0]"),
        (lambda: S.piecewise_constant([5], [1.0, 2.0, 3.0]), "values=[1.0, 2.0, 3.0]"),
        (lambda: S.piecewise_constant([-1], [1.0, 2.0]), "boundaries=[-1]"),
        (lambda: S.piecewise_constant([2.5], [1.0, 2.0]), "boundaries=[2.5]"),
        (lambda: S.piecewise_constant([1], [1.0, float("nan")]), "values=nan"),
        (lambda: S.join([]), "segments=[]"),
        (lambda: S.join([(0, S.constant(1.0))]), "steps of a segment=0"),
        (lambda: S.join([(-2, S.constant(1.0))]), "steps of a segment=-2"),
        (lambda: S.join([(2.0, S.constant(1.0))]), "steps of a segment=2.0"),
        (lambda: S.join([(3, "x")]), "'x'"),
        (lambda: S.join([S.constant(1.0)]), "segment constant(value=1.0)"),
        # past any step counter's reach (an int64's): refused when made, not at a step
        (lambda: S.cosine_decay(0.1, 2**64), "decay_steps=18446744073709551616"),
        (lambda: S.linear(0.0, 1.0, 2**63), "steps=9223372036854775808"),
        (lambda: S.piecewise_constant([2**63], [1.0, 2.0]), "boundaries=[9223372036854775808]"),
        (lambda: S.join([(2**64, S.constant(1.0))]), "steps of a segment=18446744073709551616"),
        # numbers past the float range: a ValueError naming them (was a bare OverflowError)
        (lambda: S.constant(10**400), "value=10000000000"),
        (lambda: S.linear(0.0, -10**400, 5), "end_value=-1000000000"),
        (lambda: S.piecewise_constant([3], [1.0, 10**400]), "values=1000000000"),
        (lambda: S.join([(3, 10**400)]), "value=1000000000"),
    ]


BAD = _cases_bad()


@pytest.mark.parametrize("make,fragment", BAD, ids=[b[1] for b in BAD])
def test_bad_arguments_raise(make, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make()


class _Counted(schedule.Linear):
    calls = 0

    def _at(self, k, ops):  # (a subclass that defines __call__ is called once per counter)
        type(self).calls += 1
        return super()._at(k, ops)


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_optimizer_class_evaluates_a_schedule_once_a_step(backend):
    """Each parameter of a class has its own step counter: a vega schedule is evaluated
    once a step on all of them, and a parameter that missed a step gets its own step's
    value -- as a functional step of that parameter alone."""
    import vega
    from vega.codegen import c as c_backend
    if backend == "c" and not c_backend.available():
        pytest.skip("no C compiler: no C backend")
    gen = torch.Generator().manual_seed(0)
    shapes = [(10,), (7, 3), ()]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    alone = [p.detach().clone() for p in params]
    states = [vega.adamw_init(p) for p in alone]
    lr = _Counted(1e-2, 1e-3, 4)
    opt = vega.optim.AdamW(params, lr=lr, backend=backend)
    class_calls = []
    for k in range(6):
        for i, p in enumerate(params):
            p.grad = None if (k, i) in {(1, 1), (2, 1), (3, 2)} else \
                torch.randn(p.shape, generator=gen)
        _Counted.calls = 0
        opt.step()
        class_calls.append(_Counted.calls)
        for i, p in enumerate(params):
            if p.grad is not None:
                alone[i], states[i] = vega.adamw_step(alone[i], p.grad, states[i], lr=lr,
                                                      backend=backend)
    assert class_calls == [1 + 1] + [1] * 5  # (and once for the initial states)
    for p, q, st in zip(params, alone, states):
        assert torch.equal(p.detach(), q)
        assert torch.equal(opt.state[p]["step"], st["step"])
        assert torch.equal(opt.state[p]["mu"], st["mu"]) and torch.equal(opt.state[p]["nu"],
                                                                           st["nu"])
    assert [int(opt.state[p]["step"]) for p in params] == [6, 4, 5]


def test_a_callable_that_is_not_a_vega_schedule_is_called_per_counter():
    import vega
    calls = []

    def lr(step):
        calls.append(step)
        return 1e-2 / (1.0 + step.to(torch.float64))

    params = [torch.nn.Parameter(torch.ones(4) * i) for i in range(3)]
    opt = vega.optim.SGD(params, lr=lr, backend="reference")
    for p in params:
        p.grad = torch.ones(4)
    opt.step()
    assert len(calls) == 1 + 3  # the initial states' value, then each counter's
    del calls[:]
    opt.step()
    assert len(calls) == 3
    expected = torch.ones(4) * 2 - (1e-2 + 1e-2 / 2)
    torch.testing.assert_close(params[2].detach(), expected, rtol=1e-6, atol=0)


def test_join_past_an_int32_step_and_the_steps_its_segments_see():
    """A join's segments from offsets past 2**31 pick the value of the host's formula for an
    int32 step tensor too (the comparison wrapped, and took the third segment at step 150),
    and past 2**63 - 1 are never reached; each segment is called with its own step count,
    never a negative one (a user's ``sqrt(k)`` failed with a math domain error on the steps
    before its segment)."""
    s = schedule.join([(100, 0.1), (2**32, 0.2), (10, 0.3)])
    for k, dtype in ((150, torch.int32), (2**31 - 1, torch.int32), (2**32 + 99, torch.int64),
                     (2**32 + 150, torch.int64), (5, torch.int64)):
        assert s(torch.tensor(k, dtype=dtype)).item() == s(k), k
    far = schedule.join([(2**62, 0.1), (2**62, 0.2), (2**62, 0.3)])
    for k in (2**62 + 1, 2**63 - 1):
        assert far(torch.tensor(k)).item() == far(k) == 0.2
    seen = []

    def inverse_sqrt(k):
        seen.append(k)
        if isinstance(k, torch.Tensor):
            return 0.1 / torch.sqrt(k + 1.0)
        return 0.1 / math.sqrt(k + 1)
    s = schedule.join([(10, 0.01), (100, inverse_sqrt)])
    assert s(torch.tensor(3, dtype=torch.int32)).item() == s(3) == 0.01
    assert s(torch.tensor(14, dtype=torch.int32)).item() == pytest.approx(s(14))
    assert s(14) == 0.1 / math.sqrt(5)
    assert all(int(k) >= 0 and k.dtype == torch.int32 for k in seen if isinstance(k, torch.Tensor))


@pytest.mark.parametrize("s", [
    schedule.constant(0.3), schedule.linear(1.0, -1.0, 37),
    schedule.cosine_decay(2.0, 40, alpha=-0.2), schedule.exponential_decay(1.0, 0.3, 17),
    schedule.polynomial_decay(-1.0, 2.0, 50, power=3.0), schedule.warmup_cosine(1.0, -1.0, 30),
    schedule.warmup_cosine_decay(0.5, 2.0, 20, 60, end_value=-0.1),
    schedule.one_cycle(1.0, 90, pct_start=0.4), schedule.piecewise_constant([3, 40], [1, -2, 0.5]),
    schedule.cosine_decay_restarts(1.0, 7, t_mul=1.5, m_mul=0.7, alpha=-0.1),
    schedule.cosine_decay_restarts(-1.0, 9, m_mul=1.2, alpha=0.3),
    # (cycles of 4, 5.2, 6.76, ... steps: the last step of each falls short of its end by
    # another fraction, so the smallest value is in none of the first or last two)
    schedule.cosine_decay_restarts(1.2, 4, t_mul=1.3, m_mul=0.9),
    schedule.cosine_decay_restarts(1.0, 3, t_mul=1.7, m_mul=1.1),
    schedule.join([(13, schedule.linear(0.0, 1.0, 13)), (20, -0.5),
                   (30, schedule.cosine_decay_restarts(2.0, 6, t_mul=2.0))]),
], ids=repr)
@pytest.mark.parametrize("first,last", [(0, 300), (5, 80), (41, 41)])
def test_reach_lists_the_extremes(s, first, last):
    """``reach(first, last)``, which the hyperparameters' range checks read, lists steps of
    the interval with their values, among them the smallest and the largest value there
    (every step evaluated, against it)."""
    listed = s.reach(first, last)
    assert all(first <= k <= last and s(k) == v for k, v in listed)
    values = [s(k) for k in range(first, last + 1)]
    assert min(v for _, v in listed) == min(values)
    assert max(v for _, v in listed) == max(values)


def test_reach_of_what_it_cannot_tell():
    """None for a schedule of one's own and a join of a plain callable: no range checked."""
    class Mine(schedule.Schedule):
        def _at(self, k, ops):
            return 1.0
    assert Mine().reach() is None
    assert schedule.join([(3, 0.1), (3, lambda k: 0.2)]).reach() is None
    assert schedule.linear(1.0, 0.0, 10).reach() == [(0, 1.0), (2**31 - 1, 0.0)]


@pytest.mark.parametrize("scheduler, kw", [
    (torch.optim.lr_scheduler.StepLR, {"step_size": 1}),
    (torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 4}),
    (torch.optim.lr_scheduler.ReduceLROnPlateau, {"patience": 0}),
])
def test_a_torch_lr_scheduler_over_a_vega_schedule_is_told_why_it_cannot(scheduler, kw):
    """A torch scheduler scales a group's lr: a vega schedule there is refused with a
    message that says what to do, and the group keeps its schedule."""
    import vega.optim
    sched = schedule.linear(1e-3, 0.0, 100)
    p = torch.zeros(3, requires_grad=True)
    opt = vega.optim.AdamW([p], lr=sched)
    torch_scheduler = scheduler(opt, **kw)
    with pytest.raises(TypeError, match=r"linear\(.*\) is a vega schedule.*torch LR "
                                        r"scheduler cannot scale it"):
        for loss in (1.0, 2.0, 3.0):
            p.grad = torch.ones(3)
            opt.step()
            torch_scheduler.step(*[loss][:scheduler is torch.optim.lr_scheduler.
                                          ReduceLROnPlateau])
    assert opt.param_groups[0]["lr"] is sched
    for op in (lambda s: s * 0.5, lambda s: 0.5 * s, lambda s: s - 1, lambda s: 1 - s,
               lambda s: s / 2, lambda s: s + 1, lambda s: -s, float):
        with pytest.raises(TypeError, match="is a vega schedule"):
            op(sched)


def test_a_growing_schedule_that_overflows_where_the_range_has_no_bound_is_taken():
    """lr's range [0, inf) has no upper bound: an exponential growth that reaches inf only
    at a count past the float range is taken (by the class and the functional step), as a
    step reaches it only there; one that goes below 0 is refused."""
    import vega
    grow = schedule.exponential_decay(1e-3, 2.0, 1)  # (inf from step 1024 on)
    p = [torch.nn.Parameter(torch.randn(3))]
    vega.optim.SGD(p, lr=grow)
    params = {"w": torch.randn(3)}
    vega.sgd_step(params, {"w": torch.ones(3)}, vega.sgd_init(params), lr=grow)
    with pytest.raises(ValueError, match=r"outside lr's range"):
        vega.optim.SGD(p, lr=schedule.linear(1e-3, -1e-3, 10))


def test_ramps_end_exactly_on_their_end_values():
    """A linear ramp reaches its end value exactly at its last step, and a warmup ends
    exactly on the peak: ``init + (end - init) * k / n`` at ``k = n`` misses it by a
    rounding (0.7 + (0.1 - 0.7) is 0.09999999999999998; a cosine decay's first value,
    ``end + (peak - end) * 1``, is 0.0010000000000000009 for a peak of 1e-3 above an end
    of 0.1). Both paths."""
    for s, k, want in ((schedule.linear(0.7, 0.1, 5), 5, 0.1),
                       (schedule.warmup_cosine(0.7, 0.1, 5), 5, 0.1),
                       (schedule.warmup_cosine(0.7, 0.1, 5), 6, 0.1),
                       (schedule.warmup_cosine_decay(0.7, 0.1, 5, 10), 5, 0.1),
                       (schedule.warmup_cosine_decay(0.0, 1e-3, 3, 5, end_value=0.1), 3, 1e-3),
                       (schedule.one_cycle(1e-3, 10, div_factor=1e-3 / 0.1,
                                           final_div_factor=1e-2, pct_start=0.5), 5, 1e-3)):
        assert s(k) == want, s
        assert s(torch.tensor(k)).item() == want, s


def test_one_cycle_warms_up_for_the_floor_of_pct_start_steps():
    """``w = floor(pct_start * total_steps)``: 0.3 of 9 steps is a warmup of 2 (not 3, as
    rounding 2.7 would make it), the peak at step 2 and the cosine from step 3."""
    s = schedule.one_cycle(1.0, 9, div_factor=10.0, final_div_factor=100.0, pct_start=0.3)
    check(s, [0.1, 0.55, 1.0] + [0.01 + 0.99 * 0.5 * (1 + c(pi * j / 7)) for j in range(1, 7)]
          + [0.01, 0.01])


def test_the_longest_length_and_the_last_boundary_are_taken():
    """A length or a boundary of 2**63 - 1, an int64 step's largest, is taken (2**63 is not:
    ``test_bad_arguments_raise``)."""
    s = schedule.linear(0.0, 1.0, 2**63 - 1)
    assert s(2**62) == 0.5 and s(torch.tensor(2**62)).item() == 0.5
    p = schedule.piecewise_constant([2**63 - 1], [1.0, 2.0])
    assert p(2**63 - 1) == 1.0 and p(torch.tensor(2**63 - 1)).item() == 1.0


def test_a_growing_exponential_past_the_float_range_is_inf_on_both_paths():
    """``decay_rate ** (k / decay_steps)`` past the largest float is inf, as torch gives it,
    not an OverflowError of Python's ``**`` (which ``reach``, read by the range checks of
    the hyperparameters, met too)."""
    s = schedule.exponential_decay(1.0, 2.0, 1)
    assert s(2000) == math.inf and s(torch.tensor(2000)).item() == math.inf
    assert s.reach(0, 2000)[-1] == (2000, math.inf)


def test_restarts_of_a_t_mul_near_1_stay_in_a_cycle_to_its_last_step():
    """With t_mul a hair above 1, the closed form's cycle of a cycle's last step can be the
    next one (its log rounded up): the step is put back into its cycle, at the cycle's low
    end, not at the next one's top."""
    t, d = 1.0000000007705232, 8619659
    s = schedule.cosine_decay_restarts(1.0, d, t_mul=t)
    for c in (21, 35):
        last = math.ceil(d * (t**c - 1) / (t - 1)) - 1
        assert s(last) < 1e-12 and s(last + 1) > 0.99, c
        assert s(torch.tensor(last)).item() < 1e-12, c
