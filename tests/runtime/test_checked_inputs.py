"""Inputs that are refused with a ValueError naming them, not taken silently nor failing with
a raw error: loaded states and loss scales, hyperparameters past the float range,
schedules that return something other than one value, state dtypes, state leaves, state
files' leaves and keys, spec files, and the loss scale's settings (docs/robustness.md,
"Inputs that are checked")."""
import collections
import copy
import math
import operator
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import vega
from vega import LossScale
from vega.runtime.engine import shown

from tests import forks


def _params(n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(n)]


def _stepped(opt, params, steps=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


def _snapshot(opt):
    """What load_state_dict may not change when it refuses: every state tensor, the groups'
    settings, the loss scale's tensors (copies)."""
    state = {i: {k: v.clone() for k, v in opt.state[p].items()}
             for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    scale = None if opt.loss_scale is None else [t.clone() for t in opt.loss_scale.tensors()]
    return state, groups, scale, opt.state, opt.param_groups


def _unchanged(opt, snap):
    state, groups, scale, state_obj, groups_obj = snap
    assert opt.state is state_obj and opt.param_groups is groups_obj
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        assert opt.state[p].keys() == state[i].keys()
        for k, v in state[i].items():
            assert torch.equal(opt.state[p][k], v), (i, k)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    if scale is not None:
        for a, b in zip(opt.loss_scale.tensors(), scale):
            assert torch.equal(a, b)


# -- the loss scale of a loaded state_dict --------------------------------------------

BAD_SCALES = [
    ("loss_scale", torch.tensor(-4.0), "'loss_scale' is -4.0; it must be positive and finite"),
    ("loss_scale", torch.tensor(float("nan")), "'loss_scale' is nan"),
    ("loss_scale", torch.tensor(float("inf")), "'loss_scale' is inf"),
    ("loss_scale", torch.tensor(0.0), "'loss_scale' is 0.0"),
    ("loss_scale", torch.tensor(4.0, dtype=torch.float64), "0-d torch.float32 tensor"),
    ("loss_scale", torch.tensor([4.0]), "0-d torch.float32 tensor"),
    ("loss_scale", 1024.0, "'loss_scale' is 1024.0; it must be a 0-d torch.float32"),
    ("good_steps", torch.tensor(-2, dtype=torch.int32), "'good_steps' is -2"),
    ("good_steps", torch.tensor(3.0), "0-d torch.int32 tensor"),
    ("skipped_steps", torch.tensor(-1, dtype=torch.int32), "'skipped_steps' is -1"),
    ("min_scale", torch.tensor(float("nan")), "'min_scale' is nan"),
    ("min_scale", torch.tensor(1e9), "'min_scale' is 1000000000.0, above the scale"),
    ("scale", torch.tensor(2.0), "'loss_scale' has 'scale'; a loss scale has loss_scale, "),
]


@pytest.mark.parametrize("entry,value,message", BAD_SCALES,
                         ids=[f"{e}={m[:24]}" for e, _, m in BAD_SCALES])
def test_load_state_dict_refuses_a_loss_scale_no_scale_has(entry, value, message):
    """A negative scale flips the sign of every update; a NaN one skips every step."""
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.dynamic(init=64.0)), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["loss_scale"][entry] = value
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"^AdamW\.load_state_dict: .*" + re.escape(message)):
        opt.load_state_dict(sd)
    _unchanged(opt, snap)
    _stepped(opt, ps, 1)  # and it still steps


def test_load_state_dict_takes_a_loss_scale_it_can_step_with():
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.dynamic(init=64.0)), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["loss_scale"]["loss_scale"] = torch.tensor(8.0)
    del sd["loss_scale"]["min_scale"]  # (a missing entry keeps the optimizer's own)
    other = vega.optim.AdamW(_params(), lr=1e-2, loss_scale=LossScale.dynamic(min_scale=2.0))
    other.load_state_dict(sd)
    assert other.loss_scale.loss_scale.item() == 8.0
    assert other.loss_scale.min_scale.item() == 2.0
    assert other.loss_scale.good_steps.item() == 2


def test_load_state_dict_loads_the_scale_into_the_optimizers_own():
    """The loop scales its loss with the object it gave the optimizer: loading copies the
    saved values into that object's tensors. A new object would leave the loop's scale
    behind, never adjusted, and the steps would unscale by a scale the loss was not scaled
    by."""
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.dynamic(
        init=64.0, growth_interval=1)), ps)
    saved = opt.loss_scale.loss_scale.item()
    mine = LossScale.dynamic(init=1024.0, growth_interval=1)
    tensors = mine.tensors()
    other = vega.optim.AdamW(_params(), lr=1e-2, loss_scale=mine)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.loss_scale is mine and all(map(operator.is_, mine.tensors(), tensors))
    assert mine.loss_scale.item() == saved != 1024.0
    assert mine.good_steps.item() == opt.loss_scale.good_steps.item()


def test_load_state_dict_loads_a_static_scale_into_a_static_one():
    """A static scale's state (good_steps -1) is of the kind of a static optimizer's scale:
    loaded without a word (its saved value taken), as a dynamic one into a dynamic one."""
    import warnings
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.static(8.0)), ps)
    mine = LossScale.static(4.0)
    other = vega.optim.AdamW(_params(), lr=1e-2, loss_scale=mine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert mine.loss_scale.item() == 8.0 and mine.good_steps.item() == -1


def test_load_state_dict_takes_groups_saved_without_the_later_settings():
    """A state saved before the groups held ``maximize`` and the precision settings loads
    with their defaults, and steps as it stepped (descending)."""
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2), ps)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        for key in ("maximize", "master_weights", "stochastic_rounding", "rounding_seed"):
            g.pop(key, None)
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    other = vega.optim.AdamW(again, lr=1e-2)
    other.load_state_dict(sd)
    assert other.param_groups[0]["maximize"] is False
    assert other.param_groups[0]["master_weights"] is False
    _stepped(other, again, steps=1, seed=5)
    _stepped(opt, ps, steps=1, seed=5)
    for a, b in zip(again, ps):
        assert torch.equal(a, b)


def test_load_state_dict_says_a_saved_scale_is_not_loaded():
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.dynamic(init=64.0)), ps)
    other = vega.optim.AdamW(_params(), lr=1e-2)
    with pytest.warns(UserWarning, match=r"^AdamW\.load_state_dict: the state dict holds a "
                      "loss scale, but this optimizer has none"):
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.loss_scale is None


def test_load_state_dict_keeps_its_own_scale_of_another_kind():
    """A dynamic scale's state loaded by an optimizer with a static one (or the other way)
    is not loaded, with a warning: copied in, the static scale took the saved value and a
    counter it never advanced, and a dynamic one a static's counter of -1 (growth a step
    late)."""
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=1e-2, loss_scale=LossScale.dynamic(
        init=64.0, growth_interval=1)), ps)
    static = LossScale.static(8.0)
    other = vega.optim.AdamW(_params(), lr=1e-2, loss_scale=static)
    with pytest.warns(UserWarning, match=r"^AdamW\.load_state_dict: the state dict holds a "
                      r"dynamic loss scale, but this optimizer's is static: the saved scale is "
                      r"not loaded"):
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert static.loss_scale.item() == 8.0 and static.good_steps.item() == -1
    dynamic = LossScale.dynamic(init=4.0)
    again = vega.optim.AdamW(_params(), lr=1e-2, loss_scale=dynamic)
    with pytest.warns(UserWarning, match=r"holds a static loss scale, but this optimizer's is "
                                         r"dynamic"):
        again.load_state_dict(copy.deepcopy(other.state_dict()))
    assert dynamic.loss_scale.item() == 4.0 and dynamic.good_steps.item() == 0


# -- another optimizer's state --------------------------------------------------------

def _torch_sgd_state():
    ps = _params()
    opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return _stepped(opt, ps).state_dict()


def _torch_adam_state():
    ps = _params()
    return _stepped(torch.optim.Adam(ps, lr=0.1), ps).state_dict()


def _vega_state(cls, **kw):
    ps = _params()
    return _stepped(cls(ps, **kw), ps).state_dict()


def _unnamed(sd: dict) -> dict:
    """A vega state dict without the rule's name (one saved through
    torch.distributed.checkpoint keeps only 'state' and 'param_groups'): the groups' keys
    say whose it seems."""
    return {k: v for k, v in sd.items() if k != "vega_rule"}


OTHERS = [
    (vega.optim.SGD, lambda: _unnamed(_vega_state(vega.optim.Adam)),
     r"group 0 of the state has no 'dampening', 'momentum', 'nesterov' and has 'amsgrad', 'b1', "
     r"'b2', 'betas', 'eps', unknown to SGD; it seems to be the state of vega\.optim\.Adam or "
     r"vega\.optim\.AdamW"),
    # torch's state is converted only into the class of its rule (test_torch_names.py)
    (vega.optim.Adam, _torch_sgd_state,
     r"group 0 of the state has no 'amsgrad', 'b1', 'b2', 'backend', 'eps', 'state_dtype' and "
     r"has .*'momentum'.*; it seems to be the state of torch\.optim\.SGD"),
    (vega.optim.Adagrad, _torch_adam_state,
     r"group 0 of the state has no 'backend', 'initial_accumulator_value', 'lr_decay', "
     r"'state_dtype' and has .*'betas'.*; it seems to be the state of torch\.optim\.Adam"),
    (vega.optim.LARS, lambda: _unnamed(_vega_state(vega.optim.SGD, momentum=0.9)),
     r"group 0 of the state has no 'eps', 'trust_coefficient' and has 'dampening', unknown to "
     r"LARS; it seems to be the state of vega\.optim\.SGD"),
]


@pytest.mark.parametrize("cls,make,message", OTHERS, ids=["Adam>SGD", "torch.SGD>Adam",
                                                         "torch.Adam>Adagrad", "SGD>LARS"])
def test_load_state_dict_of_another_optimizer_says_whose_it_seems(cls, make, message):
    ps = _params()
    opt = _stepped(cls(ps, lr=0.1), ps)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.load_state_dict: {message}"):
        opt.load_state_dict(make())
    _unchanged(opt, snap)
    _stepped(opt, ps, 1)


RULES = [(vega.optim.AdamW, vega.optim.Adam, "adam", "adamw"),
         (vega.optim.Adam, vega.optim.AdamW, "adamw", "adam"),
         (vega.optim.RAdam, vega.optim.AdamW, "adamw", "radam"),
         (vega.optim.RAdam, vega.optim.Yogi, "yogi", "radam"),
         (vega.optim.LAMB, vega.optim.Adam, "adam", "lamb")]


@pytest.mark.parametrize("cls,other,theirs,mine", RULES,
                         ids=[f"{o.__name__}>{c.__name__}" for c, o, _, _ in RULES])
def test_load_state_dict_refuses_the_state_of_another_rule(cls, other, theirs, mine):
    """Groups whose keys this class also has, with another meaning: AdamW's weight_decay is
    Adam's L2 penalty, and RAdam has none. Before, such a state loaded without a word (and
    RAdam's group held a weight_decay it did not apply)."""
    ps = _params()
    opt = _stepped(cls(ps, lr=0.1), ps)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.load_state_dict: the state is of "
                       rf"the rule '{theirs}', and {cls.__name__} steps the rule '{mine}'"):
        opt.load_state_dict(_vega_state(other, lr=0.1))
    _unchanged(opt, snap)
    _stepped(opt, ps, 1)
    opt.load_state_dict(opt.state_dict())  # (its own: named, and taken)


def test_load_state_dict_refuses_state_entries_of_another_optimizer():
    """Groups alike, per-parameter entries not: torch's SGD's ``momentum_buffer`` in vega's
    SGD, a renamed moment in Adam."""
    ps = _params()
    opt = _stepped(vega.optim.Adam(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][1]["exp_avg"] = sd["state"][1].pop("mu")
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"^Adam\.load_state_dict: the state of parameter 1 of "
                                         r"group 0 has \['exp_avg', 'nu', 'step'\], but Adam with "
                                         r"these settings keeps \['mu', 'nu', 'step'\]; missing "
                                         r"\['mu'\]; unknown \['exp_avg'\]"):
        opt.load_state_dict(sd)
    _unchanged(opt, snap)


