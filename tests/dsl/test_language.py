"""The language's features: what parses, what it means, how the IR comes out."""
import math
import os

import pytest
import torch

import vega
from vega.dsl.ir import Kind, Op


def _program(text, **flags):
    return vega.compile(text).program(**flags)


def _updates(program):
    return dict(program.updates)


def test_header_types_ranges_and_class_name():
    spec = vega.compile("""
        # First line is the summary.
        optimizer my_opt as MyOpt(lr = 1e-3 in [0, inf), b = 0.5 in (0, 1], k: float = 2,
                                  flag: bool = true, other = false,) {
            p = p - lr * g
        }""")
    assert spec.name == "my_opt" and spec.class_name == "MyOpt"
    assert spec.doc == "First line is the summary."
    kinds = {h.name: (h.type, h.default) for h in spec.hypers}
    assert kinds == {"lr": ("float", 1e-3), "b": ("float", 0.5), "k": ("float", 2.0),
                     "flag": ("bool", True), "other": ("bool", False)}
    b = spec.hypers[1].range
    assert not b.contains(0.0) and b.contains(1.0) and str(b) == "(0, 1]"
    assert spec.hypers[0].range.contains(1e30) and not spec.hypers[0].range.contains(math.inf)


def test_precedence_and_power():
    prog = _program("optimizer o() { p = -p ^ 2 + 2 * 3 ^ 2 ^ 1 - g / 2 }")
    # -(p^2) + 18 - g/2, constant part folded
    node = _updates(prog)["p"]
    assert node.op is Op.SUB
    plus = node.src[0]
    assert plus.op is Op.ADD and plus.src[1].op is Op.CONST and plus.src[1].arg == 18.0
    # p ^ 2 is p * p: the exponents torch's pow special-cases become plain ops
    square = plus.src[0].src[0]
    assert plus.src[0].op is Op.NEG and square.op is Op.MUL and square.src[0] is square.src[1]


@pytest.mark.parametrize("exponent,op", [("2", Op.MUL), ("0.5", Op.SQRT), ("-0.5", Op.RSQRT),
                                         ("-1", Op.DIV), ("-2", Op.DIV), ("1", Op.PARAM),
                                         ("3", Op.POW), ("-0.25", Op.POW)])
def test_constant_powers_become_plain_ops(exponent, op):
    node = _updates(_program(f"optimizer o() {{ p = p ^ {exponent} }}"))["p"]
    assert node.op is op
    p = torch.tensor([0.25, 2.0, 9.0], dtype=torch.float64)
    spec = vega.compile(f"optimizer o() {{ p = p ^ {exponent} }}")
    new, _ = spec.step({"w": p}, {"w": torch.zeros(3, dtype=torch.float64)}, spec.init({"w": p}),
                       backend="reference")
    torch.testing.assert_close(new["w"], p ** float(exponent), rtol=1e-15, atol=0)


NEGATIVE_BASES = [("(-2) ^ k", "k", 2.0, 4.0), ("(-2) ^ k", "k", 3.0, -8.0),
                  ("(-0.5) ^ k", "k", 2.0, 0.25), ("(0 - 2) ^ k", "k", 2.0, 4.0),
                  ("(-2) ^ 2 ^ k", "k", 1.0, 4.0), ("(-1) ^ t", None, None, -1.0)]


@pytest.mark.parametrize("base,name,value,want", NEGATIVE_BASES,
                         ids=[f"{b}|{v}" for b, _, v, _ in NEGATIVE_BASES])
@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_negative_number_raised_to_a_power_that_is_not_constant(backend, base, name, value,
                                                                  want):
    """(-2) ^ k is 4 at k = 2: the reference's Python read its -2.0 ** k as -(2.0 ** k)."""
    hypers = f"{name} = 1.0" if name else ""
    spec = vega.compile(f"optimizer o({hypers}) {{ p = p + {base} }}")
    p = {"w": torch.zeros(2, dtype=torch.float64)}
    kw = {name: value} if name else {}
    new, _ = spec.step(p, {"w": torch.zeros(2, dtype=torch.float64)}, spec.init(p),
                       backend=backend, **kw)
    assert new["w"].tolist() == [want, want]


