"""torch.optim's keywords on vega's classes: betas (and torch's LR schedulers that cycle
them), maximize, SGD's dampening, foreach / fused / capturable / differentiable."""
import copy
import re

import pytest
import torch

import vega
import vega.optim
from tests.oracles import assert_close

STEPS = 6
SHAPES = [(5, 3), (4,), ()]


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _grads(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def _run(make, schedule=None, steps=STEPS):
    """The parameters and optimizer after ``steps`` steps of ``make(params)`` on the fixed
    gradients, with ``schedule(opt)`` (a torch LR scheduler) stepped after each."""
    params = [p.clone().requires_grad_(True) for p in _params()]
    opt = make(params)
    sched = schedule(opt) if schedule is not None else None
    for k in range(steps):
        for p, g in zip(params, _grads(k)):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()
    return params, opt


def _same_run(ours, theirs, states: dict, counted: bool = True):
    """Parameters and the named states (vega's name -> torch's) of two runs agree, and the
    step counters (``counted``; torch's SGD keeps none: taken as STEPS)."""
    (ps, opt), (qs, ref) = ours, theirs
    for i, (p, q) in enumerate(zip(ps, qs)):
        assert_close(p.detach(), q.detach(), rtol=1e-10, what=f"parameter {i}")
        for mine, its in states.items():
            assert_close(opt.state[p][mine], ref.state[q][its], rtol=1e-10,
                         what=f"state {mine} of parameter {i}")
        if counted or "step" in ref.state[q]:
            assert int(opt.state[p]["step"]) == int(ref.state[q].get("step", STEPS))


ADAM_STATE = {"mu": "exp_avg", "nu": "exp_avg_sq"}


# -- betas --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_betas_keyword_matches_torch(name):
    ours = _run(lambda ps: getattr(vega.optim, name)(ps, lr=1e-2, betas=(0.8, 0.95)))
    theirs = _run(lambda ps: getattr(torch.optim, name)(ps, lr=1e-2, betas=(0.8, 0.95),
                                                        foreach=False))
    _same_run(ours, theirs, ADAM_STATE)
    group = ours[1].param_groups[0]
    assert group["betas"] == (0.8, 0.95) and (group["b1"], group["b2"]) == (0.8, 0.95)


def test_betas_follow_the_specs_own_names():
    """Every class whose spec names b1, b2, ... takes betas of that length; the others
    refuse it as an unknown hyperparameter."""
    assert vega.optim.Adan([torch.zeros(2)], betas=(0.9, 0.8, 0.7)).defaults["b3"] == 0.7
    assert vega.optim.Lion([torch.zeros(2)], b2=0.5).defaults["betas"] == (0.9, 0.5)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 0.8\) must be a tuple of 3 values, "
                                         r"\(b1, b2, b3\)"):
        vega.optim.Adan([torch.zeros(2)], betas=(0.9, 0.8))
    with pytest.raises(TypeError, match="unexpected hyperparameter 'betas'"):
        vega.optim.SGD([torch.zeros(2)], betas=(0.9, 0.8))


def test_betas_and_own_names_that_disagree_are_refused():
    with pytest.raises(ValueError, match=r"betas=\(0.8, 0.95\) and b1=0.7 disagree"):
        vega.optim.AdamW([torch.zeros(2)], betas=(0.8, 0.95), b1=0.7)
    vega.optim.AdamW([torch.zeros(2)], betas=(0.8, 0.95), b1=0.8)  # agreeing: fine
    opt = vega.optim.AdamW([torch.zeros(2)])
    with pytest.raises(ValueError, match=r"betas=\(0.5, 0.6\) and b2=0.7 disagree"):
        opt.add_param_group({"params": [torch.zeros(3)], "betas": (0.5, 0.6), "b2": 0.7})
    opt.add_param_group({"params": [torch.zeros(3)], "b2": 0.7})
    assert opt.param_groups[-1]["betas"] == (0.9, 0.7)


def test_a_changed_name_is_followed_by_the_other():
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = vega.optim.AdamW([p])
    group = opt.param_groups[0]
    group["betas"] = (0.5, 0.6)
    opt.step()
    assert (group["b1"], group["b2"]) == (0.5, 0.6)
    group["b2"] = 0.7
    opt.step()
    assert group["betas"] == (0.5, 0.7)
    group["betas"], group["b1"] = (0.1, 0.7), 0.2
    with pytest.raises(ValueError, match=r"group 0 has betas=\(0.1, 0.7\) but b1=0.2, b2=0.7"):
        opt.step()


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1,
                                               cycle_momentum=True, base_momentum=0.6,
                                               max_momentum=0.95)


@pytest.mark.parametrize("name,kw,states", [
    ("AdamW", {"weight_decay": 0.05}, ADAM_STATE),
    ("Adam", {}, ADAM_STATE),
    ("SGD", {"momentum": 0.9}, {"v": "momentum_buffer"}),
    ("RMSprop", {"momentum": 0.9}, {"nu": "square_avg", "buf": "momentum_buffer"}),
])
def test_one_cycle_with_cycled_momentum_matches_torch(name, kw, states):
    """OneCycleLR cycles betas[0] (Adam's) or momentum (SGD's, RMSprop's) with the rate, each
    change taking effect at the next step, as in torch's class."""
    ours = _run(lambda ps: getattr(vega.optim, name)(ps, lr=0.05, **kw), _one_cycle)
    theirs = _run(lambda ps: getattr(torch.optim, name)(ps, lr=0.05, foreach=False, **kw),
                  _one_cycle)
    _same_run(ours, theirs, states)
    if name.startswith("Adam"):
        group = ours[1].param_groups[0]
        assert group["betas"] == theirs[1].param_groups[0]["betas"]
        assert group["b1"] not in (0.9, group["betas"][0])  # cycled; synced at the next step


def test_a_state_saved_after_a_cycled_momentum_resumes():
    """OneCycleLR writes betas after a step; a state saved then (betas and b1 disagree until
    the next step) loads into a new optimizer, a deep copy and an unpickled one, each taking
    betas, as torch's class reads it, and resumes bitwise."""
    import copy
    import io

    def build():
        p = torch.nn.Parameter(torch.linspace(-1, 1, 10))
        return p, vega.optim.AdamW([p], lr=1e-2)
    p, opt = build()
    sched = _one_cycle(opt)
    for k in range(3):
        p.grad = torch.full_like(p, 0.1 * (k + 1))
        opt.step()
        sched.step()
    group = opt.param_groups[0]
    assert group["betas"][0] != group["b1"]  # (cycled, not yet synced)
    saved = copy.deepcopy(opt.state_dict())
    q, loaded = build()
    q.data.copy_(p.detach())
    loaded.load_state_dict(saved)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    copies = [loaded, copy.deepcopy(opt), torch.load(buffer, weights_only=False)]
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    for other in copies:
        other_p = other.param_groups[0]["params"][0]
        other_p.grad = torch.full_like(p, 0.5)
        other.step()
        assert torch.equal(other_p, p)
        assert other.param_groups[0]["b1"] == group["b1"] == group["betas"][0]