def test_load_state_dict_still_takes_a_state_a_value_turns_on_or_off():
    """sgd's ``v``: saved without momentum, loaded and stepped with (the step makes it), and
    back."""
    ps = _params()
    plain = _stepped(vega.optim.SGD(ps, lr=0.1), ps).state_dict()
    qs = _params()
    opt = vega.optim.SGD(qs, lr=0.1)
    opt.load_state_dict(copy.deepcopy(plain))
    opt.param_groups[0]["momentum"] = 0.9
    _stepped(opt, qs, 1)
    assert "v" in opt.state[qs[0]]
    back = vega.optim.SGD(_params(), lr=0.1)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))  # v kept, as torch keeps buffers


@pytest.mark.parametrize("value,message", [
    (torch.tensor(-3, dtype=torch.int32), "is -3; a step counter is a whole number"),
    (torch.tensor(float("nan")), "is nan"),
    (torch.tensor(2.5), "is 2.5"),
    (torch.tensor(2.0**40), "is 1099511627776.0"),
    (torch.tensor(True), "of dtype torch.bool"),
    (7, "of parameter 0 of group 0 is 7, not a tensor"),
])
def test_load_state_dict_refuses_a_step_counter_out_of_range(value, message):
    ps = _params()
    opt = _stepped(vega.optim.Adam(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = value
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=r"^Adam\.load_state_dict: state 'step' .*"
                                         + re.escape(message)):
        opt.load_state_dict(sd)
    _unchanged(opt, snap)


@pytest.mark.parametrize("value", [torch.tensor(0, dtype=torch.int32),
                                   torch.tensor(2**31 - 1, dtype=torch.int32),
                                   torch.tensor(float(2**31 - 1), dtype=torch.float64)],
                         ids=["0", "int32 max", "float64 2**31 - 1"])
def test_load_state_dict_takes_a_step_counter_at_the_ends_of_its_range(value):
    """The counts an int32 counter holds, 0 and 2**31 - 1 included, load (as int32)."""
    ps = _params()
    opt = _stepped(vega.optim.Adam(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = value
    opt.load_state_dict(sd)
    step = opt.state[ps[0]]["step"]
    assert step.dtype == torch.int32 and int(step) == int(value)


def test_load_state_dict_keeps_an_entry_the_rule_does_not_keep_beside_all_it_keeps():
    """A parameter's state with an entry this optimizer does not keep, beside all it keeps,
    is the caller's own (torch.optim loads and keeps any such entry): loaded as torch loads
    it, never read by a step. One in place of an entry the rule keeps is refused, naming
    both (``test_load_state_dict_refuses_state_entries_of_another_optimizer``)."""
    ps = _params()
    opt = _stepped(vega.optim.AdamW(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["velocity"] = torch.full((4, 3), 2.0)
    qs = _params()
    other = vega.optim.AdamW(qs, lr=0.1)
    other.load_state_dict(sd)
    assert torch.equal(other.state[qs[0]]["velocity"], torch.full((4, 3), 2.0))
    _stepped(other, qs, 1)
    assert torch.equal(other.state[qs[0]]["velocity"], torch.full((4, 3), 2.0))


def test_load_state_dict_takes_torch_adams_float_step_counter():
    ps = _params()
    opt = _stepped(vega.optim.Adam(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = st["step"].float()
    other = vega.optim.Adam(_params(), lr=0.1)
    other.load_state_dict(sd)
    assert all(st["step"].dtype == torch.int32 and int(st["step"]) == 2
               for st in other.state.values())


@pytest.mark.parametrize("broken,message", [
    (lambda sd: sd.pop("state"), "a state_dict is a dict with 'state' and 'param_groups'"),
    (lambda sd: sd["state"].__setitem__(0, [1.0]), r"state_dict\['state'\] must be a dict"),
    (lambda sd: sd["state"][0].__setitem__("nu", sd["state"][0]["nu"].to(torch.int8)),
     r"state 'nu' of parameter id 0 is of dtype torch\.int8; a state is a float tensor, or "
     r"8-bit codes of dtype torch\.uint8"),
    (lambda sd: sd.__setitem__("param_groups", {"params": [0, 1, 2]}),
     r"state_dict\['param_groups'\] is dict; it is the list of the groups' dicts"),
    (lambda sd: sd["param_groups"][0].__setitem__("state_dtype", "float32"),
     "state_dtype='float32' must be None, a torch float dtype"),
    (lambda sd: sd["param_groups"][0].__setitem__("lr", 10**400), "lr=1000.* is too large"),
])
def test_load_state_dict_refuses_a_malformed_state_dict(broken, message):
    ps = _params()
    opt = _stepped(vega.optim.Adam(ps, lr=0.1), ps)
    sd = copy.deepcopy(opt.state_dict())
    broken(sd)
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    _unchanged(opt, snap)


# -- hyperparameters and state dtypes -------------------------------------------------

def test_a_number_past_the_float_range_is_a_value_error():
    p = torch.ones(3)
    for call, owner in [(lambda: vega.optim.AdamW([torch.nn.Parameter(p)], lr=10**400),
                         "AdamW"),
                        (lambda: vega.adamw_init([p], lr=10**400), "adamw_init"),
                        (lambda: vega.adamw_step([p], [p], vega.adamw_init([p]), lr=10**400),
                         "adamw_step")]:
        with pytest.raises(ValueError, match=rf"^{owner}: lr=1000000.*0000 is too large for a "
                                             r"float$"):
            call()
    with pytest.raises(ValueError, match=r"max_grad_norm=1000.* must be a positive finite"):
        vega.optim.AdamW([torch.nn.Parameter(p)], max_grad_norm=10**400)
    with pytest.raises(ValueError, match=r"LossScale.static: s=1000.* must be positive and "
                                         r"finite"):
        LossScale.static(10**400)


@pytest.mark.parametrize("dtype", ["float32", torch.int32, torch.bool, 32, float])
def test_state_dtype_is_a_torch_float_dtype(dtype):
    p = torch.nn.Parameter(torch.ones(3))
    words = "must be None, a torch float dtype"
    with pytest.raises(ValueError, match=rf"^adamw_init: state_dtype=.* {words}"):
        vega.adamw_init([p.detach()], state_dtype=dtype)
    with pytest.raises(ValueError, match=rf"^AdamW: state_dtype=.* {words}"):
        vega.optim.AdamW([p], state_dtype=dtype)
    opt = vega.optim.AdamW([p])
    with pytest.raises(ValueError, match=rf"^AdamW: state_dtype=.* {words}"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "state_dtype": dtype})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match=rf"^lbfgs_init: state_dtype=.* {words}"):
        vega.lbfgs_init([p.detach()], state_dtype=dtype)
    with pytest.raises(ValueError, match=rf"^LBFGS: state_dtype=.* {words}"):
        vega.optim.LBFGS([p], state_dtype=dtype)
    vega.adamw_init([p.detach()], state_dtype=torch.float64)  # a dtype is taken


# -- schedules ------------------------------------------------------------------------

BAD_SCHEDULES = {
    "a vector": (lambda step: torch.full((3,), 1e-3), r"a tensor of shape \(3,\) and dtype "
                 r"torch\.float32; a schedule returns one value"),
    "a string": (lambda step: "0.001", r"'0.001', a str"),
    "None": (lambda step: None, r"None, a NoneType"),
    "a bool tensor": (lambda step: step > 0, r"a tensor of shape \(\) and dtype torch\.bool"),
    "a complex tensor": (lambda step: torch.tensor(1e-3j), r"a tensor of shape \(\) and dtype "
                         r"torch\.complex64"),
    "a huge int": (lambda step: 10**400, r"1000.*, too large for a float"),
    "a meta tensor": (lambda step: torch.tensor(1e-3, device="meta"),
                      r"a meta tensor, which the step cannot read"),
    "a sparse tensor": (lambda step: torch.tensor([1e-3]).to_sparse(),
                        r"a torch\.sparse_coo tensor, which the step cannot read"),
}


def _schedule_calls(lr):
    """Each way a schedule is evaluated: the functional init and step (one tensor, several:
    counters stacked), the class step on the reference and the default backend (the
    direct step's rows, from the second step)."""
    def functional(params):
        state = vega.adamw_init(params)
        vega.adamw_step(params, [torch.ones_like(p) for p in params], state, lr=lr)

    def classes(backend):
        ps = _params(3)
        opt = vega.optim.AdamW(ps, backend=backend)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()  # (a constant lr: the direct step is planned)
        opt.param_groups[0]["lr"] = lr
        opt.step()
    return {
        "init": lambda: vega.adamw_init([torch.ones(3)], lr=lr),
        "step of one tensor": lambda: functional([torch.ones(3)]),
        "step of several": lambda: functional([torch.ones(3), torch.ones(2, 2)]),
        "class on reference": lambda: classes("reference"),
        "class on the default backend": lambda: classes(None),
    }


@pytest.mark.parametrize("what", BAD_SCHEDULES)
def test_a_schedule_that_returns_no_single_value_is_named(what):
    lr, message = BAD_SCHEDULES[what]
    for where, call in _schedule_calls(lr).items():
        with pytest.raises(ValueError, match=rf"hyperparameter 'lr': its schedule returned "
                                             rf"{message}"):
            call()


def test_a_schedule_may_return_a_number_or_a_one_element_tensor():
    for lr in (lambda step: 1e-3, lambda step: torch.tensor([1e-3]),
               lambda step: step.double() * 0 + 1e-3, lambda step: step + 1):
        for call in _schedule_calls(lr).values():
            call()


# (a schedule, the hyperparameter given it, the first step and value outside its range)
OUT_OF_RANGE = {
    "a negative constant": (lambda: vega.schedule.constant(-0.1), "lr", r"-0\.1 at step 0"),
    "a decay past zero": (lambda: vega.schedule.linear(1e-3, -1e-3, 4), "lr",
                          r"-0\.0005 at step 3"),
    "b1 rising past 1": (lambda: vega.schedule.linear(0.9, 1.5, 10), "b1", r"1\.02 at step 2"),
    "a join's later segment": (lambda: vega.schedule.join([(5, 1e-3), (5, -1.0)]), "lr",
                               r"-1\.0 at step 5"),
    "a piecewise value": (lambda: vega.schedule.piecewise_constant([3], [1e-3, -1.0]), "lr",
                          r"-1\.0 at step 4"),
    "a restart's floor": (lambda: vega.schedule.cosine_decay_restarts(1.0, 10, alpha=-0.5),
                          "lr", r"-0\.19\d+ at step 7"),
    # (cycles that grow past the range: the first cycle outside, of many unlisted by reach)
    "restarts growing": (lambda: vega.schedule.cosine_decay_restarts(0.5, 10, m_mul=1.1), "b1",
                         r"1\.07\d+ at step 80"),
    "a join's restarts": (lambda: vega.schedule.join([(7, 0.5), (9, vega.schedule.
                          cosine_decay_restarts(0.5, 10, m_mul=1.1))]), "b1",
                          r"1\.07\d+ at step 87"),
}


@pytest.mark.parametrize("what", OUT_OF_RANGE)
def test_a_schedule_that_leaves_the_range_is_refused(what):
    """A float given for a hyperparameter is checked against its range; so is a schedule of
    vega.schedule, over every count of the step counter, on the host, where it is given (the
    functional step, init, a class and its groups, L-BFGS): a decay past zero stepped
    uphill, a b1 reaching 1 divided by 0. The message names the first step outside."""
    make, name, at = OUT_OF_RANGE[what]
    msg = (rf"{name}={re.escape(shown(make()))} is {at}, outside {name}'s range .*; give a "
           r"schedule that stays within it at every count a step counter holds")
    ps = _params(2)
    before = [p.detach().clone() for p in ps]
    grads = [torch.ones_like(p) for p in ps]
    with pytest.raises(ValueError, match="adamw_step: " + msg):
        vega.adamw_step(before, grads, vega.adamw_init(before), **{name: make()})
    with pytest.raises(ValueError, match="adamw_init: " + msg):
        vega.adamw_init(before, **{name: make()})
    with pytest.raises(ValueError, match="AdamW: " + msg):
        vega.optim.AdamW(ps, **{name: make()})
    for backend in ("reference", None):
        opt = _stepped(vega.optim.AdamW(ps, backend=backend), ps, steps=1)
        stepped = [p.detach().clone() for p in ps]
        opt.param_groups[0][name] = make()
        with pytest.raises(ValueError, match=msg):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, stepped))  # (refused unstepped)
        with torch.no_grad():
            for p, q in zip(ps, before):
                p.copy_(q)
    if name == "lr":
        with pytest.raises(ValueError, match="lbfgs_step: " + msg):
            vega.lbfgs_step(before, grads, vega.lbfgs_init(before), lr=make())
        with pytest.raises(ValueError, match="LBFGS: " + msg):
            vega.optim.LBFGS(ps, lr=make())


def test_a_schedule_within_the_range_is_taken():
    """Within the range, at its bounds, and growing to infinity where the range has no
    upper bound (an exponential growth of lr, as a rate range test runs, overflows only
    past the float range); a checked schedule pickles as a fresh one."""
    S = vega.schedule
    ps = [torch.ones(3)]
    for name, sched in [("lr", S.warmup_cosine_decay(0.0, 1e-3, 10, 90)),
                        ("lr", S.exponential_decay(1e-7, 10.0, 100)),
                        ("b1", S.linear(0.8, 0.0, 10)), ("b1", S.join([(3, 0.5), (3, 0.9)])),
                        ("lr", S.cosine_decay_restarts(1e-3, 10, t_mul=2.0, m_mul=0.5))]:
        vega.adamw_step(ps, [torch.ones(3)], vega.adamw_init(ps), **{name: sched})
        vega.optim.AdamW([torch.nn.Parameter(torch.ones(3))], **{name: sched})
        assert pickle.dumps(sched) == pickle.dumps(copy.deepcopy(sched))
        assert pickle.loads(pickle.dumps(sched)) == sched


# -- state leaves of the functional step ----------------------------------------------

@pytest.mark.parametrize("mu,message", [
    ([1.0], r"state leaf 'mu\.0' is 1\.0, a float, not a tensor"),
    ([[1.0]], r"state field 'mu' does not have the structure of params: params have a leaf "
              r"at '0', 'mu' has a float at '0\.0'"),
    ([torch.ones(3), torch.ones(3)], r"state field 'mu' does not have the structure of "
                                     r"params: params have nothing more, 'mu' has a tensor at "
                                     r"'1'"),
    ((torch.ones(3),), r"state field 'mu' does not have the structure of params: 'mu' is a "
                       r"tuple, params a list"),
    ([None], r"state leaf 'mu\.0' is missing"),
])
def test_a_state_leaf_that_is_not_a_tensor_is_named(mu, message):
    p = torch.ones(3)
    state = vega.adamw_init([p])
    state["mu"] = mu
    with pytest.raises(ValueError, match=rf"^adamw_step: {message}"):
        vega.adamw_step([p], [p], state)


@pytest.mark.parametrize("state,message", [
    (lambda s: list(s.values()), r"state must be the dict that adamw_init returns, got list"),
    (lambda s: None, r"state must be the dict that adamw_init returns, got NoneType"),
    (lambda s: {"mu": s["mu"]}, r"state has fields \['mu'\], but this step \(amsgrad=False\) "
                                r"needs \['mu', 'nu', 'step'\]; make it with "
                                r"adamw_init\(params, amsgrad=False\)"),
])
def test_a_state_that_is_not_the_inits_dict_is_named(state, message):
    """docs/robustness.md, "States of the functional API": not a dict, or other fields."""
    p = torch.ones(3)
    with pytest.raises(ValueError, match=rf"^adamw_step: {message}"):
        vega.adamw_step([p], [p], state(vega.adamw_init([p])))


@pytest.mark.parametrize("grads,message", [
    ({"b": torch.ones(3), "a": torch.ones(3)}, r"grads have the leaves of params in another "
                                               r"order \('b', 'a'\); a dict's keys are read in "
                                               r"their order"),
    ({"a": torch.ones(3), "c": torch.ones(3)}, r"params have a leaf at 'b', grads have a "
                                               r"tensor at 'c'"),
    (collections.OrderedDict(a=torch.ones(3), b=torch.ones(3)), r"grads are a OrderedDict, "
                                                                r"params a dict"),
])
def test_grads_of_another_structure_say_where(grads, message):
    """(the message said only "2 leaves against 2")"""
    params = {"a": torch.ones(3), "b": torch.ones(3)}
    with pytest.raises(ValueError, match=r"^adamw_step: grads do not have the structure of "
                                         r"params \(2 leaves against 2\): " + message):
        vega.adamw_step(params, grads, vega.adamw_init(params))


_Pair = collections.namedtuple("_Pair", "u v")


@pytest.mark.parametrize("kind,message", [
    (tuple, r"grads have a tuple at 'a\.x', where params have a list"),
    (collections.OrderedDict, r"grads have a OrderedDict at 'n\.v\.1', where params have a "
                              r"dict"),
])
def test_grads_whose_inner_containers_differ_say_where(kind, message):
    """A container of another type inside the trees is named by its path (the message said
    only "3 leaves against 3"), for the gradients and for a state field."""
    def tree(seq, mapping):
        return {"a": {"x": seq([torch.ones(2)])},
                "n": _Pair(torch.ones(1), [torch.ones(3), mapping(w=torch.ones(2))])}
    params = tree(list, dict)
    grads = tree(kind, dict) if kind is tuple else tree(list, kind)
    with pytest.raises(ValueError, match=r"^adamw_step: grads do not have the structure of "
                                         r"params \(4 leaves against 4\): " + message):
        vega.adamw_step(params, grads, vega.adamw_init(params))
    state = vega.adamw_init(params)
    state["mu"] = grads
    field = message.replace("grads have", "'mu' has")
    with pytest.raises(ValueError, match=r"^adamw_step: state field 'mu' does not have the "
                                         r"structure of params: " + field):
        vega.adamw_step(params, params, state)


def test_backend_c_names_parameters_off_the_cpu_before_their_counters():
    """(meta parameters were refused for their step counter's device, which follows theirs)"""
    params = {"w": torch.empty(3, device="meta")}
    with pytest.raises(ValueError, match=r"^adamw_step: params leaf 'w': backend 'c' runs on "
                                         r"CPU tensors, got parameters on meta; use "
                                         r"backend='triton' or 'reference'"):
        vega.adamw_step(params, {"w": torch.empty(3, device="meta")}, vega.adamw_init(params),
                        backend="c")


def test_params_with_two_leaves_of_one_name_are_refused_at_init():
    """{1: a, "1": b}: both leaves are named '1', which vega.save and get_leaf refused only
    once a state had been made and stepped."""
    with pytest.raises(ValueError, match=r"^adamw_init: two leaves of params are both named "
                                         r"'1' \(a state names each leaf by its keys joined "
                                         r"with '\.'\); rename a key"):
        vega.adamw_init({1: torch.ones(2), "1": torch.ones(2)})
    assert vega.state_names(vega.adamw_init({1: torch.ones(2), 2: torch.ones(2)}))[:2] == \
        ["mu.1", "mu.2"]


# -- state files ----------------------------------------------------------------------

def test_save_refuses_a_meta_or_sparse_leaf(tmp_path):
    path = tmp_path / "s.safetensors"
    with pytest.raises(ValueError, match=r"^vega\.save: state leaf 'mu\.w' is a meta tensor"):
        vega.save(path, {"mu": {"w": torch.empty(3, device="meta")}, "step": torch.zeros(())})
    with pytest.raises(ValueError, match=r"^vega\.save: state leaf 'mu' is a torch\.sparse_coo "
                                         r"tensor"):
        vega.save(path, {"mu": torch.ones(3).to_sparse()})
    assert not os.listdir(tmp_path)  # nothing written, not even the temporary file


@pytest.mark.parametrize("state,where", [
    ({"": torch.ones(3)}, ""),
    ({"mu": {"": torch.ones(3)}, "step": torch.zeros((), dtype=torch.int32)}, " under 'mu'"),
    ({"": {"w": torch.ones(3)}}, ""),
    ({"mu": {"a": {"": torch.ones(3)}}}, " under 'mu.a'"),
])
def test_an_empty_key_is_refused_on_save_and_load(tmp_path, state, where):
    message = rf"the state has an empty key{re.escape(where)}; each leaf is named by its keys"
    path = tmp_path / "s.safetensors"
    with pytest.raises(ValueError, match=rf"^vega\.save: {message}"):
        vega.save(path, state)
    vega.save(path, {"mu": torch.ones(3)})
    with pytest.raises(ValueError, match=rf"^vega\.load: {message}"):
        vega.load(path, like=state)
    with pytest.raises(ValueError, match=rf"^vega\.get_leaf: {message}"):
        vega.get_leaf(state, "mu")


def test_a_state_made_for_params_with_an_empty_key_cannot_be_saved(tmp_path):
    state = vega.adamw_init({"": torch.ones(3)})
    with pytest.raises(ValueError, match=r"empty key under 'mu'"):
        vega.save(tmp_path / "s.safetensors", state)


# -- loss scale settings --------------------------------------------------------------

@pytest.mark.parametrize("kw,message", [
    (dict(backoff_factor=2), "backoff_factor=2 must be below 1"),
    (dict(backoff_factor=1.0), "backoff_factor=1.0 must be below 1"),
    (dict(growth_factor=1.0), "growth_factor=1.0 must be above 1"),
    (dict(growth_factor=0.5), "growth_factor=0.5 must be above 1"),
    (dict(growth_factor=10**400), "growth_factor=1000"),
    (dict(backoff_factor=0.0), "backoff_factor=0.0 must be positive"),
])
def test_loss_scale_factors_are_those_gradscaler_takes(kw, message):
    """torch.amp.GradScaler: growth_factor > 1, backoff_factor < 1 (and vega: > 0)."""
    (name, value), = kw.items()
    for who, call in [
            ("LossScale.dynamic", lambda: LossScale.dynamic(**kw)),
            ("LossScale", lambda: LossScale(torch.tensor(8.0), torch.tensor(0, dtype=torch.int32),
                                            **kw)),
            ("LossScale.adjust", lambda: LossScale.dynamic().adjust(True, **kw)),
            ("LossScale.adjust", lambda: LossScale.static(4.0).adjust(True, **kw))]:
        with pytest.raises(ValueError, match=rf"^{re.escape(who)}: {re.escape(message)}"):
            call()
    torch.amp.GradScaler("cpu", growth_factor=1.5, backoff_factor=0.9)  # the edges it takes
    ls = LossScale.dynamic(init=4.0, growth_factor=1.5, backoff_factor=0.9)
    assert math.isclose(ls.adjust(False).loss_scale.item(), 3.6, rel_tol=1e-6)


# -- spec files -----------------------------------------------------------------------

GOOD = "optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n"


def test_compile_file_reads_only_a_regular_file_of_utf8_text(tmp_path):
    """(A device without end and a FIFO: tests/test_cli.py, in a bounded process.)"""
    with pytest.raises(vega.SpecError, match=r"/dev/null: error: a character device, not a "
                                             r"regular file"):
        vega.compile_file("/dev/null")
    with pytest.raises(vega.SpecError, match=r": error: a directory, not a regular file"):
        vega.compile_file(tmp_path)
    binary = tmp_path / "bin.vega"
    binary.write_bytes(b"optimizer o() {\n  p = p\n}\n# \xff\xfe\n")
    with pytest.raises(vega.SpecError, match=r"bin\.vega: error: not UTF-8 text \(byte 0xff at "
                                             r"offset 28\)"):
        vega.compile_file(binary)
    big = tmp_path / "big.vega"
    big.write_text(GOOD + "#" * (1 << 20) + "\n")
    with pytest.raises(vega.SpecError, match=r"big\.vega: error: larger than 1048576 bytes "
                                             r"\(1 MiB\)"):
        vega.compile_file(big)
    with pytest.raises(FileNotFoundError, match=r"missing\.vega: error: cannot read spec file: "
                                                r"No such file"):
        vega.compile_file(tmp_path / "missing.vega")
    crlf = tmp_path / "crlf.vega"
    crlf.write_bytes(GOOD.replace("\n", "\r\n").encode())
    assert vega.compile_file(crlf).name == "o"  # line ends read as open() reads text
    bom = tmp_path / "bom.vega"  # (UTF-8 with a byte-order mark, as editors may save it)
    bom.write_bytes(b"\xef\xbb\xbf" + (GOOD + "x\n").encode())
    with pytest.raises(vega.SpecError, match=r"bom\.vega:4:1: error"):  # (columns as without)
        vega.compile_file(bom)
    bom.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert vega.compile_file(bom).name == "o"


def test_program_refuses_a_shape_no_tensor_has():
    for shape, message in [((-1, 2), "has a negative size"), ((10**30,), "is too large"),
                           ((2**32, 2**32), "is too large"), ((2.5,), "whole numbers"),
                           (5, "whole numbers")]:
        with pytest.raises(ValueError, match=rf"^adafactor\.program: shape=.* {message}"):
            vega.adafactor.program(shape)
    assert vega.adafactor.program(torch.Size([3, 4])) is vega.adafactor.program([3, 4])
    # a shape of 2**61 to 2**63 - 1 elements, which a tensor's element count holds and its
    # float32 bytes do not, has its program (it was torch's RuntimeError: Storage size
    # calculation overflowed, a traceback of vega show adafactor --shape 4611686018427387904)
    factored, plain = vega.adafactor.program((200, 300)), vega.adafactor.program((5,))
    assert factored is not plain
    assert vega.adafactor.program((2**55, 128)) is factored
    for shape in [(2**62,), (2,) * 62, (2**63 - 1,)]:
        assert vega.adafactor.program(shape) is plain


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("where", ["grads", "mu", "nu", "params"])
def test_a_tensor_on_another_device_is_named_before_anything_is_written(where, backend):
    """The quick check of a step (every parameter, gradient and state leaf on the first
    parameter's device: ``vega.codegen.tensors.like``) lets no leaf on another device
    through, a parameter's own included: the leaf and both devices are named, and nothing
    is written."""
    params = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    state = vega.adamw_init(params)
    if where == "grads":
        grads["b"] = torch.empty(2, 2, device="meta")
    elif where == "params":  # (its gradient and state on the first parameter's device)
        params["b"] = torch.empty(2, 2, device="meta")
    else:
        state[where]["b"] = torch.empty(2, 2, device="meta")
    before = copy.deepcopy((params, state))
    words = r"leaf 'b' is on cpu, the parameter on meta" if where == "params" else \
        r"leaf '(mu\.|nu\.)?b'.* on meta.*on cpu"
    with pytest.raises(ValueError, match=words):
        vega.adamw_step(params, grads, state, donate=True, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(
        [params["a"], state["mu"]["a"], state["nu"]["a"], state["step"]],
        [before[0]["a"], before[1]["mu"]["a"], before[1]["nu"]["a"], before[1]["step"]]))


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("kind", ["sparse_csr", "sparse_coo", "nested"])
def test_a_sparse_or_nested_gradient_is_named_before_anything_is_written(kind, backend):
    """A gradient of any layout but strided (CSR as well as COO), or a nested tensor, is
    refused with its leaf named, before the other leaves are written (a CSR gradient reached
    torch's ``is_contiguous`` and the reference stepped the leaves before it)."""
    import warnings
    params = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    grads = {"a": torch.full((3,), 0.5)}
    with warnings.catch_warnings():  # (torch's beta and prototype notes)
        warnings.simplefilter("ignore")
        grads["b"] = {"sparse_csr": lambda: torch.eye(2).to_sparse_csr(),
                      "sparse_coo": lambda: torch.eye(2).to_sparse(),
                      "nested": lambda: torch.nested.nested_tensor([torch.ones(2)] * 2)}[kind]()
    state = vega.adamw_init(params)
    words = "is a nested tensor" if kind == "nested" else rf"is sparse \(torch.{kind}\)"
    with pytest.raises(ValueError, match=rf"grads leaf 'b' {words}"):
        vega.adamw_step(params, grads, state, donate=True, backend=backend)
    assert torch.equal(params["a"], torch.ones(3)) and int(state["step"]) == 0
    assert not state["mu"]["a"].any()


@pytest.mark.parametrize("backend", [None, "reference"])
def test_a_fused_step_over_gradients_on_two_devices_names_them(backend):
    """Clipping sums over every gradient at once: gradients on two devices (each on its
    parameter's) are refused with both devices named (``tensors.on_one_device``)."""
    params = {"a": torch.ones(3), "b": torch.ones(2, device="meta")}
    grads = {"a": torch.ones(3), "b": torch.ones(2, device="meta")}
    with pytest.raises(ValueError, match=r"needs all gradients on one device, got "
                                         r"\['cpu', 'meta'\]"):
        vega.adamw_step(params, grads, vega.adamw_init(params), max_grad_norm=1.0,
                        backend=backend)


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("where, dtype", [("grads", torch.int64), ("grads", torch.bool),
                                          ("mu", torch.int32), ("nu", torch.bool)])
def test_an_integer_or_bool_gradient_or_state_is_refused_before_anything_is_written(
        where, dtype, backend):
    """A gradient leaf of an integer or bool dtype is refused with a ValueError naming it,
    a state tensor of one with the state and the dtype named, on every backend, and nothing
    is written (the reference stepped an int32 ``mu``, which kept its values truncated to
    integers, and promoted an integer gradient)."""
    params = {"a": torch.ones(3), "b": torch.ones(2, 2)}
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    state = vega.adamw_init(params)
    if where == "grads":
        grads["b"] = torch.ones(2, 2, dtype=dtype)
    else:
        state[where]["b"] = torch.zeros(2, 2, dtype=dtype)
    before = copy.deepcopy((params, state))
    words = rf"grads leaf 'b' has dtype {dtype}; vega steps floating-point" \
        if where == "grads" else rf"backend '{backend}'.*state.*{dtype}"
    with pytest.raises(ValueError, match=words):
        vega.adamw_step(params, grads, state, donate=True, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(
        [params["a"], params["b"], state["mu"]["a"], state["nu"]["a"], state["step"]],
        [before[0]["a"], before[0]["b"], before[1]["mu"]["a"], before[1]["nu"]["a"],
         before[1]["step"]]))


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("key, wrong", [("mu", "shape"), ("d", "shape"), ("p0", "dtype")])
def test_a_staged_class_step_names_a_wrong_state_before_anything_is_written(key, wrong,
                                                                           backend):
    """Prodigy's class step runs in stages (its sums over the group): a state tensor set by
    hand to another shape or to an integer dtype is named as the plain step names it, on
    every backend, and nothing is written (the reference's staged step checked neither: a
    raw RuntimeError of mismatched sizes, an int32 state truncated)."""
    params = _params()
    opt = _stepped(vega.optim.Prodigy(params, backend=backend), params)
    st = opt.state[params[1]]
    st[key] = torch.zeros(3) if wrong == "shape" else st[key].to(torch.int32)
    before = _snapshot(opt), [p.detach().clone() for p in params]
    words = rf"^Prodigy: parameter 1 of group 0: backend '{backend}': state '{key}' has shape " \
        r"\(3,\)" if wrong == "shape" else rf"backend '{backend}'.* state( '{key}')?.* torch.int32"
    with pytest.raises(ValueError, match=words):
        _stepped(opt, params, steps=1)
    after = _snapshot(opt), [p.detach().clone() for p in params]
    assert all(torch.equal(x, y) for x, y in zip(before[1], after[1]))
    for i in before[0][0]:
        assert all(torch.equal(v, after[0][0][i][k]) for k, v in before[0][0][i].items())


@pytest.mark.parametrize("name, key, wrong, words", [
    ("Prodigy", "num", lambda x: x.reshape(1), r"state 'num' has shape \(1,\)"),
    ("Prodigy", "mu", lambda x: x.to(torch.complex64),
     "state 'mu' is of dtype torch.complex64, but its parameter is of dtype torch.float32: "
     "real like it"),
    ("AdamW", "mu", lambda x: x.to(torch.complex64),
     "state 'mu' is of dtype torch.complex64, but its parameter is of dtype torch.float32: "
     "real like it"),
    ("AdamW", "nu", lambda x: x.to(torch.float8_e4m3fn),
     "does not support state 'nu' of dtype torch.float8_e4m3fn")])
@pytest.mark.parametrize("how", ["in place", "in a new dict"])
def test_a_wrong_state_of_the_second_group_is_named_before_the_first_is_written(name, key,
                                                                               wrong, words,
                                                                               how):
    """A class step of two groups checks both before either is written: a state set by hand
    in the second group to another shape, or to a dtype the C kernels do not take (complex,
    float8), is named and nothing is written (the first group's kernels had run: Prodigy's
    step in stages checked no group before the first, and float8 and complex states passed
    the checks the kernels then refused)."""
    params = _params(3)
    opt = _stepped(getattr(vega.optim, name)([{"params": params[:1]}, {"params": params[1:]}]),
                   params)
    if how == "in place":
        opt.state[params[2]][key] = wrong(opt.state[params[2]][key])
    else:  # (the group's plan made again: its tensors not known to be plain ones)
        opt.state[params[2]] = {**opt.state[params[2]], key: wrong(opt.state[params[2]][key])}
    before = [p.detach().clone() for p in params], _snapshot(opt)[0]
    with pytest.raises(ValueError, match=f"{name}: parameter 1 of group 1: .*{words}"):
        _stepped(opt, params, steps=1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before[0]))
    after = _snapshot(opt)[0]
    for i, st in before[1].items():
        for k, v in st.items():
            assert v.dtype == after[i][k].dtype and torch.equal(v, after[i][k]), (i, k)


@pytest.mark.parametrize("name", ["AdamW", "NAdam"])
def test_complex_parameters_in_two_groups_step_as_in_one(name):
    """Complex parameters (and their complex states) are stepped as their real views; the
    checks a class step of several calls makes before the first writes take them."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(5, 3, dtype=torch.complex64, generator=gen) for _ in range(3)]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    cls = getattr(vega.optim, name)
    opt = cls([{"params": ours[:1]}, {"params": ours[1:]}], backend="c")
    one = cls(theirs, backend="c")
    for step in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        one.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert all(torch.equal(opt.state[p][k], one.state[q][k]) for k in opt.state[p])


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("name", ["Prodigy", "DAdaptAdamW"])
def test_a_step_in_stages_steps_complex_parameters_as_their_real_views(name, backend):
    """Prodigy's and D-Adaptation's steps (sums over the group between the phases) step a
    complex parameter as its two real coordinates: bit for bit as the same values given as
    a real parameter of shape (..., 2), the state's d too. (The reference backend cast the
    gradient to real, which dropped its imaginary part and left every parameter real after
    the first step; the C and Triton backends refused complex parameters.) The functional
    step, pure, gives the same values and leaves its inputs alone."""
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
    z = torch.nn.Parameter(value.clone())
    r = torch.nn.Parameter(torch.view_as_real(value).clone())
    ours = getattr(vega.optim, name)([z], lr=0.5, backend=backend)
    twin = getattr(vega.optim, name)([r], lr=0.5, backend=backend)
    grads = [torch.randn(5, 3, dtype=torch.complex64, generator=gen) for _ in range(3)]
    for g in grads:
        z.grad, r.grad = g.clone(), torch.view_as_real(g).clone()
        ours.step()
        twin.step()
    assert torch.equal(torch.view_as_real(z.detach()), r.detach())
    assert z.detach().imag.abs().min() > 0
    for key, x in ours.state[z].items():
        assert torch.equal(torch.view_as_real(x) if x.is_complex() else x, twin.state[r][key]), key
    spec = vega.builtin({"Prodigy": "prodigy", "DAdaptAdamW": "dadapt_adamw"}[name])
    params, state = {"z": value.clone()}, spec.init({"z": value.clone()}, lr=0.5)
    for g in grads:
        g_in = {"z": g.clone()}
        was = copy.deepcopy((params, state))
        new_params, new_state = spec.step(params, g_in, state, backend=backend, lr=0.5)
        assert torch.equal(g_in["z"], g) and torch.equal(params["z"], was[0]["z"])
        assert all(torch.equal(x, y) for x, y in zip(
            [state[k] if k == "step" else state[k]["z"] for k in state],
            [was[1][k] if k == "step" else was[1][k]["z"] for k in state]))
        params, state = new_params, new_state
    assert torch.equal(params["z"], z.detach())


def _set_by_hand_is_refused(name, backend, groups, dtype, key, new, match) -> None:
    """A class over two parameters of ``dtype`` (in one group, or in two) steps once; state
    ``key`` of the second is set by hand to ``new(its value)``; the next step is refused with
    a ValueError matching ``match``, and no parameter or state is written."""
    ps = [torch.nn.Parameter(torch.randn(5, 3, dtype=dtype)) for _ in range(2)]
    opt = getattr(vega.optim, name)([{"params": ps}] if groups == 1 else
                                    [{"params": ps[:1]}, {"params": ps[1:]}], backend=backend)
    for p in ps:
        p.grad = torch.randn(5, 3, dtype=dtype)
    opt.step()
    opt.state[ps[1]][key] = new(opt.state[ps[1]][key])
    before = [[p.detach().clone(), *(v.clone() for v in opt.state[p].values())] for p in ps]
    with pytest.raises(ValueError, match=match):
        opt.step()
    for p, was in zip(ps, before):
        assert all(torch.equal(a, b) for a, b in zip([p.detach(), *opt.state[p].values()], was))


def _named(name: str, groups: int) -> str:
    """How a class names the second of ``_set_by_hand_is_refused``'s parameters."""
    return rf"^{name}: parameter {1 if groups == 1 else 0} of group {groups - 1}: "


@pytest.mark.parametrize("groups", [1, 2])
def test_a_real_state_of_a_complex_parameter_is_named_as_such(groups):
    """A state set by hand to a real tensor for a complex parameter is named for what it
    is, not as a dtype the backend does not take, and by the parameter's place in its group
    where the group holds another complex parameter (whose complex state had the backend's
    check name it as 'parameter 1' of the kernel's call, and each one's check alone found
    nothing wrong)."""
    _set_by_hand_is_refused("AdamW", "c", groups, torch.complex64, "mu",
                            lambda x: x.real.clone(),
                            _named("AdamW", groups) + r"state 'mu' is of dtype torch.float32, "
                            r"but its parameter is of dtype torch.complex64: complex like it")


def _made_complex_is_refused(name, backend, match) -> None:
    """A class over a real matrix in each of two groups steps twice; the second parameter's
    data is made complex (``p.data = ...``, its states stay real); the next step is refused
    with a ValueError matching ``match``, and no parameter or state is written (the first
    group's included)."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(2)]
    opt = getattr(vega.optim, name)([{"params": ps[:1]}, {"params": ps[1:]}], backend=backend)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(5, 3, generator=gen)
        opt.step()
    ps[1].data = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
    for p in ps:
        p.grad = torch.randn(5, 3, dtype=p.dtype, generator=gen)
    before = [[p.detach().clone(), *(v.clone() for v in opt.state[p].values())] for p in ps]
    with pytest.raises(ValueError, match=match):
        opt.step()
    for p, was in zip(ps, before):
        assert all(torch.equal(a, b) for a, b in zip([p.detach(), *opt.state[p].values()], was))


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_parameter_made_complex_after_its_real_state_is_refused_by_name(backend):
    """A parameter whose data became complex after its first steps keeps real states: refused
    by name before the first group is written (the reference refused it inside the second
    group's run, after the first group had stepped, naming its position in that call)."""
    _made_complex_is_refused("AdamW", backend, r"^AdamW: parameter 0 of group 1: state 'mu' "
                             r"is of dtype torch.float32, but its parameter is of dtype "
                             r"torch.complex64: complex like it")


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_parameter_made_complex_under_row_and_column_reductions_is_refused_by_name(backend):
    """Muon's orthogonalization has no complex form: a matrix made complex after its first
    steps is refused by name before the first group is written (it was refused inside the
    second group's run, after the first group had stepped, without naming it)."""
    _made_complex_is_refused("Muon", backend, r"^Muon: parameter 0 of group 1 is of dtype "
                             r"torch.complex64: muon's matrix products step real "
                             r"parameters only")


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_complex_parameter_under_row_and_column_reductions_is_named_at_its_first_step(
        backend):
    """A complex matrix given to Muon is refused at its first step by name, before anything
    is written or any state is kept (the message, from the making of its state, named no
    parameter)."""
    gen = torch.Generator().manual_seed(0)
    real = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    z = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64, generator=gen))
    opt = vega.optim.Muon([{"params": [real]}, {"params": [z]}], backend=backend)
    real.grad = torch.randn(5, 3, generator=gen)
    z.grad = torch.randn(4, 3, dtype=torch.complex64, generator=gen)
    was = real.detach().clone()
    with pytest.raises(ValueError, match=r"^Muon: parameter 0 of group 1 is of dtype "
                                         r"torch.complex64: muon's matrix products"):
        opt.step()
    assert torch.equal(real.detach(), was) and not opt.state


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_complex_state_of_a_real_parameter_is_refused(groups, backend):
    """A state set by hand to a complex tensor for a real parameter is refused by name on
    every backend, and nothing is written (the reference dropped its imaginary part with
    torch's warning, and kept a complex state)."""
    _set_by_hand_is_refused("AdamW", backend, groups, torch.float32, "mu",
                            lambda x: x.to(torch.complex64),
                            _named("AdamW", groups) + r".*state 'mu' is of dtype torch.complex64, "
                            r"but its parameter is of dtype torch.float32: real like it")


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("name, key", [("NAdam", "mu_product"), ("Prodigy", "d")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_a_complex_state_of_one_number_is_refused(dtype, name, key, groups, backend):
    """A state of one number (NAdam's mu_product, Prodigy's d) set by hand to a complex
    tensor is refused by name, for real and complex parameters alike (it is real for both),
    and nothing is written (the reference stepped it, its imaginary part dropped; one call
    over complex parameters named it by its real view's shape)."""
    _set_by_hand_is_refused(name, backend, groups, dtype, key, lambda x: x.to(torch.complex64),
                            _named(name, groups) + rf".*state '{key}' is of dtype "
                            r"torch.complex64, but its parameter is of dtype .*: a state of one "
                            r"number is real")


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_a_complex_parameters_state_set_to_its_real_view_is_refused(name, groups, backend):
    """A state set by hand to the real view of its complex value, shaped ``(..., 2)``, is
    refused by shape, in the class's words, whether the step is one call or several (Prodigy's
    one call: a step in stages), and nothing is written (one call took it as the parameter's
    real view, and stepped it; torch.optim refuses it)."""
    _set_by_hand_is_refused(name, backend, groups, torch.complex64, "mu",
                            lambda x: torch.view_as_real(x).clone(),
                            _named(name, groups) + r".*state 'mu' has shape \(5, 3, 2\), but "
                            r"its parameter, of shape \(5, 3\)")


def test_a_step_over_lists_names_a_real_state_of_a_complex_parameter():
    """``engine.run``, beneath every step over lists, names a real state of a complex
    parameter before any kernel runs."""
    from vega.runtime import engine
    program = vega.adamw.program()
    p, g = torch.randn(5, 3, dtype=torch.complex64), torch.randn(5, 3, dtype=torch.complex64)
    mu = torch.zeros(5, 3, 2)
    with pytest.raises(ValueError, match=r"state 'mu' of parameter 0 is of dtype "
                                         r"torch.float32, but its parameter is of dtype "
                                         r"torch.complex64: complex like it"):
        engine.run(program, "c", [p], [g], [[mu], [torch.zeros_like(p)]],
                   [torch.zeros((), dtype=torch.int32)], [{}], donate=True)
    assert not mu.any()


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_rule_with_a_state_of_one_number_steps_complex_parameters_as_torch(backend):
    """NAdam keeps one number a tensor (``mu_product``): real for a complex parameter, whose
    other states are complex like it (its first step failed in view_as_complex of a 0-d
    tensor); stepped as torch.optim.NAdam steps complex parameters."""
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
    p, q = torch.nn.Parameter(value.clone()), torch.nn.Parameter(value.clone())
    ours, theirs = vega.optim.NAdam([p], backend=backend), torch.optim.NAdam([q])
    for _ in range(4):
        p.grad = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
        q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    assert ours.state[p]["mu_product"].dtype == torch.float32
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("name, key", [("AdamW", "mu"), ("NAdam", "mu_product"),
                                       ("Prodigy", "d")])
def test_a_sparse_state_set_by_hand_is_named_before_anything_is_written(name, key, backend):
    """A state entry set by hand to a sparse tensor is named as sparse, and nothing is
    written (it was called an expanded tensor, and a sparse state of one number failed with
    torch's raw 'Cannot access data pointer')."""
    params = _params()
    opt = _stepped(getattr(vega.optim, name)(params, backend=backend), params)
    opt.state[params[1]][key] = opt.state[params[1]][key].to_sparse()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"state '{key}' of parameter 1 .*is sparse "
                                         r"\(torch.sparse_coo\); a step in place writes "
                                         r"dense \(strided\) tensors"):
        _stepped(opt, params, steps=1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def _not_dense(kind: str) -> torch.Tensor:
    import warnings
    with warnings.catch_warnings():  # (torch's beta and prototype notes)
        warnings.simplefilter("ignore")
        return {"sparse_coo": lambda: torch.eye(3).to_sparse(),
                "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
                "nested": lambda: torch.nested.nested_tensor([torch.ones(3)] * 3)}[kind]()


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "nested"])
def test_a_sparse_or_nested_parameter_is_named_by_init_step_and_the_classes(kind, backend):
    """A sparse (COO or CSR) or nested parameter is refused with its leaf named: by
    ``*_init`` (whose states torch cannot make like it: NotImplementedError before), by a
    step before anything is written (a RuntimeError from torch before), and by a class when
    it is given the parameter."""
    words = "is a nested tensor" if kind == "nested" else rf"is sparse \(torch.{kind}\)"
    with pytest.raises(ValueError, match=rf"^adamw_init: params leaf 'w' {words}; vega steps "
                                         r"dense \(strided\) parameters"):
        vega.adamw_init({"a": torch.ones(2), "w": _not_dense(kind)})
    state = vega.adamw_init({"a": torch.ones(2), "w": torch.ones(3, 3)})
    params = {"a": torch.ones(2), "w": _not_dense(kind)}
    with pytest.raises(ValueError, match=rf"^adamw_step: params leaf 'w' {words}"):
        vega.adamw_step(params, {"a": torch.ones(2), "w": torch.ones(3, 3)}, state,
                        donate=True, backend=backend)
    assert torch.equal(params["a"], torch.ones(2)) and int(state["step"]) == 0
    assert not state["mu"]["a"].any()
    with pytest.raises(ValueError, match=rf"^AdamW: parameter 1 of group 0 {words}"):
        vega.optim.AdamW([torch.nn.Parameter(torch.ones(2)),
                          torch.nn.Parameter(_not_dense(kind))], lr=0.1)


