"""The C backend on programs over a matrix view (row and column reductions, state per row
or per column) against the reference, on params and every state tensor."""
import re

import pytest
import torch

import vega
from vega import codegen
from vega.codegen import c
from vega.codegen.base import axis_geometry

from .test_c import assert_close, pure_against_donated


def run_both(spec, params, steps, grads_at, **kwargs):
    """``steps`` steps on the reference and on C from one state; checks every tensor."""
    hypers = {k: v for k, v in kwargs.items() if k not in ("max_grad_norm", "skip_nonfinite")}
    ref = (params, spec.init(params, **hypers))
    cc = (params, spec.init(params, **hypers))
    for step in range(steps):
        grads = grads_at(step)
        ref = spec.step(ref[0], grads, ref[1], backend="reference", **kwargs)
        cc = spec.step(cc[0], grads, cc[1], backend="c", **kwargs)
        compare(cc, ref, f"step {step}")
    return cc, ref


def compare(cc, ref, what):
    (cp, cs), (rp, rs) = cc, ref
    for k in rp:
        assert cp[k].dtype == rp[k].dtype and cp[k].shape == rp[k].shape, k
        assert_close(cp[k], rp[k], rp[k].dtype, f"{what} p.{k}")
        for field in rs:
            if field == "step":
                continue
            if rs[field][k] is None:
                assert cs[field][k] is None
                continue
            assert cs[field][k].shape == rs[field][k].shape, f"{field}.{k}"
            assert_close(cs[field][k], rs[field][k], rp[k].dtype, f"{what} {field}.{k}")
    assert torch.equal(cs["step"], rs["step"])


