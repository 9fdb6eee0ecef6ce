"""The C backend against the reference, over every shipped spec, shape and dtype."""
import errno
import math
import multiprocessing
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import vega
from vega import codegen
from vega.codegen import c
from vega.codegen.c import build as cbuild
from vega.codegen.c import native
from vega.codegen.c import render

from tests import forks

# every setting of the bool hyperparameters; and the programs without a momentum buffer
# (hyper_values gives momentum 0.01); of the programs this backend compiles (one with a
# state of one number per tensor runs on the reference's, every backend: test_group_language)
SPECS = [(name, flags) for name in vega.builtin_names()
         for flags in vega.builtin(name)._spec.flag_settings()
         if not vega.builtin(name)._spec.program(flags).torch_only] + [
    (name, {"momentum": 0.0}) for name in ("sgd", "rmsprop")]
IDS = [n + "[" + (",".join(k if v is True else f"{k}={v}" for k, v in f.items()
                          if v is not False) or "plain") + "]" for n, f in SPECS]

# (rtol, atol) of the C backend against the reference, by parameter dtype
TOL = {torch.float64: (1e-12, 1e-14), torch.float32: (1e-5, 1e-6),
       torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-3)}


def make_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(9, 13, generator=gen, dtype=torch.float64)
    return {
        "matrix": torch.randn(37, 41, generator=gen, dtype=torch.float64).to(dtype),
        "odd": torch.randn(1001, generator=gen, dtype=torch.float64).to(dtype),
        "one": torch.randn(1, generator=gen, dtype=torch.float64).to(dtype),
        "scalar": torch.randn((), generator=gen, dtype=torch.float64).to(dtype),
        "empty": torch.zeros(0, 3, dtype=dtype),
        "transposed": base.to(dtype).t(),  # not contiguous
    }


def grads_for(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: (scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.dtype)
            for k, p in params.items()}


def hyper_values(spec):
    """Non-default, in-range values for every float hyperparameter."""
    out = {}
    for h in spec.hypers:
        if h.type == "float":
            out[h.name] = h.default * 0.9 if h.default != 0 else 0.01
    return out


def assert_close(a, b, dtype, what, tol=None):
    rtol, atol = (tol or TOL)[dtype]
    scale = b.double().abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol * max(1.0, scale),
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,flags", SPECS, ids=IDS)
def test_matches_reference_20_steps(name, flags, dtype):
    _against_reference(name, flags, dtype, make_params(dtype), 20)


LONG = (16383, 16384, 16387, 40001, 65539)  # about SPLIT_MIN, on one thread and on two
# A per-tensor reduction (adafactor's update RMS, lamb's norms) over tens of thousands of
# float64 terms, summed in another order than torch's, differs from it by up to about
# n * eps relative: on some x86 machines (other vector widths under -march=native) that
# reaches 6e-14 on parameters of magnitude 5, past TOL's absolute 1e-14 per unit of scale.
LONG_TOL = {**TOL, torch.float64: (1e-12, 1e-13)}


# the programs of element loops (adafactor's factored setting runs loops of its own)
ELEMENTWISE = [(n, f) for n, f in SPECS if not (n == "adafactor" and f.get("factored"))]


# the setting of this CPU (its kernels the other tests' too) in both dtypes; the other one,
# whose every kernel is compiled for this test alone, in float32 (its loops are the same in
# float64; a kernel takes half a second of a CPU to compile, two hundred of them here)
_MINE = "1" if render.split_min() == "16384" else "0"
QUARTERS = [(q, d) for q in ("1", "0") for d in (torch.float64, torch.float32)
            if q == _MINE or d == torch.float32]


@pytest.mark.parametrize("quarters,dtype", QUARTERS,
                         ids=[f"{q}-{str(d)[6:]}" for q, d in QUARTERS])
@pytest.mark.parametrize("name,flags", ELEMENTWISE,
                         ids=[i for i, s in zip(IDS, SPECS) if s in ELEMENTWISE])
def test_long_tensors_read_in_quarters_match_reference(monkeypatch, name, flags, dtype,
                                                       quarters):
    """A thread's share of a tensor of SPLIT_MIN elements or more is read as four quarters
    at once, the rest after: lengths about it, on one thread and split between two. And the
    same without the split (``render.split_min``: the choice on AMD Zen). Each on a spec
    compiled afresh (its kernels rendered with the setting)."""
    monkeypatch.setenv("VEGA_C_QUARTERS", quarters)
    spec = vega.compile(vega.builtin(name).source_text + f"\n# VEGA_C_QUARTERS={quarters}\n")
    assert f"#define SPLIT_MIN {render.split_min()} " in spec.source("c")
    assert render.split_min() == ("16384" if quarters == "1" else "INT64_MAX")
    # (without the split, the loop alone is rendered: a third less C to compile)
    assert ("if (e - b >= SPLIT_MIN)" in spec.source("c")) == (quarters == "1")
    gen = torch.Generator().manual_seed(1)
    params = {f"n{n}": torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
              for n in LONG}
    params["matrix"] = torch.randn(130, 257, generator=gen, dtype=torch.float64).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _against_reference(name, flags, dtype, params, 5, tol=LONG_TOL, spec=spec)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,flags", ELEMENTWISE,
                         ids=[i for i, s in zip(IDS, SPECS) if s in ELEMENTWISE])
def test_many_small_tensors_on_two_threads_match_reference(name, flags, dtype):
    """Tensors of at most FUSED_MAX elements: a spec with per-tensor reductions runs each
    tensor's phases and update on one thread (vega_fused), the tensors shared between two
    threads by where they start, an empty one among them."""
    gen = torch.Generator().manual_seed(2)
    sizes = [int(k) for k in torch.randint(1, 6000, (24,), generator=gen)]
    sizes[7] = 0
    params = {f"t{k}": torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
              for k, n in enumerate(sizes)}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _against_reference(name, flags, dtype, params, 4, donate=True)  # (in place: once)
    finally:
        torch.set_num_threads(threads)


def _against_reference(name, flags, dtype, params, steps, donate=False, tol=None, spec=None):
    spec = spec or vega.builtin(name)
    hypers = {**hyper_values(spec), **flags}
    ref_p, ref_s = params, spec.init(params, **hypers)
    c_p = {k: v.clone() for k, v in params.items()} if donate else params
    c_s = spec.init(c_p, **hypers)
    for step in range(steps):
        grads = grads_for(params, step)
        ref_p, ref_s = spec.step(ref_p, grads, ref_s, backend="reference", **hypers)
        c_p, c_s = spec.step(c_p, grads, c_s, backend="c", donate=donate, **hypers)
        for k in params:
            assert c_p[k].dtype == dtype and c_p[k].shape == params[k].shape
            assert_close(c_p[k], ref_p[k], dtype, f"{name} step {step} p.{k}", tol)
            for field in ref_s:
                if field != "step" and ref_s[field][k] is None:  # (adafactor: not factored)
                    assert c_s[field][k] is None
                elif field != "step":
                    assert_close(c_s[field][k], ref_s[field][k], dtype, f"{field}.{k}", tol)
        assert torch.equal(c_s["step"], ref_s["step"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_half_precision_parameters(name, dtype):
    spec = vega.builtin(name)
    hypers = {"lr": 1e-2, **({"momentum": 0.9} if name == "sgd" else {})}
    params = make_params(dtype)
    ref_p, ref_s = params, spec.init(params, **hypers)
    c_p, c_s = params, spec.init(params, **hypers)
    field = spec.program(**hypers).state_names[0]
    assert all(s.dtype == torch.float32 for s in ref_s[field].values())
    for step in range(5):
        grads = grads_for(params, step)
        ref_p, ref_s = spec.step(ref_p, grads, ref_s, backend="reference", **hypers)
        c_p, c_s = spec.step(c_p, grads, c_s, backend="c", **hypers)
        for k in params:
            assert c_p[k].dtype == dtype
            assert_close(c_p[k], ref_p[k], dtype, f"p.{k}")


def test_bfloat16_rounds_to_nearest_even():
    """A float32 value halfway between two bfloat16 numbers rounds to the even one."""
    spec = vega.compile("optimizer o() { p = g }")
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: even is 1.0
    # 1 + 3 * 2^-8 is halfway between 1.0078125 and 1.015625: even is 1.015625
    g = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)], dtype=torch.float32)
    p = torch.zeros(3, dtype=torch.bfloat16)
    out, _ = spec.step(p, g, spec.init(p), backend="c")
    assert out.tolist() == [1.0, 1.015625, -1.0]
    assert out.tolist() == g.to(torch.bfloat16).tolist()


def test_a_float32_nan_stored_to_bfloat16_stays_nan():
    """A float32 NaN whose fraction is set only in its low 16 bits (a signaling NaN, which
    no arithmetic leaves so: a float32 state read and stored as it is) is a NaN in bfloat16,
    as torch's conversion, not the infinity its top 16 bits alone would be."""
    spec = vega.compile("optimizer o() {\n    state s = zeros\n    s = s\n    p = s\n}")
    bits = torch.tensor([0x7F800001, 0xFF800001 - 2**32, 0x7F80FFFF, 0x3F800000],
                        dtype=torch.int32)
    p = torch.zeros(4, dtype=torch.bfloat16)
    for backend in ("reference", "c"):
        state = spec.init(p)
        assert state["s"].dtype == torch.float32
        state["s"] = bits.view(torch.float32).clone()
        out, _ = spec.step(p, torch.zeros_like(p), state, backend=backend)
        assert out.isnan().tolist() == [True, True, True, False], (backend, out)
        assert out[3].item() == 1.0


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "adam"])
def test_nonfinite_step_is_skipped_exactly(name, backend):
    spec = vega.builtin(name)
    hypers = {"momentum": 0.9} if name == "sgd" else {}  # every state: sgd's buffer too
    params = make_params(torch.float32)
    state = spec.init(params, **hypers)
    params, state = spec.step(params, grads_for(params, 0), state, backend=backend,
                              skip_nonfinite=True, **hypers)
    for bad in (float("nan"), float("inf"), -float("inf")):
        grads = grads_for(params, 1)
        grads["odd"][500] = bad
        new_p, new_s = spec.step(params, grads, state, backend=backend, skip_nonfinite=True,
                                 max_grad_norm=1.0, **hypers)
        for k in params:
            assert torch.equal(new_p[k], params[k])
        for field in state:
            if field == "step":
                assert torch.equal(new_s[field], state[field])
            else:
                for k in params:
                    assert torch.equal(new_s[field][k], state[field][k])
    # the same in place
    before = {k: v.clone() for k, v in params.items()}
    step_before = state["step"].clone()
    spec.step(params, grads, state, backend=backend, skip_nonfinite=True, donate=True, **hypers)
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert torch.equal(state["step"], step_before)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_clipping_matches_reference(name):
    spec = vega.builtin(name)
    params = make_params(torch.float64)
    ref = (params, spec.init(params))
    cc = (params, spec.init(params))
    for step in range(5):
        grads = grads_for(params, step, scale=10.0)
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", max_grad_norm=0.5)
        cc = spec.step(*cc[:1], grads, cc[1], backend="c", max_grad_norm=0.5)
        for k in params:
            assert_close(cc[0][k], ref[0][k], torch.float64, f"p.{k}")
    # clipping by a large norm is the identity
    grads = grads_for(params, 9)
    a, _ = spec.step(params, grads, spec.init(params), backend="c", max_grad_norm=1e9)
    b, _ = spec.step(params, grads, spec.init(params), backend="c")
    for k in params:
        assert torch.equal(a[k], b[k])