@pytest.mark.parametrize("name", ["adamw_init", "lbfgs_init"])
def test_init_names_a_lazy_modules_uninitialized_parameter(name):
    """``*_init`` over a lazy module's parameters before its first forward pass names the
    uninitialized leaf (torch's error from inside the init named none)."""
    init, lazy = getattr(vega, name), torch.nn.LazyLinear(3)
    with pytest.raises(ValueError, match=rf"^{name}: params leaf 'weight' is "
                                         r"uninitialized \(a lazy module's, before its first "
                                         r"forward pass\)"):
        init(dict(lazy.named_parameters()))
    lazy(torch.ones(2, 4))
    state = init(dict(lazy.named_parameters()))
    assert state["step"].shape == ()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["adamw", "muon", "lbfgs"])
@pytest.mark.parametrize("backend", ["reference", "c"])
def test_step_names_a_lazy_modules_uninitialized_parameter(name, backend, native, monkeypatch):
    """A functional step over a lazy module's parameters before its first forward pass (with
    a state made for an initialized twin) names the uninitialized leaf, as ``*_init`` does:
    it failed with torch's "Can't access the shape" from inside the step's checks (with the
    native module's passes or without them)."""
    if not native:
        monkeypatch.setattr(vega.codegen.tensors, "native_passes", lambda: None)
    init, step = getattr(vega, f"{name}_init"), getattr(vega, f"{name}_step")
    twin = torch.nn.LazyLinear(3)
    twin(torch.ones(2, 4))
    state = init(dict(twin.named_parameters()))
    lazy = torch.nn.LazyLinear(3)
    grads = {"weight": torch.ones(3, 4), "bias": torch.ones(3)}
    with pytest.raises(ValueError, match=rf"^{name}_step: params leaf 'weight' is "
                                         r"uninitialized \(a lazy module's, before its first "
                                         r"forward pass\): its shape is not known yet"):
        step(dict(lazy.named_parameters()), grads, state,
             **({} if name == "lbfgs" else {"backend": backend}))


