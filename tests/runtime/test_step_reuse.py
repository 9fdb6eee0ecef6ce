"""The optimizer classes reuse what a step found (the parameters with gradients, their
state, the programs; the C kernel its address tables) only while none of it changed:
each change below is followed exactly as torch.optim.SGD follows it."""
import copy

import pytest
import torch

import vega
from vega.codegen import c as c_backend

BACKENDS = ["reference"] + (["c"] if c_backend.available() else [])


def _pair(backend):
    gen = torch.Generator().manual_seed(0)
    shapes = [(30,), (4, 5), (), (7,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
            for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = vega.optim.SGD(ours, lr=0.1, momentum=0.9, backend=backend)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
    return ours, theirs, opt, ref


def _grads(ours, theirs, step, skip=()):
    gen = torch.Generator().manual_seed(100 + step)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.grad, q.grad = (None, None) if i in skip else (g, g.clone())


def _same(ours, theirs, opt, ref):
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)
        if "momentum_buffer" in ref.state.get(q, {}):
            torch.testing.assert_close(opt.state[p]["v"], ref.state[q]["momentum_buffer"],
                                       rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_change_between_steps_is_followed(backend):
    ours, theirs, opt, ref = _pair(backend)
    changes = {
        # a parameter without a gradient is not stepped; then it is again
        2: lambda: None,
        # the learning rate changes (a plain number in the group)
        4: lambda: [g.__setitem__("lr", 0.05) for o in (opt, ref) for g in o.param_groups],
        # a state tensor is replaced, in both
        5: lambda: [opt.state[ours[1]].__setitem__("v", torch.full((4, 5), 0.5).double()),
                    ref.state[theirs[1]].__setitem__("momentum_buffer",
                                                     torch.full((4, 5), 0.5).double())],
        # a parameter moves to new memory
        6: lambda: [setattr(ours[0], "data", ours[0].data.clone()),
                    setattr(theirs[0], "data", theirs[0].data.clone())],
        # momentum off (another program, without the buffer), then on again
        7: lambda: [g.__setitem__("momentum", 0.0) for o in (opt, ref) for g in o.param_groups],
        9: lambda: [g.__setitem__("momentum", 0.9) for o in (opt, ref) for g in o.param_groups],
    }
    for step in range(12):
        if step in changes:
            changes[step]()
        _grads(ours, theirs, step, skip={3} if step in (2, 3) else ())
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_params_added_to_a_group_and_a_loaded_state_are_followed(backend):
    ours, theirs, opt, ref = _pair(backend)
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
    # a parameter appended to the group's list, as add_param_group would not do
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    extra_ref = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt.param_groups[0]["params"].append(extra)
    ref.param_groups[0]["params"].append(extra_ref)
    ours.append(extra)
    theirs.append(extra_ref)
    for step in range(3, 5):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)
    # an earlier state loaded back: its tensors, not the ones stepped since
    saved = copy.deepcopy(opt.state_dict())
    saved_ref = copy.deepcopy(ref.state_dict())
    for step in range(5, 7):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
    opt.load_state_dict(saved)
    ref.load_state_dict(saved_ref)
    for step in range(7, 9):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)