def test_clip_is_optax_rule():
    """g * max_norm / max(norm, max_norm) over all leaves together."""
    spec = vega.compile("optimizer o() { p = g }")
    grads = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64),
             "b": torch.tensor([4.0], dtype=torch.float64)}
    params = {k: torch.zeros_like(v) for k, v in grads.items()}
    for backend in ("reference", "c"):
        out, _ = spec.step(params, grads, spec.init(params), backend=backend, max_grad_norm=1.0)
        assert torch.allclose(out["a"], torch.tensor([0.6, 0.0], dtype=torch.float64))
        assert torch.allclose(out["b"], torch.tensor([0.8], dtype=torch.float64))


REDUCING = """optimizer reducing(lr = 1e-2, b1 = 0.9) {
    state mu = zeros
    mu = b1 * mu + (1 - b1) * g
    r = mu + 0.1 * p
    trust = where(norm(p) > 0 and norm(r) > 0, norm(p) / norm(r), 1)
    shift = mean(g) - sum(g) / 1000 + max(abs(r))
    p = p - lr * trust * r - 1e-3 * shift * max(r / (1 + norm(r)))
}"""


# new values that are per-tensor reductions themselves, written to state like p (n: the
# same one twice)
REDUCED_STATE = """optimizer reduced(lr = 0.1) {
    state s = ones
    state m = zeros
    state n = zeros
    s = norm(g)
    m = max(g) + s
    n = s
    p = p - lr * g * s + 0.01 * m
}"""


def steps_against_reference(spec, params, steps):
    """(step, reference result, C result) after each of ``steps`` steps from one state."""
    ref, cc = (params, spec.init(params)), (params, spec.init(params))
    for step in range(steps):
        grads = grads_for(params, step)
        ref = spec.step(ref[0], grads, ref[1], backend="reference")
        cc = spec.step(cc[0], grads, cc[1], backend="c")
        yield step, ref, cc


STORED_THEN_REDUCED = """optimizer stored_then_reduced(lr = 0.1) {
    state s = zeros
    s = norm(g) * 2
    m = norm(p * s)
    p = p - lr * g * (s + m)
}"""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_per_tensor_value_of_a_stored_state_stays_in_the_loop(dtype):
    """m reads s, which an earlier phase stored and the update loads per element: m is not
    computed before the loop (where s is not yet declared) with the values of the tensor."""
    params = {**make_params(dtype), "long": torch.randn(40001, dtype=torch.float64).to(dtype)}
    spec = vega.compile(STORED_THEN_REDUCED)
    for step, ref, cc in steps_against_reference(spec, params, 3):
        for k in params:
            assert_close(cc[0][k], ref[0][k], dtype, f"step {step} p.{k}")
            assert_close(cc[1]["s"][k], ref[1]["s"][k], dtype, f"step {step} s.{k}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_state_set_to_a_reduction(dtype):
    params = make_params(dtype)
    for step, ref, cc in steps_against_reference(vega.compile(REDUCED_STATE), params, 3):
        for k in params:
            for what, x, y in [("p", cc[0][k], ref[0][k])] + [
                    (n, cc[1][n][k], ref[1][n][k]) for n in "smn"]:
                assert_close(x, y, dtype, f"step {step} {what}.{k}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reductions_and_phases(dtype):
    spec = vega.compile(REDUCING)
    assert len(c.launch.reduction_phases(spec.program())) == 2  # max(r / (1 + norm(r))) nests
    params = make_params(dtype)
    for step, ref, cc in steps_against_reference(spec, params, 10):
        for k in params:
            assert_close(cc[0][k], ref[0][k], dtype, f"step {step} p.{k}")


DIVIDING = """optimizer dividing(s = 1.0) {
    p = p - g / s + p / (1 + norm(g))
}"""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_division_by_a_per_tensor_value(dtype):
    """The C loop multiplies by a per-tensor divisor's reciprocal where that is a normal
    number and divides otherwise: a divisor whose reciprocal is subnormal or overflows
    (``x * (1 / s)`` would be 0 or inf where ``x / s`` is finite) gives the reference's
    values, and so do zero, infinite and NaN divisors."""
    src = vega.adamw.source("c")
    # the bias corrections (mu's new value, v_mu, is v_v_mu in C)
    assert "v_v_mu * r0_" in src and re.search(r"recip_ok\(v_v_\d+\)", src)
    spec = vega.compile(DIVIDING)
    tiny = 1e-40 if dtype == torch.float32 else 1e-310  # subnormal: 1 / s overflows
    huge = 3e38 if dtype == torch.float32 else 1.7e308  # 1 / s is subnormal
    params = {"v": torch.tensor([1e-5, -2e-3, 3.0, 0.0, 1e-30], dtype=dtype)}
    grads = {"v": torch.tensor([1e-36, -2e-38, 7e-3, 0.0, 1e-30], dtype=dtype)}
    if dtype == torch.float64:
        grads = {"v": grads["v"] * 1e-270}
    for s in (0.7, tiny, -tiny, huge, 0.0, -0.0, float("inf"), torch.tensor(float("nan"))):
        ref, _ = spec.step(params, grads, spec.init(params), backend="reference", s=s)
        out, _ = spec.step(params, grads, spec.init(params), backend="c", s=s)
        assert_close(out["v"], ref["v"], dtype, f"s={s}")


KEEPING = """optimizer keeping(lr = 0.1) {
    state m = zeros
    state v = zeros
    old = m
    m = 0.5 * m + g
    v = 0.9 * v + g * g
    p = p - lr * (m / (1 + norm(m) + norm(v)) + old)
}"""


# phase 0 stores a; phase 1 computes b from a's old value (a0): a must not be stored
# early, though phase 1 itself stores b
CHAINED = """optimizer chained(lr = 0.1) {
    state a = zeros
    state b = ones
    a0 = a
    a = 0.5 * a + g
    n1 = norm(a)
    b = b + a0 * g / n1
    n2 = norm(b)
    p = p - lr * b / n2
}"""

# a and b take one new value; the update reads a's old one: neither is stored early
SHARED = """optimizer shared(lr = 0.1) {
    state a = ones
    state b = ones
    a0 = a
    m = 0.5 * b + g
    a = m
    b = m
    n1 = norm(m)
    p = p - lr * (m + a0) / n1
}"""


def _stores(source: str, function: str) -> str:
    """The states a function of ``source`` stores (``phase0``: the body of ``vega_phase0``
    and ``vega_phase0_partial``)."""
    body = source.split(f"void {function}(")[1].split("\nvoid ")[0]
    return " ".join(sorted({line.split("=")[0].strip() for line in body.splitlines()
                            if line.strip().startswith(("SO0_[j]", "SO1_[j]"))}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_state_written_by_the_reduction_phase(dtype):
    """A new state value a reduction phase computes anyway is stored by that phase and
    loaded by the update (lamb: 24 + 16 bytes an element rather than 16 + 28), unless a
    later loop reads the old value (``old`` below keeps m in the update). A skipped step
    writes nothing in either loop."""
    lamb = vega.lamb.source("c")
    assert _stores(lamb, "phase0") == "SO0_[j] SO1_[j]"
    assert _stores(lamb, "vega_update") == ""
    keeping = vega.compile(KEEPING)
    src = keeping.source("c")
    assert _stores(src, "phase0") == "SO1_[j]" and _stores(src, "vega_update") == "SO0_[j]"
    chained, shared = vega.compile(CHAINED), vega.compile(SHARED)
    assert _stores(chained.source("c"), "phase0") == ""
    assert _stores(shared.source("c"), "vega_update") == "SO0_[j] SO1_[j]"
    for spec in (keeping, vega.lamb, chained, shared):
        params = make_params(dtype)
        ref, cc = (params, spec.init(params)), (params, spec.init(params))
        for step in range(6):
            grads = grads_for(params, step)
            if step == 3:
                grads["odd"][5] = float("nan")
            kw = {"loss_scale": vega.LossScale.dynamic(init=2.0)} if step >= 2 else {}
            ref = spec.step(ref[0], grads, ref[1], backend="reference", **kw)
            cc = spec.step(cc[0], grads, cc[1], backend="c", **kw)
            for k in params:
                assert_close(cc[0][k], ref[0][k], dtype, f"step {step} p.{k}")
                for name in {keeping: ("m", "v"), vega.lamb: ("mu", "nu")}.get(spec, "ab"):
                    assert_close(cc[1][name][k], ref[1][name][k], dtype,
                                 f"step {step} {name}.{k}")


def test_multi_threaded_steps_are_deterministic():
    spec = vega.compile(REDUCING)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = {"big": torch.randn(300_000, dtype=torch.float32), "small": torch.randn(7)}
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        outs = [spec.step(params, grads, spec.init(params), backend="c", max_grad_norm=1.0)[0]
                for _ in range(3)]
        for other in outs[1:]:
            assert all(torch.equal(outs[0][k], other[k]) for k in params)
    finally:
        torch.set_num_threads(threads)


def test_the_fused_norm_is_the_same_on_any_number_of_threads():
    """max_grad_norm's sum of squares: each thread summed its share of the elements in
    blocks that began where the share did, so that the norm, and a float64 step clipped by
    it, changed in the last bits between one thread and two or three. A tensor is now
    summed in pieces from its start, each piece by one thread, the pieces added in order."""
    gen = torch.Generator().manual_seed(3)
    sizes = (300_001, 70_001, 5, 40_000)
    params = {f"t{k}": torch.randn(n, generator=gen, dtype=torch.float64)
              for k, n in enumerate(sizes)}
    grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64).mul(
        torch.rand(v.shape, generator=gen, dtype=torch.float64).mul(6).exp())
        for k, v in params.items()}
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(vega.sgd_step(params, grads, vega.sgd_init(params), lr=1.0,
                                      max_grad_norm=1.0, backend="c")[0])
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(outs[0][k], other[k]) for k in params)


@pytest.mark.parametrize("name", ["lamb", "lars", "novograd", "adafactor", "prodigy",
                                  "dadapt_adamw"])
@pytest.mark.parametrize("sizes", [(300_001, 70_001, 5, 40_000), (10_007,) * 6],
                         ids=["split", "small"])
def test_per_tensor_reductions_are_the_same_on_any_number_of_threads(name, sizes):
    """A per-tensor reduction (a trust ratio's norms, a mean, prodigy's and dadapt's sums)
    was each thread's partial over its share of the tensor, combined in thread order: a
    float64 step changed in the last bits between one thread and two or three. Each tensor
    is now reduced in pieces from its start, each by one thread, combined in order; six
    tensors of 10,007 go through vega_fused on one thread and the phases' loops on two or
    three, with the same bits."""
    gen = torch.Generator().manual_seed(5)
    params = {f"t{k}": torch.randn(n, generator=gen, dtype=torch.float64)
              for k, n in enumerate(sizes)}
    grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
             for k, v in params.items()}
    init, step = getattr(vega, f"{name}_init"), getattr(vega, f"{name}_step")
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ps, st = params, init(params)
            for _ in range(2):
                ps, st = step(ps, grads, st, backend="c")[:2]
            outs.append(torch.utils._pytree.tree_leaves((ps, st)))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_the_fused_norm_spans_parameter_groups_in_order():
    """A class's max_grad_norm is the norm over every group's gradients, summed tensor by
    tensor in the order the groups list them: the same parameters in one group or in two
    step the same bits (float64, where the norm's last bits show)."""
    gen = torch.Generator().manual_seed(4)
    sizes = [int(n) for n in torch.randint(1000, 90_000, (8,), generator=gen)]
    scales = torch.rand(8, generator=gen, dtype=torch.float64).mul(10).exp()

    def run(split):
        ps = [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(k),
                                             dtype=torch.float64))
              for k, n in enumerate(sizes)]
        for k, p in enumerate(ps):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(50 + k),
                                 dtype=torch.float64) * scales[k]
        groups = [{"params": ps[:split]}, {"params": ps[split:], "lr": 1.0}] if split else ps
        vega.optim.SGD(groups, lr=1.0, max_grad_norm=0.5, backend="c").step()
        return ps

    one = run(0)
    for split in (3, 5):
        assert all(torch.equal(a, b) for a, b in zip(one, run(split)))


