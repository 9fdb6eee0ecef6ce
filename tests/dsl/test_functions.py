"""The language's elementwise functions on every backend against torch's, edge cases included:
signed zeros, infinities, NaN, halves (round is half to even), and values where a naive
formula loses digits (log1p and expm1 near 0, tanh past 20)."""
import math

import pytest
import torch

import vega

BACKENDS = ["reference", "c", "triton"]
UNARY = {"tanh": torch.tanh, "sin": torch.sin, "cos": torch.cos, "erf": torch.erf,
         "log1p": torch.log1p, "expm1": torch.expm1, "sigmoid": torch.sigmoid,
         "floor": torch.floor, "round": torch.round}
EDGES = [0.0, -0.0, math.inf, -math.inf, math.nan, 0.5, -0.5, 1.5, 2.5, -2.5, 3.5, 1e-8, -1e-8,
         1e-30, -3e-20, 0.49999997, -0.49999997, 30.0, -30.0, 19.5, 88.0, -100.0, 8388609.0,
         4503599627370497.0, 0.9, -0.999, -1.0, -1.5, 1234.5678, 7e-4]
# (rtol, atol) against torch's function, by dtype: a few units in the last place
TOL = {torch.float64: (1e-14, 1e-300), torch.float32: (4e-6, 1e-37)}


