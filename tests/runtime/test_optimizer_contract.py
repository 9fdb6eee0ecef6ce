"""The classes against torch.optim's Optimizer contract: what a caller does to ``state`` and
``param_groups`` between steps, and what ``state_dict`` then saves."""
import copy
import pickle

import pytest
import torch

import vega.optim as vo


def _stepped(cls, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = cls(ps, lr=0.1, **kw)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    return ps, opt


@pytest.mark.parametrize("name", ["AdamW", "SGD", "LBFGS"])
def test_state_dict_after_reading_the_state_of_a_tensor_not_in_the_optimizer(name):
    # opt.state is a defaultdict: reading a tensor that is in no group makes it an empty
    # entry, which torch's state_dict() then fails on (KeyError: the tensor's id)
    ps, opt = _stepped(getattr(vo, name))
    other = torch.nn.Parameter(torch.randn(2))
    assert not opt.state[other]
    sd = opt.state_dict()
    assert len(sd["state"]) == 2 and other not in opt.state
    fresh = getattr(vo, name)([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1)
    fresh.load_state_dict(sd)
    opt.step()


@pytest.mark.parametrize("name", ["AdamW", "SGD", "LBFGS"])
def test_state_dict_names_the_state_of_a_parameter_removed_from_its_group(name):
    ps, opt = _stepped(getattr(vo, name))
    opt.param_groups[0]["params"].pop(1)
    with pytest.raises(ValueError, match=r"shape \(5,\).* in no parameter group.*del "):
        opt.state_dict()
    del opt.state[ps[1]]
    sd = opt.state_dict()
    assert len(sd["param_groups"][0]["params"]) == 1
    opt.step()


def test_a_deleted_step_count_is_named_as_deleted_too():
    # the message guessed only a state written in before the first step
    ps, opt = _stepped(vo.AdamW)
    del opt.state[ps[0]]["step"]
    with pytest.raises(ValueError, match=r"no step count: .*where it had stepped and its "
                                         r"'step' was deleted, put back its step count"):
        opt.step()
    opt.state[ps[0]]["step"] = torch.tensor(1, dtype=torch.int32)
    opt.step()
    assert int(opt.state[ps[0]]["step"]) == 2


def _rebuilt_by_a_step_without_gradients(opt, ps):
    # a step in which one parameter has no gradient plans the group anew, as does the
    # step after it, with every gradient back
    g = ps[1].grad
    ps[1].grad = None
    opt.step()
    ps[1].grad = g


def _rebuilt_by_a_new_group(opt, ps):
    q = torch.nn.Parameter(torch.randn(2))
    q.grad = torch.ones(2)
    opt.add_param_group({"params": [q]})
    opt.param_groups.reverse()  # (the first group's plan, by its position, is made anew)


def _rebuilt_by_a_load(opt, ps):
    opt.load_state_dict(opt.state_dict())


def _rebuilt_by_another_state_dtype(opt, ps):
    opt.param_groups[0]["state_dtype"] = torch.float64
    del opt.state[ps[1]]  # (a new state, in the group's new dtype)


@pytest.mark.parametrize("rebuild", [_rebuilt_by_a_step_without_gradients,
                                     _rebuilt_by_a_new_group, _rebuilt_by_a_load,
                                     _rebuilt_by_another_state_dtype])
@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_a_key_of_the_callers_own_in_a_state_is_kept_through_every_new_plan(name, rebuild):
    # torch.optim keeps any entry a caller writes into opt.state[p] (an EMA of the caller's,
    # a note) and saves it; a class step refused it where its plan was made anew (not where
    # the last step's was reused), and load_state_dict refused a state dict that held one
    kw = {"momentum": 0.9} if name == "SGD" else {}
    ps, opt = _stepped(getattr(vo, name), backend="reference", **kw)
    ema, note = torch.full((3,), 7.0), 1.5
    opt.state[ps[0]]["my_ema"] = ema
    opt.state[ps[0]]["my_note"] = note
    opt.step()  # (the last step's plan)
    rebuild(opt, ps)
    opt.step()
    st = opt.state[ps[0]]
    assert torch.equal(st["my_ema"], torch.full((3,), 7.0)) and st["my_note"] == 1.5
    assert int(st["step"]) == (4 if rebuild is _rebuilt_by_a_step_without_gradients else 3)
    sd = opt.state_dict()
    saved = [s for s in sd["state"].values() if "my_note" in s]
    assert len(saved) == 1 and torch.equal(saved[0]["my_ema"], ema) and \
        saved[0]["my_note"] == 1.5


def test_a_key_of_the_callers_own_is_saved_and_loaded_as_torch_loads_it():
    ps, opt = _stepped(vo.AdamW, backend="reference")
    opt.state[ps[0]]["my_ema"] = torch.full((4, 3), 7.0, dtype=torch.float64)
    opt.state[ps[0]]["my_count"] = torch.tensor(3)  # (an integer tensor: torch keeps it)
    opt.state[ps[1]]["my_note"] = 0.25
    sd = opt.state_dict()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = vo.AdamW(qs, lr=0.1, backend="reference")
    fresh.load_state_dict(sd)
    # as torch.optim.AdamW loads them: a float tensor in its parameter's dtype
    tq = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1)
    tq.load_state_dict({"state": {0: {"step": torch.tensor(1.0),
                                      "my_ema": sd["state"][0]["my_ema"],
                                      "my_count": sd["state"][0]["my_count"]}},
                        "param_groups": tq.state_dict()["param_groups"]})
    want = tq.state[tq.param_groups[0]["params"][0]]
    got = fresh.state[qs[0]]
    for key in ("my_ema", "my_count"):  # (torch casts both to the parameter's float32)
        assert got[key].dtype == want[key].dtype == torch.float32
        assert torch.equal(got[key], want[key])
    assert fresh.state[qs[1]]["my_note"] == 0.25
    for q, p in zip(qs, ps):
        q.grad = torch.ones_like(q)
        p.grad = torch.ones_like(p)
    fresh.step()
    opt.step()
    for q, p in zip(qs, ps):
        assert torch.equal(q, p)
    assert torch.equal(got["my_ema"], torch.full((4, 3), 7.0))


def test_a_key_of_the_callers_own_written_before_the_first_step_is_kept():
    # (torch.optim.SGD steps such a state; so does a vega class, making its own entries)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = vo.Adam([p], lr=0.1, backend="reference")
    opt.state[p]["my_ema"] = torch.zeros(3)
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    opt.add_param_group({"params": [q]})
    opt.param_groups[1]["lr"] = float("nan")  # (refused after the first group's states)
    with pytest.raises(ValueError, match="lr=nan"):
        opt.step()
    assert list(opt.state[p]) == ["my_ema"]  # (what the refused step made, dropped)
    opt.param_groups[1]["lr"] = 0.1
    opt.step()
    assert sorted(opt.state[p]) == ["mu", "my_ema", "nu", "step"]
    ref = torch.nn.Parameter(torch.ones(3))
    ref.grad = torch.ones(3)
    vo.Adam([ref], lr=0.1, backend="reference").step()
    assert torch.equal(p, ref)


@pytest.mark.parametrize("name", ["AdamW", "ScheduleFreeAdamW"])
def test_a_state_of_the_callers_own_alone_before_the_first_step_saves_loads_and_switches(name):
    # a parameter whose state holds entries of the caller's own and none of the rule's has
    # not stepped, as the step takes it: its state_dict was refused by load_state_dict
    # ('missing ['mu', 'nu', 'step']; unknown ['my_ema']'), and ScheduleFree's eval() and
    # train() refused it ("state 'step' of parameter 0 of group 0 is None, not a tensor")
    def made():
        ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        return ps, getattr(vo, name)(ps, lr=0.1, backend="reference")
    ps, opt = made()
    opt.state[ps[0]]["my_ema"] = torch.zeros(3)
    if name == "ScheduleFreeAdamW":
        opt.eval()
        opt.train()
        assert torch.equal(ps[0], torch.ones(3))
    qs, other = made()
    other.load_state_dict(opt.state_dict())
    assert list(other.state[qs[0]]) == ["my_ema"]
    for o, params in ((opt, ps), (other, qs)):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        o.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    assert sorted(other.state[qs[0]]) == sorted({*other.state[qs[1]], "my_ema"})


def test_a_state_name_of_the_rule_written_wrong_is_refused_on_every_path():
    # not a key of the caller's: a state the rule reads, of another shape
    ps, opt = _stepped(vo.SGD, backend="reference", momentum=0.9)
    opt.state[ps[0]]["v"] = torch.zeros(5)
    named = r"(parameter 0 of group 0.*state 'v'|state 'v' of parameter 0 of group 0).*\(5,\)"
    with pytest.raises(ValueError, match=named):
        opt.step()
    with pytest.raises(ValueError, match=named):
        opt.load_state_dict(opt.state_dict())


_PRECISION = ("master_weights", "rounding_seed", "stochastic_rounding")


def _half(n=3, value=1.0):
    p = torch.nn.Parameter(torch.full((n,), value, dtype=torch.bfloat16))
    p.grad = torch.full((n,), 0.5, dtype=torch.bfloat16)
    return p


def test_a_group_put_in_param_groups_without_its_precision_settings_is_named():
    # read with group.get, a group appended by hand stepped without master weights (its
    # bfloat16 parameter rounded each step) where the optimizer was made with them
    p, q = _half(), _half()
    opt = vo.Adam([p], lr=0.1, master_weights=True, backend="reference")
    group = {k: v for k, v in opt.param_groups[0].items() if k not in _PRECISION}
    opt.param_groups.append({**group, "params": [q]})
    with pytest.raises(ValueError, match=r"^Adam: group 1 has no 'master_weights', "
                                         r"'rounding_seed', 'stochastic_rounding': .*by hand"):
        opt.step()
    assert not opt.state[p] and not opt.state[q] and torch.equal(q, _half())
    opt.param_groups.pop()
    opt.add_param_group({"params": [q]})  # (fills them from the defaults)
    assert opt.param_groups[1]["master_weights"] is True
    opt.step()
    assert "master" in opt.state[q]


@pytest.mark.parametrize("key", _PRECISION + ("backend", "state_dtype"))
def test_a_precision_setting_deleted_from_a_group_is_named(key):
    ps, opt = _stepped(vo.AdamW, backend="reference")
    opt.step()  # (the plan of the last step, reused where nothing changed)
    del opt.param_groups[0][key]
    with pytest.raises(ValueError, match=rf"^AdamW: group 0 has no '{key}': a setting deleted"):
        opt.step()


@pytest.mark.parametrize("name", ["ScheduleFreeAdamW"])
def test_a_mode_switch_names_a_group_without_its_settings(name):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = getattr(vo, name)([p], lr=0.1, backend="reference")
    opt.step()
    del opt.param_groups[0]["master_weights"]
    with pytest.raises(ValueError, match=rf"^{name}: group 0 has no 'master_weights'"):
        opt.eval()
    assert opt.param_groups[0]["mode"] == "train"


def test_a_step_in_mode_eval_is_refused_and_writes_nothing():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    opt = vo.ScheduleFreeAdamW([p], lr=0.1, backend="reference")
    opt.step()
    y = p.detach().clone()
    opt.eval()
    x = p.detach().clone()
    kept = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=r"^ScheduleFreeAdamW: step\(\) with the parameters in "
                                         r"mode 'eval'; call train\(\) before stepping$"):
        opt.step()
    assert torch.equal(p.detach(), x)
    assert all(torch.equal(opt.state[p][k], v) for k, v in kept.items())
    opt.train()
    assert torch.equal(p.detach(), y)
    opt.step()  # (in mode train again)
    assert not torch.equal(p.detach(), y)


