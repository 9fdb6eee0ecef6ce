"""The Triton backend against the reference, under Triton's CPU interpreter.

Without a GPU the kernels run in Triton's interpreter on CPU tensors, which
needs ``TRITON_INTERPRET=1`` in the environment before triton is first
imported (``torch._dynamo`` imports it); this module sets it before its own
imports, which is enough when it runs first or alone (else set the variable in
the environment). On a machine with CUDA it leaves the variable alone and runs
on the GPU. The interpreter runs every program in Python, about a millisecond
each: tensors are small and blocks large.
"""
import contextlib
import math
import os
import re

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch._dynamo.testing  # imports triton

import triton  # noqa: E402,F401  (a dependency on Linux: missing fails, never skips)

import vega  # noqa: E402
from vega import codegen, schedule  # noqa: E402
from vega.codegen import triton as triton_backend  # noqa: E402
from vega.codegen import triton_runtime  # noqa: E402
from vega.codegen.record import make_pre  # noqa: E402

from tests import forks  # noqa: E402

assert codegen.BACKENDS["triton"] is triton_backend
DEVICE = "cpu" if triton_runtime.interpreting() else "cuda"
if DEVICE == "cpu" and not triton_runtime.library_interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run with "
                "TRITON_INTERPRET=1 in the environment", allow_module_level=True)

# every setting of the bool hyperparameters; and the programs without a momentum buffer
# (hyper_values gives momentum 0.01); of the programs this backend compiles (nadam's,
# novograd's and schedule_free_adamw's states of one number per tensor included, and
# prodigy's and dadapt_adamw's reductions over the group, in the kernels' phases)
SPECS = [(name, flags) for name in vega.builtin_names()
         for flags in vega.builtin(name)._spec.flag_settings()
         if not vega.builtin(name)._spec.program(flags).torch_only] + [
    (name, {"momentum": 0.0}) for name in ("sgd", "rmsprop")]
IDS = [n + "[" + (",".join(k if v is True else f"{k}={v}" for k, v in f.items()
                          if v is not False) or "plain") + "]" for n, f in SPECS]

# (rtol, atol) against the reference, by parameter dtype
TOL = {torch.float64: (1e-12, 1e-14), torch.float32: (1e-5, 1e-6),
       torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-2, 1e-3)}


def make_params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)

    return {"vector": randn(1000), "matrix": randn(37, 41), "scalar": randn(()), "one": randn(1),
            "empty": randn(0, 3), "transposed": randn(9, 13).t()}


def grads_for(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(100 + step)
    return {k: (scale * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            .to(p.dtype).to(DEVICE) for k, p in params.items()}


def hyper_values(spec):
    """Non-default, in-range values for every float hyperparameter."""
    return {h.name: h.default * 0.9 if h.default != 0 else 0.01
            for h in spec.hypers if h.type == "float"}


def assert_close(a, b, what):
    rtol, atol = TOL[b.dtype]
    scale = b.double().abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol * max(1.0, scale),
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_same(a, b, what):
    """Bitwise equal (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def leaves(params, state):
    yield from (("p." + k, v) for k, v in params.items())
    for field, tree in state.items():
        if field == "step":
            yield "step", tree
        else:
            # (None where a tensor's program lacks the field: muon's buf of a vector)
            yield from ((f"{field}.{k}", v) for k, v in tree.items() if v is not None)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("name,flags", SPECS, ids=IDS)
def test_matches_reference_5_steps(name, flags, fused):
    """Every shipped spec, float32, 5 steps; fused: clipping, skip-on-overflow and a NaN
    gradient at step 3 that must leave everything bitwise unchanged."""
    spec = vega.builtin(name)
    hypers = {**hyper_values(spec), **flags}
    options = {"max_grad_norm": 1.0, "skip_nonfinite": True} if fused else {}
    params = make_params()
    ref = (params, spec.init(params, **hypers))
    tri = (params, spec.init(params, **hypers))
    for step in range(5):
        grads = grads_for(params, step)
        if fused and step == 3:
            grads["matrix"][5, 7] = float("nan")
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", **options, **hypers)
        before = tri
        tri = spec.step(*tri[:1], grads, tri[1], backend="triton", **options, **hypers)
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            assert a.dtype == b.dtype and a.shape == b.shape, what
            if what == "step":
                assert torch.equal(a, b), what
            else:
                assert_close(a, b, f"{name} step {step} {what}")
        if fused and step == 3:
            for (what, a), (_, b) in zip(leaves(*tri), leaves(*before)):
                assert_same(a, b, f"skipped step changed {what}")


@pytest.mark.parametrize("name", ["adamw", "lamb", "prodigy"])
def test_donate_matches_pure_and_updates_in_place(name):
    spec = vega.builtin(name)
    params = make_params()
    state = spec.init(params)
    pure = (params, state)
    donated = ({k: v.clone() for k, v in params.items()},
               {f: (v.clone() if f == "step" else {k: x.clone() for k, x in v.items()})
                for f, v in state.items()})
    objects = [id(v) for _, v in leaves(*donated)]
    for step in range(3):
        grads = grads_for(params, step)
        pure = spec.step(pure[0], grads, pure[1], backend="triton", max_grad_norm=0.5)
        out = spec.step(donated[0], grads, donated[1], backend="triton", max_grad_norm=0.5,
                        donate=True)
        assert [id(v) for _, v in leaves(*out)] == objects
        for (what, a), (_, b) in zip(leaves(*donated), leaves(*pure)):
            assert_same(a, b, what)
    # the pure steps left their inputs alone
    assert all(torch.equal(params[k], make_params()[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
def test_other_dtypes_match_reference(name, dtype):
    """float64 in float64; bfloat16 and float16 parameters with float32 state and arithmetic."""
    spec = vega.builtin(name)
    params = make_params(dtype)
    ref = (params, spec.init(params))
    tri = (params, spec.init(params))
    for step in range(3):
        grads = grads_for(params, step)
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", lr=1e-2)
        tri = spec.step(*tri[:1], grads, tri[1], backend="triton", lr=1e-2)
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            assert a.dtype == b.dtype, what
            if what != "step":
                assert_close(a, b, f"{dtype} {what}")


def test_loss_scale_matches_reference():
    """float16 parameters, gradients scaled by a dynamic loss scale, an overflow at step 2:
    unscaled, clipped and skipped in the fused step as in the reference; same scale after."""
    spec = vega.builtin("adamw")
    params = make_params(torch.float16)
    scale = vega.LossScale.dynamic(init=2.0**10, growth_interval=2)
    ref = (params, spec.init(params), scale)
    tri = (params, spec.init(params), scale)
    for step in range(4):
        grads = {k: (g.float() * 2.0**10).to(g.dtype) for k, g in grads_for(params, step).items()}
        if step == 2:
            grads["vector"][3] = float("inf")
        ref = spec.step(ref[0], grads, ref[1], backend="reference", loss_scale=ref[2],
                        max_grad_norm=1.0)
        tri = spec.step(tri[0], grads, tri[1], backend="triton", loss_scale=tri[2],
                        max_grad_norm=1.0)
        for (what, a), (_, b) in zip(leaves(*tri[:2]), leaves(*ref[:2])):
            if what == "step":
                assert torch.equal(a, b), what
            else:
                assert_close(a, b, f"step {step} {what}")
        assert torch.equal(tri[2].loss_scale, ref[2].loss_scale)
    assert int(tri[1]["step"]) == 3


def test_bfloat16_rounds_to_nearest_even():
    """A float32 value halfway between two bfloat16 numbers rounds to the even one (the
    interpreter's own cast truncates)."""
    spec = vega.compile("optimizer o() { p = g }")
    g = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-7 + 2**-9, 3.4e38,
                      float("inf"), -0.0, 1e-40], dtype=torch.float32, device=DEVICE)
    p = torch.zeros(len(g), dtype=torch.bfloat16, device=DEVICE)
    out, _ = spec.step(p, g, spec.init(p), backend="triton")
    assert_same(out, g.to(torch.bfloat16), "bfloat16 rounding")
    assert out[:2].tolist() == [1.0, 1.015625]



@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_a_nan_of_any_payload_stays_a_nan_in_bfloat16(stochastic):
    """A float32 NaN whose payload is all ones (0x7FFFFFFF, 0xFFFFFFFF), or only its low
    bits (0x7F800001), stored as bfloat16 is a NaN, as torch's cast gives, rounded to
    nearest or stochastically: its bits plus the rounding's carry into the sign (-0.0) or
    clear the payload (inf)."""
    spec = vega.compile("optimizer o() { p = g }")
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000], dtype=torch.int32)
    g = bits.view(torch.float32).to(DEVICE)
    p = torch.zeros(len(g), dtype=torch.bfloat16, device=DEVICE)
    kw = {"stochastic_rounding": True, "rounding_seed": 3} if stochastic else {}
    out, _ = spec.step(p, g, spec.init(p), backend="triton", **kw)
    assert out.isnan().all(), out.view(torch.int16).tolist()


