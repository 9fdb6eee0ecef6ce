"""An if on float hyperparameters' values (``if momentum > 0``): decided at the step."""
import pytest
import torch

import vega
from vega import SpecError, schedule

SPEC = """optimizer heavy(lr = 0.1, momentum = 0.0 in [0, inf), nesterov = false) {
    d = g
    if momentum > 0 and not nesterov {
        state v = zeros
        v = momentum * v + d
        d = v
    }
    p = p - lr * d
}"""


def test_value_condition_picks_the_program_at_the_step():
    spec = vega.compile(SPEC)
    params = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    grads = {k: torch.full_like(p, 0.5) for k, p in params.items()}
    plain = spec.init(params, momentum=0.0)
    assert set(plain) == {"step"}
    out, _ = spec.step(params, grads, plain)
    assert torch.allclose(out["a"], torch.full((3,), 0.95))
    heavy = spec.init(params, momentum=0.5)
    assert set(heavy["v"]) == {"a", "b"}
    p1, heavy = spec.step(params, grads, heavy, momentum=0.5)
    p2, heavy = spec.step(p1, grads, heavy, momentum=0.5)
    assert torch.allclose(p2["a"], torch.full((3,), 1 - 0.05 - 0.075))
    assert torch.allclose(heavy["v"]["b"], torch.full((2, 2), 0.75))
    # a bool in the same condition still counts: nesterov takes the plain program
    assert "v" not in spec.init(params, momentum=0.5, nesterov=True)
    assert "momentum" in spec.source("reference", momentum=0.5) and \
        "v_v = " in spec.source("reference", momentum=0.5)  # the buffer's new value


def test_value_condition_needs_a_plain_number():
    spec = vega.compile(SPEC)
    params = {"a": torch.ones(3)}
    for value in (torch.tensor(0.5), schedule.constant(0.5)):
        with pytest.raises(ValueError, match=r"momentum=.* must be a plain number: an if of "
                                             "the spec reads it"):
            spec.init(params, momentum=value)


def test_a_repeat_count_needs_a_plain_number():
    """A repeat by a float hyperparameter chooses each tensor's program by its value, as an
    if on it does: a tensor or a schedule for it is refused, saying a repeat reads it."""
    spec = vega.compile("""
optimizer r(lr = 0.1, n = 2.0 in [0, 4]) {
    x = g
    repeat n {
        x = 0.5 * x
    }
    p = p - lr * x
}
""")
    params = {"a": torch.ones(3)}
    for value in (torch.tensor(2.0), schedule.constant(2.0)):
        with pytest.raises(ValueError, match=r"^r_init: n=.* must be a plain number: an if of "
                                             r"the spec reads it \(or a repeat, as its count\)"):
            spec.init(params, n=value)
    new, _ = spec.step(params, params, spec.init(params), n=3.0)
    assert torch.equal(new["a"], torch.full((3,), 1 - 0.1 * 0.125))


