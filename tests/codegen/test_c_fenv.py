"""The C kernels' threads compute in the calling thread's floating-point environment:
``torch.set_flush_denormal(True)`` sets the flush of subnormal values to zero (x86's FTZ and
DAZ) on the calling thread alone, and the OpenMP pool's other threads kept their own."""
import ctypes

import pytest
import torch

import vega
from vega.codegen import c
from vega.codegen.c import build as cbuild

pytestmark = pytest.mark.skipif(not c.available(), reason="no C compiler")


def _flushing() -> bool:
    """Whether this CPU flushes subnormals at torch's asking (set back off)."""
    ok = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    return ok


needs_flush = pytest.mark.skipif(not _flushing(), reason="torch cannot flush subnormals here")


def _on_threads(fn, counts=(1, 2, 3), flush=True):
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            torch.set_flush_denormal(flush)
            try:
                outs.append(fn())
            finally:
                torch.set_flush_denormal(False)
    finally:
        torch.set_num_threads(threads)
    return outs


def _equal(a, b) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return len(flat_a) == len(flat_b) and all(  # bit for bit (NaN and signed zeros too)
        x.dtype == y.dtype and torch.equal(x.view(ints[x.element_size()]),
                                           y.view(ints[y.element_size()]))
        for x, y in zip(flat_a, flat_b))


@needs_flush
@pytest.mark.parametrize("name, shape, hyper", [
    ("adamw", (200_001,), {"lr": 1e-3, "max_grad_norm": 1e-30}),
    ("sgd", (150_000,), {"lr": 0.5, "momentum": 0.9}),
    ("adafactor", (400, 300), {"lr": 1e-3, "eps": 1e-37})])
def test_flushed_subnormals_do_not_depend_on_the_thread_count(name, shape, hyper):
    """Subnormal parameters and gradients stepped with torch.set_flush_denormal(True): the
    calling thread flushed them and the other threads did not, so that with 2 threads the
    second half of a tensor came out unflushed (sgd: 100,000 of 200,000 values zero; with 3
    threads 133,333). Every thread now computes as the caller: the same bits on 1, 2 and 3
    threads, flushed (unlike the step without it); and a step after the flush is set back
    off gives the unflushed bits on every thread (each thread's own environment restored)."""
    gen = torch.Generator().manual_seed(5)
    p = {"w": torch.randn(shape, generator=gen).mul(1e-39)}
    g = {"w": torch.randn(shape, generator=gen).mul(1e-20 if name == "adafactor" else 1e-39)}
    init, step = getattr(vega, f"{name}_init"), getattr(vega, f"{name}_step")

    def run():
        return step(p, g, init(p), backend="c", **hyper)
    flushed = _on_threads(run)
    plain = _on_threads(run, flush=False)
    assert _equal(flushed[0], flushed[1]) and _equal(flushed[0], flushed[2])
    assert _equal(plain[0], plain[1]) and _equal(plain[0], plain[2])
    assert not _equal(flushed[0], plain[0])


@needs_flush
def test_a_parallel_for_computes_in_the_callers_environment():
    """``share_fenv`` over an ``omp parallel for simd`` (the form of the element runs of
    Muon's loops and of the staged kernels' chunks): every element flushed on 2 threads."""
    src = "\n".join([
        "#include <fenv.h>", "#include <stdint.h>",
        'const char *vega_key(void) { return "@KEY@"; }',
        "void halve(int64_t n, const float *x, float *y, int nth) {",
        "    #pragma omp parallel for simd num_threads(nth) if (n >= 1000) schedule(static)",
        "    for (int64_t i = 0; i < n; i++) {",
        "        y[i] = x[i] * 0.5f;",
        "    }",
        "}", ""])
    lib = cbuild.library(cbuild.share_fenv(src))
    lib.halve.restype = None
    lib.halve.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    x = torch.full((100_000,), 3e-39)

    def run():
        y = torch.empty_like(x)
        lib.halve(x.numel(), x.data_ptr(), y.data_ptr(), 2)
        return y
    flushed, = _on_threads(run, counts=(2,))
    plain, = _on_threads(run, counts=(2,), flush=False)
    assert torch.equal(flushed, torch.zeros_like(x))
    assert torch.equal(plain, x * 0.5)
