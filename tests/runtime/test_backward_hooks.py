"""The optimizer step fused into the backward pass, as torch's tutorial writes it: one optimizer
per parameter, each stepped and zeroed in the parameter's post-accumulate-grad hook during
``backward()``. Against the same pattern over torch.optim's class and an ordinary step after
backward: the parameters and every state, on the C and reference backends; with the fused
settings and 8-bit state given to each optimizer, a parameter used twice, a step refused
inside a hook, gradients that are zeroed, absent or frozen, ``maximize``, and a compiled
model."""
import pytest
import torch

import vega
import vega.optim

BACKENDS = ["c", "reference"]
STEPS = 4


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(6, 8), "b": torch.nn.Linear(8, 3),
                                "c": torch.nn.Linear(8, 3)}).to(dtype)


def _data(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(10, 6, generator=gen, dtype=dtype),
             torch.randn(10, 3, generator=gen, dtype=dtype)) for _ in range(STEPS)]


def _loss(m, x, y, i: int, forward=None):
    h = torch.tanh(m["a"](x))
    out = m["b"](h) + h[:, :3] @ m["a"].weight[:3, :3]  # (a's weight used twice)
    if i % 3 != 1:  # (a branch not taken at some steps: c has no gradient there)
        out = out + m["c"](h)
    return ((out - y) ** 2).mean()


def _hooked(m, make):
    """One optimizer per parameter, stepped and zeroed in the parameter's hook."""
    opts = {p: make(p) for p in m.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return opts


def _states(opts, m):
    return [opts[p].state[p] if isinstance(opts, dict) else opts.state[p]
            for p in m.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_in_hooks_equal_torch_and_an_ordinary_step(backend):
    data = _data()
    m1 = _model()
    hooked = _hooked(m1, lambda p: vega.optim.AdamW([p], lr=1e-2, weight_decay=0.1,
                                                    backend=backend))
    m2 = _model()
    torch_hooked = _hooked(m2, lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1))
    m3 = _model()
    ordinary = vega.optim.AdamW(m3.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    for i, (x, y) in enumerate(data):
        _loss(m1, x, y, i).backward()
        _loss(m2, x, y, i).backward()
        ordinary.zero_grad()
        _loss(m3, x, y, i).backward()
        ordinary.step()
    for p1, p2, p3 in zip(m1.parameters(), m2.parameters(), m3.parameters()):
        assert p1.grad is None
        assert torch.equal(p1, p3)
        torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-6)
    for s1, s2, s3 in zip(_states(hooked, m1), _states(torch_hooked, m2),
                          _states(ordinary, m3)):
        assert s1.keys() == s3.keys()
        assert all(torch.equal(s1[k], s3[k]) for k in s1)
        assert s1["step"].item() == s2["step"].item()  # (c: 3 of 4 steps)
        torch.testing.assert_close(s1["mu"], s2["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(s1["nu"], s2["exp_avg_sq"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("settings", [{"max_grad_norm": 0.05}, {"skip_nonfinite": True},
                                      {"loss_scale": "dynamic"},
                                      {"state_dtype": torch.uint8}])
def test_fused_settings_in_hooks_step_as_each_optimizer_after_backward(backend, settings):
    """Each parameter's optimizer clips by its own norm, checks its own gradient and adjusts
    its own scale, as the same optimizers stepped after backward; 8-bit state on a weight of
    4,096 values."""
    def make(p):
        kw = {k: vega.LossScale.dynamic() if v == "dynamic" else v
              for k, v in settings.items()}
        return vega.optim.AdamW([p], lr=1e-2, backend=backend, **kw)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 2))
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 64, generator=gen), torch.randn(4, 2, generator=gen))
            for _ in range(3)]
    m1, m2 = model(), model()
    hooked = _hooked(m1, make)
    after = {p: make(p) for p in m2.parameters()}
    for i, (x, y) in enumerate(data):
        if i == 1 and ("skip_nonfinite" in settings or "loss_scale" in settings):
            x = x.clone()
            x[0, 0] = float("inf")  # (not finite: every gradient but the last bias's)
        for m, opts in ((m1, hooked), (m2, None)):
            loss = ((m(x) - y) ** 2).mean()
            scale = next(iter((opts or after).values())).loss_scale
            (loss if scale is None else scale.scale(loss)).backward()
        for o in after.values():
            o.step()
            o.zero_grad()
    if "state_dtype" in settings:
        assert "mu_absmax" in hooked[m1[0].weight].state[m1[0].weight]
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
        s1, s2 = hooked[p1].state[p1], after[p2].state[p2]
        assert s1.keys() == s2.keys()
        for k in s1:
            torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0)
        if "loss_scale" in settings:
            assert torch.equal(hooked[p1].loss_scale.loss_scale, after[p2].loss_scale.loss_scale)
    if "loss_scale" in settings:  # (docs/training.md: the scales part at an overflow that
        # spares some parameter, here the last bias)
        scales = [hooked[p].loss_scale.loss_scale.item() for p in m1.parameters()]
        assert scales[0] < scales[-1]