def test_momentum_turned_on_and_off_follows_torch():
    """As torch.optim.SGD: no buffer while momentum is 0; one started when it turns
    positive (from the gradient: v = 0 * 0.9 + d); kept, unread, when it returns to 0;
    read again when it turns positive again."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    ours, theirs = vega.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
    for step, momentum in enumerate((0.0, 0.9, 0.9, 0.0, 0.9)):
        for opt in (ours, theirs):
            opt.param_groups[0]["momentum"] = momentum
        g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (step + 1)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=0)
        if step == 0:
            assert set(ours.state[p]) == {"step"}
    torch.testing.assert_close(ours.state[p]["v"], theirs.state[q]["momentum_buffer"])


def test_other_state_mismatches_are_still_named():
    p = torch.nn.Parameter(torch.ones(3))
    opt = vega.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    opt.step()
    opt.state[p]["v"] = torch.zeros(2)  # as from another model's state_dict
    with pytest.raises(ValueError, match=r"parameter 0 of group 0: .*state 'v' has shape "
                                         r"\(2,\), but its parameter, of shape \(3,\), "
                                         r"needs \(3,\)"):
        opt.step()
    # (an entry whose name is none of the rule's, 'mu' in SGD's, is the caller's own: kept
    # and never read, as torch.optim keeps one; v, which a value turns on, made anew)
    opt.state[p]["mu"] = torch.zeros(3)
    del opt.state[p]["v"]
    opt.step()
    assert sorted(opt.state[p]) == ["mu", "step", "v"] and not opt.state[p]["mu"].any()


def test_conditions_that_read_tensors_are_still_refused():
    bad = SPEC.replace("momentum > 0 and not nesterov", "momentum > mean(g)")
    with pytest.raises(SpecError, match=r"<spec>:3:19: error: a condition on the shape or on "
                                        r"float hyperparameters may use only .*not mean\(\)"):
        vega.compile(bad)


@pytest.mark.parametrize("name,always,buffer", [("sgd", set(), "v"), ("rmsprop", {"nu"}, "buf")])
def test_shipped_momentum_buffers_exist_only_with_momentum(name, always, buffer):
    """As torch keeps a momentum_buffer only for momentum > 0: without one a step moves
    12 bytes an element fewer. ``init`` without a momentum makes the buffer (the seeds'
    sgd state is a velocity), and with momentum=0 keeps none."""
    params = {"w": torch.randn(4, 3)}
    spec = vega.builtin(name)
    assert set(spec.init(params, momentum=0.0)) == always | {"step"}
    assert set(spec.init(params)) == always | {buffer, "step"}
    assert set(spec.init(params, momentum=0.9)) == always | {buffer, "step"}
    # (the buffer's new value, v_<name> in the program, v_v_<name> in C)
    assert f"v_v_{buffer}" not in spec.source("c") and f"v_v_{buffer}" in spec.source(
        "c", momentum=0.9)


def _moved(source, params, **hypers):
    """Each tensor's first value after one step from zeros with a gradient of ones."""
    spec = vega.compile(source)
    grads = {k: torch.ones_like(p) for k, p in params.items()}
    out, _ = spec.step(params, grads, spec.init(params, **hypers), **hypers)
    return {k: v.flatten()[0].item() for k, v in out.items()}


SHAPES = {"v": torch.zeros(5), "m": torch.zeros(2, 4), "s": torch.zeros(()),
          "t": torch.zeros(3, 1), "w": torch.zeros(2, 6)}


def test_shape_conditions_with_or_minus_and_not():
    """'or', unary minus and 'not' in a condition on the shape decide each tensor's branch
    as Python would on its ndim, nrows and ncols (the matrix view: a vector is one row, a
    (3, 1) tensor's columns are its longer axis); the right side of each 'or' and 'and'
    decides some tensor's branch (v's, w's)."""
    either = """optimizer o() {
    if ndim(p) >= 2 or ncols(p) > 3 {
        p = p - g
    } else {
        p = p + g
    }
}"""
    assert _moved(either, SHAPES) == {"v": -1.0, "m": -1.0, "s": 1.0, "t": -1.0, "w": -1.0}
    negated = """optimizer o() {
    if -ndim(p) < -1 and not (ncols(p) > 4) {
        p = p - g
    } else {
        p = p + g
    }
}"""
    assert _moved(negated, SHAPES) == {"v": 1.0, "m": -1.0, "s": 1.0, "t": -1.0, "w": 1.0}
    # and the literal false, in an expression
    literal = "optimizer o() {\n    x = false\n    p = where(x or not x, p - g, p + g)\n}"
    assert _moved(literal, SHAPES) == dict.fromkeys(SHAPES, -1.0)


def test_value_conditions_with_not_and_minus():
    source = """optimizer o(lr = 1.0, k = 2.0) {
    if not (lr > 0.5) or -k < -1 {
        state m = zeros
        m = m + 1
        p = p - m * g
    } else {
        p = p + g
    }
}"""
    params = {"a": torch.zeros(3)}
    assert _moved(source, params) == {"a": -1.0}
    assert _moved(source, params, lr=1.0, k=0.5) == {"a": 1.0}
    assert _moved(source, params, lr=0.1, k=0.5) == {"a": -1.0}
    spec = vega.compile(source)
    # init without the values keeps the state the condition may need; with values that
    # decide it false, none
    assert set(spec.init(params)) == {"m", "step"}
    assert set(spec.init(params, lr=1.0, k=0.5)) == {"step"}
    assert set(spec.init(params, lr=0.1)) == {"m", "step"}
