"""The C backend's step through its native operator (``vega_c::step``, ``native.cpp``) gives
bitwise what the Python path (ctypes, the same kernels) gives, step after step, whatever
changes between steps; the class step gives bitwise what the functional step gives."""
import contextlib
import copy
import functools

import pytest
import torch

import vega
from vega.codegen import c as c_backend
from vega.codegen.c import native

pytestmark = pytest.mark.skipif(
    not c_backend.available() or native._paths() is None,
    reason="needs a C and a C++ compiler")

SPECS = {"sgd": {"momentum": 0.9, "weight_decay": 0.01}, "adam": {}, "adamw": {},
         "radam": {}, "lamb": {}, "lars": {"lr": 0.1}, "lion": {}, "adagrad": {},
         "rmsprop": {"momentum": 0.5}, "adan": {}, "adafactor": {},
         # states of one number per tensor (a 0-d tensor each): the operator's checks and
         # tables take them; prodigy's reductions over the group run the staged step
         "nadam": {}, "novograd": {}, "schedule_free_adamw": {}, "prodigy": {"d0": 1e-3}}
SHAPES = [(33,), (4, 5), (), (1,), (0,), (7, 3), (1000,)]


@pytest.fixture(autouse=True)
def operator():
    found = native.module(wait=True)
    assert found is not None, native.status()
    return found


@contextlib.contextmanager
def python_path():
    """Steps here go the Python way: as where the operator cannot be built."""
    real = native.module
    native.module = lambda wait=None: None
    try:
        yield
    finally:
        native.module = real


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
            for s in SHAPES]


class _Twin:
    """An optimizer stepped on the Python path."""

    def __init__(self, opt):
        self.opt = opt

    def step(self):
        with python_path():
            self.opt.step()

    def __getattr__(self, name):
        return getattr(self.opt, name)


def _twins(name, dtype, **extra):
    """Two optimizers over equal parameters: the first steps through the native operator,
    the second on the Python path; ``native`` records, for each step of the first, whether
    every C backend call of it went through the operator."""
    cls = getattr(vega.optim, vega.builtin(name).class_name)
    ours, theirs = _params(dtype), _params(dtype)
    opt = cls(ours, **SPECS[name], **extra)
    twin = _Twin(cls(theirs, **SPECS[name], **copy.deepcopy(extra)))
    native_steps, calls = [], []
    real_step, real_python = opt.step, c_backend.Kernel._python_step
    real_tables = c_backend.Kernel._tables  # (the Python path's tables: a staged step's too)

    def step():
        calls.clear()
        c_backend.Kernel._python_step = lambda self, *a: calls.append(False) or real_python(
            self, *a)
        c_backend.Kernel._tables = lambda self, *a, **k: calls.append(False) or real_tables(
            self, *a, **k)
        try:
            real_step()
        finally:
            c_backend.Kernel._python_step = real_python
            c_backend.Kernel._tables = real_tables
        native_steps.append(not calls)
    opt.step = step
    return ours, theirs, opt, twin, native_steps


def _grads(ours, theirs, step, scale=1.0, bad=False):
    gen = torch.Generator().manual_seed(100 + step)
    for p, q in zip(ours, theirs):
        g = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.dtype)
        if bad and p.numel() > 1:
            g.view(-1)[1] = float("inf")
        p.grad, q.grad = g, g.clone()  # new gradient tensors, as set_to_none leaves