@pytest.mark.parametrize("when", ["before the scheduler", "between steps"])
@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_a_b2_set_by_hand_under_a_scheduler_cycling_betas_is_kept(scheduler, when):
    """A scheduler that cycles momentum writes betas[0] (as it is made, and after each step);
    b2 set by hand meanwhile is another value of the tuple: both are taken, as torch's class
    takes betas[1] set by hand, where the step refused the two as disagreeing."""
    def make(opt):
        if scheduler == "OneCycleLR":
            return _one_cycle(opt)
        return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=0.05,
                                                 step_size_up=2, base_momentum=0.6,
                                                 max_momentum=0.95)

    def run(cls, set_b2):
        params = [p.clone().requires_grad_(True) for p in _params()]
        opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": 0.02}], lr=0.05)
        if when == "before the scheduler":
            set_b2(opt)
        sched = make(opt)
        for k in range(STEPS):
            if when == "between steps" and k == 2:
                set_b2(opt)
            for p, g in zip(params, _grads(k)):
                p.grad = g.clone()
            opt.step()
            sched.step()
        return params, opt

    def ours(opt):
        for group in opt.param_groups:
            group["b2"] = 0.99

    def theirs(opt):
        for group in opt.param_groups:
            group["betas"] = (group["betas"][0], 0.99)
    mine = run(vega.optim.Adam, ours)
    _same_run(mine, run(lambda ps, **kw: torch.optim.Adam(ps, foreach=False, **kw), theirs),
              ADAM_STATE)
    assert all(g["b2"] == 0.99 and g["betas"][1] == 0.99 for g in mine[1].param_groups)


def test_a_b1_changed_before_saving_is_saved():
    """b1 changed by hand, then the state saved (or the optimizer copied) before a step:
    the groups are made to agree first, so the loaded group steps with the new b1."""
    import copy
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.ones(4)
    opt = vega.optim.Adam([w], lr=1e-2)
    opt.step()
    opt.param_groups[0]["b1"] = 0.5
    w2 = torch.nn.Parameter(w.detach().clone())
    w2.grad = torch.ones(4)
    loaded = vega.optim.Adam([w2], lr=1e-2)
    loaded.load_state_dict(opt.state_dict())
    copied = copy.deepcopy(opt)
    copied.param_groups[0]["params"][0].grad = torch.ones(4)
    opt.step()
    loaded.step()
    copied.step()
    assert loaded.param_groups[0]["betas"][0] == copied.param_groups[0]["b1"] == 0.5
    assert torch.equal(w, w2) and torch.equal(w, copied.param_groups[0]["params"][0])


@pytest.mark.parametrize("key, value", [("b1", 0.5), ("betas", (0.5, 0.999)), (None, None)])
def test_a_state_dict_whose_betas_and_b1_disagree_warns_at_load(key, value):
    """state_dict() saves betas and b1, b2 in agreement; a saved group changed by hand in one
    of them (b1 = 0.5 in the checkpoint, as one changes its lr) loads taking betas, as
    torch's classes read it: the load warns, naming both, where a change of b1 alone was
    lost without a word. A state dict as saved, and torch.optim's, load without one."""
    import warnings
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.ones(4)
    opt = vega.optim.AdamW([w], lr=1e-2)
    opt.step()
    saved = opt.state_dict()
    if key is not None:
        saved["param_groups"][0][key] = value
    loaded = vega.optim.AdamW([torch.nn.Parameter(w.detach().clone())], lr=1e-2)
    if key is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded.load_state_dict(saved)
            torch_opt = torch.optim.AdamW([torch.nn.Parameter(w.detach().clone())])
            torch_opt.load_state_dict(opt.torch_state_dict())
            loaded.load_state_dict(torch_opt.state_dict())
        return
    shown = "betas=(0.9, 0.999) and b1=0.5" if key == "b1" else "betas=(0.5, 0.999) and b1=0.9"
    with pytest.warns(UserWarning, match=re.escape(
            f"AdamW.load_state_dict: group 0 of the state has {shown}, b2=0.999, which "
            f"disagree")):
        loaded.load_state_dict(saved)
    group = loaded.param_groups[0]
    assert group["b1"] == group["betas"][0] == (0.9 if key == "b1" else 0.5)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("key, value", [("b1", 0.5), ("betas", (0.5, 0.999))])
def test_a_b1_or_betas_changed_on_a_copy_before_its_first_step_is_taken(how, key, value):
    """A deep copy or an unpickled optimizer is the original's twin: a b1 set by name on it
    before it steps is taken, as on the original and on a loaded state, where the copy
    took betas (its memory of which changed is not copied) and stepped with the old b1."""
    import copy
    import pickle
    w = torch.nn.Parameter(torch.ones(4))
    w.grad = torch.ones(4)
    opt = vega.optim.Adam([w], lr=1e-2)
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    for o in (opt, twin):
        o.param_groups[0][key] = value
        o.param_groups[0]["params"][0].grad = torch.ones(4)
        o.step()
        assert o.param_groups[0]["b1"] == o.param_groups[0]["betas"][0] == 0.5
    assert torch.equal(twin.param_groups[0]["params"][0], w)


# -- maximize and dampening ---------------------------------------------------------------

TORCH_TWINS = [  # (class, keywords both take, vega's state -> torch's)
    ("SGD", {"momentum": 0.9, "weight_decay": 0.05}, {"v": "momentum_buffer"}),
    ("SGD", {"momentum": 0.9, "dampening": 0.3}, {"v": "momentum_buffer"}),
    ("SGD", {"momentum": 0.9, "nesterov": True}, {"v": "momentum_buffer"}),
    ("Adam", {"weight_decay": 0.05, "amsgrad": True}, {**ADAM_STATE, "nu_max": "max_exp_avg_sq"}),
    ("AdamW", {"weight_decay": 0.05}, ADAM_STATE),
    ("RAdam", {"eps": 0.0}, ADAM_STATE),  # (the two rules agree at eps = 0)
    ("Adagrad", {"lr_decay": 0.01}, {"acc": "sum"}),
    ("RMSprop", {"momentum": 0.5, "centered": True},
     {"nu": "square_avg", "mu": "grad_avg", "buf": "momentum_buffer"}),
]


@pytest.mark.parametrize("maximize", [True, False])
@pytest.mark.parametrize("name,kw,states", TORCH_TWINS, ids=lambda x: str(x)[:20])
def test_maximize_and_dampening_match_torch(name, kw, states, maximize):
    ours = _run(lambda ps: getattr(vega.optim, name)(ps, lr=1e-2, maximize=maximize, **kw))
    theirs = _run(lambda ps: getattr(torch.optim, name)(ps, lr=1e-2, maximize=maximize,
                                                        foreach=False, **kw))
    _same_run(ours, theirs, states)


@pytest.mark.parametrize("name", sorted(vega.optim._SPECS))
def test_maximize_steps_on_the_negated_gradient(name):
    """Every class: maximize=True on g is the step on -g, bitwise, and p.grad is kept."""
    def make(maximize):
        def build(ps):
            return getattr(vega.optim, name)(ps, maximize=maximize, max_grad_norm=1.0)
        return build
    up, _ = _run(make(True))
    params = [p.clone().requires_grad_(True) for p in _params()]
    opt = make(False)(params)
    for k in range(STEPS):
        for p, g in zip(params, _grads(k)):
            p.grad = -g
        opt.step()
    for p, q in zip(up, params):
        assert torch.equal(p, q)
    assert torch.equal(up[0].grad, _grads(STEPS - 1)[0])


def test_maximize_is_a_bool():
    with pytest.raises(ValueError, match="maximize=1 must be True or False"):
        vega.optim.Adam([torch.zeros(2)], maximize=1)
    opt = vega.optim.Adam([torch.zeros(2)])
    with pytest.raises(ValueError, match="maximize='yes' must be True or False"):
        opt.add_param_group({"params": [torch.zeros(2)], "maximize": "yes"})
    assert len(opt.param_groups) == 1


def test_dampening_range():
    with pytest.raises(ValueError, match=r"dampening=1.5 is outside its range \[0, 1\]"):
        vega.optim.SGD([torch.zeros(2)], momentum=0.9, dampening=1.5)


