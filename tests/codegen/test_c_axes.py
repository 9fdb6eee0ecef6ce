"""The C backend on programs over a matrix view (row and column reductions, state per row
or per column) against the reference, on params and every state tensor."""
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


# -- the step over shards (FSDP2's): stage by stage, partial results combined -------------

# every kind of reduction along each axis and over each domain, and state per row and per
# column, one of which a shard splits; values read across the stages
SHARDED = vega.compile("""
optimizer sharded(lr = 0.01, b = 0.9) {
    state m = zeros
    state vr: rows = zeros
    state vc: cols = zeros
    m = b * m + g
    vr = b * vr + row_mean(g * g)
    vc = b * vc + col_mean(g * g)
    big = max(abs(m)) + max(row_max(abs(g))) + max(col_max(g))
    u = m / (big + 1) + 0.01 * sum(m) + mean(g * g) + 0.1 * row_sum(g) + 0.1 * col_sum(g)
        + 0.1 * row_mean(g * p) + 0.1 * col_mean(abs(g)) + 0.01 * vr / (mean(vr) + 1)
        + 0.01 * vc / (norm(vc) + 1)
    p = p - lr * u / (sqrt(mean(u * u)) + 1)
}
""")
ADA_SHARDED = dict(lr=0.05, decay_rate=0.7, decay_offset=0.0, min_dim_size_to_factor=2.0,
                   clipping_threshold=0.5, momentum=0.8, weight_decay_rate=0.01, eps=1e-20,
                   param_scale_min=0.01)


def _shard(x, geo, dom, axis, lo, hi):
    """The part of ``x`` (a value of domain ``dom`` of a tensor of matrix view ``geo``) that
    a shard of the tensor's ``axis`` from ``lo`` to ``hi`` holds: all of it where ``dom``
    has no such axis (a replicated value)."""
    if not geo.keeps(dom, axis):
        return x.clone()
    return x.narrow(geo.position(axis, dom), lo, hi - lo).clone()


def _staged_over_shards(backend, program, p, g, states, values, axis, cuts, step=0):
    """``backend``'s staged step of ``p`` cut along ``axis`` at ``cuts`` into shards, each
    a process of its own: the shards' generators run side by side, each stage's partial
    results summed (or their maximum taken) over the shards. The whole new parameter and
    states, put together, and the combining calls' count."""
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import Done
    full = geometry(p.shape)
    kern = codegen.kernel(backend, program)
    assert backend == "reference" or kern.stageable
    bounds = list(zip([0, *cuts], [*cuts, p.shape[axis]]))
    doms = [s.dom for s in program.states]
    gens = []
    for lo, hi in bounds:
        local = Geometry(tuple(p.narrow(axis, lo, hi - lo).shape), axes=(full.r, full.c))
        view = ShardView(local, full, frozenset({axis}))
        gens.append(kern.staged(
            [p.narrow(axis, lo, hi - lo).clone()], [g.narrow(axis, lo, hi - lo).clone()],
            [[_shard(s, full, d, axis, lo, hi)] for s, d in zip(states, doms)],
            [torch.full((), step, dtype=torch.int32)], [values], False, None, [view]))
    asked = [gen.send(None) for gen in gens]
    rounds = 0
    while not isinstance(asked[0], Done):
        rounds += 1
        assert not any(isinstance(a, Done) for a in asked)
        totals = []
        for parts in zip(*asked):
            how = parts[0][0]
            xs = [x for _, x in parts]
            total = xs[0].clone()
            for x in xs[1:]:
                total = total + x if how == "sum" else torch.maximum(total, x)
            totals.append(total)
        asked = [gen.send(totals) for gen in gens]
    outs = [a.value for a in asked]
    new_p = torch.cat([o[0][0] for o in outs], axis)
    new_s = []
    for k, d in enumerate(doms):
        pieces = [o[1][k][0] for o in outs]
        if full.keeps(d, axis):
            new_s.append(torch.cat(pieces, full.position(axis, d)))
        else:  # replicated: every shard's copy the same
            assert all(torch.equal(x, pieces[0]) for x in pieces)
            new_s.append(pieces[0])
    return new_p, new_s, rounds


SHARD_CASES = [  # (shape, the split axis, where it is cut)
    ((12, 10), 0, [5]), ((12, 10), 1, [4, 7]), ((3, 8, 6), 1, [3]), ((3, 8, 6), 0, [1, 1]),
    ((10, 12), 0, [10]),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["sharded", "adafactor"])
@pytest.mark.parametrize("shape,axis,cuts", SHARD_CASES,
                         ids=[f"{s}/{a}@{c}" for s, a, c in SHARD_CASES])