@pytest.mark.parametrize("field,value,words", [
    ("z", torch.zeros(2), r"state 'z' of parameter 0 of group 0 has shape \(2,\) on cpu, but "
                          r"its parameter, of shape \(3,\), needs \(3,\) on cpu"),
    ("step", 3, r"state 'step' of parameter 0 of group 0 is 3, not a tensor")])
def test_a_mode_switch_names_a_state_it_cannot_read(field, value, words):
    """eval() checks every state it reads before it writes a parameter: one of another shape
    (which may broadcast into the parameter) or not a tensor is named, the mode unchanged."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    opt = vo.ScheduleFreeAdamW([p], lr=0.1, backend="reference")
    opt.step()
    y = p.detach().clone()
    opt.state[p][field] = value
    with pytest.raises(ValueError, match=rf"^ScheduleFreeAdamW.eval\(\): {words}$"):
        opt.eval()
    assert opt.param_groups[0]["mode"] == "train" and torch.equal(p.detach(), y)


def test_modes_of_a_rule_without_them_do_nothing():
    p = torch.nn.Parameter(torch.ones(3))
    opt = vo.Adam([p], lr=0.1)
    opt.eval()
    opt.train()
    assert torch.equal(p.detach(), torch.ones(3)) and "mode" not in opt.param_groups[0]


def _torch_adam_state(p):
    tp = torch.nn.Parameter(p.detach().clone())
    tp.grad = p.grad.clone()
    t = torch.optim.Adam([tp], lr=0.1)
    t.step()
    return t.state_dict()


def _older_vega_state(p):
    old = vo.Adam([torch.nn.Parameter(p.detach().clone())], lr=0.1, backend="reference")
    old.param_groups[0]["params"][0].grad = p.grad.clone()
    old.step()
    sd = old.state_dict()
    for g in sd["param_groups"]:  # (saved by a vega whose groups had no precision settings)
        for key in _PRECISION:
            del g[key]
    return sd


@pytest.mark.parametrize("saved", [_older_vega_state, _torch_adam_state])
def test_a_state_dict_without_precision_settings_loads_with_the_optimizers_defaults(saved):
    # (as torch's classes setdefault an option their older states lack): the optimizer made
    # with master_weights=True keeps them on, making the master copy at its next step
    p = _half()
    sd = saved(p)
    opt = vo.Adam([p], lr=0.1, master_weights=True, stochastic_rounding=True,
                  rounding_seed=7, backend="reference")
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert (group["master_weights"], group["stochastic_rounding"], group["rounding_seed"]) \
        == (True, True, 7)
    opt.step()
    assert "master" in opt.state[p]


def test_lbfgs_keeps_a_key_of_the_callers_own_as_torch_does():
    # its step never read one, but its load_state_dict refused it (unknown: ['my_ema'])
    ps, opt = _stepped(vo.LBFGS)
    opt.state[ps[1]]["my_ema"] = torch.full((5,), 7.0, dtype=torch.float64)
    opt.state[ps[0]]["my_note"] = 0.5
    opt.step()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = vo.LBFGS(qs, lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    # (as torch loads it: cast to its parameter's dtype)
    assert fresh.state[qs[1]]["my_ema"].dtype == torch.float32
    assert torch.equal(fresh.state[qs[1]]["my_ema"], torch.full((5,), 7.0))
    assert fresh.state[qs[0]]["my_note"] == 0.5
    for q, p in zip(qs, ps):
        q.grad = torch.ones_like(q)
    fresh.step()
    opt.step()
    for q, p in zip(qs, ps):
        assert torch.equal(q, p)


def test_a_group_added_after_the_defaults_betas_were_edited_takes_them():
    # torch's classes fill a new group from opt.defaults: an edited 'betas' was lost (the
    # group took b1 and b2 as the optimizer was made, and stepped at them)
    ps = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.full((3,), 2.0))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = vo.Adam(ps[:1], lr=0.1, backend="reference")
    ref = torch.optim.Adam(theirs[:1], lr=0.1)
    for o in (opt, ref):
        o.defaults["betas"] = (0.5, 0.9)
    opt.add_param_group({"params": ps[1:]})
    ref.add_param_group({"params": theirs[1:]})
    group = opt.param_groups[1]
    assert (group["b1"], group["b2"], group["betas"]) == (0.5, 0.9, (0.5, 0.9))
    for _ in range(3):
        for p, q in zip(ps, theirs):
            p.grad = torch.tensor([1.0, -2.0, 0.5])
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ps, theirs):
        torch.testing.assert_close(p.detach(), q.detach())
    opt.defaults["b2"] = 0.95  # (vega's name, edited: taken too)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert opt.param_groups[2]["betas"] == (0.5, 0.95)
    opt.defaults["b1"], opt.defaults["betas"] = 0.7, (0.6, 0.95)  # (both, disagreeing)
    with pytest.raises(ValueError, match=r"^Adam: its defaults have betas=\(0\.6, 0\.95\) but "
                                         r"b1=0\.7, b2=0\.95; .*change one of the two"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert len(opt.param_groups) == 3


@pytest.mark.parametrize("copied", ["deepcopy", "pickle"])
def test_a_copied_optimizers_defaults_keep_an_edited_b1(copied):
    # a copy starts without the memory of its defaults' values: a b1 edited on the copy (or
    # on the optimizer before it was copied) was put back by add_param_group, betas taken
    # over it without a word
    def copy_of(opt):
        return copy.deepcopy(opt) if copied == "deepcopy" else pickle.loads(pickle.dumps(opt))
    opt = copy_of(vo.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1))
    opt.defaults["b1"] = 0.5
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert opt.param_groups[1]["betas"] == (0.5, 0.999) and opt.defaults["betas"][0] == 0.5
    opt.defaults["b2"] = 0.9  # (edited on the optimizer, which is then copied)
    opt = copy_of(opt)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert opt.param_groups[2]["betas"] == (0.5, 0.9)
    opt.defaults["betas"] = (0.6, 0.9)  # (the tuple, as torch's classes read it)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    assert (opt.param_groups[3]["b1"], opt.param_groups[3]["betas"]) == (0.6, (0.6, 0.9))


@pytest.mark.parametrize("reuse", [False, True])
def test_a_state_deleted_from_a_parameters_state_is_named_as_deleted(reuse):
    # the message guessed only a bool hyperparameter changed since the first step (Adam's
    # mu is read by every step, whatever its settings)
    ps, opt = _stepped(vo.Adam, backend="reference")
    if reuse:
        opt.step()
    mu = opt.state[ps[0]].pop("mu")
    with pytest.raises(ValueError, match=r"^Adam: the state of parameter 0 of group 0 has "
                                         r"\['nu', 'step'\] without 'mu', which every step "
                                         r"of the rule reads \(deleted from it\?\)"):
        opt.step()
    opt.state[ps[0]]["mu"] = mu
    opt.step()
    del opt.state[ps[0]]
    opt.step()
    assert int(opt.state[ps[0]]["step"]) == 1


@pytest.mark.parametrize("name", ["AdamW", "LBFGS"])
def test_a_sparse_entry_of_the_callers_own_loads_as_torch_loads_it(name):
    # (refused as a state a step keeps dense, which the caller's own entries are not)
    ps, opt = _stepped(getattr(vo, name))
    opt.state[ps[1]]["my_sparse"] = torch.eye(5).to_sparse()
    fresh = getattr(vo, name)([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    st = fresh.state[fresh.param_groups[0]["params"][1]]
    assert torch.equal(st["my_sparse"].to_dense(), torch.eye(5))
    fresh.step()
    sd = opt.state_dict()  # (a state of the rule's: still refused)
    key = "step" if name == "AdamW" else "diff_params"
    sd["state"][1][key] = sd["state"][1][key].to_sparse()
    with pytest.raises(ValueError, match=rf"state '{key}' of parameter id 1 is sparse"):
        fresh.load_state_dict(sd)
