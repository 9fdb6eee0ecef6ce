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


def _in_threads(fn, keys, deadline: float = 120.0) -> dict:
    """``{key: fn(key)}``, each call in a thread of its own, all at once; a call's error is
    raised here, and a thread still running at the deadline fails the test (never a hang)."""
    got: dict = {}
    errors = []

    def worker(key):
        try:
            got[key] = fn(key)
        except BaseException as e:  # noqa: BLE001 (raised below)
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline)
    assert not any(t.is_alive() for t in threads), f"a thread ran past {deadline} s"
    assert not errors, errors
    return got


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
    made = {seed: make(seed) for seed in (1, 2)}
    together = _in_threads(lambda seed: run(seed, made[seed]), (1, 2))
    for seed, want in zip((1, 2), alone):
        got = together[seed]
        assert int(got[-1]) == int(want[-1]) == 0  # no step skipped: every gradient finite
        for a, b in zip(got[:-1], want[:-1]):
            assert torch.equal(a, b)


def test_a_program_first_made_by_two_threads_at_once_is_one(monkeypatch):
    """Two threads that make a spec's stochastically rounded program at the same moment
    both step with the one kept first: each tensor draws its rounding bits by its position
    in its program's call, and a thread that took its own for its first tensor and the
    other thread's for the rest split its step in two calls, whose bits were not those of
    the same step alone (nor reproducible). The moment is forced: B has looked for the
    program and not found it, A makes it, keeps it and steps its first tensor, then B keeps
    its own, before A looks for the program of its second tensor."""
    from vega.codegen import precision
    from vega.runtime.library import _dir
    text = _dir().joinpath("adamw.vega").read_text()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(33, generator=gen).to(torch.bfloat16) for _ in range(4)]
    grads = [torch.randn(33, generator=gen).to(torch.bfloat16) for _ in range(4)]

    def step(spec):
        state = spec.init(params)
        new, _ = spec.step(params, grads, state, lr=0.1, stochastic_rounding=True,
                           rounding_seed=5)
        return new
    alone = step(vega.compile(text))
    spec = vega.compile(text)  # (nothing made yet)
    b_missed, a_kept, b_kept = threading.Event(), threading.Event(), threading.Event()
    made, variant = precision.Program, precision.variant
    names: dict = {}

    def program(*args):  # B, having found no program, waits for A to keep its own
        if names.get(threading.get_ident()) == "B" and not b_missed.is_set():
            b_missed.set()
            assert a_kept.wait(10)
        return made(*args)

    calls = []

    def looked(program_, master, seed):
        who = names.get(threading.get_ident())
        if who == "A":
            calls.append(1)
            if len(calls) == 1:
                assert b_missed.wait(10)
            elif len(calls) == 2:
                assert b_kept.wait(10)
        out = variant(program_, master, seed)
        if who == "A" and len(calls) == 1:
            a_kept.set()
        if who == "B":
            b_kept.set()
        return out
    monkeypatch.setattr(precision, "Program", program)
    monkeypatch.setattr(precision, "variant", looked)

    def named(name):
        names[threading.get_ident()] = name
        return step(spec)
    got = _in_threads(named, ("B", "A"), 60)
    assert len(calls) >= 2  # (the moment came)
    for name in ("A", "B"):
        for a, b in zip(got[name], alone):
            assert torch.equal(a, b), name


def test_a_spec_lowered_by_two_threads_at_once_keeps_one_program(monkeypatch):
    """A program lowered by two threads at once is the one kept first for both: another
    thread lowers it and keeps it while this one lowers it too (forced: within this one's
    lowering). Programs are told apart by identity: two would split a step's tensors in two
    calls (``test_a_program_first_made_by_two_threads_at_once_is_one``)."""
    import vega.dsl as dsl
    spec = vega.compile("optimizer o(lr = 0.1) {\n    p = p - lr * g\n}")._spec
    lower, inner = dsl.lower, []

    def lowering(*args):
        if not inner:
            inner.append(None)
            inner[0] = spec.program({})  # (the other thread, at this moment)
        return lower(*args)
    monkeypatch.setattr(dsl, "lower", lowering)
    outer = spec.program({})
    assert outer is inner[0] is spec.program({})


def test_an_8bit_program_made_by_two_threads_at_once_is_one(monkeypatch):
    """As for a program lowered: the 8-bit variant another thread made and kept while this
    one made it too (forced: within this one's making) is the one both take."""
    from vega.codegen import quant
    program = vega.compile("optimizer o(lr = 0.1) {\n    state mu = zeros\n"
                           "    mu = 0.9 * mu + g\n    p = p - lr * mu\n}")._spec.program({})
    made, inner = quant.Program, []

    def making(*args):
        if not inner:
            inner.append(None)
            inner[0] = quant.variant(program, frozenset({"mu"}))  # (the other thread)
        return made(*args)
    monkeypatch.setattr(quant, "Program", making)
    outer = quant.variant(program, frozenset({"mu"}))
    assert outer is inner[0] is quant.variant(program, frozenset({"mu"}))


def test_two_threads_step_on_triton_interpreted_as_one_after_the_other():
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``) patches triton.language while it runs
    a kernel: a second thread's launch at that moment failed ("Did you forget to add
    @triton.jit ?", "x >= grid_dim[0]") or ran with the other's patches; the backend's
    interpreted launches run one at a time."""
    from vega import codegen
    from vega.codegen import triton_runtime
    if "triton" not in codegen.BACKENDS or not triton_runtime.library_interpreted():
        pytest.skip("needs triton, imported with TRITON_INTERPRET=1")
    shapes = [(1000 + 37 * k,) for k in range(3)]

    def run(seed, spec):
        gen = torch.Generator().manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = spec.optimizer(ps, backend="triton", max_grad_norm=0.5)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return ps
    specs = (vega.adamw, vega.lion)
    alone = [run(seed, spec) for seed, spec in enumerate(specs)]
    together = _in_threads(lambda seed: run(seed, specs[seed]), range(len(specs)))
    for seed, want in enumerate(alone):
        for a, b in zip(together[seed], want):
            assert torch.equal(a, b)