@pytest.mark.parametrize("key, value, words", [
    ("maximize", "False", r"group 0: maximize='False' must be True or False"),
    ("backend", "cuda", r"group 0: backend='cuda' is not one of"),
    ("lr", -1.0, r"group 0: lr=-1.0 is outside its range"),
    ("momentum", "x", r"group 0: momentum='x' must be a float"),
])
def test_load_state_dict_checks_each_group_as_add_param_group_does(key, value, words):
    """A loaded group's settings get the checks a group given to the optimizer gets (a
    string ``maximize`` was loaded and, being truthy, turned descent into ascent; an
    unknown backend was loaded and failed every later step), and a refused load changes
    nothing."""
    params = _params()
    opt = _stepped(vega.optim.SGD(params, lr=0.1, momentum=0.9), params)
    before = _snapshot(opt)
    saved = opt.state_dict()
    saved["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=rf"^SGD.load_state_dict: {words}"):
        opt.load_state_dict(saved)
    after = _snapshot(opt)
    assert after[3] is before[3] and after[4] is before[4] and after[1] == before[1]
    for i in before[0]:
        assert all(torch.equal(before[0][i][k], after[0][i][k]) for k in before[0][i])


def test_a_parameter_given_twice_in_a_group_is_named_at_both_places():
    """One parameter twice in a group is refused when the group is given, naming both
    places (a step refused it later as 'parameter 0 shares memory with parameter 0'; torch
    only warns), in the constructor and in add_param_group, which then adds nothing."""
    import warnings
    w, v = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.ones(2))
    with warnings.catch_warnings():  # (torch's own warning of duplicate parameters)
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"^AdamW: parameter 2 of group 0 is parameter 0 "
                                             r"again: give each parameter once"):
            vega.optim.AdamW([w, v, w], lr=0.1)
        opt = vega.optim.AdamW([w], lr=0.1)
        with pytest.raises(ValueError, match=r"parameter 1 of group 1 is parameter 0 again"):
            opt.add_param_group({"params": [v, v]})
    assert len(opt.param_groups) == 1
    # put in a group's list after the optimizer was made: the step says so (it said that
    # the parameter shared memory with itself), in the same group or another
    for group in (0, 1):
        opt = vega.optim.AdamW([{"params": [w]}, {"params": [v]}], lr=0.1)
        opt.param_groups[group]["params"].append(w)
        w.grad, v.grad = torch.ones(3), torch.ones(2)
        with pytest.raises(ValueError, match=r"^AdamW: parameter 0 of group 0 is in the "
                                             r"optimizer twice \(put in a group's list"):
            opt.step()


