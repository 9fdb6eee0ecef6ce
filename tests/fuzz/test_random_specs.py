"""Random valid specs, generated from the language's grammar, stepped on every backend
against the reference, on parameters and gradients full of NaN, infinities, signed zeros,
subnormals and numbers near float32's and float16's range.

Each spec assigns several states a random expression each (arithmetic, unary minus,
powers the compiler writes out, comparisons, ``and``/``or``/``not``, ``where``, ``min``,
``max``, ``clamp``, ``abs``, ``sign``, ``floor``, ``round``, per-tensor and group
maxima, ``t``, hyperparameters, states of several dtypes and one number per tensor), so
that one kernel a dtype covers many expressions. Only operations every backend computes
exactly are drawn (a divisor is one value per element: the C kernels multiply by the
reciprocal of a divisor of one number per step, within two units in the last place; and a
maximum of 0.0 and -0.0 over a tensor may be either), so the states must agree bit for
bit: the same NaNs, the same signs of zero, the same values.

Deterministic (a fixed seed per spec); ``VEGA_FUZZ_SPECS`` sets the number of specs
(default 1, a few seconds; a few hundred, which take minutes, find what one does not)."""
import math
import os
import random

import pytest
import torch

import vega
from vega.codegen import c as c_backend

N = int(os.environ.get("VEGA_FUZZ_SPECS", "1"))
NUMBERS = ["0", "0.0", "1", "2", "0.5", "3", "1e-30", "1e30", "1e38", "1e-45", "inf", "nan",
           "pi", "1e300", "7", "0.1", "65504", "1e39", "1e-40"]
EXACT = ["abs", "sign", "floor", "round"]
COMPARE = ["<", "<=", ">", ">=", "==", "!="]
ELEMENTS = ["p", "g", "s1", "s2", "s3"]
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-42, 1e38, -1e38, 1e-30,
           3.0, -2.5, 0.5, 1.0, -1.0, 2.5, 65504.0, 1e-8, 7.0, -7.0, 1e-45, 3.4028234663852886e38]


class Expressions:
    """Random expressions of the language over ``leaves``."""

    def __init__(self, rng: random.Random, leaves: list[str]):
        self.rng, self.leaves = rng, leaves

    def leaf(self) -> str:
        return self.rng.choice(NUMBERS) if self.rng.random() < 0.2 else \
            self.rng.choice(self.leaves)

    def value(self, depth: int) -> str:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.2:
            return self.leaf()
        f = lambda: self.value(depth - 1)  # noqa: E731
        return rng.choice([
            lambda: f"({f()} {rng.choice('+-*')} {f()})",
            lambda: f"({f()} / ({rng.choice(ELEMENTS)} {rng.choice('+-*')} {f()}))",
            lambda: f"-{f()}",
            lambda: f"-({f()}) ^ {rng.choice(['2', '1', '-1', '0', '2 ^ 1'])}",
            lambda: f"{rng.choice(EXACT)}({f()})",
            lambda: f"{rng.choice(['min', 'max'])}({f()}, {f()})",
            lambda: f"clamp({f()}, {f()}, {f()})",
            lambda: f"where({self.condition(depth - 1)}, {f()}, {f()})",
            lambda: self.maximum(f"{rng.choice(ELEMENTS)} - {f()}"),
        ])()

    def maximum(self, x: str) -> str:
        """A maximum over a tensor or a group, plus 0: a maximum of 0.0 and -0.0 may be either
        (the order of the values decides), and + 0 makes both 0.0."""
        return f"({self.rng.choice(['max', 'global_max'])}({x}) + 0)"

    def condition(self, depth: int) -> str:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.5:
            return f"{self.value(depth - 1)} {rng.choice(COMPARE)} {self.value(depth - 1)}"
        return rng.choice([
            lambda: f"({self.condition(depth - 1)} and {self.condition(depth - 1)})",
            lambda: f"({self.condition(depth - 1)} or {self.condition(depth - 1)})",
            lambda: f"not ({self.condition(depth - 1)})",
        ])()


