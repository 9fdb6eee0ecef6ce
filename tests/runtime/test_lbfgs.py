"""vega.runtime.lbfgs against optax.lbfgs(linesearch=None), in float64, step by step.

Each side evaluates the gradient of the same objective at its own parameters,
so the curvature pairs are the real ones and any difference compounds: the
parameters are compared after every one of 20 steps, and the whole state at
the end.
"""
from __future__ import annotations

import copy
import math
import os
import pickle
import re

import numpy as np
import pytest
import jax  # test dependencies (like optax): a missing one fails, never skips
import jax.numpy as jnp
import optax
import torch

import vega
from vega.runtime.io import load, save
from vega.runtime.lbfgs import LBFGS, lbfgs_init, lbfgs_step

jax.config.update("jax_enable_x64", True)

STEPS = 20
RTOL = 1e-9


# -- the objective: a regularized bilinear least squares, with a quartic term ----------
#
# r = w @ b + s * u - y;  f = |r|^2 / 2 + lam (|w|^2 + |b|^2 + s^2) / 2 + mu sum(b^4) / 4.
# Written once for torch and jax.numpy (the same operators), gradient by hand.

LAM, MU = 0.1, 0.05


def consts(dtype=torch.float64):
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(5, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(5, generator=gen, dtype=torch.float64).to(dtype))


def make_params(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 7, generator=gen, dtype=torch.float64).to(dtype),
            "b": torch.randn(7, generator=gen, dtype=torch.float64).to(dtype),
            "s": torch.tensor(0.7, dtype=dtype)}


def residual(p, u, y):
    return p["w"] @ p["b"] + p["s"] * u - y


def loss(p, u, y):
    w, b, s = p["w"], p["b"], p["s"]
    r = residual(p, u, y)
    return (0.5 * (r * r).sum() + 0.5 * LAM * ((w * w).sum() + (b * b).sum() + s * s)
            + 0.25 * MU * (b ** 4).sum())


def grad(p, u, y):
    w, b, s = p["w"], p["b"], p["s"]
    r = residual(p, u, y)
    return {"w": r[:, None] * b[None, :] + LAM * w,
            "b": w.T @ r + LAM * b + MU * b ** 3,
            "s": (r * u).sum() + LAM * s}


def to_jax(tree):
    return jax.tree.map(lambda t: jnp.asarray(t.detach().numpy()), tree)


def assert_close(got: torch.Tensor, want, what: str, rtol: float = RTOL):
    got = got.detach().numpy()
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, what
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-300)
    err = float(np.abs(got - want).max(initial=0.0))
    assert err <= rtol * scale, f"{what}: max error {err:.3e} against scale {scale:.3e}"


def run_both(memory_size=10, lr=1.0, optax_lr=None, scale_init_precond=True, steps=STEPS,
             params=None, grad_fn=grad):
    """Step vega and optax side by side; compare params every step, return both."""
    u, y = consts()
    ju, jy = jnp.asarray(u.numpy()), jnp.asarray(y.numpy())
    params = make_params() if params is None else params
    tx = optax.lbfgs(learning_rate=lr if optax_lr is None else optax_lr,
                     memory_size=memory_size, scale_init_precond=scale_init_precond,
                     linesearch=None)
    jp = to_jax(params)
    js = tx.init(jp)
    kw = {} if memory_size == 10 else {"memory_size": memory_size}
    state = lbfgs_init(params, **kw)
    p = params

    @jax.jit
    def optax_step(jp, js):
        upd, js = tx.update(grad_fn(jp, ju, jy), js, jp)
        return optax.apply_updates(jp, upd), js

    for k in range(steps):
        p, state = lbfgs_step(p, grad_fn(p, u, y), state, lr=lr,
                              scale_init_precond=scale_init_precond)
        jp, js = optax_step(jp, js)
        for name in p:
            assert_close(p[name], jp[name], f"step {k}: params '{name}'")
    return p, state, jp, js


def compare_state(state, js, memory_size):
    ls = js[0]  # ScaleByLBFGSState, first in optax's chain
    assert int(state["step"]) == int(ls.count)
    assert_close(state["weights"], ls.weights_memory, "weights")
    for name in state["params_prev"]:
        assert_close(state["params_prev"][name], ls.params[name], f"params_prev.{name}")
        assert_close(state["updates_prev"][name], ls.updates[name], f"updates_prev.{name}")
        assert_close(state["diff_params"][name], ls.diff_params_memory[name],
                     f"diff_params.{name}")
        assert_close(state["diff_updates"][name], ls.diff_updates_memory[name],
                     f"diff_updates.{name}")
        assert state["diff_params"][name].shape[0] == memory_size


# -- against optax ---------------------------------------------------------------------

def test_matches_optax_defaults():
    p, state, jp, js = run_both()
    compare_state(state, js, 10)
    u, y = consts()
    assert float(loss(p, u, y)) < 0.2 * float(loss(make_params(), u, y))


@pytest.mark.parametrize("memory_size,lr", [(4, 0.5), (1, 0.8), (3, 1.0)])
def test_matches_optax_small_memory_wraps(memory_size, lr):
    _, state, _, js = run_both(memory_size=memory_size, lr=lr)
    compare_state(state, js, memory_size)
    assert int(state["step"]) > memory_size  # the ring buffer wrapped


def test_matches_optax_without_initial_scaling():
    _, state, _, js = run_both(memory_size=5, lr=0.3, scale_init_precond=False)
    compare_state(state, js, 5)


def test_lr_as_tensor_and_as_schedule():
    run_both(memory_size=6, lr=torch.tensor(0.7, dtype=torch.float64), optax_lr=0.7)
    # a schedule of the step tensor, evaluated at the completed steps (optax's count)
    run_both(memory_size=6, lr=lambda k: 0.9 * 0.95 ** k.double(),
             optax_lr=lambda c: 0.9 * 0.95 ** c)


def test_a_schedule_of_a_one_element_tensor_keeps_a_0d_parameter_0d():
    """A schedule may return its value as a tensor of one element of any shape (``(1,)``):
    a 0-d parameter stays 0-d (the product with it broadcast the parameter to ``(1,)``),
    stepped as at the same rate given as a number, pure and in place."""
    def make():
        return {"s": torch.tensor(2.0, dtype=torch.float64),
                "v": torch.arange(3.0, dtype=torch.float64)}
    grads = {"s": torch.tensor(-1.0, dtype=torch.float64),
             "v": torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64)}
    want, _ = lbfgs_step(make(), grads, lbfgs_init(make()), lr=0.5)
    for donate in (False, True):
        p = make()
        got, _ = lbfgs_step(p, grads, lbfgs_init(p), donate=donate,
                            lr=lambda k: torch.full((1,), 0.5, dtype=torch.float64))
        assert got["s"].shape == () and torch.equal(got["s"], want["s"]), donate
        assert torch.equal(got["v"], want["v"]), donate


def test_vega_schedule_is_evaluated_at_completed_steps():
    """A vega.schedule (float32 values) against optax fed the same float32 values."""
    sched = vega.schedule.linear(init_value=1.0, end_value=0.2, steps=10)
    values = [float(sched(torch.tensor(k, dtype=torch.int32))) for k in range(STEPS)]
    run_both(memory_size=4, lr=sched,
             optax_lr=lambda c: jnp.asarray(values)[jnp.minimum(c, STEPS - 1)])


def test_zero_lr_keeps_params_and_records_history():
    params = make_params()
    u, y = consts()
    state = lbfgs_init(params)
    p = params
    for _ in range(3):
        p, state = lbfgs_step(p, grad(p, u, y), state, lr=0.0)
    for name in params:
        assert torch.equal(p[name], params[name])
    assert int(state["step"]) == 3
    # no parameter movement: the pairs are zero, so their weights are 0, not inf
    assert torch.equal(state["weights"], torch.zeros(10, dtype=torch.float64))


