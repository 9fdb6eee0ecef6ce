"""A refused call changes nothing: each bad input below, given to an optimizer that has
taken steps, raises an error that names it, leaves the parameters, gradients, every state
tensor, the step counters, the loss scale's tensors and settings and the groups' dicts
bitwise as they were, and a following good step gives bitwise what the same optimizer that
never saw the bad call gives (docs/robustness.md, "Inputs that are checked")."""
import copy
import re

import pytest
import torch

import vega
import vega.optim
from vega import LossScale


def _copied(v):
    """``v`` with each tensor a copy (its dtype, device and bits), for ``_same``."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.device, v.detach().clone())
    if isinstance(v, (list, tuple)):
        return (type(v), [_copied(x) for x in v])
    if isinstance(v, dict):
        return ("dict", [(k, _copied(x)) for k, x in v.items()])
    return v


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _same(a, b, at: str = "") -> None:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        assert b[0] == "tensor" and a[1:3] == b[1:3], at
        assert a[3].shape == b[3].shape and torch.equal(_bits(a[3]), _bits(b[3])), at
    elif isinstance(a, tuple) and a and a[0] in (list, tuple, "dict"):
        assert a[0] == b[0] and len(a[1]) == len(b[1]), (at, a, b)
        for k, (x, y) in enumerate(zip(a[1], b[1])):
            if a[0] == "dict":
                assert x[0] == y[0], (at, x[0], y[0])
                _same(x[1], y[1], f"{at}.{x[0]}")
            else:
                _same(x, y, f"{at}[{k}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, at
    else:
        assert a is b or a == b, (at, a, b)


_SCALE_KEYS = ("growth_interval", "growth_factor", "backoff_factor", "is_dynamic")


def _snapshot(params, opt, ids: bool = True):
    """What a refused call may not change; ``ids``: with which objects hold it (the
    optimizer's own, not a twin's)."""
    ls = getattr(opt, "loss_scale", None)
    at = {id(p): k for k, p in enumerate(params)}  # (a state's parameter: its position)
    out = {"params": list(params), "grads": [p.grad for p in params],
           "state": [(at.get(id(p), "another"), st) for p, st in opt.state.items()],
           "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
           "scale": None if ls is None else (ls.tensors(), [getattr(ls, k) for k in _SCALE_KEYS]),
           "fused": (getattr(opt, "max_grad_norm", None), getattr(opt, "skip_nonfinite", None))}
    if ids:
        out["ids"] = ([id(p) for g in opt.param_groups for p in g["params"]],
                      [id(t) for st in opt.state.values() for t in st.values()], id(ls),
                      id(opt.state), id(opt.param_groups))
    return _copied(out)


def _grads(params, gen) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 4


def _adamw(backend, scaled: bool = True):
    """An AdamW of two groups with a dynamic loss scale and clipping (``scaled``; else
    skip_nonfinite alone), after three steps, its gradients for a fourth set."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(7, generator=gen)),
              torch.nn.Parameter(torch.randn(4, generator=gen))]
    opt = vega.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 2e-2}],
                           lr=1e-2, backend=backend, max_grad_norm=1.0 if scaled else None,
                           loss_scale=LossScale.dynamic(2.0**4, growth_interval=2)
                           if scaled else None, skip_nonfinite=not scaled)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads(params, gen)
        opt.step()
    _grads(params, gen)
    return params, opt


def _set(where, key, value):
    """A change of ``where(params, opt)[key]`` (a dict or an object), returning its undo."""
    def change(params, opt):
        obj = where(params, opt)
        get, put = (obj.__getitem__, obj.__setitem__) if isinstance(obj, dict) else \
            (lambda k: getattr(obj, k), lambda k, v: setattr(obj, k, v))
        old = get(key)
        put(key, value(old) if callable(value) and not isinstance(value, type) else value)
        return lambda: put(key, old)
    return change


def _group(k):
    return lambda params, opt: opt.param_groups[k]


def _state(i):
    return lambda params, opt: opt.state[params[i]]


def _dropped(i, key):
    def change(params, opt):
        st = opt.state[params[i]]
        old = dict(st)
        del st[key]
        return lambda: (st.clear(), st.update(old))
    return change


