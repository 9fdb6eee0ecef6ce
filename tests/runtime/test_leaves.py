"""Leaves of every kind, and the parameter groups of the optimizer classes.

Complex parameters step as their two real coordinates (torch.optim's convention),
with complex state; integer and bool leaves pass through; half-precision
parameters keep float32 state unless ``state_dtype`` says otherwise; param groups
carry their own hyperparameters; parameters without a gradient are left alone.
"""
import operator

import pytest
import torch
from torch.utils import _pytree as pytree

import vega
from vega.codegen import c as c_backend

SPECS = vega.builtin_names()
BACKENDS = ["reference", pytest.param("c", marks=pytest.mark.skipif(
    not c_backend.available(), reason="no C compiler"))]


def bits(t):
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- complex parameters against torch.optim ---------------------------------------------

# (vega functional, vega class, torch class, hyperparameters, {vega state: torch state})
COMPLEX_CASES = {
    "sgd": (vega.sgd, vega.optim.SGD, torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, {"v": "momentum_buffer"}),
    "sgd-nesterov": (vega.sgd, vega.optim.SGD, torch.optim.SGD,
                     {"lr": 0.05, "momentum": 0.9, "nesterov": True}, {"v": "momentum_buffer"}),
    "adam": (vega.adam, vega.optim.Adam, torch.optim.Adam,
             {"lr": 0.01, "weight_decay": 0.01}, {"mu": "exp_avg", "nu": "exp_avg_sq"}),
    "adam-amsgrad": (vega.adam, vega.optim.Adam, torch.optim.Adam,
                     {"lr": 0.01, "amsgrad": True},
                     {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}),
}


def complex_params():
    gen = torch.Generator().manual_seed(0)
    return {"z": torch.randn(6, 4, dtype=torch.complex128, generator=gen),
            "x": torch.randn(5, dtype=torch.float64, generator=gen),
            "c": torch.randn((), dtype=torch.complex128, generator=gen)}


def complex_grads(k):
    gen = torch.Generator().manual_seed(100 + k)
    return {name: torch.randn(p.shape, dtype=p.dtype, generator=gen)
            for name, p in complex_params().items()}


def torch_trajectory(torch_cls, hypers, steps=10):
    params = {k: v.clone().requires_grad_(True) for k, v in complex_params().items()}
    opt = torch_cls(params.values(), foreach=False, **hypers)
    for k in range(steps):
        for name, p in params.items():
            p.grad = complex_grads(k)[name]
        opt.step()
    return params, opt


def assert_close(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} against {expected.dtype}"
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-10, atol=1e-10,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", COMPLEX_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_functional_matches_torch(case, backend):
    spec, _, torch_cls, hypers, state_map = COMPLEX_CASES[case]
    expected, opt = torch_trajectory(torch_cls, hypers)
    params = complex_params()
    state = spec.init(params, **hypers)
    assert state["mu" if "mu" in state else "v"]["z"].dtype == torch.complex128
    for k in range(10):
        params, state = spec.step(params, complex_grads(k), state, backend=backend, **hypers)
    assert int(state["step"]) == 10
    for name, p in expected.items():
        assert_close(params[name], p, f"param {name}")
        for ours, theirs in state_map.items():
            assert_close(state[ours][name], opt.state[p][theirs], f"state {ours}.{name}")