# -- torch's implementation keywords ------------------------------------------------------

@pytest.mark.parametrize("kw", [{"foreach": None}, {"foreach": True}, {"foreach": False},
                                {"fused": None}, {"fused": True}, {"fused": False},
                                {"capturable": True}, {"capturable": False},
                                {"differentiable": False}])
def test_implementation_keywords_are_accepted(kw):
    ours = _run(lambda ps: vega.optim.AdamW(ps, **kw))
    plain = _run(lambda ps: vega.optim.AdamW(ps))
    for p, q in zip(ours[0], plain[0]):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kw,message", [
    ({"differentiable": True}, "differentiable=True is not supported"),
    ({"foreach": "yes"}, "foreach='yes' must be None, True or False"),
    ({"fused": 1}, "fused=1 must be None, True or False"),
    ({"differentiable": None}, "differentiable=None must be True or False"),
])
def test_implementation_keywords_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        vega.optim.SGD([torch.zeros(2)], **kw)


# -- torch.optim's state dicts ------------------------------------------------------------

def _resume(make, params, opt, first: int, steps: int):
    for k in range(first, first + steps):
        for p, g in zip(params, _grads(k)):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("name,kw,states", TORCH_TWINS, ids=lambda x: str(x)[:20])
def test_torch_state_dict_loads_and_continues_as_torch(name, kw, states):
    """torch's run saved after 3 steps, loaded into vega's class: the next steps are
    torch's own; and back, vega's state in torch's format continues in torch's class."""
    def torch_make(ps):
        return getattr(torch.optim, name)(ps, lr=1e-2, foreach=False, **kw)

    def vega_make(ps):
        return getattr(vega.optim, name)(ps, lr=1e-2, **kw)
    half, full = 3, STEPS
    theirs = _run(torch_make)
    ps, saved = _run(torch_make, steps=half)
    ours = _resume(vega_make, *_loaded(vega_make, ps, saved.state_dict()), half, full - half)
    _same_run(ours, theirs, states, counted=False)  # (torch's SGD counts no steps: 1 here)

    ps, mine = _run(vega_make, steps=half)
    converted, own = mine.torch_state_dict(), saved.state_dict()  # (torch's own format)
    assert [sorted(g) for g in converted["param_groups"]] == \
        [sorted(g) for g in own["param_groups"]]
    assert {i: {k: (v.dtype, v.device) for k, v in st.items()}
            for i, st in converted["state"].items()} == \
        {i: {k: (v.dtype, v.device) for k, v in st.items()} for i, st in own["state"].items()}
    back = _resume(torch_make, *_loaded(torch_make, ps, mine.torch_state_dict()), half,
                   full - half)
    _same_run(_run(vega_make), back, states)


def test_a_torch_optimizer_loaded_from_torch_state_dict_shares_its_tensors_as_torchs_do():
    """docs/optimizers.md: torch.optim's load_state_dict keeps the tensors of
    ``torch_state_dict()`` as it keeps those of its own ``state_dict()`` (a torch optimizer
    loaded from another steps the other's exp_avg); a deep copy keeps the two apart, and
    vega's load_state_dict copies what it loads."""
    def pair(p):
        q = p.detach().clone().requires_grad_(True)
        p.grad = q.grad = torch.ones(4)
        return q
    for make, key in [(lambda ps: torch.optim.Adam(ps), "exp_avg"),
                      (lambda ps: vega.optim.Adam(ps), "mu")]:
        p = torch.nn.Parameter(torch.randn(4))
        p.grad = torch.ones(4)
        opt = make([p])
        opt.step()
        saved = opt.torch_state_dict() if key == "mu" else opt.state_dict()
        q = pair(p)
        theirs = torch.optim.Adam([q])
        theirs.load_state_dict(saved)
        assert theirs.state[q]["exp_avg"] is opt.state[p][key]  # (the same tensor)
        q = pair(p)
        apart = torch.optim.Adam([q])
        apart.load_state_dict(copy.deepcopy(saved))
        before = opt.state[p][key].clone()
        apart.step()
        assert torch.equal(opt.state[p][key], before)
    q = pair(p)
    ours = vega.optim.Adam([q])
    ours.load_state_dict(opt.state_dict())
    assert ours.state[q]["mu"].data_ptr() != opt.state[p]["mu"].data_ptr()


def _loaded(make, saved_params, state_dict):
    params = [p.detach().clone().requires_grad_(True) for p in saved_params]
    opt = make(params)
    opt.load_state_dict(state_dict)
    return params, opt


def _torch_state(cls, **kw):
    return _run(lambda ps: cls(ps, lr=1e-2, **kw), steps=2)[1].state_dict()


@pytest.mark.parametrize("cls,saved,message", [
    (vega.optim.Adam, lambda: _torch_state(torch.optim.Adam, decoupled_weight_decay=True),
     r"Adam\.load_state_dict: group 0 of the state in torch\.optim's format has "
     r"decoupled_weight_decay=True \(the state of torch\.optim\.AdamW: load it into "
     r"vega\.optim\.AdamW\), but vega\.optim\.Adam's rule is torch's at "
     r"decoupled_weight_decay=False"),
    (vega.optim.AdamW, lambda: _torch_state(torch.optim.Adam),
     r"AdamW\.load_state_dict: group 0 of the state in torch\.optim's format has "
     r"decoupled_weight_decay=False \(the state of torch\.optim\.Adam: load it into "
     r"vega\.optim\.Adam\), but vega\.optim\.AdamW's rule is torch's at "
     r"decoupled_weight_decay=True"),
    (vega.optim.RAdam, lambda: _torch_state(torch.optim.RAdam, weight_decay=0.1),
     r"RAdam\.load_state_dict: group 0 of the state in torch\.optim's format has "
     r"weight_decay=0\.1, but vega\.optim\.RAdam's rule is torch's at weight_decay=0"),
    (vega.optim.NAdam, lambda: _torch_state(torch.optim.NAdam),
     r"NAdam\.load_state_dict: group 0 of the state has no .*; it seems to be the state of "
     r"torch\.optim\.NAdam, whose format vega\.optim\.NAdam does not convert \(torch's "
     r"states are converted for Adagrad, Adam, AdamW, RAdam, RMSprop, SGD\)"),
    (vega.optim.SGD, lambda: _torch_state(torch.optim.Adam),
     r"SGD\.load_state_dict: group 0 of the state has no 'backend', 'dampening', 'momentum', "
     r"'nesterov', 'state_dtype' .*it seems to be the state of torch\.optim\.Adam"),
])
def test_torch_state_dict_of_another_rule_is_refused(cls, saved, message):
    opt = cls([p.requires_grad_(True) for p in _params()])
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved())


def test_torch_format_of_a_rule_torch_has_not():
    opt = _run(lambda ps: vega.optim.Lion(ps))[1]
    with pytest.raises(ValueError, match=r"Lion\.torch_state_dict: vega\.optim\.Lion's state "
                                         r"is not converted to torch's format; it is for "
                                         r"Adagrad, Adam, AdamW, RAdam, RMSprop, SGD"):
        opt.torch_state_dict()
    opt = _run(lambda ps: vega.optim.NAdam(ps))[1]  # (torch has a NAdam; not converted)
    with pytest.raises(ValueError, match=r"NAdam\.torch_state_dict: vega\.optim\.NAdam's "
                                         r"state is not converted"):
        opt.torch_state_dict()
    opt = _run(lambda ps: vega.optim.AdamW(ps, lr=vega.schedule.constant(1e-2)))[1]
    with pytest.raises(ValueError, match=r"AdamW\.torch_state_dict: group 0 has lr=.*; torch's "
                                         r"state format holds plain numbers"):
        opt.torch_state_dict()


