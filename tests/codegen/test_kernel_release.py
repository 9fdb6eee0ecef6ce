"""Kernels are released with the spec that made them: the tables through which the torch
custom ops find a kernel by name hold it weakly, so a program that compiles spec after spec
(a search over optimizers, a notebook) does not keep every kernel it ever made. A kernel in
use, by an optimizer or by a step, stays."""
import gc

import pytest
import torch

import vega
from vega import codegen
from vega.codegen import c, reference, triton, triton_runtime

BACKENDS = [b for b in ("c", "triton") if b in codegen.BACKENDS]
KERNEL_CLASSES = (c.Kernel, reference.Kernel, triton.Kernel)


def live_kernels() -> dict[str, int]:
    gc.collect()
    counts = {cls.__module__: 0 for cls in KERNEL_CLASSES}
    for obj in gc.get_objects():
        if type(obj) in KERNEL_CLASSES:
            counts[type(obj).__module__] += 1
    return counts


def spec(n: int):
    return vega.compile(f"optimizer released{n}(lr = 0.5) {{ p = p - lr * g * {n + 1} }}")


def made(n: int) -> None:
    """The kernels of a new spec on every backend, then dropped with it."""
    program = spec(n).program()
    for backend in BACKENDS:
        codegen.kernel(backend, program)


def test_kernels_are_released_with_their_spec():
    made(0)  # (whatever a first compile makes once)
    before, registered = live_kernels(), (len(c.launch._KERNELS), len(triton_runtime._KERNELS))
    for n in range(1, 201):
        made(n)
    after = live_kernels()
    assert after == before, f"kernels left alive by 200 dropped specs: {before} -> {after}"
    assert (len(c.launch._KERNELS), len(triton_runtime._KERNELS)) == registered


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_released_kernels_name_is_not_given_again(backend):
    program = spec(1000).program()
    first = codegen.kernel(backend, program).key
    del program
    gc.collect()
    registry = c.launch if backend == "c" else triton_runtime
    assert first not in registry._KERNELS
    with pytest.raises(RuntimeError, match="was released"):
        registry.kernel_of(first)
    assert codegen.kernel(backend, spec(1000).program()).key != first


@pytest.mark.skipif(not c.available(), reason="no C compiler: no C backend")
def test_an_optimizer_in_use_keeps_its_kernels():
    """Nothing but the optimizer holds the spec: its kernels survive a collection, and its
    steps (through the custom op, by the kernel's name) are the reference backend's."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    text = ("optimizer kept(lr = 0.1, beta = 0.9) {\n"
            "    state m = zeros\n    m = beta * m + g\n    p = p - lr * m\n}")
    opt = vega.compile(text).optimizer(params, backend="c")
    ref = vega.compile(text).optimizer(twins, backend="reference")
    for step in range(3):
        gc.collect()
        for p, q in zip(params, twins):
            p.grad = q.grad = torch.full_like(p, float(step + 1))
        opt.step()
        ref.step()
        live = [k for k in gc.get_objects() if type(k) is c.Kernel and k.program.name == "kept"]
        assert len(live) == 1 and c.kernel_of(live[0].key) is live[0]
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q)


@pytest.mark.skipif(not c.available(), reason="no C compiler: no C backend")
def test_a_spec_compiled_again_loads_its_library_once(monkeypatch):
    """A search that compiles the same spec in each trial loads its C library once: each
    load maps a copy of its own that is never unloaded, so a load a trial would use up the
    process's memory maps."""
    from vega.codegen.c import build as cbuild
    loads = []
    real = cbuild.load_verified
    monkeypatch.setattr(cbuild, "load_verified",
                        lambda path, load: loads.append(path) or real(path, load))
    text = "optimizer trial(lr = 0.25) { p = p - lr * g * 7 }"
    for n in range(5):
        spec = vega.compile(text)
        params = [torch.ones(3)]
        params, _ = spec.step(params, [torch.ones(3)], spec.init(params), backend="c")
        assert params[0].tolist() == [-0.75] * 3
        gc.collect()
    assert len(loads) <= 1, f"{len(loads)} loads of one spec's library"


@pytest.mark.skipif("triton" not in BACKENDS, reason="no triton")
def test_a_spec_compiled_again_runs_the_triton_module_already_loaded():
    """The Triton kernels of a spec compiled again are the jit functions already made for
    its source: new ones would compile and load their kernels again, and Triton never
    unloads a loaded CUDA module."""
    text = "optimizer trial_gpu(lr = 0.25) { p = p - lr * g * 5 }"
    dtypes = ("float32",) * 3
    first = codegen.kernel("triton", vega.compile(text).program()).module(dtypes)
    gc.collect()
    again = codegen.kernel("triton", vega.compile(text).program()).module(dtypes)
    assert again is first


@pytest.mark.skipif("triton" not in BACKENDS, reason="no triton")
def test_a_search_over_many_specs_keeps_a_bounded_number_of_triton_modules():
    for n in range(triton_runtime._MODULES_KEPT + 10):
        codegen.kernel("triton", spec(2000 + n).program()).module(("float32",) * 3)
    assert len(triton_runtime._MODULES) <= triton_runtime._MODULES_KEPT
