"""The call sequences of the OCaml library's pages work as written: sgd's state is an
all-zero velocity, and ``LossScale.adjust`` takes the growth and backoff settings."""
import pytest
import torch

import vega

BACKENDS = ["reference", "c"]


def _tree(dtype=torch.float64):
    params = {"w": torch.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4),
              "b": torch.ones(4, dtype=dtype)}
    grads = [{k: torch.randn(v.shape, dtype=dtype, generator=torch.Generator().manual_seed(i))
              for k, v in params.items()} for i in range(4)]
    return params, grads


def test_sgd_init_is_an_all_zero_velocity():
    params, _ = _tree()
    state = vega.sgd_init(params)
    assert vega.state_names(state) == ["v.w", "v.b", "step"]
    for k, p in params.items():
        v = state["v"][k]
        assert v.shape == p.shape and v.dtype == p.dtype and not v.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_step_with_momentum_on_the_init_state(backend):
    """v = m v + g; p = p - lr v, the seeds' sequence, over several steps."""
    params, grads = _tree()
    state = vega.sgd_init(params)
    p, v = {k: x.clone() for k, x in params.items()}, {k: torch.zeros_like(x)
                                                      for k, x in params.items()}
    out = params
    for g in grads:
        out, state = vega.sgd_step(out, g, state, lr=0.1, momentum=0.9, backend=backend)
        for k in p:
            v[k] = 0.9 * v[k] + g[k]
            p[k] = p[k] - 0.1 * v[k]
            torch.testing.assert_close(out[k], p[k], rtol=1e-14, atol=1e-15)
            torch.testing.assert_close(state["v"][k], v[k], rtol=1e-14, atol=1e-15)
    assert int(state["step"]) == len(grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_momentum_zero_keeps_the_last_gradient_as_velocity(backend):
    params, grads = _tree()
    state = vega.sgd_init(params)
    out, state = vega.sgd_step(params, grads[0], state, lr=0.1, momentum=0.9, backend=backend)
    before = {k: x.clone() for k, x in out.items()}
    out, state = vega.sgd_step(out, grads[1], state, lr=0.1, backend=backend)  # momentum 0
    for k in params:
        assert torch.equal(state["v"][k], grads[1][k])
        torch.testing.assert_close(out[k], before[k] - 0.1 * grads[1][k], rtol=1e-14,
                                   atol=1e-15)


def test_sgd_momentum_zero_at_init_keeps_no_velocity():
    """Said at init, momentum=0 saves the memory, as torch keeps no momentum_buffer; that
    state cannot then step with momentum."""
    params, grads = _tree()
    state = vega.sgd_init(params, momentum=0.0)
    assert set(state) == {"step"}
    out, state = vega.sgd_step(params, grads[0], state, lr=0.1)
    torch.testing.assert_close(out["w"], params["w"] - 0.1 * grads[0]["w"])
    with pytest.raises(ValueError, match=r"sgd_step: state has fields \['step'\], but this "
                                         r"step .* needs \['step', 'v'\]"):
        vega.sgd_step(params, grads[0], state, lr=0.1, momentum=0.9)


def test_a_value_if_decided_by_a_flag_is_not_held_open():
    """An if that a bool setting turns off stays off: the state made for it is refused,
    not stepped by the branch the flag turned off."""
    spec = vega.compile("""optimizer heavy(lr = 0.1, momentum = 0.0 in [0, inf),
                                          nesterov = false) {
        d = g
        if momentum > 0 and not nesterov {
            state v = zeros
            v = momentum * v + d
            d = v
        }
        p = p - lr * d
    }""")
    params, grads = _tree()
    assert "v" in spec.init(params)
    assert "v" not in spec.init(params, nesterov=True)
    with pytest.raises(ValueError, match="needs"):
        spec.step(params, grads[0], spec.init(params), nesterov=True, momentum=0.5)


def test_the_class_keeps_torchs_momentum_buffer_rule():
    """The classes follow torch.optim.SGD: no buffer while momentum is 0."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = vega.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    assert set(opt.state[p]) == {"step"}


# -- LossScale.adjust with the seeds' keywords ----------------------------------------

def test_adjust_takes_growth_and_backoff_for_one_call():
    ls = vega.LossScale.dynamic(init=8.0)
    grown = ls.adjust(torch.tensor(True), growth_interval=1, growth_factor=3.0)
    assert grown.loss_scale.item() == 24.0 and grown.good_steps.item() == 0
    # the scale keeps its own settings: the next call grows only after 2000 steps
    assert (grown.growth_interval, grown.growth_factor, grown.backoff_factor) == (2000, 2.0, 0.5)
    assert grown.adjust(torch.tensor(True)).loss_scale.item() == 24.0
    backed = ls.adjust(torch.tensor(False), backoff_factor=0.25)
    assert backed.loss_scale.item() == 2.0 and backed.skipped_steps.item() == 1
    # with the defaults as given, the same as without them
    plain, same = ls.adjust(True), ls.adjust(True, growth_interval=2000, growth_factor=2.0,
                                             backoff_factor=0.5)
    assert all(torch.equal(a, b) for a, b in zip(plain.tensors(), same.tensors()))


def test_adjust_counts_to_a_given_interval():
    ls = vega.LossScale.dynamic(init=1.0)
    for _ in range(2):
        ls = ls.adjust(torch.tensor(True), growth_interval=3)
    assert ls.loss_scale.item() == 1.0 and ls.good_steps.item() == 2
    ls = ls.adjust(torch.tensor(True), growth_interval=3)
    assert ls.loss_scale.item() == 2.0 and ls.good_steps.item() == 0
    # a counter past a shorter interval grows at once
    ls = vega.LossScale.dynamic(init=1.0)
    for _ in range(5):
        ls = ls.adjust(True)
    assert ls.adjust(True, growth_interval=2).loss_scale.item() == 2.0


@pytest.mark.parametrize("kw", [dict(growth_interval=0), dict(growth_interval=-3),
                                dict(growth_interval=1.5), dict(growth_factor=0.0),
                                dict(growth_factor=-2.0), dict(backoff_factor=0),
                                dict(backoff_factor=float("nan"))])
def test_adjust_refuses_a_setting_that_is_not_positive(kw):
    (name, value), = kw.items()
    for ls in (vega.LossScale.dynamic(), vega.LossScale.static(4.0)):
        with pytest.raises(ValueError, match=f"LossScale.adjust: {name}="):
            ls.adjust(torch.tensor(True), **kw)


def test_adjust_of_a_static_scale_is_the_identity_with_settings_too():
    ls = vega.LossScale.static(4.0)
    assert ls.adjust(torch.tensor(False), backoff_factor=0.1) is ls