@pytest.mark.parametrize("name, kw", [("AdamW", {"weight_decay": 0.05}),
                                      ("SGD", {"momentum": 0.9})])
def test_torch_format_of_a_tensor_lr_under_a_scheduler(name, kw):
    """A tensor lr (which a torch scheduler fills in place; the scheduler keeps a tensor
    initial_lr beside it) is a value torch's groups hold too: the state in torch's format,
    loaded into torch's class with the scheduler's state, resumes as torch's own run, where
    torch_state_dict refused it as not a plain number. A tensor where torch's class takes
    only a number (eps, dampening) is still refused, naming what takes a tensor."""
    def make(mod, params):
        extra = {"foreach": False} if mod is torch.optim else {}
        opt = getattr(mod, name)([{"params": params[:2], "lr": torch.tensor(0.05,
                                                                           dtype=torch.float64)},
                                  {"params": params[2:], "lr": torch.tensor(0.02,
                                                                           dtype=torch.float64)}],
                                 **kw, **extra)
        return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)

    def steps(opt, sched, params, ks):
        for k in ks:
            for p, g in zip(params, _grads(k)):
                p.grad = g.clone()
            opt.step()
            sched.step()
    theirs = [p.clone().requires_grad_(True) for p in _params()]
    ref, ref_sched = make(torch.optim, theirs)
    steps(ref, ref_sched, theirs, range(2 * STEPS))
    ours = [p.clone().requires_grad_(True) for p in _params()]
    opt, sched = make(vega.optim, ours)
    steps(opt, sched, ours, range(STEPS))
    saved, saved_sched = copy.deepcopy(opt.torch_state_dict()), sched.state_dict()
    assert isinstance(saved["param_groups"][0]["lr"], torch.Tensor)
    resumed = [p.detach().clone().requires_grad_(True) for p in ours]
    torch_opt, torch_sched = make(torch.optim, resumed)
    torch_opt.load_state_dict(saved)
    torch_sched.load_state_dict(saved_sched)
    steps(torch_opt, torch_sched, resumed, range(STEPS, 2 * STEPS))
    for p, q in zip(resumed, theirs):
        assert_close(p.detach(), q.detach(), rtol=1e-10)
    assert float(torch_opt.param_groups[1]["lr"]) == float(ref.param_groups[1]["lr"])
    key = "eps" if name == "AdamW" else "dampening"
    opt.param_groups[0][key] = torch.tensor(0.0 if key == "dampening" else 1e-8,
                                            dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"group 0 has {key}=.*torch\.optim\.{name} takes "
                                         rf"{key} as a plain number \(a tensor only for "):
        opt.torch_state_dict()


def test_decoupled_weight_decay_as_torchs_classes_take_it():
    """torch.optim.Adam(decoupled_weight_decay=False) is torch's default, and vega's Adam's
    rule: taken (it was an unexpected hyperparameter); True is AdamW's rule, refused with a
    pointer there. torch.optim.AdamW takes no such keyword, and neither does vega's."""
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    vega.optim.Adam([p], decoupled_weight_decay=False)
    vega.optim.Adam([p], decoupled_weight_decay=0)  # (as torch takes it)
    vega.optim.RAdam([p], decoupled_weight_decay=False)
    with pytest.raises(ValueError, match=r"^Adam: decoupled_weight_decay=True: vega\.optim\."
                                         r"Adam's rule is torch's at decoupled_weight_decay="
                                         r"False; another rule is another class \(vega\.optim"
                                         r"\.AdamW\)"):
        vega.optim.Adam([p], decoupled_weight_decay=True)
    with pytest.raises(TypeError, match="unexpected hyperparameter 'decoupled_weight_decay'"):
        vega.optim.AdamW([p], decoupled_weight_decay=True)


def test_rprop_takes_torch_etas_and_step_sizes():
    """torch.optim.Rprop's tuples name vega's four hyperparameters; a tuple that disagrees
    with a value given by its own name, or of the wrong length, is refused by name."""
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = vega.optim.Rprop([p], lr=0.02, etas=(0.4, 1.5), step_sizes=(1e-3, 0.3))
    group = opt.param_groups[0]
    assert (group["etaminus"], group["etaplus"]) == (0.4, 1.5)
    assert (group["step_size_min"], group["step_size_max"]) == (1e-3, 0.3)
    with pytest.raises(ValueError, match=r"etas=\(0\.4, 1\.5\) and etaminus=0\.3 disagree"):
        vega.optim.Rprop([p], etas=(0.4, 1.5), etaminus=0.3)
    with pytest.raises(ValueError, match=r"step_sizes=\(1e-06,\) must be a tuple of 2 values"):
        vega.optim.Rprop([p], step_sizes=(1e-6,))
    with pytest.raises(TypeError, match="etas"):  # a spec without those names
        vega.optim.Adam([p], etas=(0.4, 1.5))


RPROP = {"etas": (0.4, 1.5), "step_sizes": (1e-3, 0.3)}


@pytest.mark.parametrize("where", ["a group given", "add_param_group", "set between steps"])
def test_rprop_groups_take_torch_etas_and_step_sizes(where):
    """Rprop's groups hold torch's ``etas`` and ``step_sizes`` beside the four values they
    name, as groups hold ``betas``: given in a group, added, or set between steps, they
    step as torch's Rprop steps them (they were kept as inert keys, the defaults stepped)."""
    def make(mod):
        def opt(params):
            if where == "a group given":
                return mod.Rprop([{"params": params, **RPROP}], lr=0.02)
            if where == "add_param_group":
                o = mod.Rprop([torch.zeros(1, dtype=torch.float64, requires_grad=True)],
                              lr=0.02)
                o.add_param_group({"params": params, **RPROP})
                return o
            o = mod.Rprop(params, lr=0.02)
            o.register_step_post_hook(lambda o, *_: o.param_groups[0].update(RPROP))
            return o
        return opt
    ours, theirs = _run(make(vega.optim)), _run(make(torch.optim))
    _same_run(ours, theirs, {"g_prev": "prev", "step_size": "step_size"})
    group = ours[1].param_groups[-1]
    assert (group["etaminus"], group["etaplus"], group["etas"]) == (0.4, 1.5, (0.4, 1.5))
    assert (group["step_size_min"], group["step_size_max"]) == (1e-3, 0.3)