def _aliased(p):
    """``p``'s gradient made its own tensor (a step in place would write it twice)."""
    old = p.grad
    p.grad = p.data
    return lambda: setattr(p, "grad", old)


def _step_raising(params, opt):
    def closure():
        raise RuntimeError("closure failed")
    opt.step(closure)


# (name, change of the optimizer returning its undo, the refused call, error, its words)
STEPS = [
    ("lr of group 1", _set(_group(1), "lr", -1.0), None, ValueError, "lr=-1.0"),
    ("maximize of group 1", _set(_group(1), "maximize", 1), None, ValueError, "maximize=1"),
    ("backend of group 1", _set(_group(1), "backend", "nope"), None, ValueError, "'nope'"),
    ("state_dtype of group 1", _set(_group(1), "state_dtype", torch.int32), None, ValueError,
     "torch.int32"),
    ("max_grad_norm", _set(lambda ps, o: o, "max_grad_norm", -1.0), None, ValueError,
     "max_grad_norm=-1.0"),
    ("skip_nonfinite", _set(lambda ps, o: o, "skip_nonfinite", 2), None, ValueError,
     "skip_nonfinite=2"),
    ("loss scale's growth_interval", _set(lambda ps, o: o.loss_scale, "growth_interval", 0),
     None, ValueError, "loss_scale: growth_interval=0"),
    ("loss scale's growth_factor", _set(lambda ps, o: o.loss_scale, "growth_factor", 0.5),
     None, ValueError, "loss_scale: growth_factor=0.5"),
    ("loss scale's backoff_factor", _set(lambda ps, o: o.loss_scale, "backoff_factor", 2.0),
     None, ValueError, "loss_scale: backoff_factor=2.0"),
    ("a state of another shape", _set(_state(2), "mu", lambda t: t[:2].clone()), None,
     ValueError, "'mu'"),
    ("a state of integers", _set(_state(2), "nu", lambda t: t.int()), None, ValueError,
     "int32"),
    ("a state dropped", _dropped(2, "nu"), None, ValueError, "'nu'"),
    ("a gradient that is its parameter", lambda ps, o: _aliased(ps[2]), None, ValueError,
     "the gradient of parameter 1 of group 1"),
    ("a closure that raises", lambda ps, o: (lambda: None), _step_raising, RuntimeError,
     "closure failed"),
]


def _refused(make, change, call, error, words):
    """``change`` an optimizer ``make()`` made, check that ``call`` (its step by default) is
    refused and changes nothing, undo the change, and check that the next step is a twin's."""
    params, opt = make()
    twin_params, twin = make()
    undo = change(params, opt)
    before = _snapshot(params, opt)
    with pytest.raises(error, match=re.escape(words)):
        (call or (lambda ps, o: o.step()))(params, opt)
    _same(before, _snapshot(params, opt))
    undo()
    opt.step()
    twin.step()
    _same(_snapshot(twin_params, twin, False), _snapshot(params, opt, False))


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("name, change, call, error, words", STEPS, ids=[s[0] for s in STEPS])
def test_a_refused_class_step_changes_nothing(name, change, call, error, words, backend):
    _refused(lambda: _adamw(backend), change, call, error, words)


@pytest.mark.parametrize("name, change, call, error, words",
                         [s for s in STEPS if "loss scale" not in s[0]],
                         ids=[s[0] for s in STEPS if "loss scale" not in s[0]])
def test_a_refused_class_step_that_skips_without_a_scale_changes_nothing(name, change, call,
                                                                          error, words):
    _refused(lambda: _adamw("c", scaled=False), change, call, error, words)


@pytest.mark.parametrize("name", ["lr of group 1", "loss scale's growth_interval",
                                  "a state of another shape"])
def test_a_refused_triton_step_changes_nothing(name):
    _, change, call, error, words = next(s for s in STEPS if s[0] == name)
    _refused(lambda: _adamw("triton"), change, call, error, words)


def _saved(edit):
    def call(params, opt):
        sd = copy.deepcopy(opt.state_dict())
        edit(sd)
        opt.load_state_dict(sd)
    return call


def _added(group):
    return lambda params, opt: opt.add_param_group(group(params))


def _new():
    return torch.nn.Parameter(torch.ones(6))