def test_staged_step_over_shards_of_a_matrix_view_is_the_whole_step(which, shape, axis, cuts,
                                                                    dtype):
    """A program over a matrix view stepped over shards on the C kernels (FSDP2's
    ``fully_shard``: ``vega.runtime.sharded``): each stage's reductions along an axis a
    shard splits, and per tensor, combined across the shards (uneven ones, an empty one),
    give the whole tensor's step: against the C kernels' own step of the whole tensor and
    the reference's, on the parameter and every state, over three steps."""
    if which == "sharded":
        program, values = SHARDED.program(shape), {"lr": 0.01, "b": 0.9}
    else:
        program = vega.adafactor.program(shape, factored=True, min_dim_size_to_factor=2)
        values = dict(ADA_SHARDED)
    assert program.uses_axes
    gen = torch.Generator().manual_seed(sum(shape) + axis)
    p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    kern, ref = codegen.kernel("c", program), codegen.kernel("reference", program)
    states = ref.init(p, values, dtype)
    whole = (p, states)
    for step in range(3):
        g = (torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + step)).to(dtype)
        steps = [torch.full((), step, dtype=torch.int32)]
        new_p, new_s, rounds = _staged_over_shards("c", program, whole[0], g, whole[1],
                                                    values, axis, cuts, step)
        # the reference's staged step over the same shards: a combining call each stage
        # where a shard splits a reduction (Adafactor's mean of the unsplit factor: none)
        ref_p, ref_s, ref_rounds = _staged_over_shards("reference", program, whole[0], g,
                                                        whole[1], values, axis, cuts, step)
        assert rounds == ref_rounds >= ref.nstages - 1
        want = kern([whole[0]], [g], [[s] for s in whole[1]], steps, [values], False)
        oracle = ref([whole[0]], [g], [[s] for s in whole[1]], steps, [values], False)
        for got, w, o, r, what in [(new_p, want[0][0], oracle[0][0], ref_p, "p"),
                                   *((x, y[0], z[0], u, s.name) for x, y, z, u, s in zip(
                                       new_s, want[1], oracle[1], ref_s, program.states))]:
            assert got.shape == w.shape, what
            assert_close(got, w, dtype, f"step {step} {what}")
            assert_close(got, o, dtype, f"step {step} {what} (reference)")
            assert_close(got, r, dtype, f"step {step} {what} (reference, staged)")
        whole = (new_p, new_s)


def test_staged_step_over_unsplit_tensors_is_the_plain_step_bitwise():
    """With nothing split (a replicated copy, HSDP's), the staged entry points give the
    plain C step bit for bit: the same loops, stage by stage."""
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import drive
    for spec, values, shape in ((SHARDED, {"lr": 0.01, "b": 0.9}, (9, 7)),
                                (vega.adafactor, ADA_SHARDED, (3, 8, 6))):
        program = spec.program(shape, **({"factored": True, "min_dim_size_to_factor": 2}
                                         if spec is vega.adafactor else {}))
        kern = codegen.kernel("c", program)
        p = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        g = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        states = kern.init(p, values, torch.float32)
        steps = [torch.zeros((), dtype=torch.int32)]
        want = kern([p], [g], [[s] for s in states], steps, [values], False)
        full = geometry(p.shape)
        view = ShardView(Geometry(tuple(p.shape), axes=(full.r, full.c)), full, frozenset(),
                         0.5)
        results = [None]
        drive({0: kern.staged([p], [g], [[s] for s in states], steps, [values], False, None,
                              [view])}, results, lambda parts: [x * 2 for _, x in parts])
        got = results[0]
        assert torch.equal(got[0][0], want[0][0])
        for a, b in zip(got[1], want[1]):
            assert torch.equal(a[0], b[0])


def test_staged_step_over_shards_refuses_what_it_cannot_read():
    """A reduction whose result a shard splits too (a tensor split along both axes), and a
    shard's state of the wrong shape: ValueError, before anything is written."""
    from vega.codegen.base import Geometry, ShardView, geometry
    program = SHARDED.program((12, 10))
    kern = codegen.kernel("c", program)
    values = {"lr": 0.01, "b": 0.9}
    full = geometry((12, 10))
    p, g = torch.randn(6, 5), torch.randn(6, 5)
    local = Geometry((6, 5), axes=(full.r, full.c))
    states = [torch.zeros(6, 5), torch.zeros(local.shape("r")), torch.zeros(local.shape("c"))]
    before = [x.clone() for x in (p, *states)]
    steps = [torch.zeros((), dtype=torch.int32)]
    gen = kern.staged([p], [g], [[s] for s in states], steps, [values], True, None,
                      [ShardView(local, full, frozenset({0, 1}))])
    with pytest.raises(ValueError, match="its result is split too"):
        gen.send(None)
    bad = [states[0], torch.zeros(4), states[2]]
    gen = kern.staged([p], [g], [[s] for s in bad], steps, [values], True, None,
                      [ShardView(local, full, frozenset({0}))])
    with pytest.raises(ValueError, match="state 'vr' of parameter 0 has shape \\(4,\\)"):
        gen.send(None)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, *states)))
    assert int(steps[0]) == 0