def test_complex_parameters_match_optax():
    """A complex leaf steps as its two real coordinates: optax takes the real part of
    every inner product, which is the same thing. The gradient is torch's convention
    (conj of jax.grad), fed to both."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(6, 4, generator=gen, dtype=torch.complex128)
    t = torch.randn(6, generator=gen, dtype=torch.complex128)
    ja, jt = jnp.asarray(a.numpy()), jnp.asarray(t.numpy())

    def g(p, A, T):
        r = A @ p["z"] - T
        return {"z": A.conj().T @ r + 0.1 * p["z"], "x": 2.0 * (p["x"] - 1.0)}

    params = {"z": torch.randn(4, generator=gen, dtype=torch.complex128),
              "x": torch.randn(3, generator=gen, dtype=torch.float64)}
    tx = optax.lbfgs(learning_rate=0.5, memory_size=3, linesearch=None)
    jp = to_jax(params)
    js = tx.init(jp)
    state = lbfgs_init(params, memory_size=3)
    assert state["diff_params"]["z"].dtype == torch.complex128
    assert state["weights"].dtype == torch.float64
    p = params

    @jax.jit
    def optax_step(jp, js):
        upd, js = tx.update(g(jp, ja, jt), js, jp)
        return optax.apply_updates(jp, upd), js

    for k in range(12):
        p, state = lbfgs_step(p, g(p, a, t), state, lr=0.5)
        jp, js = optax_step(jp, js)
        assert p["z"].dtype == torch.complex128
        for name in p:
            assert_close(p[name], jp[name], f"step {k}: params '{name}'")
    assert_close(state["diff_updates"]["z"], js[0].diff_updates_memory["z"], "diff_updates.z")


def test_first_step_is_a_capped_gradient_step():
    params = {"x": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    grads = {"x": torch.tensor([6.0, 8.0], dtype=torch.float64)}  # norm 10
    p, _ = lbfgs_step(params, grads, lbfgs_init(params), lr=0.5)
    torch.testing.assert_close(p["x"], params["x"] - 0.5 * grads["x"] / 10, rtol=0, atol=1e-15)
    small = {"x": torch.tensor([0.06, 0.08], dtype=torch.float64)}  # norm 0.1: not scaled up
    p, _ = lbfgs_step(params, small, lbfgs_init(params), lr=0.5)
    torch.testing.assert_close(p["x"], params["x"] - 0.5 * small["x"], rtol=0, atol=1e-15)
    zero = {"x": torch.zeros(2, dtype=torch.float64)}
    p, state = lbfgs_step(params, zero, lbfgs_init(params))
    assert torch.equal(p["x"], params["x"]) and torch.isfinite(state["weights"]).all()


def test_quadratic_converges_to_solution():
    """On a strongly convex quadratic, L-BFGS at lr 1 reaches the minimizer."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    a = q @ q.T + 0.5 * torch.eye(8, dtype=torch.float64)
    bvec = torch.randn(8, generator=gen, dtype=torch.float64)
    x = {"x": torch.zeros(8, dtype=torch.float64)}
    state = lbfgs_init(x)
    for _ in range(40):
        x, state = lbfgs_step(x, {"x": a @ x["x"] - bvec}, state)
    torch.testing.assert_close(x["x"], torch.linalg.solve(a, bvec), rtol=1e-8, atol=1e-10)


# -- the state -------------------------------------------------------------------------

def test_state_structure_and_names():
    params = {"w": torch.zeros(5, 7, dtype=torch.float64), "b": torch.zeros(7),
              "s": torch.zeros((), dtype=torch.float64), "idx": torch.arange(3)}
    state = lbfgs_init(params, memory_size=4)
    assert vega.state_names(state) == [
        "diff_params.w", "diff_params.b", "diff_params.s",
        "diff_updates.w", "diff_updates.b", "diff_updates.s",
        "weights",
        "params_prev.w", "params_prev.b", "params_prev.s",
        "updates_prev.w", "updates_prev.b", "updates_prev.s",
        "step"]
    assert state["diff_params"]["w"].shape == (4, 5, 7)
    assert state["diff_updates"]["s"].shape == (4,)
    assert state["diff_params"]["b"].dtype == torch.float32
    assert state["params_prev"]["w"].shape == (5, 7)
    assert state["diff_params"]["idx"] is None and state["params_prev"]["idx"] is None
    assert state["weights"].shape == (4,) and state["weights"].dtype == torch.float64
    assert state["step"].dtype == torch.int32 and state["step"].dim() == 0
    assert int(state["step"]) == 0
    assert lbfgs_init(params)["weights"].shape == (10,)


def test_state_dtypes():
    f32 = lbfgs_init({"a": torch.zeros(3)})
    assert f32["weights"].dtype == torch.float32
    half = lbfgs_init({"h": torch.zeros(3, dtype=torch.bfloat16)})
    assert half["diff_params"]["h"].dtype == torch.float32
    assert half["weights"].dtype == torch.float32
    chosen = lbfgs_init({"a": torch.zeros(3)}, state_dtype=torch.float64)
    assert chosen["params_prev"]["a"].dtype == torch.float64
    assert chosen["weights"].dtype == torch.float64
    # a complex parameter's state is complex: float64 given, complex128 (not complex64),
    # and a complex dtype given, a real parameter's is its real counterpart
    wide = lbfgs_init({"z": torch.zeros(3, dtype=torch.complex64)}, state_dtype=torch.float64)
    assert wide["diff_params"]["z"].dtype == wide["params_prev"]["z"].dtype == torch.complex128
    assert wide["weights"].dtype == torch.float64
    real = lbfgs_init({"a": torch.zeros(3)}, state_dtype=torch.complex128)
    assert real["diff_updates"]["a"].dtype == torch.float64
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = LBFGS([z], state_dtype=torch.float64)
    z.grad = torch.ones(3, dtype=torch.complex64)
    opt.step()
    assert opt.state[z]["updates_prev"].dtype == torch.complex128


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_state_dtype_no_step_computes_in_is_refused_where_given(dtype):
    """A float dtype other than float32, float64, bfloat16 and float16 (a float8 one) is
    refused where it is given, naming it, as the spec optimizers refuse it: the step's
    arithmetic has no float8 kernels, and failed deep in torch at the first step."""
    words = rf"state_dtype={re.escape(str(dtype))} is not a dtype"
    with pytest.raises(ValueError, match=rf"^lbfgs_init: {words}"):
        lbfgs_init({"a": torch.zeros(3)}, state_dtype=dtype)
    with pytest.raises(ValueError, match=rf"^LBFGS: {words}"):
        LBFGS([torch.nn.Parameter(torch.zeros(3))], state_dtype=dtype)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = LBFGS([p])
    opt.param_groups[0]["state_dtype"] = dtype  # (set before the first step makes state)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=rf"^LBFGS: {words}"):
        opt.step()
    assert not opt.state


def test_a_conjugate_stepped_in_place_takes_its_update():
    """A complex parameter that is a conjugate view (``x.conj()``), stepped in place (the
    functional step's ``donate=True``, the class's step), takes the update the pure step
    gives its values: it stepped as a resolved copy, and kept its old values while its
    state and counter advanced."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.complex64, generator=g)
    grads = [torch.randn(4, 3, dtype=torch.complex64, generator=g) for _ in range(3)]
    ref, state = {"z": x.conj().resolve_conj()}, lbfgs_init({"z": x}, memory_size=2)
    for gr in grads:
        ref, state = lbfgs_step(ref, {"z": gr}, state, lr=0.1)
    z = x.clone().conj()
    donated = lbfgs_init({"z": z}, memory_size=2)
    for gr in grads:
        lbfgs_step({"z": z}, {"z": gr}, donated, lr=0.1, donate=True)
    assert z.is_conj()
    torch.testing.assert_close(z, ref["z"], rtol=0, atol=0)
    p = torch.nn.Parameter(x.clone().conj())
    opt = LBFGS([p], lr=0.1, memory_size=2)
    for gr in grads:
        p.grad = gr
        opt.step()
    torch.testing.assert_close(p.detach(), ref["z"], rtol=0, atol=0)


def test_a_sparse_parameter_is_refused_where_it_is_given():
    """A sparse parameter is refused by lbfgs_init and by the class's constructor, naming
    it, as the spec optimizers' refuse it: lbfgs_init made it dense state, and the class
    made it state at its first step, both of which the step then refused."""
    sparse = torch.ones(4).to_sparse()
    with pytest.raises(ValueError, match=r"^lbfgs_init: params leaf 's' is sparse"):
        lbfgs_init({"w": torch.ones(3), "s": sparse})
    with pytest.raises(ValueError, match=r"^LBFGS: parameter 1 of group 0 is sparse"):
        LBFGS([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(sparse)])


_EMPTY_RANK = """
import os, sys, torch, torch.distributed as dist, vega
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2)
w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
opt = vega.optim.LBFGS([w] if rank == 0 else [{"params": []}], lr=0.5, memory_size=2,
                       reduce_group=dist.group.WORLD)
alone = torch.nn.Parameter(w.detach().clone())
ref = vega.optim.LBFGS([alone], lr=0.5, memory_size=2)
for k in range(3):
    for p in (w, alone):
        p.grad = torch.full((2, 3), 1.0 + k) * p.detach()
    opt.step()
    ref.step()
if rank == 0:
    torch.testing.assert_close(w.detach(), alone.detach(), rtol=1e-6, atol=1e-6)