FRESH_STEP = """
import sys, torch, vega
gen = torch.Generator().manual_seed(3)
params = {"big": torch.randn(100_003, generator=gen, dtype=torch.float64),
          "small": torch.randn(7, generator=gen, dtype=torch.float64)}
grads = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in params.items()}
state = vega.sgd_init(params, momentum=0.9)
for _ in range(2):
    params, state = vega.sgd_step(params, grads, state, backend="c", momentum=0.9,
                                  max_grad_norm=1.0)
torch.save((params, state), sys.argv[1])
"""


def test_a_fresh_process_with_a_cold_cache_and_three_threads_steps_the_same_bits(tmp_path):
    """The same steps (clipped by the global norm, with momentum) in a fresh process,
    its kernels compiled afresh into an empty cache and run on OMP_NUM_THREADS=3 (more
    threads than this machine may have cores) through the Python path (VEGA_NATIVE=0),
    give the bits this process gives."""
    env = {**os.environ, "VEGA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "3",
           "VEGA_NATIVE": "0"}
    subprocess.run([sys.executable, "-c", FRESH_STEP, str(tmp_path / "fresh.pt")], env=env,
                   check=True, timeout=300)
    scope = {}
    exec(compile(FRESH_STEP.replace("torch.save((params, state), sys.argv[1])", ""),
                 "fresh_step", "exec"), scope)
    got = torch.utils._pytree.tree_leaves(torch.load(tmp_path / "fresh.pt"))
    want = torch.utils._pytree.tree_leaves((scope["params"], scope["state"]))
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_one_kernel_call_per_phase_for_many_tensors_through_the_operator():
    """Multi-tensor: the native operator calls the update once per dtype group, not once per
    tensor, then the counters' advance once."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip(native.status())
    params = [torch.randn(5) for _ in range(50)] + [torch.randn(3, dtype=torch.float64)]
    state = vega.adamw_init(params)
    vega.adamw_step(params, [torch.randn_like(p) for p in params], state, backend="c")
    before = mod.entry_calls()
    vega.adamw_step(params, [torch.randn_like(p) for p in params], state, backend="c")
    assert mod.entry_calls() - before == 3  # two dtype groups' updates, one advance


def test_one_kernel_call_per_phase_for_many_tensors(monkeypatch):
    """Multi-tensor, on the Python path: the update runs once per dtype group, not once per
    tensor."""
    monkeypatch.setattr(native, "module", lambda wait=None: None)
    kern = codegen.kernel("c", vega.adamw.program())
    params = [torch.randn(5) for _ in range(50)] + [torch.randn(3, dtype=torch.float64)]
    state = vega.adamw_init(params)
    vega.adamw_step(params, [torch.randn_like(p) for p in params], state, backend="c")
    calls = []
    for key, lib in kern._libs.items():
        real = lib.vega_update

        class Counting:
            def __call__(self, *args, _real=real, _key=key):
                calls.append(_key)
                return _real(*args)
        monkeypatch.setattr(lib, "vega_update", Counting())
    vega.adamw_step(params, [torch.randn_like(p) for p in params], state, backend="c")
    assert sorted(calls) == [("float32",) * 3, ("float64",) * 3]


def test_hundreds_of_settings_keep_their_arrays():
    """The C kernel keeps an array of each group's plain hyperparameter values across steps
    for hundreds of groups (layer-wise rates): where a step held more settings than it
    kept (64), every step emptied its store and made every array again."""
    kern = codegen.kernel("c", vega.adamw.program())
    settings = [{"lr": 1e-3 * 0.98 ** k, "b1": 0.9, "b2": 0.999, "eps": 1e-8,
                 "weight_decay": 0.01 * (k % 3)} for k in range(300)]
    first = [kern._hyper_array(v) for v in settings]
    again = [kern._hyper_array(v) for v in settings]
    assert all(a is b for a, b in zip(first, again))


def test_refuses_unsupported_input_clearly():
    p = torch.zeros(3, dtype=torch.int32)
    kern = codegen.kernel("c", vega.sgd.program())
    with pytest.raises(ValueError, match="does not support parameters of dtype torch.int32"):
        values = {"lr": 1.0, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}
        kern([p], [p], [[p]], [torch.zeros((), dtype=torch.int32)], [values], True)


# -- the cache -------------------------------------------------------------------

def test_source_is_readable_c():
    text = vega.adamw.source("c")
    assert "void vega_update(" in text and "#pragma omp parallel" in text
    # the scalar phase: hoisted, in double
    assert re.search(r"d_v_\d+ = \(\(double\)1.0\) - d_h_b1", text)


def _build_in_subprocess(cache_dir, source):
    os.environ["VEGA_CACHE_DIR"] = cache_dir
    lib, path, compiled = cbuild.build(source)
    return str(path), compiled, lib.vega_key().decode()


def test_cache_reuse_corruption_and_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path))
    spec = vega.compile("optimizer cached(lr = 0.125) { p = p - lr * g * 3 }")
    source = c.Source(spec.program(), "float32", "float32", "float32").text()
    _, path, compiled = cbuild.build(source)
    assert compiled and path.parent == tmp_path / "c" and path.exists()
    _, path2, compiled2 = cbuild.build(source)
    assert path2 == path and not compiled2
    # a corrupt entry is rebuilt, not trusted (checked in a fresh process: this one has the
    # library mapped already, and writing into a mapped file is no test of anything)
    path.unlink()
    path.write_bytes(b"not a shared library")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        (path3, compiled3, key3), = pool.starmap(_build_in_subprocess, [(str(tmp_path), source)])
    assert path3 == str(path) and compiled3 and key3 == path.stem
    path.unlink()
    # two processes compiling the same kernel at once both succeed
    with ctx.Pool(2) as pool:
        results = pool.starmap(_build_in_subprocess, [(str(tmp_path), source)] * 2)
    assert results[0][0] == results[1][0] and os.path.exists(results[0][0])
    assert results[0][2] == results[1][2] == path.stem
    assert not [f for f in os.listdir(tmp_path / "c") if f.startswith(".")]  # no temporaries


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cbuild, "compiler", lambda: None)
    monkeypatch.setattr(cbuild, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert codegen.default_backend("cpu") == "reference"
        assert codegen.default_backend("cpu") == "reference"
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "no C compiler found" in messages[0]


def _answering(tmp_path, name: str):
    """A program ``name`` in a directory of its own that answers ``--version``: a compiler as
    ``find_compiler`` sees one."""
    fake = tmp_path / "bin" / name
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!/bin/sh\necho '{name} 1.0'\n")
    fake.chmod(0o700)
    return fake


@pytest.mark.parametrize("variable", ["CC", "CXX"])
@pytest.mark.parametrize("value", ["/nonexistent", "no-such-cc", "ccache gcc", "/etc/hostname"])
def test_a_compiler_named_by_the_environment_that_does_not_run_is_said_once(
        tmp_path, variable, value):
    """CC (CXX for the native operator) naming no compiler that runs (none there, not on the
    PATH, a command whose program is not on the PATH, a file that is not a program): the
    compiler taken
    instead is taken with one RuntimeWarning that names the variable, its value and that
    compiler (it was taken without a word); none where the variable names one that runs or
    is not set."""
    first, *others = ("cc", "gcc", "clang") if variable == "CC" else ("c++", "g++", "clang++")
    fallback = _answering(tmp_path, first)
    mine = _answering(tmp_path, "my-compiler")
    find = cbuild.compiler if variable == "CC" else native._cxx
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", str(fallback.parent))
        try:
            for setting, want, said in [(value, fallback, True), (str(mine), mine, False),
                                        (None, fallback, False), ("", fallback, False)]:
                if setting is None:
                    mp.delenv(variable, raising=False)
                else:
                    mp.setenv(variable, setting)
                find.cache_clear()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    assert find() == (str(want), f"{want.name} 1.0")
                    assert find() == (str(want), f"{want.name} 1.0")  # (asked once a process)
                messages = [str(w.message) for w in caught
                            if issubclass(w.category, RuntimeWarning)]
                if said:
                    assert len(messages) == 1, messages
                    assert f"{variable}={value!r} names no " in messages[0]
                    assert f"building with {fallback} instead" in messages[0]
                else:
                    assert messages == [], (setting, messages)
            mp.setenv(variable, value)
            mp.setenv("PATH", str(tmp_path / "nowhere"))
            find.cache_clear()
            with pytest.warns(RuntimeWarning, match=rf"^vega: {variable}=.* and no other "):
                assert find() is None
        finally:
            find.cache_clear()  # (asked again under this process's own environment)


@pytest.mark.parametrize("variable", ["CC", "CXX"])
def test_a_compiler_named_by_a_command_with_arguments_is_run_with_them(tmp_path, variable):
    """CC='ccache gcc' (CXX likewise), a command with arguments as make and setuptools take
    it, was refused with a warning and another compiler taken: the command is split as a
    shell splits it, run with its arguments before vega's, and named whole in the cache
    key; a path with spaces is still one program, and a command whose program does not
    run is still passed over with the warning."""
    first = "cc" if variable == "CC" else "c++"
    fallback = _answering(tmp_path, first)
    mine = _answering(tmp_path, "my-compiler")
    spaced = tmp_path / "a dir" / "my-compiler"
    spaced.parent.mkdir()
    spaced.write_bytes(mine.read_bytes())
    spaced.chmod(0o700)
    wrap = tmp_path / "bin" / "wrap"  # (a wrapper that runs the rest: ccache, env)
    wrap.write_text('#!/bin/sh\nexec "$@"\n')
    wrap.chmod(0o700)
    find = cbuild.compiler if variable == "CC" else native._cxx
    cbuild.target_cpu()  # (asked of this process's compiler, once, before CC changes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", str(fallback.parent))
        try:
            for setting, want, args in [
                    ("wrap my-compiler -O1", wrap, ("my-compiler", "-O1")),
                    (f"'{spaced}' -O1", spaced, ("-O1",)),  # (quoted, as a shell takes it)
                    (str(spaced), spaced, ()),  # (a path with spaces, unquoted: one program)
                    ("my-compiler", mine, ())]:
                mp.setenv(variable, setting)
                find.cache_clear()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    found = find()
                assert found == (str(want), "my-compiler 1.0") and found.args == args, setting
                assert cbuild.command(found) == [str(want), *args]
                assert (cbuild.shown(found) in cbuild.identity(found)) == bool(args)
            plain = find()
            mp.setenv(variable, "wrap my-compiler")
            find.cache_clear()
            if variable == "CXX":  # (the native operator's key: another command, another key)
                assert native._key(find(), []) != native._key(plain, [])
            else:
                wrapped = cbuild.key_of("int x;")
                mp.setenv(variable, "my-compiler")
                find.cache_clear()
                assert cbuild.key_of("int x;") != wrapped
            mp.setenv(variable, "wrap no-such-program")
            find.cache_clear()
            with pytest.warns(RuntimeWarning, match=rf"^vega: {variable}='wrap no-such-pro"):
                assert find() == (str(fallback), f"{first} 1.0")
        finally:
            find.cache_clear()  # (asked again under this process's own environment)


def test_kernels_build_with_a_compiler_command_and_its_arguments(tmp_path, monkeypatch):
    """A kernel built under CC='<wrapper> <compiler> <argument>': the wrapper runs the
    compiler, and the argument (here a macro the source needs) reaches it."""
    real = cbuild.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    log = tmp_path / "ran"
    wrap = tmp_path / "wrap"
    wrap.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec "$@"\n')
    wrap.chmod(0o700)
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", f"{wrap} {cbuild.shown(real)} -DVEGA_FROM_CC=7")
    cbuild.compiler.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lib, path, compiled = cbuild.build(
                'const char *vega_key(void) { return "@KEY@"; }\n'
                "int vega_from_cc(void) { return VEGA_FROM_CC; }\n")
    finally:
        cbuild.compiler.cache_clear()
    assert compiled and lib.vega_from_cc() == 7
    assert any(line.startswith(f"{real[0]} -DVEGA_FROM_CC=7 -O3")
               for line in log.read_text().splitlines())


@pytest.mark.parametrize("exponent", ["1e39", "-1e39", "1e300"])
def test_a_written_exponent_past_float32s_range_is_the_power_as_written(exponent):
    """A written exponent beyond float32's range (which float32 cannot hold: struct's pack
    overflows, c.render._float32_holds) is a power of the number as written, computed in
    double: bitwise the reference's for float32, bfloat16 and half parameters, of bases
    below, at and above 1 in magnitude, signed zeros, an infinity and a NaN."""
    spec = vega.compile(f"optimizer o() {{\n  p = g ^ {exponent}\n}}\n")
    x = torch.tensor([-1.0, 1.0, -2.0, 0.5, 0.0, -0.0, 1.5, -math.inf, -0.5, math.nan])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        p, g = {"w": torch.zeros_like(x, dtype=dtype)}, {"w": x.to(dtype)}
        want = spec.step(p, g, spec.init(p), backend="reference")[0]["w"]
        got = spec.step(p, g, spec.init(p), backend="c")[0]["w"]
        assert torch.equal(got.isnan(), want.isnan()), (dtype, got, want)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (dtype, got, want)
        assert want.isinf().any() and (want == 0).any()


def test_a_step_on_c_without_a_compiler_says_what_to_do(tmp_path, monkeypatch):
    """backend='c' asked for where no C compiler is found: a CompilerError that names the
    backend and says how to get one (CC, gcc or clang) or what else to step on (it said
    "no C compiler found"), and the parameter as it was."""
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cbuild, "compiler", lambda: None)
    monkeypatch.setattr(cbuild, "_warned", False)  # (one warning a process)
    spec = vega.compile("optimizer o(lr = 0.5) {\n  p = p - lr * g * 3\n}\n")
    p = torch.ones(5)
    with pytest.warns(RuntimeWarning, match="^vega: no C compiler found"):
        state = spec.init([p])  # (on the default backend: the reference, with the warning)
    with pytest.raises(cbuild.CompilerError, match=r"^backend 'c' compiles its kernels with a "
                       r"C compiler, and none is found here: set CC, or install gcc or "
                       r"clang; or step on backend='reference'$"):
        spec.step([p], [torch.ones(5)], state, backend="c", donate=True)
    assert torch.equal(p, torch.ones(5))


def test_compile_failure_names_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path))
    with pytest.raises(cbuild.CompilerError, match="failed on a generated kernel"):
        cbuild.build("this is not C; const char *vega_key(void) { return \"@KEY@\"; }")


def _fake_compiler(tmp_path, monkeypatch, name: str, script: str) -> None:
    """Make ``cbuild.build`` compile with the shell ``script`` (a fake compiler named
    ``name``), into a cache under ``tmp_path``."""
    fake = tmp_path / name
    fake.write_text(f"#!/bin/sh\n{script}")
    fake.chmod(0o700)
    monkeypatch.setattr(cbuild, "compiler", lambda: (str(fake), f"{name} 1"))
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path / "cache"))


def test_a_compile_past_its_time_is_a_compiler_error(tmp_path, monkeypatch):
    """A compiler that does not finish a kernel (a spec of thousands of lines gives
    megabytes of C) is stopped and said so, as a CompilerError: subprocess's
    TimeoutExpired, naming a temporary file, came out of the step; nothing is left in
    the cache."""
    _fake_compiler(tmp_path, monkeypatch, "slow-cc", "exec sleep 30\n")
    monkeypatch.setattr(cbuild, "COMPILE_TIMEOUT", 0.5)
    with pytest.raises(cbuild.CompilerError, match=r"slow-cc did not finish compiling a "
                                                   r"generated kernel \(\d+ bytes of C\) in 0.5 s"):
        cbuild.build('const char *vega_key(void) { return "@KEY@"; }\n')
    assert [f.name for f in (tmp_path / "cache" / "c").iterdir()] == []


def test_a_toolchain_without_openmp_is_said_with_what_to_do(tmp_path, monkeypatch):
    # a compiler that answers --version but cannot link -fopenmp (no libgomp, a clang
    # without libomp): the first step said "a bug in vega; please report it"
    real = cbuild.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    _fake_compiler(tmp_path, monkeypatch, "cc-without-openmp",
                   f"for a in \"$@\"; do [ \"$a\" = -fopenmp ] && "
                   f"echo 'ld: cannot find -lgomp' >&2 && exit 1; done\n"
                   f"exec {cbuild.shown(real)} \"$@\"\n")
    fake = tmp_path / "cc-without-openmp"
    with pytest.raises(cbuild.CompilerError) as caught:
        cbuild.build('const char *vega_key(void) { return "@KEY@"; }\n')
    said = str(caught.value)
    assert "cannot build vega's C kernels here" in said and "cannot find -lgomp" in said
    assert "set CC" in said and "backend='reference'" in said and "a bug" not in said
    assert [f.name for f in (tmp_path / "cache" / "c").iterdir()] == []  # nothing left
    # a probe that cannot be written (a full disk, here no directory) says nothing of the
    # compiler: the kernel's own error stands
    assert cbuild.toolchain_problem((str(fake), "1"), tmp_path / "no-such-directory") is None


@pytest.mark.parametrize("how", ["itself", "its program", "its program, in a locale",
                                 "under a shell"])
def test_a_compiler_killed_by_a_signal_is_said_as_such(tmp_path, monkeypatch, how):
    # a compiler killed while it compiles a kernel (the out-of-memory killer, with several
    # processes building at once), or gcc's driver whose cc1 was (in the words of the
    # user's locale, unless it runs in C's): the step said "a bug in vega; please report it"
    real = cbuild.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    english = "echo 'cc: fatal error: Killed signal terminated program cc1' >&2; exit 1"
    # (under a shell: a wrapper script whose compiler was killed ends with 128 + 9)
    dies = {"itself": "kill -9 $$", "its program": english,
            "under a shell": "sh -c 'kill -9 $$'; exit $?",
            "its program, in a locale": f"if [ \"$LC_ALL\" = C ]; then {english}; else echo "
                                        "'cc: erreur fatale: le signal Killed a termine le "
                                        "programme cc1' >&2; exit 1; fi"}[how]
    # killed at its first source, a compiler after (the toolchain probe's)
    _fake_compiler(tmp_path, monkeypatch, "cc-killed",
                   f"case \"$*\" in *.c\\ *) [ -e {tmp_path}/once ] || "
                   f"{{ touch {tmp_path}/once; {dies}; }};; esac\n"
                   f"exec {cbuild.shown(real)} \"$@\"\n")
    with pytest.raises(cbuild.CompilerError) as caught:
        cbuild.build('const char *vega_key(void) { return "@KEY@"; }\n')
    said = str(caught.value)
    assert {"itself": "was killed by signal 9 (SIGKILL)",
            "under a shell": "ended with status 137, a shell's word for a program killed by "
                             "signal 9 (SIGKILL)"}.get(
        how, "had the program it ran killed (Killed signal terminated program)") in said
    assert "a bug" not in said and "a later step compiles it again" in said, said
    assert [f.name for f in (tmp_path / "cache" / "c").iterdir()] == []  # nothing left


def test_a_compiler_not_started_for_want_of_memory_is_said_as_such(tmp_path, monkeypatch):
    # a kernel's compiler that could not be forked for want of memory (several processes
    # building at once): the step raised a bare OSError that named no compiler, not a
    # CompilerError (one stopped at its time limit: test_a_compile_past_its_time_...)
    real = cbuild.compiler()
    if real is None:
        pytest.skip("no C compiler here")
    run = subprocess.run

    def stopped(args, **kwargs):
        if any(str(a).endswith(".c") for a in args):  # (a kernel's source)
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return run(args, **kwargs)
    monkeypatch.setattr(cbuild.subprocess, "run", stopped)
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cbuild.CompilerError) as caught:
        cbuild.build('const char *vega_key(void) { return "@KEY@"; }\n')
    said = str(caught.value)
    assert "Cannot allocate memory" in said
    assert real[0] in said and "a later step compiles it again" in said, said
    assert [f.name for f in (tmp_path / "cache" / "c").iterdir()] == []  # nothing left


def test_default_backend_on_cpu_is_c():
    assert codegen.default_backend("cpu") == "c"
    out = subprocess.run([sys.executable, "-c", "import vega, torch; p = torch.zeros(2); "
                          "print(vega.codegen.default_backend('cpu'))"], capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "c"


def test_address_tables_follow_tensors_that_move():
    """The kernel reuses its address tables only while every address is the same."""
    ps = [torch.randn(100, requires_grad=True), torch.randn(7, 3, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    opt = vega.optim.AdamW(ps, lr=1e-2, backend="c")
    ref_opt = vega.optim.AdamW(ref, lr=1e-2, backend="reference")
    for step in range(6):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, q, g in zip(ps, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()  # new gradient tensors every step
        if step == 3:  # a parameter moved to new memory, as `p.data = ...` does
            ps[0].data = ps[0].data.clone()
            opt.state[ps[0]]["mu"] = opt.state[ps[0]]["mu"].clone()
        opt.step()
        ref_opt.step()
        for p, q in zip(ps, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_two_groups_of_one_kernel_keep_their_tables(monkeypatch):
    """On the Python path (where the native operator cannot be built, which builds a call's
    tables itself): two param groups (or optimizers) stepped by one kernel alternate, and
    each finds its own address tables again rather than rebuilding them every step."""
    monkeypatch.setattr(native, "module", lambda wait=None: None)
    kern = codegen.kernel("c", vega.adamw.program())
    built = []
    real = c.Kernel._tables
    monkeypatch.setattr(c.Kernel, "_tables",
                        lambda self, *a: built.append(self) or real(self, *a))
    a, b = [torch.randn(50, requires_grad=True)], [torch.randn(30, requires_grad=True)]
    opt = vega.optim.AdamW([{"params": a}, {"params": b, "weight_decay": 0.0}], lr=1e-2)
    other = vega.optim.AdamW([torch.randn(20, requires_grad=True)], lr=1e-2)
    for _ in range(4):
        for p in (*a, *b, *other.param_groups[0]["params"]):
            p.grad = torch.ones_like(p)  # new gradients, as a backward pass makes
        opt.step()
        other.step()
    # the first step builds two (the two groups are one call, ``_joined``); later ones reuse
    assert built.count(kern) == 2
    assert len(kern._plans) <= 64


def test_prelude_tables_follow_new_gradients():
    """The prelude keeps its tables per (sizes, dtypes, devices) and rewrites the
    addresses: new gradients every step, and a step where one parameter has none."""
    ps = [torch.randn(100, requires_grad=True), torch.randn(7, 3, requires_grad=True),
          torch.randn(5, dtype=torch.float64, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    kw = {"lr": 1e-2, "max_grad_norm": 0.5}  # (a loss scale each: one belongs to one optimizer)
    opt = vega.optim.AdamW(ps, backend="c", loss_scale=vega.LossScale.dynamic(init=4.0), **kw)
    ref_opt = vega.optim.AdamW(ref, backend="reference",
                               loss_scale=vega.LossScale.dynamic(init=4.0), **kw)
    for step in range(6):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(ps, ref):
            g = 4.0 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad, q.grad = (None, None) if step == 2 and p.dim() == 2 else (g, g.clone())
        opt.step()
        ref_opt.step()
        for p, q in zip(ps, ref):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_tables_made_under_inference_mode_serve_outside_it():
    spec = vega.adam
    params = {"w": torch.randn(40), "b": torch.randn(3)}
    state = spec.init(params)
    for inference in (True, False, True):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        with torch.inference_mode(inference):
            for kw in ({}, {"max_grad_norm": 1.0}):  # the update's tables, the prelude's
                spec.step(params, grads, state, backend="c", donate=True, **kw)
    assert int(state["step"]) == 6


def test_a_state_replaced_at_the_same_address_is_followed():
    """A tensor freed and another made may take its address: a state of another dtype, a
    smaller one, or a transposed view of itself at the old address makes new tables (or
    is refused), never a write past its end or through the old layout."""
    n = 1000
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n))
    q = torch.nn.Parameter(p.detach().clone())
    opt = vega.optim.SGD([p], lr=0.1, momentum=0.9, backend="c")
    ref = vega.optim.SGD([q], lr=0.1, momentum=0.9, backend="reference")

    def step():
        g = torch.randn(n)
        p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()

    step()
    buf = torch.zeros(2 * n, dtype=torch.bfloat16)  # 4n bytes
    v32 = buf.view(torch.float32)
    v32.copy_(opt.state[p]["v"])
    opt.state[p]["v"] = v32  # float32 state at buf's address
    step()
    v16, canary = buf[:n], buf[n:]  # bfloat16 state at the same address
    v16.copy_(ref.state[q]["v"].to(torch.bfloat16))
    canary.zero_()
    opt.state[p]["v"] = v16
    ref.state[q]["v"] = ref.state[q]["v"].to(torch.bfloat16)
    step()
    assert not canary.ne(0).any()
    torch.testing.assert_close(p, q, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[p]["v"], ref.state[q]["v"], rtol=0, atol=0)
    opt.state[p]["v"] = v16[:3]  # smaller, at the same address
    with pytest.raises(ValueError, match=r"SGD: parameter 0 of group 0: backend 'c': state "
                                         r"'v' has shape \(3,\)"):
        opt.step()


def test_a_transposed_state_at_the_same_address_steps_as_torch():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    opt = vega.optim.SGD([p], lr=0.1, momentum=0.9, backend="c")
    ref = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    for k in range(3):
        g = torch.randn(5, 5, dtype=torch.float64)
        p.grad, q.grad = g, g.clone()
        opt.step()
        ref.step()
        if k == 0:
            opt.state[p]["v"] = opt.state[p]["v"].t()
            ref.state[q]["momentum_buffer"] = ref.state[q]["momentum_buffer"].t()
    torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("lr", [0.1, lambda step: 0.1, torch.tensor(0.1, dtype=torch.float64)],
                         ids=["float", "callable", "tensor"])
def test_float64_hyperparameters_are_not_rounded_to_float32(backend, lr):
    ps = [torch.nn.Parameter(torch.ones(5, dtype=torch.float64)) for _ in range(2)]
    qs = [torch.nn.Parameter(torch.ones(5, dtype=torch.float64)) for _ in range(2)]
    opt = vega.optim.SGD(ps, lr=lr, momentum=0.9, backend=backend)
    ref = torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        ref.step()
    torch.testing.assert_close(ps[0], qs[0], rtol=1e-15, atol=1e-15)


def test_a_gradient_shrunk_behind_its_parameter_is_refused():
    """``p.grad.data = ...`` changes a gradient's size past torch's check of ``p.grad``: the
    kernel must not read the parameter's size from it."""
    p = torch.nn.Parameter(torch.zeros(64))
    p.grad = torch.ones(64)
    opt = vega.optim.SGD([p], lr=1.0, backend="c")
    opt.step()
    p.grad.data = torch.ones(4)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"SGD: the gradient of parameter 0 of group 0 has "
                                         r"shape \(4,\), but the parameter has shape \(64,\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_many_groups_of_one_kernel_keep_their_tables(monkeypatch):
    """On the Python path: layer-wise settings make a group per layer, all stepped by one
    kernel in one call, whose address tables are built once; as many optimizers stepped by
    one kernel each keep their own."""
    monkeypatch.setattr(native, "module", lambda wait=None: None)
    built = []
    real = c.Kernel._tables
    monkeypatch.setattr(c.Kernel, "_tables", lambda self, *a: built.append(1) or real(self, *a))
    groups = [{"params": [torch.randn(10, requires_grad=True)], "lr": 1e-3 * (k + 1)}
              for k in range(20)]
    opts = [vega.optim.AdamW(groups), *(vega.optim.AdamW([g]) for g in groups)]
    for _ in range(3):
        for opt in opts:  # (in turn)
            for g in groups:
                g["params"][0].grad = torch.ones(10)
            opt.step()
    assert len(built) == 1 + 20


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(_INT_OF[a.element_size()]),
        b.contiguous().view(_INT_OF[b.element_size()]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,flags", SPECS, ids=IDS)
def test_pure_step_writes_new_tensors_in_one_pass(name, flags, dtype, monkeypatch):
    """A pure step on contiguous tensors reads the old tensors and writes new ones (no
    copy first): bitwise the donated step's values, the inputs untouched; a skipped step
    returns copies, in new memory."""
    pure_against_donated(vega.builtin(name), {**hyper_values(vega.builtin(name)), **flags},
                         {k: v.contiguous() for k, v in make_params(dtype).items()},
                         monkeypatch)


def pure_against_donated(spec, hypers, params, monkeypatch):
    """Four steps of ``spec`` pure and donated from ``params``, the second to fourth with
    a loss scale and clipping, the third skipped: bitwise the same, the pure steps out of
    place."""
    outs = []  # whether each table made (in Python, or by the operator) has outputs
    tables, native_call = c.Kernel._tables, c.Kernel._native_call

    def spying(self, *args, **kw):
        outs.append(len(args) > 7 and args[7] is not None or kw.get("outs") is not None)
        return tables(self, *args, **kw)

    def spying_native(self, mod, call, *args):
        if call is mod.step:
            outs.append(bool(args[-1]))
        return native_call(self, mod, call, *args)
    monkeypatch.setattr(c.Kernel, "_tables", spying)
    monkeypatch.setattr(c.Kernel, "_native_call", spying_native)
    pure = (params, spec.init(params, **hypers))
    donated = torch.utils._pytree.tree_map(lambda x: None if x is None else x.clone(), pure)
    # a step with reductions over the group runs in stages (Kernel.staged), on copies of
    # the inputs where it is pure: not out of place in one pass, but as bitwise the same
    staged = spec.program(**hypers).spans_group
    for step in range(4):
        grads = grads_for(params, step)
        kw = {"backend": "c", **hypers}
        if step >= 1:
            kw.update(loss_scale=vega.LossScale.dynamic(init=2.0), max_grad_norm=1.0)
        if step == 2:
            big = max(grads, key=lambda k: grads[k].numel())
            grads[big].view(-1)[7] = float("inf")
        before = [x.clone() for x in _leaves(pure)]
        outs.clear()
        new = spec.step(pure[0], grads, pure[1], **kw)[:2]
        assert staged or (outs and all(outs)), "the pure step did not run out of place"
        spec.step(donated[0], grads, donated[1], donate=True, **kw)
        for x, b in zip(_leaves(pure), before):
            assert _same_bits(x, b), f"step {step}: a pure step changed an input"
        old_ptrs = {x.data_ptr() for x in _leaves(pure) if x.numel()}
        for k, (x, y) in enumerate(zip(_leaves(new), _leaves(donated))):
            assert _same_bits(x, y), f"step {step}: leaf {k}, pure against donated"
            assert not x.numel() or x.data_ptr() not in old_ptrs
        if step == 2:  # skipped
            assert all(_same_bits(x, y) for x, y in zip(_leaves(new), _leaves(pure)))
        pure = new


def _leaves(tree) -> list[torch.Tensor]:
    """The tensors of ``tree`` (a state has None where a tensor's program lacks a field)."""
    return [x for x in torch.utils._pytree.tree_leaves(tree) if x is not None]


def test_non_contiguous_gradients_are_read_while_the_kernel_runs():
    """A non-contiguous gradient is stepped from a contiguous copy, which must live until
    the kernel has run (the table holds only its address: a copy freed before the launch
    was read after other tensors had taken its memory)."""
    torch.manual_seed(0)
    for n in (8, 64, 200, 300):
        params = {"w": torch.randn(n, n), "b": torch.randn(n)}
        grads = {"w": torch.randn(n, n).t(), "b": torch.randn(2 * n)[::2]}
        for name in ("sgd", "adamw", "lion"):
            spec = vega.builtin(name)
            hypers = {"momentum": 0.9} if name == "sgd" else {}
            ref = spec.step(params, grads, spec.init(params, **hypers), backend="reference",
                            **hypers)[0]
            out = spec.step(params, grads, spec.init(params, **hypers), backend="c",
                            **hypers)[0]
            for k in params:
                assert_close(out[k], ref[k], torch.float32, f"{name} n={n} {k}")
            # the class, whose gradients are the .grad of each parameter
            ps = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            for k, p in ps.items():
                p.grad = grads[k]
            getattr(vega.optim, spec.class_name)(list(ps.values()), **hypers).step()
            for k in params:
                assert_close(ps[k].detach(), ref[k], torch.float32, f"{name} class n={n} {k}")


SIGNS = torch.tensor([float("nan"), -0.0, 0.0, 2.5, -3.0, float("inf"), -float("inf")])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sign_keeps_nan_and_signed_zeros(dtype):
    """sign(x): 1 above zero, -1 below, x itself otherwise (NaN, -0.0 and 0.0), on every
    backend; torch.sign gives 0 for NaN."""
    spec = vega.compile("optimizer signs() {\n    p = sign(g)\n}")
    params, grads = {"x": torch.ones(7, dtype=dtype)}, {"x": SIGNS.to(dtype)}
    want = torch.tensor([float("nan"), -0.0, 0.0, 1, -1, 1, -1], dtype=dtype)
    for backend in ("reference", "c"):
        got = spec.step(params, grads, spec.init(params), backend=backend)[0]["x"]
        assert got.isnan().tolist() == want.isnan().tolist(), (backend, got)
        assert _same_bits(got[1:], want[1:]), (backend, got)  # -0.0 too


# number literals beside float64 values, and where() of two bool literals
LITERALS = """optimizer literals(f = true) {
    c = where(g > 0, true, f)
    d = where(t > 1, false, true)
    p = where(c and d, min(g, 1e-3) + where(g > 1, 0.1, 0.2), max(p, 1e-3))
}"""


@pytest.mark.parametrize("f", [False, True])
def test_literals_keep_their_digits_and_types(f):
    spec = vega.compile(LITERALS)
    params = {"x": torch.tensor([1.0, -1.0, 3.0], dtype=torch.float64)}
    grads = {"x": torch.tensor([5.0, -5.0, 0.5], dtype=torch.float64)}
    ref = spec.step(params, grads, spec.init(params), backend="reference", f=f)[0]["x"]
    got = spec.step(params, grads, spec.init(params), backend="c", f=f)[0]["x"]
    assert _same_bits(got, ref) and ref[0].item() == 0.001 + 0.1


def test_a_literal_beyond_float32_is_inf_in_float32():
    """1e39 (or exp(100), folded) beside float32 values is inf there, as the C cast rounds
    it; torch refuses such a number in clamp and where, so the reference rounds it first."""
    params = {"w": torch.tensor([1.0, -2.0])}
    grads = {"w": torch.tensor([3.0, 4.0])}
    for expr in ("max(g, 1e39)", "max(g, exp(100))", "where(g > 3.5, 1e39, -1e39)",
                 "min(g, 3.4028235e38)"):
        spec = vega.compile(f"optimizer big() {{\n    p = {expr}\n}}")
        ref = spec.step(params, grads, spec.init(params), backend="reference")[0]["w"]
        got = spec.step(params, grads, spec.init(params), backend="c")[0]["w"]
        assert _same_bits(got, ref), (expr, got, ref)
    # and in float64 a number as it is
    spec = vega.compile("optimizer big() {\n    p = max(g, 1e39)\n}")
    wide = {"w": params["w"].double()}
    for backend in ("reference", "c"):
        out = spec.step(wide, {"w": grads["w"].double()}, spec.init(wide), backend=backend)
        assert out[0]["w"].tolist() == [1e39, 1e39]


NAMED_NUMBERS = """optimizer named(lr = 1.0, cap = inf, lowest = -inf, k = pi in [-pi, pi]) {
    state a = zeros
    state b = zeros
    state c = zeros
    state d = zeros
    state e = zeros
    a = min(g, inf) + max(g, lowest) - min(g, cap)
    b = where(g > 0, inf, -inf)
    c = where(g > 0, nan, g * 0 + pi)
    d = k * lr * g
    e = pi
    p = p - lr * pi * g
}"""


def named_numbers_expected(p, g):
    """What NAMED_NUMBERS computes, in torch with Python's math constants."""
    pi, inf = torch.full_like(g, math.pi), torch.full_like(g, math.inf)
    return {"p": p - (1.0 * math.pi) * g, "a": g, "c": torch.where(g > 0, math.nan, pi),
            "b": torch.where(g > 0, inf, -inf), "d": (math.pi * 1.0) * g, "e": pi}


def test_inf_nan_and_pi_are_numbers_on_every_backend():
    """inf, nan and pi in expressions, defaults and ranges: in float64 exactly Python's
    math.inf, math.nan and math.pi, on the reference and in C; in float32 both round pi
    alike."""
    spec = vega.compile(NAMED_NUMBERS)
    assert [h.default for h in spec.hypers[1:]] == [math.inf, -math.inf, math.pi]
    for dtype in (torch.float64, torch.float32):
        params = {"w": torch.tensor([2.0, -3.0, 1.0, -0.5], dtype=dtype)}
        grads = {"w": torch.tensor([1.0, -1.0, 0.25, -2.0], dtype=dtype)}
        outs = {}
        for backend in ("reference", "c"):
            new_p, new_s = spec.step(params, grads, spec.init(params), backend=backend)
            outs[backend] = {"p": new_p["w"], **{k: v["w"] for k, v in new_s.items()
                                                 if k != "step"}}
        want = named_numbers_expected(params["w"], grads["w"])
        for name, ref in outs["reference"].items():
            got = outs["c"][name]
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{dtype} {name}: {m}")
            if dtype == torch.float64:
                torch.testing.assert_close(ref, want[name], rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m: f"{name}: {m}")
        assert outs["c"]["e"].tolist() == [torch.tensor(math.pi, dtype=dtype).item()] * 4
    assert outs["c"]["e"].dtype == torch.float32


EQUAL_VALUES = """optimizer zeros(a = 0.0, b = 0.0) {
    state s = zeros
    s = max(g, 0) + 0 * min(a, b)
    p = 1 / (min(g, -p) + 0 * max(g, a)) + 1 / max(a, b) + 0 * min(a, g)
}"""


def test_min_and_max_of_equal_values_give_the_second():
    """min and max of 0.0 and -0.0 (in either order, of tensors, hyperparameters and
    literals) give the second, on every backend; NaN in either wins."""
    spec = vega.compile(EQUAL_VALUES)
    params = {"w": torch.tensor([0.0, -0.0, 1.0, float("nan")], dtype=torch.float64)}
    grads = {"w": torch.tensor([-0.0, 0.0, float("nan"), 2.0], dtype=torch.float64)}
    outs = {}
    for backend in ("reference", "c"):
        outs[backend] = spec.step(params, grads, spec.init(params), backend=backend, a=-0.0)
    ref, got = outs["reference"], outs["c"]
    assert _same_bits(got[0]["w"], ref[0]["w"]) and _same_bits(got[1]["s"]["w"], ref[1]["s"]["w"])
    # max(-0.0, 0) is the literal's +0.0; min(-0.0, -0.0) and min(0.0, 0.0) the second;
    # 1 / max(-0.0, 0.0) = inf
    assert ref[1]["s"]["w"][:2].tolist() == [0.0, 0.0]
    assert not torch.signbit(ref[1]["s"]["w"][0])


def test_a_number_over_a_value_is_one_division_on_the_reference_and_in_c():
    """``0.1 / g``: one correctly rounded division on the reference, as in C (torch's
    ``0.1 / x`` is ``x.reciprocal() * 0.1``, a unit off for a third of the values, and inf
    over a subnormal whose reciprocal overflows: 0.1 / 1e-39 is 1e38 in float32)."""
    gen = torch.Generator().manual_seed(4)
    g = torch.cat([torch.tensor([1e-39, -1e-39, 0.0, -0.0, math.inf, 3.0]),
                   torch.randn(3000, generator=gen)])
    want = torch.div(torch.tensor(0.1), g)
    spec = vega.compile("optimizer o() {\n    p = 0.1 / g\n}")
    for backend in ("reference", "c"):
        got = spec.step(torch.zeros_like(g), g, spec.init(g), backend=backend)[0]
        assert _same_bits(got, want), (backend, (got != want).sum())
    assert math.isfinite(want[0].item())


OPPOSITE_ZEROS = """optimizer opposite(a = -1.0) {
    state lo = zeros
    state hi = zeros
    state slo = zeros
    state shi = zeros
    state ssign = zeros
    state szero = zeros
    lo = min(g, p)
    hi = max(g, p)
    slo = min(log(a), 1.0) + 0 * g
    shi = max(log(a), 1.0) + 0 * g
    ssign = sign(log(a)) + 0 * g
    szero = sign(a * 0) * g
    p = p
}"""


def test_min_max_and_sign_of_zeros_and_nan_in_the_loop_and_the_scalar_phase():
    """min and max of 0.0 and -0.0 of two tensors give the second; in the scalar phase (of
    hyperparameters alone) a NaN wins min and max and sign keeps it, and sign(-0.0) is
    -0.0, in C as on the reference."""
    spec = vega.compile(OPPOSITE_ZEROS)
    params = {"w": torch.tensor([-0.0, 0.0, 1.0], dtype=torch.float64)}
    grads = {"w": torch.tensor([0.0, -0.0, 1.0], dtype=torch.float64)}
    outs = {b: spec.step(params, grads, spec.init(params), backend=b)[1]
            for b in ("reference", "c")}
    for name in ("lo", "hi", "slo", "shi", "ssign", "szero"):  # (NaNs of either sign)
        got, want = outs["c"][name]["w"], outs["reference"][name]["w"]
        assert got.isnan().tolist() == want.isnan().tolist(), name
        assert _same_bits(got[~got.isnan()], want[~want.isnan()]), name
    ref = outs["reference"]
    assert ref["lo"]["w"].tolist() == [-0.0, 0.0, 1.0] and ref["hi"]["w"].tolist()[2] == 1.0
    assert torch.signbit(ref["lo"]["w"]).tolist() == [True, False, False]
    assert torch.signbit(ref["hi"]["w"]).tolist() == [True, False, False]
    for name in ("slo", "shi", "ssign"):
        assert ref[name]["w"].isnan().all(), name
    assert torch.signbit(ref["szero"]["w"]).tolist() == [True, False, True]


def test_the_scalar_phase_is_taken_again_only_for_the_same_step_and_hyperparameters():
    """A tensor's scalar phase is computed once and taken again by the next tensor of its
    thread with bit for bit the same step and hyperparameters (``Source._scalar_phase``):
    step counters alternating in one call, a hyperparameter changed between calls at the
    same step, and -0.0 after 0.0 each step as the reference (and torch.optim) do."""
    ps = [torch.nn.Parameter(torch.randn(5, dtype=torch.float64)) for _ in range(4)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = vega.optim.AdamW(ps, lr=0.1, backend="c")
    theirs = torch.optim.AdamW(twins, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for k in range(5):  # parameters 1 and 3 step from the start, 0 and 2 from step 3
        for i, (p, q) in enumerate(zip(ps, twins)):
            g = torch.randn(5, generator=gen, dtype=torch.float64)
            p.grad, q.grad = (g.clone(), g.clone()) if k >= 3 or i % 2 else (None, None)
        ours.step()
        theirs.step()
    assert [int(ours.state[p]["step"]) for p in ps] == [2, 5, 2, 5]
    for p, q in zip(ps, twins):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)

    spec = vega.builtin("adamw")
    params = [torch.randn(7, dtype=torch.float64) for _ in range(3)]
    grads = [torch.randn(7, dtype=torch.float64) for _ in range(3)]
    _, state = spec.step(params, grads, spec.init(params), backend="reference", lr=0.1)
    for b1 in (0.9, 0.5, 0.9):  # the second step each time (the first's is b1's alone)
        got = spec.step(params, grads, state, backend="c", b1=b1, lr=0.1)
        want = spec.step(params, grads, state, backend="reference", b1=b1, lr=0.1)
        for a, b in zip(got[0], want[0]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

    signed = vega.compile("optimizer o(h = 1.0) {\n s = 1 / h\n"
                          " p = p + where(s > 0, 0.5, -0.5)\n}")
    x = [torch.zeros(3, dtype=torch.float64)]
    for h, want in ((0.0, 0.5), (-0.0, -0.5), (0.0, 0.5)):
        got, _ = signed.step(x, x, signed.init(x), backend="c", h=h)
        assert torch.equal(got[0], torch.full((3,), want, dtype=torch.float64))


@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
def test_a_staged_step_with_tensor_hyperparameters_matches_the_reference(name):
    """A rule with sums over the group (its C step staged: phases, then the update) given its
    hyperparameters as 0-d tensors steps as the reference does, over three steps, parameters
    and every state (the arrays of those values are made for the step, and were freed before
    its kernels read them: Prodigy's step came out NaN)."""
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    hypers = {"lr": torch.tensor(1.0), "weight_decay": torch.tensor(0.01),
              "b1": torch.tensor(0.9, dtype=torch.float64)}
    init, step = getattr(vega, f"{name}_init"), getattr(vega, f"{name}_step")
    got = {}
    for backend in ("reference", "c"):
        p = {k: v.clone() for k, v in params.items()}
        state = init(p)
        g2 = torch.Generator().manual_seed(1)
        for _ in range(3):
            grads = {k: torch.randn(v.shape, generator=g2) for k, v in p.items()}
            p, state = step(p, grads, state, backend=backend, **hypers)
        got[backend] = (p, state)
    (p_ref, s_ref), (p_c, s_c) = got["reference"], got["c"]
    for k in params:
        assert p_c[k].isfinite().all(), k
        assert_close(p_c[k], p_ref[k], torch.float32, f"param {k}")
    for field, leaves in s_ref.items():
        if isinstance(leaves, dict):
            for k, ref in leaves.items():
                assert_close(s_c[field][k], ref, torch.float32, f"{field}.{k}")
        else:
            assert_close(s_c[field], leaves, torch.float32, field)


def test_a_plans_new_gradients_are_looked_up_in_its_written_spans():
    """The C kernels' cached plans (the Python path, without the native operator) take a
    new gradient each step: ``_Plan.meets`` says whether one lies in memory the step writes
    (the step then names it) and not for one beside it, a shared one or a copy."""
    from vega.codegen.c.launch import _Plan
    base = torch.zeros(300)
    p, q, s = base[:100], base[200:300], torch.zeros(100)
    plan = _Plan([], (), [], None, [p, q, s], [torch.zeros(100), torch.zeros(100)])
    ptr = torch.Tensor.data_ptr
    apart = torch.zeros(100)
    assert not plan.meets([ptr(apart), ptr(apart)])
    assert not plan.meets([ptr(base[100:200]), ptr(apart)])  # (between p and q)
    assert plan.meets([ptr(apart), ptr(base[150:250])])  # (into q)
    assert plan.meets([ptr(base[1:101]), ptr(apart)])  # (p shifted by one)
    assert plan.meets([ptr(s), ptr(apart)])  # (a state)
    assert not _Plan([], (), [], None, [], []).meets([])


@pytest.mark.parametrize("native_on", ["1", "0"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_fused_reductions_of_an_empty_tensor_at_a_threads_edge(where, native_on, monkeypatch):
    """vega_fused (small tensors, each thread taking those that start in its share) gives an
    empty tensor at the edge of a thread's share, the first or the last tensor, the
    reductions of no values as the reference does (a mean NaN, a max -inf, a norm 0), as it
    gives one in the middle: the empty tensor was taken by no thread, its reductions left
    as the step found them (0, or whatever the buffer held). Through the native operator
    and through the Python path (``VEGA_NATIVE`` is read only until the operator is loaded,
    so the path is chosen here by ``native.module``, as test_native_step.py does)."""
    if native_on == "0":
        monkeypatch.setattr(native, "module", lambda wait=None: None)
    elif native.module(wait=True) is None:
        pytest.skip(native.status())
    spec = vega.compile("""optimizer o(lr = 0.1) {
        state s: scalar = zeros
        state m: scalar = zeros
        state n: scalar = zeros
        s = mean(g)
        m = max(g)
        n = norm(g)
        p = p - lr * g * n
    }""")
    sizes = [0] + [100] * 8 if where == "first" else [100] * 8 + [0]
    gen = torch.Generator().manual_seed(3)
    params = {f"t{k}": torch.randn(n, generator=gen) for k, n in enumerate(sizes)}
    grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
    empty = "t0" if where == "first" else "t8"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):  # (a buffer of the step's own, reused)
            _, got = spec.step(params, grads, spec.init(params), backend="c")
    finally:
        torch.set_num_threads(threads)
    _, want = spec.step(params, grads, spec.init(params), backend="reference")
    for field in "smn":
        torch.testing.assert_close(got[field][empty], want[field][empty], equal_nan=True,
                                   msg=f"{field} of the empty tensor")
        torch.testing.assert_close(got[field]["t1"], want[field]["t1"])


@pytest.mark.parametrize("n", [3, 40])
def test_each_hyperparameter_keys_the_kept_array_of_values(n):
    """The C kernel keeps an array of each distinct setting's values across calls, keyed by
    their bits: a change of any one of them, the last of many as the first, or of a zero's
    sign alone, is a new array."""
    names = [f"h{k}" for k in range(n)]
    spec = vega.compile(f"optimizer many({', '.join(f'{h} = 1.0' for h in names)}) {{\n"
                        f" p = p + {' + '.join(f'{k + 1} * {h}' for k, h in enumerate(names))}"
                        f" + where(1 / {names[-1]} > 0, 0.5, -0.5)\n}}")
    x = [torch.zeros(2, dtype=torch.float64)]
    base = {h: 0.0 for h in names}
    for k in (0, n - 1):
        for value in (0.0, 2.0, -0.0, 0.0):
            hypers = {**base, names[k]: value}
            got, _ = spec.step(x, x, spec.init(x), backend="c", **hypers)
            want, _ = spec.step(x, x, spec.init(x), backend="reference", **hypers)
            assert torch.equal(got[0], want[0]), (k, value)


def test_the_kernel_choices_of_the_environment_changed_mid_process_change_no_value(
        monkeypatch):
    """``VEGA_C_QUARTERS`` and ``VEGA_C_Q8_TABLE`` are read where a kernel is rendered: one
    built before a change keeps its choice, one built after takes the new one. Neither
    choice changes a value (a process holding kernels of both steps as either would alone),
    which is what makes the mix harmless: a clipped AdamW over long tensors, LAMB's trust
    ratios and 8-bit state stepped on across a change, and a spec compiled after it."""
    from vega.codegen.c import render
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(n, generator=gen) for n in (70001, 40000)]
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(4)]
    cases = [("adamw", dict(max_grad_norm=0.5)), ("lamb", {}),
             ("adamw", dict(state_dtype=torch.uint8))]

    def run(name, kw, tag, change=None):
        spec = vega.compile(vega.builtin(name).source_text + f"\n# {tag}\n")
        ps = [p.clone().requires_grad_() for p in params]
        opt = spec.optimizer_class(ps, lr=0.01, backend="c", **kw)
        for k, gs in enumerate(grads):
            if k == 2 and change is not None:
                change()
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return ps + [v for st in opt.state.values() for v in st.values()], spec

    def bits(x):
        return x.view(torch.uint8) if x.dtype.is_floating_point else x

    for name, kw in cases:
        for first, then in (("1", "0"), ("0", "1")):
            monkeypatch.setenv("VEGA_C_QUARTERS", then)
            monkeypatch.setenv("VEGA_C_Q8_TABLE", then)
            want, _ = run(name, kw, f"all {then}")
            monkeypatch.setenv("VEGA_C_QUARTERS", first)
            monkeypatch.setenv("VEGA_C_Q8_TABLE", first)

            def change():
                monkeypatch.setenv("VEGA_C_QUARTERS", then)
                monkeypatch.setenv("VEGA_C_Q8_TABLE", then)
            got, spec = run(name, kw, f"{first} then {then}", change)
            assert f"#define SPLIT_MIN {'16384' if then == '1' else 'INT64_MAX'} " in \
                spec.source("c")  # (rendered again now: the new choice)
            assert render.split_min() == ("16384" if then == "1" else "INT64_MAX")
            for a, b in zip(got, want):
                assert torch.equal(bits(a), bits(b)), (name, kw, first)


# (the start of the scripts below: a step's tensors, its reference result, the path chosen)
STEP_SCRIPT = r"""
import sys
import torch
import torch._dynamo  # (what an optimizer class imports at its first use: once, in the server)
import vega
from torch.func import functionalize
from vega.codegen.c import launch, native
how, path = sys.argv[1:3]
if path == "python":
    native.module = lambda wait=None: None
gen = torch.Generator().manual_seed(0)
w = torch.randn(4, 5, dtype=torch.float64, generator=gen)
g = torch.randn(4, 5, dtype=torch.float64, generator=gen)
want, _ = vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3,
                          backend="reference")
"""


def _run_step_script(script: str, how: str, path: str) -> None:
    """``script`` (``STEP_SCRIPT``'s) run in a fresh process with ``how`` and ``path``
    ("native" or "python"); it must print ok. (A child of a server that has made
    ``STEP_SCRIPT``'s imports: tests/forks.py.)"""
    if cbuild.compiler() is None:
        pytest.skip("no C compiler here")
    if path == "native" and native.module(wait=True) is None:
        pytest.skip(native.status())
    repo = os.path.abspath(os.path.join(os.path.dirname(vega.__file__), ".."))
    env = {**os.environ, "PYTHONPATH": repo, "VEGA_NATIVE": "sync"}
    run = forks.run(script, how, path, env=env, timeout=600,
                    imports=("torch", "torch._dynamo", "vega", "torch.func",
                             "vega.codegen.c.launch", "vega.codegen.c.native"))
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], run.stderr[-3000:]


KEPT_HYPERS = STEP_SCRIPT + r"""
if how == "meta":  # a step under a default device other than the CPU
    with torch.device("meta"):
        got, _ = vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3,
                                 backend="c")
    assert got["w"].device.type == "cpu"
    torch.testing.assert_close(got["w"], want["w"], rtol=1e-12, atol=1e-14)
else:  # the hyperparameter array of a call made under functionalize, as a step makes it
    seen = []
    made = launch.Kernel._hyper_tables
    launch.Kernel._hyper_tables = lambda self, values: seen.append((self, values)) or \
        made(self, values)
    vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3, backend="c")
    launch.Kernel._hyper_tables = made
    kernel, values = seen[-1]
    kernel._hyp_cache.clear()
    functionalize(lambda x: (kernel._hyper_tables(values), x)[1])(torch.zeros(2))
got, _ = vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3, backend="c")
torch.testing.assert_close(got["w"], want["w"], rtol=1e-12, atol=1e-14)
p = torch.nn.Parameter(w.clone())
p.grad = g.clone()
vega.optim.AdamW([p], lr=0.3, backend="c").step()
torch.testing.assert_close(p.detach(), want["w"], rtol=1e-12, atol=1e-14)
print("ok")
"""


@pytest.mark.parametrize("path", ["native", "python"])
@pytest.mark.parametrize("how", ["meta", "functionalize"])
def test_a_hyperparameter_array_made_under_a_mode_is_not_kept(how, path):
    """A kernel's hyperparameter arrays, kept across its calls, are plain CPU tensors: one made
    under ``torch.device("meta")`` (or a default device set so) was a meta tensor, and one
    made under ``torch.func.functionalize`` a wrapper without memory, both of address 0,
    kept for every later step of the kernel, of any optimizer, which read its
    hyperparameters there and crashed (a segmentation fault, in the native operator or the
    Python path). In a fresh process: the crash would take the test session with it."""
    _run_step_script(KEPT_HYPERS, how, path)


NO_MEMORY = STEP_SCRIPT + r"""
from torch._subclasses.fake_tensor import FakeTensorMode
p = torch.nn.Parameter(w.clone())
p.grad = g.clone()
opt = vega.optim.AdamW([p], lr=0.3, backend="c")
refused = None
if how == "fake-functional":  # a functional step of real tensors under FakeTensorMode
    state = vega.adamw_init({"w": w})
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            vega.adamw_step({"w": w}, {"w": g}, state, lr=0.3, backend="c")
    except ValueError as e:
        refused = str(e)
elif how == "fake-class":  # a class step there, after one outside (its tables kept), of
    q = torch.nn.Parameter(w.clone())  # a new lr (its hyperparameters' array made there)
    q.grad = g.clone()
    other = vega.optim.AdamW([q], lr=0.2, backend="c")
    other.step()
    other.param_groups[0]["lr"] = 0.25
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            other.step()
    except ValueError as e:
        refused = str(e)
elif how == "fake-record":  # a clipped functional step there, after one outside (the
    state = vega.adamw_init({"w": w})  # prelude's tables kept): its record made there
    vega.adamw_step({"w": w}, {"w": g}, state, lr=0.3, backend="c", max_grad_norm=1.0)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            vega.adamw_step({"w": w}, {"w": g}, state, lr=0.3, backend="c", max_grad_norm=1.0)
    except ValueError as e:
        refused = str(e)
    assert "the prelude's record" in refused, refused
else:  # the operator given a hyperparameter row or a step counter without memory
    mod = native.module(wait=True)
    seen = []
    made = launch.Kernel._hyper_tables
    launch.Kernel._hyper_tables = lambda self, values: seen.append((self, made(self, values)))\
        or seen[-1][1]
    vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3, backend="c")
    launch.Kernel._hyper_tables = made
    kernel, (hyp, _) = seen[-1]
    x, s = w.clone(), [torch.zeros_like(w), torch.zeros_like(w)]
    plain = torch.zeros((), dtype=torch.int32)

    def call(_):  # (a tensor made here is functionalize's wrapper, of address 0)
        rows = [torch.tensor(hyp[0].tolist(), dtype=torch.float64)] if how == "hyper" else hyp
        counter = torch.zeros((), dtype=torch.int32) if how == "counter" else plain
        record = torch.zeros(8, dtype=torch.float64) if how == "record" else None
        mod.step(kernel.id, [x], [g], s, [counter], [0], rows, None, record, [], [])
        return _
    try:
        functionalize(call)(torch.zeros(2))
    except ValueError as e:
        refused = str(e)
    assert refused is not None and ("no storage" in refused or "record" in refused), refused
    assert torch.equal(x, w)
if how.startswith("fake"):
    assert refused is not None and "FakeTensor" in refused, refused
got, _ = vega.adamw_step({"w": w}, {"w": g}, vega.adamw_init({"w": w}), lr=0.3, backend="c")
torch.testing.assert_close(got["w"], want["w"], rtol=1e-12, atol=1e-14)
opt.step()
torch.testing.assert_close(p.detach(), want["w"], rtol=1e-12, atol=1e-14)
print("ok")
"""


@pytest.mark.parametrize("how,path", [("fake-functional", "native"), ("fake-functional", "python"),
                                      ("fake-class", "native"), ("fake-class", "python"),
                                      ("fake-record", "native"), ("fake-record", "python"),
                                      ("hyper", "native"), ("counter", "native"),
                                      ("record", "native")])
def test_a_step_of_tensors_without_memory_is_refused_by_name(how, path):
    """A step whose own tensors have no memory (its outputs, step counters, hyperparameter
    rows and prelude's record made under FakeTensorMode, of real parameters; a row, counter
    or record that functionalize wraps, handed to the native operator) is refused with a ValueError
    naming the tensor, and later steps step as ever: the kernels read and wrote at address 0
    (a segmentation fault, in the native operator or the Python path). In a fresh process:
    the crash would take the test session with it."""
    _run_step_script(NO_MEMORY, how, path)


def test_a_compiler_that_finds_no_room_is_said_as_such(tmp_path, monkeypatch):
    # a kernel's compiler whose files found no room (a full disk or quota): the toolchain
    # probe, which fails the same way, said the compiler "cannot build vega's C kernels here"
    # and to install what it lacks (libgomp, the C library's headers); a probe that could not
    # be written said "a bug in vega; please report it"
    _fake_compiler(tmp_path, monkeypatch, "cc-full",
                   "echo '/usr/bin/ld: final link failed: No space left on device' >&2\n"
                   "echo 'collect2: error: ld returned 1 exit status' >&2; exit 1\n")
    with pytest.raises(cbuild.CompilerError) as caught:
        cbuild.build('const char *vega_key(void) { return "@KEY@"; }\n')
    said = str(caught.value)
    assert "final link failed: No space left on device" in said, said
    assert "free some space" in said and "a later step compiles it again" in said, said
    assert "a bug" not in said and "cannot build vega's C kernels" not in said, said
    assert [f.name for f in (tmp_path / "cache" / "c").iterdir()] == []  # nothing left
