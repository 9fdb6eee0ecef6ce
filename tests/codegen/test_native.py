"""The native tensor scanner reads what Python reads of a tensor, and its build is cached like
the kernels' (atomic, a corrupt file rebuilt, off with VEGA_NATIVE=0)."""
import ctypes
import errno
import os
import sys
import time

import pytest
import torch

from vega.codegen import native

needs_cxx = pytest.mark.skipif(native._paths() is None,
                               reason="no C++ compiler or Python headers here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A new cache directory and no scanner loaded; the session's scanner back afterwards."""
    saved = dict(native._state)
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VEGA_NATIVE", raising=False)
    native._state.update(module=None, pending=None, failed=None, next_poll=0.0)
    yield tmp_path
    native._state.clear()
    native._state.update(saved)


def _python_row(t):
    if t is None:
        return (0, 0, 0)
    if t.layout != torch.strided:
        return (0, 0, native.DEFINED)
    return (t.data_ptr(), t.numel(), t.is_contiguous(), t.dtype, t.is_cpu)


def _native_row(scanner, row):
    ptr, numel, flags = (int(x) for x in row)
    if not flags & native.STRIDED:
        return (ptr, numel, flags)
    dtype = next(d for d, code in scanner.codes.items() if code == flags & 0xFF)
    return (ptr, numel, bool(flags & native.CONTIGUOUS), dtype, bool(flags & native.CPU))


@needs_cxx
def test_scan_reads_what_python_reads():
    scanner = native.scanner(wait=True)
    assert scanner is not None, native.status()
    p = torch.nn.Parameter(torch.randn(6, 5))
    p.grad = torch.randn(5, 6).t()  # a gradient that is not contiguous
    q = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    tensors = [p, q, torch.zeros(()), torch.empty(0), torch.arange(10.0)[2:7],
               torch.arange(12.0).view(3, 4)[:, 1], torch.zeros(4, dtype=torch.bfloat16),
               torch.zeros(4, dtype=torch.float16), torch.zeros((), dtype=torch.int32),
               torch.zeros(3, dtype=torch.complex64), torch.zeros(5).to_sparse(), None]
    rows, held = scanner.scan_grads(tensors)
    assert rows.shape == (len(tensors), 6)
    for t, row in zip(tensors, rows):
        assert _native_row(scanner, row[:3]) == _python_row(t)
        assert _native_row(scanner, row[3:]) == _python_row(None if t is None else t.grad)
    plain = scanner.scan(tensors)
    assert (plain == rows[:, :3]).all()
    with pytest.raises(TypeError, match="item 1 is of type int, not a tensor"):
        scanner.scan([p, 3])


@needs_cxx
def test_scan_grads_holds_the_gradients_until_dropped():
    """A kernel reads the gradients without the GIL, while another thread may drop them
    (zero_grad): the handle keeps their memory."""
    scanner = native.scanner(wait=True)
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = torch.full((1000,), 3.0)
    rows, held = scanner.scan_grads([p])
    address = int(rows[0, 3])
    p.grad = None  # the last Python reference
    junk = [torch.full((1000,), 7.0) for _ in range(20)]  # would take the freed memory
    assert ctypes.c_float.from_address(address).value == 3.0
    del held, junk


@needs_cxx
def test_stacked_counters_are_torch_stack_of_them():
    scanner = native.scanner(wait=True)
    counters = [torch.tensor(k * 7 - 3, dtype=torch.int32) for k in range(50)]
    addresses = torch.tensor([c.data_ptr() for c in counters], dtype=torch.int64)
    got = scanner.stacked_counters(addresses)
    assert got.dtype == torch.int32 and torch.equal(got, torch.stack(counters))


@needs_cxx
def test_same_items_compares_by_identity():
    scanner = native.scanner(wait=True)
    a, b = torch.zeros(2), torch.zeros(2)
    dicts = [{"m": a, "step": b}, {"m": b, "step": a}]
    assert scanner.same_items(dicts, ("m", "step"), [a, b, b, a])
    assert not scanner.same_items(dicts, ("m", "step"), [a, a, b, a])
    assert not scanner.same_items(dicts, ("m", "v"), [a, b, b, a])  # a missing key
    assert not scanner.same_items([dicts[0], None], ("m",), [a, b])  # not a dict
    assert not scanner.same_items(dicts, ("m",), [a])  # not one per dict and name


@needs_cxx
def test_built_once_in_the_background_then_loaded_from_the_cache(fresh):
    assert native.scanner() is None  # the build starts in a process of its own
    assert native.status() == "native tensor scanner still building"
    deadline = time.monotonic() + 300
    while native.scanner() is None and time.monotonic() < deadline:
        assert native._state["failed"] is None, native._state["failed"]
        time.sleep(0.2)
    assert native.scanner() is not None
    libraries = list((fresh / "native").glob("vega_native-*"))
    assert [p.name for p in libraries if p.name.endswith(".building")] == []
    assert len(libraries) == 1 and not list((fresh / "native").glob(".*"))  # no leftovers
    native._state.update(module=None, pending=None, failed=None)
    began = time.monotonic()
    assert native.scanner() is not None  # from the cache, at once
    assert time.monotonic() - began < 5


@needs_cxx
def test_a_corrupt_library_is_rebuilt(fresh):
    _, target = native._paths()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a shared library")  # as a build cut short might leave
    assert native.scanner(wait=True) is not None
    assert target.read_bytes()[:4] == b"\x7fELF"


def test_off_with_vega_native_0(fresh, monkeypatch):
    monkeypatch.setenv("VEGA_NATIVE", "0")
    assert native.scanner() is None and native.scanner(wait=True) is None
    assert native.status() == "native tensor scanner off (VEGA_NATIVE=0)"
    assert not (fresh / "native").exists()  # nothing built


def test_no_compiler_means_the_python_path(fresh, monkeypatch):
    monkeypatch.setattr(native, "_paths", lambda: None)
    assert native.scanner(wait=True) is None
    assert "no C++ compiler" in native.status()


@needs_cxx
def test_a_failing_compiler_is_said_once_and_remembered(fresh, monkeypatch):
    command, target = native._paths()
    failing = [sys.executable, "-c", "import sys; sys.exit('the compiler says no')"]
    monkeypatch.setattr(native, "_paths", lambda: (failing, target))
    assert native.scanner(wait=True) is None
    assert "the compiler says no" in native.status()
    assert native._failed_file(target).exists()
    native._state.update(module=None, pending=None, failed=None)
    assert native.scanner() is None  # no second build: the failure is remembered
    assert native._state["pending"] is None and "the compiler says no" in native.status()


@needs_cxx
def test_a_build_that_cannot_start_leaves_the_python_path(fresh, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(native.subprocess, "Popen", refuse)
    assert native.scanner() is None
    assert "could not start" in native.status()
    _, target = native._paths()
    assert not native._lock(target).exists()


@needs_cxx
def test_a_stale_lock_is_taken_over(fresh):
    _, target = native._paths()
    target.parent.mkdir(parents=True)
    lock = native._lock(target)
    lock.touch()
    assert native.scanner() is None
    assert native._state["pending"][1] is None  # a fresh lock: another process builds
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))  # ... which died
    native._state["next_poll"] = 0.0
    assert native.scanner() is None
    assert native._state["pending"][1] is not None  # this process builds it now
    assert native.scanner(wait=True) is not None
    assert not lock.exists()