def test_a_scale_shared_by_the_optimizers_of_the_parameters_is_refused():
    m = _model()
    ls = vega.LossScale.dynamic()
    with pytest.raises(ValueError, match="loss scale of another optimizer"):
        _hooked(m, lambda p: vega.optim.AdamW([p], loss_scale=ls))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("first", [True, False])
def test_a_step_refused_in_a_hook_leaves_every_optimizer_whole(backend, first):
    """autograd stops at the refusal: the parameters stepped before it are stepped, the one
    refused and those after it are not, their states (none before a first step) as they
    were; the backward pass after the cause is gone steps them all."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = _data()[0]
    ps = list(m.parameters())
    opts = _hooked(m, lambda p: vega.optim.AdamW([p], lr=1e-2, backend=backend))
    if not first:
        ((m(x) - y) ** 2).mean().backward()
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in opts[p].state[p].items()})
              for p in ps}
    opts[ps[1]].param_groups[0]["lr"] = -1.0  # (the first layer's bias: refused)
    with pytest.raises(ValueError, match="lr=-1.0"):
        ((m(x) - y) ** 2).mean().backward()
    for p in ps:
        value, state = before[p]
        now = opts[p].state[p]
        if torch.equal(p, value):  # (not stepped: its state as it was)
            assert now.keys() == state.keys()
            assert all(torch.equal(now[k], state[k]) for k in state)
        else:  # (stepped whole)
            assert now["step"].item() == (1 if first else 2)
            assert p.grad is None
    assert not torch.equal(ps[2], before[ps[2]][0]) and not torch.equal(ps[3], before[ps[3]][0])
    assert torch.equal(ps[1], before[ps[1]][0]) and ps[1].grad is not None
    opts[ps[1]].param_groups[0]["lr"] = 1e-2
    ps[1].grad = None
    ((m(x) - y) ** 2).mean().backward()
    steps = [opts[p].state[p]["step"].item() for p in ps]
    assert steps[1:] == ([1, 2, 2] if first else [2, 3, 3])


RULES = [("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01}),
         ("Adam", {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
         ("RMSprop", {"lr": 1e-2, "momentum": 0.5, "centered": True}),
         ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}), ("NAdam", {"lr": 1e-2}),
         ("Rprop", {"lr": 1e-2})]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", RULES, ids=[r[0] for r in RULES])
@pytest.mark.parametrize("hooks", [False, True])
def test_zeroed_absent_and_frozen_gradients_and_maximize_as_torch(backend, rule, hooks):
    """``zero_grad(set_to_none=False)`` (every parameter steps, a zero gradient where a branch
    was not taken), ``maximize`` turned on mid-training, and a weight frozen with
    ``requires_grad_(False)`` (torch's class steps it on the zeros it keeps), against
    torch.optim's class: float64, each step after backward or in the hooks."""
    name, kw = rule
    data = _data(torch.float64)
    out = []
    for lib, extra in ((torch.optim, {}), (vega.optim, {"backend": backend})):
        for set_to_none in (True, False):
            m = _model(torch.float64)
            make = getattr(lib, name)
            if hooks:
                opts = {p: make([p], **kw, **extra) for p in m.parameters()}

                def hook(p, opts=opts, set_to_none=set_to_none):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=set_to_none)
                for p in m.parameters():
                    p.register_post_accumulate_grad_hook(hook)
                all_opts = list(opts.values())
            else:
                opt = make(m.parameters(), **kw, **extra)
                all_opts = [opt]
            for i, (x, y) in enumerate(data * 2):
                if i == 3:
                    m["a"].weight.requires_grad_(False)
                if i == 5:
                    for o in all_opts:
                        o.param_groups[0]["maximize"] = True
                if not hooks:
                    opt.zero_grad(set_to_none=set_to_none)
                _loss(m, x, y, i).backward()
                if not hooks:
                    opt.step()
            out.append([p.detach().clone() for p in m.parameters()])
    # (torch's NAdam keeps mu_product a float32 number under torch's default dtype:
    # docs/optimizers.md)
    tol = 1e-6 if name == "NAdam" else 1e-12
    for torch_run, vega_run in zip(out[:2], out[2:]):
        for a, b in zip(torch_run, vega_run):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_model_stepped_in_hooks_is_the_eager_model(backend):
    """torch.compile(model) (aot_eager: the model's own arithmetic unchanged), its parameters
    stepped by vega in their hooks: bitwise the eager model's, states too."""
    data = _data()
    runs = []
    for compiled in (False, True):
        m = _model()
        opts = _hooked(m, lambda p: vega.optim.AdamW([p], lr=1e-2, backend=backend))
        body = torch.compile(lambda x: torch.tanh(m["b"](torch.tanh(m["a"](x)))),
                             backend="aot_eager") if compiled else \
            (lambda x: torch.tanh(m["b"](torch.tanh(m["a"](x)))))
        for x, y in data:
            ((body(x) - y) ** 2).mean().backward()
        runs.append((m, opts))
    (m1, o1), (m2, o2) = runs
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
        s1, s2 = o1[p1].state.get(p1, {}), o2[p2].state.get(p2, {})
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
