"""A float64 step is float64 all the way: a hyperparameter, a schedule's value included,
reaches a float64 parameter's update at float64 precision."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import vega

jax.config.update("jax_enable_x64", True)

STEPS = 8


def _optax_float64(sched):
    """optax evaluates a schedule at its int32 count, which jax computes in float32;
    at an int64 count it computes in float64, the precision compared here."""
    return lambda count: sched(count.astype(jnp.int64))


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_scheduled_adamw_in_float64_matches_optax_in_float64(backend):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(33, 17, dtype=torch.float64, generator=gen),
              "b": torch.randn(17, dtype=torch.float64, generator=gen)}
    grads = [{k: torch.randn(v.shape, dtype=torch.float64, generator=gen)
              for k, v in params.items()} for _ in range(STEPS)]
    sched = vega.schedule.warmup_cosine_decay(init_value=0.0, peak_value=1e-2,
                                              warmup_steps=3, decay_steps=7)
    tx = optax.adamw(_optax_float64(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10)),
                     b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    jp = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    ostate = tx.init(jp)
    state = vega.adamw_init(params)
    p = params
    for step, g in enumerate(grads):
        p, state = vega.adamw_step(p, g, state, lr=sched, weight_decay=0.01, backend=backend)
        updates, ostate = tx.update({k: jnp.asarray(v.numpy()) for k, v in g.items()},
                                    ostate, jp)
        jp = optax.apply_updates(jp, updates)
        adam = ostate[0]
        for name, ours, theirs in [("p", p, jp), ("mu", state["mu"], adam.mu),
                                   ("nu", state["nu"], adam.nu)]:
            for k in ours:
                want = np.asarray(theirs[k])
                assert ours[k].dtype == torch.float64
                np.testing.assert_allclose(ours[k].numpy(), want, rtol=1e-13,
                                           atol=1e-15 * np.abs(want).max(),
                                           err_msg=f"{name}.{k} at step {step}")


def test_a_schedule_on_a_step_tensor_is_float64():
    s = vega.schedule.cosine_decay(1.0 / 3.0, 10)
    v = s(torch.tensor(3, dtype=torch.int32))
    assert v.dtype == torch.float64 and v.item() == s(3)


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_a_hyperparameter_past_float32s_range_steps_float32_parameters_as_torch(backend):
    """A float hyperparameter past float32's range (Adagrad's lr_decay=1e39: a rate that
    falls to nothing after the first step) steps float32 parameters as torch.optim does,
    its step constants in float64: the state's init made every hyperparameter a float32
    tensor by torch.full, which raised "value cannot be converted to type float without
    overflow" for one it does not even read (a number past the range rounds to inf, as
    the kernels round it)."""
    start = torch.linspace(-1, 1, 12).reshape(3, 4)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = vega.optim.Adagrad([ours], lr=0.1, lr_decay=1e39, backend=backend)
    ref = torch.optim.Adagrad([theirs], lr=0.1, lr_decay=1e39, foreach=False)
    for k in range(3):
        g = torch.cos(torch.arange(12.0) * (k + 1)).reshape(3, 4)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours.detach(), start)
    params = {"w": start.clone()}
    state = vega.yogi_init(params, initial_accumulator_value=1e39)
    assert torch.isinf(state["nu"]["w"]).all()
