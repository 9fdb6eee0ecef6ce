"""The Triton backend's staged path (values per row, column or matrix of a tensor's matrix
view: axis reductions, row and column state) against the reference, under Triton's CPU
interpreter (see test_triton.py for how the interpreter is set up)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo.testing  # noqa: E402,F401  (imports triton)

import triton  # noqa: E402,F401  (a dependency on Linux: missing fails, never skips)

import vega  # noqa: E402
from vega import codegen  # noqa: E402
from vega.codegen import triton_runtime  # noqa: E402

from .test_triton import leaves as all_leaves  # noqa: E402

DEVICE = "cpu" if triton_runtime.interpreting() else "cuda"
if DEVICE == "cpu" and not triton_runtime.library_interpreted():
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run with "
                "TRITON_INTERPRET=1 in the environment", allow_module_level=True)

TOL = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-12, 1e-14),
       torch.bfloat16: (1e-2, 1e-2)}
SHAPES = {"wide": (5, 7), "tall": (7, 5), "batch": (3, 6, 5), "square": (4, 4),
          "vector": (6,), "scalar": ()}


def randn(shapes, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {k: (scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
            for k, s in shapes.items()}


def leaves(params, state):
    """The named leaves (those present: adafactor's state lacks v_row where it does not factor)."""
    return ((name, x) for name, x in all_leaves(params, state) if x is not None)


def assert_close(tri, ref, what):
    for (name, a), (name_b, b) in zip(leaves(*tri), leaves(*ref), strict=True):
        assert name == name_b and a.shape == b.shape and a.dtype == b.dtype, (what, name)
        if name == "step":
            assert torch.equal(a, b), (what, name)
            continue
        rtol, atol = TOL[b.dtype]
        scale = b.double().abs().nan_to_num(posinf=0, neginf=0).max().item() if b.numel() else 0
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * max(1.0, scale), equal_nan=True,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_same(after, before, what):
    for (name, a), (_, b) in zip(leaves(*after), leaves(*before), strict=True):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
            f"{what}: {name} changed"


def clone(params, state):
    return ({k: v.clone() for k, v in params.items()},
            {f: t.clone() if f == "step" else
             {k: None if v is None else v.clone() for k, v in t.items()}
             for f, t in state.items()})


def run(step, params, state, grads, **kw):
    """A step on both backends from the same inputs (fresh copies for donate)."""
    out = {}
    for backend in ("reference", "triton"):
        p, s = clone(params, state) if kw.get("donate") else (params, state)
        out[backend] = step(p, grads, s, backend=backend, **kw)
    return out["triton"], out["reference"]


FLAGS = ["factored", "multiply_by_parameter_scale", "relative_step", "use_momentum"]
CASES = [  # (dtype, flags on, donate)
    (torch.float32, {"factored", "multiply_by_parameter_scale", "use_momentum"}, False),
    (torch.float32, {"factored", "relative_step"}, True),
    (torch.float64, {"factored", "multiply_by_parameter_scale", "relative_step",
                     "use_momentum"}, True),
    (torch.float64, {"multiply_by_parameter_scale"}, False),
]


@pytest.mark.parametrize("dtype,on,donate", CASES,
                         ids=[f"{str(d)[6:]}-{'+'.join(sorted(o))}-{'donate' if n else 'pure'}"
                              for d, o, n in CASES])
def test_adafactor_matches_reference(dtype, on, donate):
    flags = {f: f in on for f in FLAGS}
    hypers = {"min_dim_size_to_factor": 4, "weight_decay_rate": 0.01, "momentum": 0.8,
              "clipping_threshold": 0.9, "lr": 0.05, **flags}
    params = randn(SHAPES, dtype, 0)
    state = vega.adafactor_init(params, **hypers)
    if flags["factored"]:  # the (4, 4) matrix, and the others of rank 2 or more, factor
        assert state["v_row"]["square"].shape == (4,) and state["v_row"]["vector"] is None
        assert state["v_col"]["batch"].shape == (3, 6) and state["v_row"]["tall"].shape == (5,)
    tri = ref = (params, state)
    for k in range(3):
        grads = randn(SHAPES, dtype, 10 + k)
        if donate:  # in place: each backend steps its own copies of the same inputs
            tri, ref = run(vega.adafactor_step, ref[0], ref[1], grads, donate=True, **hypers)
        else:
            tri = vega.adafactor_step(tri[0], grads, tri[1], backend="triton", **hypers)
            ref = vega.adafactor_step(ref[0], grads, ref[1], backend="reference", **hypers)
        assert_close(tri, ref, f"step {k}")


AXES_SPEC = """
optimizer axes(lr = 0.1, b = 0.8) {
    state vr: rows = zeros
    state vc: cols = 1
    state m = zeros
    state z: rows = zeros
    g2 = g * g + 1e-6
    vr = b * vr + (1 - b) * (row_mean(g2) + 0.1 * abs(row_sum(g)) + row_max(g) ^ 2)
    vc = b * vc + (1 - b) * col_mean(g2) + 0.01 * col_max(abs(g)) + 0.001 * abs(col_sum(p))
    scale = col_mean(vr) + row_sum(vc) * 0.01 + max(vc) * 0.001 + col_max(vr)
    k = mean(vr) + sum(vc) * 0.01 + norm(g) * 0.001
    m = 0.5 * m + g * rsqrt(vr * vc / scale + 1e-8) / (1 + k)
    z = row_max(g) + col_max(row_mean(g)) + mean(row_sum(p))
    p = p - lr * m + 0.001 * z
}
"""
AXES_SHAPES = {"wide": (5, 7), "tall": (7, 3), "batch": (2, 3, 4), "vector": (6,),
               "scalar": (), "empty": (0, 3)}


def test_user_spec_with_every_axis_reduction():
    spec = vega.compile(AXES_SPEC)
    params = randn(AXES_SHAPES, torch.float32, 1)
    state = spec.init(params)
    assert state["vr"]["batch"].shape == (2, 3) and state["vc"]["empty"].shape == (3,)
    tri = ref = (params, state)
    for k in range(3):
        grads = randn(AXES_SHAPES, torch.float32, 20 + k)
        tri = spec.step(tri[0], grads, tri[1], backend="triton", lr=0.05)
        ref = spec.step(ref[0], grads, ref[1], backend="reference", lr=0.05)
        assert_close(tri, ref, f"step {k}")
    # an empty column axis: the mean of no values is NaN, their max -inf
    assert ref[1]["vc"]["empty"].isnan().all() and tri[1]["vc"]["empty"].isnan().all()


def test_nan_gradient_and_row_max():
    spec = vega.compile("""
    optimizer nanmax(lr = 0.1) {
        state z: rows = zeros
        state w: cols = zeros
        z = row_max(g) + 0 * z
        w = col_max(g) - col_mean(g)
        p = p - lr * g
    }""")
    params = randn({"m": (4, 6), "n": (3, 2, 5)}, torch.float64, 2)
    grads = randn({"m": (4, 6), "n": (3, 2, 5)}, torch.float64, 3)
    grads["m"][2, 3] = float("nan")
    grads["n"][1, 0, 4] = float("inf")
    grads["n"][1, 1, 4] = float("-inf")
    tri, ref = run(spec.step, params, spec.init(params), grads)
    assert_close(tri, ref, "NaN gradient")
    assert tri[1]["z"]["m"].isnan().tolist() == [False, False, True, False]
    assert tri[1]["w"]["m"].isnan().sum() == 1 and tri[1]["w"]["n"].isnan().sum() == 1


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donate"])
def test_skip_nonfinite_leaves_everything_unchanged(donate):
    hypers = {"min_dim_size_to_factor": 4, "use_momentum": True}
    params = randn(SHAPES, torch.float32, 4)
    state = vega.adafactor_init(params, **hypers)
    # a first, finite step (clipped), then one with an infinite gradient in a factored matrix
    grads = randn(SHAPES, torch.float32, 5, scale=3.0)
    tri, ref = run(vega.adafactor_step, params, state, grads, skip_nonfinite=True,
                   max_grad_norm=0.5, donate=donate, **hypers)
    assert_close(tri, ref, "clipped step")
    copies = clone(*tri)
    grads = randn(SHAPES, torch.float32, 6)
    grads["wide"][1, 2] = float("inf")
    after = vega.adafactor_step(tri[0], grads, tri[1], backend="triton", skip_nonfinite=True,
                                max_grad_norm=0.5, donate=donate, **hypers)
    assert_same(after, copies, "a skipped step")
    grads["wide"][1, 2] = 0.5
    tri, ref = run(vega.adafactor_step, copies[0], copies[1], grads, skip_nonfinite=True,
                   max_grad_norm=0.5, **hypers)
    assert_close(tri, ref, "the step after")


def test_bfloat16_and_loss_scale():
    """bfloat16 parameters (float32 state), gradients scaled by a dynamic loss scale with an
    overflow at step 1: unscaled and skipped as in the reference."""
    hypers = {"min_dim_size_to_factor": 4, "use_momentum": True}
    params = randn(SHAPES, torch.bfloat16, 9)
    scale = vega.LossScale.dynamic(init=2.0**6, growth_interval=2)
    tri = ref = (params, vega.adafactor_init(params, **hypers), scale)
    for k in range(3):
        grads = randn(SHAPES, torch.bfloat16, 30 + k, scale=2.0**6)
        if k == 1:
            grads["batch"][2, 1, 0] = float("inf")
        tri = vega.adafactor_step(tri[0], grads, tri[1], backend="triton", loss_scale=tri[2],
                                  **hypers)
        ref = vega.adafactor_step(ref[0], grads, ref[1], backend="reference",
                                  loss_scale=ref[2], **hypers)
        assert_close(tri[:2], ref[:2], f"step {k}")
        assert torch.equal(tri[2].loss_scale, ref[2].loss_scale)
    assert int(tri[1]["step"]) == 2


def test_launches_do_not_grow_with_tensors(monkeypatch):
    """One launch per stage and domain for every tensor of a dtype group."""
    count = [0]
    real = triton_runtime.launch

    def counting(*args, **kw):
        count[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(triton_runtime, "launch", counting)
    hypers = {"min_dim_size_to_factor": 2}
    seen = []
    for n in (1, 4):
        params = randn({f"w{k}": (3 + k, 4) for k in range(n)}, torch.float32, 7)
        state = vega.adafactor_init(params, **hypers)
        count[0] = 0
        vega.adafactor_step(params, randn({f"w{k}": (3 + k, 4) for k in range(n)},
                                          torch.float32, 8), state, backend="triton", **hypers)
        seen.append(count[0])
    assert seen[0] == seen[1], seen


def test_source():
    spec = vega.builtin("adafactor")
    program = spec._spec.program({"factored": True, "multiply_by_parameter_scale": True,
                                  "relative_step": False, "use_momentum": True}, (True,))
    assert program.uses_axes
    kern = codegen.kernel("triton", program)
    for dtypes in (("float32",) * 3, ("bfloat16", "bfloat16", "float32"), ("float64",) * 3):
        text = kern.source(dtypes)
        compile(text, "<adafactor>", "exec")
        assert "def vega_adafactor_write_r(" in text and "put(offsets[:, None]" in text
        for line in text.splitlines():
            assert len(line) <= 100 or line.lstrip().startswith("#") or "  # " in line, line
    shown = spec.source("triton", shape=(256, 512), use_momentum=True)
    assert shown == kern.source()  # the public view of the factored kernel
    assert "def vega_adafactor_write_r(" not in spec.source("triton")  # a vector's: not factored