dist.destroy_process_group()
"""


def test_a_rank_without_parameters_takes_part_in_the_groups_steps(tmp_path):
    """LBFGS over a reduce_group on a rank that holds no parameter (ZeroRedundancyOptimizer
    with more ranks than parameters) makes the collectives of every step, of sums over
    nothing, and the rank that holds them steps as alone: its step read the state of a
    first parameter it has not (IndexError), and the other ranks waited for it."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    procs = [subprocess.Popen([sys.executable, "-c", _EMPTY_RANK, str(r),
                               str(tmp_path / "rendezvous")], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outs


def test_save_and_load_round_trip(tmp_path):
    params = make_params()
    u, y = consts()
    state = lbfgs_init(params, memory_size=3)
    p = params
    for _ in range(4):
        p, state = lbfgs_step(p, grad(p, u, y), state)
    save(tmp_path / "lbfgs.safetensors", state)
    back = load(tmp_path / "lbfgs.safetensors", like=lbfgs_init(params, memory_size=3))
    a, sa = lbfgs_step(p, grad(p, u, y), state)
    b, sb = lbfgs_step(p, grad(p, u, y), back)
    for name in a:
        assert torch.equal(a[name], b[name])
    assert int(sb["step"]) == 5


def test_step_saturates():
    params = {"x": torch.ones(2, dtype=torch.float64)}
    state = lbfgs_init(params, memory_size=3)
    state["step"] = torch.tensor(2 ** 31 - 1, dtype=torch.int32)
    p, state = lbfgs_step(params, {"x": torch.ones(2, dtype=torch.float64)}, state)
    assert int(state["step"]) == 2 ** 31 - 1 and torch.isfinite(p["x"]).all()


# -- purity, donation, pass-through -----------------------------------------------------

def _leaves(tree):
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _advanced_state(memory_size=4, steps=6):
    params = make_params()
    u, y = consts()
    state = lbfgs_init(params, memory_size=memory_size)
    p = params
    for _ in range(steps):
        p, state = lbfgs_step(p, grad(p, u, y), state)
    return p, state, grad(p, u, y)


def test_pure_by_default():
    p, state, g = _advanced_state()
    before = [x.clone() for x in _leaves((p, state, g))]
    new_p, new_state = lbfgs_step(p, g, state)
    for a, b in zip(_leaves((p, state, g)), before):
        assert torch.equal(a, b)
    old_ptrs = {x.data_ptr() for x in _leaves((p, state, g))}
    for x in _leaves((new_p, new_state)):
        assert x.data_ptr() not in old_ptrs  # nothing returned aliases an input
    assert int(new_state["step"]) == int(state["step"]) + 1


def test_donate_updates_in_place_and_agrees_with_pure():
    p, state, g = _advanced_state()
    want_p, want_state = lbfgs_step(p, g, state)
    ids = [id(x) for x in _leaves((p, state))]
    got_p, got_state = lbfgs_step(p, g, state, donate=True)
    assert [id(x) for x in _leaves((got_p, got_state))] == ids
    for a, b in zip(_leaves((got_p, got_state)), _leaves((want_p, want_state))):
        assert torch.equal(a, b)
    assert vega.state_names(got_state) == vega.state_names(want_state)


def test_non_float_leaves_pass_through_and_a_leaf_without_gradients_stays():
    params = {**make_params(), "idx": torch.arange(4), "frozen": torch.ones(2, dtype=torch.float64)}
    u, y = consts()
    state = lbfgs_init(params, memory_size=3)
    p = params
    for _ in range(5):
        g = {**grad(p, u, y), "idx": None, "frozen": None}
        p, state = lbfgs_step(p, g, state)
    assert p["idx"] is params["idx"] and state["diff_params"]["idx"] is None
    # (a None gradient is a zero one: a leaf that never has one never moves)
    assert torch.equal(p["frozen"], params["frozen"])
    assert torch.equal(state["diff_params"]["frozen"], torch.zeros(3, 2, dtype=torch.float64))
    # the stepped leaves follow optax over just those leaves
    _, _, jp, _ = run_both(memory_size=3, steps=5)
    for name in jp:
        assert_close(p[name], jp[name], name)


def _quadratic(dim: int = 6):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    return q @ q.T + torch.eye(dim, dtype=torch.float64), torch.randn(dim, generator=gen,
                                                                       dtype=torch.float64)


def test_a_missing_gradient_is_a_zero_gradient():
    # every other step one parameter has no gradient: the class and the functional step
    # take it as a zero gradient (as torch.optim.LBFGS does), bitwise, and stay bounded on a
    # convex quadratic (leaving it out paired ring-buffer slots of other steps with this
    # step's weight: the loss reached 1e15)
    a, c = _quadratic()
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    b = torch.nn.Parameter(torch.full((2,), 0.5, dtype=torch.float64))
    opt = LBFGS([w, b], lr=1.0, memory_size=3)
    params = {"w": w.detach().clone(), "b": b.detach().clone()}
    state = lbfgs_init(params, memory_size=3)

    def loss_of(x):
        return 0.5 * x @ a @ x - c @ x
    for k in range(40):
        opt.zero_grad()
        loss_of(torch.cat([w, b])).backward()
        if k % 2:
            b.grad = None
        opt.step()
        x = torch.cat([params["w"], params["b"]]).requires_grad_()
        gw, gb = torch.autograd.grad(loss_of(x), x)[0].split([4, 2])
        params, state = lbfgs_step(params, {"w": gw, "b": None if k % 2 else gb}, state)
        assert torch.equal(w.detach(), params["w"]) and torch.equal(b.detach(), params["b"]), k
    assert torch.equal(opt.state[b]["diff_updates"], state["diff_updates"]["b"])
    assert abs(float(loss_of(torch.cat([w, b])))) < 10  # (it was 4.8e15)


def test_requires_grad_is_kept():
    params = {"x": torch.ones(3, dtype=torch.float64, requires_grad=True)}
    p, _ = lbfgs_step(params, {"x": torch.ones(3, dtype=torch.float64)}, lbfgs_init(params))
    assert p["x"].requires_grad and p["x"].is_leaf


def test_float32_tracks_float64():
    u, y = consts(torch.float32)
    u64, y64 = consts()
    p32, p64 = make_params(torch.float32), make_params()
    s32, s64 = lbfgs_init(p32, memory_size=5), lbfgs_init(p64, memory_size=5)
    for _ in range(8):
        p32, s32 = lbfgs_step(p32, grad(p32, u, y), s32, lr=0.5)
        p64, s64 = lbfgs_step(p64, grad(p64, u64, y64), s64, lr=0.5)
    assert p32["w"].dtype == torch.float32 and s32["weights"].dtype == torch.float32
    for name in p64:
        torch.testing.assert_close(p32[name].double(), p64[name], rtol=1e-3, atol=1e-4)


