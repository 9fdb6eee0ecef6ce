"""The fused step of the optimizer classes and the functional API: loss scale, clip, skip."""
import operator

import pytest
import torch

import vega


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(40, 30, generator=gen, dtype=dtype).requires_grad_(),
            torch.randn(30, generator=gen, dtype=dtype).requires_grad_()]


def _clip_grads(params, max_norm):
    """The unfused reference: each .grad replaced by its clipped value (optax's rule)."""
    for p, g in zip(params, vega.clip_by_global_norm([p.grad for p in params], max_norm)):
        p.grad = g


def _set_grads(params, step, scale=1.0, bad=False):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
    if bad:
        params[1].grad[3] = float("inf")


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_class_matches_unscale_clip_then_plain_step(backend):
    """opt(loss_scale, max_grad_norm) == unscale, clip_by_global_norm, then a plain step."""
    scale = 2.0**10
    fused_ps, plain_ps = _params(), _params()
    fused = vega.optim.AdamW(fused_ps, lr=1e-2, max_grad_norm=0.5, backend=backend,
                             loss_scale=vega.LossScale.dynamic(init=scale, growth_interval=3))
    plain = vega.optim.AdamW(plain_ps, lr=1e-2, backend="reference")
    for step in range(8):
        _set_grads(fused_ps, step, scale=fused.loss_scale.loss_scale.item())
        _set_grads(plain_ps, step)
        _clip_grads(plain_ps, 0.5)
        fused.step()
        plain.step()
        for a, b in zip(fused_ps, plain_ps):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the scale grew every 3 finite steps: 8 steps -> two growths
    assert fused.loss_scale.loss_scale.item() == scale * 4
    assert fused.loss_scale.good_steps.item() == 2


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_overflow_skips_and_backs_off(backend):
    ps = _params()
    opt = vega.optim.Adam(ps, lr=1e-2, loss_scale=vega.LossScale.dynamic(init=8.0),
                          backend=backend)
    _set_grads(ps, 0)
    opt.step()
    before = [p.detach().clone() for p in ps]
    state = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    _set_grads(ps, 1, bad=True)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, before))
    assert all(torch.equal(opt.state[ps[0]][k], state[k]) for k in state)
    assert opt.loss_scale.loss_scale.item() == 4.0 and opt.loss_scale.good_steps.item() == 0
    sd = opt.state_dict()
    assert sd["loss_scale"]["loss_scale"].item() == 4.0
    other = vega.optim.Adam(_params(), lr=1e-2, loss_scale=vega.LossScale.dynamic())
    other.load_state_dict(sd)
    assert other.loss_scale.loss_scale.item() == 4.0


@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_a_class_adjusts_the_callers_loss_scale_in_place(name):
    """Every rule's class step adjusts the loss scale it was given in place, the caller's
    object itself (Prodigy's and D-Adaptation's steps, through vega.runtime.sharded, bound a
    new one, and the caller's stayed at its first value); a second optimizer given the same
    scale is refused, which each one's steps would adjust (the second unscaled its
    gradients by a scale the loss was not scaled by); once the first is gone it is free."""
    import gc
    ls = vega.LossScale.dynamic(init=4.0, growth_interval=1)
    ps = _params()
    opt = getattr(vega.optim, name)(ps, lr=1e-2, loss_scale=ls)
    for step in range(3):
        _set_grads(ps, step, scale=ls.loss_scale.item())
        opt.step()
    assert opt.loss_scale is ls and ls.loss_scale.item() == 32.0
    with pytest.raises(ValueError, match=rf"^SGD: loss_scale is the loss scale of another "
                                         rf"optimizer \({name}\), whose steps adjust it"):
        vega.optim.SGD(_params(), lr=1.0, loss_scale=ls)
    other = vega.optim.SGD(_params(), lr=1.0)
    other.loss_scale = ls  # (set after construction: refused by the step's check)
    with pytest.raises(ValueError, match=r"^SGD: loss_scale is the loss scale of another"):
        other.step()
    del opt
    gc.collect()
    vega.optim.SGD(_params(), lr=1.0, loss_scale=ls)