def test_muon_takes_torch_ns_coefficients():
    """torch.optim.Muon's ns_coefficients=(a, b, c) are vega's a, b, c, where the optimizer is
    made and in a group (they were refused as an unexpected hyperparameter), and step as
    torch's; a tuple of another length is refused by name."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 6, generator=gen)
    coefficients = (2.0, -1.5, 0.5)
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ours = vega.optim.Muon([{"params": [p], "ns_coefficients": coefficients}], lr=0.02)
    theirs = torch.optim.Muon([q], lr=0.02, ns_coefficients=coefficients)
    assert tuple(ours.param_groups[0][n] for n in "abc") == coefficients
    for _ in range(3):
        g = torch.randn(8, 6, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert_close(p.detach(), q.detach(), rtol=1e-5, scale=1.0, what="parameter")
    assert not torch.allclose(p, w)
    with pytest.raises(ValueError, match=r"ns_coefficients=\(3\.0, -4\.0\) must be a tuple of "
                                         r"3 values, \(a, b, c\)"):
        vega.optim.Muon([p], ns_coefficients=(3.0, -4.0))
    # (torch's keyword for torch's Muon: a spec of one's own with an a, b and c is not Muon)
    mine = vega.compile("optimizer abc(a = 1.0, b = 2.0, c = 3.0) {\n  p = p - a * b * c * g\n}")
    assert "ns_coefficients" not in mine.optimizer([p]).param_groups[0]
    with pytest.raises(TypeError, match="ns_coefficients"):
        mine.optimizer([p], ns_coefficients=(1.0, 2.0, 3.0))


def test_the_constructor_takes_a_setting_of_torchs_class_as_its_groups_do():
    """A keyword of torch's same-named class that the rule does not take is taken at the
    value where torch's rule is vega's, as a group takes it (it was an unexpected
    hyperparameter at every value), and refused at another; torch's
    adjust_lr_fn='match_rms_adamw' is Muon's match_rms_adamw=True."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    vega.optim.RAdam([p], weight_decay=0)
    vega.optim.RAdam([p], weight_decay=0.0, decoupled_weight_decay=False)
    with pytest.raises(ValueError, match=r"^RAdam: weight_decay=0\.1: vega\.optim\.RAdam's "
                                         r"rule is torch's at weight_decay=0; another rule"):
        vega.optim.RAdam([p], weight_decay=0.1)
    assert vega.optim.Muon([p], adjust_lr_fn=None).defaults["match_rms_adamw"] is False
    opt = vega.optim.Muon([p], adjust_lr_fn="match_rms_adamw")
    assert opt.defaults["match_rms_adamw"] is True
    with pytest.raises(ValueError, match=r"adjust_lr_fn='match_rms_adamw' is "
                                         r"match_rms_adamw=True, but match_rms_adamw=False"):
        vega.optim.Muon([p], adjust_lr_fn="match_rms_adamw", match_rms_adamw=False)
    vega.optim.Muon([p], adjust_lr_fn="original")  # (torch's None)
    vega.optim.Muon([p], adjust_lr_fn="original", match_rms_adamw=False)
    for fn in ("original", None):  # (torch's rule without the scale, given with it)
        with pytest.raises(ValueError, match=rf"^Muon: adjust_lr_fn={fn!r} is "
                                             r"match_rms_adamw=False, but "
                                             r"match_rms_adamw=True is given too"):
            vega.optim.Muon([p], adjust_lr_fn=fn, match_rms_adamw=True)
    with pytest.raises(ValueError, match=r"^Muon: adjust_lr_fn='other': .*; torch's "
                                         r"adjust_lr_fn='match_rms_adamw' is match_rms_adamw"):
        vega.optim.Muon([p], adjust_lr_fn="other")
    with pytest.raises(ValueError, match=r"group would step as without it; torch's "
                                         r"adjust_lr_fn='match_rms_adamw' is match_rms_adamw"):
        vega.optim.Muon([{"params": [p], "adjust_lr_fn": "match_rms_adamw"}])
    # stepped as the vega keyword
    q = torch.nn.Parameter(p.detach().clone())
    mine = vega.optim.Muon([q], lr=0.1, match_rms_adamw=True)
    for o, x in ((opt, p), (mine, q)):
        x.grad = torch.ones(4, 3)
        o.param_groups[0]["lr"] = 0.1
        o.step()
    assert torch.equal(p, q)


def test_a_group_refuses_a_setting_of_torchs_class_the_rule_does_not_take():
    """A group of RAdam with torch.optim.RAdam's weight_decay (or Adam's with its
    decoupled_weight_decay) at another value than the rule's would step as without it: refused
    where given, added or set between steps, before anything changes; at the rule's value
    (a framework's weight_decay=0 for every class) it is kept, as torch keeps it."""
    p = torch.nn.Parameter(torch.ones(3))
    words = (r"a parameter group has weight_decay=0\.5, a setting of torch\.optim\.RAdam "
             r"that vega\.optim\.RAdam does not take: its rule is torch's at weight_decay=0")
    with pytest.raises(ValueError, match=r"^RAdam: " + words):
        vega.optim.RAdam([{"params": [p], "weight_decay": 0.5}], lr=0.1)
    opt = vega.optim.RAdam([{"params": [p], "weight_decay": 0.0}], lr=0.1)
    with pytest.raises(ValueError, match=words):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))],
                             "weight_decay": 0.5})
    assert len(opt.param_groups) == 1
    p.grad = torch.ones(3)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"^RAdam: group 0: " + words):
        opt.step()
    assert torch.equal(p, before[0])
    assert all(torch.equal(v, before[1][k]) for k, v in opt.state[p].items())
    with pytest.raises(ValueError, match=r"decoupled_weight_decay=True, a setting of "
                                         r"torch\.optim\.Adam"):
        vega.optim.Adam([{"params": [p], "decoupled_weight_decay": True}])
    vega.optim.Lion([{"params": [p], "weight_decay": 0.5}])  # (no torch.optim.Lion: kept)


@pytest.mark.parametrize("cls,torch_cls,message", [
    ("AdamW", "AdamW", r"torch\.optim\.Adam or torch\.optim\.AdamW or torch\.optim\.RAdam's"),
    ("SGD", "SGD", r"torch\.optim\.SGD's"),
])
def test_a_torch_state_written_in_directly_is_named_at_the_step(cls, torch_cls, message):
    """A state written into a vega optimizer's ``state`` without its load_state_dict, as
    ZeroRedundancyOptimizer.load_state_dict writes the state of the optimizer it wraps, is
    not converted: the step names it torch's and says how to convert it (it asked whether a
    bool hyperparameter had changed)."""
    lin = torch.nn.Linear(3, 2)
    theirs = getattr(torch.optim, torch_cls)(lin.parameters(), lr=0.1, momentum=0.9) \
        if torch_cls == "SGD" else getattr(torch.optim, torch_cls)(lin.parameters(), lr=0.1)
    lin(torch.ones(2, 3)).sum().backward()
    theirs.step()
    ours = getattr(vega.optim, cls)(lin.parameters(), lr=0.1,
                                    **({"momentum": 0.9} if cls == "SGD" else {}))
    for p in lin.parameters():
        ours.state[p] = dict(theirs.state[p])
    before = [p.detach().clone() for p in lin.parameters()]
    with pytest.raises(ValueError, match=rf"^{cls}: the state of parameter 0 of group 0 has "
                                         rf"\[.*\], the entries of {message} state, where this "
                                         rf"optimizer keeps .*load it into a vega\.optim\.{cls} "
                                         r"with load_state_dict"):
        ours.step()
    assert all(torch.equal(p, b) for p, b in zip(lin.parameters(), before))


def test_torch_state_dict_leaves_master_copies_out_with_a_warning():
    """torch.optim keeps no master copy: torch's format leaves vega's out, with a warning
    (torch's class kept it as a state of its own, cast to the bfloat16 parameter's dtype)."""
    p = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16))
    opt = vega.optim.AdamW([p], lr=1e-2, master_weights=True)
    p.grad = torch.randn(6, 4).to(torch.bfloat16)
    opt.step()
    assert "master" in opt.state[p]
    with pytest.warns(UserWarning, match=r"AdamW.torch_state_dict: the master copies .* are "
                                         "left out: torch.optim keeps none"):
        converted = opt.torch_state_dict()
    assert set(converted["state"][0]) == {"exp_avg", "exp_avg_sq", "step"}
    theirs = torch.optim.AdamW([p], lr=1e-2)
    theirs.load_state_dict(converted)
    theirs.step()
    assert set(theirs.state[p]) == {"exp_avg", "exp_avg_sq", "step"}