@pytest.mark.parametrize("attr, value, words", [
    ("max_grad_norm", 0.0, r"max_grad_norm=0.0 must be a positive finite number"),
    ("max_grad_norm", float("nan"), r"max_grad_norm=nan must be a positive finite number"),
    ("max_grad_norm", "3", r"max_grad_norm='3' must be a positive finite number"),
    ("loss_scale", 1024.0, r"loss_scale=1024.0 must be a vega.LossScale"),
    ("skip_nonfinite", 1, r"skip_nonfinite=1 must be True or False"),
])
def test_a_fused_setting_changed_after_construction_is_checked_by_the_step(attr, value, words):
    """``opt.max_grad_norm``, ``opt.loss_scale`` and ``opt.skip_nonfinite`` set after
    construction are checked by the next step as the constructor checks them (0.0 or NaN
    turned clipping off without a word, a float loss scale failed with an AttributeError),
    before anything is written; set back, the step runs."""
    params = _params()
    opt = vega.optim.SGD(params, lr=0.1, max_grad_norm=1.0)
    setattr(opt, attr, value)
    for p in params:
        p.grad = torch.full_like(p, 100.0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"^SGD: {words}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    setattr(opt, attr, {"max_grad_norm": 1.0, "loss_scale": None, "skip_nonfinite": False}[attr])
    opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.parametrize("key, value, words", [
    ("maximize", 1, r"maximize=1 must be True or False"),
    ("maximize", "yes", r"maximize='yes' must be True or False"),
    ("state_dtype", torch.int8, r"state_dtype=torch.int8 must be None, a torch float dtype"),
    ("state_dtype", {"mu": torch.int8}, r"state_dtype\['mu'\]=torch.int8 must be one of"),
    ("backend", "cuda", r"backend='cuda' is not one of"),
    ("foreach", 3, r"foreach=3 must be None, True or False"),
    ("differentiable", True, r"differentiable=True is not supported"),
])
def test_a_group_setting_changed_after_construction_is_checked_by_the_step(key, value, words):
    """A group's ``maximize``, ``state_dtype``, ``backend`` and torch's keywords set after
    the group was given are checked by the next step as the constructor checks them
    (``maximize=1`` stepped as maximizing without a word; ``state_dtype=torch.int8`` made an
    int8 state a kernel then refused), before any state is made or anything written; set
    back, the step runs."""
    params = _params()
    opt = vega.optim.AdamW(params, lr=0.1)
    default = opt.param_groups[0].get(key, False if key == "differentiable" else None)
    opt.param_groups[0][key] = value
    for p in params:
        p.grad = torch.full_like(p, 1.0)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=rf"^AdamW: group 0: {words}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state
    opt.param_groups[0][key] = default
    opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(params, before))