def test_a_loss_scale_an_optimizer_let_go_of_is_free():
    """An optimizer given another loss scale (``opt.loss_scale = ...``) no longer adjusts
    its first one, which another optimizer may then take; taking it back while that one
    holds it is refused, as sharing it is."""
    ls = vega.LossScale.dynamic(init=4.0)
    ps, qs = _params(), _params(1)
    first = vega.optim.SGD(ps, lr=1.0, loss_scale=ls)
    _set_grads(ps, 0)
    first.step()
    first.loss_scale = vega.LossScale.dynamic(init=4.0)
    _set_grads(ps, 1)
    first.step()
    second = vega.optim.SGD(qs, lr=1.0, loss_scale=ls)
    _set_grads(qs, 0)
    second.step()
    first.loss_scale = ls
    with pytest.raises(ValueError, match=r"^SGD: loss_scale is the loss scale of another"):
        first.step()


def test_a_refused_optimizer_leaves_the_loss_scale_where_it_is():
    """An optimizer refused another's loss scale does not move it first: a scale made
    without a device, held by an optimizer whose parameters are on the meta device, waits
    for their device (its first step), not the refused optimizer's."""
    ls = vega.LossScale.dynamic(init=4.0)
    first = vega.optim.SGD([torch.nn.Parameter(torch.zeros(3, device="meta"))], lr=1.0,
                           loss_scale=ls)
    held = ls.tensors()
    with pytest.raises(ValueError, match=r"^SGD: loss_scale is the loss scale of another"):
        vega.optim.SGD(_params(), lr=1.0, loss_scale=ls)
    assert not ls.device_given and all(map(operator.is_, ls.tensors(), held))
    assert first.loss_scale is ls


def test_functional_step_returns_the_adjusted_scale():
    params = {"w": torch.randn(5, 3), "b": torch.randn(3)}
    state = vega.adamw_init(params)
    ls = vega.LossScale.dynamic(init=4.0, growth_interval=1)
    grads = {k: torch.randn_like(v) * 4.0 for k, v in params.items()}
    new_p, new_s, new_ls = vega.adamw_step(params, grads, state, loss_scale=ls)
    assert new_ls.loss_scale.item() == 8.0
    ref_p, _ = vega.adamw_step(params, {k: g / 4.0 for k, g in grads.items()}, state)
    for k in params:
        torch.testing.assert_close(new_p[k], ref_p[k])
    grads["b"][0] = float("nan")
    same_p, same_s, back = vega.adamw_step(new_p, grads, new_s, loss_scale=new_ls)
    assert all(torch.equal(same_p[k], new_p[k]) for k in params)
    assert torch.equal(same_s["step"], new_s["step"])
    assert back.loss_scale.item() == 4.0


def test_clipping_spans_param_groups():
    a, b = _params(), _params()
    grouped = vega.optim.SGD([{"params": [a[0]]}, {"params": [a[1]], "lr": 0.1}], lr=0.1,
                             max_grad_norm=1.0)
    single = vega.optim.SGD(b, lr=0.1)
    _set_grads(a, 0, scale=10.0)
    _set_grads(b, 0, scale=10.0)
    _clip_grads(b, 1.0)
    grouped.step()
    single.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_bad_fused_arguments():
    with pytest.raises(ValueError, match="max_grad_norm=0.0 must be a positive"):
        vega.optim.AdamW(_params(), max_grad_norm=0.0)
    with pytest.raises(ValueError, match="loss_scale=1024.0 must be a vega.LossScale"):
        vega.optim.AdamW(_params(), loss_scale=1024.0)
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="max_grad_norm=-1 must be a positive"):
        vega.sgd_step(p, p, vega.sgd_init(p), max_grad_norm=-1)


