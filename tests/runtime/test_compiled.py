"""Compiled training steps, and steps that allocate nothing.

A whole functional training step -- ``torch.func.grad_and_value`` over
``torch.func.functional_call``, then ``vega.adamw_step`` with a learning rate
computed from the step tensor and a dynamic loss scale -- compiles under
``torch.compile(fullgraph=True)`` once and replays as the rate and the scale
change. A donated step on the C backend allocates no parameter- or state-sized
tensor.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.profiler import ProfilerActivity, profile

import vega
from vega.codegen import c as c_backend

needs_c = pytest.mark.skipif(not c_backend.available(), reason="no C compiler: no C backend")
# The C kernels are ctypes calls, which dynamo cannot trace: a compiled step goes through
# the torch custom ops vega::c_prelude and vega::c_step.
BACKENDS = ["reference", pytest.param("c", marks=[needs_c]), "triton"]


def schedule(step):
    return 1e-3 * 0.9 ** step.float()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_training_step(model, backend, donate=False):
    """A step over (params, optimizer state, loss scale): the loss is scaled, and the
    vega step unscales, clips and adjusts the scale, fused."""
    def loss_fn(params, x, y, ls):
        loss = (torch.func.functional_call(model, params, (x,)) - y).square().mean()
        return ls.scale(loss), loss

    def train_step(params, state, ls, x, y):
        grads, (_, loss) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y, ls)
        params, state, ls = vega.adamw_step(params, grads, state, lr=schedule,
                                            weight_decay=0.01, max_grad_norm=1.0,
                                            loss_scale=ls, backend=backend, donate=donate)
        return params, state, ls, loss
    return train_step


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen))
            for _ in range(n)]


def fresh(model):
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return params, vega.adamw_init(params), vega.LossScale.dynamic(2.0**10, growth_interval=3)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_step_compiles_once_as_the_rate_changes(backend, donate):
    torch._dynamo.reset()
    model = make_model()
    step = make_training_step(model, backend, donate)
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    eager_p, eager_s, eager_ls = fresh(model)
    comp_p, comp_s, comp_ls = fresh(model)
    rates = []
    for x, y in batches(10):
        rates.append(float(schedule(comp_s["step"])))
        eager_p, eager_s, eager_ls, eager_loss = step(eager_p, eager_s, eager_ls, x, y)
        comp_p, comp_s, comp_ls, comp_loss = compiled(comp_p, comp_s, comp_ls, x, y)
        torch.testing.assert_close(comp_loss, eager_loss, rtol=1e-6, atol=0)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    assert len(set(rates)) == 10  # the rate did change at every step
    assert float(comp_ls.loss_scale) == float(eager_ls.loss_scale) == 2.0**13  # grew 3 times
    assert comp_s["step"].dtype == torch.int32 and int(comp_s["step"]) == 10
    for k in eager_p:
        torch.testing.assert_close(comp_p[k], eager_p[k], rtol=1e-6, atol=0)
        for field in ("mu", "nu"):
            torch.testing.assert_close(comp_s[field][k], eager_s[field][k], rtol=1e-6, atol=0)


SIGNUM = """
# sign of a momentum average: a spec of this test's own, so no other test built its kernels
optimizer signum(lr = 1e-2 in [0, inf), b = 0.9 in [0, 1)) {
    state m = zeros
    m = b * m + (1 - b) * g
    p = p - lr * sign(m)
}
"""


@pytest.mark.parametrize("lr", [schedule, 1e-2], ids=["schedule", "float"])
# init builds the default backend's kernel; a Triton kernel on CPU tensors (not the default
# there) is built by the first eager step, so this one runs on the CPU's own backends
@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_first_step_may_be_the_compiled_one(backend, lr):
    """No eager step before: the kernel the compiled step needs is built by init, and
    nothing cached during the first compiled step makes the second recompile."""
    torch._dynamo.reset()
    signum = vega.compile(SIGNUM, f"<signum for {backend}, lr {lr}>")
    model = make_model()

    def loss_fn(params, x, y):
        return (torch.func.functional_call(model, params, (x,)) - y).square().mean()

    def train_step(params, state, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        return (*signum.step(params, grads, state, lr=lr, backend=backend), loss)
    counter = CompileCounter()
    compiled = torch.compile(train_step, backend=counter, fullgraph=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = signum.init(params)
    eager_p, eager_s = params, state
    for x, y in batches(3):
        params, state, _ = compiled(params, state, x, y)
    for x, y in batches(3):
        eager_p, eager_s, _ = train_step(eager_p, eager_s, x, y)
    assert counter.frame_count == 1 and int(state["step"]) == 3
    for k in params:
        torch.testing.assert_close(params[k], eager_p[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_step_runs_through_aot_autograd(backend):
    """With functionalization (aot_eager): the C step's in-place custom op is functionalized
    and written back, and the results still match the eager step."""
    torch._dynamo.reset()
    model = make_model()
    step = make_training_step(model, backend, donate=True)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_p, eager_s, eager_ls = fresh(model)
    comp_p, comp_s, comp_ls = fresh(model)
    for x, y in batches(4):
        eager_p, eager_s, eager_ls, _ = step(eager_p, eager_s, eager_ls, x, y)
        comp_p, comp_s, comp_ls, _ = compiled(comp_p, comp_s, comp_ls, x, y)
    assert int(comp_s["step"]) == 4
    for k in eager_p:
        torch.testing.assert_close(comp_p[k], eager_p[k], rtol=1e-6, atol=0)


@needs_c
def test_c_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and functionalization of the C kernels' ops."""
    from vega import codegen
    from vega.codegen.record import make_pre
    kernel = codegen.kernel("c", vega.adamw.program())
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    grads = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    states = [torch.zeros_like(p) for _ in range(2) for p in params]  # mu..., nu...
    steps = [torch.zeros((), dtype=torch.int32)]
    hypers = [torch.tensor([vega.adamw.defaults[h] for h in vega.adamw.program().float_hypers],
                           dtype=torch.float64)]
    pre = make_pre(torch.device("cpu"), None, 1.0, True)
    torch.library.opcheck(torch.ops.vega.c_prelude.default, (kernel.key, grads, pre.clone()))
    torch.library.opcheck(torch.ops.vega.c_step.default,
                          (kernel.key, params, grads, states, steps, [0, 0], hypers, [0, 0], pre))


