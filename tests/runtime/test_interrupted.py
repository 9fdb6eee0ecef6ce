"""A KeyboardInterrupt (or any exception) that arrives part way through a call that changes
an optimizer leaves it either as it was or as the call makes it, never half changed. An
interrupt is simulated at each line of a function (``sys.settrace``), one run for each."""
import copy
import sys

import pytest
import torch

import vega
import vega.optim
from vega.runtime.optimizer import SpecOptimizer, _States


class _Interrupt(KeyboardInterrupt):
    pass


def _interrupted(code, k: int, call) -> bool:
    """``call()`` with a KeyboardInterrupt raised at the ``k``-th line run in ``code`` (the
    lines of that function itself, not of what it calls); whether it was raised."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == k:
                raise _Interrupt
        return local

    def first(frame, event, arg):
        return local if frame.f_code is code else None

    sys.settrace(first)
    try:
        call()
    except _Interrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _snapshot(params, opt) -> list:
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [(k, v.clone()) for k, v in sorted(opt.state[p].items())]
    return out + ([] if opt.loss_scale is None else [t.clone() for t in opt.loss_scale.tensors()])


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and torch.equal(x[1], y[1]) if isinstance(x, tuple) else torch.equal(x, y)
        for x, y in zip(a, b))


def _adam(seed: int, steps: int):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(4, 3, generator=gen).requires_grad_(), torch.randn(5, generator=gen)
              .requires_grad_()]
    opt = vega.optim.Adam(params, lr=1e-2,
                          loss_scale=vega.LossScale.dynamic(2.0**4, growth_interval=1))
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def test_a_load_interrupted_at_any_line_loads_all_or_nothing():
    """The loss scale's tensors were copied after the state was taken, outside what an
    interrupted load puts back: one interrupted between the two kept the loaded state with
    the scale (and its counters) of before."""
    _, saved_from = _adam(1, 3)
    saved = copy.deepcopy(saved_from.state_dict())
    params, opt = _adam(0, 2)
    before = _snapshot(params, opt)
    opt.load_state_dict(copy.deepcopy(saved))
    loaded = _snapshot(params, opt)
    assert not _same(before, loaded)
    code = SpecOptimizer._load_state_dict.__code__
    k = 0
    while True:
        k += 1
        params, opt = _adam(0, 2)
        if not _interrupted(code, k, lambda: opt.load_state_dict(copy.deepcopy(saved))):
            break
        now = _snapshot(params, opt)
        assert _same(now, before) or _same(now, loaded), f"interrupted at line {k}"
        # (the state counts the changes of its dicts, which the step's plans read: torch's
        # plain defaultdict, left by an interrupt after the try, counted none)
        assert type(opt.state) is _States, f"interrupted at line {k}"
    assert k > 5


def _hooked():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    opt = vega.optim.Adam([w])
    opt.step()
    opt.register_load_state_dict_pre_hook(lambda o, sd: None)
    opt.register_load_state_dict_post_hook(lambda o: None)
    opt.register_state_dict_pre_hook(lambda o: None)
    opt.register_state_dict_post_hook(lambda o, sd: None)
    return opt


def _hooks(opt) -> list[int]:
    return [len(opt._optimizer_load_state_dict_pre_hooks),
            len(opt._optimizer_load_state_dict_post_hooks),
            len(opt._optimizer_state_dict_pre_hooks), len(opt._optimizer_state_dict_post_hooks)]


def test_a_load_or_save_interrupted_before_it_ran_keeps_the_hooks():
    """``load_state_dict`` and ``state_dict`` hold torch's hooks off while vega's own loading
    (saving) runs, by setting their dicts empty and back: an interrupt after the first was
    emptied and before the try that puts them back lost the hooks (silently: a checkpoint
    migration hook no longer ran)."""
    from vega.runtime import torch_names
    saved = _hooked().state_dict()
    for outer, inner, call in (
            (torch_names.loading, "_load_state_dict",
             lambda o: o.load_state_dict(copy.deepcopy(saved))),
            (torch_names.saving, "_state_dict", lambda o: o.state_dict())):
        k = 0
        while True:
            k += 1
            opt = _hooked()
            ran = []
            own = getattr(opt, inner)
            setattr(opt, inner, lambda *a, own=own: (ran.append(1), own(*a))[1])
            if not _interrupted(outer.__code__, k, lambda: call(opt)):
                break
            if not ran:  # (interrupted before vega's own part ran)
                assert _hooks(opt) == [1, 1, 1, 1], (outer.__name__, k)
        assert k > 3


def _prodigy():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, generator=gen).requires_grad_() for _ in range(2))
    opt = vega.optim.Prodigy([a, b], lr=1.0)
    for _ in range(3):  # (b has no gradient yet: its state is made later)
        a.grad = torch.randn(4, generator=gen)
        opt.step()
    a.grad, b.grad = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    return (a, b), opt


def test_a_first_state_interrupted_as_it_is_made_is_dropped():
    """A parameter's first state takes its group's values (Prodigy's d and step counter,
    from the parameters that have stepped): an interrupt after the state was set but before
    it took them, or before it was noted as made in this step, kept it with the values of
    a first state (step 0, the initial d), which the next step then stepped from."""
    params, opt = _prodigy()
    opt.step()
    want = _snapshot(params, opt)
    code = SpecOptimizer._group_work.__code__
    k = 0
    while True:
        k += 1
        params, opt = _prodigy()
        grads = [p.grad for p in params]
        if not _interrupted(code, k, opt.step):
            break
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()  # (again, whole)
        assert _same(_snapshot(params, opt), want), f"interrupted at line {k}"
    assert k > 5


def test_an_lbfgs_first_step_interrupted_as_a_state_is_made_steps_again():
    """LBFGS made a parameter's state one entry at a time, and makes it where
    ``diff_params`` is missing: one interrupted after that entry lacked the others, and
    every later step refused it ("state leaf 'diff_updates' is missing")."""
    from vega.runtime.lbfgs import LBFGS

    def make():
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(3, generator=gen).requires_grad_() for _ in range(2)]
        for p in params:
            p.grad = torch.randn(3, generator=gen)
        return params, vega.optim.LBFGS(params, lr=0.1)

    params, opt = make()
    opt.step()
    want = [p.detach().clone() for p in params]
    code = LBFGS._param_state.__code__
    k = 0
    while True:
        k += 1
        params, opt = make()
        if not _interrupted(code, k, opt.step):
            break
        opt.step()
        assert all(torch.equal(p, w) for p, w in zip(params, want)), f"interrupted at {k}"
    assert k > 2



@pytest.mark.parametrize("where", ["keep", "involved"])
def test_a_first_step_interrupted_before_it_writes_keeps_no_state(where, monkeypatch):
    """What the step called between its check of every group and the try around its
    kernels (the groups' tuples kept, whether a tensor is sharded) was in neither try that
    drops the states a refused first step made: an interrupt there kept them (the
    parameters unchanged, each with a state at step 0)."""
    from vega.runtime import sharded, torch_names
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, generator=gen).requires_grad_() for _ in range(2)]
    for p in params:
        p.grad = torch.randn(4, generator=gen)
    opt = vega.optim.Adam([{"params": params[:1]}, {"params": params[1:], "lr": 0.1}],
                          lr=0.01)
    before = [p.detach().clone() for p in params]

    def interrupt(*args, **kwargs):
        raise _Interrupt

    monkeypatch.setattr(*(torch_names.TupleSync, "keep") if where == "keep" else
                        (sharded, "involved"), interrupt)
    with pytest.raises(_Interrupt):
        opt.step()
    assert not any(opt.state.get(p) for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_a_first_step_its_kernel_refuses_leaves_no_state():
    """A first step of one call on the C backend, whose kernel checks its own tensors (here
    a gradient that is its parameter's memory), refuses it before writing anything, and the
    state that step made is dropped: the next step starts from no state, as a step refused
    earlier does."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = vega.optim.AdamW([p], lr=0.1, backend="c")
    p.grad = p.data
    with pytest.raises(ValueError, match=r"shares memory with parameter 0 of group 0"):
        opt.step()
    assert not opt.state and torch.equal(p.detach(), torch.ones(3))