def test_amsgrad_turned_off_keeps_its_state_as_torch_and_on_makes_it():
    """A state an if on a bool declares (amsgrad's nu_max) is kept where the bool is turned
    off after steps, as torch.optim.Adam keeps max_exp_avg_sq and steps without it (it was a
    ValueError), and made fresh where the bool is turned on (torch's step fails on the
    missing key): the steps after equal a fresh amsgrad's."""
    def run(cls, g):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 7, dtype=torch.float64))
        opt = cls([p], lr=0.1, amsgrad=True)
        for k in range(6):
            if k == 3:
                opt.param_groups[0]["amsgrad"] = False
            p.grad = torch.randn(7, dtype=torch.float64, generator=g)
            opt.step()
        return p, opt
    p, mine = run(vega.optim.Adam, torch.Generator().manual_seed(0))
    q, theirs = run(torch.optim.Adam, torch.Generator().manual_seed(0))
    assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert torch.allclose(mine.state[p]["nu_max"], theirs.state[q]["max_exp_avg_sq"],
                          rtol=0, atol=1e-15)
    # turned on after steps without it: nu_max starts at zeros, as a fresh amsgrad's
    a = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    opt = vega.optim.Adam([a], lr=0.1)
    a.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    opt.step()
    assert torch.equal(opt.state[a]["nu_max"], opt.state[a]["nu"])
    # 8-bit states, and their scales, alike (off, then on again)
    big = torch.nn.Parameter(torch.linspace(-1, 1, 5000))
    opt = vega.optim.Adam([big], lr=0.1, amsgrad=True, state_dtype=torch.uint8)
    for on in (True, False, True):
        opt.param_groups[0]["amsgrad"] = on
        big.grad = torch.ones(5000)
        opt.step()
        assert {"nu_max", "nu_max_absmax"} <= opt.state[big].keys()


def test_a_rule_without_weight_decay_refuses_a_decaying_group():
    """A framework's decay and no-decay groups give weight_decay to every optimizer: a class
    torch has not whose rule does not decay (AdaBelief, Yogi, ADOPT, a spec of one's own)
    kept weight_decay=0.5 and stepped as without it. It takes 0 and refuses another value,
    as RAdam does; a class of torch's that has none keeps the key, as torch's does."""
    p = torch.nn.Parameter(torch.ones(3))
    words = (r"a parameter group has weight_decay=0\.5, which AdaBelief's rule does not take "
             r"\(it has no weight_decay\): only weight_decay=0 is taken, and the group would "
             r"step as without it")
    with pytest.raises(ValueError, match=words):
        vega.optim.AdaBelief([{"params": [p], "weight_decay": 0.5}])
    with pytest.raises(ValueError, match=r"^Yogi: weight_decay=0\.1, which Yogi's rule does "
                                         r"not take"):
        vega.optim.Yogi([p], weight_decay=0.1)
    opt = vega.optim.ADOPT([{"params": [p], "weight_decay": 0.0}], weight_decay=0)
    p.grad = torch.ones(3)
    opt.step()
    opt.param_groups[0]["weight_decay"] = 0.5
    before = p.detach().clone()
    with pytest.raises(ValueError, match="ADOPT's rule does not take"):
        opt.step()
    assert torch.equal(p, before)
    mine = vega.compile("optimizer plain(lr = 0.1) { p = p - lr * g }").optimizer_class
    with pytest.raises(ValueError, match="rule does not take"):
        mine([{"params": [p], "weight_decay": 0.01}])
    vega.optim.Rprop([{"params": [p], "weight_decay": 0.5}])  # (torch's Rprop keeps it too)


@pytest.mark.parametrize("kind", ["pre", "post", "migrate", "torch names"])
def test_load_state_dict_hooks_run_as_torchs(kind):
    """torch's load_state_dict hooks: what a pre-hook returns is what is loaded (it was
    checked, converted and cast from the caller's dict, so the hook's changes were undone or
    refused), and what a post-hook writes into the state stays; a pre-hook sees torch's
    names in a state dict of torch's class."""
    def trained(cls):
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        opt = cls(lin.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            lin(torch.randn(2, 4)).sum().backward()
            opt.step()
        return opt.state_dict()
    seen = []

    def pre(opt, sd):
        seen.append(sorted(next(iter(sd["state"].values()))))
        sd = dict(sd)
        if kind == "migrate":  # (an old checkpoint's name for lr)
            sd["param_groups"] = [{**{k: v for k, v in g.items() if k != "learning_rate"},
                                   "lr": g["learning_rate"]} for g in sd["param_groups"]]
            return sd
        sd["state"] = {i: {**st, "mu": torch.zeros_like(st["mu"])}
                       for i, st in sd["state"].items()}
        return sd

    def post(opt):
        for st in opt.state.values():
            st["mu"] = torch.zeros_like(st["mu"])
    saved = trained(torch.optim.AdamW if kind == "torch names" else vega.optim.AdamW)
    if kind == "migrate":
        saved["param_groups"] = [{**{k: v for k, v in g.items() if k != "lr"},
                                  "learning_rate": g["lr"]} for g in saved["param_groups"]]
    opt = vega.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-2)
    if kind == "torch names":
        opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append(
            sorted(next(iter(sd["state"].values())))))
    elif kind == "post":
        opt.register_load_state_dict_post_hook(post)
    else:
        opt.register_load_state_dict_pre_hook(pre)
    opt.load_state_dict(saved)
    st = next(iter(opt.state.values()))
    if kind == "torch names":
        assert seen == [["exp_avg", "exp_avg_sq", "step"]]
        return
    assert int(st["step"]) == 3
    if kind == "migrate":
        assert opt.param_groups[0]["lr"] == 1e-2 and "learning_rate" not in opt.param_groups[0]
    else:
        assert not st["mu"].any() and st["nu"].any()


@pytest.mark.parametrize("cls", ["AdamW", "LBFGS"])
def test_state_dict_post_hooks_see_the_whole_state_dict(cls):
    """torch's state_dict post-hooks run last, on what state_dict() returns: vega's entries
    (the loss scale's tensors, the rule's name) were added after them, so that a hook
    never saw them, and a hook's snapshot (a deep copy) was given the live loss scale."""
    model = torch.nn.Linear(4, 3)
    opt = vega.optim.LBFGS(model.parameters()) if cls == "LBFGS" else \
        vega.optim.AdamW(model.parameters(), loss_scale=vega.LossScale.dynamic())
    seen = []
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sorted(sd)))
    opt.register_state_dict_post_hook(lambda o, sd: copy.deepcopy(sd))
    saved = opt.state_dict()
    assert seen == ["pre", sorted(saved)]
    if cls == "AdamW":
        assert {"loss_scale", "vega_rule"} <= saved.keys()
        assert saved["loss_scale"]["loss_scale"] is not opt.loss_scale.loss_scale
        opt.loss_scale.loss_scale.fill_(2.0)
        assert float(saved["loss_scale"]["loss_scale"]) == 2.0**15


@pytest.mark.parametrize("cls", ["AdamW", "LBFGS"])
def test_a_state_dict_pre_hook_registers_and_saves_as_torchs(cls):
    """A state_dict pre-hook runs on the optimizer's own hook dicts, as torch's does: one
    that registered a post-hook (the optimizer having one already) put it in the stand-in
    that held the post-hooks off during the saving, where it ran once and was then lost
    with it; a state_dict() called from a pre-hook ran no post-hook."""
    model = torch.nn.Linear(4, 3)
    opt = vega.optim.LBFGS(model.parameters()) if cls == "LBFGS" else \
        vega.optim.AdamW(model.parameters())
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("first"))

    def pre(o):
        if not seen:
            seen.append("pre")
            o.register_state_dict_post_hook(lambda o, sd: {**sd, "added": len(seen)})
            seen.append(sorted(o.state_dict()))
    opt.register_state_dict_pre_hook(pre)
    saved = opt.state_dict()
    assert seen[:3] == ["pre", "first", sorted(saved)] and seen[3] == "first"
    assert saved["added"] == 4
    assert opt.state_dict()["added"] == 5 and seen[4:] == ["first"]


