"""Adafactor beyond the registry in test_zoo.py: tensors of every rank and shape against
optax, optax's own alias, and how the shape conditions pick a program per tensor."""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
import torch

import vega
from .test_zoo import (RTOL, _adafactor_optax, _adafactor_state, assert_close,
                       optax_trajectory)

jax.config.update("jax_enable_x64", True)

H = dict(lr=0.05, decay_rate=0.7, decay_offset=0.0, min_dim_size_to_factor=4.0,
         clipping_threshold=0.5, momentum=0.8, weight_decay_rate=0.01, eps=1e-20,
         param_scale_min=0.01, factored=True, multiply_by_parameter_scale=True,
         relative_step=False, use_momentum=True)

# (3, 6, 5): factored over its two largest axes (6 and 5), the 3 a batch of matrices;
# (7, 5) tall and (5, 7) wide; (4, 4) square (the later axis is the column axis);
# (2, 9): its row axis is shorter than min_dim_size_to_factor, so it is not factored
SHAPES = {"cube": (3, 6, 5), "tall": (7, 5), "wide": (5, 7), "square": (4, 4),
          "thin": (2, 9), "vec": (6,), "scalar": ()}


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}


def _grads(k):
    return {n: (1 + k % 3) * v for n, v in _params(100 + k).items()}


def _run_vega(h, steps, backend=None):
    params = _params()
    state = vega.adafactor_init(params, **h)
    out = []
    for k in range(steps):
        params, state = vega.adafactor_step(params, _grads(k), state, backend=backend, **h)
        snap = {f"p.{n}": v for n, v in params.items()}
        for f, tree in state.items():
            if f != "step":
                snap.update({f"{f}.{n}": v for n, v in tree.items() if v is not None})
        out.append(snap)
    return out, state


def _run_optax(tx, getters, steps):
    return optax_trajectory(tx, getters, _params(), _grads, steps)


def test_every_shape_matches_optax():
    ours, state = _run_vega(H, 12)
    theirs = _run_optax(_adafactor_optax(H), _adafactor_state(H), 12)
    for k, (a, e) in enumerate(zip(ours, theirs)):
        for key, value in e.items():
            assert key in a, f"vega has no {key}"
            assert_close(a[key], value, f"{key} against optax", k + 1)
    # which tensors were factored, and the shapes of their factors: optax's
    assert set(n for n, v in state["v_row"].items() if v is not None) == {
        "cube", "tall", "wide", "square"}
    assert state["v_row"]["cube"].shape == (3, 5) and state["v_col"]["cube"].shape == (3, 6)
    assert state["v_row"]["tall"].shape == (5,) and state["v_col"]["tall"].shape == (7,)
    assert state["v"]["thin"].shape == (2, 9) and state["v"]["cube"] is None


def test_optax_alias_differs_only_by_the_decay():
    """optax.adafactor itself computes 1 - t^-0.8 in float32: the same trajectory to about
    float32's precision, not to float64's. The test chain with the float64 decay is what
    vega follows (docs/conventions.md)."""
    h = dict(H, use_momentum=False, lr=0.05)
    alias = optax.adafactor(learning_rate=h["lr"], min_dim_size_to_factor=4,
                            decay_rate=h["decay_rate"], clipping_threshold=h["clipping_threshold"],
                            weight_decay_rate=h["weight_decay_rate"], eps=h["eps"])
    h.update(param_scale_min=1e-3)  # optax's scale_by_param_block_rms default
    ours, _ = _run_vega(h, 8)
    theirs = _run_optax(alias, {}, 8)
    worst = max(float(((a := ours[k][key]) - torch.tensor(np.array(v))).abs().max()
                      / (a.abs().max() + 1e-30))
                for k in range(8) for key, v in theirs[k].items())
    assert worst < 1e-6, worst
    assert worst > RTOL, "optax's float32 decay should show at float64 precision"


def test_shape_hyper_must_be_a_number():
    params = {"w": torch.randn(5, 7)}
    with pytest.raises(ValueError, match="min_dim_size_to_factor=.*plain number"):
        vega.adafactor_init(params, min_dim_size_to_factor=torch.tensor(4.0))


def test_state_of_the_wrong_shape_is_named():
    params = {"w": torch.randn(5, 7, dtype=torch.float64)}
    state = vega.adafactor_init(params, min_dim_size_to_factor=4)
    state["v_row"]["w"] = torch.zeros(7, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"v_row\.w.*\(7,\).*one value per row.*\(5,\)"):
        vega.adafactor_step(params, {"w": torch.ones(5, 7, dtype=torch.float64)}, state,
                            min_dim_size_to_factor=4)


