"""The optimizer classes' direct step (``SpecOptimizer._direct_step``: the C backend's tables
checked with the native scanner instead of per-tensor Python) gives bitwise what the Python
path gives, and each change between steps sends it back to the Python path."""
import copy

import pytest
import torch

import vega
from vega.codegen import c as c_backend
from vega.codegen import native

pytestmark = pytest.mark.skipif(
    not c_backend.available() or native._paths() is None,
    reason="needs a C and a C++ compiler")

# every shipped spec the direct step takes (adafactor's ifs read shapes: never direct)
SPECS = {"sgd": {"momentum": 0.9, "weight_decay": 0.01}, "adam": {}, "adamw": {},
         "radam": {}, "lamb": {}, "lars": {"lr": 0.1}, "lion": {}, "adagrad": {},
         "rmsprop": {"momentum": 0.5}, "adan": {}}
SHAPES = [(33,), (4, 5), (), (1,), (0,), (7, 3), (1000,)]


@pytest.fixture(autouse=True)
def scanner():
    found = native.scanner(wait=True)
    assert found is not None, native.status()
    return found


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
            for s in SHAPES]


def _twins(name, dtype, **extra):
    """Two optimizers over equal parameters: the first steps directly where it can, the
    second never does."""
    cls = getattr(vega.optim, vega.builtin(name).class_name)
    ours, theirs = _params(dtype), _params(dtype)
    opt = cls(ours, **SPECS[name], **extra)
    twin = cls(theirs, **SPECS[name], **copy.deepcopy(extra))
    twin._plan_direct = lambda work: None
    direct = []
    real = opt._direct_step
    opt._direct_step = lambda: direct.append(real()) or direct[-1]
    return ours, theirs, opt, twin, direct


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
def test_direct_steps_equal_the_python_path_bitwise(name, dtype):
    ours, theirs, opt, twin, direct = _twins(name, dtype)
    for step in range(6):
        _grads(ours, theirs, step)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [False] + [True] * 5  # the first step plans; the others are direct


SCHEDULES = {
    "cosine_decay": lambda: vega.schedule.cosine_decay(1e-2, 10),
    "warmup_cosine_decay": lambda: vega.schedule.warmup_cosine_decay(0.0, 1e-2, 3, 10),
    "a plain callable": lambda: (lambda step: 1e-2 / (1.0 + step.double())),
    "a tensor": lambda: torch.tensor(3e-3, dtype=torch.float64),
}


@pytest.mark.parametrize("lr", SCHEDULES)
@pytest.mark.parametrize("name", ["adamw", "lion", "lamb"])
def test_direct_steps_with_a_schedule_equal_the_python_path(name, lr):
    ours, theirs, opt, twin, direct = _twins(name, torch.float32, lr=SCHEDULES[lr]())
    for step in range(6):
        _grads(ours, theirs, step)
        if step == 4:  # one parameter's counter falls behind: rows per counter
            opt.state[ours[2]]["step"].fill_(0)
            twin.state[theirs[2]]["step"].fill_(0)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct == [False] + [True] * 5


@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
def test_direct_fused_steps_skip_and_clip_as_the_python_path(name):
    ours, theirs, opt, twin, direct = _twins(
        name, torch.float32, max_grad_norm=0.5,
        loss_scale=vega.LossScale.dynamic(init=2.0 ** 10, growth_interval=2))
    for step in range(8):
        _grads(ours, theirs, step, scale=2.0 ** 10, bad=step == 4)
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct.count(True) == 7
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


KEPT = {"the learning rate changes", "clipping is turned on",  # still direct
        "the group's parameters become a tuple", "the learning rate becomes a schedule",
        "the learning rate becomes a tensor"}
PYTHON_ONLY = {"the backend changes"}  # from then on


def _all_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("change", CHANGES)
def test_each_change_is_followed_as_on_the_python_path(change):
    ours, theirs, opt, twin, direct = _twins("sgd", torch.float32)
    for step in range(6):
        if step == 3:
            CHANGES[change](opt, ours)
            CHANGES[change](twin, theirs)
        _grads(ours, theirs, step)
        for extra, twin_extra in zip(_all_params(opt)[len(ours):],
                                     _all_params(twin)[len(theirs):]):
            extra.grad, twin_extra.grad = torch.ones_like(extra), torch.ones_like(twin_extra)
        opt.step()
        twin.step()
        _equal(_all_params(opt), _all_params(twin), opt, twin)
    assert direct[:3] == [False, True, True]
    # the change sent the step back to the Python path, which planned a direct step again
    assert direct[3] is (change in KEPT) and direct[5] is (change not in PYTHON_ONLY)