CALLS = [
    ("a group's lr", _saved(lambda sd: sd["param_groups"][1].update(lr=-1.0)), ValueError,
     "lr=-1.0"),
    ("a state of another shape", _saved(lambda sd: sd["state"][2].update(mu=torch.zeros(3))),
     ValueError, "'mu'"),
    ("a negative step counter", _saved(lambda sd: sd["state"][1].update(
        step=torch.tensor(-1, dtype=torch.int32))), ValueError, "-1"),
    ("a negative loss scale", _saved(lambda sd: sd["loss_scale"].update(
        loss_scale=torch.tensor(-1.0))), ValueError, "'loss_scale' is -1.0"),
    ("a group too few", _saved(lambda sd: sd["param_groups"].pop()), ValueError, "group"),
    ("a group with a parameter of another", _added(lambda ps: {"params": [_new(), ps[0]]}),
     ValueError, "more than one parameter group"),
    ("a group's lr of add_param_group", _added(lambda ps: {"params": [_new()], "lr": -2.0}),
     ValueError, "lr=-2.0"),
    ("a group's misspelt key", _added(lambda ps: {"params": [_new()], "lr_": 0.1}), TypeError,
     "'lr_'"),
    ("a group's betas against its b1", _added(lambda ps: {"params": [_new()],
                                                          "betas": (0.5, 0.6), "b1": 0.7}),
     ValueError, "b1=0.7"),
    ("a group of integers", _added(lambda ps: {"params": [torch.zeros(3, dtype=torch.int64)]}),
     ValueError, "torch.int64"),
]


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("name, call, error, words", CALLS, ids=[c[0] for c in CALLS])
def test_a_refused_load_or_new_group_changes_nothing(name, call, error, words, backend):
    _refused(lambda: _adamw(backend), lambda ps, o: (lambda: None), call, error, words)


# -- the functional step, in place -----------------------------------------------------

def _functional(backend):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(7, generator=gen)}
    state = vega.adamw_init(params)
    ls = LossScale.dynamic(2.0**4, growth_interval=2)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=gen) * 4 for k, v in params.items()}
        params, state, ls = vega.adamw_step(params, grads, state, lr=1e-2, backend=backend,
                                            donate=True, max_grad_norm=1.0, loss_scale=ls)
    grads = {k: torch.randn(v.shape, generator=gen) * 4 for k, v in params.items()}
    return params, grads, state, ls


def _scale_with(**settings):
    def edit(args):
        ls = copy.copy(args["loss_scale"])
        for k, v in settings.items():
            setattr(ls, k, v)
        args["loss_scale"] = ls
    return edit


FUNCTIONAL = [
    ("lr", lambda a: a.update(lr=-1.0), "lr=-1.0"),
    ("max_grad_norm", lambda a: a.update(max_grad_norm=0.0), "max_grad_norm=0.0"),
    ("the loss scale's growth_interval", _scale_with(growth_interval=0),
     "loss_scale: growth_interval=0"),
    ("the loss scale's backoff_factor", _scale_with(backoff_factor=1.5),
     "loss_scale: backoff_factor=1.5"),
    ("a gradient of another shape", lambda a: a.update(grads={**a["grads"], "b": torch.zeros(3)}),
     "grads leaf 'b'"),
    ("a state leaf of another shape", lambda a: a.update(state={
        **a["state"], "mu": {**a["state"]["mu"], "w": torch.zeros(3)}}), "'mu.w'"),
    ("a float step counter", lambda a: a.update(state={**a["state"],
                                                      "step": a["state"]["step"].float()}),
     "state['step']"),
]


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("name, edit, words", FUNCTIONAL, ids=[f[0] for f in FUNCTIONAL])
def test_a_refused_functional_step_in_place_changes_nothing(name, edit, words, backend):
    params, grads, state, ls = _functional(backend)
    args = {"params": params, "grads": grads, "state": state, "loss_scale": ls, "lr": 1e-2,
            "max_grad_norm": 1.0}
    edit(args)
    given = [args.pop(k) for k in ("params", "grads", "state")]
    before = _copied((params, grads, state, given, list(ls.tensors())))
    with pytest.raises(ValueError, match=re.escape(words)):
        vega.adamw_step(*given, backend=backend, donate=True, **args)
    _same(before, _copied((params, grads, state, given, list(ls.tensors()))))
    twin = _functional(backend)
    mine = vega.adamw_step(params, grads, state, lr=1e-2, backend=backend, donate=True,
                           max_grad_norm=1.0, loss_scale=ls)
    theirs = vega.adamw_step(*twin[:3], lr=1e-2, backend=backend, donate=True,
                             max_grad_norm=1.0, loss_scale=twin[3])
    _same(_copied((mine[:2], list(mine[2].tensors()))),
          _copied((theirs[:2], list(theirs[2].tensors()))))