def test_class_steps_mixed_shapes_and_round_trips_its_state():
    ps = [torch.nn.Parameter(v) for v in _params().values()]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a = vega.optim.Adafactor(ps, lr=0.05, min_dim_size_to_factor=4)
    b = vega.optim.Adafactor(qs, lr=0.05, min_dim_size_to_factor=4)
    for k in range(3):
        g = _grads(k)
        for p, q, n in zip(ps, qs, SHAPES):
            p.grad, q.grad = g[n].clone(), g[n].clone()
        a.step()
        if k == 0:  # b resumes from a's state after the first step
            b.step()
            b.load_state_dict(a.state_dict())
        elif k > 0:
            b.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert set(a.state[ps[0]]) == {"v_row", "v_col", "step"}
    assert set(a.state[ps[-1]]) == {"v", "step"}
    # and a functional trajectory is the same
    ours, _ = _run_vega(dict(lr=0.05, min_dim_size_to_factor=4.0), 3)
    for p, n in zip(ps, SHAPES):
        torch.testing.assert_close(p.detach(), ours[-1][f"p.{n}"], rtol=1e-12, atol=1e-14)


def test_state_with_missing_leaves_saves_and_loads(tmp_path):
    """Row and column factors where a tensor is factored, v elsewhere: the file holds just
    the leaves that exist, and loads back into a fresh state bitwise."""
    params = _params()
    h = dict(min_dim_size_to_factor=4.0)
    state = vega.adafactor_init(params, **h)
    params, state = vega.adafactor_step(params, _grads(0), state, **h)
    vega.save(tmp_path / "s.safetensors", state)
    back = vega.load(tmp_path / "s.safetensors", like=vega.adafactor_init(params, **h))
    assert vega.state_names(back) == vega.state_names(state)
    assert "v_row.cube" in vega.state_names(state) and "v.cube" not in vega.state_names(state)
    for field in ("v_row", "v_col", "v"):
        for n in SHAPES:
            assert (back[field][n] is None) == (state[field][n] is None)
            if state[field][n] is not None:
                assert torch.equal(back[field][n], state[field][n])
    params2, _ = vega.adafactor_step(params, _grads(1), back, **h)
    params1, _ = vega.adafactor_step(params, _grads(1), state, **h)
    for n in SHAPES:
        assert torch.equal(params1[n], params2[n])


def test_matches_torch_where_the_definitions_coincide():
    """torch.optim.Adafactor is one setting of vega's: relative step and parameter scale on
    (its eps2 is param_scale_min), every matrix factored (min_dim_size_to_factor 0) with
    the last axis the longest (torch always factors the last two axes), eps 0 for vega and
    a tiny eps1 for torch (torch clamps where optax and vega add), no weight decay (torch
    scales its decay by lr, not by the relative step) and no momentum."""
    # lr 0.5: the relative step min(lr, 1/sqrt(t)) is 1/sqrt(t) from t = 5 on; torch takes
    # no clipping threshold below 1
    h = dict(lr=0.5, decay_rate=0.7, decay_offset=0.0, min_dim_size_to_factor=0.0,
             clipping_threshold=1.0, momentum=0.9, weight_decay_rate=0.0, eps=0.0,
             param_scale_min=0.02, factored=True, multiply_by_parameter_scale=True,
             relative_step=True, use_momentum=False)
    gen = torch.Generator().manual_seed(5)
    start = {"w": torch.randn(5, 7, generator=gen, dtype=torch.float64),
             "c": torch.randn(2, 3, 4, generator=gen, dtype=torch.float64),
             "k": torch.randn(3, 2, 4, 6, generator=gen, dtype=torch.float64),
             "b": torch.randn(7, generator=gen, dtype=torch.float64)}
    ours = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    theirs = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    opt = vega.optim.Adafactor(list(ours.values()), **h)
    ref = torch.optim.Adafactor(list(theirs.values()), lr=h["lr"], beta2_decay=-h["decay_rate"],
                                eps=(1e-30, h["param_scale_min"]), d=h["clipping_threshold"],
                                weight_decay=0.0, foreach=False)
    for k in range(20):
        for n in start:
            g = torch.randn(start[n].shape, generator=gen, dtype=torch.float64)
            ours[n].grad, theirs[n].grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for n in start:
            assert_close(ours[n], theirs[n], f"p.{n} against torch", k + 1)
            mine, its = opt.state[ours[n]], ref.state[theirs[n]]
            if start[n].dim() > 1:
                assert_close(mine["v_row"], its["row_var"].squeeze(-1), f"v_row.{n}", k + 1)
                assert_close(mine["v_col"], its["col_var"].squeeze(-2), f"v_col.{n}", k + 1)
            else:
                assert_close(mine["v"], its["variance"], f"v.{n}", k + 1)


