"""Reductions over a parameter group (``global_sum``, ``global_norm``, ``global_max``), states
of one number per tensor (``state d: scalar``) and modes (``mode eval { p = ... }``), on every
backend, against the same rule written out in torch."""
import math

import pytest
import torch

import vega
from vega import codegen
from vega.runtime import engine

BACKENDS = ["reference", "c", "triton"]

# every kind of reduction over the group, and a per-tensor reduction beside them (LAMB's
# kind), in one spec without scalar state: the C kernels run it in their stages; the
# second, a reduction over the group of a per-tensor value, runs on the reference's
GLOBAL = """
optimizer o(lr = 0.1) {
    n = global_norm(g)
    s = global_sum(g * p)
    m = global_max(abs(g))
    p = p - lr * (g / n + s * p / m) - lr * 0.01 * norm(p)
}
"""
OF_NORMS = GLOBAL.replace("* norm(p)", "* norm(p) * global_sum(norm(g))")


def written_out(params, grads, lr=0.1, of_norms=False):
    """GLOBAL's step in torch, every reduction over all the tensors given."""
    n = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    s = sum((g.double() * p.double()).sum() for g, p in zip(grads, params))
    m = max(g.double().abs().max() for g in grads)
    gn = sum(torch.linalg.vector_norm(g.double()) for g in grads) if of_norms else 1
    return [(p.double() - lr * (g.double() / n + s * p.double() / m)
             - lr * 0.01 * torch.linalg.vector_norm(p.double()) * gn).to(p.dtype)
            for p, g in zip(params, grads)]


