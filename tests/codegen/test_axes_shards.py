"""The step over shards (FSDP2's ``fully_shard``: ``vega.runtime.sharded``) of programs over
a matrix view, on the C and Triton kernels (Triton's under its interpreter, on CPU tensors):
stage by stage, the partial results of reductions a shard splits combined across shards, in
one process (the distributed tests run the same over ranks)."""
import pytest
import torch

import vega
from vega import codegen
from vega.codegen import triton as triton_backend
from vega.codegen.c import available as c_available

from .test_c import assert_close

BACKENDS = [pytest.param("c", marks=pytest.mark.skipif(not c_available(),
                                                       reason="needs a C compiler")),
            pytest.param("triton", marks=pytest.mark.skipif(not triton_backend.available(),
                                                            reason="needs triton"))]


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


def _staged_over_shards(backend, program, p, g, states, values, axis, cuts, step=0,
                        replicas=1):
    """``backend``'s staged step of ``p`` cut along ``axis`` at ``cuts`` into shards, each
    a process of its own (``replicas`` processes holding each shard, their partial sums
    weighted: HSDP): the shards' generators run side by side, each stage's partial
    results summed (or their maximum taken) over all of them. The whole new parameter and
    states, put together, and the combining calls' count."""
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import Done
    full = geometry(p.shape)
    kern = codegen.kernel(backend, program)
    assert backend == "reference" or kern.stageable
    bounds = list(zip([0, *cuts], [*cuts, p.shape[axis]]))
    doms = [s.dom for s in program.states]
    gens = []
    for lo, hi in [b for b in bounds for _ in range(replicas)]:
        local = Geometry(tuple(p.narrow(axis, lo, hi - lo).shape), axes=(full.r, full.c))
        view = ShardView(local, full, frozenset({axis}), 1 / replicas)
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
    for k in range(0, len(outs), replicas):  # a shard's copies alike
        for o in outs[k + 1:k + replicas]:
            assert all(torch.equal(a, b) for a, b in zip(o[0], outs[k][0]))
    outs = outs[::replicas]
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


SHARD_CASES = [  # (shape, the split axis, where it is cut, copies of each shard)
    ((12, 10), 0, [5], 1), ((12, 10), 1, [4, 7], 1), ((3, 8, 6), 1, [3], 1),
    ((3, 8, 6), 0, [1, 1], 1), ((10, 12), 0, [10], 1), ((12, 10), 1, [6], 2),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["sharded", "adafactor"])
@pytest.mark.parametrize("shape,axis,cuts,replicas", SHARD_CASES,
                         ids=[f"{s}/{a}@{c}x{r}" for s, a, c, r in SHARD_CASES])
def test_staged_step_over_shards_of_a_matrix_view_is_the_whole_step(which, shape, axis, cuts,
                                                                    replicas, dtype, backend):
    """A program over a matrix view stepped over shards on ``backend``'s kernels: each
    stage's reductions along an axis a shard splits, and per tensor, combined across the
    shards (uneven ones, an empty one, two copies of each), give the whole tensor's step:
    against the backend's own step of the whole tensor and the reference's, on the
    parameter and every state, over three steps."""
    if which == "sharded":
        program, values = SHARDED.program(shape), {"lr": 0.01, "b": 0.9}
    else:
        program = vega.adafactor.program(shape, factored=True, min_dim_size_to_factor=2)
        values = dict(ADA_SHARDED)
    assert program.uses_axes
    gen = torch.Generator().manual_seed(sum(shape) + axis)
    p = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    kern, ref = codegen.kernel(backend, program), codegen.kernel("reference", program)
    states = ref.init(p, values, dtype)
    whole = (p, states)
    for step in range(3):
        g = (torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + step)).to(dtype)
        steps = [torch.full((), step, dtype=torch.int32)]
        new_p, new_s, rounds = _staged_over_shards(backend, program, whole[0], g, whole[1],
                                                    values, axis, cuts, step, replicas)
        # the reference's staged step over the same shards: a combining call each stage
        # where a shard splits a reduction (Adafactor's mean of the unsplit factor: none)
        ref_p, ref_s, ref_rounds = _staged_over_shards("reference", program, whole[0], g,
                                                        whole[1], values, axis, cuts, step,
                                                        replicas)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_step_over_unsplit_tensors_is_the_plain_step_bitwise(backend):
    """With nothing split (a replicated copy, HSDP's), the staged entry points give the
    plain step bit for bit: the same loops, stage by stage."""
    from vega.codegen.base import Geometry, ShardView, geometry
    from vega.codegen.steps import drive
    for spec, values, shape in ((SHARDED, {"lr": 0.01, "b": 0.9}, (9, 7)),
                                (vega.adafactor, ADA_SHARDED, (3, 8, 6))):
        program = spec.program(shape, **({"factored": True, "min_dim_size_to_factor": 2}
                                         if spec is vega.adafactor else {}))
        kern = codegen.kernel(backend, program)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_step_over_shards_refuses_what_it_cannot_read(backend):
    """A reduction whose result a shard splits too (a tensor split along both axes), a
    shard's state of the wrong shape, and a view of other local values than the parameter
    holds: ValueError, before anything is written."""
    from vega.codegen.base import Geometry, ShardView, geometry
    program = SHARDED.program((12, 10))
    kern = codegen.kernel(backend, program)
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
    wide = Geometry((12, 5), axes=(full.r, full.c))  # (its states: those of 12 x 5 values)
    gen = kern.staged([p], [g], [[states[0]], [torch.zeros(wide.shape("r"))],
                                 [torch.zeros(wide.shape("c"))]], steps, [values], True,
                      None, [ShardView(wide, full, frozenset({1}))])
    with pytest.raises(ValueError, match=r"parameter 0 has shape \(6, 5\), but its shard's "
                       r"view holds local values of shape \(12, 5\)"):
        gen.send(None)
    assert all(torch.equal(a, b) for a, b in zip(before, (p, *states)))
    assert int(steps[0]) == 0
