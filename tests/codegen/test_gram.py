"""The Gram form of Newton-Schulz chains (``vega.codegen.gram``): which programs it rewrites,
where it runs, and that it computes the iteration as written."""
import pytest
import torch

import vega
from vega.codegen import gram, reference

CUBIC = """
optimizer o() {
    x = g / norm(g)
    repeat 4 {
        A = x @ transpose(x)
        x = 1.5 * x + (-0.5 * A) @ x
    }
    p = p - x
}"""


def form(text: str, shape=(3, 10)):
    program = vega.compile(text).program(shape=shape)
    return gram.gram_form(reference.fuse_products(program))


def products_of(monkeypatch) -> list:
    """The shapes of the products torch computes from here on (the last two axes)."""
    out = []
    for name in ("matmul", "addmm", "baddbmm", "bmm"):
        def recorded(*args, _fn=getattr(torch, name), **kwargs):
            res = _fn(*args, **kwargs)
            out.append(tuple(res.shape[-2:]))
            return res
        monkeypatch.setattr(torch, name, recorded)
    return out


def cubic_by_hand(g: torch.Tensor, steps: int = 4) -> torch.Tensor:
    x = g / g.norm()
    for _ in range(steps):
        x = 1.5 * x - 0.5 * (x @ x.T) @ x
    return x


def test_a_chain_of_steps_is_found_and_costed():
    """Four cubic steps (no square product in B): runs of 3 and 1. The Gram form pays where
    the columns outnumber the rows by more than 1.5, for the cubic here and for Muon's
    quintic alike; never for a square or a tall view."""
    found = form(CUBIC)
    assert found is not None and found.chains == ((4, 0, (3, 1)),)
    # standard: 4 (2 m^2 n); Gram: 2 m^2 n + 6 m^3, then 2 m^2 n: n > 1.5 m
    assert found.pays(30, 46) and not found.pays(30, 45) and not found.pays(30, 30)
    muon = vega.builtin("muon").program(shape=(4, 12))
    quintic = gram.gram_form(reference.fuse_products(muon))
    assert quintic.chains == ((5, 1, (3, 2)),)
    assert quintic.pays(768, 3072) and quintic.pays(768, 15000)
    assert not quintic.pays(768, 1152)  # (the same work: the iteration as written)
    assert not quintic.pays(768, 768) and not quintic.pays(3072, 768)
    assert quintic.pays(2, 256) and not quintic.pays(1, 256)  # (one row: as written)


def test_the_gram_form_computes_the_iteration_as_written(monkeypatch):
    """float64, a wide view: the cubic iteration written out by hand, to rounding; two
    products of the parameter's size (x x^T aside), where the steps as written take four."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    spec = vega.compile(CUBIC)
    shapes = products_of(monkeypatch)
    new, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    torch.testing.assert_close(new[0], -cubic_by_hand(g), rtol=1e-12, atol=1e-12)
    assert shapes.count((3, 10)) == 2, shapes
    shapes.clear()
    monkeypatch.setattr(gram.Gram, "pays", lambda self, rows, cols: False)
    again, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    assert shapes.count((3, 10)) == 4, shapes
    torch.testing.assert_close(again[0], new[0], rtol=1e-12, atol=1e-12)


def test_a_square_view_keeps_the_iteration_as_written(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    spec = vega.compile(CUBIC)
    shapes = products_of(monkeypatch)
    new, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    torch.testing.assert_close(new[0], -cubic_by_hand(g), rtol=1e-12, atol=1e-12)
    assert shapes.count((6, 6)) == 8  # x x^T and the step's product, four times


@pytest.mark.parametrize("text, chains", [
    # an intermediate x read elsewhere: the steps do not chain
    ("optimizer o() {\n x = g\n A = x @ transpose(x)\n x = 1.5 * x + (-0.5 * A) @ x\n"
     " y = x\n A = x @ transpose(x)\n x = 1.5 * x + (-0.5 * A) @ x\n p = p - x - y\n}", None),
    # B reads more than x x^T (the gradient's own Gram matrix)
    ("optimizer o() {\n x = g\n G = g @ transpose(g)\n repeat 3 {\n A = x @ transpose(x)\n"
     " x = 1.5 * x + (G - A) @ x\n }\n p = p - x\n}", None),
    # the steps of a tall matrix's form, x (xT x): the products multiply x on the right
    ("optimizer o() {\n x = g\n repeat 3 {\n C = transpose(x) @ x\n"
     " x = 1.5 * x + x @ (-0.5 * C)\n }\n p = p - x\n}", None),
    ("optimizer o() {\n x = g\n repeat 2 {\n C = transpose(x) @ x\n x = x @ C\n }\n"
     " p = p - x\n}", None),
    # one step only
    ("optimizer o() {\n x = g\n A = x @ transpose(x)\n x = 1.5 * x + (-0.5 * A) @ x\n"
     " p = p - x\n}", None),
    # B widened: a bfloat16 x becomes float32 after the first step, and each later A is
    # float32, which the Gram form would compute from the first step's bfloat16 A
    ("optimizer o() {\n x = bfloat16(g)\n repeat 3 {\n A = x @ transpose(x)\n"
     " x = 1.5 * x + widen(-0.5 * A) @ x\n }\n p = p - widen(x)\n}", None),
    # the last A read after the chain: that step is not one, the two before it chain
    ("optimizer o() {\n x = g\n repeat 3 {\n A = x @ transpose(x)\n"
     " x = 1.5 * x + (-0.5 * A) @ x\n }\n p = p - x - sum(A)\n}", ((2, 0, (2,)),)),
])
def test_what_is_not_a_step_of_a_chain_is_left_as_written(monkeypatch, text, chains):
    found = form(text)
    assert (found and found.chains) == chains
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(3, 10, generator=gen, dtype=torch.float64) / 4
    spec = vega.compile(text)
    new, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    monkeypatch.setattr(gram.Gram, "pays", lambda self, rows, cols: False)
    spec = vega.compile(text)
    written, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    torch.testing.assert_close(new[0], written[0], rtol=1e-12, atol=1e-12)


def test_a_chain_of_a_program_with_more_is_rewritten_alone(monkeypatch):
    """B without the shift (``x = B @ x``), and values before and after the chain that read
    x: only the chain's steps change."""
    text = """
    optimizer o() {
        x = g / norm(g)
        y = 2 * x
        repeat 3 {
            A = x @ transpose(x)
            x = (1.5 * A - A @ A) @ x
        }
        p = p - x - y
    }"""
    found = form(text)
    assert found is not None and found.chains == ((3, 1, (3,)),)
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(2, 9, generator=gen, dtype=torch.float64)
    x = g / g.norm()
    for _ in range(3):
        a = x @ x.T
        x = (1.5 * a - a @ a) @ x
    spec = vega.compile(text)
    new, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    torch.testing.assert_close(new[0], -x - 2 * (g / g.norm()), rtol=1e-12, atol=1e-12)