def values(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = torch.randn(2000, generator=gen, dtype=torch.float64) * torch.logspace(
        -6, 2, 2000, dtype=torch.float64)
    return torch.cat([torch.tensor(EDGES, dtype=torch.float64), rand]).to(dtype)


def run(spec_text, backend, p, g, **hypers):
    spec = vega.compile(spec_text)
    state = spec.init({"x": p}, **hypers)
    out, _ = spec.step({"x": p}, {"x": g}, state, backend=backend, **hypers)
    return out["x"]


def same(got, want, dtype, what):
    """Close to torch's values, NaN where it has NaN, and zeros signed as torch signs them."""
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")
    zero = want == 0
    assert torch.equal(torch.signbit(got[zero]), torch.signbit(want[zero])), \
        f"{what}: signs of zeros differ at {torch.nonzero(zero).flatten().tolist()}"


# one spec computes every function, each into a state of its own name (one compile a backend)
EVERY = "optimizer f() {\n" + "".join(
    f"    state {name}_of_g = zeros\n    {name}_of_g = {name}(g)\n" for name in UNARY) + \
    "    p = p\n}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unary_functions_match_torch(backend, dtype):
    g = values(dtype)
    spec = vega.compile(EVERY)
    _, state = spec.step({"x": torch.zeros_like(g)}, {"x": g}, spec.init({"x": g}),
                         backend=backend)
    for name, fn in UNARY.items():
        same(state[f"{name}_of_g"]["x"], fn(g), dtype, f"{name} on {backend}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_atan2_matches_torch_in_every_quadrant(backend, dtype):
    edge = torch.tensor(EDGES[:12], dtype=torch.float64)
    y, x = torch.meshgrid(edge, edge, indexing="ij")
    gen = torch.Generator().manual_seed(1)
    y = torch.cat([y.flatten(), torch.randn(3000, generator=gen, dtype=torch.float64)]).to(dtype)
    x = torch.cat([x.flatten(), torch.randn(3000, generator=gen, dtype=torch.float64)]).to(dtype)
    got = run("optimizer f() { p = atan2(g, p) }", backend, x.clone(), y)
    same(got, torch.atan2(y, x), dtype, f"atan2 on {backend}")


POW_BASES = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1e-30,
             -1e-30, 3.7, -3.7, 1.0000001]
POW_EXPONENTS = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 7.0, 9.0, 0.5, 1.5, -1.5, 2.5, -2.5,
                 63.0, 64.0, 100.0, 2001.0, -2001.0, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_power_of_two_values_matches_torch(backend, dtype):
    """``p ^ g`` elementwise: torch's special cases (1 ^ nan, (-1) ^ inf, (-inf) ^ 2.5, the
    sign of (-0.0) ^ -1), and a few units in the last place for whole and other exponents
    (Triton's power was 42 units off for x ^ 7 in float32, and NaN for (-inf) ^ 2.5)."""
    a, b = torch.meshgrid(torch.tensor(POW_BASES, dtype=torch.float64),
                          torch.tensor(POW_EXPONENTS, dtype=torch.float64), indexing="ij")
    gen = torch.Generator().manual_seed(2)
    base = torch.rand(2000, generator=gen, dtype=torch.float64) * 10 + 0.1
    base = torch.where(torch.arange(2000) % 3 == 0, -base, base)
    expo = torch.randint(-8, 9, (2000,), generator=gen).double()
    expo = torch.where(torch.arange(2000) % 2 == 0, expo,
                       torch.rand(2000, generator=gen, dtype=torch.float64) * 16 - 8)
    a = torch.cat([a.flatten(), base]).to(dtype)
    b = torch.cat([b.flatten(), expo]).to(dtype)
    got = run("optimizer f() { p = p ^ g }", backend, a.clone(), b)
    want = torch.pow(a, b)
    if backend == "triton" and dtype == torch.float64:  # (exp2(b log2|a|) where b is not
        whole = b == torch.floor(b)                       # whole: within about 100 units)
        torch.testing.assert_close(got[~whole], want[~whole], rtol=2.5e-14, atol=1e-300,
                                   equal_nan=True)
        got, want = got[whole], want[whole]
    same(got, want, dtype, f"p ^ g on {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_functions_of_hyperparameters_and_numbers(backend):
    """The scalar phase (float64 on every backend) and constant folding give torch's values
    in float64 too."""
    x = torch.tensor([1.0, -2.0, 0.25], dtype=torch.float64)
    lr = 0.3
    text = ("optimizer f(lr = 0.1) { p = p * tanh(lr) + atan2(lr, -1) + round(lr * 5) "
            "+ log1p(lr) * expm1(lr) + sigmoid(lr) * erf(lr) + sin(lr) * cos(lr) + floor(-lr) "
            "+ tanh(0.5) * atan2(-0.0, -1) }")
    want = (x * math.tanh(lr) + math.atan2(lr, -1) + 2.0 + math.log1p(lr) * math.expm1(lr)
            + 1 / (1 + math.exp(-lr)) * math.erf(lr) + math.sin(lr) * math.cos(lr) - 1
            + math.tanh(0.5) * -math.pi)
    got = run(text, backend, x.clone(), torch.zeros_like(x), lr=lr)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("wrong,message", [
    ("tanhh(g)", "unknown function 'tanhh' (did you mean 'tanh' or 'atan2'?)"),
    ("arctan2(g, p)", "unknown function 'arctan2' (did you mean 'atan2'?)"),
    ("ln(g)", "unknown function 'ln'; the functions are abs, atan2, bfloat16, clamp,"),
    ("atan2(g)", "atan2() takes 2 arguments, got 1"),
    ("round(g, 2)", "round() takes 1 argument, got 2"),
])
def test_unknown_functions_and_wrong_counts_are_named(wrong, message):
    with pytest.raises(vega.SpecError) as err:
        vega.compile(f"optimizer f() {{\n    p = p - {wrong}\n}}")
    assert message in str(err.value)
    assert ":2:13:" in str(err.value) or ":2:" in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_tensor_reductions_accumulate_in_float64(backend):
    """norm, sum and mean of a float32 tensor, accumulated in float64 and rounded once, as
    the reductions over a group: the reference's float32 norm of values of 1e30 overflowed
    to inf where C and Triton gave 3.2e30, and its sum of 20,000 values lost digits."""
    big = torch.full((10,), 1e30)
    got = run("optimizer f() { p = p * 0 + norm(g) }", backend, torch.zeros(10), big)
    assert torch.equal(got, torch.full((10,), math.sqrt(10) * 1e30, dtype=torch.float32))
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(10000, generator=gen) * 1e4 + 1e-3
    g = torch.cat([g, -g[:-1]])
    for name, exact in (("sum", g.double().sum()), ("mean", g.double().mean())):
        got = run(f"optimizer f() {{ p = p * 0 + {name}(g) }}", backend, torch.zeros_like(g), g)
        assert torch.equal(got, exact.float().expand_as(g)), (name, got[0], exact)


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_per_tensor_max_is_nan_where_a_value_is(backend):
    """max(x) of a tensor holding a NaN is NaN wherever the NaN stands (first, last, in a
    later piece of a long tensor), as torch.amax; of negative values, the largest."""
    gen = torch.Generator().manual_seed(3)
    for n, at in ((5, 0), (5, 4), (70000, 69999), (70000, 3)):
        g = -torch.rand(n, generator=gen) - 1
        want = g.max().expand(n).clone()
        got = run("optimizer f() { p = p * 0 + max(g) }", backend, torch.zeros(n), g)
        assert torch.equal(got, want), (n, got[0], want[0])
        g[at] = math.nan
        got = run("optimizer f() { p = p * 0 + max(g) }", backend, torch.zeros(n), g)
        assert got.isnan().all(), (n, at, got[0])


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_round_of_a_hyperparameter_is_half_to_even(backend):
    """round() in the scalar phase (of hyperparameters alone) rounds halves to even, as in
    the element loop and torch.round."""
    x = torch.zeros(1, dtype=torch.float64)
    for h, want in ((0.5, 0.0), (1.5, 2.0), (2.5, 2.0), (-0.5, -0.0), (-2.5, -2.0),
                    (3.5, 4.0), (2.4, 2.0)):
        got = run("optimizer f(h = 0.0) { p = p * 0 + round(h) }", backend, x.clone(),
                  torch.zeros_like(x), h=h)
        assert got.item() == want, (h, got.item())