EVERY_OP = """
    optimizer odd(lr = 0.1, k = 1.5, c = 2.0) {
        state m = zeros
        state s = 1
        state q = lr * 2
        a = max(abs(g), 0.001) ^ k
        m = where(g > 0 and not (p < 0) or t > 3, min(m + a, 10), -sign(g) * exp(-abs(g)))
        s = rsqrt(s + log(1 + g * g)) + mean(p) - sum(g) / 100 + max(g) + clamp(g, -1, 1)
        q = lr * c ^ t + max(m)
        p = p - lr * (m + s * 0.01 + q) / (norm(g) + 1) + norm(m * 0.001)
    }"""


def test_mixed_dtypes_and_every_op():
    """A user spec with every operation and reduction, over float32, bfloat16 and float64
    parameters in one step (one dtype group each)."""
    spec = vega.compile(EVERY_OP)
    base = make_params()
    params = {"f32": base["matrix"], "empty": base["empty"], "scalar": base["scalar"],
              "bf16": base["vector"].to(torch.bfloat16), "f64": base["one"].double()}
    ref = (params, spec.init(params))
    tri = (params, spec.init(params))
    for step in range(4):
        grads = grads_for(params, step)
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", c=1.5)
        tri = spec.step(*tri[:1], grads, tri[1], backend="triton", c=1.5)
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            if what != "step":
                assert_close(a, b, f"step {step} {what}")


def test_names_the_kernels_use_are_renamed():
    """Spec names that the generated code uses for itself (mask, offsets, finite, P, i,
    p_ptr, a column's name) or that Python reserves (lambda) are renamed, not shadowed."""
    spec = vega.compile("""
    optimizer o(mask = 0.5, lambda = 0.1, i = 2.0, P = 1.0) {
        state offsets = zeros
        state p_ptr = 1
        finite = g * i
        offsets = offsets * mask + finite
        p_ptr = p_ptr * P
        S_OFFSETS = lambda * offsets ^ 2
        p = p - S_OFFSETS * p_ptr + norm(offsets)
    }""")
    params = make_params()
    ref = (params, spec.init(params))
    tri = (params, spec.init(params))
    for step in range(2):
        grads = grads_for(params, step)
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", skip_nonfinite=True)
        tri = spec.step(*tri[:1], grads, tri[1], backend="triton", skip_nonfinite=True)
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            if what != "step":
                assert_close(a, b, what)