def test_scalar_subexpressions_are_hoisted():
    prog = vega.adamw.program()
    from vega.codegen.base import linearize
    lin = linearize(prog)
    scalar_ops = {line.node.op for line in lin.scalar_lines}
    assert Op.POW in scalar_ops  # b1 ^ t is computed once per step
    assert all(line.node.kind == Kind.ELEMENT or line.node.kind == Kind.TENSOR
               for line in lin.element_lines)
    assert all(line.node.kind <= Kind.SCALAR for line in lin.scalar_lines)


def test_a_name_assigned_many_times_is_named_in_linear_time(monkeypatch):
    """Each value of a name assigned again and again gets the next free suffix (v_x, v_x_1,
    v_x_2, ..., past one the spec took itself, x_1), found without trying every suffix
    before it: a spec assigning x 20,000 times (300 KB) spent minutes in the quadratic
    search. Counted by the lookups in the set of names taken, not timed."""
    from vega.codegen import base
    lookups = [0]

    class Counted(set):
        def __contains__(self, item):
            lookups[0] += 1
            return super().__contains__(item)

    monkeypatch.setattr(base, "set", Counted, raising=False)
    n = 2000
    text = ("optimizer o(lr = 0.1) {\n  x_1 = g * 3\n  x = g\n"
            + "  x = x * 0.5 + x_1\n" * n + "  p = p - lr * x\n}\n")
    lin = base.linearize(vega.compile(text).program())
    named = [line.var for line in lin.element_lines if line.var.startswith("v_x")]
    assert named[:4] == ["v_x_1", "v_x", "v_x_2", "v_x_3"]  # (g * 3 first: x_1's own)
    assert len(set(named)) == len(named)
    assert lookups[0] < 10 * n


def test_compile_time_if_selects_state_and_code():
    spec = vega.adam
    assert spec.program(amsgrad=False).state_names == ("mu", "nu")
    assert spec.program(amsgrad=True).state_names == ("mu", "nu", "nu_max")


def test_if_else_chain_and_boolean_logic():
    text = """optimizer o(lr = 1.0, a = false, b = false) {
        if a and not b { d = g } else if b { d = 2 * g } else { d = 3 * g }
        p = p - lr * d
    }"""
    spec = vega.compile(text)
    p, g = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for flags, factor in [({"a": True}, 1), ({"b": True}, 2), ({}, 3), ({"a": True, "b": True}, 2)]:
        state = spec.init(p)
        new, _ = spec.step(p, g, state, **flags)
        assert torch.equal(new, p - factor * g)


# x is one value per element where f holds; the other branch makes it narrower (a number,
# one per row or column, one per tensor), and each reduction counts it as the if made it
NARROWED = [("x = row_sum(g)", "sum(x)", lambda g: g.sum(-1, keepdim=True).expand_as(g).sum()),
            ("x = row_sum(g)", "norm(x) ^ 2",
             lambda g: (g.sum(-1, keepdim=True).expand_as(g) ** 2).sum()),
            ("x = col_sum(g)", "sum(x)", lambda g: g.sum(0, keepdim=True).expand_as(g).sum()),
            ("x = row_sum(g)", "global_sum(x)", None),
            ("x = norm(g)", "global_sum(x)", None),
            ("x = 2", "global_sum(x)", None)]


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
@pytest.mark.parametrize("other,reduce,want", NARROWED, ids=lambda v: v if isinstance(v, str)
                         else "")
