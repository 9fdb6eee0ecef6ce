"""The functional API under ``torch.func`` transforms.

``vmap`` over an ensemble (a batch dimension on params, grads and state) steps each member
as a loop over the members would, by the reference backend, purely; ``init`` under vmap
makes each member a state of its own. ``jvp`` (forward mode) goes through a pure reference
step. ``grad`` (reverse mode) is refused: the step runs outside autograd, and a gradient
through it would be silently zero. ``donate=True`` and a compiled backend under vmap or jvp
are refused, naming the transform.
"""
import re

import pytest
import torch
from torch.func import grad, jvp, vmap

import vega
from vega.runtime.tree import flatten

E = 3


def ensemble():
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(E, 4, 5, generator=g, dtype=torch.float64),
              "b": torch.randn(E, 5, generator=g, dtype=torch.float64)}
    grads = [{k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}
             for _ in range(3)]
    return params, grads


def member(tree, i):
    return {k: v[i] for k, v in tree.items()}


def own_leaves(state):
    """Every tensor leaf of a vmapped state, none a stride-0 view shared by the members."""
    leaves = [x for v in state.values() for x in flatten(v)[0] if x is not None]
    assert leaves
    for x in leaves:
        assert x.shape[0] == E and x.stride(0) != 0, (x.shape, x.stride())
        x.select(0, 1).fill_(7)  # (a member's own: the others keep their values)
        assert not (x.select(0, 0) == 7).all()


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor", "schedule_free_adamw"])
def test_vmap_init_gives_each_member_its_own_state(name):
    params, _ = ensemble()
    own_leaves(vmap(getattr(vega, name).init)(params))


def test_vmap_lbfgs_init_gives_each_member_its_own_state():
    params, _ = ensemble()
    own_leaves(vmap(vega.lbfgs_init)(params))


CASES = [("adamw", dict(lr=1e-2, weight_decay=0.1)), ("sgd", dict(lr=0.1, momentum=0.9)),
         ("lamb", dict(lr=1e-2)), ("adamw", dict(lr=1e-2, max_grad_norm=0.5)),
         ("lbfgs", dict(lr=0.1))]


@pytest.mark.parametrize("name,kw", CASES)
def test_vmap_step_is_a_loop_over_members(name, kw):
    params, grads = ensemble()
    init = vega.lbfgs_init if name == "lbfgs" else getattr(vega, name).init
    step = vega.lbfgs_step if name == "lbfgs" else getattr(vega, name).step
    p, s = params, vmap(init)(params)
    for g in grads:
        p, s = vmap(lambda a, b, c: step(a, b, c, **kw))(p, g, s)
    for i in range(E):
        q = member(params, i)
        t = init(q)
        for g in grads:
            q, t = step(q, member(g, i), t, **kw)
        for k in q:
            torch.testing.assert_close(p[k][i], q[k], rtol=1e-12, atol=1e-12)


def test_vmap_step_skips_each_member_of_its_own():
    params, grads = ensemble()
    g = {k: v.clone() for k, v in grads[0].items()}
    g["b"][1, 0] = float("inf")
    p, s = vmap(lambda a, b, c: vega.adamw_step(a, b, c, lr=0.1, skip_nonfinite=True))(
        params, g, vmap(vega.adamw_init)(params))
    assert torch.equal(p["w"][1], params["w"][1]) and int(s["step"][1]) == 0
    for i in (0, 2):
        assert not torch.equal(p["w"][i], params["w"][i]) and int(s["step"][i]) == 1


@pytest.mark.parametrize("kw,words", [(dict(donate=True), "donate=True under torch.func.vmap"),
                                      (dict(backend="c"), "backend='c' under torch.func.vmap")])
def test_vmap_refuses_what_cannot_batch(kw, words):
    params, grads = ensemble()
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        vmap(lambda a, b, c: vega.adamw_step(a, b, c, lr=0.1, **kw))(
            params, grads[0], vmap(vega.adamw_init)(params))
    if "donate" in kw:
        with pytest.raises(ValueError, match="donate=True under torch.func.vmap"):
            vmap(lambda a, b, c: vega.lbfgs_step(a, b, c, **kw))(
                params, grads[0], vmap(vega.lbfgs_init)(params))