def _equal(ours, theirs, opt, twin):
    for p, q in zip(ours, theirs):
        assert torch.equal(p.detach(), q.detach())
        a, b = opt.state.get(p, {}), twin.state.get(q, {})
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    if opt.loss_scale is not None:
        for x, y in zip(opt.loss_scale.tensors(), twin.loss_scale.tensors()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", SPECS)
def test_native_steps_equal_the_python_path_bitwise(name, dtype):
    ours, theirs, opt, twin, direct = _twins(name, dtype)
    for step in range(6):
        _grads(ours, theirs, step)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [True] * 6


SCHEDULES = {
    "cosine_decay": lambda: vega.schedule.cosine_decay(1e-2, 10),
    "warmup_cosine_decay": lambda: vega.schedule.warmup_cosine_decay(0.0, 1e-2, 3, 10),
    "a plain callable": lambda: (lambda step: 1e-2 / (1.0 + step.double())),
    "a tensor": lambda: torch.tensor(3e-3, dtype=torch.float64),
}


@pytest.mark.parametrize("lr", SCHEDULES)
@pytest.mark.parametrize("name", ["adamw", "lion", "lamb"])
def test_native_steps_with_a_schedule_equal_the_python_path(name, lr):
    ours, theirs, opt, twin, direct = _twins(name, torch.float32, lr=SCHEDULES[lr]())
    for step in range(6):
        _grads(ours, theirs, step)
        if step == 4:  # one parameter's counter falls behind: rows per counter
            opt.state[ours[2]]["step"].fill_(0)
            twin.state[theirs[2]]["step"].fill_(0)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [True] * 6


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
def test_native_fused_steps_skip_and_clip_as_the_python_path(name):
    ours, theirs, opt, twin, direct = _twins(
        name, torch.float32, max_grad_norm=0.5,
        loss_scale=vega.LossScale.dynamic(init=2.0 ** 10, growth_interval=2))
    for step in range(8):
        _grads(ours, theirs, step, scale=2.0 ** 10, bad=step == 4)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [True] * 8
    assert float(opt.loss_scale.loss_scale) != 2.0 ** 10  # it grew, and fell at the skip


def _replace_state(opt, ps, name):
    st = opt.state[ps[1]]
    st[name] = torch.full_like(st[name], 0.25)


CHANGES = {
    "a parameter moves to new memory": lambda opt, ps: setattr(ps[0], "data",
                                                             ps[0].data.clone()),
    "a parameter becomes float64": lambda opt, ps: setattr(ps[0], "data", ps[0].data.double()),
    "a state dict is replaced": lambda opt, ps: opt.state.__setitem__(ps[1], {}),
    "a state dict is removed": lambda opt, ps: opt.state.pop(ps[6]),
    "a state tensor is replaced": lambda opt, ps: _replace_state(opt, ps, "v"),
    "a step counter is replaced": lambda opt, ps: _replace_state(opt, ps, "step"),
    "the learning rate changes": lambda opt, ps: opt.param_groups[0].__setitem__("lr", 0.05),
    "the learning rate becomes a schedule": lambda opt, ps: opt.param_groups[0].__setitem__(
        "lr", vega.schedule.cosine_decay(0.1, 10)),
    "the learning rate becomes a tensor": lambda opt, ps: opt.param_groups[0].__setitem__(
        "lr", torch.tensor(0.03, dtype=torch.float64)),
    "momentum is turned off": lambda opt, ps: opt.param_groups[0].__setitem__("momentum", 0.0),
    "the backend changes": lambda opt, ps: opt.param_groups[0].__setitem__("backend",
                                                                          "reference"),
    "clipping is turned on": lambda opt, ps: setattr(opt, "max_grad_norm", 0.1),
    "a parameter is appended to the group": lambda opt, ps: opt.param_groups[0][
        "params"].append(torch.nn.Parameter(torch.ones(5))),
    "a group is added": lambda opt, ps: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.ones(3))]}),
    "the group's parameters become a tuple": lambda opt, ps: opt.param_groups[0].__setitem__(
        "params", tuple(opt.param_groups[0]["params"])),
    "the state is loaded back": lambda opt, ps: opt.load_state_dict(
        copy.deepcopy(opt.state_dict())),
}


PYTHON_WAY = {"the backend changes"}  # (the reference backend: no C step at all)


def _all_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("change", CHANGES)
def test_each_change_is_followed_as_on_the_python_path(change):
    ours, theirs, opt, twin, direct = _twins("sgd", torch.float32)
    for step in range(6):
        if step == 3:
            CHANGES[change](opt, ours)
            CHANGES[change](twin.opt, theirs)
        _grads(ours, theirs, step)
        for extra, twin_extra in zip(_all_params(opt)[len(ours):],
                                     _all_params(twin)[len(theirs):]):
            extra.grad, twin_extra.grad = torch.ones_like(extra), torch.ones_like(twin_extra)
        opt.step()
        twin.step()
        _equal(_all_params(opt), _all_params(twin), opt, twin)
    assert direct == [True] * 6


