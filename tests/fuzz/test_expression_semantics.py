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
    at = torch.nonzero(~same).flatten()[:8]
    assert same.all(), f"{what} at {at.tolist()}: {got[at].tolist()}, not {want[at].tolist()}"


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16],
                         ids=str)
@pytest.mark.parametrize("backend", ["c", "triton"])
def test_numbers_compared_in_the_compute_type(backend, dtype):
    """A number is rounded to the step's compute type before it meets a value: Triton makes
    a bare literal in a comparison a tensor of its own type, so ``p == 0.1`` compared
    float64 values with 0.1 rounded to float32, and ``p <= 1e39``, ``p == 1e-46`` compared
    float32 values in float64 (inf <= 1e39 false, 0 == 1e-46 false, where float32 has
    inf <= inf and 0 == 0)."""
    text = ("optimizer f(h = 0.1) {\n"
            "    state a = zeros\n    state b = zeros\n    state c = zeros\n"
            "    a = where(p == 0.1, 1, 0) + where(p <= 1e39, 2, 0) + where(1e-46 == p, 4, 0)\n"
            "    b = where(p == 3.4028235e38, 1, 0) + where(p < 1e-40, 2, 0)"
            " + where(p != -1e-46, 4, 0) + where(p >= -1e300, 8, 0)\n"
            "    c = max(p, 1e-46) + min(p, -1e39) * where(p > 1e-40, 1e-40, p)\n"
            "    p = where(h == 0.1, p, -p) + where(t * h > 0.1, 1, 0)\n}")
    p = edges(dtype)
    want_p, want = step(text, "reference", p, p)
    got_p, got = step(text, backend, p, p)
    assert_same(got_p["x"], want_p["x"], "p")
    for name in "abc":
        assert_same(got[name]["x"], want[name]["x"], name)


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_bools_of_elements_steps_and_tensors_combine(backend):
    """A per-element bool with one of the step (``b > t``) or of the tensor (``norm(g) >
    1``) in ``or`` and in a bool ``where``: Triton's interpreter made floats of a where of a
    block's bools and such a one, and its ``&`` then failed."""
    text = ("optimizer f(b = -0.5) {\n    state a = zeros\n    state c = zeros\n"
            "    a = where(p > 1 and (p == p or b > t), g, p)\n"
            "    c = where(where(g > 0, b > t, p < -1) and g < 1, g, p)"
            " + where(where(g > 0, p < 0, norm(g) < 1) and p < 2, 1, 0)\n"
            "    p = where(where(g > 0, norm(g) > 1, p < 0) and p < 2, g, p)\n}")
    p, g = edges(torch.float32), edges(torch.float32).flip(0)
    want_p, want = step(text, "reference", p, g)
    got_p, got = step(text, backend, p, g)
    assert_same(got_p["x"], want_p["x"], "p")
    for name in "ac":
        assert_same(got[name]["x"], want[name]["x"], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("backend", ["c", "triton"])
def test_a_value_of_the_step_or_tensor_keeps_its_signed_zero(backend, dtype):
    """``p = -b`` at ``b = 0`` is -0.0 in every element: the Triton kernels made a block of
    one number per step or tensor by adding it to a block of 0.0, which made -0.0 +0.0."""
    text = ("optimizer f(b = 0.0) {\n    state s = zeros\n    state n = zeros\n"
            "    s = -sign(floor(b))\n    n = -norm(g * b)\n    p = -b\n}")
    p = torch.ones(5, dtype=dtype)
    want_p, want = step(text, "reference", p, p)
    got_p, got = step(text, backend, p, p)
    assert torch.signbit(want_p["x"]).all()
    assert_same(got_p["x"], want_p["x"], "p")
    for name in "sn":
        assert_same(got[name]["x"], want[name]["x"], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_written_half_exponent_is_a_square_root(backend):
    """``a ^ 0.5`` and ``a ^ -0.5`` written out are torch's ``pow`` by a number: a square
    root (NaN at -inf, -0.0 at -0.0), where the exponent in a hyperparameter is pow's
    (docs/language.md)."""
    x = torch.tensor([-math.inf, -0.0, 0.0, math.inf, -4.0, 4.0], dtype=torch.float64)
    text = ("optimizer f(h = 0.5) {\n    state a = zeros\n    state b = zeros\n"
            "    state c = zeros\n    a = p ^ 0.5\n    b = p ^ -0.5\n    c = p ^ h\n"
            "    p = p ^ -h\n}")
    got_p, got = step(text, backend, x, x)
    for name, value in (("a", torch.pow(x, 0.5)), ("b", torch.pow(x, -0.5)),
                        ("c", torch.pow(x, torch.full_like(x, 0.5)))):
        assert_same(got[name]["x"], value, name)
    assert_same(got_p["x"], torch.pow(x, torch.full_like(x, -0.5)), "p")
    assert_same(got["a"]["x"][:2], torch.tensor([math.nan, -0.0]), "a at -inf, -0.0")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_power_of_numbers_folds_to_what_the_step_computes(backend):
    """The compiler folds ``(-0.0) ^ -0.5`` as the step computes ``p ^ -0.5`` at ``p =
    -0.0``: -inf, a reciprocal square root (numpy's power, which folded it, gave inf; and
    0.0 for ``(-inf) ^ -0.5``, where the step gives NaN)."""
    x = torch.tensor([-0.0, -math.inf, 4.0, -0.0], dtype=torch.float64)
    text = ("optimizer f() {\n    state a = zeros\n    state b = zeros\n"
            "    a = p ^ -0.5\n"
            "    b = where(g == 0, (-0.0) ^ -0.5, where(g < 0, (-inf) ^ -0.5, 4 ^ -0.5))\n"
            "    p = where(g == 0, (-0.0) ^ 0.5, where(g < 0, (-inf) ^ 0.5, 4 ^ 0.5))\n}")
    got_p, got = step(text, backend, x, x)
    assert_same(got["a"]["x"], torch.tensor([-math.inf, math.nan, 0.5, -math.inf]), "a")
    assert_same(got["b"]["x"], got["a"]["x"], "b, folded")
    assert_same(got_p["x"], torch.pow(x, 0.5), "p, folded")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_number_over_a_value_is_one_division(backend, dtype):
    """``3.0 / g`` is the correctly rounded quotient on every backend: the reference gave
    Python's ``g.reciprocal() * 3.0``, a unit in the last place off for about a third of
    the values, NaN for ``0.0 / g`` at a subnormal ``g`` (whose reciprocal overflows) and
    inf for ``0.1 / 1e-39`` in float32; and ``3.0 / h`` likewise in the scalar phase."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3000, generator=gen, dtype=torch.float64)
    g[:4] = torch.tensor([1e-40, -1e-40, 1e-39, -0.0])
    g = g.to(dtype)
    text = ("optimizer f(h = 0.9) {\n    state a = zeros\n    state b = zeros\n"
            "    state c = zeros\n    a = 3.0 / g\n    b = 0.0 / g\n    c = 0.1 / g\n"
            "    p = p * 0 + 3.0 / h\n}")
    got_p, got = step(text, backend, torch.zeros_like(g), g)
    for name, number in (("a", 3.0), ("b", 0.0), ("c", 0.1)):
        assert_same(got[name]["x"], torch.full_like(g, number) / g, f"{number} / g")
    assert torch.equal(got_p["x"], torch.full_like(g, 3.0 / 0.9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_division_by_a_value_of_the_step_is_within_two_units(backend):
    """``g / (h * t)``: one division on the reference and Triton; the C kernels multiply by
    the divisor's reciprocal, within two units in the last place (docs/language.md)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3000, generator=gen)
    got_p, _ = step("optimizer f(h = 0.9) { p = g / (h * t) }", backend, g.clone(), g)
    want = g / torch.full_like(g, 0.9)
    if backend == "c":
        ulp = torch.abs(want.double() - torch.nextafter(want, torch.full_like(want, math.inf)))
        assert ((got_p["x"].double() - want.double()).abs() <= 2 * ulp).all()
    else:
        assert_same(got_p["x"], want, f"g / h on {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float16_state_of_a_float64_step_is_rounded_as_torch_casts(backend):
    """A float16 state of float64 parameters stores each value as torch's cast does, through
    float32 (as every backend stores a bfloat16 one): the C and Triton kernels rounded
    float64 to float16 at once, so at 1 + 2^-11 + 2^-40 (just past a tie of float16, a tie
    of float32 too) they stored 1.0009765625 where the reference stored 1.0, and 65504
    where it stored inf at 65519.99999; a fuzzed spec then read the state into a sum of
    sines and the two parted by 1e-2."""
    x = torch.tensor([1 + 2 ** -11 + 2 ** -40, -(1 + 2 ** -11 + 2 ** -40), 65519.99999,
                      1 + 2 ** -11 - 2 ** -40, 2 ** -25 + 2 ** -60, 0.1, math.nan, -0.0],
                     dtype=torch.float64)
    text = "optimizer f() {\n    state a: float16 = zeros\n    a = p\n    p = p\n}"
    _, got = step(text, backend, x, x)
    assert_same(got["a"]["x"], x.to(torch.float16), "a")
    assert_same(got["a"]["x"][:3], torch.tensor([1.0, -1.0, math.inf]), "a at the ties")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_read_after_it_is_assigned_is_the_value_before_it_is_stored(backend):
    """Reading a state after assigning it reads the value computed, not that value rounded to
    the state's dtype (which happens when it is stored): a float16 state given 960449.4
    stores inf, and the parameter read from it is 960449.4 on every backend
    (docs/language.md)."""
    x = torch.full((1000,), 960.4494)
    text = "optimizer f() {\n    state a: float16 = zeros\n    a = g * 1000\n    p = a * 1\n}"
    got_p, got = step(text, backend, torch.zeros_like(x), x)
    assert_same(got_p["x"], x * 1000, "p")
    assert_same(got["a"]["x"], torch.full((1000,), math.inf, dtype=torch.float16), "a")