def test_jvp_through_a_step_is_a_hand_written_update_s():
    g = torch.Generator().manual_seed(1)
    w, gw, x = (torch.randn(*s, generator=g, dtype=torch.float64) for s in
                [(4, 5), (4, 5), (3, 4)])

    def through_vega(lr, w):
        q, _ = vega.adamw_step({"w": w}, {"w": gw}, vega.adamw_init({"w": w}), lr=lr,
                               weight_decay=0.1)
        return (x @ q["w"]).square().sum()

    def by_hand(lr, w):  # AdamW's first step: m_hat = g, v_hat = g**2
        q = w * (1 - lr * 0.1) - lr * gw / (gw.abs() + 1e-8)
        return (x @ q).square().sum()

    args, tangents = (torch.tensor(0.01, dtype=torch.float64), w), \
        (torch.tensor(1.0, dtype=torch.float64), torch.randn(4, 5, generator=g,
                                                             dtype=torch.float64))
    got, want = jvp(through_vega, args, tangents), jvp(by_hand, args, tangents)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="backend='c' under torch.func.jvp"):
        jvp(lambda w: vega.adamw_step({"w": w}, {"w": gw}, vega.adamw_init({"w": w}),
                                      backend="c")[0]["w"], (w,), (w,))


@pytest.mark.parametrize("backend", ["reference", "c", None])
def test_grad_through_a_step_is_refused_not_zero(backend):
    w, gw = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)

    def of_lr(lr):
        q, _ = vega.sgd_step({"w": w}, {"w": gw}, vega.sgd_init({"w": w}), lr=lr,
                             backend=backend)
        return q["w"].square().sum()

    def of_w(w):
        q, _ = vega.adamw_step({"w": w}, {"w": gw}, vega.adamw_init({"w": w}),
                               backend=backend)
        return q["w"].square().sum()

    with pytest.raises(ValueError, match="sgd_step: called under torch.func.grad"):
        grad(of_lr)(torch.tensor(0.1, dtype=torch.float64))
    with pytest.raises(ValueError, match="adamw_step: called under torch.func.grad"):
        grad(of_w)(w)
    with pytest.raises(ValueError, match="lbfgs_step: called under torch.func.grad"):
        grad(lambda w: vega.lbfgs_step({"w": w}, {"w": gw}, vega.lbfgs_init({"w": w}))[0][
            "w"].sum())(w)


def test_vmap_step_of_large_tensors_and_matrix_products():
    # (the reference backend computes a large CPU tensor a tile at a time into a tensor of
    # its shape, and writes temporaries in place: neither batched under vmap)
    from vega.codegen.reference import TILE
    g = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(2, 2 * TILE + 5, generator=g),
              "m": torch.randn(2, 725, 725, generator=g)}  # (over 2 * TILE values)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    for name, kw in [("adamw", dict(lr=1e-2)), ("muon", dict(lr=1e-2, bf16=False))]:
        spec = getattr(vega, name)
        s0 = spec.init(member(params, 0))
        dims = {k: {a: None if b is None else 0 for a, b in v.items()}
                if isinstance(v, dict) else 0 for k, v in s0.items()}
        s = vmap(spec.init, out_dims=dims)(params)
        p, _ = vmap(lambda a, b, c: spec.step(a, b, c, **kw), in_dims=(0, 0, dims),
                    out_dims=(0, dims))(params, grads, s)
        for i in range(2):
            q, _ = spec.step(member(params, i), member(grads, i),
                             spec.init(member(params, i)), backend="reference", **kw)
            for k in q:
                torch.testing.assert_close(p[k][i], q[k], rtol=0, atol=1e-5)


def _class_opt(name, backend):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    for p in (w, b):
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    kw = {} if name == "LBFGS" else dict(backend=backend)
    return [w, b], getattr(vega.optim, name)([w, b], lr=0.1, **kw)


@pytest.mark.parametrize("name,backend", [("AdamW", "c"), ("AdamW", "reference"),
                                          ("Muon", "reference"), ("LBFGS", None)])