def test_a_dict_of_state_dtypes_changed_in_place_is_checked_and_no_group_is_kept_alive():
    """A group's ``state_dtype`` dict changed in place after a step is checked by the next
    one (a kept dict would be the same object); and the step's memory of what it checked
    holds no group: a group dropped from ``param_groups`` frees its parameters."""
    import gc
    import weakref
    w, v = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(1000))
    opt = vega.optim.AdamW([{"params": [w], "state_dtype": {"mu": torch.float32}},
                            {"params": [v]}], lr=0.1)
    w.grad, v.grad = torch.ones(3), torch.ones(1000)
    opt.step()
    opt.param_groups[0]["state_dtype"]["mu"] = torch.int8
    with pytest.raises(ValueError, match=r"group 0: state_dtype\['mu'\]=torch.int8 must be"):
        opt.step()
    opt.param_groups[0]["state_dtype"]["mu"] = torch.float32
    opt.step()
    gone = weakref.ref(v)
    opt.param_groups.pop()
    del opt.state[v], v
    gc.collect()
    opt.step()
    assert gone() is None


@pytest.mark.parametrize("extra, error, words", [
    ({"lr_": 1.0}, TypeError, r"a parameter group has 'lr_', unknown to SGD \(did you mean "
                              r"'lr'\?\)"),
    ({"momentun": 0.9}, TypeError, r"a parameter group has 'momentun', unknown to SGD \(did "
                                   r"you mean 'momentum'"),
    ({"max_grad_norm": 1.0}, ValueError, r"a parameter group has max_grad_norm=1.0, but the "
                                         r"optimizer's is None: max_grad_norm is a setting of "
                                         r"the whole optimizer"),
    ({"skip_nonfinite": True}, ValueError, r"a parameter group has skip_nonfinite=True, but "
                                           r"the optimizer's is False"),
    ({"differentiable": True}, ValueError, r"differentiable=True is not supported"),
    ({"foreach": "yes"}, ValueError, r"foreach='yes' must be None, True or False"),
])
def test_a_group_key_that_would_be_ignored_is_refused(extra, error, words):
    """A group's misspelled hyperparameter (``lr_``), a setting of the whole optimizer
    (``max_grad_norm``, which clipped nothing from a group) and torch's keywords are
    refused as the constructor refuses them, in a group given to the constructor and to
    add_param_group (which adds nothing); a name of the author's own or a scheduler's key
    is kept, as torch keeps it."""
    w, v = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(error, match=rf"^SGD: {words}"):
        vega.optim.SGD([{"params": [w], **extra}], lr=0.1)
    opt = vega.optim.SGD([w], lr=0.1, momentum=0.9)
    with pytest.raises(error, match=rf"^SGD: {words}"):
        opt.add_param_group({"params": [v], **extra})
    assert len(opt.param_groups) == 1
    kept = {"name": "head", "lr_mult": 2.0, "initial_lr": 0.1, "max_momentum": 0.95,
            "max_grad_norm": None, "skip_nonfinite": False}  # (the optimizer's own: ZeRO's)
    opt.add_param_group({"params": [v], **kept})
    assert all(opt.param_groups[1][k] == x for k, x in kept.items())