def test_inner_products_of_a_long_float32_leaf_on_the_cpu():
    """torch.dot on the CPU adds float32 products into a few float32 sums that stop growing
    (2**22 squares of 0.1 came out 0.09% off on one thread, products of 0.1 and 0.3 0.3%
    off). The inner products of a long float32 leaf are torch.sum's pairwise sum of its
    products: the first step's norm and the first curvature pair's weight are those of the
    float64 values within 1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 2**22 + 3
        p0 = {"w": torch.zeros(n)}
        g1, g2 = torch.full((n,), 0.1), torch.full((n,), 0.3)
        p1, state = lbfgs_step(p0, {"w": g1}, lbfgs_init(p0, memory_size=2), lr=1.0)
        norm = torch.linalg.vector_norm(g1.double()).item()
        assert p1["w"][0].item() == pytest.approx(-g1[0].item() / norm, rel=1e-6)
        _, state = lbfgs_step(p1, {"w": g2}, state, lr=1.0)
        rho = 1 / torch.dot(p1["w"].double(), g2.double() - g1.double()).item()
        assert state["weights"][0].item() == pytest.approx(rho, rel=1e-6)
    finally:
        torch.set_num_threads(threads)


# -- no host sync: one compiled graph ----------------------------------------------------

def test_compiles_fullgraph_and_matches_eager():
    params = make_params()
    u, y = consts()
    sched = vega.schedule.cosine_decay(init_value=0.8, decay_steps=10)

    def train_step(p, state):
        return lbfgs_step(p, grad(p, u, y), state, lr=sched)

    compiled = torch.compile(train_step, backend="eager", fullgraph=True)
    pe, se = params, lbfgs_init(params, memory_size=3)
    pc, sc = params, lbfgs_init(params, memory_size=3)
    for _ in range(5):
        pe, se = train_step(pe, se)
        pc, sc = compiled(pc, sc)
    for a, b in zip(_leaves((pc, sc)), _leaves((pe, se))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# -- validation ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10", None])
def test_memory_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=re.escape(f"memory_size={bad!r}")):
        lbfgs_init(make_params(), memory_size=bad)


@pytest.mark.parametrize("bad,msg", [
    (-0.1, "lr=-0.1 must be a finite number >= 0"), (math.nan, "lr=nan"),
    (math.inf, "lr=inf"), ("fast", "lr='fast'"), (True, "lr=True"),
    (torch.tensor([0.1]), "lr must be a 0-d float tensor"),
    (torch.tensor(1), "lr must be a 0-d float tensor"),
])
def test_lr_is_validated(bad, msg):
    params = make_params()
    with pytest.raises(ValueError, match=re.escape(msg)):
        lbfgs_step(params, params, lbfgs_init(params), lr=bad)


def test_step_validates_its_inputs():
    params = make_params()
    state = lbfgs_init(params, memory_size=4)
    with pytest.raises(ValueError, match=r"memory_size=5, but the state was made with "
                                         r"memory_size=4"):
        lbfgs_step(params, params, state, memory_size=5)
    lbfgs_step(params, params, state, memory_size=4)  # agreeing is fine
    with pytest.raises(ValueError, match="memory_size=0"):
        lbfgs_step(params, params, state, memory_size=0)
    with pytest.raises(ValueError, match="scale_init_precond=1"):
        lbfgs_step(params, params, state, scale_init_precond=1)
    with pytest.raises(ValueError, match="donate='yes'"):
        lbfgs_step(params, params, state, donate="yes")
    with pytest.raises(ValueError, match="grads do not have the structure of params"):
        lbfgs_step(params, {"w": params["w"]}, state)
    bad = {**params, "w": torch.zeros(7, 5, dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"grads leaf 'w' has shape \(7, 5\)"):
        lbfgs_step(params, bad, state)
    with pytest.raises(ValueError, match="state must be the dict that lbfgs_init returns"):
        lbfgs_step(params, params, [state])
    with pytest.raises(ValueError, match="make it with lbfgs_init"):
        lbfgs_step(params, params, vega.adam_init(params))
    with pytest.raises(ValueError, match=r"state\['step'\] must be a 0-d int32 tensor"):
        lbfgs_step(params, params, {**state, "step": torch.tensor(0)})
    # no curvature pairs (weights of shape (0,)), a counter on another device than the
    # weights: refused by name (they failed in the recursion's remainder and indexing)
    with pytest.raises(ValueError, match=r"state\['weights'\] must be a float32 or float64 "
                                         r"tensor of shape \(memory_size,\)"):
        lbfgs_step(params, params, {**state, "weights": torch.zeros(0, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"state\['step'\] must be a 0-d int32 tensor on cpu"):
        lbfgs_step(params, params,
                   {**state, "step": torch.zeros((), dtype=torch.int32, device="meta")})
    with pytest.raises(ValueError, match="state field 'params_prev' does not have the structure"):
        lbfgs_step(params, params, {**state, "params_prev": {"w": params["w"]}})
    other = lbfgs_init({**params, "w": torch.zeros(5, 6, dtype=torch.float64)}, memory_size=4)
    with pytest.raises(ValueError, match=r"state leaf 'diff_params.w' has shape \(4, 5, 6\)"):
        lbfgs_step(params, params, other)
    with pytest.raises(ValueError, match="params leaf 'w' is a float, not a tensor"):
        lbfgs_init({"w": 1.0})
    with pytest.raises(TypeError, match="unexpected keyword"):
        lbfgs_step(params, params, state, momentum=0.9)


@pytest.mark.parametrize("key,value,how", [
    ("max_grad_norm", 1.0, r"vega\.clip_by_global_norm\(grads, max_norm\) clips them"),
    ("loss_scale", vega.LossScale.dynamic(), r"LossScale\.unscale\(grads\) unscales them"),
    ("skip_nonfinite", True, r"vega\.grads_finite\(grads\) checks them"),
])
def test_the_spec_optimizers_fused_options_are_refused_saying_what_does_them(key, value, how):
    # AdamW(..., max_grad_norm=1.0) turned into LBFGS(...) was Python's bare "unexpected
    # keyword argument": the refusal says L-BFGS has no fused options, and what does each
    params = {"w": torch.zeros(3)}
    said = rf"{key}=.* is an option of vega's spec optimizers, fused into their kernels; " \
           rf"L-BFGS, written in the runtime, takes none of .*: before its step, {how}"
    with pytest.raises(TypeError, match="LBFGS: " + said):
        vega.optim.LBFGS([torch.nn.Parameter(torch.zeros(3))], **{key: value})
    with pytest.raises(TypeError, match="lbfgs_step: " + said):
        lbfgs_step(params, params, lbfgs_init(params), **{key: value})


def test_a_backend_is_refused_saying_lbfgs_has_none():
    # README.md: every step and class of a spec takes backend=; L-BFGS's are torch operations
    params = {"w": torch.zeros(3)}
    said = r"backend='c' chooses the kernels of vega's spec optimizers; L-BFGS, written in " \
           "the runtime, steps in torch's operations on the parameters' device"
    with pytest.raises(TypeError, match="LBFGS: " + said):
        vega.optim.LBFGS([torch.nn.Parameter(torch.zeros(3))], backend="c")
    with pytest.raises(TypeError, match="lbfgs_step: " + said):
        lbfgs_step(params, params, lbfgs_init(params), backend="c")


# -- it trains: full-batch logistic regression, functional and as a torch.optim class ---

def logistic_data():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(200, 6, generator=gen, dtype=torch.float64)
    w_true = torch.randn(6, generator=gen, dtype=torch.float64)
    y = (x @ w_true + 0.5 * torch.randn(200, generator=gen, dtype=torch.float64) > 0).double()
    return x, y


def test_logistic_regression_loss_decreases():
    x, y = logistic_data()

    def objective(p):
        return torch.nn.functional.binary_cross_entropy_with_logits(x @ p["w"] + p["b"], y)

    p = {"w": torch.zeros(6, dtype=torch.float64), "b": torch.zeros((), dtype=torch.float64)}
    state = lbfgs_init(p)
    start = float(objective(p))
    losses = []
    for _ in range(30):
        g = torch.func.grad(objective)(p)
        p, state = lbfgs_step(p, g, state, lr=1.0)
        losses.append(float(objective(p)))
    assert losses[-1] < 0.6 * start
    assert all(math.isfinite(v) for v in losses)
    gnorm = torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in
                                                torch.func.grad(objective)(p).values()]))
    assert float(gnorm) < 1e-6  # converged to the optimum


def test_optimizer_class_matches_functional_and_trains():
    x, y = logistic_data()
    lin = torch.nn.Linear(6, 1, dtype=torch.float64)
    opt = LBFGS(lin.parameters(), lr=0.8, memory_size=4)
    ref = {n: t.detach().clone() for n, t in lin.named_parameters()}
    state = lbfgs_init(ref, memory_size=4)
    losses = []
    for _ in range(15):
        def closure():
            opt.zero_grad()
            out = torch.nn.functional.binary_cross_entropy_with_logits(lin(x).squeeze(1), y)
            out.backward()
            return out
        losses.append(float(opt.step(closure).detach()))
        g = torch.func.grad(lambda q: torch.nn.functional.binary_cross_entropy_with_logits(
            torch.func.functional_call(lin, q, (x,)).squeeze(1), y))(ref)
        ref, state = lbfgs_step(ref, g, state, lr=0.8)
        # autograd and torch.func sum the gradient in different orders: 1e-9 over 15 steps
        for n, t in lin.named_parameters():
            torch.testing.assert_close(t.detach(), ref[n], rtol=1e-9, atol=1e-12)
    assert losses[-1] < losses[0]
    # state_dict round trip keeps dtypes and the int32 counter
    sd = opt.state_dict()
    lin2 = torch.nn.Linear(6, 1, dtype=torch.float64)
    lin2.load_state_dict(lin.state_dict())
    opt2 = LBFGS(lin2.parameters(), lr=0.8, memory_size=4)
    opt2.load_state_dict(sd)
    first = opt2.state[lin2.weight]
    assert first["step"].dtype == torch.int32 and int(first["step"]) == 15
    assert first["weights"].dtype == torch.float64 and first["diff_params"].shape == (4, 1, 6)


@pytest.mark.parametrize("state_dtype", [None, torch.float64, torch.float32,
                                         torch.complex128])
def test_optimizer_class_steps_complex_parameters_as_the_functional_step(state_dtype):
    """A complex parameter keeps complex state under a real ``state_dtype`` (its complex
    counterpart), in the class as in ``lbfgs_init``, and a real one real state under a
    complex ``state_dtype`` (its real counterpart): the class's state took the real dtype
    for the complex parameter, and both forms the complex one for the real parameter, and
    the first step failed in the curvature pair's shapes."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(6, 4, generator=gen, dtype=torch.complex64)
    t = torch.randn(6, generator=gen, dtype=torch.complex64)
    z = torch.nn.Parameter(torch.randn(4, generator=gen, dtype=torch.complex64))
    x = torch.nn.Parameter(torch.randn(3, generator=gen))
    opt = LBFGS([z, x], lr=0.5, memory_size=3, state_dtype=state_dtype)
    ref = {"z": z.detach().clone(), "x": x.detach().clone()}
    state = lbfgs_init(ref, memory_size=3, state_dtype=state_dtype)

    def grads(p):
        return {"z": a.conj().T @ (a @ p["z"] - t), "x": 2.0 * (p["x"] - 1.0)}
    for _ in range(5):
        g = grads({"z": z.detach(), "x": x.detach()})
        z.grad, x.grad = g["z"], g["x"]
        opt.step()
        ref, state = lbfgs_step(ref, grads(ref), state, lr=0.5)
        assert torch.equal(z.detach(), ref["z"]) and torch.equal(x.detach(), ref["x"])
    for f in ("diff_params", "diff_updates", "params_prev", "updates_prev"):
        assert torch.equal(opt.state[z][f], state[f]["z"]), f
        assert torch.equal(opt.state[x][f], state[f]["x"]), f
    assert opt.state[z]["diff_params"].is_complex()
    assert not opt.state[x]["diff_params"].is_complex()
    assert torch.equal(opt.state[z]["weights"], state["weights"])
    assert int(opt.state[z]["step"]) == 5


