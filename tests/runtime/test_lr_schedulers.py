"""torch's LR schedulers and SWA utilities over vega's classes, against torch.optim's class of
the same rule under the same scheduler: several groups of their own rates, a float or a
tensor lr (which the schedulers fill in place), the parameters and states after 30 steps;
and a run saved mid-way (the optimizer's and the scheduler's state dicts) and resumed in new
objects, bitwise the run not interrupted."""
import copy

import pytest
import torch
from torch.optim import lr_scheduler as sched
from torch.optim import swa_utils

import vega.optim
from tests.oracles import assert_close
from tests.runtime.test_torch_names import _grads, _params

STEPS = 30
LRS = (0.02, 0.005, 0.01)


def _groups(params, tensor_lr: bool):
    return [{"params": [p], "lr": torch.tensor(lr, dtype=torch.float64) if tensor_lr else lr}
            for p, lr in zip(params, LRS)]


SCHEDULERS = {
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=1e-3, max_lr=0.03, step_size_up=4,
                                         step_size_down=3, base_momentum=0.5,
                                         max_momentum=0.9),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.LinearLR(o, start_factor=0.1, total_iters=5),
            sched.CosineAnnealingLR(o, T_max=20)], milestones=[5]),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=4), sched.ExponentialLR(o, gamma=0.95)]),
    "CosineAnnealingWarmRestarts": lambda o: sched.CosineAnnealingWarmRestarts(
        o, T_0=5, T_mult=2, eta_min=1e-4),
    "PolynomialLR": lambda o: sched.PolynomialLR(o, total_iters=20, power=2.0),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.2, total_iters=10),
    "ConstantLR": lambda o: sched.ConstantLR(o, factor=0.3, total_iters=7),
    "MultiplicativeLR": lambda o: sched.MultiplicativeLR(o, lambda e: 0.97),
    "LambdaLR": lambda o: sched.LambdaLR(o, [lambda e: 1 / (1 + e), lambda e: 0.9 ** e,
                                             lambda e: 1.0]),
    "SWALR": lambda o: swa_utils.SWALR(o, swa_lr=[5e-3, 1e-3, 2e-3], anneal_epochs=4),
}
RULES = {"Adam": ({"weight_decay": 0.01}, {"mu": "exp_avg", "nu": "exp_avg_sq"}),
         "SGD": ({"momentum": 0.9, "nesterov": True}, {"v": "momentum_buffer"})}


def _run(mod, name, make_sched, tensor_lr, split=None):
    """``STEPS`` steps of ``mod.<name>`` under ``make_sched``; with ``split``, the optimizer
    and the scheduler saved there and loaded into new ones (the parameters copied), which go
    on."""
    kw = RULES[name][0] | ({"foreach": False} if mod is torch.optim else {})
    params = [p.clone().requires_grad_(True) for p in _params()]
    opt = getattr(mod, name)(_groups(params, tensor_lr), **kw)
    scheduler = make_sched(opt)
    for k in range(STEPS):
        if k == split:
            saved = copy.deepcopy((opt.state_dict(), scheduler.state_dict()))
            params = [p.detach().clone().requires_grad_(True) for p in params]
            opt = getattr(mod, name)(_groups(params, tensor_lr), **kw)
            scheduler = make_sched(opt)
            opt.load_state_dict(saved[0])
            scheduler.load_state_dict(saved[1])
        for p, g in zip(params, _grads(k)):
            p.grad = g.clone()
        opt.step()
        scheduler.step()
    return params, opt


@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_torch_scheduler_steps_as_on_torchs_class_and_resumes(scheduler, name, tensor_lr):
    make = SCHEDULERS[scheduler]
    ps, opt = _run(vega.optim, name, make, tensor_lr)
    qs, ref = _run(torch.optim, name, make, tensor_lr)
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_close(p.detach(), q.detach(), rtol=1e-12, what=f"parameter {i}")
        for mine, theirs in RULES[name][1].items():
            assert_close(opt.state[p][mine], ref.state[q][theirs], rtol=1e-12,
                         what=f"state {mine} of parameter {i}")
    for group, its in zip(opt.param_groups, ref.param_groups):
        assert float(group["lr"]) == float(its["lr"])
        assert isinstance(group["lr"], torch.Tensor) == tensor_lr
        for key in ("betas", "momentum"):
            if key in its:
                assert group[key] == its[key]
    if scheduler == "CyclicLR":  # (cycled: betas[0] and b1 alike)
        assert len({g["b1"] if name == "Adam" else g["momentum"]
                    for g in opt.param_groups}) == 1
    resumed, again = _run(vega.optim, name, make, tensor_lr, split=STEPS // 2 - 1)
    for p, q in zip(ps, resumed):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(value, again.state[q][key]), key


@pytest.mark.parametrize("use_buffers", [False, True])
def test_swa_averages_as_over_torchs_class(use_buffers):
    """AveragedModel (an EMA by get_ema_multi_avg_fn) and SWALR over a model that vega's
    class steps: the average, saved and loaded with the rest mid-way, as over torch's."""
    def run(mod, split=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                    torch.nn.Linear(3, 1)).double()

        def build(model):
            ps = list(model.parameters())
            opt = getattr(mod, "SGD")([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.03}],
                                      lr=0.01, momentum=0.9)
            avg = swa_utils.AveragedModel(model, use_buffers=use_buffers,
                                          multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
            return opt, avg, swa_utils.SWALR(opt, swa_lr=5e-3, anneal_epochs=3)
        opt, avg, swalr = build(model)
        gen = torch.Generator().manual_seed(1)
        for k in range(20):
            if k == split:
                saved = copy.deepcopy([x.state_dict() for x in (model, opt, avg, swalr)])
                model = copy.deepcopy(model)
                opt, avg, swalr = build(model)
                for x, sd in zip((model, opt, avg, swalr), saved):
                    x.load_state_dict(sd)
            loss = model(torch.randn(8, 4, generator=gen, dtype=torch.float64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if k >= 5:
                avg.update_parameters(model)
                swalr.step()
        return avg.state_dict()
    ours, theirs, resumed = run(vega.optim), run(torch.optim), run(vega.optim, split=11)
    assert ours.keys() == theirs.keys() == resumed.keys()
    for key in ours:
        assert_close(ours[key], theirs[key], rtol=1e-12, what=key)
        assert torch.equal(ours[key], resumed[key])