def _train(dtype, steps=150, overflow_at=(40,)):
    from vega.demo import model, spirals
    x, y = spirals(seed=0)
    net = model(0).to(dtype)
    ls = vega.LossScale.dynamic(init=2.0**12, growth_interval=20) if dtype == torch.float16 \
        else None
    opt = vega.optim.AdamW(net.parameters(), lr=1e-2, loss_scale=ls, skip_nonfinite=True)
    gen = torch.Generator().manual_seed(1)
    skipped = 0
    for step in range(steps):
        idx = torch.randint(0, len(x), (128,), generator=gen)
        loss = torch.nn.functional.cross_entropy(net(x[idx].to(dtype)).float(), y[idx])
        opt.zero_grad()
        (opt.loss_scale.scale(loss) if ls is not None else loss).backward()
        if step in overflow_at:
            next(net.parameters()).grad[0, 0] = float("inf")
        before = next(net.parameters()).detach().clone()
        opt.step()
        skipped += int(torch.equal(before, next(net.parameters())))
    with torch.no_grad():
        final = torch.nn.functional.cross_entropy(net(x.to(dtype)).float(), y).item()
    return final, skipped, opt


def test_float16_with_dynamic_loss_scale_reaches_float32_loss():
    """float16 parameters and gradients, float32 state, an injected overflow: the final
    loss is within 0.05 of the float32 run's (both start at ln 3 = 1.10)."""
    loss32, _, _ = _train(torch.float32)
    loss16, skipped, opt = _train(torch.float16)
    assert skipped >= 1  # the injected overflow was skipped
    assert opt.loss_scale.loss_scale.item() < 2.0**12 * 2.0**8  # it backed off at least once
    assert all(s.dtype == torch.float32 for st in opt.state.values() for k, s in st.items()
               if k != "step")
    assert loss32 < 0.5
    assert abs(loss16 - loss32) < 0.05, (loss16, loss32)


HOST_READS = ["item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"]


def _refuse_host_reads(monkeypatch) -> None:
    """Each of torch's ways to read a tensor's value on the host (``HOST_READS``) made to
    fail the test until ``monkeypatch.undo()``."""
    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"host read Tensor.{name} inside step()")
        return read
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, refuse(name))


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_no_step_reads_a_tensor_back_to_the_host(backend, monkeypatch):
    """Any read of a tensor's value into Python during step() fails the test."""
    ps = _params()
    opt = vega.optim.AdamW(ps, backend=backend, max_grad_norm=1.0,
                           loss_scale=vega.LossScale.dynamic(),
                           lr=vega.schedule.warmup_cosine_decay(0.0, 1e-3, 5, 20))
    _set_grads(ps, 0)
    opt.step()  # first step: state made (outside the patched region too)

    _refuse_host_reads(monkeypatch)
    for step in range(1, 4):
        _set_grads(ps, step, bad=(step == 2))
        opt.step()
    monkeypatch.undo()
    assert opt.state[ps[0]]["step"].item() == 3  # one skipped


