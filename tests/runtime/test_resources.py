"""What a program that makes and drops many optimizers and steps keeps: nothing of theirs
once they are gone, and no cache that grows with the values it has seen."""
import gc
import weakref

import pytest
import torch

import vega
from vega.codegen import c as c_backend


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def test_a_search_over_max_grad_norm_keeps_no_record_per_value():
    """Each step without a loss scale copies a prelude record made once per setting; a
    search that tries many values of ``max_grad_norm`` keeps a bounded number of them."""
    params = {"w": torch.ones(4)}
    grads = {"w": torch.ones(4)}
    state = vega.sgd_init(params)

    def trial(n: int) -> None:
        vega.sgd_step(params, grads, state, lr=0.5, max_grad_norm=1.0 + n, backend="reference")

    trial(0)
    before = live_tensors()
    for n in range(1, 201):
        trial(n)
    assert live_tensors() - before < 50


def _stepped_states(backend: str):
    params = [torch.nn.Parameter(torch.randn(50)) for _ in range(3)]
    opt = vega.optim.AdamW(params, lr=1e-3, backend=backend)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return params, opt, [weakref.ref(t) for p in params for t in opt.state[p].values()]


@pytest.mark.parametrize("how", ["clear", "del", "pop", "popitem", "replace", "update", "ior"])
@pytest.mark.parametrize("backend", ["reference", "c"])
def test_state_dicts_removed_from_an_optimizer_are_freed(backend, how):
    """A state dict removed from ``opt.state`` (to free its memory, or to reset a parameter)
    is not kept alive by what the last step planned: its tensors go with it, as with
    torch.optim."""
    if backend == "c" and not c_backend.available():
        pytest.skip("no C compiler")
    params, opt, refs = _stepped_states(backend)
    if how == "clear":
        opt.state.clear()
    for p in params:
        if how == "del":
            del opt.state[p]
        elif how == "pop":
            opt.state.pop(p)
        elif how == "popitem":
            opt.state.popitem()
        elif how == "replace":
            opt.state[p] = {}
        elif how == "update":
            opt.state.update({p: {}})
        elif how == "ior":
            opt.state |= {p: {}}
    gc.collect()
    assert [r() for r in refs if r() is not None] == []
    for p in params:  # and the next step starts them again
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(int(opt.state[p]["step"]) == 1 for p in params)


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError, RuntimeError])
def test_a_first_step_interrupted_before_it_writes_leaves_no_state(error):
    """A first step stopped before it writes (a ^C in a schedule, memory running out while
    a later group's state is made) keeps none of the states it made for the earlier groups,
    as a refused step does; the step tried again is the first."""
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    calls = []

    def lr(count):
        calls.append(count)
        if len(calls) == 1:
            raise error("stopped")
        return 0.5

    opt = vega.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": lr}], lr=0.5,
                         backend="reference")
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(error):
        opt.step()
    assert len(opt.state) == 0
    assert [p.tolist() for p in params] == [[1.0] * 4, [1.0] * 3]
    opt.step()
    assert [p.tolist() for p in params] == [[0.5] * 4, [0.5] * 3]
    assert [int(opt.state[p]["step"]) for p in params] == [1, 1]


def test_init_without_state_makes_no_copy_of_a_parameter():
    """A program with no state (``p = p - lr * g``; SGD without momentum in vega.optim)
    makes none at init, and no tensor the size of a parameter either: the float32 copy of
    a bfloat16 parameter it made before was 8 GB for one of 2**31 values."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.made = max(Largest.made, t.numel())
            return out

    spec = vega.compile("optimizer plain(lr = 0.1) {\n    p = p - lr * g\n}\n")
    params = {"w": torch.ones(100_000, dtype=torch.bfloat16), "b": torch.ones(7)}
    with Largest():
        state = spec.init(params)
    assert list(state) == ["step"] and Largest.made < 100