def test_complex_parameters_step_as_two_real_coordinates():
    spec = vega.builtin("adamw")
    base = make_params()["vector"]
    params = {"z": torch.complex(base[:100], base[100:200]), "w": base[200:300]}
    ref = (params, spec.init(params))
    tri = (params, spec.init(params))
    for step in range(3):
        grads = {"z": params["z"] * (0.5 + step), "w": grads_for(params, step)["w"]}
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference")
        tri = spec.step(*tri[:1], grads, tri[1], backend="triton")
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            assert a.dtype == b.dtype, what
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class Launches:
    """Counts kernel launches (every launch goes through triton_runtime.launch)."""

    def __init__(self, monkeypatch):
        self.names = []
        launch = triton_runtime.launch

        def counting(fn, grid, *args, **meta):
            self.names.append(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
            launch(fn, grid, *args, **meta)
        monkeypatch.setattr(triton_runtime, "launch", counting)


@pytest.mark.parametrize("name,donate", [("lamb", False), ("sgd", True), ("prodigy", True)])
def test_launches_per_step_do_not_grow_with_tensors(monkeypatch, name, donate):
    """One launch per phase for all tensors: the same launches for 3 tensors as for 300
    (prodigy's sums over the group too: each tensor's part in a phase, summed between
    launches)."""
    spec = vega.builtin(name)
    counts, launches = {}, Launches(monkeypatch)
    for n in (3, 300):
        params = {f"w{i}": torch.randn(5 + i % 7, device=DEVICE) for i in range(n)}
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        launches.names.clear()
        spec.step(params, grads, spec.init(params), backend="triton", max_grad_norm=1.0,
                  skip_nonfinite=True, donate=donate)
        counts[n] = list(launches.names)
    k = f"vega_{name}"  # the kernels' names begin with it
    phases = [f"{k}_phase0", f"{k}_finish0"] if name != "sgd" else []
    # (this step's scalars once, then the update, which advances the counters too)
    assert counts[3] == counts[300] == [f"{k}_prelude", f"{k}_scalars",
                                        *phases, f"{k}_update"]


def test_optimizer_class_launches_do_not_grow(monkeypatch):
    """torch.optim classes keep a step counter per parameter: one scalars launch for all, and
    the update advances every counter."""
    counts, launches = {}, Launches(monkeypatch)
    for n in (3, 300):
        ws = [torch.nn.Parameter(torch.randn(4, device=DEVICE)) for _ in range(n)]
        opt = vega.builtin("sgd").optimizer(ws, lr=0.1, momentum=0.9, backend="triton")
        before = [w.detach().clone() for w in ws]
        for w in ws:
            w.grad = torch.ones_like(w)
        opt.step()
        launches.names.clear()
        opt.step()
        counts[n] = list(launches.names)
        for w, w0 in zip(ws, before):  # v = 1, then 1.9: w moves by 0.1 + 0.19
            torch.testing.assert_close(w.detach(), w0 - 0.29)
        assert all(int(opt.state[w]["step"]) == 2 for w in ws)
    assert counts[3] == counts[300] == ["vega_sgd_scalars", "vega_sgd_update"]


def test_a_traced_step_never_asks_whether_a_cuda_graph_is_being_captured(monkeypatch):
    """dynamo cannot trace ``torch.cuda.is_current_stream_capturing`` (a graph break: on a
    GPU, ``fullgraph=True`` failed in ``make_pre``). Under torch.compile the prelude's record
    and the settings tensors are made by the graph, and the question is never asked."""
    from vega.codegen import record

    def refuse():
        raise AssertionError("is_current_stream_capturing asked under torch.compile")
    real = torch.tensor
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", refuse)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(record, "_new_pre", lambda device, *rest: ("new", device))
    monkeypatch.setattr(torch, "tensor", lambda values, dtype, device: real(
        values, dtype=dtype, device="meta"))  # (no CUDA here: what it makes, on meta)
    cuda = torch.device("cuda")
    assert record.make_pre(cuda, None, 1.0, True) == ("new", cuda)
    made = triton_runtime.settings(cuda, 1.0, True)
    assert made.device.type == "meta" and made.shape == (3,)


def test_compiles_once_as_the_rate_changes():
    """The kernel as torch custom ops: a step with the rate from a schedule on the step
    tensor traces in one graph, is not recompiled as the rate changes, and matches eager."""
    program = vega.builtin("adamw").program()
    kern = codegen.kernel("triton", program)
    sched = schedule.warmup_cosine_decay(0.0, 1e-2, 2, 10)

    def step_fn(params, grads, states, step):
        vals = {"lr": sched(step), "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
        pre = make_pre(step.device, None, 1.0, True)
        kern.prelude(grads, pre)
        new_p, new_s, new_t, finite = kern(params, grads, states, [step] * len(params),
                                           [vals] * len(params), False, pre)
        return new_p, new_s, new_t[0], finite

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step_fn, backend=counter, fullgraph=True)
    params = [torch.randn(100, device=DEVICE), torch.randn(7, 3, device=DEVICE)]
    eager = (params, [[torch.zeros_like(p) for p in params] for _ in range(2)],
             torch.zeros((), dtype=torch.int32, device=DEVICE))
    comp = eager
    frames = None
    for k in range(4):
        grads = [torch.randn_like(p) for p in params]
        if k == 2:
            grads[1][0, 0] = float("inf")
        eager = step_fn(eager[0], grads, eager[1], eager[2])
        comp = compiled(comp[0], grads, comp[1], comp[2])
        frames = frames or counter.frame_count
        assert bool(comp[3]) == (k != 2)
        for a, b in zip([*comp[0], *comp[1][0], *comp[1][1], comp[2]],
                        [*eager[0], *eager[1][0], *eager[1][1], eager[2]]):
            assert_same(a, b, f"compiled step {k}")
    assert counter.frame_count == frames  # compiled on the first call only
    assert int(comp[2]) == 3


def test_source_reads_like_the_tutorial():
    text = vega.builtin("lamb").source("triton")
    compile(text, "<lamb>", "exec")
    assert "BLOCK: tl.constexpr" in text and "@triton.jit" in text
    for line in text.splitlines():
        assert len(line) <= 100, line
        if re.search(r"tl\.(load|store)\(\w+ \+ (offsets|blocks)", line):
            assert "mask=mask" in line, f"unmasked: {line}"
    signature = False
    for line in text.splitlines():
        signature = signature or line.startswith("def ")
        if signature and line.startswith("    ") and line.rstrip().endswith(","):
            assert "  # " in line, f"argument without a comment: {line}"
        if line.startswith("):"):
            signature = False


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("runs on the GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        vega.sgd_step(p, torch.ones(3), vega.sgd_init(p), backend="triton")


@pytest.mark.parametrize("value", ["1", "true", "Yes", "ON", "y", "0", "no", "off", "2",
                                   " 1", ""])
def test_the_interpreter_is_on_where_triton_says_so(monkeypatch, value):
    """``interpreting()`` reads TRITON_INTERPRET as Triton does: "no" or "2" is off for
    Triton, which compiles for the GPU, where the runtime took them for on (it refused CUDA
    tensors, and on the CPU said the variable was set too late)."""
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_runtime.interpreting() == bool(knobs.runtime.interpret)


def test_refuses_a_misshaped_state_before_launching():
    """A state smaller than its parameter would be read and written past its end."""
    p = torch.nn.Parameter(torch.randn(1000, device=DEVICE))
    opt = vega.optim.SGD([p], lr=0.1, momentum=0.9, backend="triton")
    p.grad = torch.randn(1000, device=DEVICE)
    opt.step()
    opt.state[p]["v"] = torch.zeros(3, device=DEVICE)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"SGD: parameter 0 of group 0: backend 'triton': "
                                         r"state 'v' has shape \(3,\), but its parameter, of "
                                         r"shape \(1000,\), needs \(1000,\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


def test_optimizer_class_with_a_schedule_and_counters_that_differ(monkeypatch):
    """A schedule's values arrive as one table (a row per counter), taken as it is (not
    a 0-d tensor per value); a parameter that missed a step reads its own row."""
    given = []
    real = triton_runtime._hyper_array
    monkeypatch.setattr(triton_runtime, "_hyper_array",
                        lambda device, n, d, tensors, *a: given.append(len(tensors))
                        or real(device, n, d, tensors, *a))
    gen = torch.Generator().manual_seed(0)
    shapes = [(1000,), (37, 41), ()]
    lr = schedule.linear(1e-2, 1e-3, 4)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = vega.optim.AdamW(ours, lr=lr, backend="triton")
    ref_opt = vega.optim.AdamW(ref, lr=lr, backend="reference")
    for k in range(4):
        for i, (p, q) in enumerate(zip(ours, ref)):
            g = torch.randn(p.shape, generator=gen).to(DEVICE)
            p.grad, q.grad = (None, None) if (k, i) in {(1, 1), (2, 2)} else (g, g.clone())
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert torch.equal(opt.state[p]["step"], ref_opt.state[q]["step"])
    assert [int(opt.state[p]["step"]) for p in ours] == [4, 3, 3]
    assert given and set(given) == {1}


def test_a_state_set_to_a_reduction():
    """A new value that is a per-tensor reduction itself (s = norm(g)), read by the update
    from its phase."""
    from .test_c import REDUCED_STATE
    spec = vega.compile(REDUCED_STATE)
    params = make_params()
    ref, tri = (params, spec.init(params)), (params, spec.init(params))
    for step in range(2):
        grads = grads_for(params, step)
        ref = spec.step(ref[0], grads, ref[1], backend="reference")
        tri = spec.step(tri[0], grads, tri[1], backend="triton")
        for (name, x), (_, y) in zip(leaves(*tri), leaves(*ref)):
            if name == "step":
                assert torch.equal(x, y)
            else:
                assert_close(x, y, f"step {step} {name}")


def test_sign_keeps_nan_and_signed_zeros():
    from .test_c import SIGNS
    spec = vega.compile("optimizer signs() {\n    p = sign(g)\n}")
    params, grads = {"x": torch.ones(7, device=DEVICE)}, {"x": SIGNS.to(DEVICE)}
    got = spec.step(params, grads, spec.init(params), backend="triton")[0]["x"]
    ref = spec.step(params, grads, spec.init(params), backend="reference")[0]["x"]
    assert_same(got, ref, "sign")


def test_inf_nan_and_pi_are_numbers():
    """Triton's float("inf"), float("nan") and pi's digits: the reference's values, and in
    float64 Python's."""
    from .test_c import NAMED_NUMBERS, named_numbers_expected
    spec = vega.compile(NAMED_NUMBERS)
    for dtype in (torch.float64, torch.float32):
        params = {"w": torch.tensor([2.0, -3.0, 1.0, -0.5], dtype=dtype, device=DEVICE)}
        grads = {"w": torch.tensor([1.0, -1.0, 0.25, -2.0], dtype=dtype, device=DEVICE)}
        ref = spec.step(params, grads, spec.init(params), backend="reference")
        tri = spec.step(params, grads, spec.init(params), backend="triton")
        want = named_numbers_expected(params["w"], grads["w"])
        for (name, x), (_, y) in zip(leaves(*tri), leaves(*ref)):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{dtype} {name}: {m}")
        if dtype == torch.float64:
            assert tri[1]["e"]["w"].tolist() == [math.pi] * 4
            torch.testing.assert_close(tri[0]["w"], want["p"], rtol=0, atol=0)


@pytest.mark.parametrize("f", [False, True])
def test_literals_keep_their_digits_and_types(f):
    """A float literal in min, max or where is not rounded to float32 beside float64."""
    from .test_c import LITERALS
    spec = vega.compile(LITERALS)
    params = {"x": torch.tensor([1.0, -1.0, 3.0], dtype=torch.float64, device=DEVICE)}
    grads = {"x": torch.tensor([5.0, -5.0, 0.5], dtype=torch.float64, device=DEVICE)}
    ref = spec.step(params, grads, spec.init(params), backend="reference", f=f)[0]["x"]
    got = spec.step(params, grads, spec.init(params), backend="triton", f=f)[0]["x"]
    assert_same(got, ref, "literals")


def test_min_and_max_of_equal_values_give_the_second():
    from .test_c import EQUAL_VALUES
    spec = vega.compile(EQUAL_VALUES)
    params = {"w": torch.tensor([0.0, -0.0, 1.0, float("nan")], dtype=torch.float64,
                                device=DEVICE)}
    grads = {"w": torch.tensor([-0.0, 0.0, float("nan"), 2.0], dtype=torch.float64,
                               device=DEVICE)}
    ref = spec.step(params, grads, spec.init(params), backend="reference", a=-0.0)
    tri = spec.step(params, grads, spec.init(params), backend="triton", a=-0.0)
    for (name, x), (_, y) in zip(leaves(*tri), leaves(*ref)):
        nan = x.isnan()
        assert torch.equal(nan, y.isnan()), name
        assert_same(x[~nan], y[~nan], name)  # signed zeros and infinities (not NaN's bits)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "in place"])
@pytest.mark.parametrize("which", ["parameters", "gradients"])
def test_a_uint8_parameter_or_gradient_is_refused(which, donate):
    """uint8 is a state's 8-bit codes only: a kernel called with a uint8 parameter or
    gradient refuses it, naming it, as the C backend's does (the checks' pass over every
    tensor's dtype took uint8 for any, and a uint8 parameter was stepped and truncated)."""
    from vega.runtime import engine
    p = torch.full((10,), 7.0, device=DEVICE)
    g = torch.full((10,), 0.5, device=DEVICE)
    if which == "parameters":
        p = p.to(torch.uint8)
    else:
        g = g.to(torch.uint8)
    before = p.clone()
    states = [[torch.zeros(10, device=DEVICE)], [torch.zeros(10, device=DEVICE)]]
    with pytest.raises(ValueError, match=f"does not support {which} of dtype torch.uint8"):
        engine.run(vega.adamw.program(), "triton", [p], [g], states,
                   [torch.zeros((), dtype=torch.int32, device=DEVICE)],
                   [dict(lr=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)], donate)
    assert torch.equal(p, before)


@pytest.mark.parametrize("case", ["two groups", "loss scale", "no elements"])
def test_the_prelude_writes_the_whole_record(case):
    """The fused step's record comes from the prelude alone, made new (``torch.empty``):
    its last program combines every program's sums and writes the settings, and a second
    dtype group adds to it. Against the reference's record, made from a blank one."""
    from vega.runtime import engine
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(3000, generator=gen).to(DEVICE),
             torch.randn(5, 7, generator=gen, dtype=torch.float64).to(DEVICE)]
    inv = None
    if case == "two groups":
        grads[1][2, 3] = float("nan")
    elif case == "loss scale":
        grads = grads[:1]
        inv = torch.tensor(0.25, device=DEVICE)
    else:
        grads = [torch.zeros(0, device=DEVICE), torch.zeros(0, 4, device=DEVICE)]
    program = vega.adamw.program()
    records = {backend: engine.prelude([(program, backend, grads)], inv, 0.3, True)
               for backend in ("triton", "reference")}
    tri, ref = records["triton"], records["reference"]
    assert torch.allclose(tri, ref, rtol=1e-12, atol=0, equal_nan=True), (tri, ref)
    assert torch.equal(tri[1:], ref[1:])  # the count and the settings, exactly
    assert tri[1].item() == (1.0 if case == "two groups" else 0.0)
    # and again: the count of finished programs is back to 0 after each launch
    again = engine.prelude([(program, "triton", grads)], inv, 0.3, True)
    assert torch.allclose(again, tri, rtol=0, atol=0, equal_nan=True), (again, tri)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_prelude_inverts_a_loss_scale_of_any_dtype_as_the_reference(dtype):
    """The record's inverse loss scale from a ``LossScale``'s scale, which the constructor
    takes in any dtype: 1 / the scale in float64, as ``engine.inverse_scale`` forms it (a
    float64 scale was rounded to float32 before the prelude inverted it)."""
    from vega.runtime import engine
    grads = [torch.randn(300, generator=torch.Generator().manual_seed(0)).to(DEVICE)]
    scale = vega.LossScale(torch.tensor(1000.1, dtype=dtype, device=DEVICE),
                           torch.tensor(0, dtype=torch.int32, device=DEVICE))
    program = vega.adamw.program()
    tri, ref = (engine.prelude([(program, backend, grads)], None, 0.3, True, loss_scale=scale)
                for backend in ("triton", "reference"))
    assert tri[2].item() == ref[2].item() == 1.0 / scale.loss_scale.double().item()
    assert torch.allclose(tri, ref, rtol=1e-12, atol=0), (tri, ref)


@pytest.mark.parametrize("init,floor", [(2.0**8, None), (3.0e38, None), (1.0, 0.75)])
def test_the_update_adjusts_the_loss_scale_as_the_reference(init, floor):
    """A class step with a dynamic loss scale: the Triton update's program 0 adjusts it in
    place (no torch operation of its own), bitwise as ``LossScale.adjust`` does, through
    growth every two good steps, an overflow of the grown scale, backoffs on non-finite
    gradients and the floor; the parameters and states as the reference's."""
    opts = {}
    for backend in ("triton", "reference"):
        ws = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(k),
                                             dtype=torch.float64).float().to(DEVICE))
              for k, s in enumerate(((1000,), (30, 40), (7,)))]
        scale = vega.LossScale.dynamic(init=init, growth_interval=2, min_scale=floor,
                                       device=DEVICE)
        opts[backend] = (ws, vega.optim.AdamW(ws, lr=1e-2, backend=backend, max_grad_norm=1.0,
                                              loss_scale=scale))
    for step in range(7):
        for ws, opt in opts.values():
            for k, w in enumerate(ws):
                w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(
                    10 * step + k), dtype=torch.float64).float().to(DEVICE)
                if step in (2, 5) and k == 1:
                    w.grad[3] = float("inf")
            opt.step()
        (tw, topt), (rw, ropt) = opts["triton"], opts["reference"]
        for mine, theirs in zip(topt.loss_scale.tensors(), ropt.loss_scale.tensors()):
            assert torch.equal(mine, theirs), (step, topt.loss_scale, ropt.loss_scale)
        for a, b in zip(tw, rw):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert topt.loss_scale.skipped_steps.item() == 2