def test_a_reduction_counts_a_value_an_if_narrowed_once_per_element(backend, other, reduce,
                                                                    want):
    """docs/language.md: a value assigned one value per element in one branch and a number
    (or one per row) in the other is one per element after the if, and a reduction of it
    counts it once per element in every setting: sum(x) of a per-row x is its rows' values
    each times the number of columns, as the same x spread over the elements sums."""
    spec = vega.compile(f"optimizer o(f: bool = true) {{\n  if f {{ x = g }} else {{ {other} }}"
                        f"\n  p = p - {reduce}\n}}\n")
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 5), (6, 4), (7,)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    per_element = []  # x as one value per element, with f false
    for g in grads:
        m = g.reshape(1, -1) if g.dim() == 1 else g if g.shape[0] <= g.shape[1] else g.T
        x = {"x = row_sum(g)": m.sum(1, keepdim=True), "x = col_sum(g)": m.sum(0, keepdim=True),
             "x = norm(g)": g.norm(), "x = 2": torch.tensor(2.0, dtype=g.dtype)}[other]
        per_element.append(x.expand_as(m))
    group = sum(float(x.sum()) for x in per_element)
    new, _ = spec.step(params, grads, spec.init(params), backend=backend, f=False)
    for p, x, got in zip(params, per_element, new):
        r = {"sum(x)": x.sum(), "norm(x) ^ 2": (x * x).sum()}.get(reduce, group)
        torch.testing.assert_close(got, p - r, rtol=1e-12, atol=1e-12)



def test_a_number_an_if_made_of_a_per_row_or_per_tensor_value_counts_as_that():
    """Where the other branch assigns one value per row (per tensor), a number from this
    one is counted once per row (per tensor), not once per element; a repeat's copies of
    one reduction each count their own argument."""
    d = torch.float64
    params = [torch.zeros(2, 3, dtype=d), torch.zeros(4, dtype=d)]
    grads = [torch.ones(2, 3, dtype=d), torch.ones(4, dtype=d)]
    for other, reduce, want in [("x = row_sum(g)", "sum(x)", [-4.0, -2.0]),
                                ("x = norm(g)", "global_sum(x)", [-4.0, -4.0]),
                                ("x = col_sum(g)", "global_sum(x)", [-14.0, -14.0])]:
        spec = vega.compile(f"optimizer o(f: bool = true) {{\n if f {{ {other} }} else "
                            f"{{ x = 2 }}\n p = p - {reduce}\n}}\n")
        new, _ = spec.step(params, grads, spec.init(params), f=False, backend="reference")
        assert [float(w.flatten()[0]) for w in new] == want, (other, reduce)
    spec = vega.compile("optimizer o() {\n x = row_sum(g)\n s = 0\n"
                        " repeat 2 { s = 10 * s + sum(x)\n x = g }\n p = p - s\n}\n")
    new, _ = spec.step(params, grads, spec.init(params), backend="reference")
    assert [float(w.flatten()[0]) for w in new] == [-66.0, -44.0]


def test_where_comparisons_and_functions():
    spec = vega.compile("""optimizer o(lr = 1.0) {
        d = where(g > 0 and g <= 2, sqrt(abs(g)), -exp(log(abs(g) + 1)))
        e = clamp(g, -1, 1) + min(g, 0) + max(g, 0) + sign(g) + rsqrt(abs(g) + 1)
        p = p - lr * (d + e)
    }""")
    g = torch.tensor([-3.0, -0.5, 0.0, 0.5, 2.0, 5.0], dtype=torch.float64)
    p = torch.zeros_like(g)
    new, _ = spec.step(p, g, spec.init(p))
    d = torch.where((g > 0) & (g <= 2), g.abs().sqrt(), -(g.abs() + 1))
    e = g.clamp(-1, 1) + g.clamp(max=0) + g.clamp(min=0) + g.sign() + (g.abs() + 1).rsqrt()
    torch.testing.assert_close(new, -(d + e), rtol=1e-14, atol=1e-14)