def test_torch_factors_the_last_two_axes_where_vega_factors_the_two_longest():
    """A tensor whose last two axes are not its two longest ((8, 2, 10): vega's rows are
    axis 0, torch's axis 1) is factored otherwise than torch.optim.Adafactor factors it,
    so the two step it apart (the spec's header and docs/optimizers.md say where they
    meet); a 2-d matrix whose first axis is the longer steps alike, its factors swapped."""
    h = dict(lr=0.5, decay_rate=0.7, min_dim_size_to_factor=0.0, clipping_threshold=1.0,
             eps=0.0, param_scale_min=0.02, relative_step=True)
    gen = torch.Generator().manual_seed(7)
    apart = {}
    for shape in ((8, 2, 10), (9, 3)):
        start = torch.randn(shape, generator=gen, dtype=torch.float64)
        ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        opt = vega.optim.Adafactor([ours], **h)
        ref = torch.optim.Adafactor([theirs], lr=h["lr"], beta2_decay=-h["decay_rate"],
                                    eps=(1e-30, h["param_scale_min"]), d=1.0, foreach=False)
        for _ in range(3):
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            ours.grad, theirs.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        apart[shape] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        mine, its = opt.state[ours], ref.state[theirs]
        if shape == (8, 2, 10):
            assert mine["v_row"].shape == (8, 2) and its["row_var"].shape == (8, 2, 1)
            assert mine["v_col"].shape == (2, 10) and its["col_var"].shape == (8, 1, 10)
        else:
            assert_close(mine["v_row"], its["col_var"].squeeze(-2), "v_row", 3)
            assert_close(mine["v_col"], its["row_var"].squeeze(-1), "v_col", 3)
    assert apart[(8, 2, 10)] > 1e-3 and apart[(9, 3)] < 1e-12, apart


def test_a_state_made_for_other_shape_conditions_is_named():
    """init and step disagree on min_dim_size_to_factor: the step says which value."""
    params = {"s": torch.randn(10, 30)}
    state = vega.adafactor_init(params)  # 128: s keeps a full v
    with pytest.raises(ValueError, match=r"needs \['step', 'v_col', 'v_row'\].*the same "
                                         "min_dim_size_to_factor"):
        vega.adafactor_step(params, {"s": torch.ones(10, 30)}, state, min_dim_size_to_factor=8)
    # the same fields (a factored at both values, b never), but s lacks its factors
    params = {"a": torch.randn(130, 140), "s": torch.randn(10, 30), "b": torch.randn(5)}
    state = vega.adafactor_init(params)
    with pytest.raises(ValueError, match=r"v_row\.s' is missing.*min_dim_size_to_factor"):
        vega.adafactor_step(params, {n: torch.ones_like(v) for n, v in params.items()}, state,
                            min_dim_size_to_factor=8)
    opt = vega.optim.Adafactor([torch.nn.Parameter(torch.randn(10, 30))])
    opt.param_groups[0]["params"][0].grad = torch.ones(10, 30)
    opt.step()
    opt.param_groups[0]["min_dim_size_to_factor"] = 8.0
    with pytest.raises(ValueError, match="or min_dim_size_to_factor .* changed"):
        opt.step()
    with pytest.raises(ValueError, match="min_dim_size_to_factor=.*plain number"):
        vega.optim.Adafactor([torch.nn.Parameter(torch.randn(3))],
                             min_dim_size_to_factor=torch.tensor(4.0))


def test_complex_parameters_are_refused_where_factored():
    """A complex tensor has no matrix view: refused at init, by name; unfactored it steps."""
    params = {"w": torch.randn(6, 5, dtype=torch.complex128)}
    with pytest.raises(ValueError, match="complex parameters have no matrix view"):
        vega.adafactor_init(params, min_dim_size_to_factor=4)
    state = vega.adafactor_init(params)  # 128: not factored, v per element
    new, state = vega.adafactor_step(params, {"w": torch.ones_like(params["w"])}, state)
    assert new["w"].dtype == torch.complex128 and state["v"]["w"].shape == (6, 5)


def test_shape_conditions_are_evaluated_once_per_shape(monkeypatch):
    """The program chosen for a shape is kept across steps, for the hyperparameter values
    the conditions read: a thousand small tensors do not evaluate them every step."""
    spec = vega.builtin("adafactor")._spec
    calls = []
    real = type(spec).shapes
    monkeypatch.setattr(type(spec), "shapes",
                        lambda self, values, shape: calls.append(shape) or real(self, values,
                                                                               shape))
    spec._chosen.clear()
    ps = [torch.nn.Parameter(torch.randn(n, 8)) for n in (2, 5, 7)]
    ps.append(torch.nn.Parameter(torch.randn(5, 8)))
    opt = vega.optim.Adafactor(ps, lr=0.05, min_dim_size_to_factor=4)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    assert sorted(calls) == [(2, 8), (5, 8), (7, 8)]
    assert set(opt.state[ps[0]]) == {"v", "step"} and set(opt.state[ps[1]]) == {
        "v_row", "v_col", "step"}
    # other values of what the conditions read choose again
    opt.param_groups[0]["min_dim_size_to_factor"] = 6
    with pytest.raises(ValueError, match="min_dim_size_to_factor"):
        opt.step()  # (5, 8) is no longer factored: its state does not fit, and says so
    assert len(calls) == 6