def test_a_loss_scale_of_other_dtypes_is_adjusted_as_the_reference():
    """A dynamic ``LossScale`` whose tensors the constructor took in other dtypes (a float64
    scale and floor, int64 counts): the update, which reads them as float32 and int32, leaves
    it to ``LossScale.adjust_``, so it grows as the reference's (the update's program 0
    read the float64 scale's bits as a float32 and kept it)."""
    out = {}
    for backend in ("triton", "reference"):
        w = torch.nn.Parameter(torch.ones(50, device=DEVICE))
        scale = vega.LossScale(torch.tensor(1024.0, dtype=torch.float64, device=DEVICE),
                               torch.tensor(0, device=DEVICE), torch.tensor(0, device=DEVICE),
                               torch.tensor(1.0, dtype=torch.float64, device=DEVICE),
                               growth_interval=2)
        opt = vega.optim.AdamW([w], lr=1e-2, backend=backend, loss_scale=scale)
        for step in range(3):
            w.grad = torch.full((50,), 512.0 * (step + 1), device=DEVICE)
            opt.step()
        out[backend] = (w.detach(), scale.tensors())
    (tw, tscale), (rw, rscale) = out["triton"], out["reference"]
    assert [t.item() for t in tscale] == [t.item() for t in rscale] == [2048.0, 1, 0, 1.0]
    torch.testing.assert_close(tw, rw)


