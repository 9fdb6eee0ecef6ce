"""The small state tensors a class step makes are packed: one buffer for each state name,
dtype and device, each tensor a view of its own aligned part of it (``_pack``). Packing
changes where the values live, never what they are, and everything a user does with the
state (stepping, saving, loading, a parameter that steps later) works as without it."""
import io
import sys

import pytest
import torch

import vega
from vega.codegen import c as c_backend
from vega.runtime import optimizer as opt_module

BACKENDS = ["reference"] + (["c"] if c_backend.available() else [])
SHAPES = [(33,), (4, 5), (), (1,), (0,), (7, 3), (opt_module.PACK_MAX + 1,), (100,)]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype))
            for s in SHAPES]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)


def _steps_alike(ours, theirs, opt, twin, steps):
    """Both optimizers stepped on the same gradients: the same parameters and state, bit
    for bit."""
    for step in steps:
        _grads(ours, step)
        _grads(theirs, step)
        opt.step()
        twin.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p.detach(), q.detach())
        for name in ("mu", "nu", "step"):
            assert torch.equal(opt.state[p][name], twin.state[q][name]), name


@pytest.fixture
def unpacked(monkeypatch):
    """Optimizers made inside ``with unpacked():`` keep each state tensor apart."""
    import contextlib

    @contextlib.contextmanager
    def off():
        with monkeypatch.context() as m:
            m.setattr(opt_module, "_pack", lambda made: None)
            yield
    return off


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_states_are_views_of_one_buffer_and_step_as_apart(backend, dtype, unpacked):
    ours, theirs = _params(dtype), _params(dtype)
    opt = vega.optim.AdamW(ours, backend=backend, max_grad_norm=1.0)
    with unpacked():
        twin = vega.optim.AdamW(theirs, backend=backend, max_grad_norm=1.0)
        _grads(theirs, 0)
        twin.step()
    _grads(ours, 0)
    opt.step()
    small = [p for p in ours if p.numel() <= opt_module.PACK_MAX]
    big = [p for p in ours if p.numel() > opt_module.PACK_MAX]
    for name in ("mu", "nu"):
        bases = {opt.state[p][name].untyped_storage().data_ptr() for p in small}
        assert len(bases) == 1, name  # one buffer
        for p in small:
            t = opt.state[p][name]
            assert t.shape == p.shape and t.is_contiguous() and t.dtype == torch.float32
            assert t.data_ptr() % opt_module.PACK_ALIGN == 0
        for p in big:  # kept apart: its own storage, as made
            t = opt.state[p][name]
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    steps = {opt.state[p]["step"].untyped_storage().data_ptr() for p in ours}
    assert len(steps) == len(ours)  # each counter its own
    _steps_alike(ours, theirs, opt, twin, range(1, 4))


def test_a_parameter_that_steps_later_gets_a_state_of_its_own():
    params = _params()
    opt = vega.optim.AdamW(params)
    _grads(params, 0)
    params[1].grad = None
    opt.step()
    assert params[1] not in opt.state
    _grads(params, 1)
    opt.step()
    late, other = opt.state[params[1]]["mu"], opt.state[params[0]]["mu"]
    assert late.untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
    assert late.untyped_storage().nbytes() == late.numel() * 4


def test_packed_state_saved_and_loaded_resumes_bitwise():
    ours, theirs = _params(), _params()
    opt = vega.optim.AdamW(ours)
    for step in range(2):
        _grads(ours, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = buf.getbuffer().nbytes
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                      for t in st.values())
    assert saved < state_bytes + 64 * 1024  # each buffer once
    for p, q in zip(ours, theirs):
        q.data.copy_(p.detach())
    twin = vega.optim.AdamW(theirs)
    buf.seek(0)
    loaded = torch.load(buf)
    twin.load_state_dict(loaded)
    for name in ("mu", "nu"):  # packed again, the loaded tensors left as they were
        small = [q for q in theirs if q.numel() <= opt_module.PACK_MAX]
        assert len({twin.state[q][name].untyped_storage().data_ptr() for q in small}) == 1
        assert all(twin.state[q][name] is not t for q in theirs
                   for t in (s[name] for s in loaded["state"].values()))
    _steps_alike(ours, theirs, opt, twin, range(2, 4))


@pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux")
def test_a_large_packed_buffer_starts_on_a_huge_page_and_asks_for_them(monkeypatch):
    asked = []
    monkeypatch.setattr(opt_module, "_madvise_huge", lambda at, n: asked.append((at, n)))
    params = [torch.nn.Parameter(torch.randn(20_000)) for _ in range(60)]  # 4.8 MB a state
    small = [torch.nn.Parameter(torch.randn(100)) for _ in range(10)]  # 4 KB a state
    opt = vega.optim.AdamW([{"params": params}, {"params": small}])
    for p in params + small:
        p.grad = torch.randn(p.shape)
    opt.step()
    first = opt.state[params[0]]["mu"].data_ptr()
    assert len(asked) == 2  # mu's and nu's buffers of the large group; none of the small
    for at, n in asked:
        assert at % opt_module.HUGE_PAGE == 0
        assert n >= 60 * 20_000 * 4
    assert first in {at for at, _ in asked}
    for name in ("mu", "nu"):
        storage = opt.state[params[0]][name].untyped_storage()
        start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        at, n = next((a, m) for a, m in asked if start <= a < end)
        assert at + n <= end  # within what was allocated


def test_a_large_buffer_is_usable_memory_of_its_length():
    """With the real system call: the buffer is as long as asked and holds what is written
    (asking for huge pages changes where the values live, nothing else)."""
    t = opt_module._buffer(3 << 20, torch.float32, "cpu")
    assert t.shape == (3 << 20,) and t.dtype == torch.float32 and t.is_contiguous()
    if sys.platform == "linux":
        assert t.data_ptr() % opt_module.HUGE_PAGE == 0
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * (3 << 20)
    assert opt_module._buffer(10, torch.bfloat16, "cpu").shape == (10,)


def test_a_loaded_state_of_tensors_apart_is_packed(unpacked):
    """A state dict whose tensors are each their own (saved before states were packed, or
    converted from torch.optim's) loads packed, with its values."""
    ours, theirs = _params(), _params()
    with unpacked():
        opt = vega.optim.AdamW(ours)
        _grads(ours, 0)
        opt.step()
    saved = opt.state_dict()
    assert len({st["mu"].untyped_storage().data_ptr() for st in saved["state"].values()}) > 1
    twin = vega.optim.AdamW(theirs)
    twin.load_state_dict(saved)
    small = [q for q in theirs if q.numel() <= opt_module.PACK_MAX]
    assert len({twin.state[q]["mu"].untyped_storage().data_ptr() for q in small}) == 1
    for p, q in zip(ours, theirs):
        for name in ("mu", "nu", "step"):
            assert torch.equal(opt.state[p][name], twin.state[q][name]), name