def test_loading_a_live_optimizers_state_shares_no_tensor():
    """Loading another optimizer's state_dict copies it: stepping one leaves the other's
    state (the step counter included) alone."""
    ps = [torch.nn.Parameter(torch.randn(4, 3))]
    qs = [torch.nn.Parameter(ps[0].detach().clone())]
    a, b = vega.optim.Adam(ps, lr=0.1), vega.optim.Adam(qs, lr=0.1)
    ps[0].grad = torch.ones(4, 3)
    a.step()
    b.load_state_dict(a.state_dict())
    for name, value in a.state[ps[0]].items():
        assert value.data_ptr() != b.state[qs[0]][name].data_ptr(), name
    qs[0].grad = torch.ones(4, 3)
    b.step()
    assert int(a.state[ps[0]]["step"]) == 1 and int(b.state[qs[0]]["step"]) == 2


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("of_torch", [False, True])
def test_loaded_states_are_the_optimizers_own_cast_or_not(state_dtype, of_torch):
    """Each loaded state is a tensor of the optimizer's own, cast where it keeps another
    dtype (float32 states into bfloat16 ones; torch's float32 step counter into vega's
    int32): writing into the given dict afterwards changes nothing loaded, and a step
    changes nothing given."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
          torch.nn.Parameter(torch.randn(3, 4, generator=g).t())]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a = torch.optim.AdamW(ps, lr=0.1) if of_torch else vega.optim.AdamW(ps, lr=0.1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    a.step()
    given = a.state_dict()
    b = vega.optim.AdamW(qs, lr=0.1, state_dtype=state_dtype)
    b.load_state_dict(given)
    saved = {(i, k): v.clone() for i, st in given["state"].items() for k, v in st.items()}
    names = {"exp_avg": "mu", "exp_avg_sq": "nu"} if of_torch else {}
    for i, q in enumerate(qs):
        for name, value in given["state"][i].items():
            mine = b.state[q][names.get(name, name)]
            want = torch.int32 if name == "step" else state_dtype or torch.float32
            assert mine.dtype == want, name
            assert torch.equal(mine, value.to(want)), name
    for value in (v for st in given["state"].values() for v in st.values()):
        value.fill_(7.0)
    for i, q in enumerate(qs):
        for name, value in saved.items():
            if name[0] == i:
                mine = b.state[q][names.get(name[1], name[1])]
                assert torch.equal(mine, value.to(mine.dtype)), name
    for q in qs:
        q.grad = torch.ones(q.shape)
    b.step()
    assert all(torch.equal(v, torch.full_like(v, 7.0))
               for st in given["state"].values() for v in st.values())


def test_gradients_are_unscaled_then_clipped_in_that_order():
    """Each gradient times the inverse loss scale, then times the clip coefficient, each
    product rounded: C and the reference bitwise alike, with a scale whose inverse is not
    a power of two (the product of the two factors first rounds otherwise)."""
    gen = torch.Generator().manual_seed(5)
    p = {"w": torch.zeros(3000), "b": torch.zeros(70)}
    g = {k: torch.randn(v.shape, generator=gen) * 1000.0 for k, v in p.items()}
    spec = vega.compile("optimizer o() {\n    p = g\n}")
    outs = {b: spec.step(p, g, spec.init(p), backend=b, max_grad_norm=1.0,
                         loss_scale=vega.LossScale.static(1000.0))[0] for b in ("reference", "c")}
    inv = torch.tensor(1 / 1000.0)
    norm = torch.sqrt(sum((x.double() / 1000.0).square().sum() for x in g.values()))
    coef = torch.tensor(1.0 / max(norm.item(), 1.0))
    for k in p:
        want = g[k] * inv * coef
        assert torch.equal(outs["reference"][k], want), k
        assert torch.equal(outs["c"][k], want), k


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_clipping_by_a_nan_or_overflowing_norm_as_the_reference(backend):
    """A NaN gradient makes the joint norm, and so every clipped gradient, NaN (a
    propagating max in the clip coefficient); finite gradients whose squares overflow
    float32 are summed in double, as the reference sums them."""
    p = {"w": torch.ones(10), "b": torch.ones(3)}
    g = {"w": torch.full((10,), 0.1), "b": torch.full((3,), 0.1)}
    g["w"][0] = float("nan")
    for b in (backend, "reference"):
        out, state = vega.adamw_step(p, g, vega.adamw_init(p), backend=b, max_grad_norm=1.0)
        assert out["w"].isnan().all() and out["b"].isnan().all(), b
        # (a step that does not check for non-finite gradients counts itself: C's counters
        # are advanced by a kernel of their own, apart from the update's)
        assert state["step"].tolist() == 1, b
    for at in (0, 9):  # (C: in the quarters read side by side, and in the rest after them)
        p = {"w": torch.ones(10)}
        g = {"w": torch.full((10,), 0.1)}
        g["w"][at] = 3e38
        want = vega.sgd_step(p, g, vega.sgd_init(p), backend="reference", lr=1.0,
                             max_grad_norm=1.0)[0]["w"]
        got = vega.sgd_step(p, g, vega.sgd_init(p), backend=backend, lr=1.0,
                            max_grad_norm=1.0)[0]
        torch.testing.assert_close(got["w"], want)
        assert want[at] < 1e-6


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_no_step_of_groups_with_tensor_rates_reads_one_back(backend, monkeypatch):
    """Groups whose rates are 0-d tensors (layer-wise rates a captured graph can change),
    joined into one call: telling their values dicts apart compares no tensor's value (an
    equality of two dicts would call each tensor's ``__bool__``)."""
    ps = _params()
    opt = vega.optim.AdamW([{"params": [ps[0]], "lr": torch.tensor(1e-3)},
                            {"params": [ps[1]], "lr": torch.tensor(1e-3)}], backend=backend)
    _set_grads(ps, 0)
    opt.step()

    _refuse_host_reads(monkeypatch)
    for step in range(1, 3):
        _set_grads(ps, step)
        opt.step()
    monkeypatch.undo()
    assert opt.state[ps[1]]["step"].item() == 3