def test_per_tensor_reductions():
    spec = vega.compile("""optimizer o(lr = 1.0) {
        p = p - lr * (norm(g) + sum(g) + mean(g) + max(g)) * g
    }""")
    params = {"a": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    new, _ = spec.step(params, grads, spec.init(params))
    for k in params:
        g = grads[k]
        want = params[k] - (g.norm() + g.sum() + g.mean() + g.max()) * g
        torch.testing.assert_close(new[k], want, rtol=1e-14, atol=1e-14)


def test_state_init_from_hyperparameters_and_p():
    spec = vega.compile("""optimizer o(lr = 1.0, init = 0.1) {
        state acc = init
        state copy = p * 2
        acc = acc + g * g
        p = p - lr * g / sqrt(acc) + 0 * copy
    }""")
    p = torch.arange(3.0, dtype=torch.float64)
    state = spec.init(p, init=0.25)
    assert torch.equal(state["acc"], torch.full((3,), 0.25, dtype=torch.float64))
    assert torch.equal(state["copy"], 2 * p)


def test_scalar_state_update_broadcasts():
    spec = vega.compile("optimizer o(lr = 1.0) { state s = zeros\n s = lr * 2\n p = p - s * g }")
    p = torch.zeros(2, 3)
    new, state = spec.step(p, torch.ones(2, 3), spec.init(p), lr=0.5)
    assert state["s"].shape == (2, 3) and torch.equal(state["s"], torch.ones(2, 3))
    assert torch.equal(new, -torch.ones(2, 3))


def test_python_keywords_as_names():
    spec = vega.compile("optimizer o(lambda = 0.5, def = 1.0) {\n is = g * lambda\n"
                        " p = p - def * is }")
    p = torch.ones(3)
    new, _ = spec.step(p, torch.ones(3), spec.init(p))
    assert torch.equal(new, torch.full((3,), 0.5))


NAMED = [("inf", math.inf), ("-inf", -math.inf), ("nan", math.nan), ("pi", math.pi),
         ("-pi", -math.pi), ("2 * pi", 2 * math.pi), ("pi / 2", math.pi / 2),
         ("inf - inf", math.nan), ("min(pi, inf)", math.pi), ("-inf < pi", True)]


@pytest.mark.parametrize("text,value", NAMED, ids=[t for t, _ in NAMED])
def test_inf_nan_and_pi_are_numbers_in_expressions(text, value):
    """Each a literal that folds like any number (where a name would be undefined)."""
    if isinstance(value, bool):  # where(x, g, p) with x known: g or p
        node = _updates(_program(f"optimizer o() {{\n    x = {text}\n"
                                 "    p = where(x, g, p)\n}"))["p"]
        assert node.op is (Op.GRAD if value else Op.PARAM)
        return
    node = _updates(_program(f"optimizer o() {{\n    x = {text}\n"
                             "    p = where(g > 0, x, p)\n}"))["p"]
    got = node.src[1].arg
    assert got == value or (math.isnan(value) and math.isnan(got)), (text, got)


def test_inf_nan_and_pi_in_defaults_and_ranges():
    spec = vega.compile("""optimizer o(cap = inf, low = -inf, k = pi in [-pi, pi],
                                      b = 0.5 in (-inf, pi)) {
        p = p - b * max(min(g, cap), low) * k
    }""")
    assert [h.default for h in spec.hypers] == [math.inf, -math.inf, math.pi, 0.5]
    k, b = spec.hypers[2].range, spec.hypers[3].range
    assert str(k) == "[-pi, pi]" and str(b) == "(-inf, pi)"
    assert k.contains(math.pi) and k.contains(-math.pi) and not k.contains(3.1416)
    p = torch.zeros(2)
    with pytest.raises(ValueError, match=r"k=3\.2 is outside its range \[-pi, pi\]"):
        spec.step(p, p, spec.init(p), k=3.2)


def test_pi_is_exact_in_a_float64_step():
    """pi, as a literal and as a default, is Python's math.pi to the last bit."""
    spec = vega.compile("optimizer o(k = pi) {\n    state s = zeros\n    s = p * 0 + k\n"
                        "    p = p * 0 + pi\n}")
    p = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    new_p, new_s = spec.step(p, p, spec.init(p), backend="reference")
    assert new_p["w"].tolist() == [math.pi] * 2 and new_s["s"]["w"].tolist() == [math.pi] * 2


def test_names_that_begin_like_a_constant_are_names():
    spec = vega.compile("""optimizer o(inflation = 2.0, pie = 0.5, nan_ok = true) {
        info = g * inflation
        pi2 = info * pie
        p = p - where(nan_ok, pi2, 0)
    }""")
    p = torch.ones(2)
    assert spec.step(p, p, spec.init(p))[0].tolist() == [0.0, 0.0]


def test_a_condition_on_a_hyperparameter_against_inf():
    """inf in the condition of an if on a float hyperparameter's value."""
    spec = vega.compile("""optimizer clipped(lr = 1.0, clip = inf in [0, inf]) {
        if clip < inf {
            p = p - lr * min(g, clip)
        } else {
            p = p - lr * g
        }
    }""")
    p, g = torch.zeros(2), torch.tensor([3.0, 0.5])
    assert spec.step(p, g, spec.init(p))[0].tolist() == [-3.0, -0.5]
    assert spec.step(p, g, spec.init(p), clip=1.0)[0].tolist() == [-1.0, -0.5]


def test_unknown_flag_and_bad_values():
    with pytest.raises(TypeError, match="unexpected hyperparameter 'amsgard'.*'amsgrad'"):
        vega.adam.program(amsgard=True)
    p = torch.zeros(2)
    with pytest.raises(ValueError, match=r"b1=1\.5 is outside its range \[0, 1\)"):
        vega.adam_step(p, p, vega.adam_init(p), b1=1.5)
    with pytest.raises(ValueError, match="lr=-0.1 is outside its range"):
        vega.optim.AdamW([torch.zeros(2, requires_grad=True)], lr=-0.1)
    # a bound as written, not to six digits ([0, 1], which would hold the value)
    close = vega.compile("optimizer o(b = 0.5 in [0, 0.99999999]) { p = p - b * g }")
    with pytest.raises(ValueError, match=r"b=0\.999999999 is outside its range "
                                         r"\[0, 0\.99999999\]"):
        close.step(p, p, close.init(p), b=0.999999999)
    with pytest.raises(ValueError, match="amsgrad=1 must be True or False"):
        vega.adam_init(p, amsgrad=1)
    # a state's dtypes are its init's: a step names where to give them
    with pytest.raises(TypeError, match=r"adam_step got state_dtype: a state's dtypes are "
                                        r"chosen where it is made \(adam_init\(params, "
                                        r"state_dtype=\.\.\.\)\)"):
        vega.adam_step(p, p, vega.adam_init(p), state_dtype=torch.bfloat16)


# (expression of A and B, a, b): folded where both are literals, computed by the kernels'
# scalar phase where they are hyperparameters; the two must agree bit for bit
FOLDS = [("A ^ B", 0.0, -1.0), ("A ^ B", -0.0, -1.0), ("A ^ B", -8.0, 0.5),
         ("A ^ B", 10.0, 400.0), ("exp(A) + B", 1000.0, 0.0), ("A / B", 1.0, -0.0),
         ("A / B", 0.0, 0.0), ("min(A, sqrt(B))", 1.0, -1.0), ("max(sqrt(B), A)", 1.0, -1.0),
         ("min(A, B)", -0.0, 0.0), ("max(A, B)", 0.0, -0.0), ("sign(A) + B", -0.0, -0.0),
         ("sign(sqrt(B)) + A", 0.0, -1.0), ("log(A) * B", 0.0, 1.0), ("rsqrt(A) + B", -0.0, 0.0)]


@pytest.mark.parametrize("expr,a,b", FOLDS, ids=[f"{e}|{a}|{b}" for e, a, b in FOLDS])
def test_constant_folding_computes_what_the_kernels_compute(expr, a, b):
    """Folding literals never fails to compile (0 ^ -1 is inf, (-8) ^ 0.5 NaN, exp(1000)
    inf) and gives the value the kernels give the same expression of hyperparameters:
    NaN through min, max and sign, signed zeros."""
    def lit(x):
        return f"({x})" if str(x)[0] != "-" else f"(-{str(x)[1:]})"
    folded = vega.compile("optimizer folded() {\n    p = p * 0 + "
                          f"{expr.replace('A', lit(a)).replace('B', lit(b))}\n}}")
    unfolded = vega.compile("optimizer unfolded(a = 1.0, b = 1.0) {\n"
                            f"    p = p * 0 + {expr.replace('A', 'a').replace('B', 'b')}\n}}")
    params = {"w": torch.ones(3, dtype=torch.float64)}
    grads = {"w": torch.ones(3, dtype=torch.float64)}
    want = folded.step(params, grads, folded.init(params), backend="reference")[0]["w"]
    for backend in ("reference", "c"):
        got = unfolded.step(params, grads, unfolded.init(params, a=a, b=b), backend=backend,
                            a=a, b=b)[0]["w"]
        assert torch.equal(got.isnan(), want.isnan()), (backend, got, want)
        same = got.isnan() | (got.view(torch.int64) == want.view(torch.int64))
        assert same.all(), (backend, got, want)


def test_a_state_declared_after_p_is_assigned_starts_from_the_parameter():
    spec = vega.compile("""optimizer o(lr = 0.1) {
        p = p - lr * g
        state s = 2 * p
        s = s + g
    }""")
    params = {"w": torch.ones(2, dtype=torch.float64)}
    grads = {"w": torch.ones(2, dtype=torch.float64)}
    assert spec.init(params)["s"]["w"].tolist() == [2.0, 2.0]
    for backend in ("reference", "c"):
        new_p, new_s = spec.step(params, grads, spec.init(params), backend=backend)
        assert new_p["w"].tolist() == [0.9, 0.9] and new_s["s"]["w"].tolist() == [3.0, 3.0]


# specs whose check walks both branches (a value per element), and a setting that makes
# the value smaller: the reduction spreads it over the elements, as the check saw it
SETTINGS_THAT_SHRINK = [
    ("optimizer o(lr = 0.1, f = true) {\n    p = p - lr * sum(where(f, g, 0))\n}",
     {"f": False}, 1.0, 1.0),
    ("optimizer o(lr = 0.1, f = true) {\n    if f {\n        y = g\n    } else {\n"
     "        y = lr\n    }\n    p = p - lr * mean(y)\n}", {"f": False}, 0.99, 0.99),
    ("optimizer o(lr = 0.1) {\n    if ndim(p) >= 2 {\n        y = g\n    } else {\n"
     "        y = row_mean(g)\n    }\n    p = p - lr * row_sum(y)\n}", {}, 0.7, 0.6),
    ("optimizer o(lr = 0.1, f = true) {\n    if f {\n        p = p - lr * g\n    }\n}",
     {"f": False}, 1.0, 1.0),  # p as it is
]


@pytest.mark.parametrize("source,hypers,w,v", SETTINGS_THAT_SHRINK)
def test_every_setting_a_spec_compiles_with_steps(source, hypers, w, v):
    spec = vega.compile(source)
    params = {"w": torch.ones(2, 3, dtype=torch.float64), "v": torch.ones(4, dtype=torch.float64)}
    grads = {k: torch.ones_like(x) for k, x in params.items()}
    for backend in ("reference", "c"):
        new_p, _ = spec.step(params, grads, spec.init(params, **hypers), backend=backend,
                             **hypers)
        torch.testing.assert_close(new_p["w"], torch.full((2, 3), w, dtype=torch.float64))
        torch.testing.assert_close(new_p["v"], torch.full((4,), v, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", [
    "reference", "c", pytest.param("triton", marks=pytest.mark.skipif(
        "triton" not in vega.codegen.BACKENDS or not torch.cuda.is_available() and
        os.environ.get("TRITON_INTERPRET") != "1", reason="no Triton to run"))])
def test_a_negative_zero_is_its_own_constant_beside_zero(backend, dtype):
    """-0.0 == 0.0 in Python, and they hash alike: a program that uses both keeps each (the
    sharing of equal subexpressions tells them apart by sign); and Triton, whose constants
    are +0.0 for -0.0, is given a product that makes it, per element and per tensor."""
    spec = vega.compile("optimizer o() {\n p = where(g > 0, -0.0, p) + where(t > 0, -0.0, 1)"
                        "\n}")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.tensor([1.0, -1.0], dtype=dtype, device=device)
    new, _ = spec.step([torch.full((2,), 3.0, dtype=dtype, device=device)], [g],
                       spec.init([g]), backend=backend)
    assert math.copysign(1.0, float(new[0][0])) == -1.0 and float(new[0][1]) == 3.0


def _page_spec(heading):
    """The spec in the first code block under ``heading`` of docs/language.md."""
    import pathlib
    page = (pathlib.Path(__file__).parents[2] / "docs" / "language.md").read_text()
    section = page[page.index(f"\n{heading}\n"):]
    return section.split("```\n", 2)[1]


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_the_pages_cautious_adamw_matches_its_rule(backend):
    """docs/language.md's worked example against a float64 transcription of Cautious
    AdamW: AdamW's update, zero where its sign is not the gradient's, over the mask's mean."""
    spec = vega.compile(_page_spec("## Example: Cautious AdamW"), "language.md")
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (16,), ()]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    hypers = dict(lr=0.05, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    want = [p.clone() for p in params]
    mu = [torch.zeros_like(p) for p in params]
    nu = [torch.zeros_like(p) for p in params]
    state = spec.init(params)
    for t in range(1, 6):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        params, state = spec.step(params, grads, state, backend=backend, **hypers)
        for w, m, v, g in zip(want, mu, nu, grads):
            m.mul_(0.9).add_(0.1 * g)
            v.mul_(0.999).add_(0.001 * g * g)
            u = (m / (1 - 0.9 ** t)) / ((v / (1 - 0.999 ** t)).sqrt() + 1e-8)
            mask = (u * g > 0).double()
            u = u * mask / mask.mean().clamp(min=1e-3)
            w.mul_(1 - 0.05 * 0.1).sub_(0.05 * u)
    for got, w in zip(params, want):
        torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)


