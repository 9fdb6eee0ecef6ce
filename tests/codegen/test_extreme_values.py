"""Every shipped rule at extreme values (infinities, NaN, signed zeros, subnormals, values
near float32's largest) in parameters, gradients and state: the C kernels leave a NaN, an
infinity of each sign and a zero of each sign where the reference leaves one (a backend
that turns a NaN into a number, or a number into a NaN, is a fault), and their finite
values agree with the reference's within a rounding."""
import itertools

import pytest
import torch

import vega
from vega.codegen.c import build as cbuild

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler here")
P_VALUES = [0.0, -0.0, 1e-45, 1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf"),
            float("nan"), 1.0, -1.0]
G_VALUES = [0.0, -0.0, 1e-45, -1e-40, 1e38, -1e20, float("inf"), float("nan"), 1.0, -0.5]
_PAIRS = list(itertools.product(P_VALUES, G_VALUES))
P = torch.tensor([p for p, _ in _PAIRS])
G = torch.tensor([g for _, g in _PAIRS])


def _same_specials(got, want, what):
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                        ("-inf", torch.isneginf),
                        ("-0.0", lambda x: (x == 0) & x.signbit()),
                        ("+0.0", lambda x: (x == 0) & ~x.signbit())):
        apart = (test(got) != test(want)).nonzero().flatten().tolist()
        assert not apart, (f"{what}: {label} at {apart[:5]} on one backend only "
                           f"(C {got[apart[:5]].tolist()}, reference {want[apart[:5]].tolist()})")
    finite = torch.isfinite(want) & torch.isfinite(got)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-30, msg=what)


def _two_steps(name, backend, p, g, edit=None, **kw):
    step, init = getattr(vega, name + "_step"), getattr(vega, name + "_init")
    params, state = step({"w": p.clone()}, {"w": g.clone()}, init({"w": p}),
                         backend=backend, **kw)
    if edit is not None:
        state = edit(state)
    params2, state2 = step(params, {"w": g.flip(0).clone()}, state, backend=backend, **kw)
    return params["w"], params2["w"], state2


def _special_state(state):
    """Each float state shaped like the parameter, its first values the special ones."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            v = {kk: t.clone() for kk, t in v.items()}
            for t in v.values():
                if t.is_floating_point() and t.numel() == P.numel():
                    t[:len(P_VALUES)] = torch.tensor(P_VALUES)
        out[k] = v
    return out


@pytest.mark.parametrize("name", vega.builtin_names())
def test_c_keeps_the_references_nan_inf_and_signed_zeros(name):
    finite_g = torch.where(G.isfinite(), G, torch.tensor(3.0))
    smooth_p, smooth_g = torch.linspace(-2, 2, P.numel()), torch.linspace(-1, 1.3, P.numel())
    for what, p, g, edit, kw in (
            ("special values", P, G, None, {}),
            ("finite extremes, clipped", P, finite_g, None, {"max_grad_norm": 1.0}),
            ("special state", smooth_p, smooth_g, _special_state, {})):
        want = _two_steps(name, "reference", p, g, edit, **kw)
        got = _two_steps(name, "c", p, g, edit, **kw)
        for k in range(2):
            _same_specials(got[k], want[k], f"{name}, {what}, step {k + 1}")
        for key, leaves in want[2].items():  # every float state after the second step
            if not isinstance(leaves, dict):
                continue
            for leaf, w in leaves.items():
                if w.is_floating_point():
                    _same_specials(got[2][key][leaf].flatten(), w.flatten(),
                                   f"{name}, {what}, state {key}")
