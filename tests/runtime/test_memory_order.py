"""A parameter stored densely in another order than its dimensions' (a channels_last
convolution's weight, a transposed one) gets states in its layout, as torch.optim's, and an
element-wise rule steps it, its gradient and states as the memory they are: the same values
as a contiguous copy's step, without copies."""
import pytest
import torch

import vega
import vega.optim
from vega.codegen.c import launch, native


def _pairs(seed: int):
    """(channels_last 4-d, transposed 2-d, contiguous) parameters with gradients of their
    layout, and contiguous twins of the same values."""
    g = torch.Generator().manual_seed(seed)
    cl = torch.randn(6, 5, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
    tr = torch.randn(9, 7, generator=g).t()
    plain = torch.randn(13, generator=g)
    ps = [torch.nn.Parameter(x.clone(memory_format=torch.preserve_format))
          for x in (cl, tr, plain)]
    twins = [torch.nn.Parameter(x.contiguous().clone()) for x in (cl, tr, plain)]
    return ps, twins


def _grads(ps, twins, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(ps, twins):
        grad = torch.randn(q.shape, generator=g)
        q.grad = grad.clone()
        p.grad = torch.empty_like(p).copy_(grad)  # (the parameter's layout, as autograd's)


@pytest.mark.parametrize("backend", ["c", "c without the native module", "triton"])
@pytest.mark.parametrize("name, extra", [("AdamW", {"weight_decay": 0.1}),
                                         ("AdamW", {"amsgrad": True, "maximize": True}),
                                         ("SGD", {"momentum": 0.9}), ("Lion", {}),
                                         ("LAMB", {})])
def test_a_parameter_of_another_layout_steps_as_its_contiguous_twin(name, extra, backend,
                                                                     monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif backend != "c":
        monkeypatch.setattr(native, "module", lambda wait=None: None)
        backend = "c"
    cls = getattr(vega.optim, name)
    ps, twins = _pairs(0)
    opt, twin = cls(ps, backend=backend, **extra), cls(twins, backend=backend, **extra)
    copies = []  # (what the Python path was given that it would copy)
    real = launch.Kernel._python_step
    monkeypatch.setattr(launch.Kernel, "_python_step", lambda self, params, grads, states, *a:
                        copies.extend(t for t in [*params, *grads, *states]
                                      if not t.is_contiguous())
                        or real(self, params, grads, states, *a))
    for t in range(3):
        _grads(ps, twins, t)
        opt.step()
        twin.step()
        for p, q in zip(ps, twins):
            assert torch.equal(p, q)
            for key, value in opt.state[p].items():
                assert torch.equal(value, twin.state[q][key]), key
                if value.shape == p.shape:  # (states like the parameter: in its layout)
                    assert value.stride() == p.stride(), key
    assert not copies  # (the C step took the tensors as they are: no contiguous copies)


def test_a_functional_step_keeps_the_layout():
    """The functional init makes a channels_last parameter's states channels_last, and its
    pure step returns the parameter's new value of the same values as a contiguous one's."""
    ps, twins = _pairs(1)
    _grads(ps, twins, 0)
    state, twin_state = vega.adamw_init([p.detach() for p in ps]), \
        vega.adamw_init([q.detach() for q in twins])
    assert state["mu"][0].stride() == ps[0].stride()
    new, new_state = vega.adamw_step([p.detach() for p in ps], [p.grad for p in ps], state,
                                     backend="c")
    new_twin, new_twin_state = vega.adamw_step([q.detach() for q in twins],
                                               [q.grad for q in twins], twin_state, backend="c")
    assert all(torch.equal(a, b) for a, b in zip(new, new_twin))
    assert all(torch.equal(a, b) for a, b in zip(new_state["nu"], new_twin_state["nu"]))


def test_a_fused_step_reads_such_gradients_as_they_are(monkeypatch):
    """max_grad_norm over gradients stored in another order: the prelude sums them as the
    memory they are (no contiguous copies, which the Python path made at every step), and the
    step clips as its contiguous twin's does."""
    ps, twins = _pairs(2)
    opt = vega.optim.AdamW(ps, backend="c", max_grad_norm=0.5, skip_nonfinite=True)
    twin = vega.optim.AdamW(twins, backend="c", max_grad_norm=0.5, skip_nonfinite=True)
    copied = []
    real = launch.Kernel._prelude
    monkeypatch.setattr(launch.Kernel, "_prelude",
                        lambda self, grads, pre: copied.append(1) or real(self, grads, pre))
    for t in range(3):
        _grads(ps, twins, t)
        opt.step()
        twin.step()
        for p, q in zip(ps, twins):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert not copied


@pytest.mark.parametrize("source", ["contiguous", "torch"])
def test_loaded_states_take_the_parameters_layout(source, monkeypatch):
    """A checkpoint whose states are contiguous (saved before states took their parameter's
    layout) or torch.optim's loads into states in the parameter's layout, which the next
    steps read without copies."""
    ps, twins = _pairs(3)
    _grads(ps, twins, 0)
    if source == "torch":
        saver = torch.optim.AdamW(ps)
    else:
        saver = vega.optim.AdamW(ps, backend="c")
    saver.step()
    sd = saver.state_dict()
    if source == "contiguous":
        sd["state"] = {k: {n: v.contiguous() for n, v in st.items()}
                       for k, st in sd["state"].items()}
    opt = vega.optim.AdamW(ps, backend="c")
    opt.load_state_dict(sd)
    for p in ps:
        for key in ("mu", "nu"):
            assert opt.state[p][key].stride() == p.stride(), key
    copies = []
    real = launch.Kernel._python_step
    monkeypatch.setattr(launch.Kernel, "_python_step",
                        lambda *a: copies.append(1) or real(*a))
    _grads(ps, twins, 1)
    opt.step()
    assert not copies