# -- allocations -------------------------------------------------------------------------

N = 1 << 20  # elements of the large parameter


def big_allocations(fn, threshold):
    """(name, bytes) of each allocation of at least ``threshold`` bytes while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events()
            if e.cpu_memory_usage >= threshold]


def big_problem():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(N, generator=gen), "b": torch.randn(16, generator=gen)}
    grads = {"w": torch.randn(N, generator=gen), "b": torch.randn(16, generator=gen)}
    return params, grads


@needs_c
@pytest.mark.parametrize("fused", [{}, {"max_grad_norm": 1.0, "skip_nonfinite": True}],
                         ids=["plain", "fused"])
def test_donated_c_step_allocates_nothing_parameter_sized(fused):
    params, grads = big_problem()
    state = vega.adamw_init(params)
    w, mu = params["w"], state["mu"]["w"]
    vega.adamw_step(params, grads, state, backend="c", donate=True, **fused)  # build the kernel
    # a pure step allocates new parameters and state: the probe sees it
    pure = big_allocations(lambda: vega.adamw_step(params, grads, state, backend="c", **fused),
                           N * 4)
    assert len(pure) >= 3, pure

    def donated():
        out = vega.adamw_step(params, grads, state, backend="c", donate=True, lr=schedule,
                              **fused)
        assert out[0]["w"] is w and out[1]["mu"]["w"] is mu
    # nothing of even one byte per element: no copy, no mask, no temporary
    assert big_allocations(donated, N) == []
    assert int(state["step"]) == 2


@needs_c
def test_optimizer_class_step_allocates_nothing_parameter_sized():
    params, grads = big_problem()
    ps = [p.requires_grad_(True) for p in params.values()]
    opt = vega.optim.AdamW(ps, lr=1e-3, max_grad_norm=1.0, backend="c")
    for p, g in zip(ps, grads.values(), strict=True):
        p.grad = g
    opt.step()  # the state is created here: parameter-sized, once
    assert big_allocations(opt.step, N) == []
    assert int(opt.state[ps[0]]["step"]) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_factored_adafactor_compiles_once(backend):
    """Two programs in one step (a factored matrix, an unfactored vector), row and column
    state, a scheduled rate and clipping: one graph, replayed, equal to the eager steps."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    hypers = dict(lr=schedule, min_dim_size_to_factor=4, use_momentum=True)

    def step(params, grads, state):
        return vega.adafactor_step(params, grads, state, backend=backend, max_grad_norm=1.0,
                                   **hypers)
    # init builds the default backend's kernels; others are built on first use, eagerly
    step(params, {n: torch.ones_like(v) for n, v in params.items()},
         vega.adafactor_init(params, **hypers))
    # as in a fresh process: the first step is the compiled one, and the first to meet these
    # shapes (the C kernels' geometry of each is computed once, in the traced step: it
    # once failed to trace, max of a generator with a default, in a process whose first
    # factored step was compiled)
    c_backend.launch._GROUP_KEYS.clear()
    c_backend.launch._GEOMETRY.clear()
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    comp_p, comp_s = params, vega.adafactor_init(params, **hypers)
    eager_p, eager_s = params, vega.adafactor_init(params, **hypers)
    assert comp_s["v_row"]["w"].shape == (5,) and comp_s["v"]["b"].shape == (5,)
    for _ in range(4):
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in params.items()}
        comp_p, comp_s = compiled(comp_p, grads, comp_s)
        eager_p, eager_s = step(eager_p, grads, eager_s)
    assert counter.frame_count == 1 and int(comp_s["step"]) == 4
    for n in params:
        torch.testing.assert_close(comp_p[n], eager_p[n], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(comp_s["v_row"]["w"], eager_s["v_row"]["w"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
def test_muon_compiles_once(bf16):
    """Muon's matrices (two wide of one shape, one tall, which the matrix view transposes,
    and a wider one, whose Newton-Schulz steps take the Gram form: vega.codegen.gram) and
    a vector (AdamW's side): one graph, replayed; equal to the eager steps in float32
    (eager, bfloat16 products of one shape are one batched product: equal to bfloat16's
    rounding). A graph break in the matrix helpers compiled them as frames of their own,
    which a second shape recompiled with the geometry's integers as symbols: the step
    failed."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(6, 9, generator=gen), "b": torch.randn(6, 9, generator=gen),
              "t": torch.randn(9, 6, generator=gen), "w": torch.randn(4, 12, generator=gen),
              "v": torch.randn(9, generator=gen)}

    def step(params, grads, state):
        return vega.muon_step(params, grads, state, lr=0.02, bf16=bf16)
    comp, eager = compiled_and_eager(step, params, vega.muon_init, gen)
    tol = dict(rtol=1e-2, atol=1e-3) if bf16 else dict(rtol=1e-6, atol=1e-7)
    for n in params:
        torch.testing.assert_close(comp[0][n], eager[0][n], **tol)


def test_muon_bfloat16_under_inductor_equals_eager_with_emulated_casts(monkeypatch):
    """Inductor computes a run of bfloat16 operations in float32 and rounds once, and Muon's
    iteration carries that on (a compiled update's elements up to 8% from the eager ones,
    as torch.optim.Muon's); with ``emulate_precision_casts`` it rounds as eager does, and
    the compiled step (a square matrix, a column, which the matrix view transposes) is the
    eager one bit for bit, as docs/training.md says."""
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 4, generator=gen), "t": torch.randn(9, 1, generator=gen)}

    def step(params, grads, state):
        return vega.muon_step(params, grads, state, lr=1.0, weight_decay=0.0, momentum=0.5)
    step(params, {n: torch.ones_like(v) for n, v in params.items()}, vega.muon_init(params))
    compiled = torch.compile(step, fullgraph=True)
    comp, eager = (params, vega.muon_init(params)), (params, vega.muon_init(params))
    for _ in range(2):
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in params.items()}
        comp, eager = compiled(*comp[:1], grads, comp[1]), step(*eager[:1], grads, eager[1])
        for n in params:
            assert torch.equal(comp[0][n], eager[0][n]), n
            assert torch.equal(comp[1]["buf"][n], eager[1]["buf"][n]), n
    torch._dynamo.reset()


def compiled_and_eager(step, params, init, gen, steps: int = 3):
    """``steps`` steps of ``step`` compiled (``fullgraph=True``) and eager from ``init``'s
    state, on the same random gradients: ((params, state), (params, state)), the compiled
    one asserted to be one graph. (A first eager step before: the programs it picks are
    kept, which a traced step would guard on.)"""
    step(params, {n: torch.ones_like(v) for n, v in params.items()}, init(params))
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    comp, eager = (params, init(params)), (params, init(params))
    for _ in range(steps):
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in params.items()}
        comp, eager = compiled(*comp[:1], grads, comp[1]), step(*eager[:1], grads, eager[1])
    assert counter.frame_count == 1 and int(comp[1]["step"]) == steps
    return comp, eager


@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
def test_reductions_over_the_group_compile_as_one_graph(name):
    """A functional step with sums over the group (each rule's scalar state) on the
    default backend under ``fullgraph=True``: one graph, replayed, equal to the eager
    steps. A traced step takes the reference's staged step, whose generators end with a
    last yield (``steps.Done``): dynamo cannot read a generator's return value back from
    its StopIteration, and the C kernels' own staged step calls them through ctypes."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(6, 9, generator=gen), "b": torch.randn(9, generator=gen)}
    spec = vega.builtin(name)

    def step(params, grads, state):
        return spec.step(params, grads, state, max_grad_norm=1.0)
    (comp_p, comp_s), (eager_p, eager_s) = compiled_and_eager(step, params, spec.init, gen)
    for n in params:
        torch.testing.assert_close(comp_p[n], eager_p[n], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(comp_s["d"], eager_s["d"], rtol=1e-6, atol=0)


def test_reductions_over_the_group_compile(backend="triton"):
    """Prodigy's sums over the group in a compiled class step, twice, on Triton (whose staged
    step launches its kernels itself: a traced step takes the reference's, where the eager
    one takes the kernels' phases): equal to the eager steps."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen) for p in start] for _ in range(2)]
    runs = []
    for compiling in (True, False):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = vega.optim.Prodigy(ps, backend=backend, d0=1e-2, max_grad_norm=1.0)

        def step(opt=opt):
            opt.step()
        run = torch.compile(step, backend="eager") if compiling else step
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            run()
        runs.append([p.detach() for p in ps] + [opt.state[ps[0]]["d"]])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@needs_c
@pytest.mark.parametrize("lr", ["vega schedule", "torch scheduler"])
def test_whole_class_training_step_compiles_without_recompiles(lr):
    """Forward, backward and ``opt.step()`` of a vega class in one compiled function, over
    50 steps as the rate changes, equal to the eager run. With a vega schedule the three
    are one graph (``fullgraph=True``; dynamo traces ``Tensor.backward`` with
    ``trace_autograd_ops``): no graph break inside vega, and no recompile after the step
    that makes the state. With a torch LR
    scheduler writing a tensor ``lr``, the scheduler's wrapper of ``opt.step`` is one of
    the functions dynamo will not trace (a break of torch's own): no recompile either.
    ``opt.zero_grad`` (which dynamo will not trace either) runs outside."""
    torch._dynamo.reset()

    def setup():
        model = make_model()
        if lr == "vega schedule":
            rate = vega.schedule.warmup_cosine_decay(init_value=0.0, peak_value=1e-2,
                                                     warmup_steps=10, decay_steps=40)
            opt = vega.optim.AdamW(model.parameters(), lr=rate, max_grad_norm=1.0)
            return model, opt, None
        opt = vega.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), max_grad_norm=1.0)
        return model, opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)

    def run(model, opt, sched, step):
        for x, y in data:
            step(x, y)
            opt.zero_grad()
            frames.append(counter.frame_count)
            if sched is not None:
                sched.step()

    def make_step(model, opt):
        def train_step(x, y):
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()
        return train_step

    data, frames, counter = batches(50), [], CompileCounter()
    eager = setup()
    run(*eager, make_step(*eager[:2]))
    frames.clear()
    model, opt, sched = setup()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        run(model, opt, sched, torch.compile(make_step(model, opt), backend=counter,
                                             fullgraph=sched is None))
    # the first step makes the optimizer's state, the second compiles with it, and then
    # nothing changes what was compiled
    assert frames[1:] == [frames[1]] * 49, f"recompiled: {frames}"
    if sched is None:
        assert frames[1] <= 2, frames
    assert int(opt.state[next(model.parameters())]["step"]) == 50
    for p, q in zip(model.parameters(), eager[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_fused_settings_compile_with_dynamic_floats(backend):
    """Under ``torch.compile(dynamic=True)`` a float setting is a symbolic float: the checks
    of ``max_grad_norm`` and of a dynamic scale's factors compare it (``math.isfinite``
    broke the graph, which ``fullgraph=True`` refused). Class and functional steps, one
    graph each after the step that makes the state, equal to the eager steps; a setting
    changed to infinity between compiled steps is still refused."""
    def make():
        model = make_model()
        return model, vega.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5,
                                       loss_scale=vega.LossScale.dynamic(2.0**4),
                                       backend=backend)
    runs = []
    for compiling in (False, True):
        torch._dynamo.reset()
        model, opt = make()
        counter = CompileCounter()
        step = torch.compile(opt.step, backend=counter, dynamic=True, fullgraph=True) \
            if compiling else opt.step
        for x, y in batches(4):
            opt.loss_scale.scale((model(x) - y).square().mean()).backward()
            step()
            opt.zero_grad()
        runs.append([*model.parameters(), *opt.loss_scale.tensors(),
                     *(t for st in opt.state.values() for t in st.values())])
    assert counter.frame_count <= 2, counter.frame_count
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    opt.max_grad_norm = float("inf")  # (fullgraph: dynamo reports the ValueError raised)
    with pytest.raises(Exception, match="max_grad_norm=inf must be a positive finite"):
        step()

    params = {"w": torch.ones(3)}
    grads = {"w": torch.full((3,), 2.0)}

    def functional(max_grad_norm):
        return vega.adamw_step(params, grads, vega.adamw_init(params), lr=0.1,
                               max_grad_norm=max_grad_norm, backend=backend)[0]["w"]
    compiled = torch.compile(functional, backend="eager", dynamic=True, fullgraph=True)
    for norm in (0.5, 0.25):
        assert torch.equal(compiled(norm), functional(norm))


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_class_step_compiles_without_the_plans_of_eager_steps(backend):
    """A traced class step neither reads nor keeps the plans eager steps reuse
    (``SpecOptimizer._planned_work``): reading one called an ``attrgetter`` over the
    parameters without a gradient (one that never has one, here), which dynamo cannot
    trace (``fullgraph=True`` refused the second compiled step), and a plan kept by a
    traced step was guarded on, so that a ``load_state_dict`` compiled the step twice. One
    graph before the state is made, one after, one more after each load; equal to the
    eager steps bit for bit, every state tensor too."""
    def run(compiling):
        torch._dynamo.reset()
        model = make_model()
        unused = torch.nn.Parameter(torch.ones(3))
        opt = vega.optim.AdamW([*model.parameters(), unused], lr=torch.tensor(1e-2),
                               max_grad_norm=1.0, backend=backend)
        counter = CompileCounter()
        step = torch.compile(opt.step, backend=counter, fullgraph=True) \
            if compiling else opt.step
        for k, (x, y) in enumerate(batches(8)):
            (model(x) - y).square().mean().backward()
            step()
            opt.zero_grad()
            if k == 2:
                saved = opt.state_dict()
                saved = {**saved, "state": {i: {n: t.clone() for n, t in st.items()}
                                            for i, st in saved["state"].items()}}
            if k in (4, 6):
                opt.load_state_dict(saved)
        return counter.frame_count, [*model.parameters(), unused,
                                     *(t for st in opt.state.values() for t in st.values())]
    frames, compiled = run(True)
    assert frames == 4, frames
    eager = run(False)[1]
    assert len(compiled) == len(eager) == 5 + 4 * 3
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)


def compiled_like_eager(make, n, *, dynamic=None, eager_first=0, then=None) -> int:
    """Steps the optimizer ``make(model)`` over ``n`` batches twice: eagerly, and with its
    step compiled (``fullgraph=True``) after ``eager_first`` eager steps; ``then(opt)``, made
    after the step is compiled, is called after each step. Asserts both end equal bit for
    bit (the parameters and every state tensor); returns the graphs the compiled run made."""
    def run(compiling):
        torch._dynamo.reset()
        model = make_model()
        opt = make(model)
        counter = CompileCounter()
        step = torch.compile(opt.step, backend=counter, dynamic=dynamic, fullgraph=True) \
            if compiling else opt.step
        after = then(opt) if then is not None else (lambda: None)
        for k, (x, y) in enumerate(batches(n)):
            (model(x) - y).square().mean().backward()
            (opt.step if k < eager_first else step)()
            opt.zero_grad()
            after()
        return counter.frame_count, [*model.parameters(),
                                     *(t for st in opt.state.values() for t in st.values()
                                       if isinstance(t, torch.Tensor))]
    frames, compiled = run(True)
    for a, b in zip(compiled, run(False)[1], strict=True):
        assert torch.equal(a, b)
    return frames


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_a_class_step_compiled_after_eager_steps_reads_no_plan_of_theirs(backend):
    """A class step compiled after eager steps, which keep plans
    (``SpecOptimizer._planned_work``), does not read theirs: reading one called an
    ``attrgetter`` over the parameters without a gradient (one that never has one, here),
    which dynamo cannot trace (``fullgraph=True`` refused the step). One graph, equal to
    the eager steps."""
    def make(model):
        unused = torch.nn.Parameter(torch.ones(3))
        return vega.optim.AdamW([*model.parameters(), unused], lr=torch.tensor(1e-2),
                                max_grad_norm=1.0, backend=backend)
    assert compiled_like_eager(make, 6, eager_first=2) == 1


@pytest.mark.parametrize("lr", ["float", "tensor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_torch_scheduler_changes_the_rate_without_recompiles(backend, lr):
    """A class step compiled before a torch LR scheduler wraps it, the scheduler changing
    the rate after every step: one graph after the step that makes the state, with a rate
    given as a number too (the Triton operator took it as a float argument, a constant of
    the graph: each new value compiled the step again, until dynamo's limit refused it),
    equal to the eager steps bit for bit."""
    def make(model):
        return vega.optim.AdamW(model.parameters(), backend=backend, max_grad_norm=1.0,
                                lr=1e-2 if lr == "float" else torch.tensor(1e-2))

    def then(opt):  # (the scheduler wraps opt.step, already compiled)
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9).step
    assert compiled_like_eager(make, 10, then=then) == 2


@pytest.mark.parametrize("name", ["SGD", "Adafactor"])
def test_programs_picked_by_values_compile_with_dynamic_floats(name):
    """Under ``torch.compile(dynamic=True)`` the values an ``if`` of the spec reads (SGD's
    momentum) are symbolic floats: their outcomes are Python bools (a guard each) before
    the program is lowered outside the trace, and the cache of programs by values is not
    asked (its key sorted symbolic floats), which ``fullgraph=True`` refused. One graph
    after the step that makes the state, equal to the eager steps."""
    def make(model):
        return getattr(vega.optim, name)(model.parameters(), max_grad_norm=1.0,
                                         **({"momentum": 0.9} if name == "SGD" else {}))
    assert compiled_like_eager(make, 4, dynamic=True) == 2


def test_lbfgs_compiles_with_dynamic_floats():
    """LBFGS's check of a float ``lr`` compares it (``math.isnan`` of the symbolic float of
    ``torch.compile(dynamic=True)`` broke the graph, which ``fullgraph=True`` refused): one
    graph after the step that makes the state, equal to the eager steps."""
    assert compiled_like_eager(lambda model: vega.optim.LBFGS(model.parameters(), lr=0.5), 4,
                               dynamic=True) == 2


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_a_number_changed_between_steps_compiled_with_dynamic_false_recompiles(backend):
    """docs/training.md: with ``dynamic=False`` a float setting is a constant of the graph
    (dynamo specializes it), so a number a torch scheduler changes after every step compiles
    the step again each time, on dynamo's ``eager`` backend too; a tensor rate does not."""
    def make(rate):  # (a new tensor each run: the scheduler writes into it)
        return lambda model: vega.optim.AdamW(model.parameters(), backend=backend, lr=rate())

    def then(opt):
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9).step
    assert compiled_like_eager(make(lambda: 1e-2), 4, dynamic=False, then=then) == 4
    assert compiled_like_eager(make(lambda: torch.tensor(1e-2)), 4, dynamic=False,
                               then=then) == 2


@pytest.mark.parametrize("name", ["adamw_init", "lbfgs_init"])
def test_an_init_compiles_fullgraph(name):
    """``*_init`` inside a compiled function (a training step that makes its state): its
    check for a lazy module's uninitialized parameter is one dynamo evaluates (torch's
    ``is_lazy``, a torch function returning a bool, broke the graph, which
    ``fullgraph=True`` refused); the state is the eager one."""
    init = getattr(vega, name)
    params = {k: v.detach() for k, v in make_model().named_parameters()}
    counter = CompileCounter()
    state = torch.compile(init, backend=counter, fullgraph=True)(params)
    flat, eager = (torch.utils._pytree.tree_leaves(s) for s in (state, init(params)))
    assert len(flat) == len(eager) and all(torch.equal(a, b) for a, b in zip(flat, eager))
    assert counter.frame_count == 1


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_step_takes_parameters_and_gradients_in_any_dense_layout(backend, donate):
    """A compiled functional step whose parameter or gradient is not contiguous (a
    channels_last convolution's weight, a transposed matrix, a slice) stepped eagerly, but
    compiled on the C backend failed at its first call: ``backend 'c': parameter 0 is not a
    contiguous CPU tensor ... holding its values as stored`` (the traced operator takes
    contiguous tensors, which the eager path makes). It steps as the eager step does."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    shape = (6, 5, 4, 3)
    cases = [(lambda t: t.contiguous(memory_format=cl), lambda t: t),
             (lambda t: t, lambda t: t.contiguous(memory_format=cl)),
             (lambda t: t.contiguous(memory_format=cl), lambda t: t.contiguous(memory_format=cl)),
             (lambda t: torch.zeros(6, 5, 4, 6)[..., ::2].copy_(t), lambda t: t)]
    step = torch.compile(lambda p, g, s: vega.adamw_step(p, g, s, lr=0.01, backend=backend,
                                                         donate=donate, max_grad_norm=1.0),
                         backend="eager", fullgraph=True, dynamic=False)
    # every case in one step (one compile: each layout of its own, under dynamic=False,
    # compiled the step again), each case a parameter of its own beside a contiguous one
    names = [f"w{k}" for k in range(len(cases))]
    ws = [torch.randn(shape, generator=gen) for _ in cases]
    params = {**{n: lay_p(w.clone()) for n, (lay_p, _), w in zip(names, cases, ws)},
              "b": torch.ones(3)}
    twin = {**{n: w.clone() for n, w in zip(names, ws)}, "b": torch.ones(3)}
    state, twin_state = vega.adamw_init(params), vega.adamw_init(twin)
    for _ in range(2):
        g = {**{n: torch.randn(shape, generator=gen) for n in names},
             "b": torch.randn(3, generator=gen)}
        laid = {**{n: lay_g(g[n].clone()) for n, (_, lay_g) in zip(names, cases)}, "b": g["b"]}
        out, state = step(params, laid, state)
        params = params if donate else out
        twin, twin_state = vega.adamw_step(twin, g, twin_state, lr=0.01, backend="reference",
                                           max_grad_norm=1.0)
    for n in names:
        torch.testing.assert_close(params[n], twin[n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["nu"][n], twin_state["nu"][n], rtol=1e-5, atol=1e-7)
