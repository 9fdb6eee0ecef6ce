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

    def steps(ks, compare=True):
        for k in ks:
            _grads(ours, theirs, k)
            opt.step()
            ref.step()
            if compare:
                _same(ours, theirs, opt, ref)

    steps(range(3))
    # a parameter appended to the group's list, as add_param_group would not do
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    extra_ref = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt.param_groups[0]["params"].append(extra)
    ref.param_groups[0]["params"].append(extra_ref)
    ours.append(extra)
    theirs.append(extra_ref)
    steps(range(3, 5))
    # an earlier state loaded back: its tensors, not the ones stepped since
    saved = copy.deepcopy(opt.state_dict())
    saved_ref = copy.deepcopy(ref.state_dict())
    steps(range(5, 7), compare=False)
    opt.load_state_dict(saved)
    ref.load_state_dict(saved_ref)
    steps(range(7, 9))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shape_change_that_picks_another_program_is_refused(backend):
    """adafactor factors a matrix, not a vector: a parameter viewed as a matrix after a
    step needs other state, and the step says so, naming the parameter and its new shape,
    rather than stepping the old program (nothing written: the other parameter neither)."""
    q = torch.nn.Parameter(torch.randn(5))
    p = torch.nn.Parameter(torch.randn(12))
    q.grad, p.grad = torch.randn(5), torch.randn(12)
    opt = vega.optim.Adafactor([q, p], min_dim_size_to_factor=2.0, backend=backend)
    opt.step()
    p.data = p.data.view(4, 3)
    p.grad = torch.randn(4, 3)
    was = q.detach().clone()
    with pytest.raises(ValueError, match=r"^Adafactor: the state of parameter 1 of group 0 has "
                                         r"\['step', 'v'\] but the group's settings need "
                                         r"\['step', 'v_col', 'v_row'\]; .*or the parameter's "
                                         r"shape \(now \(4, 3\)\) changed after the first "
                                         r"step\?"):
        opt.step()
    assert torch.equal(q.detach(), was)


def test_a_loaded_state_leaves_nothing_of_the_old_one_alive():
    import gc
    import weakref
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    opt = vega.optim.Adam([p])
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    old = weakref.ref(opt.state[p]["mu"])
    for _ in range(3):
        opt.load_state_dict(saved)
        opt.step()
    gc.collect()
    assert old() is None


def test_a_copied_optimizer_keeps_its_fused_settings():
    p = torch.nn.Parameter(torch.randn(10))
    opt = vega.optim.AdamW([p], lr=1e-2, max_grad_norm=0.5, skip_nonfinite=True,
                           loss_scale=vega.LossScale.dynamic(init=8.0))
    p.grad = torch.randn(10)
    opt.step()
    twin = copy.deepcopy(opt)
    assert (twin.max_grad_norm, twin.skip_nonfinite) == (0.5, True)
    assert torch.equal(twin.loss_scale.loss_scale, opt.loss_scale.loss_scale)
    twin_p = twin.param_groups[0]["params"][0]
    g = torch.randn(10) * 8.0
    p.grad, twin_p.grad = g, g.clone()
    opt.step()
    twin.step()
    assert torch.equal(p, twin_p)


def test_a_schedule_subclass_with_its_own_call_is_called_per_counter():
    class Steps(vega.schedule.Schedule):
        def __call__(self, step):  # reads its one step back: not elementwise
            return torch.tensor(0.1 if int(step) < 1 else 0.01)

    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = vega.optim.SGD(ps, lr=Steps(), backend="reference")
    for _ in range(2):
        for p in ps:
            p.grad = torch.ones(3)
        opt.step()
    torch.testing.assert_close(ps[1].detach(), torch.full((3,), 1 - 0.1 - 0.01))


def test_a_cycled_momentum_keeps_the_plan(monkeypatch):
    """OneCycleLR cycles momentum: while it stays positive the program is the same, and
    the step reuses its plan."""
    made = []
    real = vega.optim.SGD._group_work
    monkeypatch.setattr(vega.optim.SGD, "_group_work",
                        lambda self, *a: made.append(1) or real(self, *a))
    ps = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    qs = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    opt = vega.optim.SGD(ps, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    for k in range(6):
        for o in (opt, ref):
            o.param_groups[0]["momentum"] = 0.85 + 0.01 * k
        for p, q in zip(ps, qs):
            p.grad, q.grad = torch.full((4,), float(k)), torch.full((4,), float(k))
        opt.step()
        ref.step()
    assert len(made) == 1
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach())


def test_a_schedule_with_a_python_if_in_its_formula_still_steps():
    """A subclass whose _at reads its step with a Python if cannot take all the counters
    at once: it is called once per counter instead."""
    class Halving(vega.schedule.Schedule):
        def _at(self, k, ops):
            return 0.1 if k < 1 else 0.05

    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = vega.optim.SGD(ps, lr=Halving())
    for _ in range(2):
        for p in ps:
            p.grad = torch.ones(3)
        opt.step()
    torch.testing.assert_close(ps[1].detach(), torch.full((3,), 1 - 0.1 - 0.05))


def _copied(st: dict) -> dict:
    return {k: v.clone() for k, v in st.items()}


# each way of giving a parameter another state dict between two steps (the new dict holds
# copies of the old one's tensors: a step that wrote the old dict leaves the new one behind)
REPLACED = {
    "set": lambda state, p: state.__setitem__(p, _copied(state[p])),
    "update": lambda state, p: state.update({p: _copied(state[p])}),
    "|=": lambda state, p: state.__ior__({p: _copied(state[p])}),
    "setdefault after pop": lambda state, p: state.setdefault(p, _copied(state.pop(p))),
    "popitem and set": lambda state, p: [state.__setitem__(k, _copied(v)) for k, v in
                                         [state.popitem() for _ in range(len(state))]],
    "clear and update": lambda state, p: _renewed(state),
    "deleted": lambda state, p: state.__delitem__(p),
}