# states of one number per tensor whose new values read only such states' old values, t and
# the hyperparameters (NAdam's product of momenta): the scalars kernel computes and writes
# them once a step; a chain of two, one read by the update
PER_STEP = """
optimizer per_step(lr = 0.1, b = 0.5) {
    state a: scalar = ones
    state c: scalar = zeros
    state d: scalar = lr
    a = a * (b + 0.125 * t)
    c = c + a
    p = p - d * g * c / (1 + a)
}
"""


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "in place"])
def test_states_of_one_number_step_once_a_step_in_the_scalars_kernel(monkeypatch, donate):
    """Triton's own kernels (not the reference's), the launches of a plain step (the scalars,
    then the update), the values written out over 4 steps, and a skipped step that leaves
    the numbers as they were; an empty tensor's numbers move like the others'."""
    spec = vega.compile(PER_STEP)
    assert type(codegen.kernel("triton", spec.program())).__module__ == "vega.codegen.triton"
    launches = Launches(monkeypatch)
    params = {"w": torch.randn(37, 41, device=DEVICE), "e": torch.randn(0, 3, device=DEVICE)}
    state = spec.init(params, lr=0.25)
    a, c, t, want = 1.0, 0.0, 0, params["w"].double().clone()
    for k in range(4):
        grads = grads_for(params, k)
        if k == 2:
            grads["w"][1, 1] = float("nan")
        before = {f: {n: x.clone() for n, x in state[f].items()} for f in ("a", "c")}
        params, state = spec.step(params, grads, state, backend="triton", donate=donate,
                                  skip_nonfinite=True, lr=0.25)
        if k == 2:  # skipped
            for f in ("a", "c"):
                for n in params:
                    assert_same(state[f][n], before[f][n], f"{f}.{n}")
            continue
        t += 1  # (a skipped step does not count)
        a = float(torch.tensor(a, dtype=torch.float32) * torch.tensor(0.5 + 0.125 * t,
                                                                         dtype=torch.float32))
        c = float(torch.tensor(c, dtype=torch.float32) + torch.tensor(a, dtype=torch.float32))
        want = want - 0.25 * grads["w"].double() * c / (1 + a)
        for n in params:
            assert float(state["a"][n]) == a and float(state["c"][n]) == c, (k, n)
            assert float(state["d"][n]) == 0.25, (k, n)  # (read, never assigned: kept)
    torch.testing.assert_close(params["w"].double(), want, rtol=1e-5, atol=1e-5)
    assert [x for x in launches.names if x.startswith("vega_per_step")][-2:] == [
        "vega_per_step_scalars", "vega_per_step_update"]


