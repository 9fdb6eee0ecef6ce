"""The language's expressions on every backend against the reference, at the values where
backends part: NaN, infinities, signed zeros, subnormals and numbers past float32's range,
in each parameter dtype; each test the smallest spec that once gave another value (or no
kernel) on a compiled backend."""
import math

import pytest
import torch

import vega

BACKENDS = ["reference", "c", "triton"]
EDGES = [math.inf, -math.inf, math.nan, 0.0, -0.0, 1.0, -1.0, 0.1, 1e38, -1e38,
         3.4028234663852886e38, 1e-40, -1e-40, 1e-45, 2.5, -7.0]


def edges(dtype):
    return torch.tensor(EDGES, dtype=torch.float64).to(dtype)


def step(text, backend, p, g, **hypers):
    spec = vega.compile(text)
    state = spec.init({"x": p}, **hypers)
    return spec.step({"x": p}, {"x": g}, state, backend=backend, **hypers)


def assert_same(got, want, what):
    """Equal values, NaN where the reference has NaN, zeros of the same sign."""
    got, want = got.double(), want.double()
    same = (got == want) & (torch.signbit(got) == torch.signbit(want)) \
        | got.isnan() & want.isnan()
    assert same.all(), f"{what}: {got.tolist()} against the reference's {want.tolist()}"


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_a_state_of_one_number_assigned_a_reduction_of_computed_values(backend):
    """``s = max(g * 2)``: the C kernels' store of the states of one number per tensor,
    after the loops, computed the reduction's argument again there (reading ``g``, which
    it has not), and the kernel did not compile."""
    text = ("optimizer f() {\n    state s: scalar = zeros\n    state n: scalar = zeros\n"
            "    s = max(g * 2)\n    n = norm(g - p) + 1\n    p = g\n}")
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(2, 40, generator=gen)
    want_p, want = step(text, "reference", p, g)
    got_p, got = step(text, backend, p, g)
    assert_same(got_p["x"], want_p["x"], "p")
    for name in ("s", "n"):
        assert_same(got[name]["x"], want[name]["x"], name)