@pytest.mark.parametrize("transform", ["grad", "jvp", "functionalize"])
def test_a_class_step_under_grad_jvp_or_functionalize_is_refused_and_changes_nothing(
        name, backend, transform):
    params, opt = _class_opt(name, backend)
    before = [p.detach().clone() for p in params]

    def stepping(x):
        opt.step()
        return (x * x).sum()

    x = torch.ones(3, dtype=torch.float64)
    run = {"grad": lambda: grad(stepping)(x), "jvp": lambda: jvp(stepping, (x,), (x,)),
           "functionalize": lambda: torch.func.functionalize(stepping)(x)}[transform]
    with pytest.raises(ValueError, match=f"{name}.step: called under torch.func.{transform}"):
        run()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    # the optimizer steps on outside the transform, as a fresh one would
    fresh_params, fresh = _class_opt(name, backend)
    opt.step()
    fresh.step()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))
    for p in params:
        for v in opt.state[p].values():
            assert not torch._C._functorch.is_functorch_wrapped_tensor(v)
            assert not torch._is_functional_tensor(v)


@pytest.mark.parametrize("name,backend", [("AdamW", "c"), ("Muon", "reference")])
def test_a_class_step_under_vmap_of_other_tensors_steps_as_outside_it(name, backend):
    params, opt = _class_opt(name, backend)
    eager_params, eager = _class_opt(name, backend)

    def stepping(x):
        opt.step()
        return x + 1

    vmap(stepping)(torch.zeros(3, 2))
    eager.step()
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params))


@pytest.mark.parametrize("name,backend", [("AdamW", "c"), ("AdamW", "reference"),
                                          ("LBFGS", None)])
def test_a_class_step_under_vmap_of_its_own_gradients_is_refused_and_changes_nothing(
        name, backend):
    params, opt = _class_opt(name, backend)
    before = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]

    def stepping(g):
        params[0].grad = g
        opt.step()
        return g

    with pytest.raises(ValueError, match=f"{name}.step: called under torch.func.vmap with a "
                                         f"batched parameter or gradient"):
        vmap(stepping)(torch.randn(3, 4, 5, dtype=torch.float64))
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    params[0].grad = grads[0]
    fresh_params, fresh = _class_opt(name, backend)
    opt.step()
    fresh.step()
    assert all(torch.equal(p, q) for p, q in zip(params, fresh_params))


@pytest.mark.parametrize("donate", [False, True])
def test_functional_step_under_functionalize_is_the_reference_step(donate):
    params, grads = ensemble()
    params, grads = member(params, 0), member(grads[0], 0)
    ls = vega.LossScale.dynamic()
    want = vega.adamw_step(params, grads, vega.adamw_init(params), lr=0.1, backend="reference",
                           max_grad_norm=1.0, loss_scale=ls)
    mine = {k: v.clone() for k, v in params.items()}

    def step(p, g):
        return vega.adamw_step(p, g, vega.adamw_init(p), lr=0.1, max_grad_norm=1.0,
                               loss_scale=vega.LossScale.dynamic(), donate=donate)

    got = torch.func.functionalize(step)(mine, grads)
    for a, b in zip(flatten(got[:2])[0], flatten(want[:2])[0]):
        assert torch.equal(a, b)
    assert torch.equal(got[2].loss_scale, want[2].loss_scale)
    if donate:  # (functionalize writes the step's writes back into its inputs)
        assert all(torch.equal(mine[k], want[0][k]) for k in mine)
    with pytest.raises(ValueError, match="backend='c' under torch.func.functionalize"):
        torch.func.functionalize(lambda p, g: vega.adamw_step(
            p, g, vega.adamw_init(p), backend="c"))(params, grads)


def test_a_class_step_refused_under_a_transform_names_its_rules_functional_step():
    """The refusal points to the step to call instead: ``vega.<name>_step`` for a shipped
    rule, the spec's own ``step`` for one compiled from a text (there is no ``vega.`` step
    of its name)."""
    text = vega.builtin("sgd").source_text.replace("optimizer sgd as SGD", "optimizer mine as Mine")
    for opt, want in [(_class_opt("AdamW", "reference")[1], "(vega.adamw_step)"),
                      (_class_opt("LBFGS", None)[1], "(vega.lbfgs_step)"),
                      (vega.compile(text).optimizer([torch.nn.Parameter(torch.ones(3))],
                                                    lr=0.1), "spec.step")]:
        with pytest.raises(ValueError, match=re.escape(want)):
            grad(lambda x: (opt.step(), (x * x).sum())[1])(torch.ones(2))