# states of one number per tensor whose new values read a reduction over the elements
# (NovoGrad's norm of g): the update computes them, from the old values the scalars kernel
# read, and the program of each tensor's first block writes them
FIRST_BLOCK = """
optimizer first_block(lr = 0.1, b = 0.5) {
    state s: scalar = ones
    state k: scalar = zeros
    state d: scalar = lr
    s = b * s + sum(g * g)
    k = k + 1
    p = p - d * g / sqrt(s + k)
}
"""


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "in place"])
def test_states_of_one_number_that_read_a_reduction_are_written_by_a_first_block(
        monkeypatch, donate):
    """Against the reference over 4 steps (one skipped): a tensor of several blocks (its
    other programs read the old numbers, not the first block's new ones), an empty tensor
    (a block of its own, whose program reads no element: its number still moves), Triton's
    own kernels and launches."""
    spec = vega.compile(FIRST_BLOCK)
    assert type(codegen.kernel("triton", spec.program())).__module__ == "vega.codegen.triton"
    launches = Launches(monkeypatch)
    params = {"w": torch.randn(3 * triton_runtime.block_size() + 5, device=DEVICE),
              "m": torch.randn(37, 41, device=DEVICE), "e": torch.randn(0, 3, device=DEVICE)}
    tri = ({n: x.clone() for n, x in params.items()}, spec.init(params))
    ref = (params, spec.init(params))
    for k in range(4):
        grads = grads_for(params, k, scale=0.1)
        if k == 2:
            grads["m"][1, 1] = float("nan")
        before = tri
        tri = spec.step(tri[0], grads, tri[1], backend="triton", donate=donate,
                        skip_nonfinite=True)
        ref = spec.step(ref[0], grads, ref[1], backend="reference", skip_nonfinite=True)
        for (what, a), (_, b) in zip(leaves(*tri), leaves(*ref)):
            if what == "step":
                assert torch.equal(a, b), what
            else:
                assert_close(a, b, f"step {k} {what}")
        if k == 2 and not donate:  # (in place, before is the same tensors)
            for (what, a), (_, b) in zip(leaves(*tri), leaves(*before)):
                assert_same(a, b, f"skipped step changed {what}")
    assert float(tri[1]["s"]["e"]) == 0.125 and float(tri[1]["k"]["e"]) == 3.0
    assert all(float(x) == pytest.approx(0.1) for x in tri[1]["d"].values())
    assert launches.names[-2:] == ["vega_first_block_finish0", "vega_first_block_update"]


def test_a_triton_state_loaded_on_the_cpu_says_where_the_backend_came_from(monkeypatch):
    """A checkpoint made with backend='triton' brings its backend into the group that loads
    it (torch's load_state_dict takes a saved group's settings): the refusal on CPU tensors
    without the interpreter says so, and how to choose by the device."""
    saved = vega.optim.AdamW([torch.nn.Parameter(torch.ones(8))], backend="triton")
    p = torch.nn.Parameter(torch.ones(8))
    opt = vega.optim.AdamW([p], backend="c")
    opt.load_state_dict(saved.state_dict())
    p.grad = torch.ones(8)
    monkeypatch.setattr(triton_runtime, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"takes the backend of a state_dict it loads.*"
                                         r"group\['backend'\] = None"):
        opt.step()
    assert torch.equal(p, torch.ones(8))
    opt.param_groups[0]["backend"] = None
    opt.step()
    assert not torch.equal(p, torch.ones(8))


@pytest.mark.parametrize("api", ["class", "functional"])
def test_a_step_of_two_programs_refused_on_the_cpu_writes_neither(monkeypatch, api):
    """Muon steps a matrix with the reference's operations (on any device) and a vector with
    Triton's kernel, which refuses CPU tensors without the interpreter: the refusal comes
    before the matrix's call writes (it had stepped the matrix, its state and counter)."""
    monkeypatch.setattr(triton_runtime, "interpreting", lambda: False)
    torch.manual_seed(0)
    w, b = torch.randn(6, 5), torch.randn(5)
    gw, gb = torch.randn(6, 5), torch.randn(5)
    words = r"Triton's interpreter"
    if api == "functional":
        params, grads = {"w": w.clone(), "b": b.clone()}, {"w": gw, "b": gb}
        state = vega.muon_init(params)
        buf = state["buf"]["w"].clone()
        with pytest.raises(ValueError, match=words):
            vega.muon_step(params, grads, state, backend="triton", donate=True)
        assert torch.equal(params["w"], w) and torch.equal(params["b"], b)
        assert torch.equal(state["buf"]["w"], buf) and int(state["step"]) == 0
        return
    ps = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    ps[0].grad, ps[1].grad = gw, gb
    opt = vega.optim.Muon(ps, backend="triton")
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert torch.equal(ps[0], w) and torch.equal(ps[1], b) and len(opt.state) == 0
    opt.param_groups[0]["backend"] = None  # (by the device: it steps as a new optimizer)
    opt.step()
    twin = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    twin[0].grad, twin[1].grad = gw, gb
    vega.optim.Muon(twin).step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin))