@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_load_state_dict_refuses_a_state_that_is_not_dense(kind):
    """A sparse or nested state entry is refused by name and nothing is loaded (it was
    loaded, and the next step failed in torch's index_copy_ or its nested sizes)."""
    import warnings
    lin = torch.nn.Linear(3, 1)
    opt = LBFGS(lin.parameters(), lr=0.5, memory_size=2)
    lin(torch.ones(2, 3)).sum().backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())  # (torch's shares the live state's dicts)
    weights = sd["state"][0]["weights"]
    with warnings.catch_warnings():  # (torch's prototype note on nested tensors)
        warnings.simplefilter("ignore")
        sd["state"][0]["weights"] = weights.to_sparse() if kind == "sparse" else \
            torch.nested.nested_tensor([weights])
    before = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    with pytest.raises(ValueError, match=r"^LBFGS.load_state_dict: state 'weights' of parameter "
                                         r"id 0 is (sparse \(torch.sparse_coo\)|a nested tensor); "
                                         r"L-BFGS keeps dense"):
        opt.load_state_dict(sd)
    assert all(torch.equal(opt.state[lin.weight][k], v) for k, v in before.items())


def test_a_sparse_gradient_is_refused_naming_its_parameter():
    """An embedding's sparse gradient (``sparse=True``) is refused naming which parameter's
    it is, as the spec optimizers' classes name it, and nothing is written."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3, sparse=True), torch.nn.Linear(3, 1))
    opt = LBFGS([*model[1].parameters(), *model[0].parameters()], lr=0.5)
    model(torch.tensor([1, 3])).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^LBFGS does not support sparse gradients: the "
                                         r"gradient of parameter 2 of group 0 is "
                                         r"torch.sparse_coo"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state


def test_load_state_dict_refuses_state_for_a_lazy_modules_uninitialized_parameter():
    """A state loaded for a lazy module's parameter before its first forward pass (its shape
    not known) is refused by name, and nothing is loaded; after the model's state_dict it
    loads and steps on as the saved optimizer does."""
    torch.manual_seed(0)
    saved, model = torch.nn.LazyLinear(2), torch.nn.LazyLinear(2)
    opt, fresh = LBFGS(saved.parameters(), lr=0.5), LBFGS(model.parameters(), lr=0.5)
    x = torch.randn(3, 4)
    saved(x).square().sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"^LBFGS.load_state_dict: parameter 0 of group 0 is "
                                         r"uninitialized \(a lazy module's"):
        fresh.load_state_dict(opt.state_dict())
    assert not fresh.state
    model.load_state_dict(saved.state_dict())
    fresh.load_state_dict(opt.state_dict())
    for m, o in ((saved, opt), (model, fresh)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))


def _torch_lbfgs_state():
    lin = torch.nn.Linear(6, 1, dtype=torch.float64)
    opt = torch.optim.LBFGS(lin.parameters(), lr=0.1)
    x = torch.randn(5, 6, dtype=torch.float64)

    def closure():
        opt.zero_grad()
        loss = lin(x).pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    return opt.state_dict()


def _set(field, value, pid=0):
    def change(sd):
        if value is None:
            del sd["state"][pid][field]
        else:
            sd["state"][pid][field] = value(sd["state"][pid][field])
    return change


BAD_LOADS = [
    ("weights missing", _set("weights", None), r"the first parameter's state\['weights'\] must "
     r"be a float32 or float64 tensor of shape \(4,\) \(memory_size\), got None"),
    ("params_prev missing", _set("params_prev", None, 1), r"state leaf 'params_prev\.1' is "
     r"missing"),
    ("diff_params transposed", _set("diff_params", lambda t: t.transpose(1, 2).contiguous()),
     r"state leaf 'diff_params\.0' has shape \(4, 6, 1\) on cpu, but needs \(4, 1, 6\)"),
    ("diff_params float32", _set("diff_params", lambda t: t.float()),
     r"state leaf 'diff_updates\.0' has dtype torch\.float64, the other state leaves of its "
     r"parameter torch\.float32"),
    ("step -1", _set("step", lambda t: torch.tensor(-1, dtype=torch.int32)),
     r"the first parameter's state\['step'\] is -1; a step counter is a whole number"),
    ("step float", _set("step", lambda t: t.float()),
     r"the first parameter's state\['step'\] must be a 0-d int32 tensor"),
    ("weights of another memory", _set("weights", lambda t: t[:2]),
     r"the first parameter's state\['weights'\] must be a float32 or float64 tensor of "
     r"shape \(4,\)"),
    ("a shared entry in another parameter's state",
     lambda sd: sd["state"][1].__setitem__("step", torch.tensor(3, dtype=torch.int32)),
     r"the state of parameter 1 has .*'step'.*; \['step'\] are the first parameter's alone"),
    ("lr -1", lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0), r"lr=-1\.0 must be"),
    ("memory_size 0", lambda sd: sd["param_groups"][0].__setitem__("memory_size", 0),
     r"memory_size=0 must be a positive integer"),
    ("torch.optim.LBFGS's", None, r"the group of the state has no 'memory_size', "
     r"'scale_init_precond', 'state_dtype': it is not the state of vega\.optim\.LBFGS"),
    ("not a state dict", lambda sd: sd.pop("param_groups"), r"a state_dict is a dict with "
     r"'state'"),
]


@pytest.mark.parametrize("change,message", [b[1:] for b in BAD_LOADS],
                         ids=[b[0] for b in BAD_LOADS])
def test_load_state_dict_refuses_what_a_step_cannot_read(change, message):
    """Each refused before the optimizer changes (they were loaded, and the next step failed
    in a KeyError or torch's index_copy_, the state before gone); it still steps."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 1, dtype=torch.float64)
    opt = LBFGS(lin.parameters(), lr=0.5, memory_size=4)
    for _ in range(3):
        lin.zero_grad()
        lin(torch.randn(5, 6, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    if change is None:
        sd = _torch_lbfgs_state()
    else:
        change(sd)
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in lin.parameters()}
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                            for g in opt.param_groups])
    with pytest.raises(ValueError, match=r"^LBFGS\.load_state_dict: " + message):
        opt.load_state_dict(sd)
    for p in lin.parameters():
        assert opt.state[p].keys() == before[id(p)].keys()
        assert all(torch.equal(opt.state[p][k], v) for k, v in before[id(p)].items())
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    lin(torch.ones(1, 6, dtype=torch.float64)).sum().backward()
    opt.step()