def randn(shapes, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return {k: (scale * torch.randn(s, generator=gen, dtype=torch.float64)).to(dtype)
            for k, s in shapes.items()}


# -- adafactor -----------------------------------------------------------------------

ADA_SHAPES = {"wide": (5, 7), "tall": (7, 5), "cube": (3, 6, 5), "square": (4, 4),
              "vec": (6,), "scalar": ()}
ADA_HYPERS = dict(lr=0.05, decay_rate=0.7, min_dim_size_to_factor=4, clipping_threshold=0.5,
                  momentum=0.8, weight_decay_rate=0.01, eps=1e-20, param_scale_min=0.01)
# every bool hyperparameter both ways
ADA_FLAGS = [dict(factored=True, multiply_by_parameter_scale=True, relative_step=False,
                  use_momentum=False),
             dict(factored=False, multiply_by_parameter_scale=False, relative_step=True,
                  use_momentum=True),
             dict(factored=True, multiply_by_parameter_scale=False, relative_step=True,
                  use_momentum=True)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("flags", ADA_FLAGS, ids=lambda f: ",".join(k for k, v in f.items() if v))
def test_adafactor_matches_reference(flags, dtype):
    params = randn(ADA_SHAPES, dtype, 0)
    (cp, cs), _ = run_both(vega.adafactor, params, 6,
                           lambda k: randn(ADA_SHAPES, dtype, 100 + k, 1 + k % 3),
                           **ADA_HYPERS, **flags)
    factored = {k for k, v in cs.get("v_row", {}).items() if v is not None}
    assert factored == ({"wide", "tall", "cube", "square"} if flags["factored"] else set())
    if flags["factored"]:
        assert cs["v_row"]["cube"].shape == (3, 5) and cs["v_col"]["cube"].shape == (3, 6)
        assert cs["v_row"]["tall"].shape == (5,) and cs["v_col"]["tall"].shape == (7,)
    assert all(not torch.equal(cp[k], params[k]) for k in params)  # it moved


def test_adafactor_bfloat16():
    params = randn(ADA_SHAPES, torch.bfloat16, 0)
    (cp, cs), _ = run_both(vega.adafactor, params, 4,
                           lambda k: randn(ADA_SHAPES, torch.bfloat16, 100 + k),
                           **ADA_HYPERS, **ADA_FLAGS[2])
    assert cp["cube"].dtype == torch.bfloat16 and cs["v_row"]["cube"].dtype == torch.float32


def test_adafactor_source_is_readable_c():
    text = vega.adafactor.source("c", (512, 768), min_dim_size_to_factor=4)
    assert "void vega_axes_step(" in text and "void vega_update(" not in text
    assert "= row_mean(v_v_g2) */" in text and "= col_mean(v_v_v_row) */" in text
    assert "write p: one value per element" in text
    # a tensor that is not factored: the multi-tensor kernel
    assert "void vega_update(" in vega.adafactor.source("c", (512,), min_dim_size_to_factor=4)


# -- each reduction, row and column state --------------------------------------------

AXES = """optimizer axes(lr = 0.1, b = 0.9) {
    state vr: rows = row_mean(p * p)
    state vc: cols = zeros
    state m = zeros
    old_vr = vr
    old_vc = vc
    vr = b * vr + (1 - b) * row_mean(g * g)
    vc = b * vc + (1 - b) * col_sum(g) / 10
    m = 0.5 * m + row_max(g) - col_max(-g)
    u = g / sqrt(vr + 1e-3) + vc / (1 + col_max(abs(p)))
    u = u + 0.01 * row_sum(p) * col_mean(g) + col_mean(vr) - row_mean(vc)
    u = u + mean(vr) + 0.1 * norm(vc) + max(row_max(p)) + sum(g * vr) / 100
    u = where(row_max(g) > 0.5, u, -u) + 0.01 * m + old_vr * old_vc
    p = p - lr * u / (1 + sqrt(mean(u * u)))
}"""

AXES_SHAPES = {"wide": (5, 7), "tall": (7, 5), "cube": (2, 6, 5), "four": (3, 2, 4, 7),
               "ones": (7, 1, 2), "row": (1, 3), "square": (4, 4), "vec": (6,),
               "scalar": (), "strided": (200, 70), "long": (3, 5000), "batch_last": (5, 7, 2),
               # a column sum of 3 tiles of 1024 outputs, its rows read in 8 parts
               "tiles": (40, 2500)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_each_axis_reduction_matches_reference(dtype):
    spec = vega.compile(AXES)
    program = spec.program()
    assert program.uses_axes
    assert {s.name: s.dom for s in program.states} == {"vr": "r", "vc": "c", "m": "rc"}
    params = randn(AXES_SHAPES, dtype, 1)
    params["transposed"] = params["strided"].t()  # not contiguous
    shapes = {**AXES_SHAPES, "transposed": (70, 200)}
    run_both(spec, params, 4, lambda k: randn(shapes, dtype, 200 + k))


def test_state_without_reductions():
    """No axis reduction, nothing materialized: only the writes, per element and per row."""
    spec = vega.compile("""optimizer plain(lr = 0.1) {
        state s: rows = ones
        s = 0.5 * s
        p = p - lr * s * g
    }""")
    params = randn(AXES_SHAPES, torch.float64, 9)
    (cp, cs), _ = run_both(spec, params, 3, lambda k: randn(AXES_SHAPES, torch.float64, 250 + k))
    assert torch.equal(cs["s"]["cube"], torch.full((2, 5), 0.125, dtype=torch.float64))


BROADCAST = """optimizer bcast(lr = 0.1) {
    state m = zeros
    state s: rows = ones
    state k: cols = zeros
    m = row_mean(g)
    s = mean(g)
    k = row_sum(col_mean(g)) + 2
    p = col_max(p) - lr * g
}"""


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_outputs_of_a_smaller_domain_broadcast(dtype):
    """A per-row value written to a state like p, a per-tensor one to a per-row state, a
    per-matrix one to a per-column state, a per-column one to p."""
    spec = vega.compile(BROADCAST)
    params = randn(AXES_SHAPES, dtype, 2)
    (cp, cs), _ = run_both(spec, params, 2, lambda k: randn(AXES_SHAPES, dtype, 300 + k))
    g = randn(AXES_SHAPES, dtype, 301)["tall"]  # the last step's gradient
    assert_close(cs["m"]["tall"], g.mean(0, keepdim=True).expand(7, 5), dtype, "m")
    assert_close(cs["s"]["tall"], g.mean().expand(5), dtype, "s")


def test_nan_gradient_propagates_through_row_max():
    spec = vega.compile("""optimizer nanmax(lr = 0.1) {
        state r: rows = zeros
        r = row_max(g)
        p = p - lr * (r + col_max(g))
    }""")
    shapes = {"tall": (7, 5), "cube": (2, 6, 5)}
    params = randn(shapes, torch.float32, 3)

    def grads(k):
        out = randn(shapes, torch.float32, 400 + k)
        out["tall"][2, 3] = float("nan")
        out["cube"][1, 4, 0] = float("nan")
        return out
    (cp, cs), _ = run_both(spec, params, 1, grads, lr=0.1)
    # (7, 5): the rows are axis 1, the columns axis 0; column 2 of the row max is NaN
    assert torch.isnan(cs["r"]["tall"]).tolist() == [False, False, False, True, False]
    assert torch.isnan(cp["tall"]).sum() == 7 + 5 - 1
    assert torch.isnan(cs["r"]["cube"]).sum() == 1


EMPTY = """optimizer empty(lr = 0.1) {
    state r: rows = zeros
    state c: cols = zeros
    r = row_mean(g)
    c = col_mean(g) + col_sum(g) + col_max(g)
    p = p - lr * (r + c + mean(g))
}"""


def test_empty_axes():
    """A (0, 3) tensor: no rows, three columns of nothing; means of nothing are NaN."""
    spec = vega.compile(EMPTY)
    shapes = {"empty": (0, 3), "zero_cols": (3, 0, 2), "tall": (7, 5)}
    params = randn(shapes, torch.float64, 4)
    (cp, cs), _ = run_both(spec, params, 2, lambda k: randn(shapes, torch.float64, 500 + k))
    assert cs["c"]["empty"].shape == (3,) and cs["r"]["empty"].shape == (0,)
    assert torch.isnan(cs["c"]["empty"]).all()


@pytest.mark.parametrize("shape,field,other", [((4, 6), "v_row", (2, 2)),
                                               ((2, 3, 4), "v_row", (3, 2)),
                                               ((4, 6), "v_col", (1, 6)),
                                               ((2, 3, 4), "v_col", (4, 2))])
def test_a_class_refuses_a_row_or_column_state_of_another_shape(shape, field, other):
    """A state of one value per row (or column) of another shape, of the same length, is
    refused by name, as the reference refuses it: the native operator compared only the
    lengths, and stepped it (a (2, 2) row state for a (4, 6) parameter)."""
    p = torch.nn.Parameter(torch.randn(shape))
    opt = vega.optim.Adafactor([p], lr=0.05, min_dim_size_to_factor=2, backend="c")
    p.grad = torch.randn(shape)
    opt.step()
    opt.state[p][field] = opt.state[p][field].reshape(other)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=rf"state '{field}' has shape {re.escape(str(other))}"):
        opt.step()
    assert torch.equal(p.detach(), before)
    # and a parameter given another shape whose rows and columns are as many (1, 4, 6)
    q = torch.nn.Parameter(torch.randn(4, 6))
    opt = vega.optim.Adafactor([q], lr=0.05, min_dim_size_to_factor=2, backend="c")
    q.grad = torch.randn(4, 6)
    opt.step()
    q.data, q.grad = torch.randn(1, 4, 6), torch.randn(1, 4, 6)
    with pytest.raises(ValueError, match=r"state 'v_row' has shape \(4,\).*needs \(1, 4\)"):
        opt.step()


# -- fused options, threads -----------------------------------------------------------

def test_skip_nonfinite_leaves_everything_unchanged():
    params = randn(ADA_SHAPES, torch.float32, 5)
    hypers = dict(ADA_HYPERS, use_momentum=True)
    state = vega.adafactor_init(params, **hypers)
    params, state = vega.adafactor_step(params, randn(ADA_SHAPES, torch.float32, 600), state,
                                        backend="c", skip_nonfinite=True, **hypers)
    for bad in (float("nan"), float("inf")):
        grads = randn(ADA_SHAPES, torch.float32, 601)
        grads["cube"][1, 2, 3] = bad
        new_p, new_s = vega.adafactor_step(params, grads, state, backend="c",
                                           skip_nonfinite=True, max_grad_norm=1.0, **hypers)
        for k in params:
            assert torch.equal(new_p[k], params[k])
            for field in state:
                if field != "step" and state[field][k] is not None:
                    assert torch.equal(new_s[field][k], state[field][k]), (field, k)
        assert torch.equal(new_s["step"], state["step"])
    # and in place
    before = {k: v.clone() for k, v in params.items()}
    v_row = state["v_row"]["wide"].clone()
    vega.adafactor_step(params, grads, state, backend="c", skip_nonfinite=True, donate=True,
                        **hypers)
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert torch.equal(state["v_row"]["wide"], v_row)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_clipping_matches_reference(dtype):
    params = randn(ADA_SHAPES, dtype, 6)
    run_both(vega.adafactor, params, 3, lambda k: randn(ADA_SHAPES, dtype, 700 + k, 10.0),
             max_grad_norm=0.5, **ADA_HYPERS, **ADA_FLAGS[0])


def test_results_do_not_depend_on_the_thread_count():
    spec = vega.compile(AXES)
    shapes = {"big": (300, 400), "strided": (900, 100), "long": (3, 40000)}
    params = randn(shapes, torch.float32, 7)
    grads = randn(shapes, torch.float32, 800)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(spec.step(params, grads, spec.init(params), backend="c"))
    finally:
        torch.set_num_threads(threads)
    for p, s in outs[1:]:
        assert all(torch.equal(p[k], outs[0][0][k]) for k in shapes)
        assert all(torch.equal(s[f][k], outs[0][1][f][k]) for f in ("vr", "vc", "m")
                   for k in shapes)
    ref_p, _ = spec.step(params, grads, spec.init(params), backend="reference")
    for k in shapes:
        assert_close(outs[0][0][k], ref_p[k], torch.float32, k)


def test_line_lengths_make_every_index_map_affine():
    """Along each run of L positions of a loop, every map into a smaller domain steps by 0
    or 1 (what the kernels' lines assume)."""
    def drop(i, inner, n):
        return (i // (inner * n)) * inner + i % inner

    def maps(shape):
        n_rc, n_r, n_c, n_, sr, sc, fr, fc, rr, cc = axis_geometry(shape)
        return {"rc": (n_rc, [lambda i: drop(i, fc, sc), lambda i: drop(i, fr, sr),
                              lambda i: drop(drop(i, fc, sc), rr, sr)]),
                "r": (n_r, [lambda i: drop(i, rr, sr)]), "c": (n_c, [lambda i: drop(i, cc, sc)])}
    for shape in [(), (4,), (3, 5), (5, 3), (4, 4), (2, 6, 5), (3, 2, 4, 7), (1, 3),
                  (7, 1, 2), (0, 3), (3, 0, 2), (2, 3, 1, 4), (6, 2, 3)]:
        for (dom, (n, fns)), length in zip(maps(shape).items(), c.line_lengths(shape)):
            assert length >= 1 and (n == 0 or n % length == 0), (shape, dom)
            for lo in range(0, n, length):
                for m in fns:
                    steps = {m(i + 1) - m(i) for i in range(lo, lo + length - 1)}
                    assert steps <= {0, 1} and len(steps) <= 1, (shape, dom, lo, steps)


def test_a_kernel_per_program_and_no_reference_fallback(monkeypatch):
    """The factored tensors run vega_axes_step; nothing calls the reference kernel."""
    from vega.codegen import reference
    monkeypatch.setattr(reference.Kernel, "__call__",
                        lambda *a, **k: pytest.fail("the reference kernel ran"))
    params = randn(ADA_SHAPES, torch.float32, 8)
    state = vega.adafactor_init(params, **ADA_HYPERS)
    vega.adafactor_step(params, randn(ADA_SHAPES, torch.float32, 900), state, backend="c",
                        **ADA_HYPERS)
    assert codegen.kernel("c", vega.adafactor.program((5, 7), **ADA_HYPERS))._axes


@pytest.mark.parametrize("source", ["adafactor", BROADCAST, EMPTY])
def test_pure_steps_over_a_matrix_view_write_new_tensors(source, monkeypatch):
    """Out of place as the elementwise programs: adafactor factored and not, states per
    row and per column, empty axes."""
    shapes = {"tall": (7, 5), "cube": (3, 6, 5), "empty": (0, 3), "zero_cols": (3, 0, 2),
              "vec": (6,), "scalar": ()}
    for dtype in (torch.float64, torch.float32):
        if source == "adafactor":
            for flags in ADA_FLAGS:
                pure_against_donated(vega.adafactor, dict(ADA_HYPERS, **flags),
                                     randn(ADA_SHAPES, dtype, 7), monkeypatch)
        else:
            pure_against_donated(vega.compile(source), {}, randn(shapes, dtype, 7), monkeypatch)