def _renewed(state) -> None:
    old = dict(state)
    state.clear()
    state.update({k: _copied(v) for k, v in old.items()})


@pytest.mark.parametrize("how", REPLACED)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_dict_given_anew_is_the_one_stepped(backend, how):
    """The step reuses the state dicts it found while nothing has given a parameter another
    one (the optimizer's ``state`` counts such changes): each way of doing so is followed as
    torch.optim.SGD follows it, and the new dict's tensors are the ones written."""
    ours, theirs, opt, ref = _pair(backend)
    for step in range(6):
        if step == 3:
            REPLACED[how](opt.state, ours[1])
            REPLACED[how](ref.state, theirs[1])
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_replaced_or_copied_state_is_the_one_stepped(backend):
    """``opt.state`` replaced as a whole (a plain defaultdict), and the optimizer copied
    (its state is copied with it): each steps its own tensors."""
    import collections
    ours, theirs, opt, ref = _pair(backend)
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
    opt.state = collections.defaultdict(dict, {k: _copied(v) for k, v in opt.state.items()})
    ref.state = collections.defaultdict(dict, {k: _copied(v) for k, v in ref.state.items()})
    for step in range(3, 5):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)
    twin = copy.deepcopy(opt)
    twin_ps = twin.param_groups[0]["params"]
    for step in range(5, 7):
        _grads(ours, theirs, step)
        for p, q in zip(twin_ps, ours):
            p.grad = q.grad.clone()
        opt.step()
        twin.step()
        ref.step()
        _same(ours, theirs, opt, ref)
        _same(twin_ps, theirs, twin, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_later_step_refuses_what_a_first_step_refuses(backend):
    """From the second step on the class gathers a group in one pass: a sparse gradient, or
    one of a subclass the backend cannot read, is still refused, before anything is
    written; the step after it, with plain gradients, is torch's."""
    from torch.testing._internal.two_tensor import TwoTensor
    ours, theirs, opt, ref = _pair(backend)
    for step in range(2):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
    before = [p.detach().clone() for p in ours]
    bad = {"sparse": lambda g: g.to_sparse()}
    if backend != "reference":
        bad["subclass"] = lambda g: TwoTensor(g, g.clone())
    for what, make in bad.items():
        _grads(ours, theirs, 2)
        ours[1].grad = make(ours[1].grad)
        with pytest.raises(ValueError, match="sparse" if what == "sparse" else "TwoTensor"):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ours, before))
    for step in range(2, 5):
        _grads(ours, theirs, step)
        opt.step()
        ref.step()
        _same(ours, theirs, opt, ref)


def test_a_later_subclass_gradient_steps_on_the_reference():
    """A group that names no backend steps a tensor subclass on the reference, from the
    second step on too."""
    from torch.testing._internal.two_tensor import TwoTensor
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = vega.optim.SGD([p], lr=0.25)
    for step in range(3):
        g = torch.ones(3, dtype=torch.float64)
        p.grad = TwoTensor(g, g.clone()) if step == 2 else g
        opt.step()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_parameter_and_two_programs_keep_the_one_pass_gather(backend, monkeypatch):
    """A parameter without a gradient, and programs that read different states
    (Muon's matrices, its other parameters: AdamW), step from the second step on through
    one gather a program, and equal a twin that finds its work anew every step."""
    from vega.runtime import optimizer as optimizer_module
    calls = []
    real = optimizer_module.gather
    monkeypatch.setattr(optimizer_module, "gather",
                        lambda *a: calls.append(len(a[0])) or real(*a))
    gen = torch.Generator().manual_seed(0)
    shapes = [(4, 5), (7,), (3,), (6, 2)]  # (3,): frozen
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
            for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = vega.optim.Muon(ours, backend=backend)
    twin = vega.optim.Muon(theirs, backend=backend)
    for step in range(6):
        for i, (p, q) in enumerate(zip(ours, theirs)):  # (the frozen one thaws at step 3)
            p.grad = None if i == 2 and step != 3 else \
                torch.randn(p.shape, generator=gen, dtype=torch.float64)
            q.grad = None if p.grad is None else p.grad.clone()
        calls.clear()
        opt.step()
        twin.__dict__.pop("_vega_plans", None)  # (the twin finds its work anew)
        twin.step()
        # (step 3 finds the thawed one and step 4 the missing gradient after gathering:
        # both then find their work anew)
        assert sorted(calls) == ([] if step == 0 else [2, 2] if step == 4 else [1, 2]), step
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
            assert opt.state.get(p, {}).keys() == twin.state.get(q, {}).keys()
            for name, x in opt.state.get(p, {}).items():
                assert torch.equal(x, twin.state[q][name]), name


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_bool_hyperparameter_changed_between_steps_picks_its_program(backend):
    """A group's bool hyperparameter (LARS's nesterov, which no value condition reads)
    changed after a step picks the program it selects at the next step, as the functional
    step with the same values does: the step's remembered plan is of the old program."""
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    opt = vega.optim.LARS([w], lr=0.1, backend=backend)
    params = {"w": w.detach().clone()}
    state = vega.lars_init(params)
    for k, nesterov in enumerate((False, True, True, False)):
        g = torch.tensor([[0.5, 1.0], [-1.5, 0.25]]) * (k + 1)
        opt.param_groups[0]["nesterov"] = nesterov
        w.grad = g.clone()
        opt.step()
        params, state = vega.lars_step(params, {"w": g}, state, lr=0.1, nesterov=nesterov,
                                       backend=backend)
        assert torch.equal(w.detach(), params["w"]), k