def test_a_state_never_assigned_reads_what_the_caller_wrote():
    """docs/language.md: a state taken from p and never assigned carries values the caller
    computes (Sophia's Hessian estimate), written into the functional state or a class's."""
    spec = vega.compile("optimizer o(lr = 0.5) {\n  state h = 0 * p\n"
                        "  p = p - lr * g / (h + 1)\n}\n")
    p = torch.ones(3, dtype=torch.float64)
    state = spec.init([p])
    state["h"] = [torch.full((3,), 3.0, dtype=torch.float64)]
    new, state = spec.step([p], [torch.ones(3, dtype=torch.float64)], state)
    assert torch.equal(new[0], torch.full((3,), 0.875, dtype=torch.float64))
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = spec.optimizer([w])
    for _ in range(2):  # the class makes the state (h = 0) in its first step
        w.grad = torch.ones(3, dtype=torch.float64)
        opt.step()
        opt.state[w]["h"].fill_(1.0)
    assert torch.equal(w.detach(), torch.full((3,), 0.25, dtype=torch.float64))
    # written before the first step: an error that says when to write it
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    w.grad = torch.ones(3, dtype=torch.float64)
    opt = spec.optimizer([w])
    opt.state[w]["h"] = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"has \['h'\] and no step count: it was written in "
                       r"before the first step made the state \(\['h', 'step'\]\); write "
                       r"into it after the first step"):
        opt.step()


@pytest.mark.parametrize("cond,taken", [
    ("true and g > 0", "g"), ("g > 0 and true", "g"), ("false or g > 0", "g"),
    ("g > 0 or false", "g"), ("false and g > 0", "minus"), ("true or g > 0", "plus")])
def test_and_or_with_a_literal_side(cond, taken):
    """'and' and 'or' with a literal true or false on one side fold to the other side or to
    the literal, as Python reads them."""
    g = torch.tensor([1.0, -2.0, 3.0])
    spec = vega.compile(f"optimizer o() {{\n    p = where({cond}, p - g, p + g)\n}}")
    params = {"a": torch.zeros(3)}
    out, _ = spec.step(params, {"a": g}, spec.init(params))
    want = {"g": torch.where(g > 0, -g, g), "plus": -g, "minus": g}[taken]
    assert torch.equal(out["a"], want)