def tensors(dtype, seed=0, shapes=((5, 7), (7,), (), (3, 4, 2))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


@pytest.mark.parametrize("of_norms", [False, True], ids=["", "of-norms"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_global_reductions_span_every_tensor(backend, dtype, of_norms):
    spec = vega.compile(OF_NORMS if of_norms else GLOBAL)
    params, grads = tensors(dtype), tensors(dtype, 1)
    state = spec.init(params)
    new, state = spec.step(params, grads, state, backend=backend)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for a, b in zip(new, written_out(params, grads, of_norms=of_norms)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # in place, through the class, the same
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = spec.optimizer(ps, backend=backend)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt.step()
    if backend != "reference":  # (its own stages, where every reduction reads per-element
        program = next(iter(engine.groups(opt.spec._spec._programs.values())))[0]  # values)
        kern = codegen.kernel(backend, program)
        assert kern.backend == backend and kern.stageable != of_norms
    for a, b in zip(ps, new):
        torch.testing.assert_close(a.detach(), b, rtol=tol, atol=tol)


def test_class_reduces_over_each_group_apart():
    """Two parameter groups: each reduces over its own tensors, not the other's."""
    spec = vega.compile(GLOBAL)
    params, grads = tensors(torch.float64), tensors(torch.float64, 1)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = spec.optimizer([{"params": ps[:2]}, {"params": ps[2:]}])
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt.step()
    want = written_out(params[:2], grads[:2]) + written_out(params[2:], grads[2:])
    for a, b in zip(ps, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


# tensors of a group that take different programs (by their shape) still reduce together
SHAPED = """
optimizer o(lr = 0.1) {
    total = global_sum(g * g)
    if ndim(p) >= 2 {
        p = p - lr * g / sqrt(total)
    } else {
        p = p - 2 * lr * g / sqrt(total)
    }
}
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_reduction_spans_the_programs_of_a_group(backend):
    spec = vega.compile(SHAPED)
    params, grads = tensors(torch.float64), tensors(torch.float64, 1)
    new, _ = spec.step(params, grads, spec.init(params), backend=backend)
    total = math.sqrt(sum(float((g * g).sum()) for g in grads))
    for p, g, a in zip(params, grads, new):
        want = p - (0.1 if p.dim() >= 2 else 0.2) * g / total
        torch.testing.assert_close(a, want, rtol=1e-12, atol=1e-12)


# a per-tensor number kept between steps, and one updated from the group's reductions
SCALARS = """
optimizer o(lr = 0.1, b = 0.5) {
    state nu: scalar = ones
    state d: scalar = lr
    nu = b * nu + (1 - b) * sum(g * g)
    d = max(d, global_max(abs(g)))
    p = p - d * g / sqrt(nu)
}
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_states(backend):
    spec = vega.compile(SCALARS)
    params = tensors(torch.float64)
    state = spec.init(params)
    assert all(x.shape == () and x.dtype == torch.float64 for x in state["nu"] + state["d"])
    nu = [1.0] * len(params)
    d = 0.1
    want = [p.clone() for p in params]
    for k in range(3):
        grads = tensors(torch.float64, 10 + k)
        params, state = spec.step(params, grads, state, backend=backend)
        d = max(d, max(float(g.abs().max()) for g in grads))
        for i, g in enumerate(grads):
            nu[i] = 0.5 * nu[i] + 0.5 * float((g * g).sum())
            want[i] = want[i] - d * g / math.sqrt(nu[i])
    for i, p in enumerate(params):
        torch.testing.assert_close(p, want[i], rtol=1e-12, atol=1e-12)
        assert float(state["nu"][i]) == pytest.approx(nu[i], rel=1e-12)
        assert float(state["d"][i]) == pytest.approx(d, rel=1e-15)
    # saved and loaded with the class: one number each
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = spec.optimizer(ps, backend=backend)
    for p, g in zip(ps, tensors(torch.float64, 3)):
        p.grad = g
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["d"].shape == ()
    again = spec.optimizer([torch.nn.Parameter(p.detach().clone()) for p in ps])
    again.load_state_dict(saved)
    assert torch.equal(again.state_dict()["state"][0]["nu"], saved["state"][0]["nu"])


MODES = """
optimizer o(lr = 0.1, b = 0.75) {
    state z = p
    z = z - lr * g
    p = b * p + (1 - b) * z
    mode eval {
        p = (p - (1 - b) * z) / b
    }
    mode train {
        p = b * p + (1 - b) * z
    }
}
"""


def test_modes_functional_and_class():
    spec = vega.compile(MODES)
    assert spec.modes == ("eval", "train")
    params = tensors(torch.float64)
    state = spec.init(params)
    params, state = spec.step(params, tensors(torch.float64, 1), state)
    x = spec.mode("eval", params, state)
    for p, z, e in zip(params, state["z"], x):
        torch.testing.assert_close(e, (p - 0.25 * z) / 0.75, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="mode 'evil' is not one of this spec's modes"):
        spec.mode("evil", params, state)
    # the class: eval() puts p at x, train() back; a step in eval mode is refused
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = spec.optimizer(ps)
    for p, g in zip(ps, tensors(torch.float64, 2)):
        p.grad = g
    opt.step()
    y = [p.detach().clone() for p in ps]
    z = [opt.state[p]["z"] for p in ps]
    opt.eval()
    opt.eval()  # (already there: nothing changes)
    for p, yy, zz in zip(ps, y, z):
        torch.testing.assert_close(p.detach(), (yy - 0.25 * zz) / 0.75, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError, match="mode 'eval'; call train"):
        opt.step()
    assert opt.state_dict()["param_groups"][0]["mode"] == "eval"
    opt.train()
    for p, yy in zip(ps, y):
        torch.testing.assert_close(p.detach(), yy, rtol=1e-14, atol=1e-14)
    opt.step()


def test_a_functional_mode_names_a_state_leaf_of_another_shape():
    """``spec.mode`` refuses a state leaf of another shape than its parameter's, naming the
    leaf by its path (its message was built from a position, which failed with a
    TypeError)."""
    spec = vega.compile(MODES)
    params = {"w": torch.ones(4, 3), "b": torch.ones(3)}
    state = spec.init(params)
    state["z"]["w"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"^o\.mode: state leaf 'z\.w' has shape \(3,\)"):
        spec.mode("eval", params, state)


def test_a_class_switches_no_group_where_a_state_cannot_be_read():
    """eval() and train() check every group's states before they write a parameter, as a
    step does: a state of another shape that broadcasts (set by hand) wrote wrong values
    into the parameter, and a group refused after another left the two in two modes."""
    spec = vega.compile(MODES)
    ps = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
    opt = spec.optimizer([{"params": [ps[0]]}, {"params": [ps[1]]}])
    for p in ps:
        p.grad = torch.ones(p.shape)
    opt.step()
    before = [p.detach().clone() for p in ps]
    opt.state[ps[1]]["z"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"^O\.eval\(\): state 'z' of parameter 0 of group 1 "
                                         r"has shape \(1,\) on cpu, but its parameter, of "
                                         r"shape \(3,\), needs \(3,\)"):
        opt.eval()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert [g["mode"] for g in opt.param_groups] == ["train", "train"]
    del opt.state[ps[1]]["z"]
    with pytest.raises(ValueError, match=r"^O\.eval\(\): state 'z' of parameter 0 of group 1 "
                                         r"is None, not a tensor"):
        opt.eval()


def test_modes_read_the_master_copy():
    """With master weights, eval() reads the float32 master copy and train() restores it."""
    spec = vega.compile(MODES)
    ps = [torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))]
    opt = spec.optimizer(ps, master_weights=True, lr=1e-3)
    ps[0].grad = torch.randn(64, dtype=torch.bfloat16)
    opt.step()
    master = opt.state[ps[0]]["master"].clone()
    opt.eval()
    want = ((master - 0.25 * opt.state[ps[0]]["z"]) / 0.75).to(torch.bfloat16)
    assert torch.equal(ps[0].detach(), want)
    opt.train()
    assert torch.equal(ps[0].detach(), master.to(torch.bfloat16))
    assert torch.equal(opt.state[ps[0]]["master"], master)


def test_rules_without_modes_ignore_train_and_eval():
    opt = vega.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    opt.eval()
    opt.train()
    assert "mode" not in opt.param_groups[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_copy_repeat_makes_of_a_reduction_is_its_own(backend):
    """repeat writes global_sum out twice: two reductions, not one summed twice."""
    spec = vega.compile("optimizer o() {\n x = g\n acc = 0\n repeat 2 {\n"
                        " acc = acc + global_sum(x)\n x = x * 2\n }\n p = p - acc\n}")
    params = [torch.zeros(2, 3), torch.zeros(3)]
    new, _ = spec.step(params, [torch.ones(2, 3), torch.ones(3)], spec.init(params),
                       backend=backend)
    assert torch.equal(new[0], torch.full((2, 3), -27.0))  # 9 + 18


# the programs of a group reach the reduction over it at different stages (one normalizes
# by its own norm first): each waits for the others' parts
STAGES_APART = """
optimizer o(lr = 0.1) {
    if ndim(p) == 2 {
        x = g / norm(g)
    } else {
        x = g
    }
    p = p - lr * x * global_sum(x * x)
}
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_programs_reaching_a_reduction_at_different_stages_reduce_together(backend):
    spec = vega.compile(STAGES_APART)
    params, grads = tensors(torch.float64), tensors(torch.float64, 1)
    xs = [g / g.norm() if g.dim() == 2 else g for g in grads]
    total = sum((x * x).sum() for x in xs)
    want = [p - 0.1 * x * total for p, x in zip(params, xs)]
    new, _ = spec.step(params, grads, spec.init(params), backend=backend)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = spec.optimizer(ps, backend=backend)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    opt.step()
    for a, b, w in zip(new, ps, want):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.detach(), w, rtol=1e-12, atol=1e-12)


def test_functional_mode_reads_the_master_copy():
    spec = vega.compile(MODES)
    params = [torch.randn(64, dtype=torch.bfloat16)]
    state = spec.init(params, master_weights=True)
    params, state = spec.step(params, [torch.randn(64, dtype=torch.bfloat16)], state,
                              master_weights=True)
    got = spec.mode("eval", params, state, master_weights=True)
    master, z = state["master"][0], state["z"][0]
    assert torch.equal(got[0], ((master - 0.25 * z) / 0.75).to(torch.bfloat16))
    assert torch.equal(state["master"][0], master)


def test_a_tensor_without_a_gradient_keeps_its_group_s_estimate():
    """Prodigy's d is one number per group: a tensor that skips a step (no gradient) takes
    the group's new d, in the class and in the functional step, so that all agree after."""
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(4, 3, generator=gen, dtype=torch.float64),
             torch.randn(5, generator=gen, dtype=torch.float64)]
    ps = [torch.nn.Parameter(p.clone()) for p in start]
    opt = vega.optim.Prodigy(ps, d0=1e-3)
    params = [p.clone() for p in start]
    state = vega.prodigy.init(params, d0=1e-3)
    for k in range(30):
        skip = k == 20
        for p in ps:
            p.grad = 2 * (p.detach() - 1)
        if skip:
            ps[1].grad = None
        opt.step()
        grads = [2 * (p - 1) for p in params]
        params, state = vega.prodigy.step(params, [grads[0], None if skip else grads[1]],
                                          state, d0=1e-3)
    ds = [opt.state[p]["d"] for p in ps]
    assert float(ds[0]) > 1e-2 and torch.equal(ds[0], ds[1])
    assert torch.equal(opt.state[ps[0]]["num"], opt.state[ps[1]]["num"])
    assert torch.equal(state["d"][0], state["d"][1]) and float(state["d"][0]) > 1e-2


# per-tensor reductions of every kind and one over the group, in two phases
PHASES = """
optimizer o(lr = 0.1) {
    state m = zeros
    m = 0.5 * m + g
    scaled = m / (max(abs(m)) + 1)
    p = p - lr * (scaled / (norm(scaled) + 1) + 0.01 * sum(m) + mean(g * g)
                  + g / global_norm(g))
}
"""


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_staged_step_weighs_a_replicated_copys_partial_results(backend):
    """A step over shards (``Kernel.staged``) of tensors each held by two processes (a
    ``ShardView`` of weight 1/2, HSDP's replicas): the partial results it yields are halved,
    and given back their sum over both copies, the step is the plain one, bitwise."""
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import drive
    from vega.dsl.check import matrix_axes
    spec = vega.compile(PHASES)
    params, grads = tensors(torch.float32), tensors(torch.float32, 1)
    state = spec.init(params)
    want, _ = spec.step(params, grads, state, backend=backend)
    program = next(iter(engine.groups(spec._spec._programs.values())))[0]
    kern = codegen.kernel(backend, program)
    assert kern.backend == backend and kern.stageable
    views = [ShardView(Geometry(tuple(p.shape), axes=matrix_axes(p.shape)),
                       geometry(p.shape), frozenset(), 0.5) for p in params]
    seen = []

    def both_copies(parts):
        seen.append([how for how, _ in parts])
        return [x * 2 if how == "sum" else x for how, x in parts]
    steps = [torch.zeros((), dtype=torch.int32) for _ in params]
    results = [None]
    drive({0: kern.staged(params, grads, [[state["m"][k] for k in range(len(params))]],
                          steps, [{"lr": 0.1}] * len(params), False, None, views)},
          results, both_copies, needs={0: set(kern.global_keys.values())})
    new_p = results[0][0]
    for a, b in zip(new_p, want):
        assert torch.equal(a, b)
    assert len(seen) == 2 and "max" in seen[0] and seen[0].count("sum") > seen[0].count("max")