@pytest.mark.parametrize("grads", ["missing", "not contiguous", "float64", "sparse"])
def test_gradients_it_cannot_take_go_the_python_way(grads):
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
                with pytest.raises(ValueError, match="does not support sparse gradients"):
                    o.step()
            _equal(ours, theirs, opt, twin)
            continue
        opt.step()
        twin.step()
        _equal(ours, theirs, opt, twin)
    assert direct[3] is False and direct[1:3] == [True, True]


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
    assert direct[-1] is False
    assert all(torch.equal(p, b) for p, b in zip(ours, before))  # nothing stepped


def test_a_copied_or_loaded_optimizer_plans_its_own_direct_step():
    ours, theirs, opt, twin, direct = _twins("lion", torch.float32)
    for step in range(3):
        _grads(ours, theirs, step)
        opt.step()
        twin.step()
    copied = copy.deepcopy(opt)
    assert "_vega_direct" not in copied.__dict__
    assert type(copied.state).__name__ == "_StateDict"
    copied_ps = copied.param_groups[0]["params"]
    for step in range(3, 6):
        _grads(copied_ps, theirs, step)
        copied.step()
        twin.step()
        _equal(copied_ps, theirs, copied, twin)
    assert "_vega_direct" in copied.__dict__


def test_gradients_dropped_while_a_group_steps_are_still_read(monkeypatch):
    """The kernels run without the GIL: another thread may drop a gradient (zero_grad) while
    an earlier group's kernel runs. The direct step holds the gradients it scanned."""
    a = [torch.nn.Parameter(torch.zeros(1000))]
    b = [torch.nn.Parameter(torch.zeros(1000))]
    opt = vega.optim.SGD([{"params": a}, {"params": b}], lr=0.1)
    for _ in range(2):
        a[0].grad, b[0].grad = torch.ones(1000), torch.full((1000,), 3.0)
        opt.step()
    assert "_vega_direct" in opt.__dict__
    real = c_backend.Direct.launch
    launched = []

    def launch(self, *args):
        real(self, *args)
        if not launched:  # as another thread would, between the two groups' kernels
            b[0].grad = None
            launched.append([torch.full((1000,), 7.0) for _ in range(20)])
    monkeypatch.setattr(c_backend.Direct, "launch", launch)
    a[0].grad, b[0].grad = torch.ones(1000), torch.full((1000,), 3.0)
    opt.step()
    assert launched  # it was the direct step
    torch.testing.assert_close(b[0].detach(), torch.full((1000,), -0.9))  # 3 steps of 0.3


def test_the_direct_step_comes_back_after_a_run_of_disruptive_steps():
    """A parameter moved to new memory before each of 6 steps sends each back to the Python
    path, and after 5 dropped plans in a row none is made (planning would cost more than it
    saves); once a step finds its tensors as the step before found them, the direct step is
    planned again, and it steps bitwise as the Python path."""
    ours, theirs, opt, twin, direct = _twins("adamw", torch.float32)
    for step in range(2):
        _grads(ours, theirs, step)
        opt.step()
        twin.step()
    def steps(numbers, disrupt):
        for step in numbers:
            if disrupt:  # the first parameter moved to new memory
                for p in (ours[0], theirs[0]):
                    p.data = p.data.clone()
            _grads(ours, theirs, step)
            opt.step()
            twin.step()
            _equal(ours, theirs, opt, twin)
    steps(range(2, 8), disrupt=True)
    assert direct == [False, True] + [False] * 6
    assert opt.__dict__["_vega_direct_misses"] > 4 and "_vega_direct" not in opt.__dict__
    steps(range(8, 12), disrupt=False)
    assert direct[8:] == [False, True, True, True]  # a steady step, then direct again
    assert "_vega_direct" in opt.__dict__ and opt.__dict__["_vega_direct_misses"] == 0
    steps(range(12, 14), disrupt=True)  # and disruption still sends it back
    assert direct[12:] == [False, False]