@pytest.mark.parametrize("grads", ["missing", "not contiguous", "float64", "sparse"])
def test_gradients_of_any_layout_and_dtype_step_as_on_the_python_path(grads):
    """A gradient that is not contiguous is refused by the operator and stepped as a
    contiguous copy; a float64 gradient of a float32 parameter is a dtype group of its own,
    whose library is built when first met."""
    ours, theirs, opt, twin, direct = _twins("adamw", torch.float32)
    for step in range(5):
        _grads(ours, theirs, step)
        if step == 3:
            for p in (ours[5], theirs[5]):
                g = p.grad
                if grads == "float64" and hasattr(p, "grad_dtype"):
                    p.grad_dtype = None  # (torch 2.13 refuses another dtype by default)
                p.grad = {"missing": None, "not contiguous": g.t().contiguous().t(),
                          "float64": g.double(), "sparse": g.to_sparse()}[grads]
        if grads == "sparse" and step == 3:
            for o in (opt, twin):
                with pytest.raises(ValueError, match="does not support sparse gradients: the "
                                       "gradient of parameter 5 of group 0 is torch.sparse_coo"):
                    o.step()
            _equal(ours, theirs, opt, twin)
            continue
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    if grads == "sparse":  # (the refused step records nothing)
        assert direct == [True] * 4
    else:
        assert direct == [True] * 3 + [grads != "not contiguous", True]


@pytest.mark.parametrize("change", ["none", "a float64 parameter", "a gradient not contiguous"])
def test_a_staged_step_takes_its_tables_from_the_operator(change):
    """Prodigy's reductions over the group run its kernels phase by phase (``staged``): the
    operator checks its tensors and builds its tables (``tables``), one a dtype group, each
    with its parameters' positions; what it refuses (a gradient not contiguous) is stepped
    on contiguous copies, as the Python path steps it."""
    ours, theirs, opt, twin, direct = _twins("prodigy", torch.float32)
    if change == "a float64 parameter":  # (two dtype groups: positions 1, and the others)
        ours[1].data, theirs[1].data = ours[1].data.double(), theirs[1].data.double()
    for step in range(5):
        _grads(ours, theirs, step)
        if step == 3 and change == "a gradient not contiguous":
            for p in (ours[5], theirs[5]):
                p.grad = p.grad.t().contiguous().t()
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [True] * 3 + [change != "a gradient not contiguous", True]


@pytest.mark.parametrize("way", ["operator", "python"])
def test_a_staged_step_reads_a_gradient_not_contiguous_as_its_copy(way):
    """A gradient that is not contiguous is stepped as a contiguous copy, which lives until
    the last of a staged step's kernels has read it (its table holds only its address): the
    same step, bit for bit, as with the contiguous gradient."""
    runs = []
    for layout in ("contiguous", "transposed"):
        params = _params(torch.float32)
        opt = vega.optim.Prodigy(params, **SPECS["prodigy"])
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            if layout == "transposed" and step == 2:
                params[5].grad = params[5].grad.t().contiguous().t()
                assert not params[5].grad.is_contiguous()
            with python_path() if way == "python" else contextlib.nullcontext():
                opt.step()
        runs.append((params, opt))
    (ps, opt), (qs, twin) = runs
    _equal(ps, qs, opt, twin)


@pytest.mark.parametrize("name", ["adamw", "prodigy"])
def test_a_step_of_ten_dtype_groups_builds_every_library(name):
    """States set by hand to ten different pairs of dtypes: ten dtype groups in one step,
    each a library built when the operator first asks for it (however many it asks for),
    stepped as the Python path steps them."""
    ours, theirs, opt, twin, direct = _twins(name, torch.float32)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
    pairs = [(a, b) for a in dtypes for b in dtypes if (a, b) != (torch.float32,) * 2][:10]
    ours += [torch.nn.Parameter(torch.randn(10)) for _ in pairs]
    theirs += [q.detach().clone().requires_grad_() for q in ours[-len(pairs):]]
    for o, ps in ((opt, ours), (twin.opt, theirs)):
        o.param_groups[0]["params"] += ps[-len(pairs):]
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
        twin.step()
        if step == 0:
            for ps, o in ((ours, opt), (theirs, twin.opt)):
                for q, (a, b) in zip(ps[-len(pairs):], pairs):
                    st = o.state[q]
                    st["mu"], st["nu"] = st["mu"].to(a), st["nu"].to(b)
        _equal(ours, theirs, opt, twin)
    assert direct == [True] * 3


