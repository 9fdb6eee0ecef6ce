"""Rows, columns and shape conditions: what they mean, on the reference backend, against
torch code written out by hand."""
import pytest
import torch

import vega

AXES_SPEC = """
optimizer axes(lr = 0.1) {
    state vr: rows = zeros
    state vc: cols = ones
    vr = vr + row_sum(g) + row_max(g) - row_mean(p)
    vc = vc * col_mean(g * g) + col_max(p) - col_sum(p)
    m = col_mean(vr)
    p = p - lr * (vr - m) * vc + mean(vr)
}
"""


def _hand(p, g, vr, vc, lr, r, c):
    """The same rule with explicit dims: ``r`` the row axis, ``c`` the column axis."""
    vr = vr + g.sum(c) + g.amax(c) - p.mean(c)
    vc = vc * (g * g).mean(r) + p.amax(r) - p.sum(r)
    r_in_vr = r if r < c else r - 1
    m = vr.mean(r_in_vr, keepdim=True)
    full = (vr - m).unsqueeze(c) * vc.unsqueeze(r)
    return p - lr * full + vr.mean(), vr, vc


@pytest.mark.parametrize("shape,r,c", [((5, 7), 0, 1), ((7, 5), 1, 0), ((4, 4), 0, 1),
                                       ((3, 6, 5), 2, 1), ((6, 2, 8), 0, 2)], ids=str)
def test_axis_reductions_and_row_column_state(shape, r, c):
    spec = vega.compile(AXES_SPEC)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=gen, dtype=torch.float64)
    state = spec.init({"w": p})
    want_r = tuple(n for a, n in enumerate(shape) if a != c)
    want_c = tuple(n for a, n in enumerate(shape) if a != r)
    assert state["vr"]["w"].shape == want_r and state["vc"]["w"].shape == want_c
    assert (state["vc"]["w"] == 1).all()
    hp, hvr, hvc = p.clone(), state["vr"]["w"].clone(), state["vc"]["w"].clone()
    params = {"w": p}
    for _k in range(3):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        params, state = spec.step(params, {"w": g}, state, backend="reference")
        hp, hvr, hvc = _hand(hp, g, hvr, hvc, 0.1, r, c)
        torch.testing.assert_close(params["w"], hp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["vr"]["w"], hvr, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state["vc"]["w"], hvc, rtol=1e-12, atol=1e-12)


def test_a_vector_is_one_row_and_a_scalar_one_by_one():
    spec = vega.compile("""
        optimizer o() {
            state vr: rows = zeros
            state vc: cols = zeros
            vr = row_sum(g)
            vc = col_sum(g)
            p = p - vr - vc
        }""")
    params = {"v": torch.tensor([1.0, 2.0, 3.0]), "s": torch.tensor(5.0)}
    state = spec.init(params)
    assert state["vr"]["v"].shape == () and state["vc"]["v"].shape == (3,)
    assert state["vr"]["s"].shape == () and state["vc"]["s"].shape == ()
    grads = {"v": torch.tensor([1.0, 2.0, 4.0]), "s": torch.tensor(2.0)}
    params, state = spec.step(params, grads, state, backend="reference")
    torch.testing.assert_close(params["v"], torch.tensor([1 - 7 - 1.0, 2 - 7 - 2.0, 3 - 7 - 4.0]))
    torch.testing.assert_close(params["s"], torch.tensor(5.0 - 2 - 2))


SHAPED = """
optimizer shaped(lr = 1.0, k = 3.0) {
    if ndim(p) >= 2 and nrows(p) >= k {
        state m: rows = zeros
        m = m + 1
        p = p - lr * t - m
    } else {
        p = p - lr * t
    }
}
"""


@pytest.mark.parametrize("donate", [False, True])
def test_shape_conditions_pick_a_program_per_tensor(donate):
    """Two programs in one step read the same t, and the counter advances once."""
    spec = vega.compile(SHAPED)
    params = {"big": torch.zeros(4, 5), "small": torch.zeros(2, 5), "vec": torch.zeros(3)}
    state = spec.init(params)
    assert state["m"]["big"].shape == (4,)
    assert state["m"]["small"] is None and state["m"]["vec"] is None
    for k in range(3):
        params, state = spec.step(params, {n: torch.zeros_like(v) for n, v in params.items()},
                                  state, donate=donate, backend="reference")
        assert int(state["step"]) == k + 1
    # sum of t over 3 steps = 6; the big one also subtracts m = 1, 2, 3
    torch.testing.assert_close(params["small"], torch.full((2, 5), -6.0))
    torch.testing.assert_close(params["vec"], torch.full((3,), -6.0))
    torch.testing.assert_close(params["big"], torch.full((4, 5), -12.0))
    # the threshold is a hyperparameter: with k = 2 the small matrix takes the other branch
    state = spec.init(params, k=2.0)
    assert state["m"]["small"].shape == (2,)


def test_shape_conditions_show_and_choose_programs():
    spec = vega.compile(SHAPED)
    assert spec.program(shape=(4, 5)).state_names == ("m",)
    assert spec.program(shape=(2, 5)).state_names == ()
    assert spec.program().state_names == ()  # no shape: every condition false
    assert "def init_s_m" not in spec.source() and "def init_s_m" in spec.source(shape=(4, 5))
    assert "hyperparameter values, in source order: true" in spec.source(shape=(4, 5))
    assert "_reduce(" in vega.adafactor.source(shape=(256, 128))


def test_a_state_like_p_may_hold_a_per_row_value_and_then_a_per_element_one():
    """A state's assignments are checked against its declared shape, not against the value
    it holds by then (a state like p set to a row mean may be set to g again)."""
    spec = vega.compile("""optimizer o(lr = 0.1) {
        state v = zeros
        v = row_mean(g)
        w = v * 2
        v = g + w
        p = p - lr * v
    }""")
    p = {"w": torch.arange(12.0, dtype=torch.float64).reshape(3, 4)}
    g = {"w": torch.arange(12.0, dtype=torch.float64).reshape(3, 4)}
    for backend in ("reference", "c"):
        new_p, new_s = spec.step(p, g, spec.init(p), backend=backend)
        want = g["w"] + 2 * g["w"].mean(1, keepdim=True)
        torch.testing.assert_close(new_s["v"]["w"], want)
        torch.testing.assert_close(new_p["w"], p["w"] - 0.1 * want)