def test_a_negative_step_counter_is_refused_by_set_leaf_and_load(tmp_path):
    """A step counter below 0 gives a step NaN values (a bias correction of 1 - b**-1 ...
    divides by a number near 0 or worse), and a step cannot read the device to check it:
    ``set_leaf`` and ``vega.load``, which run outside any step, refuse it."""
    params = {"w": torch.ones(3)}
    state = vega.adamw_init(params)
    for value in (-1, torch.tensor(-5, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"^vega.set_leaf: the value for leaf 'step' is "
                                             r"the step counter -\d; a step counter counts"):
            vega.set_leaf(state, "step", value)
    assert int(vega.set_leaf(state, "step", 7)["step"]) == 7 and int(state["step"]) == 0
    bad = dict(state, step=torch.tensor(-3, dtype=torch.int32))
    vega.save(tmp_path / "s.safetensors", bad)
    with pytest.raises(ValueError, match=r"^vega.load: leaf 'step' in .* is the step counter "
                                         r"-3"):
        vega.load(tmp_path / "s.safetensors", like=state)


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("value", [None, 3.0])
@pytest.mark.parametrize("name", ["mu", "step"])
def test_a_state_entry_set_by_hand_to_a_non_tensor_is_named(backend, value, name):
    """``opt.state[p]['mu'] = None`` (or a number; or the step counter) is named by the next
    step, which writes nothing (a TypeError from deep inside before; a counter set so was
    named by no backend, and Triton's in an AttributeError)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    w = torch.nn.Parameter(torch.ones(3, device=device))
    w.grad = torch.ones(3, device=device)
    opt = vega.optim.AdamW([w], lr=0.1, backend=backend)
    opt.step()
    opt.state[w][name] = value
    before = [w.detach().clone(), *(v.clone() for v in opt.state[w].values()
                                     if isinstance(v, torch.Tensor))]
    with pytest.raises(ValueError, match=rf"^AdamW: state '{name}' of parameter 0 of group 0 "
                                         rf"is {value}, not a tensor"):
        opt.step()
    after = [w.detach(), *(v for v in opt.state[w].values() if isinstance(v, torch.Tensor))]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def _meta_state_refused(backend: str, cls: str) -> None:
    """``test_a_state_set_by_hand_on_another_device_is_named_before_anything_is_written``'s
    check (in a child process for Triton: see there)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    w = torch.nn.Parameter(torch.ones(3, device=device))
    w.grad = torch.ones(3, device=device)
    opt = getattr(vega.optim, cls)([w], lr=0.1, backend=backend)
    opt.step()
    name = next(n for n, v in opt.state[w].items() if n != "step")
    opt.state[w][name] = opt.state[w][name].to("meta")
    before = [w.detach().clone(), *(v.clone() for n, v in opt.state[w].items() if n != name)]
    # (both name the parameter by its group: Prodigy's step, whose sums span the group, is
    # refused by its backend's staged step, and named again in the class's words)
    words = rf"^{cls}: parameter 0 of group 0: backend '{backend}': state '{name}' is on meta, "
    with pytest.raises(ValueError, match=words):
        opt.step()
    after = [w.detach(), *(v for n, v in opt.state[w].items() if n != name)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("cls", ["AdamW", "Prodigy"])
def test_a_state_set_by_hand_on_another_device_is_named_before_anything_is_written(
        backend, cls):
    """A class's state tensor set by hand on another device than its parameter's (``meta``
    here: no address, no values) is refused by every backend, naming it, before anything is
    written (Triton's kernel read its address, 0, and the process died of a segmentation
    fault: its case runs in a child process; the reference raised torch's RuntimeError)."""
    if backend != "triton":
        _meta_state_refused(backend, cls)
        return
    root = Path(__file__).resolve().parents[2]
    done = forks.run("from tests.runtime.test_checked_inputs import "  # (tests/forks.py)
                     f"_meta_state_refused; _meta_state_refused({backend!r}, {cls!r})",
                     cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_a_step_counter_at_its_last_value_steps_as_the_reference(backend):
    """A step counter may be any whole number in [0, 2**31 - 1] (it stops there): at
    2**31 - 1 the step's t is 2**31 on every backend, and the backends agree (the
    reference's t was computed in int32, wrapped to -2**31, and every step changed
    nothing)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    got = {}
    for be in ("reference", backend):
        w = torch.nn.Parameter(torch.ones(3, device=device))
        w.grad = torch.ones(3, device=device)
        opt = vega.optim.AdamW([w], lr=0.1, weight_decay=0.0, backend=be)
        opt.step()
        opt.state[w]["step"].fill_(2 ** 31 - 1)
        before = w.detach().clone()
        for _ in range(2):
            opt.step()
        assert int(opt.state[w]["step"]) == 2 ** 31 - 1
        got[be] = w.detach().cpu()
        assert not torch.equal(got[be], before.cpu()), be
    torch.testing.assert_close(got[backend], got["reference"], rtol=1e-6, atol=0)


def test_loss_scale_scale_and_a_group_without_params_are_named():
    """``LossScale.scale`` of a number or an integer tensor, and a group without
    ``params``, are ValueErrors naming what they got (an AttributeError and a bare
    KeyError from torch before)."""
    ls = LossScale.dynamic()
    for x, words in ((3.0, "3.0, a float"), (torch.tensor(3), "a tensor of dtype torch.int64")):
        with pytest.raises(ValueError, match=rf"^LossScale.scale: x is {words}; it scales a "
                                             r"float tensor"):
            ls.scale(x)
    opt = vega.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"^AdamW: a parameter group is a dict with 'params' "
                                         r"\(the tensors it steps\), got one with \['lr'\]"):
        opt.add_param_group({"lr": 0.1})
    assert len(opt.param_groups) == 1


def test_a_meta_tensor_hyperparameter_or_loaded_state_is_named():
    """A meta tensor (a shape, no value) as a hyperparameter, or as an entry of a loaded
    state, is a ValueError naming it (torch's NotImplementedError, 'Cannot copy out of
    meta tensor', before); a refused load changes nothing."""
    meta = torch.tensor(0.1, device="meta")
    with pytest.raises(ValueError, match=r"^AdamW: lr is a meta tensor, which has no value"):
        vega.optim.AdamW(_params(), lr=meta)
    with pytest.raises(ValueError, match=r"^adamw_step: lr is a meta tensor"):
        vega.adamw_step({"w": torch.ones(3)}, {"w": torch.ones(3)},
                        vega.adamw_init({"w": torch.ones(3)}), lr=meta)
    params = _params()
    opt = _stepped(vega.optim.AdamW(params, lr=0.1), params)
    before = _snapshot(opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["nu"] = torch.empty(4, 3, device="meta")
    with pytest.raises(ValueError, match=r"^AdamW.load_state_dict: state 'nu' of parameter id "
                                         r"1 is a meta tensor"):
        opt.load_state_dict(saved)
    after = _snapshot(opt)
    assert after[3] is before[3] and all(
        torch.equal(before[0][i][k], after[0][i][k]) for i in before[0] for k in before[0][i])


@pytest.mark.parametrize("kind, words", [("sparse_coo", r"sparse \(torch.sparse_coo\)"),
                                         ("sparse_csr", r"sparse \(torch.sparse_csr\)"),
                                         ("nested", "a nested tensor")])
def test_a_loaded_state_that_is_not_dense_is_named(kind, words):
    """A sparse or nested entry of a loaded state is refused by name and the load changes
    nothing (a nested one failed with torch's 'NestedTensorImpl doesn't support sizes'; a
    sparse one was loaded, and only the next step refused it)."""
    params = _params()
    opt = _stepped(vega.optim.AdamW(params, lr=0.1), params)
    snap = _snapshot(opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["mu"] = _not_dense(kind)
    with pytest.raises(ValueError, match=rf"^AdamW.load_state_dict: state 'mu' of parameter id "
                                         rf"1 is {words}; a step keeps dense \(strided\) states"):
        opt.load_state_dict(saved)
    _unchanged(opt, snap)


_COUNTERS = {"float32": lambda: torch.tensor(1.0), "float64": lambda: torch.tensor(1.0).double(),
             "int64": lambda: torch.tensor(1), "1-d": lambda: torch.tensor([1], dtype=torch.int32)}


@pytest.mark.parametrize("backend", ["c", "triton"])
@pytest.mark.parametrize("counter", list(_COUNTERS))
def test_a_step_counter_not_a_0d_int32_tensor_is_refused_before_anything_is_written(
        backend, counter):
    """The fused backends' kernels read and advance a step counter as one int32: a counter of
    another dtype or shape, set by hand, is refused by the class step (by the backend, in its
    step and in its staged step over a group's sums) and by the functional step (which checks
    its state first, on every backend), and nothing is written (Triton advanced a float32
    counter's bits as an int32's and read its step as one: a wrong update, silently)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    words = rf"backend '{backend}': a step counter must be a 0-d int32 tensor on"
    for cls in (vega.optim.AdamW, vega.optim.Prodigy):  # (Prodigy's sums over the group:
        w = torch.nn.Parameter(torch.ones(3, device=device))  # the kernels' staged step)
        w.grad = torch.full_like(w, 0.5)
        opt = cls([w], lr=0.1, backend=backend)
        opt.step()
        opt.state[w]["step"] = _COUNTERS[counter]().to(device)
        before = [w.detach().clone(), *(v.clone() for v in opt.state[w].values())]
        with pytest.raises(ValueError, match=words):
            opt.step()
        after = [w.detach(), *opt.state[w].values()]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))
    params = {"a": torch.ones(3, device=device), "b": torch.ones(2, 2, device=device)}
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    state = vega.adamw_init(params)
    state["step"] = _COUNTERS[counter]().to(device)
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match=r"^adamw_step: state\['step'\] must be a 0-d int32 "
                                         r"tensor"):
        vega.adamw_step(params, grads, state, donate=True, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(
        [params["a"], params["b"], state["mu"]["a"], state["nu"]["b"], state["step"]],
        [before[0]["a"], before[0]["b"], before[1]["mu"]["a"], before[1]["nu"]["b"],
         before[1]["step"]]))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
@pytest.mark.parametrize("backend, counter", [
    *((b, c) for b in ("c", "triton") for c in _COUNTERS), ("reference", "1-d")])
def test_a_bad_step_counter_of_any_group_is_refused_before_any_group_is_written(
        backend, counter, name, groups):
    """A step counter set by hand that the backend does not take (the compiled kernels: not
    a 0-d int32 tensor; every backend: not one number) on a parameter of the last group is
    refused by name, and no group is written: the class step of several calls checks the
    counters with the rest before the first call (a float32 counter, torch.optim's, in a
    second group was refused by the C kernels after the first group had stepped; one of
    shape (1,) failed with torch's raw error midway through Prodigy's reference step)."""
    ws = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = getattr(vega.optim, name)([{"params": ws}] if groups == 1 else
                                    [{"params": ws[:1]}, {"params": ws[1:]}],
                                    lr=0.1, backend=backend)
    for w in ws:
        w.grad = torch.full_like(w, 0.5)
    opt.step()
    opt.state[ws[1]]["step"] = _COUNTERS[counter]()
    before = [[w.detach().clone(), *(v.clone() for v in opt.state[w].values())] for w in ws]
    words = "int32 tensor" if backend != "reference" else r"tensor \(one number\)"
    with pytest.raises(ValueError, match=rf"backend '{backend}': a step counter must be a 0-d "
                                         rf"{words}"):
        opt.step()
    for w, was in zip(ws, before):
        now = [w.detach(), *opt.state[w].values()]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(was, now))


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
@pytest.mark.parametrize("counter", [5, None])
def test_a_step_counter_that_is_not_a_tensor_is_named(counter, name, backend):
    """A step counter set by hand to a number or None is named as not a tensor, in the
    class's words, and nothing is written (the reference's check of the counters' shapes
    asked a number for its dimensions: a raw AttributeError)."""
    ws = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = getattr(vega.optim, name)(ws, lr=0.1, backend=backend)
    for w in ws:
        w.grad = torch.full_like(w, 0.5)
    opt.step()
    opt.state[ws[1]]["step"] = counter
    before = [w.detach().clone() for w in ws]
    with pytest.raises(ValueError, match=rf"^{name}: state 'step' of parameter 1 of group 0 "
                                         r"is .*not a tensor"):
        opt.step()
    assert all(torch.equal(w.detach(), b) for w, b in zip(ws, before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_a_state_set_to_none_is_named_for_complex_parameters_too(name, dtype):
    """A state set by hand to None is named as not a tensor whatever the parameters' dtype
    (Prodigy's step over complex parameters asked None for its dtype, taking real views:
    a raw AttributeError); nothing is written."""
    p = torch.nn.Parameter(torch.randn(9, dtype=dtype))
    opt = getattr(vega.optim, name)([p], backend="c")
    p.grad = torch.randn(9, dtype=dtype)
    opt.step()
    opt.state[p]["mu"] = None
    before = [p.detach().clone(), *(v.clone() for v in opt.state[p].values() if v is not None)]
    with pytest.raises(ValueError, match=rf"^{name}: state 'mu' of parameter 0 of group 0 is "
                                         r".*not a tensor"):
        opt.step()
    after = [p.detach(), *(v for v in opt.state[p].values() if v is not None)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_a_first_step_that_cannot_build_its_kernels_leaves_no_state(tmp_path, name):
    """backend='c' where there is no C compiler: the first step's CompilerError leaves no
    state (it kept the zeros it had made), as a refused first step leaves none; a process
    of its own, whose PATH holds no compiler, with an empty kernel cache."""
    code = ("import torch, vega\n"
            "p = torch.nn.Parameter(torch.randn(9)); p.grad = torch.randn(9)\n"
            f"opt = vega.optim.{name}([p], backend='c')\n"
            "try:\n    opt.step()\nexcept vega.VegaError as e:\n    print(type(e).__name__)\n"
            "print(len(opt.state.get(p, {})))")
    env = {**os.environ, "CC": "/nonexistent", "CXX": "/nonexistent",
           "PATH": os.path.dirname(sys.executable), "VEGA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.split() == ["CompilerError", "0"], done.stdout + done.stderr


def _two_programs(how: str):
    """(params, grads, state, step keywords, the refusal's words) of a functional step of two
    programs whose second call's state is one its kernel refuses: 8-bit state (the large
    tensor's codes, the small one's float32) with the small one's codes set by hand and
    its scales lost; master weights over a bfloat16 and a float32 parameter, with an int32
    state of the float32 one."""
    gen = torch.Generator().manual_seed(0)
    if how == "8-bit":
        params = {"w": torch.randn(70, 64, generator=gen), "b": torch.randn(5000, generator=gen)}
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        state = vega.adamw_init(params, state_dtype=torch.uint8)
        state["mu_absmax"]["b"] = None
        return params, grads, state, {}, (r"state leaf 'mu\.b' holds 8-bit codes "
                                          r"\(torch.uint8\) without their scales: "
                                          r"'mu_absmax\.b' is None")
    params = {"w": torch.ones(4, 4, dtype=torch.bfloat16), "b": torch.ones(5)}
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = vega.adamw_init(params, master_weights=True)
    state["mu"]["b"] = state["mu"]["b"].to(torch.int32)
    return params, grads, state, {"master_weights": True}, (
        r"params leaf 'b': backend '\w+': state 'mu' has a tensor of dtype torch.int32")


@pytest.mark.parametrize("backend", ["c", "reference", "triton"])
@pytest.mark.parametrize("how", ["8-bit", "master weights"])
def test_a_functional_step_of_two_programs_in_place_checks_both_before_writing(how, backend):
    """A functional step in place whose leaves take two programs (8-bit state beside float32
    state; master weights beside none) checks the second call's tensors before the first
    call writes: a state its kernel refuses is named, and no leaf is written (the first
    program's parameters and states had stepped, and the counter had not)."""
    params, grads, state, more, words = _two_programs(how)
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match=rf"^adamw_step: {words}"):
        vega.adamw_step(params, grads, state, backend=backend, donate=True, lr=0.1, **more)
    for field, was in [("params", before[0]), *before[1].items()]:
        now = params if field == "params" else state[field]
        if field == "step":
            assert torch.equal(now, was)
            continue
        assert all((now[k] is None) == (was[k] is None) and
                   (was[k] is None or torch.equal(now[k], was[k])) for k in was), field


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_refused_first_step_leaves_no_state(backend):
    """A first step refused before it writes anything (two parameters overlapping in one
    storage) leaves no state either (it had made their zero states), and the same
    optimizer steps once the parameters are fixed."""
    b = torch.zeros(6)
    p1, p2 = torch.nn.Parameter(b[:4]), torch.nn.Parameter(b[2:])
    p1.grad, p2.grad = torch.ones(4), torch.ones(4)
    opt = vega.optim.AdamW([p1, p2], lr=0.1, backend=backend)
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 shares memory with "
                                         r"parameter 0 of group 0"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(b, torch.zeros(6))
    p2.data = torch.zeros(4)  # (its own memory now)
    opt.step()
    assert len(opt.state) == 2 and int(opt.state[p1]["step"]) == 1


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_state_leaf_of_one_number_per_tensor_of_another_shape_is_named(backend):
    """A functional state leaf of one number per tensor (novograd's ``nu``, a 0-d tensor)
    given another shape is a ValueError naming it and what it needs (a KeyError, 's', from
    the message's own table before), and nothing is written."""
    params = {"a": torch.tensor([1.0, 2.0, 3.0])}
    grads = {"a": torch.tensor([0.1, -0.2, 0.3])}
    state = vega.novograd_init(params)
    state["nu"]["a"] = torch.zeros(3)
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match=r"^novograd_step: state leaf 'nu.a' has shape \(3,\) "
                                         r"on cpu, but its parameter \(3,\) needs one number "
                                         r"per tensor \(a 0-d tensor\): \(\) on cpu"):
        vega.novograd_step(params, grads, state, lr=1e-2, donate=True, backend=backend)
    assert torch.equal(params["a"], before[0]["a"]) and torch.equal(state["nu"]["a"],
                                                                    before[1]["nu"]["a"])


def test_the_base_class_without_a_rule_says_so():
    """(It raised AttributeError: 'NoneType' object has no attribute 'class_name'.)"""
    with pytest.raises(TypeError, match=r"^SpecOptimizer has no rule: SpecOptimizer is the "
                                        r"base of vega's classes"):
        vega.optim.SpecOptimizer([torch.nn.Parameter(torch.ones(2))])


def test_a_state_of_its_own_class_missing_a_key_names_no_other_class():
    """AdamW's own state with 'lr' taken out was said to seem vega.optim.Adam's (whose keys
    are AdamW's): where the optimizer's own class fits as well as any, none is named. The
    message says how to load a state saved before the class had the setting (an SGD state
    of a vega before SGD had 'dampening' was refused with only the question)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = vega.optim.AdamW([p])
    p.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()
    del saved["param_groups"][0]["lr"]
    with pytest.raises(ValueError, match=r"^AdamW.load_state_dict: group 0 of the state has no "
                                         r"'lr'; was it saved from another optimizer than "
                                         r"vega.optim.AdamW\? If not \(a vega whose class had "
                                         r"no such setting saved it\), set 'lr' \(this "
                                         r"optimizer's default: 0.001\) in each saved group to "
                                         r"what that run used, and load it again$"):
        vega.optim.AdamW([p]).load_state_dict(saved)
    sgd = vega.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd.step()
    saved = sgd.state_dict()
    del saved["param_groups"][0]["dampening"]
    again = vega.optim.SGD([p], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"no 'dampening'; .* set 'dampening' \(this "
                                         r"optimizer's default: 0.0\) in each saved group"):
        again.load_state_dict(saved)
    saved["param_groups"][0]["dampening"] = 0.0
    again.load_state_dict(saved)
    assert torch.equal(again.state[p]["v"], sgd.state[p]["v"])


@pytest.mark.parametrize("name", ["AdamW", "DAdaptAdamW", "Muon"])
@pytest.mark.parametrize("when", ["added later", "from the start"])
def test_a_parameter_off_the_backends_device_in_the_second_group_is_named_first(name, when):
    """A group whose parameters are on two devices (a meta parameter beside CPU ones) steps
    on the first one's backend (C), which takes CPU tensors only: the parameter is named
    before anything is written (the first group had stepped, its state and counters too,
    before the second group's kernel refused it without naming it: "gradient 2 has no
    storage the kernels can read"); a first step leaves no state."""
    params = _params(3)
    meta = torch.nn.Parameter(torch.randn(3, device="meta"))  # (Muon: a vector, stepped by C)
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    if when == "from the start":
        groups[1]["params"] = params[1:] + [meta]
    opt = getattr(vega.optim, name)(groups)
    if when == "added later":
        _stepped(opt, params)
        opt.param_groups[1]["params"].append(meta)
    before = [p.detach().clone() for p in params], {
        i: {k: v.clone() for k, v in opt.state.get(p, {}).items()} for i, p in enumerate(params)}
    gen = torch.Generator().manual_seed(3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    meta.grad = torch.ones_like(meta)
    with pytest.raises(ValueError, match=rf"^{name}: parameter 2 of group 1: backend 'c' runs "
                                         r"on CPU tensors, got parameters on meta"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before[0]))
    assert not opt.state.get(meta)
    for i, p in enumerate(params):
        after = opt.state.get(p, {})
        assert after.keys() == before[1][i].keys(), i  # (none, before a first step)
        assert all(v.dtype == after[k].dtype and torch.equal(v, after[k])
                   for k, v in before[1][i].items()), i


@pytest.mark.parametrize("api", ["class", "functional"])
def test_dadapt_adamw_refuses_eps_0_which_makes_its_first_step_nan(api):
    """DAdaptAdamW's first step sums s / (sqrt(nu) + eps) at s = nu = 0: 0 / 0 at eps = 0,
    so d became NaN in the first step and every parameter in the second (the range was
    [0, inf)); a positive eps, however small, steps."""
    p = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match=r"eps=0\.0 is outside its range \(0, inf\)"):
        if api == "class":
            vega.optim.DAdaptAdamW([p], eps=0.0)
        else:
            params = {"w": p.detach()}
            vega.dadapt_adamw_step(params, {"w": torch.ones(5)}, vega.dadapt_adamw_init(params),
                                   eps=0.0)
    opt = vega.optim.DAdaptAdamW([p], eps=1e-30)
    for _ in range(2):
        p.grad = torch.randn(5)
        opt.step()
    assert torch.isfinite(p).all() and torch.isfinite(opt.state[p]["d"]).all()


@pytest.mark.parametrize("donate", ["no", 1, 0, None, np.bool_(True)])
def test_a_functional_step_takes_donate_as_a_bool_only(donate):
    """donate is True or False, as lbfgs_step has it: a string was taken by its truth, so
    donate='no' stepped the caller's tensors in place."""
    params = {"w": torch.ones(3)}
    state = vega.adamw_init(params)
    with pytest.raises(ValueError, match=r"^adamw_step: donate=.* must be True or False"):
        vega.adamw_step(params, {"w": torch.ones(3)}, state, donate=donate)
    assert torch.equal(params["w"], torch.ones(3)) and int(state["step"]) == 0


def test_a_nan_hyperparameter_without_a_range_is_refused():
    """NaN is refused for a hyperparameter that has no range (Muon's a, b, c), where the
    range check does not catch it: at construction, in a group set after it, and by the
    functional step."""
    ps = [torch.nn.Parameter(torch.randn(4, 3))]
    with pytest.raises(ValueError, match=r"Muon: a=nan is not a number"):
        vega.optim.Muon(ps, a=float("nan"))
    with pytest.raises(ValueError, match=r"Muon: a=.*nan.* is not a number"):
        vega.optim.Muon(ps, a=np.float32("nan"))  # (a number, not a float)
    opt = vega.optim.Muon(ps)
    opt.param_groups[0]["c"] = float("nan")
    ps[0].grad = torch.ones(4, 3)
    before = ps[0].detach().clone()
    with pytest.raises(ValueError, match=r"c=nan is not a number"):
        opt.step()
    assert torch.equal(ps[0].detach(), before)
    params = {"w": torch.randn(4, 3)}
    with pytest.raises(ValueError, match=r"b=nan is not a number"):
        vega.muon_step(params, {"w": torch.ones(4, 3)}, vega.muon_init(params),
                       b=float("nan"))


@pytest.mark.parametrize("state_dtype", [None, torch.uint8])
def test_load_state_dict_refuses_state_for_a_lazy_modules_uninitialized_parameter(state_dtype):
    """An optimizer made over a lazy module before its first forward pass holds uninitialized
    parameters, whose shapes are not known: a state loaded for one is refused, naming it, and
    the optimizer is left as it was; loaded once the model's state_dict has initialized them,
    it steps on as the saved optimizer does."""
    torch.manual_seed(0)
    saved = torch.nn.LazyLinear(64)
    opt = vega.optim.AdamW(saved.parameters(), lr=0.1, state_dtype=state_dtype)
    x = torch.randn(2, 96)
    saved(x).square().sum().backward()
    opt.step()
    model = torch.nn.LazyLinear(64)
    fresh = vega.optim.AdamW(model.parameters(), lr=0.5, state_dtype=state_dtype)
    snap = _snapshot(fresh)
    with pytest.raises(ValueError, match=r"^AdamW\.load_state_dict: parameter 0 of group 0 is "
                                         r"uninitialized \(a lazy module's"):
        fresh.load_state_dict(opt.state_dict())
    _unchanged(fresh, snap)
    model.load_state_dict(saved.state_dict())
    fresh.load_state_dict(opt.state_dict())
    for m, o in ((saved, opt), (model, fresh)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_parameter_made_complex_after_its_8bit_state_is_refused_as_such(backend):
    """A parameter made complex after its first step with 8-bit state is refused for what is
    wrong, its states real where it is complex, on the C backend too (which said it did not
    support state of dtype torch.uint8, which it steps), and nothing is written."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=gen))
    opt = vega.optim.AdamW([p], backend=backend, state_dtype=torch.uint8)
    p.grad = torch.randn(64, 64, generator=gen)
    opt.step()
    assert opt.state[p]["mu"].dtype == torch.uint8
    p.data = torch.randn(64, 64, dtype=torch.complex64, generator=gen)
    p.grad = torch.randn(64, 64, dtype=torch.complex64, generator=gen)
    before = [p.detach().clone(), *(v.clone() for v in opt.state[p].values())]
    with pytest.raises(ValueError, match=r"^AdamW: parameter 0 of group 0: state 'mu' is of "
                                         r"dtype torch.uint8, but its parameter is of dtype "
                                         r"torch.complex64: complex like it"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip([p.detach(), *opt.state[p].values()], before))


_BY_SHAPE = """optimizer o(lr = 0.1) {
    if ndim(p) >= 2 {
        p = p - lr * g
    } else {
        p = p - 2 * lr * g
    }
}"""


@pytest.mark.parametrize("shape,words", [
    ((2, True), "must be a sequence of whole numbers >= 0"),
    ((2.5,), "must be a sequence of whole numbers >= 0"),
    ("ab", "must be a sequence of whole numbers >= 0"),
    (5, "must be a sequence of whole numbers >= 0"),
    ((2, -1), "has a negative size"),
    ((2**40, 2**40), "is too large: a tensor has at most 2\\*\\*63 - 1 elements")])
def test_a_programs_shape_is_checked(shape, words):
    """spec.program(shape) of a spec whose ifs read the shape takes whole sizes (ints, 0-d
    integer tensors), naming any other shape."""
    spec = vega.compile(_BY_SHAPE)
    with pytest.raises(ValueError, match=rf"^o.program: shape=.* {words}$"):
        spec.program(shape)
    assert spec.program((torch.tensor(2), 3)) == spec.program((2, 3)) != spec.program((6,))


def test_a_complex_gradient_of_a_real_parameter_is_named_and_a_spec_shows_itself():
    spec = vega.compile("optimizer o(lr = 0.1) {\n    p = p - lr * g\n}", "o.vega")
    assert repr(spec) == "<vega optimizer o(lr=0.1) from o.vega>"
    params = {"a": torch.ones(3)}
    with pytest.raises(ValueError, match=r"^o_step: grads leaf 'a' has dtype torch.complex64, "
                                         r"the parameter torch.float32$"):
        spec.step(params, {"a": torch.ones(3, dtype=torch.complex64)}, spec.init(params))