def test_the_python_paths_plan_takes_no_scales_of_another_shape(monkeypatch):
    """The Python path's tables of a recent call serve again for tensors at the same
    addresses and of the same lengths; an 8-bit state's scales made a row (a view: the same
    address and length) are not taken for them, but refused by name."""
    from vega.runtime import engine
    p = torch.nn.Parameter(torch.randn(64, 100))
    opt = vega.optim.AdamW([p], state_dtype=torch.uint8)
    calls = []
    real = engine.run
    monkeypatch.setattr(engine, "run", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    p.grad = torch.randn(64, 100)
    opt.step()
    (program, backend, params, grads, states, steps, values), kw = calls[-1]
    scales = program.state_names.index("mu_absmax")
    with python_path():
        real(program, backend, params, grads, states, steps, values, **kw)
        states[scales] = [x[None] for x in states[scales]]
        before = p.detach().clone()
        with pytest.raises(ValueError, match=r"state 'mu_absmax' of parameter 0 has shape "
                                             r"\(1, 25\)"):
            real(program, backend, params, grads, states, steps, values, **kw)
    assert torch.equal(p.detach(), before)


def test_the_operators_staged_tables_are_the_python_paths(monkeypatch):
    """``tables`` (the operator's rows of a staged step) holds, row for row, what the Python
    path's ``_tables`` holds: the same library, addresses and lengths, each dtype group's
    parameters at the same positions."""
    params = _params(torch.float32)
    for k in (1, 4):
        params[k].data = params[k].data.double()
    opt = vega.optim.Prodigy(params, **SPECS["prodigy"])
    asked = []
    real = c_backend.Kernel._native_tables
    monkeypatch.setattr(c_backend.Kernel, "_native_tables",
                        lambda self, *a: asked.append((self, a)) or real(self, *a))
    for step in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    kernel, args = asked[-1]
    ours, theirs = real(kernel, *args), kernel._tables(*args)
    assert len(ours) == len(theirs) == 2
    for (lib, table, red, idx), (lib2, table2, red2, idx2) in zip(ours, theirs):
        assert lib is lib2 and list(idx) == list(idx2)
        assert table.dtype == table2.dtype == torch.int64 and torch.equal(table, table2)
        assert red.shape == red2.shape and red.dtype == red2.dtype
    assert sorted(i for *_, idx in ours for i in idx) == list(range(len(params)))


def test_a_state_tensor_resized_in_place_is_refused_not_written_past():
    ours, theirs, opt, twin, direct = _twins("adamw", torch.float32)
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
    before = [p.detach().clone() for p in ours]
    opt.state[ours[6]]["mu"].resize_(10)  # the same tensor object, now too small
    _grads(ours, theirs, 3)
    with pytest.raises(ValueError, match="state 'mu'"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))  # nothing stepped


@contextlib.contextmanager
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _many(seed=0):
    """150 parameters of three dtypes, in turn, 45,000 elements in all: the operator checks
    them on two threads (more than ``APART_MIN`` tensors, ``APART_ELEMENTS`` elements)."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    return [torch.nn.Parameter(torch.randn(296 + k % 9, generator=gen, dtype=torch.float64)
                               .to(dtypes[k % 3])) for k in range(150)]


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_many_tensors_checked_on_two_threads_step_as_on_the_python_path(name):
    """With more parameters than ``APART_MIN``, the operator checks the tensors and reads
    their addresses on two threads (this one and a helper), then builds each dtype group's
    table in order: the same steps as the Python path's, bit for bit."""
    cls = getattr(vega.optim, vega.builtin(name).class_name)
    ours, theirs = _many(), _many()
    opt, twin = cls(ours, max_grad_norm=1.0), _Twin(cls(theirs, max_grad_norm=1.0))
    calls, real_python = [], c_backend.Kernel._python_step
    c_backend.Kernel._python_step = lambda self, *a: calls.append(1) or real_python(self, *a)
    try:
        with two_threads():
            for step in range(3):
                _grads(ours, theirs, step)
                opt.step()
                twin.step()
    finally:
        c_backend.Kernel._python_step = real_python
    assert calls == [1] * 3  # the twin's three steps: none of ours
    _equal(ours, theirs, opt, twin)


def test_checked_on_two_threads_where_the_kernels_run_on_them(operator):
    """A step is checked on two threads only where its kernels run on two threads anyway:
    the operator's bound is the kernels' ``PAR_MIN``."""
    source = c_backend.Kernel(vega.builtin("adamw").program()).source()
    assert f"#define PAR_MIN {operator.APART_ELEMENTS} " in source