# -- the loss scale, adjusted in place --------------------------------------------------

@pytest.mark.parametrize("call, words", [
    (lambda ls: ls.adjust_(torch.ones(2, dtype=torch.bool)), "finite="),
    (lambda ls: ls.adjust_(torch.tensor(1.0)), "finite="),
    (lambda ls: ls.adjust_(True, growth_interval=0), "growth_interval=0"),
    (lambda ls: ls.adjust_(False, backoff_factor=0.0), "backoff_factor=0.0"),
])
def test_a_refused_adjust_in_place_changes_nothing(call, words):
    ls = LossScale.dynamic(2.0**4, growth_interval=2)
    twin = LossScale.dynamic(2.0**4, growth_interval=2)
    for finite in (True, False, True):
        ls.adjust_(finite)
        twin.adjust_(finite)
    before = _copied(list(ls.tensors()))
    with pytest.raises(ValueError, match=re.escape(words)):
        call(ls)
    _same(before, _copied(list(ls.tensors())))
    _same(_copied(list(twin.adjust_(True).tensors())), _copied(list(ls.adjust_(True).tensors())))


def test_a_refused_save_leaves_the_file_as_it_was(tmp_path):
    params, _, state, _ = _functional("reference")
    path = tmp_path / "state.safetensors"
    vega.save(path, state)
    was = path.read_bytes()
    with pytest.raises(ValueError, match="leaf 'mu.w' is a float"):
        vega.save(path, {**state, "mu": {**state["mu"], "w": 1.0}})
    assert path.read_bytes() == was and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# -- LBFGS --------------------------------------------------------------------------------

def _lbfgs(steps):
    def make():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
                  torch.nn.Parameter(torch.randn(7, generator=gen))]
        opt = vega.optim.LBFGS(params, lr=0.1, memory_size=4)
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            _grads(params, gen)
            opt.step()
        _grads(params, gen)
        return params, opt
    return make


LBFGS = [
    ("memory_size 0", _set(_group(0), "memory_size", 0), ValueError, "memory_size=0"),
    ("memory_size -1", _set(_group(0), "memory_size", -1), ValueError, "memory_size=-1"),
    ("memory_size 'x'", _set(_group(0), "memory_size", "x"), ValueError, "memory_size='x'"),
    ("memory_size 2.5", _set(_group(0), "memory_size", 2.5), ValueError, "memory_size=2.5"),
    ("lr", _set(_group(0), "lr", -1.0), ValueError, "lr=-1.0"),
    ("scale_init_precond", _set(_group(0), "scale_init_precond", 3), ValueError,
     "scale_init_precond=3"),
    ("a gradient that is its parameter", lambda ps, o: _aliased(ps[1]), ValueError,
     "parameter 1 of group 0"),
]


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("name, change, error, words", LBFGS, ids=[c[0] for c in LBFGS])
def test_a_refused_lbfgs_step_changes_nothing(name, change, error, words, steps):
    """A first step refused leaves no state either (memory_size=0 made an empty history,
    which every later step refused)."""
    _refused(_lbfgs(steps), change, None, error, words)


@pytest.mark.parametrize("edit, words", [
    (lambda sd: sd["param_groups"][0].update(memory_size=6), "needs (6, 5, 3)"),
    (lambda sd: sd["state"][1].update(diff_params=torch.zeros(4, 3)), "diff_params"),
])
def test_a_refused_lbfgs_load_changes_nothing(edit, words):
    _refused(_lbfgs(3), lambda ps, o: (lambda: None), _saved(edit), ValueError, words)