def test_a_group_put_in_param_groups_directly_is_refused_not_left_unstepped():
    """add_param_group refuses a second group; one appended to param_groups by hand (or the
    list emptied) was never stepped: the step read the first group alone."""
    torch.manual_seed(0)
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = LBFGS([p], lr=0.1)
    opt.param_groups.append({**opt.param_groups[0], "params": [q]})
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    before = p.detach().clone(), q.detach().clone()
    with pytest.raises(ValueError, match="2 parameter groups.*one group"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and not opt.state
    opt.param_groups.clear()
    with pytest.raises(ValueError, match="0 parameter groups"):
        opt.step()


@pytest.mark.parametrize("key", ["lr", "memory_size", "scale_init_precond", "state_dtype"])
def test_a_setting_deleted_from_the_group_is_named(key):
    """A group without one of its settings (deleted from it) failed the step with a bare
    KeyError of the key, as the spec classes' did: the step names the group and what it
    lacks, before the closure, and leaves the parameter and state as they were."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = LBFGS([p], lr=0.1, memory_size=3)
    p.grad = torch.ones(3)
    opt.step()
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    value = opt.param_groups[0].pop(key)
    calls = []
    with pytest.raises(ValueError, match=rf"^LBFGS: group 0 has no '{key}'"):
        opt.step(lambda: calls.append(1))
    assert not calls and torch.equal(p, before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    opt.param_groups[0][key] = value
    opt.step()
    assert int(opt.state[p]["step"]) == 2


@pytest.mark.parametrize("keep", [True, False])
def test_a_plain_dict_assigned_to_state_steps(keep):
    """``opt.state = {...}`` (a plain dict, not torch's defaultdict: docs/conventions.md says
    a new mapping works) stepped the spec classes and failed LBFGS's step with a KeyError
    that printed the whole first parameter."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = LBFGS(ps, lr=0.1), LBFGS(twin, lr=0.1)
    for k in range(3):
        for p, q in zip(ps, twin):
            p.grad = q.grad = torch.full_like(p, 1.0 + k)
        opt.step()
        ref.step()
        if k == 0:  # (the state kept, as a dict, or started again, as a clear() does)
            opt.state = dict(opt.state) if keep else {}
            if not keep:
                ref.state.clear()
    for p, q in zip(ps, twin):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_optimizer_class_validates():
    lin = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="lr=-1"):
        LBFGS(lin.parameters(), lr=-1)
    with pytest.raises(ValueError, match="memory_size=0"):
        LBFGS(lin.parameters(), memory_size=0)
    with pytest.raises(ValueError, match="parameter groups"):
        LBFGS([{"params": [lin.weight]}, {"params": [lin.bias]}])
    # torch.optim.LBFGS's keywords: what they are here
    with pytest.raises(TypeError, match=r"history_size=5 is torch.optim.LBFGS's name; give "
                                        r"memory_size=\.\.\."):
        LBFGS(lin.parameters(), history_size=5)
    for key, value in (("max_iter", 20), ("line_search_fn", "strong_wolfe"),
                       ("tolerance_grad", 1e-7)):
        with pytest.raises(TypeError, match=f"{key}=.* torch.optim.LBFGS's line search and "
                                            "inner loop; vega's LBFGS is optax's rule"):
            LBFGS(lin.parameters(), **{key: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'momentum'"):
        LBFGS(lin.parameters(), momentum=0.9)
    half = LBFGS(torch.nn.Linear(2, 1).half().parameters())
    for p in half.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    half.step()
    st = half.state[half.param_groups[0]["params"][0]]
    assert st["diff_params"].dtype == torch.float32 and st["weights"].dtype == torch.float32


def test_load_state_dict_hooks_run_as_torchs():
    """A pre-hook's answer is what is loaded, and a post-hook's changes stay (the saved
    values were cast in after torch's loading ran the hooks, undoing them)."""
    lin = torch.nn.Linear(3, 1, dtype=torch.float64)
    opt = LBFGS(lin.parameters(), lr=0.5, memory_size=3)
    for _ in range(2):
        opt.zero_grad()
        lin(torch.ones(2, 3, dtype=torch.float64)).square().sum().backward()
        opt.step()
    saved = opt.state_dict()
    other = LBFGS(lin.parameters(), lr=0.5, memory_size=3)

    def pre(o, sd):
        sd = dict(sd)
        sd["state"] = {i: {k: (torch.zeros_like(v) if k == "diff_params" else v)
                           for k, v in st.items()} for i, st in sd["state"].items()}
        return sd
    other.register_load_state_dict_pre_hook(pre)
    other.register_load_state_dict_post_hook(
        lambda o: o.state[lin.weight]["weights"].fill_(7.0))
    other.load_state_dict(saved)
    assert not other.state[lin.weight]["diff_params"].any()
    assert (other.state[lin.weight]["weights"] == 7.0).all()
    assert opt.state[lin.weight]["diff_params"].any()  # (the saved dict is the caller's)


def _steps_alike(opt, twin) -> None:
    """Two more steps of LBFGS ``opt`` (of one parameter) and of its copy ``twin``, on the
    same gradients of their parameters: the parameters agree bitwise."""
    p, q = opt.param_groups[0]["params"][0], twin.param_groups[0]["params"][0]
    for k in range(2, 4):
        p.grad = p.detach() * (k + 1)
        q.grad = q.detach() * (k + 1)
        opt.step()
        twin.step()
    assert torch.equal(q.detach(), p.detach())


@pytest.mark.parametrize("copied", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))])
def test_a_copied_or_unpickled_optimizer_steps_as_the_original(copied):
    """The copy keeps ``reduce_group``, which a step reads: torch's ``__getstate__`` holds
    only the defaults, state and groups, and the copy's step failed on the attribute."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = LBFGS([p], lr=0.5, memory_size=3)
    for k in range(2):
        p.grad = p.detach() * (k + 1)
        opt.step()
    twin = copied(opt)
    _steps_alike(opt, twin)


def test_an_optimizer_pickled_without_reduce_group_steps_as_the_original(monkeypatch):
    """A pickle of torch's entries alone (defaults, state, groups), as a vega whose LBFGS
    kept no ``reduce_group`` in its ``__getstate__`` wrote it, unpickles into an LBFGS that
    steps as the original, without a group, as a spec optimizer's such pickle does: its
    step failed on the missing attribute."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = LBFGS([p], lr=0.5, memory_size=3)
    for k in range(2):
        p.grad = p.detach() * (k + 1)
        opt.step()
    with monkeypatch.context() as m:
        m.setattr(LBFGS, "__getstate__", torch.optim.Optimizer.__getstate__)
        data = pickle.dumps(opt)
    twin = pickle.loads(data)
    assert twin.reduce_group is None
    _steps_alike(opt, twin)


def test_memory_size_changed_after_the_first_step_is_refused():
    """The ring buffers keep the first step's memory_size: another in the group was ignored
    (the step went on with the old history's size), now refused, the state unchanged."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = LBFGS([p], lr=0.5, memory_size=3)
    p.grad = p.detach().clone()
    opt.step()
    opt.param_groups[0]["memory_size"] = 5
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="memory_size=5, but the state holds 3"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in opt.state[p].items())
    opt.param_groups[0]["memory_size"] = 3
    opt.step()
    assert int(opt.state[p]["step"]) == 2


def _reshaped(opt, p):
    p.data = torch.randn(3, 4)


def _complex(opt, p):
    p.data = torch.randn(4, 3, dtype=torch.complex64)


def _expanded(opt, p):
    p.data = torch.zeros(1, 3).expand(4, 3)


def _listed_again(opt, p):
    opt.param_groups[0]["params"].append(opt.param_groups[0]["params"][0])


@pytest.mark.parametrize("change, message", [
    (_reshaped, r"^LBFGS: parameter 1 of group 0: state leaf 'diff_params' has shape "
                r"\(3, 4, 3\) on cpu, but needs \(3, 3, 4\) on cpu"),
    (_complex, r"^LBFGS: parameter 1 of group 0: state leaf 'diff_params' has dtype "
               r"torch.float32, the parameter torch.complex64"),
    (_expanded, r"^LBFGS: parameter 1 of group 0 has elements at one memory location"),
    (_listed_again, r"^LBFGS: parameter 2 of group 0 shares memory with parameter 0 of "
                    r"group 0: a step in place would write that memory twice"),
])
def test_a_parameter_changed_after_the_first_step_is_refused_by_name(change, message):
    """A parameter given another shape, made complex or expanded after the first step (or
    listed again) is refused naming it, before anything is written: the step failed inside
    torch's arithmetic (a RuntimeError naming no parameter), the expanded one after writing
    part of the state, and one listed twice was written twice."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(2, generator=gen)),
          torch.nn.Parameter(torch.randn(4, 3, generator=gen))]
    opt = LBFGS(ps, lr=0.1, memory_size=3)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    change(opt, ps[1])
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for p in ps]
    with pytest.raises(ValueError, match=message):
        opt.step()
    for p, (value, st) in zip(ps, before):
        assert torch.equal(p.detach(), value)
        assert all(torch.equal(v, st[k]) for k, v in opt.state[p].items())