@pytest.mark.parametrize("wrong", [(1990, 2000), (10, 3990)])
def test_checked_on_two_threads_the_first_wrong_tensor_is_named(operator, wrong):
    """Where tensors of both threads' halves are wrong, the error names the first, as one
    thread checking them in order names it: whether the second half's is found first
    (1990 and 2000 of 4,000) or last (10 and 3990)."""
    kernel = c_backend.Kernel(vega.builtin("adamw").program())
    kernel._registered(operator)
    n = 4000
    params = [torch.zeros(16) for _ in range(n)]
    grads = [torch.zeros(16) for _ in range(n)]
    mus = [torch.zeros(2) if i in wrong else torch.zeros(16) for i in range(n)]
    nus = [torch.zeros(16) for _ in range(n)]
    steps = [torch.zeros((), dtype=torch.int32) for _ in range(n)]
    with two_threads():
        for _ in range(10):
            with pytest.raises(ValueError,
                               match=f"state 0 of parameter {wrong[0]} has the wrong shape"):
                operator.step(kernel.id, params, grads, mus + nus, steps, list(range(n)),
                              [torch.zeros(8, dtype=torch.float64)], [0] * n, None, [], [])
    assert all(torch.equal(t, torch.zeros(16)) for t in params)
    assert all(int(t) == 0 for t in steps)


@pytest.mark.parametrize("wrong", [None, "a state's shape", "two states share memory"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_operator_advances_the_versions_of_a_step_it_takes(operator, wrong, threads):
    """The eager call advances each parameter's version counter once, after every tensor is
    checked and its libraries found, before the kernels run (``step_impl``'s ``bump``); a step
    it refuses (the last parameter's state of the wrong shape, two of its states one tensor,
    a library not built yet) leaves every version as it was. On one thread and on two
    (``APART_MIN`` tensors and more)."""
    kernel = c_backend.Kernel(vega.builtin("adamw").program())
    kernel._registered(operator)
    n = 200
    params, grads = [torch.zeros(300) for _ in range(n)], [torch.ones(300) for _ in range(n)]
    mus, nus = [torch.zeros(300) for _ in range(n)], [torch.zeros(300) for _ in range(n)]
    if wrong == "a state's shape":
        mus[-1] = torch.zeros(3)
    elif wrong is not None:
        nus[-1] = mus[-1]
    steps = [torch.zeros((), dtype=torch.int32) for _ in range(n)]
    args = (params, grads, mus + nus, steps, list(range(n)),
            [torch.full((8,), 0.1, dtype=torch.float64)], [0] * n, None, [], [])
    before = [p._version for p in params]
    with two_threads() if threads == 2 else contextlib.nullcontext():
        # (refused: its tensors; or, the first time, its library not yet built)
        with pytest.raises(ValueError if wrong else operator.MissingLibrary):
            operator.step(kernel.id, *args)
        assert [p._version for p in params] == before
        assert all(int(t) == 0 for t in steps) and all(not p.any() for p in params)
        if wrong:
            return
        kernel._native_call(operator, operator.step, *args)  # (builds it, calls again)
    assert [p._version for p in params] == [v + 1 for v in before]
    assert all(int(t) == 1 for t in steps) and all(p.any() for p in params)


def test_tensors_that_share_memory_are_refused_after_others_stepped_in_turn(operator):
    """The operator keeps the spans of its last few calls that shared no memory, not to sort
    them again (``any_shared``): optimizers that take turns keep theirs, and tensors that
    share memory are refused still, whether of one of them or the same spans over again."""
    kernel = c_backend.Kernel(vega.builtin("adamw").program())
    kernel._registered(operator)

    def lists(n):
        return ([torch.zeros(8) for _ in range(n)], [torch.ones(8) for _ in range(n)],
                [torch.zeros(8) for _ in range(2 * n)],
                [torch.zeros((), dtype=torch.int32) for _ in range(n)])

    def step(params, grads, states, steps):
        n = len(params)
        kernel._native_call(operator, operator.step, params, grads, states, steps,
                            list(range(n)), [torch.full((8,), 0.1, dtype=torch.float64)],
                            [0] * n, None, [], [])

    turns = [lists(n) for n in (3, 3, 4, 5, 3, 6)]  # (more than are kept)
    for _ in range(3):
        for args in turns:
            step(*args)
    params, grads, states, steps = turns[0]
    for shared in ([*states[:4], states[3], states[5]],  # two states of one tensor
                   [*states[:3], params[0], *states[4:]]):  # a state its parameter
        before = [p.clone() for p in params]
        with pytest.raises(ValueError, match="share memory"):
            step(params, grads, shared, steps)
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert all(int(t) == 3 for t in steps)
    step(params, grads, states, steps)  # (its own again: taken)
    assert all(int(t) == 4 for t in steps)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_class_step_is_the_functional_step_bitwise(name):
    """``vega.optim.<Class>.step()`` gathers each group's tensors and calls what
    ``vega.<name>_step`` calls: the same parameters and state, bit for bit."""
    spec = vega.builtin(name)
    cls = getattr(vega.optim, spec.class_name)
    params = _params(torch.float32)
    opt = cls(params, **SPECS[name], max_grad_norm=1.0)
    flat = {str(k): p.detach().clone() for k, p in enumerate(_params(torch.float32))}
    state = spec.init(flat, **SPECS[name])
    for step in range(4):
        gen = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        flat, state = spec.step(flat, {str(k): g for k, g in enumerate(grads)}, state,
                                **SPECS[name], max_grad_norm=1.0)
    for k, p in enumerate(params):
        assert torch.equal(p.detach(), flat[str(k)]), k
        assert opt.state[p].keys() == state.keys()
        for s, tree in state.items():  # (the functional step counts on one 0-d tensor)
            leaf = tree if isinstance(tree, torch.Tensor) else tree[str(k)]
            assert torch.equal(opt.state[p][s], leaf), (k, s)


def test_the_operator_is_registered_with_its_mutations():
    """``vega_c::step`` and ``vega_c::prelude`` are torch operators whose schemas mark what
    they write."""
    schema = torch.ops.vega_c.step.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
    assert written == {"params", "states", "steps", "pre", "outs"}
    schema = torch.ops.vega_c.prelude.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None
            and a.alias_info.is_write} == {"pre"}


def test_the_operator_refuses_lists_that_do_not_match(operator):
    kernel = c_backend.Kernel(vega.builtin("adamw").program())
    kernel._registered(operator)
    p, g = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="the lists of a step do not match"):
        operator.step(kernel.id, [p], [g, g], [p.clone(), p.clone()], [torch.zeros((),
                      dtype=torch.int32)], [0], [torch.zeros(8, dtype=torch.float64)], [0],
                      None, [], [])
    with pytest.raises(ValueError, match="a step counter must be a 0-d int32"):
        operator.step(kernel.id, [p], [g], [p.clone(), p.clone()], [torch.zeros(1)], [0],
                      [torch.zeros(8, dtype=torch.float64)], [0], None, [], [])
    assert torch.equal(p, torch.zeros(3))
    with pytest.raises(RuntimeError, match="was released"):
        operator.step(10 ** 9, [p], [g], [], [], [0], [], [0], None, [], [])


