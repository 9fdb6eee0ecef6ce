"""The states a first step or an init makes: a state that starts at a number is made at it
without the rendered ``init_<name>`` (``reference._filled``), with the values, dtype and
strides that function and the copy after it gave; the kernel and the states' dtypes found
once for the parameters of one program and dtype (``engine.init_leaf``'s memo)."""
import pytest
import torch

import vega
from vega import codegen
from vega.codegen import reference
from vega.codegen.tensors import in_memory_order, like_layout

NUMBERS = vega.compile("""
optimizer numbers(lr = 0.1, k = 2.0) {
    state a = 0.1
    state b = -0.0
    state c = 1.0e39
    state d = p
    state e = zeros
    a = a + g
    b = b + g
    c = c + g
    d = d + g
    e = e + k * g
    p = p - lr * (a + b + c + d + e)
}
""")


def rendered(kern, p, values, sds):
    """The states as the rendered ``init_<name>`` functions give them, each copied into a
    tensor of its own (``Kernel.init`` before numbers were filled without them)."""
    cd = reference.compute_dtype(p.dtype)
    pc = p.detach().to(cd)
    hv = kern._hyper_args(values, cd, p.device)
    return [like_layout(fn(pc, *hv).to(sd), p) if in_memory_order(kern.program) else
            fn(pc, *hv).to(sd).clone(memory_format=torch.contiguous_format)
            for fn, sd in zip(kern._inits, sds)]


def bits(x):
    return x.contiguous().reshape(-1).view(torch.uint8)


def params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, generator=g), torch.randn(64, generator=g).to(torch.bfloat16),
            torch.randn(1, 64, generator=g).t(),  # (strides of a size-1 axis not canonical)
            torch.randn(64, 1, generator=g).t(),
            torch.randn(2, 3, 4, 4, generator=g).to(memory_format=torch.channels_last),
            torch.randn(6, 5, generator=g).t(), torch.randn(0, 3, generator=g),
            torch.randn(5, generator=g, dtype=torch.float64)]


@pytest.mark.parametrize("sd", [None, torch.bfloat16, torch.float64])
def test_filled_states_are_what_the_rendered_inits_give(sd):
    program = NUMBERS._spec.program({})
    kern = codegen.kernel("reference", program)
    assert [f is not None for f in kern._fills] == [True, True, False, False, True]
    values = {"lr": 0.1, "k": 2.0}
    for p in params():
        sds = [reference.compute_dtype(p.dtype) if sd is None else sd] * 5
        got, want = kern.init(p, values, sds), rendered(kern, p, values, sds)
        for name, x, y in zip(program.state_names, got, want):
            assert (x.dtype, x.shape, x.stride()) == (y.dtype, y.shape, y.stride()), name
            assert torch.equal(bits(x), bits(y)), name
            assert not p.numel() or \
                x.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()


def test_a_group_of_several_dtypes_and_programs_gets_each_parameters_states():
    """One group's first step over parameters of three dtypes and of both of Adafactor's
    programs (factored or not, by the shape), mixed: each parameter's states are those it
    gets stepped alone (the memo of ``engine.init_leaf`` keyed by program and dtype)."""
    g = torch.Generator().manual_seed(1)
    shapes = [(7,), (130, 140), (130, 140), (7,), (5,), (130, 150)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.bfloat16,
              torch.bfloat16]

    def made():
        ps = [torch.randn(s, generator=g).to(d).requires_grad_() for s, d in zip(shapes, dtypes)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        return ps

    ps = made()
    alone = [p.detach().clone().requires_grad_() for p in ps]
    for a, p in zip(alone, ps):
        a.grad = p.grad.clone()
    opt = vega.optim.Adafactor(ps)
    opt.step()
    for a, p in zip(alone, ps):
        one = vega.optim.Adafactor([a])
        one.step()
        want, got = one.state[a], opt.state[p]
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert torch.equal(got[name], want[name]), name
    assert {opt.state[p]["v_row"].dtype for p in ps[1:3]} == {torch.float32, torch.float64}
    states = vega.adafactor_init({str(i): p.detach() for i, p in enumerate(made())})
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        name = "v" if len(s) == 1 else "v_row"
        assert states[name][str(i)].dtype == (torch.float32 if d == torch.bfloat16 else d)
