"""Properties every shipped spec keeps, under every setting of its bool hyperparameters.

Dtypes, the shape of the state, purity and donation, the step counter, kernel
reuse, non-float leaves, and the optimizer classes' state_dict round trip.
"""
import io

import pytest
import torch
from torch.utils import _pytree as pytree

import vega
import vega.codegen

SHAPES = {"w": (5, 7), "b": (7,), "s": ()}
# Non-default values for the float hyperparameters a spec has (data, not name branches):
# momentum and weight decay switched on, so the state and the decay term matter.
FLOAT_HYPERS = {"lr": 3e-2, "momentum": 0.7, "weight_decay": 0.05}

SETTINGS = [(name, flags) for name in vega.builtin_names()
            for flags in vega.builtin(name)._spec.flag_settings()]


def _id(setting):
    name, flags = setting
    return "-".join([name, *(f"{k}={v}" for k, v in flags.items())])


@pytest.fixture(params=SETTINGS, ids=[_id(s) for s in SETTINGS])
def setting(request):
    """(compiled spec, hyperparameters): the flags of this setting plus FLOAT_HYPERS."""
    name, flags = request.param
    spec = vega.builtin(name)
    hypers = {k: v for k, v in FLOAT_HYPERS.items() if k in spec.defaults}
    return spec, {**hypers, **flags}


def make_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen).to(dtype) for k, shape in SHAPES.items()}


def make_grads(dtype, seed=1):
    return make_params(dtype, seed)


def state_leaves(spec, hypers) -> dict[str, list[str]]:
    """Each state field and the leaves that hold it: every leaf, except where a spec's
    programs differ by shape (muon's matrices keep buf, its vectors mu and nu; the state
    holds None for a leaf without the field)."""
    out: dict[str, list[str]] = {}
    for k, shape in SHAPES.items():
        program = spec.program(shape=shape, **{h.name: hypers[h.name] for h in spec.hypers
                                               if h.name in hypers})
        for field in program.state_names:
            out.setdefault(field, []).append(k)
    return out