def test_no_private_layout_is_read():
    """Nothing in the package reads torch's private tensor layout. The native operator names
    a tensor's object only through torch's public accessors, to ask the cache for it ahead of
    its checks (``prefetch_tensor``, ``prefetch_storage``, and p.grad's metadata and tensor in
    ``gather``, through the tensor's public ``grad()``, which does not warn as ``Tensor::grad``
    does for a tensor that is not a leaf): ``unsafeGetTensorImpl()``,
    ``sizeof(c10::TensorImpl)``, and nothing else."""
    import pathlib
    import re
    root = pathlib.Path(vega.__file__).parent
    lines = [(path, line.strip()) for path in sorted(root.rglob("*"))
             if path.suffix in (".py", ".cpp", ".c", ".h", ".j2")
             for line in path.read_text().splitlines()]
    hints = ("unsafeGetTensorImpl()", "sizeof(c10::TensorImpl)")
    found = [f"{path}: {line}" for path, line in lines
             if re.search(r"_cdata|__basicsize__", line)
             or "TensorImpl" in functools.reduce(lambda text, h: text.replace(h, ""), hints, line)]
    assert found == []
    # (and those only where a prefetch asks for what they point at)
    uses = [line for _, line in lines if "unsafeGetTensorImpl()" in line]
    assert uses and all("prefetch" in line or line.endswith(("autograd_meta());", "->grad();"))
                        for line in uses), uses