@pytest.mark.parametrize("case", COMPLEX_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_optimizer_class_matches_torch(case, backend):
    _, cls, torch_cls, hypers, state_map = COMPLEX_CASES[case]
    expected, opt = torch_trajectory(torch_cls, hypers)
    params = {k: v.clone().requires_grad_(True) for k, v in complex_params().items()}
    ours = cls(params.values(), backend=backend, **hypers)
    for k in range(10):
        for name, p in params.items():
            p.grad = complex_grads(k)[name]
        ours.step()
    for name, p in expected.items():
        q = params[name]
        assert_close(q, p, f"param {name}")
        assert ours.state[q]["step"].dtype == torch.int32 and int(ours.state[q]["step"]) == 10
        for mine, theirs in state_map.items():
            assert_close(ours.state[q][mine], opt.state[p][theirs], f"state {mine} of {name}")


def test_complex_sgd_descends_a_real_objective():
    """z - lr * z.grad with torch's autograd gradient (2 (z - w) for |z - w|^2) moves
    z toward w: after n steps from 0, z = w (1 - (1 - 2 lr)^n), both coordinates."""
    target = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex128)
    z = torch.zeros(2, dtype=torch.complex128, requires_grad=True)
    opt = vega.optim.SGD([z], lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        (z - target).abs().square().sum().backward()
        opt.step()
    torch.testing.assert_close(z.detach(), target * (1 - 0.8 ** 30), rtol=1e-12, atol=0)


# -- integer and bool leaves pass through ----------------------------------------------

def mixed_params():
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=gen), "ids": torch.arange(6, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]), "b": torch.randn(3, generator=gen)}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_int_and_bool_leaves_come_out_identical(name, donate):
    spec = vega.builtin(name)
    params = mixed_params()
    ids, mask = params["ids"], params["mask"]
    ids_before, mask_before = ids.clone(), mask.clone()
    state = spec.init(params)
    for field in state:
        if field != "step":
            assert state[field]["ids"] is None and state[field]["mask"] is None
    assert not any(".ids" in n or ".mask" in n for n in vega.state_names(state))
    grads = {"w": torch.ones(4, 3), "ids": None, "mask": torch.zeros(3, dtype=torch.bool),
             "b": torch.ones(3)}
    for _ in range(3):
        params, state = spec.step(params, grads, state, donate=donate)
    for key, before in (("ids", ids_before), ("mask", mask_before)):
        assert params[key].dtype == before.dtype and torch.equal(params[key], before), key
    if donate:  # donated: the very tensors (pure mode may return them too)
        assert params["ids"] is ids and params["mask"] is mask
    assert not torch.equal(params["w"], mixed_params()["w"])  # the float leaves did step
    assert int(state["step"]) == 3


# -- half precision and state_dtype ---------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_params_keep_float32_state_by_default(dtype, backend):
    params = {"w": torch.randn(4, 3).to(dtype), "b": torch.randn(3).to(dtype)}
    state = vega.adamw_init(params)
    assert state["mu"]["w"].dtype == torch.float32 and state["nu"]["b"].dtype == torch.float32
    params, state = vega.adamw_step(params, {k: torch.ones_like(v) for k, v in params.items()},
                                    state, backend=backend)
    assert params["w"].dtype == dtype and state["mu"]["w"].dtype == torch.float32
    opt_params = [torch.randn(4, 3).to(dtype).requires_grad_(True)]
    opt = vega.optim.AdamW(opt_params, backend=backend)
    opt_params[0].grad = torch.ones_like(opt_params[0])
    opt.step()
    assert opt.state[opt_params[0]]["mu"].dtype == torch.float32
    assert opt_params[0].dtype == dtype