def test_rsqrt_of_a_subnormal_float32_is_finite_as_a_gpu_computes_it(monkeypatch):
    """On a GPU, Triton's float32 ``tl.rsqrt`` is ``rsqrt.approx.ftz.f32``: a subnormal
    argument is flushed to zero, and rsqrt(1e-40) was inf (a parameter over such a second
    moment, made inf or NaN), where torch gives 1e20. The interpreter's rsqrt is numpy's,
    exact: here it flushes as the GPU does, and the kernels' ``rsqrt`` still gives torch's
    values (a subnormal scaled into the normal numbers first)."""
    if DEVICE == "cpu":
        import numpy as np
        from triton.runtime import interpreter

        def flushing(self, arg):  # (rsqrt.approx.ftz.f32: a subnormal input taken as 0)
            x = arg.data
            if x.dtype == np.float32:
                x = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0) * x, x)
            return interpreter.TensorHandle(1 / np.sqrt(x), arg.dtype.scalar)
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_rsqrt", flushing)
    spec = vega.compile("optimizer o() {\n    state r = zeros\n    r = rsqrt(g)\n    p = p\n}")
    g = torch.tensor([1e-40, 3e-39, 1.1e-38, 4.0, 0.0, -0.0, -1e-40, 1e30], device=DEVICE)
    p = torch.zeros_like(g)
    _, state = spec.step({"x": p}, {"x": g}, spec.init({"x": p}), backend="triton")
    torch.testing.assert_close(state["r"]["x"], torch.rsqrt(g), rtol=4e-7, atol=0,
                               equal_nan=True)


def test_a_last_partial_block_writes_nothing_past_its_tensor():
    """A tensor of BLOCK - 1 (or 2 BLOCK - 1) elements: its last block is partial and
    masked, so a step in place writes nothing past its end, even where the memory after it
    is another tensor's (here, the rest of one buffer), and steps as the reference."""
    block = triton_runtime.block_size()  # (sgd's update: no narrower blocks)
    spec = vega.builtin("sgd")
    for n in (block - 1, 2 * block - 1):
        buf = torch.arange(n + 8, dtype=torch.float32, device=DEVICE)
        gbuf = torch.ones(n + 8, dtype=torch.float32, device=DEVICE)
        params, grads = {"x": buf[:n]}, {"x": gbuf[:n]}
        want = spec.step({"x": buf[:n].clone()}, grads, spec.init(params), backend="reference",
                         lr=0.5)[0]["x"]
        spec.step(params, grads, spec.init(params), backend="triton", lr=0.5, donate=True)
        assert_same(buf[:n], want, f"{n} elements")
        assert torch.equal(buf[n:], torch.arange(n, n + 8, dtype=torch.float32,
                                                 device=DEVICE)), (n, buf[n:])


def test_reductions_of_values_not_zero_at_zero_take_only_the_tensors_elements():
    """sum, mean, norm and max of values that are not 0 where g is 0 (g + 1, -1 - g * g):
    a block's lanes past the tensor's end (its loads masked to 0) count for nothing."""
    spec = vega.compile("optimizer reds() {\n    state s = zeros\n"
                        "    s = sum(g + 1) + mean(g * 0 + 2) + norm(g - 3) + max(-1 - g * g)\n"
                        "    p = p\n}")
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.zeros(n, device=DEVICE) for k, n in (("a", 1000), ("b", 7))}
    grads = {k: torch.randn(len(v), generator=gen).to(DEVICE) for k, v in params.items()}
    got = spec.step(params, grads, spec.init(params), backend="triton")[1]["s"]
    want = spec.step(params, grads, spec.init(params), backend="reference")[1]["s"]
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0, msg=k)


def test_the_prelude_reads_nothing_past_a_gradients_end():
    """Gradients that are slices of a buffer whose next element is inf: the prelude's norm
    and non-finite count take only the gradients' own elements (the step is not skipped,
    and clips as the reference's)."""
    spec = vega.builtin("sgd")
    params = {k: torch.ones(n, device=DEVICE) for k, n in (("a", 1000), ("b", 7))}
    grads = {}
    for k, p in params.items():
        buf = torch.full((len(p) + 1,), float("inf"), device=DEVICE)
        buf[:-1] = torch.arange(len(p), dtype=torch.float32) / len(p)
        grads[k] = buf[:-1]
    options = {"max_grad_norm": 1.0, "skip_nonfinite": True, "lr": 0.5}
    got = spec.step(params, grads, spec.init(params), backend="triton", **options)[0]
    want = spec.step(params, grads, spec.init(params), backend="reference", **options)[0]
    for k in params:
        assert not torch.equal(got[k], params[k]), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("how", ["with", "set_default_device"])
def test_a_step_under_a_meta_default_device_steps_as_outside(how):
    """The tables a step makes on the host (block maps, the record's settings, the address
    rows, the inverse loss scale) are on the CPU whatever the default device: made under
    ``torch.device("meta")`` (or ``torch.set_default_device``), the block map read a meta
    count and the step crashed inside, having cached the record's settings as a meta tensor
    that every later step of the process at that ``max_grad_norm`` read, and crashed on. The
    first step of these lengths and settings is made there: it and one after it, outside,
    step as the reference."""
    spec = vega.builtin("adamw")
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in
              (("w", (23, 29)), ("v", (1013,)))}  # (lengths of no other test's)
    options = {"max_grad_norm": 0.8125, "skip_nonfinite": True, "lr": 1e-2}
    scale = vega.LossScale.dynamic(init=4.0, device=DEVICE)
    ref = tri = (params, spec.init(params))
    for k in range(2):
        grads = {n: torch.randn(p.shape, generator=gen).to(DEVICE) for n, p in params.items()}
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", **options,
                        loss_scale=scale)
        if k == 0 and how == "with":
            with torch.device("meta"):
                tri = spec.step(*tri[:1], grads, tri[1], backend="triton", **options,
                                loss_scale=scale)
        elif k == 0:
            torch.set_default_device("meta")
            try:
                tri = spec.step(*tri[:1], grads, tri[1], backend="triton", **options,
                                loss_scale=scale)
            finally:
                torch.set_default_device(None)
        else:
            tri = spec.step(*tri[:1], grads, tri[1], backend="triton", **options,
                            loss_scale=scale)
        _alike_after(k, tri, ref)