def named_tensors(tree) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor leaf, e.g. ``("[1]['mu']['w']", tensor)``."""
    pairs, _ = pytree.tree_flatten_with_path(tree)
    return [(pytree.keystr(path), x) for path, x in pairs if isinstance(x, torch.Tensor)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, so that comparisons see -0.0, NaN payloads and all."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str):
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(f"{what}: {actual.dtype}{tuple(actual.shape)}, expected "
                             f"{expected.dtype}{tuple(expected.shape)}")
    if torch.equal(bits(actual), bits(expected)):
        return
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    differ = (a != e) | (a.isnan() != e.isnan())
    first = int(differ.nonzero()[0]) if differ.any() else 0
    raise AssertionError(f"{what}: {int(differ.sum())} of {a.numel()} element(s) differ "
                         f"bitwise; first at flat index {first}: {a[first].item()!r} against "
                         f"{e[first].item()!r}")


def clone_tree(tree):
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


# -- dtypes ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_float_dtype_is_preserved(setting, dtype):
    spec, hypers = setting
    params = make_params(dtype)
    state = spec.init(params, **hypers)
    for _ in range(2):
        params, state = spec.step(params, make_grads(dtype), state, **hypers)
        assert {k: v.dtype for k, v in params.items()} == {k: dtype for k in SHAPES}
        for field, keys in state_leaves(spec, hypers).items():
            assert {k: state[field][k].dtype for k in keys} == {k: dtype for k in keys}, field
        assert state["step"].dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_params_stay_half_with_float32_state(setting, dtype):
    spec, hypers = setting
    params = make_params(dtype)
    state = spec.init(params, **hypers)
    held = state_leaves(spec, hypers)
    for _ in range(2):
        for field, keys in held.items():
            assert {k: state[field][k].dtype for k in keys} == {
                k: torch.float32 for k in keys}, field
        params, state = spec.step(params, make_grads(dtype), state, **hypers)
        assert {k: v.dtype for k, v in params.items()} == {k: dtype for k in SHAPES}
        assert all(torch.isfinite(v).all() for v in params.values())
    for field, keys in held.items():
        assert {k: state[field][k].dtype for k in keys} == {k: torch.float32 for k in keys}


# -- the state's structure -------------------------------------------------------------

def test_state_structure_is_stable_across_steps(setting):
    spec, hypers = setting
    params = make_params(torch.float32)
    state = spec.init(params, **hypers)
    held = state_leaves(spec, hypers)
    assert set(state) == {*held, "step"}
    expected = [f"{f}.{k}" for f in state if f != "step" for k in SHAPES
                if k in held[f]] + ["step"]
    assert vega.state_names(state) == expected
    structure = pytree.tree_structure(state)
    for _ in range(3):
        params, state = spec.step(params, make_grads(torch.float32), state, **hypers)
        assert vega.state_names(state) == expected
        assert pytree.tree_structure(state) == structure
        assert pytree.tree_structure(params) == pytree.tree_structure(make_params(torch.float32))


# -- purity and donation ---------------------------------------------------------------

def test_pure_step_leaves_inputs_untouched_and_returns_new_tensors(setting):
    spec, hypers = setting
    params, grads = make_params(torch.float32), make_grads(torch.float32)
    state = spec.init(params, **hypers)
    params, state = spec.step(params, grads, state, **hypers)  # a non-trivial state
    inputs = named_tensors({"params": params, "grads": grads, "state": state})
    before = [x.clone() for _, x in inputs]
    new_params, new_state = spec.step(params, grads, state, **hypers)
    for (name, x), b in zip(inputs, before):
        assert_same_bits(x, b, f"a pure step changed its input {name}")
    outputs = named_tensors({"params": new_params, "state": new_state})
    assert len(outputs) == len(named_tensors({"params": params, "state": state}))
    in_ids, in_ptrs = {id(x) for _, x in inputs}, {x.data_ptr() for _, x in inputs}
    for name, out in outputs:
        assert id(out) not in in_ids, f"a pure step returned one of its inputs as {name}"
        assert out.data_ptr() not in in_ptrs, f"a pure step's {name} shares an input's memory"
    assert any(not torch.equal(new_params[k], params[k]) for k in SHAPES), "nothing stepped"


# new values that are inputs (s = p, the old p; k = g) or each other's (v = m)
ALIASING = """optimizer aliasing(lr = 0.5, b = 0.5) {
    state s = zeros
    state m = zeros
    state v = zeros
    state k = zeros
    s = p
    m = b * m + g
    v = m
    k = g
    p = p - lr * m
}"""


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_new_value_that_is_an_input_or_another_output(backend):
    """Donated, a state set to the old p gets the old p, not the one just written; pure,
    every output is a tensor of its own, none an input."""
    spec = vega.compile(ALIASING)
    params, grads = make_params(torch.float32), make_grads(torch.float32)
    state = spec.init(params)
    new_p, new_s = spec.step(params, grads, state, backend=backend)
    for k in SHAPES:
        assert_same_bits(new_s["s"][k], params[k], f"pure s.{k}")
        assert_same_bits(new_s["v"][k], new_s["m"][k], f"pure v.{k}")
        assert_same_bits(new_s["k"][k], grads[k], f"pure k.{k}")
    inputs = named_tensors({"params": params, "grads": grads, "state": state})
    outputs = named_tensors({"params": new_p, "state": new_s})
    ptrs = {x.data_ptr() for _, x in inputs}
    for name, x in outputs:
        assert x.data_ptr() not in ptrs, f"the pure step's {name} is an input's memory"
    assert len({x.data_ptr() for _, x in outputs}) == len(outputs), "outputs share memory"
    donated_p, donated_s = spec.step({k: v.clone() for k, v in params.items()}, grads,
                                     pytree.tree_map(torch.clone, state), backend=backend,
                                     donate=True)
    for (name, x), (_, y) in zip(named_tensors((donated_p, donated_s)),
                                 named_tensors((new_p, new_s))):
        assert_same_bits(x, y, f"donated against pure {name}")


# new values that are views of an input: col_sum of a vector (no row axis: the vector
# itself) and a per-row state spread over the elements
VIEWS = """optimizer views(lr = 0.5) {
    state a: rows = ones
    state b = zeros
    state s = zeros
    s = col_sum(p)
    b = a
    a = row_max(g)
    p = p - lr * g
}"""


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_new_value_that_is_a_view_of_an_input(backend):
    spec = vega.compile(VIEWS)
    params = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    grads = {"w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    for donate in (False, True):
        p = {"w": params["w"].clone()}
        new_p, new_s = spec.step(p, grads, spec.init(p), backend=backend, donate=donate)
        assert new_s["s"]["w"].tolist() == [1.0, 2.0], donate  # the old p
        assert new_s["b"]["w"].tolist() == [1.0, 1.0], donate  # the old a
        assert new_s["a"]["w"].tolist() == 4.0 and new_p["w"].tolist() == [-0.5, 0.0]


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_donated_transposed_tensors_step_bitwise_as_pure(backend):
    """Reductions over a transposed parameter sum in the same order donated (the tensor
    stays transposed) and pure (each step returns contiguous tensors)."""
    spec = vega.compile("""optimizer o(lr = 0.1) {
        state s = zeros
        s = s + g * sum(p * g)
        p = p - lr * s * norm(p)
    }""")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(300, 200, generator=gen, dtype=torch.float64)
    pure = ({"w": base.t()}, spec.init({"w": base.t()}))
    donated = ({"w": base.clone().t()}, spec.init({"w": base.t()}))
    for step in range(3):
        grads = {"w": torch.randn(300, 200, generator=gen, dtype=torch.float64).t()}
        pure = spec.step(pure[0], grads, pure[1], backend=backend)
        spec.step(donated[0], grads, donated[1], backend=backend, donate=True)
        assert_same_bits(donated[0]["w"], pure[0]["w"], f"step {step} p")
        assert_same_bits(donated[1]["s"]["w"], pure[1]["s"]["w"], f"step {step} s")


def test_donated_step_updates_in_place_with_the_pure_values(setting):
    spec, hypers = setting
    params = make_params(torch.float32)
    state = spec.init(params, **hypers)
    pure_params, pure_state = clone_tree(params), clone_tree(state)
    for seed in (1, 2):
        grads = make_grads(torch.float32, seed)
        pure_params, pure_state = spec.step(pure_params, grads, pure_state, **hypers)
        inputs = named_tensors({"params": params, "state": state})
        ptrs = [x.data_ptr() for _, x in inputs]
        params, state = spec.step(params, grads, state, donate=True, **hypers)
        outputs = named_tensors({"params": params, "state": state})
        assert [n for n, _ in outputs] == [n for n, _ in inputs]
        for (name, i), (_, o), ptr in zip(inputs, outputs, ptrs):
            assert o is i, f"step {seed}: a donated step did not return the given {name}"
            assert o.data_ptr() == ptr, f"step {seed}: {name} moved"
        pure = named_tensors({"params": pure_params, "state": pure_state})
        for (name, o), (_, want) in zip(outputs, pure):
            assert_same_bits(o, want, f"step {seed}: donated and pure {name}")


# -- the step counter -------------------------------------------------------------------

@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_step_counter_is_int32_and_counts_updates(setting, donate):
    spec, hypers = setting
    params = make_params(torch.float32)
    state = spec.init(params, **hypers)
    assert state["step"].dtype == torch.int32 and state["step"].dim() == 0
    assert int(state["step"]) == 0
    for k in range(1, 4):
        params, state = spec.step(params, make_grads(torch.float32, k), state, donate=donate,
                                  **hypers)
        assert state["step"].dtype == torch.int32 and state["step"].dim() == 0
        assert int(state["step"]) == k


# -- the compiled kernel is built once ----------------------------------------------------

def test_second_step_reuses_the_compiled_kernel(setting):
    spec, hypers = setting
    params, grads = make_params(torch.float32), make_grads(torch.float32)
    state = spec.init(params, **hypers)
    params, state = spec.step(params, grads, state, **hypers)
    first = vega.codegen.kernel.cache_info()
    params, state = spec.step(params, grads, state, **hypers)
    second = vega.codegen.kernel.cache_info()
    assert second.misses == first.misses, "the second step compiled a kernel again"
    assert second.hits > first.hits, "the second step did not go through the kernel cache"


def test_optimizer_class_second_step_reuses_the_compiled_kernel(setting):
    spec, hypers = setting
    tensors = [p.requires_grad_(True) for p in make_params(torch.float32).values()]
    opt = spec.optimizer(tensors, **hypers)
    for p, g in zip(tensors, make_grads(torch.float32).values()):
        p.grad = g
    opt.step()
    first = vega.codegen.kernel.cache_info()
    before = [p.detach().clone() for p in tensors]
    opt.step()  # (direct: it needs no kernel look-up at all)
    second = vega.codegen.kernel.cache_info()
    assert second.misses == first.misses
    assert any(not torch.equal(p, b) for p, b in zip(tensors, before)), "it did not step"


# -- leaves that are not floats ------------------------------------------------------------

@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
@pytest.mark.parametrize("int_grad", ["none", "zeros"])
def test_non_float_leaves_pass_through(setting, donate, int_grad):
    spec, hypers = setting
    params = {**make_params(torch.float32), "idx": torch.arange(6, dtype=torch.int64)}
    start = clone_tree(params)
    state = spec.init(params, **hypers)
    names = vega.state_names(state)
    for seed in (1, 2):
        grads = {**make_grads(torch.float32, seed),
                 "idx": None if int_grad == "none" else torch.zeros(6, dtype=torch.int64)}
        params, state = spec.step(params, grads, state, donate=donate, **hypers)
        assert params["idx"].dtype == torch.int64 and torch.equal(params["idx"], start["idx"])
        assert vega.state_names(state) == names
        assert state["step"].dtype == torch.int32 and int(state["step"]) == seed
    assert all(not torch.equal(params[k], start[k]) for k in ("w", "b")), "floats did not step"


def test_state_names_name_only_tensors():
    """A state's leaf names are those a saved file stores: each one names a tensor
    (here with an int64 leaf among the parameters)."""
    wrong = []
    for name, flags in SETTINGS:
        spec = vega.builtin(name)
        params = {**make_params(torch.float32), "idx": torch.arange(6, dtype=torch.int64)}
        state = spec.init(params, **flags)
        for leaf_name in vega.state_names(state):
            field, _, key = leaf_name.partition(".")
            leaf = state[field][key] if key else state[field]
            if not isinstance(leaf, torch.Tensor):
                wrong.append(f"{_id((name, flags))}: {leaf_name!r} is {leaf!r}")
    assert not wrong, "state_names lists leaves that are not tensors: " + "; ".join(wrong)


def test_errors_name_the_right_leaf_after_a_none_leaf():
    """A None leaf before a parameter must not shift the names in error messages."""
    spec = vega.builtin(vega.builtin_names()[0])
    params = {"a": None, "b": torch.zeros(3)}
    state = spec.init(params)
    with pytest.raises(ValueError, match="grads leaf 'b'"):
        spec.step(params, {"a": None, "b": torch.zeros(4)}, state)


# -- torch.optim state_dict round trip ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_optimizer_state_dict_round_trip_continues_bitwise(setting, dtype):
    spec, hypers = setting
    grads = [make_grads(dtype, seed) for seed in range(1, 7)]

    def set_grads(tensors, g):
        for p, gv in zip(tensors, g.values()):
            p.grad = gv.clone()

    straight = [p.requires_grad_(True) for p in make_params(dtype).values()]
    opt = spec.optimizer(straight, **hypers)
    for g in grads[:3]:
        set_grads(straight, g)
        opt.step()

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [p.detach().clone().requires_grad_(True) for p in straight]
    opt2 = spec.optimizer(resumed, **hypers)
    opt2.load_state_dict(saved)
    for i, (p, q) in enumerate(zip(straight, resumed)):
        assert set(opt2.state[q]) == set(opt.state[p])
        assert opt2.state[q]["step"].dtype == torch.int32 and int(opt2.state[q]["step"]) == 3
        for key, value in opt.state[p].items():
            assert_same_bits(opt2.state[q][key], value, f"param {i}: state {key!r} on loading")

    for k, g in enumerate(grads[3:], start=4):
        set_grads(straight, g)
        opt.step()
        set_grads(resumed, g)
        opt2.step()
        for i, (p, q) in enumerate(zip(straight, resumed)):
            assert_same_bits(q.detach(), p.detach(), f"step {k}: resumed param {i}")
            for key, value in opt.state[p].items():
                assert_same_bits(opt2.state[q][key], value,
                                 f"step {k}: resumed param {i}'s state {key!r}")
    assert all(int(opt2.state[q]["step"]) == 6 and opt2.state[q]["step"].dtype == torch.int32
               for q in resumed)