@pytest.mark.parametrize("cls", ["AdamW", "LBFGS"])
@pytest.mark.parametrize("first", ["pre", "post"])
def test_a_load_with_hooks_of_one_kind_keeps_the_others_registrable(cls, first):
    """A load with load_state_dict hooks of one kind only puts back the optimizer's own dict
    of the other kind: an empty one was put back as a plain ``{}``, to which torch's hook
    handles cannot take a weak reference, so that a hook of that kind registered after the
    load failed (TypeError: cannot create weak reference to 'dict' object)."""
    model = torch.nn.Linear(4, 3)
    opt = vega.optim.LBFGS(model.parameters()) if cls == "LBFGS" else \
        vega.optim.AdamW(model.parameters())
    seen = []
    hooks = {"pre": (opt.register_load_state_dict_pre_hook, lambda o, sd: seen.append("pre")),
             "post": (opt.register_load_state_dict_post_hook, lambda o: seen.append("post"))}
    register, hook = hooks[first]
    register(hook)
    opt.load_state_dict(opt.state_dict())
    assert seen == [first]
    other = "post" if first == "pre" else "pre"
    register, hook = hooks[other]
    handle = register(hook, prepend=True)
    opt.load_state_dict(opt.state_dict())
    assert sorted(seen[1:]) == ["post", "pre"]
    handle.remove()
    opt.load_state_dict(opt.state_dict())
    assert seen[3:] == [first]


def test_adagrad_starts_a_groups_sums_at_the_groups_initial_accumulator_value():
    """vega's Adagrad reads a group's own initial_accumulator_value, where torch's starts
    every sum at the optimizer's (specs/adagrad.vega): the two agree where no group gives
    its own."""
    a, b = (torch.nn.Parameter(torch.zeros(3)) for _ in range(2))
    opt = vega.optim.Adagrad([{"params": [a]},
                              {"params": [b], "initial_accumulator_value": 0.5}],
                             initial_accumulator_value=0.25)
    theirs = torch.optim.Adagrad([{"params": [a]},
                                  {"params": [b], "initial_accumulator_value": 0.5}],
                                 initial_accumulator_value=0.25)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert torch.equal(opt.state[a]["acc"], torch.full((3,), 1.25))
    assert torch.equal(opt.state[b]["acc"], torch.full((3,), 1.5))
    assert torch.equal(theirs.state[b]["sum"], torch.full((3,), 0.25))


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RAdam", "NAdam", "Adagrad",
                                  "RMSprop", "Adamax", "Adadelta", "Rprop", "Muon"])
def test_a_class_torch_has_takes_its_defaults(name):
    """Code written for torch.optim that leaves a hyperparameter out steps the same."""
    ours = getattr(vega.optim, name)([torch.zeros(2, 2, requires_grad=True)])
    theirs = getattr(torch.optim, name)([torch.zeros(2, 2, requires_grad=True)])
    group, torch_group = ours.param_groups[0], theirs.param_groups[0]
    shared = [k for k in torch_group if k != "params" and k in group]
    assert "lr" in shared
    assert {k: group[k] for k in shared} == {k: torch_group[k] for k in shared}


def test_torch_state_with_differentiable_true_is_refused():
    """torch.optim's state of a differentiable optimizer (whose steps keep a graph) is
    refused by name: vega's fused step is not differentiable."""
    ps = _params()
    opt = torch.optim.Adam(ps, lr=1e-2, differentiable=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    mine = vega.optim.Adam(_params(), lr=1e-2)
    with pytest.raises(ValueError, match=r"group 0 of torch.optim.Adam's state has "
                                         r"differentiable=True, which vega's fused step is not"):
        mine.load_state_dict(opt.state_dict())


def test_torch_state_loads_with_each_groups_own_settings():
    """Loading torch.optim's state gives each group the backend and precision settings of
    this optimizer's group of the same position (torch's state has none), and no 8-bit
    state_dtype for the saved states: an 8-bit optimizer quantizes torch's float states,
    whole-numbered ones too (which as states saved in 8 bits would be codes cast to floats)."""
    a, b = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    theirs = torch.optim.Adam([{"params": [a]}, {"params": [b]}], lr=1e-2)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    theirs.step()
    sd = copy.deepcopy(theirs.state_dict())
    for st in sd["state"].values():  # (whole numbers from 0 to 255, as codes are)
        st["exp_avg"].copy_(torch.randint(0, 256, st["exp_avg"].shape))
    mine = vega.optim.Adam([{"params": [a], "backend": "reference"},
                            {"params": [b], "backend": "c", "master_weights": True}],
                           lr=1e-2, state_dtype=torch.uint8)
    with pytest.warns(UserWarning, match=r"quantized to 8 bits"):
        mine.load_state_dict(sd)
    assert [g["backend"] for g in mine.param_groups] == ["reference", "c"]
    assert [g["master_weights"] for g in mine.param_groups] == [False, True]
    assert mine.state[b]["mu"].dtype == torch.uint8


def test_torch_state_dict_holds_only_torchs_entries():
    """torch_state_dict() is torch's format: without vega's loss scale and rule name."""
    ps = [torch.nn.Parameter(torch.randn(3))]
    opt = vega.optim.AdamW(ps, lr=1e-2, loss_scale=vega.LossScale.dynamic())
    ps[0].grad = torch.ones(3)
    opt.step()
    assert opt.torch_state_dict().keys() == {"state", "param_groups"}


@pytest.mark.parametrize("count", [2**31 - 64, 2**31 - 1])
def test_a_counter_near_the_int32_limit_goes_through_torchs_format_and_back(count):
    """A step counter from 2**31 - 64 up is 2**31 in torch's float32 (torch_state_dict
    writes it so): loaded back, by this class or through torch.optim.AdamW, it is the
    saturated 2**31 - 1 (it was refused as past the counter's range), and steps on."""
    w = torch.nn.Parameter(torch.ones(4))
    opt = vega.optim.AdamW([w], lr=1e-3)
    w.grad = torch.ones(4)
    opt.step()
    opt.state[w]["step"].fill_(count)
    saved = opt.torch_state_dict()
    assert saved["state"][0]["step"].item() == 2.0**31
    theirs = torch.optim.AdamW([w], lr=1e-3)
    theirs.load_state_dict(saved)
    for sd in (saved, theirs.state_dict()):
        mine = vega.optim.AdamW([w], lr=1e-3)
        mine.load_state_dict(sd)
        assert mine.state[w]["step"].dtype == torch.int32
        assert mine.state[w]["step"].item() == 2**31 - 1
        mine.step()
        assert mine.state[w]["step"].item() == 2**31 - 1
        assert torch.isfinite(w).all()
    with pytest.raises(ValueError, match=r"2147483904.0; a step counter is a whole number"):
        saved["state"][0]["step"] = torch.tensor(2.0**31 + 256)
        vega.optim.AdamW([w], lr=1e-3).load_state_dict(saved)


@pytest.mark.parametrize("name,args,kw", [
    ("SGD", (0.1,), {"momentum": 0.9, "weight_decay": 1e-4}),  # (torch's ImageNet example)
    ("SGD", (0.1, 0.9, 0.0, 1e-4, True), {}),
    ("Adam", (1e-2, (0.8, 0.9), 1e-6, 0.01, True), {}),
    ("RMSprop", (1e-2, 0.9, 1e-7, 0.0, 0.5, True), {}),
    ("Adagrad", (1e-2, 0.01), {}),
    ("Adagrad", (1e-2, 0.01, 0.02, 0.1, 1e-8), {}),
    ("AdamW", (1e-2, (0.8, 0.9), 1e-6, 0.05, True), {}),
    ("NAdam", (1e-2, (0.8, 0.9), 1e-6, 0.01, 0.01, True), {}),
    ("RAdam", (1e-2, [0.8, 0.9], 1e-6, 0, False), {}),
    ("Adamax", (1e-2, (0.8, 0.9), 1e-6, 0.01), {}),
    ("Adadelta", (0.5, 0.8, 1e-5, 0.01), {}),
    ("Rprop", (1e-2, (0.4, 1.3), (1e-5, 10)), {}),
])
def test_hyperparameters_by_position_as_torch_takes_them(name, args, kw):
    # torch.optim.SGD(model.parameters(), 0.1, momentum=0.9): lr, and the others in the
    # order of torch's class, by position; the same steps as torch's with them
    ours = _run(lambda ps: getattr(vega.optim, name)(ps, *args, **kw))
    theirs = _run(lambda ps: getattr(torch.optim, name)(ps, *args, foreach=False, **kw))
    for p, q in zip(ours[0], theirs[0]):
        assert_close(p, q, rtol=1e-9)


def test_muon_takes_torchs_eight_by_position():
    """torch.optim.Muon(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
    ns_steps, adjust_lr_fn): the same steps, and momentum buffers, given so to both (each
    orthogonalizing in bfloat16: to torch's test's tolerance, at shapes where the two
    roundings meet)."""
    args = (1e-2, 0.05, 0.9, False, (3.0, -4.0, 2.0), 1e-6, 4, "match_rms_adamw")

    def run(make):
        gen = torch.Generator().manual_seed(0)
        ps = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True)
              for s in ((8, 6), (4, 3))]
        opt = make(ps)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
        return ps, opt
    (ps, ours), (qs, theirs) = run(lambda ps: vega.optim.Muon(ps, *args)), \
        run(lambda ps: torch.optim.Muon(ps, *args))
    for p, q in zip(ps, qs):
        assert_close(p.detach(), q.detach(), rtol=1e-5, scale=1.0)
        assert_close(ours.state[p]["buf"], theirs.state[q]["momentum_buffer"], rtol=1e-9)
    assert ours.param_groups[0]["match_rms_adamw"] is True