def _alike_after(k: int, tri, ref) -> None:
    """Step ``k``'s Triton results ``tri`` (params, state, loss scale) are the reference's
    ``ref``: on their devices and in their dtypes, the counters equal, the rest close."""
    for (what, a), (_, b) in zip(leaves(*tri[:2]), leaves(*ref[:2])):
        assert a.device == b.device and a.dtype == b.dtype, (k, what, a.device)
        if what == "step":
            assert torch.equal(a, b), what
        else:
            assert_close(a, b, f"step {k} {what}")
    assert torch.equal(tri[2].loss_scale, ref[2].loss_scale)


def test_a_step_whose_record_is_made_before_the_prelude_under_a_meta_device():
    """Muon's Triton step takes a record made before its prelude (``record.make_pre``, its
    kernels do not write one whole): the inverse loss scale put into it was a tensor of
    the default device, under ``torch.device("meta")`` a meta one, and the copy out of it
    crashed inside. It steps as the reference, there and after."""
    spec = vega.builtin("muon")
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen).to(DEVICE) for k, s in
              (("w", (24, 20)), ("v", (300,)))}
    scale = vega.LossScale.dynamic(init=4.0, device=DEVICE)
    ref = tri = (params, spec.init(params))
    for k in range(2):
        grads = {n: torch.randn(p.shape, generator=gen).to(DEVICE) for n, p in params.items()}
        ref = spec.step(*ref[:1], grads, ref[1], backend="reference", loss_scale=scale)
        with torch.device("meta") if k == 0 else contextlib.nullcontext():
            tri = spec.step(*tri[:1], grads, tri[1], backend="triton", loss_scale=scale)
        _alike_after(k, tri, ref)


FAKE_MODE_SCRIPT = r"""
import os, sys
import torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import vega
from torch._subclasses.fake_tensor import FakeTensorMode
name = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
spec = vega.builtin(name)
for how in sys.argv[2:]:  # (one process: a table a refused step kept would serve the next)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(24, 20, generator=gen).to(device),
              "v": torch.randn(300, generator=gen).to(device)}
    grads = {k: torch.randn(v.shape, generator=gen).to(device) for k, v in params.items()}
    kw = {"max_grad_norm": 0.5625} if how.endswith("clipped") else {}
    state = spec.init(params)
    want = spec.step(params, grads, state, backend="reference", **kw)[0]
    opt = None
    if how.startswith("class"):
        ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()
        opt = spec.optimizer(ps, backend="triton", **kw)
        opt.step()  # (its state made, its tables kept)
        kept = [p.detach().clone() for p in ps]
    refused = None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            if opt is not None:
                opt.step()
            else:
                spec.step(params, grads, state, backend="triton",
                          donate=how.startswith("donate"), **kw)
    except ValueError as e:
        refused = str(e)
    assert refused is not None and "FakeTensorMode" in refused, (how, refused)
    if opt is not None:
        assert all(torch.equal(p.detach(), k) for p, k in zip(ps, kept)), how
    got = spec.step(params, grads, state, backend="triton", **kw)[0]
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    print("ok", how, flush=True)
"""
FAKE_MODE_CASES = ["pure", "donate", "class", "pure-clipped", "class-clipped"]


@pytest.mark.parametrize("name", ["adamw", "muon", "prodigy"])
def test_a_step_of_real_tensors_under_fake_tensor_mode_is_refused(name):
    """A step of real tensors under FakeTensorMode makes FakeTensors (address 0) for its
    outputs, its record and the native operator's address tables: it wrote at address 0
    (a segmentation fault) or failed inside torch, and the tables it kept would serve
    later steps. It is refused with a ValueError naming the mode, before anything is made
    or written, and a step outside the mode steps as the reference: pure, donated, a
    class's, clipped. In a fresh process (the crash would take the test session with it),
    one for the five cases of a rule (a child of a server that has made the script's
    imports: tests/forks.py; the environment has TRITON_INTERPRET=1 already where there is
    no GPU, as the session set it)."""
    root = os.path.abspath(os.path.join(os.path.dirname(vega.__file__), ".."))
    run = forks.run(FAKE_MODE_SCRIPT, name, *FAKE_MODE_CASES, timeout=600,
                    env={**os.environ, "PYTHONPATH": root},
                    imports=("torch", "vega", "torch._subclasses.fake_tensor"))
    done = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert run.returncode == 0 and done == FAKE_MODE_CASES, (done, run.stderr[-3000:])


@pytest.mark.parametrize("exponent", ["16777217", "-16777217", "2147483649", "1e-320", "0.3"])
def test_a_written_exponent_float32_cannot_hold_is_the_power_as_written(exponent):
    """On float32 (and half) parameters the C and Triton kernels took a written exponent in
    float32, as another number: 16777217 as the even 16777216 ((-1) ^ 16777217 was 1, not
    -1), 1e-320 as 0 ((-2) ^ 1e-320 was 1, not NaN; 0 ^ 1e-320 1, not 0). They compute
    torch's power by the number as written, as the reference does (``x ** 16777217.0``)."""
    from vega.codegen import c as c_backend
    spec = vega.compile(f"optimizer o() {{\n  p = g ^ {exponent}\n}}\n")
    x = torch.tensor([-1.0, 1.0, -2.0, 0.5, 0.0, -0.0, 1.5, -float("inf")], device=DEVICE)
    backends = ["triton"] + (["c"] if c_backend.available() and DEVICE == "cpu" else [])
    for dtype in (torch.float32, torch.bfloat16):
        p = {"w": torch.zeros_like(x, dtype=dtype)}
        g = {"w": x.to(dtype)}
        want = spec.step(p, g, spec.init(p), backend="reference")[0]["w"]
        for backend in backends:
            got = spec.step(p, g, spec.init(p), backend=backend)[0]["w"]
            assert torch.equal(got.isnan(), want.isnan()), (backend, dtype, got, want)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), (backend, dtype, got, want)