def test_the_source_shows_the_gram_form():
    text = vega.builtin("muon").source("reference", shape=(4, 12))
    assert "Gram form" in text and "_shift(h_a" in text
    assert text.count("def update(") == 2 and text.count("def scalars(") == 1
    assert "Gram form" not in vega.builtin("adamw").source("reference")


def test_p_is_in_the_dtype_of_the_steps_product():
    """``B`` rounded to bfloat16 meets a float64 ``x``: the step as written widens ``B``
    (and adds the shift) before its product, so ``P`` and ``R`` are float64 in the Gram
    form too, not rounded to ``B``'s bfloat16: the two forms agree to float64's rounding,
    and both to the steps written out by hand."""
    text = """
    optimizer o() {
        x = g / norm(g)
        repeat 3 {
            A = x @ transpose(x)
            x = 1.5 * x + bfloat16(-0.5 * A) @ x
        }
        y = g / (2 * norm(g))
        repeat 3 {
            A = y @ transpose(y)
            y = bfloat16(1.5 * A - A @ A) @ y
        }
        p = p - x - y
    }"""
    found = form(text, (8, 64))
    assert found.chains == ((3, 0, (3,)), (3, 1, (3,)))
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x, y = g / g.norm(), g / (2 * g.norm())
    for _ in range(3):
        x = 1.5 * x + (-0.5 * (x @ x.T)).bfloat16().double() @ x
        a = y @ y.T
        y = (1.5 * a - a @ a).bfloat16().double() @ y
    spec = vega.compile(text)
    new, _ = spec.step([torch.zeros_like(g)], [g], spec.init([g]))
    torch.testing.assert_close(new[0], -x - y, rtol=1e-9, atol=1e-12)


def test_steps_of_their_own_numbers_and_a_state_before_the_chain(monkeypatch):
    """Each step's own hyperparameter (a chain need not repeat one body), a state and a
    decay around it: the Gram form is given the scalars the program's update is, and
    computes what the steps as written do, with 2 products of the parameter's size where
    they take 4."""
    text = """
    optimizer o(lr = 0.1, k1 = 1.5, k2 = 1.4, k3 = 1.3, k4 = 1.2, w = 0.3, e = 1e-3) {
        state m = zeros
        m = w * m + g
        x = m / max(norm(m), e)
        A = x @ transpose(x)
        x = k1 * x + (-0.5 * A) @ x
        A = x @ transpose(x)
        x = k2 * x + (-0.4 * A) @ x
        A = x @ transpose(x)
        x = k3 * x + (-0.5 * A) @ x
        A = x @ transpose(x)
        x = k4 * x + (-0.3 * A) @ x
        p = p * (1 - lr * w) - lr * x
    }"""
    assert form(text, (4, 40)).chains == ((4, 0, (3, 1)),)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(4, 40, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 40, generator=gen, dtype=torch.float64) for _ in range(3)]

    def run():
        spec = vega.compile(text)
        ps, state = [w.clone()], spec.init([w])
        for g in grads:
            ps, state = spec.step(ps, [g], state, k2=1.45)
        return ps[0], state
    shapes = products_of(monkeypatch)
    new, state = run()
    assert shapes.count((4, 40)) == 2 * 3, shapes
    monkeypatch.setattr(gram.Gram, "pays", lambda self, rows, cols: False)
    written, state_written = run()
    torch.testing.assert_close(new, written, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["m"], state_written["m"], rtol=0, atol=0)