def test_the_classes_help_gives_the_order_by_position():
    """help(vega.optim.SGD) lists the hyperparameters in the spec's order (lr, momentum,
    nesterov, ...), which is not torch's order by position (lr, momentum, dampening, ...):
    the help says which order the positions take."""
    assert "By position after params: lr, momentum, dampening, weight_decay, nesterov, " \
        "torch.optim.SGD's order; the others by name." in vega.optim.SGD.__doc__
    assert "By position after params: lr, alpha, eps, weight_decay, momentum, centered, " \
        "torch.optim.RMSprop's order" in vega.optim.RMSprop.__doc__
    assert "By position after params: lr; the others by name." in vega.optim.Lion.__doc__
    mine = vega.compile("optimizer o(step_size = 1.0) {\n  p = p - step_size * g\n}\n")
    assert "By position" not in mine.optimizer_class.__doc__


def test_a_class_torch_has_not_takes_lr_alone_by_position():
    opt = vega.optim.Lion([torch.zeros(2)], 3e-4)
    assert opt.param_groups[0]["lr"] == 3e-4
    assert vega.adabelief.optimizer([torch.zeros(2)], 0.5).param_groups[0]["lr"] == 0.5
    with pytest.raises(TypeError, match=r"Lion takes 1 hyperparameter by position \(lr\), "
                                        "but 2 were given"):
        vega.optim.Lion([torch.zeros(2)], 3e-4, (0.9, 0.99))
    with pytest.raises(TypeError, match=r"SGD takes 5 hyperparameters by position \(lr, "
                                        "momentum, dampening, weight_decay, nesterov, in "
                                        "torch.optim.SGD's order\\), but 6 were given"):
        vega.optim.SGD([torch.zeros(2)], 0.1, 0.9, 0.0, 0.0, False, 1)
    with pytest.raises(TypeError, match="AdamW got multiple values for 'lr'"):
        vega.optim.AdamW([torch.zeros(2)], 0.1, lr=0.2)
    with pytest.raises(TypeError, match="RMSprop: give capturable by name"):
        vega.optim.RMSprop([torch.zeros(2)], 0.1, 0.99, 1e-8, 0.0, 0.0, False, True)
    # (torch's settings after the hyperparameters, capturable, foreach, ..., are not counted
    # among them: "RMSprop takes 10 hyperparameters by position" refused the seventh)
    with pytest.raises(TypeError, match=r"RMSprop takes 6 hyperparameters by position \(lr, "
                                        r"alpha, eps, weight_decay, momentum, centered, in "
                                        r"torch.optim.RMSprop's order\), but 11 were given"):
        vega.optim.RMSprop([torch.zeros(2)], 0.1, 0.99, 1e-8, 0.0, 0.0, False, False, None,
                           False, False, 1)
    with pytest.raises(TypeError, match=r"Adagrad takes 5 hyperparameters by position \(lr, "
                                        r"lr_decay, weight_decay, initial_accumulator_value, "
                                        r"eps, in torch.optim.Adagrad's order\), but 7 were"):
        vega.optim.Adagrad([torch.zeros(2)], 0.1, 0.0, 0.0, 0.0, 1e-10, None, 1)
    spec = vega.compile("optimizer o(step_size = 1.0) {\n  p = p - step_size * g\n}\n")
    with pytest.raises(TypeError, match=r"O takes its hyperparameters by name "
                                        r"\(step_size=...\), not by position"):
        spec.optimizer([torch.zeros(2)], 0.1)


def _copied_adam_steps(lib, change):
    """Adam's parameter after a step, a deepcopy, ``change`` of the copy's group and two
    steps of the copy."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = lib.Adam([p], lr=0.1)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    twin = copy.deepcopy(opt)
    q = twin.param_groups[0]["params"][0]
    change(twin.param_groups[0])
    for _ in range(2):
        q.grad = torch.tensor([1.0, -2.0, 0.5])
        twin.step()
    return q.detach()


@pytest.mark.parametrize("ours,theirs", [
    (lambda g: g.update(betas=(0.5, 0.9)), lambda g: g.update(betas=(0.5, 0.9))),
    (lambda g: g.update(betas=[0.5, 0.9]), lambda g: g.update(betas=[0.5, 0.9])),
    (lambda g: g.pop("betas"), lambda g: None)], ids=["tuple", "list", "deleted"])
def test_betas_of_a_copy_changed_before_its_first_step_are_taken_as_torch_takes_them(ours,
                                                                                      theirs):
    """A copy (which has no memory of what changed) reads a group's betas as torch's classes
    do, a list as a tuple; a group whose betas were deleted takes them from b1 and b2."""
    assert_close(_copied_adam_steps(vega.optim, ours), _copied_adam_steps(torch.optim, theirs),
                 rtol=1e-6)


def test_betas_that_are_no_pair_are_named():
    with pytest.raises(ValueError, match=r"^Adam: group 0 has betas=0.9; it must be a tuple of "
                                         r"2 values, \(b1, b2\)"):
        _copied_adam_steps(vega.optim, lambda g: g.update(betas=0.9))


    # (a spec of none said "takes its hyperparameters by name (), not by position")
    none = vega.compile("optimizer o() {\n  p = p - g\n}\n")
    with pytest.raises(TypeError, match=r"^O takes no hyperparameters, but 1 was given by "
                                        r"position$"):
        none.optimizer([torch.zeros(2)], 0.1)