@pytest.mark.parametrize("where, message", [
    ("param", r"^lbfgs_step: params leaf 'b' has elements at one memory location"),
    ("state", r"^lbfgs_step: state leaf 'updates_prev.b' has elements at one memory location"),
    ("grad", r"^lbfgs_step: grads leaf 'b' shares memory with params leaf 'a'"),
])
def test_a_donated_step_that_cannot_write_in_place_is_refused_by_name(where, message):
    """The functional step in place (donate=True) checks what it writes before writing, as
    the class does: an expanded parameter or state failed inside torch's arithmetic (a
    RuntimeError naming no leaf) after the other parameters and the previous updates had
    been written, and a gradient that is another parameter's memory was read after that
    parameter had been written."""
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(4, generator=gen), "b": torch.randn(4, generator=gen)}
    state = lbfgs_init(params, memory_size=3)
    grads = {k: torch.randn(4, generator=gen) for k in params}
    params, state = lbfgs_step(params, grads, state, lr=0.1, donate=True)
    grads = {k: torch.randn(4, generator=gen) for k in params}
    if where == "param":
        params["b"] = torch.zeros(1).expand(4)
    elif where == "state":
        state["updates_prev"]["b"] = torch.zeros(1).expand(4)
    else:
        grads["b"] = params["a"]
    before = copy.deepcopy((params, state, grads))
    with pytest.raises(ValueError, match=message):
        lbfgs_step(params, grads, state, lr=0.1, donate=True)
    for was, now in zip(jax.tree_util.tree_leaves(before),
                        jax.tree_util.tree_leaves((params, state, grads))):
        assert torch.equal(was, now)


def test_a_parameter_made_of_integers_after_it_was_given_is_refused_by_name():
    """A tensor given as a parameter (one that requires no gradient: torch lets its data
    become integers) made of integers after the first step is refused naming it, as the
    class refuses it when given, before anything is written: the step truncated its new
    values to integers."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(2, generator=gen), torch.randn(4, 3, generator=gen)]
    opt = LBFGS(ps, lr=0.1, memory_size=3)
    for k in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        if k == 1:
            ps[1].data = (ps[1].data * 10).long()
            before = [(p.clone(), {n: v.clone() for n, v in opt.state[p].items()}) for p in ps]
            with pytest.raises(ValueError, match=r"^LBFGS: parameter 1 of group 0 is of dtype "
                                                 r"torch.int64; LBFGS can only optimize"):
                opt.step()
            for p, (value, st) in zip(ps, before):
                assert torch.equal(p, value)
                assert all(torch.equal(v, st[n]) for n, v in opt.state[p].items())
        else:
            opt.step()


def _raises_type_error(step):
    raise TypeError("the schedule's own error")


@pytest.mark.parametrize("api", ["class", "functional"])
@pytest.mark.parametrize("lr,error,msg", [
    (10**400, ValueError, "lr=1000"),  # (an OverflowError)
    (torch.tensor(0.1, device="meta"), ValueError, "lr is a meta tensor"),
    (lambda step: "fast", ValueError, "hyperparameter 'lr': its schedule returned 'fast'"),
    (lambda step: torch.full((2,), 0.1), ValueError, r"returned a tensor of shape \(2,\)"),
    (_raises_type_error, TypeError, "the schedule's own error"),
], ids=["10**400", "meta", "schedule-str", "schedule-vector", "schedule-raises"])
def test_a_refused_lr_is_named_before_anything_is_written(api, lr, error, msg):
    """An lr the step cannot take is refused by name, before the history is written: a
    schedule was called after the step had written its curvature pair in place (the ring
    buffers and weights changed, the step refused), and what it returned was not checked
    (TypeError: bad operand type for unary -: 'str'; a size mismatch); a meta tensor
    failed deep in torch ('Cannot copy out of meta tensor') and 10**400 raised
    OverflowError."""
    params = {k: v.clone() for k, v in make_params().items()}
    state = lbfgs_init(params, memory_size=3)
    for k in range(2):  # (a history to keep)
        params, state = lbfgs_step(params, {n: torch.randn_like(p) for n, p in params.items()},
                                   state, lr=0.1)
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    if api == "functional":
        before = copy.deepcopy((params, state))
        with pytest.raises(error, match=msg):
            lbfgs_step(params, grads, state, lr=lr, donate=True)
        now = (params, state)
    else:
        ps = [torch.nn.Parameter(p.clone()) for p in params.values()]
        opt = LBFGS(ps, lr=0.1, memory_size=3)
        for p, g in zip(ps, grads.values()):
            p.grad = g
        opt.step()
        before = copy.deepcopy(([p.detach() for p in ps], dict(opt.state)))
        opt.param_groups[0]["lr"] = lr
        with pytest.raises(error, match=msg):
            opt.step()
        now = ([p.detach() for p in ps], dict(opt.state))
    flat = [x for x in torch.utils._pytree.tree_leaves(before) if isinstance(x, torch.Tensor)]
    got = [x for x in torch.utils._pytree.tree_leaves(now) if isinstance(x, torch.Tensor)]
    assert len(flat) == len(got) and all(torch.equal(a, b) for a, b in zip(flat, got))


def test_the_class_step_without_any_gradient_changes_nothing():
    """``LBFGS.step`` with no parameter holding a gradient makes no update: no state is
    made, and a made one keeps its counter and its history (stepped with zero gradients,
    the counter advanced and a curvature pair of the parameters' last move was recorded)."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = LBFGS([p], lr=0.5, memory_size=3)
    assert opt.step(lambda: 7.0) == 7.0 and not opt.state
    p.grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    moved = p.detach().clone()
    p.grad = None
    opt.step()
    assert torch.equal(p.detach(), moved)
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("reorder", ["reversed", "inserted"])
def test_parameters_reordered_in_the_closure_keep_the_history(reorder):
    """The shared weights and step counter live in the first parameter's state: a closure
    (or anything between steps) that reorders the group's parameters made the next step
    start new ones in the new first parameter's state, a restart of the history, and left
    the old ones with the old first parameter, to come back over the history when the order
    did, and to make its state_dict one no LBFGS loads. They move to the new first: the
    steps are those of the order never changed (their inner products are sums over all the
    parameters), a parameter inserted first stepping as one appended does."""
    def run(change):
        g = torch.Generator().manual_seed(1)
        ps = [torch.randn(5, generator=g).requires_grad_() for _ in range(3)]
        extra = torch.randn(4, generator=g).requires_grad_()
        opt = LBFGS(ps, lr=0.1, memory_size=4)
        group = opt.param_groups[0]
        for t in range(6):
            def closure():
                if change and t in (2, 4):
                    if reorder == "reversed":
                        group["params"] = group["params"][::-1]
                    elif t == 2:
                        group["params"].insert(0, extra)
                elif not change and reorder == "inserted" and t == 2:
                    group["params"].append(extra)
                opt.zero_grad()
                loss = sum(((p - i) ** 2).sum() * (i + 1) for i, p in enumerate([*ps, extra]))
                loss.backward()
                return loss
            opt.step(closure)
        return [*ps, extra], opt
    (want, _), (got, opt) = run(False), run(True)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    params = opt.param_groups[0]["params"]
    assert int(opt.state[params[0]]["step"]) == 6
    assert all("step" not in opt.state[p] and "weights" not in opt.state[p]
               for p in params[1:])
    other = LBFGS([torch.zeros_like(p) for p in params], lr=0.1, memory_size=4)
    other.load_state_dict(opt.state_dict())
    assert int(other.state[other.param_groups[0]["params"][0]]["step"]) == 6


def test_a_state_dict_after_the_parameters_were_reordered_loads():
    """A state_dict taken after the group's parameters were reordered, before a step moved
    the shared weights and step counter to the new first parameter: they were saved with
    the old first, and every LBFGS, this one too, refused to load it (the state of parameter
    1 has 'step' and 'weights')."""
    ps = [torch.randn(3, requires_grad=True) for _ in range(2)]
    opt = LBFGS(ps, lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        sum((p ** 2).sum() for p in ps).backward()
        opt.step()
    opt.param_groups[0]["params"].reverse()
    saved = opt.state_dict()
    assert {"weights", "step"} <= saved["state"][0].keys()
    opt.load_state_dict(saved)
    other = LBFGS([torch.zeros(3, requires_grad=True) for _ in range(2)], lr=0.1)
    other.load_state_dict(saved)
    assert int(other.state[other.param_groups[0]["params"][0]]["step"]) == 2


# -- the group's parameters changed after the first step ------------------------------

def _coupled(ps):
    """A quadratic that couples every parameter (the curvature pairs mix them)."""
    x = torch.cat([p.reshape(-1) for p in ps])
    n = x.numel()
    i = torch.arange(n, dtype=torch.float64)
    a = torch.eye(n, dtype=torch.float64) * (2 + i) + 0.3 * torch.cos(i[:, None] - i[None])
    return 0.5 * x @ a @ x - (x * torch.sin(i)).sum()


def _lbfgs_steps(opt, every, n):
    for _ in range(n):
        opt.zero_grad()
        _coupled(every).backward()
        opt.step()


def _restarted(every, group_params, n, lr=0.3, m=3):
    """A new LBFGS over copies of ``group_params`` (the rest of ``every`` held), after ``n``
    steps: the parameters' values."""
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in every}
    opt = LBFGS([copies[id(p)] for p in group_params], lr=lr, memory_size=m)
    _lbfgs_steps(opt, [copies[id(p)] for p in every], n)
    return [copies[id(p)].detach() for p in every]


def _three():
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(k, generator=g, dtype=torch.float64))
            for k in (2, 3, 2)]