def random_spec(seed: int, depth: int = 3) -> str:
    """A spec whose four states of p's shape, its state of one number per tensor and its
    parameter are each assigned a random expression."""
    rng = random.Random(f"vega-random-spec-{seed}")
    gen = Expressions(rng, ["p", "g", "t", "a", "b", "s1", "s2", "s3", "n"])
    lines = ["    state s1 = zeros", "    state s2: bfloat16 = ones",
             "    state s3: float16 = zeros", "    state s4: float64 = zeros",
             "    state n: scalar = zeros"]
    # (values first, then the states: an expression reads every state's old value)
    lines += [f"    v{k} = {gen.value(depth)}" for k in range(5)]
    lines.append(f"    v5 = {gen.maximum(f'g * {gen.value(depth - 1)}')}")
    lines += [f"    {name} = v{k}" for k, name in enumerate(("s1", "s2", "s3", "s4", "p"))]
    lines.append("    n = v5")
    hypers = f"a = {rng.choice(['0.5', '-2', '1e-8', '0', '1e30'])}, " \
             f"b = {rng.choice(['0.9', '-0.5', '1e-30', '1', 'inf'])}"
    return f"optimizer random_{seed}({hypers}) {{\n" + "\n".join(lines) + "\n}"


def values(seed: int, n: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    special = torch.tensor(SPECIAL, dtype=torch.float64)[
        torch.randint(0, len(SPECIAL), (n,), generator=gen)]
    return torch.where(torch.rand(n, generator=gen) < 0.5, special, base).to(dtype)


def leaves(seed: int, dtypes) -> dict:
    return {"w": values(seed, 48, dtypes[0]).reshape(6, 8), "b": values(seed + 1, 7, dtypes[1])}


def run(spec, backend: str, seed: int, dtypes, state_dtype, steps: int = 2) -> list:
    params = leaves(seed, dtypes)
    state = spec.init(params, state_dtype=state_dtype)
    out = []
    for k in range(steps):
        params, state = spec.step(params, leaves(1000 * (k + 1) + seed, dtypes), state,
                                  backend=backend)
        out.append({**{f"p.{n}": v for n, v in params.items()},
                    **{f"{s}.{n}": v for s, field in state.items() if isinstance(field, dict)
                       for n, v in field.items()}})
    return out


def differences(got: dict, want: dict) -> list[str]:
    """The leaves whose bits differ: NaN against a number, a zero's sign, a value."""
    bad = []
    for name, w in want.items():
        x = got[name]
        if x.dtype != w.dtype:
            bad.append(f"{name}: dtype {x.dtype}, the reference's {w.dtype}")
            continue
        x, w = x.double().flatten(), w.double().flatten()
        same = (x == w) & (torch.signbit(x) == torch.signbit(w)) | x.isnan() & w.isnan()
        if not same.all():
            at = torch.nonzero(~same).flatten()[:4].tolist()
            bad.append(f"{name} at {at}: {x[at].tolist()}, the reference's {w[at].tolist()}")
    return bad


# (the parameters' dtypes, the states' where not as declared, and the backends besides the
# reference: Triton's interpreter reads bfloat16 subnormals wrong, so on Triton bfloat16
# values are left out)
SETTINGS = [((torch.float32, torch.float64), {"s2": torch.float32}, ("c", "triton")),
            ((torch.float16, torch.float32), {"s2": torch.float16}, ("c", "triton")),
            ((torch.bfloat16, torch.float64), None, ("c",))]


@pytest.mark.skipif(not c_backend.available(), reason="no C compiler: no C backend")
@pytest.mark.parametrize("seed", range(N))
def test_random_specs_step_alike_on_every_backend(seed):
    text = random_spec(seed)
    spec = vega.compile(text, f"random-{seed}.vega")
    for dtypes, state_dtype, backends in SETTINGS:
        want = run(spec, "reference", seed, dtypes, state_dtype)
        for backend in backends:
            got = run(spec, backend, seed, dtypes, state_dtype)
            for k, (g, w) in enumerate(zip(got, want)):
                bad = differences(g, w)
                assert not bad, (f"{backend}, parameters of {dtypes}, step {k + 1}:\n"
                                 + "\n".join(bad) + f"\n{text}")