def _made_bytes(fn) -> int:
    """The bytes of the new storages that torch operations made while ``fn`` ran."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    made = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            out = func(*args, **(kwargs or {}))
            seen = set()
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    if s.data_ptr() not in given | seen:
                        seen.add(s.data_ptr())
                        made[0] += s.nbytes()
            return out
    with Count():
        fn()
    return made[0]


@pytest.mark.parametrize("rule, hypers", [("adamw", {}), ("muon", {"bf16": False})])
def test_a_donated_fused_step_by_torch_operations_makes_no_copy_of_its_outputs(rule, hypers):
    """A fused step (max_grad_norm, skip_nonfinite) by the reference kernel's torch operations
    (every backend's for Muon's matrices), donated, writes each new value into its tensor,
    chosen there against the old by the finite flag, and squares the prelude's float64 copy
    in place: it made a copy of each new value (the parameter and every state) for the
    choice, the scaled gradient twice and the prelude's squares besides, 12 times the
    parameters' bytes more than the plain step (AdamW), now under 6 times (the prelude's
    scaled copy and float64 copy, its finite check's, the scaled gradient). The same
    values, and a step with a NaN gradient leaves the parameters as they were."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32)] * 4 + [(32,)] * 4
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    nbytes = sum(p.numel() * 4 for p in params)
    init, step = getattr(vega, rule + "_init"), getattr(vega, rule + "_step")
    made, got = {}, {}
    for fused in (False, True):
        ps = [p.clone() for p in params]
        state = init(ps)
        kw = dict(max_grad_norm=0.5, skip_nonfinite=True) if fused else {}
        for _ in range(2):  # (the second step warm)
            made[fused] = _made_bytes(lambda: step(ps, grads, state, backend="reference",
                                                   donate=True, **kw, **hypers))
        got[fused] = ps
    assert made[True] - made[False] < 6 * nbytes, (made, nbytes)
    ps = [p.clone() for p in params]
    state = init(ps)
    for _ in range(2):
        want = step(ps, grads, state, backend="reference", max_grad_norm=0.5,
                    skip_nonfinite=True, **hypers)
        ps, state = want
    assert all(torch.equal(a, b) for a, b in zip(got[True], ps))
    bad = [g.clone() for g in grads]
    bad[5][3] = float("nan")
    before = [p.clone() for p in got[True]]
    state = init(got[True])
    step(got[True], bad, state, backend="reference", donate=True, max_grad_norm=0.5,
         skip_nonfinite=True, **hypers)
    assert all(torch.equal(a, b) for a, b in zip(got[True], before))