@pytest.mark.parametrize("pdtype,sdtype", [(torch.bfloat16, torch.float64),
                                           (torch.float16, torch.float64),
                                           (torch.float32, torch.float64),
                                           (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dtype_selects_the_state_dtype(pdtype, sdtype, backend):
    params = {"w": torch.randn(4, 3).to(pdtype)}
    grads = {"w": torch.randn(4, 3).to(pdtype)}
    state = vega.adam_init(params, state_dtype=sdtype)
    assert {t.dtype for t in (state["mu"]["w"], state["nu"]["w"])} == {sdtype}
    new_p, new_s = vega.adam_step(params, grads, state, backend=backend)
    assert new_p["w"].dtype == pdtype
    assert new_s["mu"]["w"].dtype == sdtype and new_s["step"].dtype == torch.int32
    # the class takes it as a keyword, and as a per-group setting
    p = params["w"].clone().requires_grad_(True)
    q = params["w"].clone().requires_grad_(True)
    opt = vega.optim.Adam([{"params": [p]}, {"params": [q], "state_dtype": None}],
                          state_dtype=sdtype, backend=backend)
    p.grad, q.grad = grads["w"].clone(), grads["w"].clone()
    opt.step()
    assert opt.state[p]["mu"].dtype == sdtype
    assert opt.state[q]["mu"].dtype == (torch.float32 if pdtype != torch.float64 else pdtype)
    # and the class's update is the functional one, bit for bit
    assert same_bits(p.detach(), new_p["w"]) and same_bits(opt.state[p]["nu"], new_s["nu"]["w"])


# -- param groups ----------------------------------------------------------------------

def test_param_groups_have_their_own_hyperparameters():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, generator=gen)
    b = torch.randn(4, generator=gen)
    ga, gb = torch.randn(5, 4, generator=gen), torch.randn(4, generator=gen)
    pa, pb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    opt = vega.optim.AdamW([{"params": [pa], "lr": 0.1, "weight_decay": 0.5},
                            {"params": [pb]}], lr=0.01, b1=0.8)
    assert opt.param_groups[1]["lr"] == 0.01 and opt.param_groups[0]["b1"] == 0.8
    state_a = vega.adamw_init({"a": a})
    state_b = vega.adamw_init({"b": b})
    fa, fb = {"a": a}, {"b": b}
    for _ in range(3):
        pa.grad, pb.grad = ga.clone(), gb.clone()
        opt.step()
        fa, state_a = vega.adamw_step(fa, {"a": ga}, state_a, lr=0.1, weight_decay=0.5, b1=0.8)
        fb, state_b = vega.adamw_step(fb, {"b": gb}, state_b, lr=0.01, b1=0.8)
    assert same_bits(pa.detach(), fa["a"]) and same_bits(pb.detach(), fb["b"])
    assert same_bits(opt.state[pa]["nu"], state_a["nu"]["a"])
    # changing a group's value between steps takes effect at the next step
    opt.param_groups[1]["lr"] = 0.0
    before = pb.detach().clone()
    pa.grad, pb.grad = ga.clone(), gb.clone()
    opt.step()
    assert same_bits(pb.detach(), before) and int(opt.state[pb]["step"]) == 4


@pytest.mark.parametrize("bad,match", [
    ({"lr": -1.0}, r"lr=-1\.0 is outside its range"),
    ({"b1": 1.5}, r"b1=1\.5 is outside its range"),
    ({"eps": float("nan")}, r"eps=nan is"),
    ({"weight_decay": "0.1"}, r"weight_decay='0\.1' must be a float"),
    ({"amsgrad": 1}, r"amsgrad=1 must be True or False"),
    ({"backend": "cuda"}, r"backend='cuda' is not one of"),
])
def test_add_param_group_validates_and_does_not_add_a_bad_group(bad, match):
    p = torch.randn(3, requires_grad=True)
    opt = vega.optim.Adam([p], lr=1e-2)
    q = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group({"params": [q], **bad})
    assert len(opt.param_groups) == 1 and all(x is not q for x in opt.param_groups[0]["params"])
    opt.add_param_group({"params": [q], "lr": 0.5})  # the same parameter, now valid
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["b1"] == 0.9
    p.grad, q.grad = torch.ones(3), torch.ones(4)
    opt.step()
    assert int(opt.state[q]["step"]) == 1


@pytest.mark.parametrize("name,value,match", [
    ("lr", -1.0, r"lr=-1\.0 is outside its range"),
    ("b1", 1.0, r"b1=1\.0 is outside its range"),
    ("eps", float("nan"), r"eps=nan is outside its range"),
    ("eps", float("inf"), r"eps=inf is outside its range"),
    ("weight_decay", "0.1", r"weight_decay='0\.1' must be a float"),
])
def test_a_group_value_set_between_steps_is_checked_at_the_step(name, value, match):
    """Each step checks its groups' values (a float one the most often: a plain float in
    its range passes a quick path), and writes nothing where one is wrong."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = vega.optim.Adam([p], lr=1e-2)
    p.grad = torch.ones(3)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0][name] = value
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert torch.equal(p.detach(), before) and int(opt.state[p]["step"]) == 1


def test_add_param_group_refuses_integer_parameters():
    opt = vega.optim.SGD([torch.randn(2, requires_grad=True)])
    with pytest.raises(ValueError, match=r"^SGD: parameter 1 of group 1 is of dtype torch\.int64; "
                                         r"SGD can only optimize float or complex tensors"):
        opt.add_param_group({"params": [torch.randn(3), torch.arange(3)]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [vega.optim.AdamW, vega.optim.LBFGS])
def test_a_modules_integer_buffer_given_as_a_parameter_is_refused_by_position(cls):
    """A BatchNorm's buffers given with its parameters (``num_batches_tracked`` is int64):
    the refusal says which of the tensors given it is."""
    bn = torch.nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: parameter 4 of group 0 is of dtype "
                                         r"torch\.int64; "):
        cls([*bn.parameters(), *bn.buffers()])


def test_constructor_validates_hyperparameters():
    with pytest.raises(ValueError, match=r"lr=-0\.1 is outside its range"):
        vega.optim.SGD([torch.randn(2, requires_grad=True)], lr=-0.1)
    with pytest.raises(TypeError, match=r"unexpected hyperparameter 'moment'.*'momentum'"):
        vega.optim.SGD([torch.randn(2, requires_grad=True)], moment=0.9)


# -- parameters without a gradient ----------------------------------------------------

@pytest.mark.parametrize("cls", [vega.builtin(n).optimizer_class for n in SPECS],
                         ids=lambda c: c.__name__)
def test_params_without_grad_are_left_alone(cls):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(4, 3, generator=gen).requires_grad_(True) for _ in range(3)]
    opt = cls(ps)
    for p in ps:
        p.grad = torch.randn(4, 3, generator=gen)
    opt.step()
    frozen = {i: (ps[i].detach().clone(), {k: v.clone() for k, v in opt.state[ps[i]].items()})
              for i in (1, 2)}
    ps[1].grad = None  # no gradient this step
    ps[2].grad = None
    ps[0].grad = torch.randn(4, 3, generator=gen)
    opt.step()
    opt.step()
    assert int(opt.state[ps[0]]["step"]) == 3
    # a state of one number per group (Prodigy's d) and then the step counter follow the
    # group's (test_group_language); every other state stays
    shared = set(cls.spec.program().group_states)
    for i, (value, state) in frozen.items():
        assert same_bits(ps[i].detach(), value), f"param {i} moved"
        assert opt.state[ps[i]].keys() == state.keys()
        for k, v in state.items():
            if k not in shared and not (shared and k == "step"):
                assert same_bits(opt.state[ps[i]][k], v), f"param {i}: state {k!r} changed"
        # torch semantics: its own counter stays
        assert int(opt.state[ps[i]]["step"]) == (3 if shared else 1)


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
def test_a_parameter_whose_first_gradient_comes_late_takes_its_groups_values(name, backend):
    """A parameter of a rule with states of one number per group (Prodigy's d and num) whose
    first gradient comes after its group has stepped takes the group's d, num and step
    counter, as the rule's own implementations hold them once for the group; the class then
    steps as the functional step, whose state holds every leaf from the start (it started
    from d0 and counted its own steps: two d's in one group)."""
    spec = vega.builtin(name)
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    opt = spec.optimizer_class([a, b], backend=backend)
    params = {"a": torch.ones(3), "b": torch.ones(4)}
    state = spec.init(params)
    for i in range(4):
        grads = {"a": torch.full((3,), 1.0 + i), "b": None if i < 2 else torch.full((4,), -1.0)}
        a.grad, b.grad = grads["a"], grads["b"]
        opt.step()
        params, state = spec.step(params, grads, state, backend=backend)
    assert same_bits(a.detach(), params["a"]) and same_bits(b.detach(), params["b"])
    for key, value in opt.state[b].items():
        want = state[key] if key == "step" else state[key]["b"]
        assert same_bits(value, want), key
    assert int(opt.state[b]["step"]) == 4


def test_param_never_given_a_grad_gets_no_state():
    p, q = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = vega.optim.Adam([p, q])
    p.grad = torch.ones(3)
    opt.step()
    assert q not in opt.state or not opt.state[q]
    assert set(opt.state_dict()["state"]) == {0}


@pytest.mark.parametrize("name", SPECS)
def test_functional_none_grad_leaves_param_and_state_untouched(name):
    spec = vega.builtin(name)
    params = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    grads = {"a": torch.randn(4, 3), "b": torch.randn(3)}
    params, state = spec.step(params, grads, spec.init(params))
    b_before = params["b"].clone()
    state_before = pytree.tree_map(lambda x: None if x is None else x.clone(), state)
    params2, state2 = spec.step(params, {"a": grads["a"], "b": None}, state)
    assert same_bits(params2["b"], b_before)
    shared = set(spec.program().group_states)  # (the group's: test_group_language)
    for field in state:  # (a field the vector does not hold, muon's buf: None for it)
        if field != "step" and state_before[field]["b"] is not None and field not in shared:
            assert same_bits(state2[field]["b"], state_before[field]["b"]), field
    assert int(state2["step"]) == 2  # the functional state has one counter for all leaves


def test_a_leaf_without_a_gradient_counts_the_calls_and_a_state_of_its_own_its_steps():
    """docs/conventions.md: a functional step's leaf whose first gradients are None takes
    its bias corrections from the one counter of the calls (Adam at lr 0.1, two calls
    without a gradient, then -3 and -4: 1.1418), where torch.optim and the class count its
    own steps (1.1997); a state of its own, stepped only where it has a gradient, counts
    them as the class does."""
    b = torch.nn.Parameter(torch.ones(4))
    opt, mine = vega.optim.Adam([b], lr=0.1), torch.optim.Adam([b.detach().clone()], lr=0.1)
    shared_p, own_p = {"a": torch.ones(3), "b": torch.ones(4)}, {"b": torch.ones(4)}
    shared, own = vega.adam_init(shared_p), vega.adam_init(own_p)
    for i in range(4):
        gb = None if i < 2 else torch.full((4,), -1.0 - i)
        shared_p, shared = vega.adam_step(shared_p, {"a": torch.ones(3), "b": gb}, shared,
                                          lr=0.1)
        if gb is not None:
            b.grad = mine.param_groups[0]["params"][0].grad = gb
            opt.step()
            mine.step()
            own_p, own = vega.adam_step(own_p, {"b": gb}, own, lr=0.1)
    assert torch.allclose(shared_p["b"], torch.full((4,), 1.1418), atol=1e-4)
    assert torch.allclose(b.detach(), torch.full((4,), 1.1997), atol=1e-4)
    assert torch.allclose(mine.param_groups[0]["params"][0], b.detach(), rtol=1e-6)
    assert same_bits(own_p["b"], b.detach())
    assert int(shared["step"]) == 4 and int(own["step"]) == int(opt.state[b]["step"]) == 2


def test_nested_trees_flatten_as_torch_walks_them(monkeypatch):
    """A tree of dicts, lists and tuples of plain tensors (a model's layers as a list of
    dicts) flattens to what torch's walk gives, and unflattens to the same containers,
    without that walk once its structure has been seen (it took 18 us a leaf at every
    functional step); a tree with anything else in it (a namedtuple, a number) takes it."""
    from collections import namedtuple

    from vega.runtime import tree
    a, b = torch.zeros(2), torch.nn.Parameter(torch.ones(3))
    pair = namedtuple("pair", "x y")
    walked = []
    flat, unflat = pytree.tree_flatten, pytree.tree_unflatten
    monkeypatch.setattr(pytree, "tree_flatten", lambda *x, **k: walked.append(1) or flat(*x, **k))
    monkeypatch.setattr(pytree, "tree_unflatten", lambda *x: walked.append(1) or unflat(*x))
    nested = ({"layers": [{"w": a, "b": None}, {"w": b, "b": a}], "head": (b, [a])},
              [[a], b, {"x": {"y": [a, b]}}, ()], ({}, [], [None]))
    for t in (*nested, [pair(a, b), a], {"x": [a, 1.0]}):
        for k in range(2):  # (the second time from the cache)
            walked.clear()
            leaves, spec = tree.flatten(t)
            back = tree.unflatten(list(leaves), spec)
            assert bool(walked) == (k == 0 or not any(t is n for n in nested))
            theirs, their_spec = flat(t, is_leaf=lambda x: x is None)
            assert len(leaves) == len(theirs) and all(map(operator.is_, leaves, theirs))
            assert spec == their_spec
            assert type(back) is type(t) and back is not t
            again, again_spec = flat(back, is_leaf=lambda x: x is None)
            assert again_spec == their_spec and all(map(operator.is_, again, theirs))


@pytest.mark.parametrize("wrap", [lambda d: d, lambda d: [d, {"x": torch.ones(1)}]],
                         ids=["flat", "nested"])
def test_keys_equal_in_value_but_not_in_type_keep_their_type(wrap):
    """A step over {1.0: w} after one over {1: w} (or {True: w}) gives back its own keys:
    the cached structure of the first tree, whose keys compare equal, gave back an int key
    for a float one, silently."""
    def keys(tree):
        d = tree if isinstance(tree, dict) else tree[0]
        return [type(k) for k in d]
    for key in (1, 1.0, True, 1):
        params = wrap({key: torch.ones(3)})
        grads = wrap({key: torch.full((3,), 0.5)})
        state = vega.adamw_init(params)
        new, state = vega.adamw_step(params, grads, state, backend="c")
        assert keys(new) == keys(state["mu"]) == [type(key)]


def test_a_functional_step_over_layers_steps_as_over_their_list():
    """A functional step over a list of dicts of tensors steps each as a flat list of them."""
    g = torch.Generator().manual_seed(0)
    layers = [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
              for _ in range(3)]
    grads = [{"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
             for _ in range(3)]
    flat = [t.clone() for layer in layers for t in layer.values()]
    flat_g = [t for layer in grads for t in layer.values()]
    state, flat_state = vega.adamw_init(layers), vega.adamw_init(flat)
    for _ in range(2):
        layers, state = vega.adamw_step(layers, grads, state, backend="c")
        flat, flat_state = vega.adamw_step(flat, flat_g, flat_state, backend="c")
    assert type(layers) is list and all(type(layer) is dict for layer in layers)
    assert all(map(torch.equal, [t for layer in layers for t in layer.values()], flat))
    assert all(map(torch.equal, [t for layer in state["nu"] for t in layer.values()],
                   flat_state["nu"]))

def test_flat_trees_flatten_as_torch_walks_them():
    """A dict, list or tuple of plain tensors (None among them) flattens without torch's
    walk to what that walk gives, and unflattens to the same kind of container; any other
    tree takes torch's walk."""
    from collections import namedtuple

    from vega.runtime import tree
    a, b = torch.zeros(2), torch.nn.Parameter(torch.ones(3))
    pair = namedtuple("pair", "x y")
    for t in ({"w": a, "b": None, "c": b}, [a, None, b], (a, b), [], [[a], b], pair(a, b)):
        for _ in range(2):  # (the second time from the cache)
            leaves, spec = tree.flatten(t)
            theirs, their_spec = pytree.tree_flatten(t, is_leaf=lambda x: x is None)
            assert len(leaves) == len(theirs) and all(map(operator.is_, leaves, theirs))
            assert spec == their_spec
            back = tree.unflatten(list(leaves), spec)
            assert type(back) is type(t) and back is not t
            again, again_spec = pytree.tree_flatten(back, is_leaf=lambda x: x is None)
            assert again_spec == their_spec and all(map(operator.is_, again, theirs))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, hypers", [
    ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.5}), ("Rprop", {"lr": 0.01})])
def test_an_empty_complex_parameter_steps_as_torch(name, hypers, backend):
    """A complex parameter with no element beside others, under a rule whose state starts at
    a constant (Adagrad's accumulator, Rprop's step sizes), steps as torch.optim's class
    steps it: its state, the constant expanded to no element, kept stride 0 and could not
    be viewed as complex (a RuntimeError at the first step)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, dtype=torch.complex64, generator=gen))
            for s in [(0,), (3,), (2, 0)]]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = getattr(vega.optim, name)(ours, backend=backend, **hypers)
    ref = getattr(torch.optim, name)(theirs, foreach=False, **hypers)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach())


def test_a_leaf_without_a_gradient_takes_its_own_copy_of_the_groups_states():
    """A leaf that does not step takes the new value of each state of one number per group
    (Prodigy's d and num) as a tensor of its own, not the stepped leaf's: shared, the next
    step in place refused the state (two leaves of it share memory), and writing one wrote
    the other."""
    spec = vega.builtin("prodigy")
    gen = torch.Generator().manual_seed(3)
    params = {"a": torch.randn(3, generator=gen), "b": torch.randn(2, generator=gen)}
    grads = {"a": torch.randn(3, generator=gen), "b": torch.randn(2, generator=gen)}
    params, state = spec.step(params, grads, spec.init(params))
    params, state = spec.step(params, {"a": grads["a"], "b": None}, state)
    for name in spec.program().group_states:
        a, b = state[name]["a"], state[name]["b"]
        assert same_bits(a, b) and a.untyped_storage().data_ptr() != \
            b.untyped_storage().data_ptr(), name
    params, state = spec.step(params, grads, state, donate=True)
    # in place too: the leaf's own tensors take the new values
    own = {name: state[name]["b"] for name in spec.program().group_states}
    params, state = spec.step(params, {"a": grads["a"], "b": None}, state, donate=True)
    for name, b in own.items():
        assert state[name]["b"] is b and same_bits(b, state[name]["a"]), name


def test_a_step_in_place_over_two_programs_reads_the_counter_once_and_advances_it_in_place():
    """Adafactor's matrix and vector step in two programs: in place (``donate=True``) both
    read the counter as it was, as the pure step does, and the state's own counter tensor
    advances once (each program stepped a copy of it: the second read the first's advance,
    and the state's counter was left behind)."""
    spec = vega.builtin("adafactor")
    gen = torch.Generator().manual_seed(5)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    hypers = {"min_dim_size_to_factor": 2.0}
    state = spec.init(params, **hypers)
    want_p, want_s = spec.step(params, grads, state, **hypers)
    counter = state["step"]
    for _ in range(2):
        params, state = spec.step(params, grads, state, donate=True, **hypers)
        if int(counter) == 1:
            for k in params:
                assert same_bits(params[k], want_p[k]), k
    assert state["step"] is counter and int(counter) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pure_step_keeps_requires_grad_as_each_parameter_has_it(backend):
    """A pure step's new parameters require gradients where the given ones did (each a leaf
    tensor, ready for the next backward pass), and only there."""
    spec = vega.builtin("adam")
    params = {"w": torch.randn(3, 2).requires_grad_(), "b": torch.randn(2)}
    grads = {"w": torch.ones(3, 2), "b": torch.ones(2)}
    new, _ = spec.step(params, grads, spec.init(params), backend=backend)
    assert new["w"].requires_grad and new["w"].is_leaf and new["w"] is not params["w"]
    assert not new["b"].requires_grad


@pytest.mark.parametrize("donate", [False, True])
def test_a_functional_step_without_any_gradient_advances_only_the_counter(donate):
    """Every gradient None: the parameters and the state stay as they were, and the step
    counter advances once, as a step whose leaves step advances it (one counter for the
    call, optax's count); in place, the state's own counter."""
    spec = vega.builtin("adam")
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    state = spec.init(params)
    before = pytree.tree_map(lambda x: x.clone(), (params, state))
    counter = state["step"]
    new_p, new_s = spec.step(params, {"w": None, "b": None}, state, donate=donate)
    assert int(new_s["step"]) == 1 and (new_s["step"] is counter) == donate
    for k in params:
        assert same_bits(new_p[k], before[0][k])
        for f in ("mu", "nu"):
            assert same_bits(new_s[f][k], before[1][f][k])


def test_the_cache_of_flat_structures_stays_bounded():
    """``flatten`` caches one structure per tuple of keys: a process that flattens trees of
    ever new keys (a dict per step, keyed by step) keeps at most 64, each still flattened
    and rebuilt as torch's walk does."""
    from vega.runtime import tree
    for k in range(100):
        d = {f"k{k}": torch.zeros(1), "none": None}
        leaves, spec = tree.flatten(d)
        assert leaves[0] is d[f"k{k}"] and leaves[1] is None
        assert list(tree.unflatten(leaves, spec)) == [f"k{k}", "none"]
    assert len(tree._FLAT_SPECS) <= 64 and len(tree._FLAT_KEYS) <= 64


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("make", [lambda: torch.nn.LazyLinear(3),
                                  lambda: torch.nn.LazyConv2d(3, 3)])
def test_a_class_made_over_a_lazy_modules_parameters_steps_as_torchs(make, backend):
    """A class made before a lazy module's first forward pass (its parameters uninitialized)
    steps, from that pass on, as torch.optim's class does: parameters and every state."""
    x = torch.randn(2, 4, 6, 6)
    runs = []
    for cls, kw in ((vega.optim.Adam, {"backend": backend}), (torch.optim.Adam, {})):
        torch.manual_seed(0)
        model = make()
        opt = cls(model.parameters(), lr=0.01, **kw)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        runs.append((model, opt))
    (mine, ours), (theirs, torchs) = runs
    for a, b in zip(mine.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b)
    saved, want = ours.torch_state_dict()["state"], torchs.state_dict()["state"]
    for i, st in want.items():
        for key, value in st.items():
            torch.testing.assert_close(saved[i][key].to(value.dtype), value)
