"""Two optimizers stepped in two threads at once give bitwise what they give one after the
other: the C kernels run without the GIL, so no table, buffer or record that a launch reads
may be shared between two callers (the prelude's tables are keyed by the gradients' sizes
alone, which two optimizers over equal shapes share)."""
import threading

import pytest
import torch

import vega
from vega.codegen.c import native
from vega.codegen import c as c_backend

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="needs a C compiler")

SHAPES = [(64 + k,) for k in range(120)]  # the same shapes for both: one kernel, one prelude
STEPS = 200


def _grads(seed: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    return [torch.randn(s, generator=gen) * (3 if step % 7 == 0 else 1) for s in SHAPES]


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _class_run():
    def make(seed):
        ps = _params(seed)
        opt = vega.adamw.optimizer(ps, lr=1e-2, max_grad_norm=0.5,
                                   loss_scale=vega.LossScale.dynamic())
        return ps, opt

    def run(seed, made):
        ps, opt = made
        for step in range(STEPS):
            for p, g in zip(ps, _grads(seed, step)):
                p.grad = g * opt.loss_scale.loss_scale
            opt.step()
        return [*ps, opt.loss_scale.skipped_steps]
    return make, run


def _functional_run():
    def make(seed):
        ps = _params(seed)
        return ps, vega.adamw.init(ps)

    def run(seed, made):
        ps, state = made
        scale = vega.LossScale.dynamic()
        for step in range(STEPS):
            gs = [g * scale.loss_scale for g in _grads(seed, step)]
            with torch.no_grad():
                ps, state, scale = vega.adamw.step(ps, gs, state, donate=True, lr=1e-2,
                                                   max_grad_norm=0.5, loss_scale=scale)
        return [*ps, *state["mu"], *state["nu"], state["step"], scale.skipped_steps]
    return make, run


@pytest.mark.parametrize("how", ["class-native", "class-python", "functional"])
def test_two_threads_step_as_one_after_the_other(how, monkeypatch):
    """``class-python``: the C backend's Python path (as where its native operator cannot be
    built), whose address tables are kept between calls."""
    if how == "class-python":
        monkeypatch.setattr(native, "module", lambda wait=None: None)
    make, run = _functional_run() if how == "functional" else _class_run()
    alone = [run(seed, make(seed)) for seed in (1, 2)]
    made = [make(seed) for seed in (1, 2)]
    together: dict = {}
    errors = []

    def worker(seed, m):
        try:
            together[seed] = run(seed, m)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(seed, m)) for seed, m in zip((1, 2), made)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed, want in zip((1, 2), alone):
        got = together[seed]
        assert int(got[-1]) == int(want[-1]) == 0  # no step skipped: every gradient finite
        for a, b in zip(got[:-1], want[:-1]):
            assert torch.equal(a, b)
