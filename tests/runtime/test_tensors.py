"""Tensors with a negative or conjugate bit (``x.conj().imag``, ``x.conj()``) step as their
values on every backend: read resolved, and written in place through a resolved copy that
is copied back (``vega.codegen.tensors``)."""
import pytest
import torch

import vega
from vega import codegen
from vega.codegen import c as c_backend
from vega.codegen import native

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="needs a C compiler")

# the backends that read memory at addresses (Triton's interpreter where there is no GPU),
# and the reference, which steps through torch's operations
BACKENDS = ["c", "reference", *(["triton"] if "triton" in codegen.BACKENDS else [])]


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- negative and conjugate bits ----------------------------------------------------------

def _neg(x: torch.Tensor) -> torch.Tensor:
    """A tensor whose values are ``x``'s, stored negated (its negative bit set)."""
    out = torch._neg_view(-x)
    assert out.is_neg() and torch.equal(out, x)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("which", ["params", "grads", "state"])
def test_a_negative_bit_is_read_and_written_as_the_values(backend, donate, which):
    p, g = _rand(7, seed=1), _rand(7, seed=2)
    state = vega.adamw.init({"w": p})
    state["mu"]["w"] = _rand(7, seed=3) * 0.1
    plain = {"w": p.clone()}, {"w": g.clone()}, {
        "mu": {"w": state["mu"]["w"].clone()}, "nu": {"w": state["nu"]["w"].clone()},
        "step": state["step"].clone()}
    params, grads = {"w": p.clone()}, {"w": g.clone()}
    if which == "params":
        params = {"w": _neg(p)}
    elif which == "grads":
        grads = {"w": _neg(g)}
    else:
        state["mu"]["w"] = _neg(state["mu"]["w"])
    want_p, want_s = vega.adamw.step(*plain, backend=backend, donate=donate)
    got_p, got_s = vega.adamw.step(params, grads, state, backend=backend, donate=donate)
    assert torch.equal(got_p["w"], want_p["w"])
    assert torch.equal(got_s["mu"]["w"], want_s["mu"]["w"])
    if donate and which == "params":  # written in place into the negated view
        assert got_p["w"] is params["w"] and params["w"].is_neg()


def test_the_imaginary_part_of_a_conjugate_steps_as_its_values():
    """``z.conj().imag`` holds -3 (its negative bit set), which the C kernel read as +3."""
    z = torch.tensor([2 + 3j])
    w = z.conj().imag
    assert w.is_neg() and w.is_contiguous()
    g = torch.tensor([0.5])
    for donate in (False, True):
        want, _ = vega.sgd.step({"w": torch.tensor([-3.0])}, {"w": g},
                                vega.sgd.init({"w": w}), lr=0.1, donate=donate)
        got, _ = vega.sgd.step({"w": w}, {"w": g}, vega.sgd.init({"w": w}), lr=0.1,
                               donate=donate)
        assert torch.equal(got["w"], want["w"]) and torch.equal(want["w"], torch.tensor([-3.05]))
    assert torch.equal(z, torch.tensor([2 + 3.05j]))  # (stored negated, through the view)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("donate", [False, True])
def test_conjugate_complex_tensors_step_as_their_values(backend, donate):
    z = torch.complex(_rand(5, seed=4), _rand(5, seed=5))
    g = torch.complex(_rand(5, seed=6), _rand(5, seed=7))
    plain = vega.adamw.step({"w": z.conj().resolve_conj()}, {"w": g.conj().resolve_conj()},
                            vega.adamw.init({"w": z}), backend=backend)
    params = {"w": z.clone().conj()}
    got = vega.adamw.step(params, {"w": g.conj()}, vega.adamw.init({"w": z.conj()}),
                          backend=backend, donate=donate)
    assert torch.equal(got[0]["w"], plain[0]["w"])
    assert torch.equal(got[1]["mu"]["w"], plain[1]["mu"]["w"])
    if donate:
        assert got[0]["w"] is params["w"] and params["w"].is_conj()


def test_the_class_steps_negated_gradients_and_states_directly_as_their_values():
    ps = [torch.nn.Parameter(_rand(40, seed=k)) for k in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, twin = vega.adamw.optimizer(ps), vega.adamw.optimizer(qs)
    for step in range(6):
        for k, (p, q) in enumerate(zip(ps, qs)):
            g = _rand(40, seed=100 * step + k)
            p.grad, q.grad = (_neg(g) if k != 1 else g.clone()), g
        if step == 3:  # a state with its negative bit, the plan made already
            opt.state[ps[2]]["mu"] = _neg(opt.state[ps[2]]["mu"].clone())
        opt.step()
        twin.step()
        for p, q in zip(ps, qs):
            assert torch.equal(p, q)
    if native.scanner() is not None:  # (a negated tensor does not go direct: copied)
        assert "_vega_direct" not in opt.__dict__ and "_vega_direct" in twin.__dict__
