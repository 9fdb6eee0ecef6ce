"""A launch's programs run at once on a GPU, in no order a step can count on; Triton's
interpreter runs them one after another, in order. Here every launch's programs run in
reversed and in shuffled order (the interpreter's grid loop renumbered), at a GPU's block
sizes, and each step gives the bits of the ordered run: no program reads what another of its
launch writes but the prelude's last, which adds every program's sums in program order
whichever finishes last; per-tensor reductions are combined in block order by one program a
tensor; no kernel adds floats atomically. So a step on a GPU gives the same bits run after
run (docs/training.md)."""
import contextlib
import random

import pytest
import torch
from triton.runtime import interpreter

import vega
from vega.codegen import triton_runtime

pytestmark = pytest.mark.skipif(not triton_runtime.interpreting(),
                                reason="reorders the programs of Triton's interpreter")


@contextlib.contextmanager
def programs_in(order: str):
    """Within: each launch's programs run in ``order`` ("reversed" or "shuffled"); yields
    the list of the launches' numbers of programs."""
    builder = interpreter.interpreter_builder
    set_dim, set_idx = type(builder).set_grid_dim, type(builder).set_grid_idx
    rng, perm, sizes = random.Random(0), [], []

    def dim(self, nx, ny, nz):
        perm[:] = range(nx)
        sizes.append(nx)
        if order == "reversed":
            perm.reverse()
        else:
            rng.shuffle(perm)
        set_dim(self, nx, ny, nz)

    def idx(self, x, y, z):
        set_idx(self, perm[x], y, z)
    builder.set_grid_dim, builder.set_grid_idx = dim.__get__(builder), idx.__get__(builder)
    try:
        yield sizes
    finally:
        del builder.set_grid_dim, builder.set_grid_idx


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x, key=str) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _functional(name, shapes, **more):
    def run():
        torch.manual_seed(0)
        params = {str(k): torch.randn(s) for k, s in enumerate(shapes)}
        params["b"] = torch.randn(4500).bfloat16()  # (a second dtype group)
        grads = {k: torch.randn_like(p) for k, p in params.items()}
        spec = vega.builtin(name)
        hypers = dict(more)
        state = spec.init(params, state_dtype=hypers.pop("state_dtype", None))
        for _ in range(2):
            spec.step(params, grads, state, backend="triton", donate=True, **hypers)
        return params, state
    return run


def _class_with_a_loss_scale():
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(s)) for s in ((5000,), (70, 90), (300,))]
    ls = vega.LossScale.dynamic(init=2.0**8, growth_interval=1)
    opt = vega.optim.AdamW(ws, lr=1e-2, backend="triton", max_grad_norm=0.5, loss_scale=ls,
                           skip_nonfinite=True)
    for bad in (False, True, False):
        for w in ws:
            w.grad = torch.full_like(w, float("nan")) if bad else torch.randn_like(w) * 256
        opt.step()
    return ws, [opt.state[w] for w in ws], ls.tensors()


FUSED = dict(max_grad_norm=0.5, skip_nonfinite=True)
STEPS = {
    "adamw, clip + skip": _functional("adamw", ((5000,), (70, 90), (300,)), **FUSED),
    "adamw, 8-bit state": _functional("adamw", ((5000,), (300,)), state_dtype=torch.uint8,
                                      **FUSED),
    "lamb (per-tensor norms)": _functional("lamb", ((5000,), (70, 90)), **FUSED),
    "novograd (per-tensor states)": _functional("novograd", ((5000,), (70, 90))),
    "adafactor (row and column means)": _functional("adafactor", ((70, 90), (3, 40, 50)),
                                                    **FUSED),
    "the class, a dynamic loss scale": _class_with_a_loss_scale,
}


@pytest.mark.parametrize("what", list(STEPS))
def test_a_step_is_the_same_in_any_order_of_its_programs(what):
    with triton_runtime.gpu_sizes():
        want = _tensors(STEPS[what]())
        for order in ("reversed", "shuffled"):
            with programs_in(order) as sizes:
                got = _tensors(STEPS[what]())
            assert max(sizes) >= 4, sizes  # (launches of several programs, reordered)
            assert len(got) == len(want)
            for k, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype and torch.equal(a, b), (what, order, k)