@pytest.mark.parametrize("removed", [0, 1])
def test_a_parameter_removed_and_put_back_restarts_the_history(removed):
    """The curvature pairs are of the group's parameters together, each pair's weight the
    inverse of its inner product over all of them. A parameter removed from the group left
    the others' pairs with weights of products over it too, and put back it brought its part
    of the ring buffers, written at other steps, into this step's pairs (and where it had
    been first, its old weights and counter, which made the state_dict one no LBFGS loads).
    torch.optim.LBFGS fails on either (its flat history has another size). Either change
    starts the history again, as a new LBFGS over the group's parameters would (its first
    step), the step counter going on."""
    ps = _three()
    opt = LBFGS(ps, lr=0.3, memory_size=3)
    group = opt.param_groups[0]
    _lbfgs_steps(opt, ps, 4)
    p = group["params"].pop(removed)
    want = _restarted(ps, group["params"], 2)
    _lbfgs_steps(opt, ps, 2)
    for a, b in zip(ps, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    group["params"].append(p)
    want = _restarted(ps, group["params"], 2)
    _lbfgs_steps(opt, ps, 2)
    for a, b in zip(ps, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    head = opt.state[group["params"][0]]
    assert int(head["step"]) == 8
    assert all({"weights", "step"}.isdisjoint(opt.state[q]) for q in group["params"][1:])
    other = LBFGS([torch.zeros_like(q) for q in group["params"]], lr=0.3, memory_size=3)
    other.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("change", ["added", "state reset"])
def test_a_parameter_without_a_history_restarts_it(change):
    """A parameter added to the group after the first step (or whose state was emptied)
    had its previous value and gradient taken as zeros: its part of the next curvature pair
    was its whole value, not its last move."""
    ps = _three()
    opt = LBFGS(ps[:2] if change == "added" else ps, lr=0.3, memory_size=3)
    group = opt.param_groups[0]
    _lbfgs_steps(opt, ps, 3)
    if change == "added":
        group["params"].append(ps[2])
    else:
        opt.state[ps[2]] = {}
    want = _restarted(ps, ps, 3)
    _lbfgs_steps(opt, ps, 3)
    for a, b in zip(ps, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    assert int(opt.state[ps[0]]["step"]) == 6


@pytest.mark.parametrize("entry", ["step", "weights"])
def test_a_shared_entry_deleted_is_named_not_made_anew(entry):
    """The first parameter's state without its step counter (deleted) made a new counter
    and new, zero weights over the history kept: a restart at step 0 without a word, where
    one without its weights was refused, as the spec classes refuse a deleted counter."""
    ps = _three()
    opt = LBFGS(ps, lr=0.3, memory_size=3)
    _lbfgs_steps(opt, ps, 3)
    head = opt.state[ps[0]]
    kept = head.pop(entry)
    weights = head.get("weights")
    before = [p.detach().clone() for p in ps]
    with pytest.raises(ValueError, match=rf"^LBFGS: the first parameter's state\['{entry}'\] "
                                         r"must be .*, got None"):
        _lbfgs_steps(opt, ps, 1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    assert entry not in head and (weights is None or head["weights"] is weights)
    head[entry] = kept
    _lbfgs_steps(opt, ps, 1)
    assert int(head["step"]) == 4


def test_parameters_on_meta_beside_real_ones_are_refused_by_name_before_any_write():
    """L-BFGS's inner products span every parameter: one on meta (no values) beside one on the
    CPU failed inside the first product with torch's ``NotImplementedError: Cannot copy out of
    meta tensor; no data!``, and the class kept the state its first step had made for both.
    A ValueError now names the parameter, before anything is written; a step whose
    parameters are all on meta steps there, as before."""
    a, b = torch.randn(5, dtype=torch.float64), torch.empty(4, dtype=torch.float64,
                                                            device="meta")
    params = {"a": a.clone(), "b": b}
    state = lbfgs_init(params, memory_size=3)
    grads = {"a": torch.randn(5, dtype=torch.float64), "b": torch.empty_like(b)}
    for donate in (False, True):
        with pytest.raises(ValueError, match=r"^lbfgs_step: params leaf 'b' is on meta, which "
                                             r"holds no values, and params leaf 'a' on cpu"):
            lbfgs_step(params, grads, state, lr=0.1, donate=donate)
        assert torch.equal(params["a"], a) and int(state["step"]) == 0
    p, q = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b)
    p.grad, q.grad = grads["a"].clone(), grads["b"]
    opt = LBFGS([p, q], lr=0.1)
    with pytest.raises(ValueError, match=r"^LBFGS: parameter 1 of group 0 is on meta, which "
                                         r"holds no values, and parameter 0 of group 0 on cpu"):
        opt.step()
    assert not opt.state and torch.equal(p, a)
    # all on meta: stepped there
    metas = {"b": b, "c": torch.empty(2, 3, dtype=torch.float64, device="meta")}
    new, st = lbfgs_step(metas, {k: torch.empty_like(v) for k, v in metas.items()},
                         lbfgs_init(metas), lr=0.1)
    assert new["c"].is_meta and st["weights"].is_meta


@pytest.mark.parametrize("how", ["deepcopy", "state_dict"])
def test_a_copy_reordered_before_its_first_step_keeps_the_history(how):
    """A copy (deepcopy, or a fresh optimizer loaded from a state_dict) knows no last step;
    its parameters reordered before its first step, the shared weights and step counter are
    found on the parameter that holds them and moved to the first: it steps as the original,
    where a restart would have dropped the curvature pairs."""
    def grads(ps, k):
        return [torch.sin(p.detach() * (k + 1)) + 0.1 * p.detach() ** 2 for p in ps]

    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, dtype=torch.float64, generator=gen))
          for n in (5, 3)]
    opt = LBFGS(ps, lr=0.1, memory_size=3)
    for k in range(3):
        for p, g in zip(ps, grads(ps, k)):
            p.grad = g
        opt.step()
    if how == "deepcopy":
        twin = copy.deepcopy(opt)
        qs = twin.param_groups[0]["params"]
    else:
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        twin = LBFGS(qs, lr=0.1, memory_size=3)
        twin.load_state_dict(opt.state_dict())
    twin.param_groups[0]["params"] = qs[::-1]
    for k in range(3, 5):
        for o, params in ((opt, ps), (twin, qs)):
            for p, g in zip(params, grads(params, k)):
                p.grad = g
            o.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    assert int(twin.state[qs[1]]["step"]) == 5 and "step" not in twin.state[qs[0]]


def test_parameter_groups_are_refused_as_torch_refuses_them():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"^LBFGS does not support per-parameter options"):
        LBFGS([{"params": [a]}, {"params": [b]}])
    with pytest.raises(ValueError, match="per-parameter options"):
        torch.optim.LBFGS([{"params": [a]}, {"params": [b]}])


def test_a_complex_state_dtype_keeps_a_real_parameters_state_in_its_real_counterpart():
    state = lbfgs_init({"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex64)},
                       state_dtype=torch.complex128)
    assert state["params_prev"]["a"].dtype == torch.float64
    assert state["diff_params"]["z"].dtype == torch.complex128
    assert state["weights"].dtype == torch.float64


def test_torch_lbfgs_positional_hyperparameters_are_refused_as_by_name():
    """torch.optim.LBFGS(params, lr, max_iter, ...) by position: vega's LBFGS took the
    third as its memory_size, so LBFGS(params, 1, 20) (torch's default max_iter) kept 20
    curvature pairs where max_iter=20 by name is refused. lr comes by position, as in
    torch; what follows it is torch's max_iter, ..., refused naming it."""
    lin = torch.nn.Linear(2, 1)
    assert LBFGS(lin.parameters(), 0.5).param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match=r"LBFGS: 20, by position after lr, is "
                                        r"torch.optim.LBFGS's max_iter \(its order: lr, "
                                        r"max_iter, max_eval, .*line search and inner loop.*"
                                        r"memory_size=\.\.\."):
        LBFGS(lin.parameters(), 1, 20)
    with pytest.raises(TypeError, match=r"LBFGS: 5, by position after lr, is "
                                        r"torch.optim.LBFGS's max_iter"):
        LBFGS(lin.parameters(), 1, 5, None, 1e-7, 1e-9, 100, "strong_wolfe")
    with pytest.raises(TypeError, match=r"LBFGS takes 7 hyperparameters by position .*"
                                        r"but 8 were given"):
        LBFGS(lin.parameters(), 1, 20, None, 1e-7, 1e-9, 100, None, 3)
    assert LBFGS(lin.parameters(), 1, memory_size=3).param_groups[0]["memory_size"] == 3
