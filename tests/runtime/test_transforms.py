"""vega.runtime.transforms against optax (float64) and torch.linalg.vector_norm."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import vega
from vega.runtime.transforms import clip_by_global_norm, clip_by_value, global_norm

jax.config.update("jax_enable_x64", True)


def grads(dtype=torch.float64, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 7, generator=gen, dtype=dtype) * scale,
            "b": [torch.randn(7, generator=gen, dtype=dtype) * scale],
            "s": torch.randn((), generator=gen, dtype=dtype) * scale}


def concat(tree):
    return torch.cat([g.reshape(-1).double() for g in torch.utils._pytree.tree_leaves(tree)])


def to_jax(tree):
    return jax.tree.map(lambda t: jnp.asarray(t.numpy()), tree)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 100.0])
def test_clip_by_global_norm_matches_optax(max_norm):
    g = grads(scale=2.0)
    tx = optax.clip_by_global_norm(max_norm)
    jg = to_jax(g)
    want, _ = tx.update(jg, tx.init(jg))
    got = clip_by_global_norm(g, max_norm)
    for a, b in zip(jax.tree.leaves(to_jax(got)), jax.tree.leaves(want)):
        assert a.dtype == b.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-13, atol=0)
    total = global_norm(got).item()
    assert total == pytest.approx(min(max_norm, global_norm(g).item()), rel=1e-13)


def test_below_threshold_is_identity():
    for dtype in (torch.float32, torch.float64, torch.float16):
        g = grads(dtype)
        out = clip_by_global_norm(g, 1e4)
        for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(g)):
            assert a.dtype == dtype and torch.equal(a, b)


def test_global_norm_of_long_float32_leaves_on_the_cpu():
    """torch's CPU norm of one long run of float32 values adds the squares into a few
    float32 sums that stop growing: 2**22 values of 0.1 came out 0.2% low on one thread (and
    2**29 values 37% low on two). global_norm takes a long leaf in chunks: its norm is the
    float64 norm of the same values within a few units in the last place, for a length
    that is no whole number of chunks, a bfloat16 leaf and one not contiguous too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        long = torch.full((2**22 + 3,), 0.1)
        cases = [[long], [long.bfloat16(), torch.ones(3)], [long[:2**20].view(2**10, 2**10).t()]]
        for leaves in cases:
            want = torch.linalg.vector_norm(concat(leaves)).item()
            got = global_norm(leaves)
            assert got.dtype == torch.float32
            assert got.item() == pytest.approx(want, rel=1e-6)
        clipped = clip_by_global_norm([long], 1.0)[0]
        assert clipped[0].item() == pytest.approx(0.1 / torch.linalg.vector_norm(
            long.double()).item(), rel=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_global_norm_of_a_long_leaf_is_the_same_on_any_number_of_threads():
    """A float32 CPU leaf of more than 2**23 values has more than 32,768 chunks, whose squared
    norms torch's CPU sum adds a thread's share at a time: the norm (and so the clipped
    leaf) changed in its last bit between one thread and two. Here the chunks' norms are
    spread over three decades, each chunk one value."""
    k = 36868
    x = torch.zeros(k, 256)
    x[:, 0] = torch.rand(k, generator=torch.Generator().manual_seed(4)).mul(8).exp()
    x = x.view(-1)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got.append((global_norm({"x": x}), clip_by_global_norm([x], 1.0)[0]))
    finally:
        torch.set_num_threads(threads)
    for norm, clipped in got[1:]:
        assert torch.equal(norm, got[0][0]) and torch.equal(clipped, got[0][1])
    want = torch.linalg.vector_norm(x.double()).item()
    assert got[0][0].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("extra", [1, 255])
def test_the_values_past_a_long_leafs_last_whole_chunk_count(extra):
    """A long float32 CPU leaf taken in chunks (NORM_LONG) is no whole number of them: the
    values past the last whole chunk count as much as the others (here they hold the whole
    norm, 5)."""
    from vega.runtime import transforms
    g = torch.zeros(transforms.NORM_LONG + transforms.NORM_CHUNK + extra)
    g[-1], g[-2 if extra > 1 else 0] = 4.0, 3.0
    assert global_norm([g]).item() == 5.0
    assert global_norm({"a": g, "b": torch.ones(1)}).item() == pytest.approx(26**0.5)


def test_global_norm_matches_vector_norm_of_concatenation():
    g = grads(torch.float32)
    n = global_norm(g)
    assert n.dtype == torch.float32 and n.dim() == 0
    torch.testing.assert_close(n, torch.linalg.vector_norm(concat(g)).float())
    mixed = {**grads(torch.float32), "d": torch.randn(4, dtype=torch.float64),
             "h": torch.randn(3).half(), "c": torch.randn(2, dtype=torch.complex64),
             "i": torch.arange(5)}
    want = torch.linalg.vector_norm(torch.cat([
        concat({k: v for k, v in mixed.items() if k not in ("c", "i")}),
        torch.view_as_real(mixed["c"]).reshape(-1).double()]))
    n = global_norm(mixed)
    assert n.dtype == torch.float64
    torch.testing.assert_close(n, want, rtol=1e-6, atol=0)
    half = global_norm({"h": torch.full((4,), 300.0, dtype=torch.float16)})
    assert half.dtype == torch.float32 and half.item() == 600.0   # 300^2 overflows float16
    assert global_norm({}).item() == 0.0


def test_clip_by_global_norm_dtypes_and_non_finite():
    mixed = {"h": torch.full((4,), 300.0, dtype=torch.float16), "i": torch.arange(3),
             "c": torch.tensor([3 + 4j])}
    out = clip_by_global_norm(mixed, 1.0)
    assert out["h"].dtype == torch.float16 and out["c"].dtype == torch.complex64
    assert out["i"] is mixed["i"]
    assert global_norm(out).item() == pytest.approx(1.0, rel=1e-3)
    inf = clip_by_global_norm({"a": torch.tensor([1.0, float("inf")])}, 1.0)["a"]
    assert not torch.isfinite(inf).all()          # an overflow stays visible after clipping
    g = grads()
    assert clip_by_global_norm(g, float("inf")) is g
    t = clip_by_global_norm(g, torch.tensor(0.5, dtype=torch.float64))
    assert global_norm(t).item() == pytest.approx(0.5, rel=1e-13)



def test_a_float32_norm_overflows_where_its_sum_of_squares_does():
    """docs/training.md: a float32 norm is infinite once the sum of squares passes float32's
    range, a norm above about 1.8e19 (not 3.4e38): one gradient of 1e20 is scaled to 0 by
    clip_by_global_norm, as by torch's clip_grad_norm_, and clipped to the norm by the fused
    step, which sums the squares in float64."""
    import vega
    below = {"a": torch.tensor([1.8e19, -0.0])}
    assert global_norm(below).item() == pytest.approx(1.8e19, rel=1e-6)
    big = {"a": torch.tensor([1e20, -0.0])}
    assert global_norm(big).item() == float("inf")
    assert clip_by_global_norm(big, 1.0)["a"].tolist() == [0.0, 0.0]
    t = big["a"].clone().requires_grad_()
    t.grad = big["a"].clone()
    assert torch.nn.utils.clip_grad_norm_([t], 1.0).item() == float("inf")
    assert t.grad.tolist() == [0.0, 0.0]
    for backend in ("reference", "c"):
        p = {"a": torch.zeros(2)}
        out = vega.sgd_step(p, big, vega.sgd_init(p), backend=backend, lr=1.0,
                            max_grad_norm=1.0)[0]["a"]
        assert out.tolist() == [-1.0, 0.0], backend

def test_clip_by_value():
    g = {"a": torch.tensor([-3.0, -0.5, 0.0, 0.7, 9.0, float("nan")]),
         "c": torch.tensor([3 - 0.25j]), "i": torch.tensor([10, -10])}
    out = clip_by_value(g, 1.0)
    assert torch.equal(out["a"][:5], torch.tensor([-1.0, -0.5, 0.0, 0.7, 1.0]))
    assert torch.isnan(out["a"][5])
    assert out["c"].item() == 1 - 0.25j
    assert out["i"] is g["i"]


BAD = [
    (lambda: clip_by_global_norm(grads(), 0.0), "max_norm=0.0"),
    (lambda: clip_by_global_norm(grads(), -1.0), "max_norm=-1.0"),
    (lambda: clip_by_global_norm(grads(), float("nan")), "max_norm=nan"),
    (lambda: clip_by_value(grads(), 0.0), "max=0.0"),
    (lambda: clip_by_value(grads(), -2), "max=-2"),
    # (an int past the float range on the negative side: below every float, not inf)
    (lambda: clip_by_global_norm(grads(), -10**400), "max_norm=-1000"),
    (lambda: clip_by_value(grads(), -10**400), "max=-1000"),
    # (no number: a string, a bool)
    (lambda: clip_by_value(grads(), "1"), "clip_by_value: max='1' must be a positive number"),
    (lambda: clip_by_global_norm(grads(), True),
     "clip_by_global_norm: max_norm=True must be a positive number"),
]


@pytest.mark.parametrize("make,fragment", BAD, ids=[b[1] for b in BAD])
def test_bad_arguments_raise(make, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make()


INF = float("inf")


@pytest.mark.parametrize("dtype,bound,want", [
    (torch.float16, 1e5, [1.0, 6e4, INF, -INF]),  # (past float16's range: inf rounds to inf)
    (torch.float16, 65519.0, [1.0, 6e4, 65504.0, -65504.0]),  # (rounds to float16's largest)
    (torch.float16, 65520.0, [1.0, 6e4, INF, -INF]),  # (a tie: rounds to inf, as to even)
    (torch.bfloat16, 1e39, [1.0, 6e4, INF, -INF]),
    (torch.float32, 1e300, [1.0, 6e4, INF, -INF]),
    (torch.float32, 10**400, [1.0, 6e4, INF, -INF]),  # (an int past every float)
])
def test_clip_by_value_takes_a_bound_past_the_range_of_the_gradients_dtype(dtype, bound, want):
    """A bound the gradients' dtype cannot hold (1e5 for float16 gradients) clamps as it would
    exactly, then rounded to the dtype: finite values are within it, an infinite one becomes
    the bound rounded (torch.clamp refused the bound: value cannot be converted without
    overflow)."""
    g = {"w": torch.tensor([1.0, 6e4, INF, -INF], dtype=dtype)}
    out = clip_by_value(g, bound)["w"]
    assert out.dtype == dtype and out.tolist() == torch.tensor(want, dtype=dtype).tolist()


@pytest.mark.parametrize("max_norm", [1e300, 10**400])
def test_clip_by_global_norm_takes_a_bound_past_the_range_of_the_norm(max_norm):
    """max_norm past the float32 norm's range: every finite norm is within it (the identity);
    an infinite norm scales by 0, as for any finite bound (torch.clamp refused 1e300, and
    10**400 raised OverflowError)."""
    g = {"w": torch.tensor([3.0, 4.0]), "h": torch.tensor([1.0], dtype=torch.float16)}
    out = clip_by_global_norm(g, max_norm)
    assert all(torch.equal(out[k], g[k]) and out[k].dtype == g[k].dtype for k in g)
    if max_norm == 1e300:  # (10**400 is no clipping at all, as inf)
        out = clip_by_global_norm({"w": torch.tensor([3.0, INF])}, max_norm)["w"]
        assert out[0].item() == 0.0 and out[1].isnan()


def test_clip_by_value_traces_under_torch_compile():
    """clip_by_value, a bound past a leaf's range included, traces whole under torch.compile
    (fullgraph) and gives the eager result: the bound is rounded on the host."""
    g = {"h": torch.tensor([1.0, 6e4, float("inf")], dtype=torch.float16),
         "c": torch.tensor([3 - 0.25j]), "w": torch.tensor([3.0, -7.0]), "i": torch.arange(2)}
    compiled = torch.compile(lambda g: (clip_by_value(g, 1e5), clip_by_value(g, 2.0)),
                             fullgraph=True, backend="eager")
    for got, want in zip(compiled(g), (clip_by_value(g, 1e5), clip_by_value(g, 2.0))):
        assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in g)


@pytest.mark.parametrize("who", ["grads_finite", "global_norm", "clip_by_global_norm",
                                 "clip_by_value"])
@pytest.mark.parametrize("layout", ["sparse", "nested"])
def test_a_sparse_or_nested_gradient_is_named(who, layout):
    """A sparse or nested gradient (nn.Embedding(sparse=True)'s) is named by its path: torch's
    norms and finite checks have no kernel for it (a NotImplementedError from inside
    torch: "Could not run 'aten::linalg_vector_norm' with arguments from the 'SparseCPU'
    backend")."""
    import vega
    bad = torch.ones(3, 2).to_sparse() if layout == "sparse" else \
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    g = {"emb": {"weight": bad}, "b": torch.ones(2)}
    fn = {"clip_by_global_norm": lambda g: clip_by_global_norm(g, 1.0),
          "clip_by_value": lambda g: clip_by_value(g, 1.0)}.get(who, getattr(vega, who))
    words = "sparse" if layout == "sparse" else "a nested tensor"
    with pytest.raises(ValueError, match=rf"^{who}: the gradient 'emb.weight' is {words}"):
        fn(g)


@pytest.mark.parametrize("how", ["clip_by_global_norm", "LossScale.unscale"])
def test_complex_leaves_trace_under_torch_compile(how):
    """A complex leaf is scaled at its real dtype, found in a way dynamo traces (fullgraph):
    torch.dtype.to_real() stopped the trace ('Dynamo does not know how to trace method
    to_real of class dtype')."""
    import vega
    g = {"c": torch.tensor([3 - 4j, 1j]), "w": torch.tensor([3.0, -7.0])}
    fn = (lambda g: clip_by_global_norm(g, 1.0)) if how == "clip_by_global_norm" else \
        vega.LossScale.dynamic(init=4.0).unscale
    got, want = torch.compile(fn, fullgraph=True, backend="eager")(g), fn(g)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in g)


def test_a_conjugate_view_is_taken_as_its_values():
    """A complex leaf that is a conjugate view (``x.conj()``, torch's lazy conjugate) is
    taken as the values it holds: torch.view_as_real refuses such a view ("view_as_real
    doesn't work on unresolved conjugated tensors"), which global_norm, clip_by_global_norm,
    clip_by_value and LossScale.unscale raised from inside torch."""
    import vega
    c = torch.tensor([3 + 4j, -1j, 0.5 - 0.25j])
    lazy, plain = {"c": c.conj()}, {"c": c.conj().resolve_conj()}
    assert lazy["c"].is_conj() and not plain["c"].is_conj()
    for fn in (global_norm, lambda g: clip_by_global_norm(g, 1.0),
               lambda g: clip_by_value(g, 2.0), vega.LossScale.dynamic(init=4.0).unscale):
        got, want = fn(lazy), fn(plain)
        for a, b in zip(torch.utils._pytree.tree_leaves(got),
                        torch.utils._pytree.tree_leaves(want), strict=True):
            assert a.dtype == b.dtype and torch.equal(a.resolve_conj(), b)


def test_a_long_leaf_stored_in_another_order_is_not_copied():
    """A long float32 CPU leaf whose memory holds its elements in another order of its
    dimensions (a channels_last convolution's gradient, a transposed one) is normed in the
    order they are stored: reshape(-1) in its own order copied it (a new tensor the size of
    the leaf at every call). Its norm is the float64 norm of its values; a slice with a step
    (no run of memory at all) still steps."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    gen = torch.Generator().manual_seed(0)
    conv = torch.randn(64, 32, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    wide = torch.randn(300, 200, generator=gen).t()
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            made.extend(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                        and t.untyped_storage().data_ptr() not in given)
            return out
    for g in (conv, wide):
        assert not g.is_contiguous() and g.numel() > 2**14
        made.clear()
        with Record():
            got = global_norm([g])
        assert max(made) < 2**14, max(made)
        assert got.item() == pytest.approx(torch.linalg.vector_norm(g.double()).item(),
                                           rel=1e-6)
    stepped = torch.randn(2**16, generator=gen)[::3]
    assert global_norm([stepped]).item() == pytest.approx(
        torch.linalg.vector_norm(stepped.double()).item(), rel=1e-6)


def test_clip_by_global_norm_with_a_tensor_bound_and_bfloat16_leaves():
    """A 0-d tensor bound clips as a number does (the identity below it, never a scale-up),
    and a bfloat16 leaf is scaled in float32 and rounded once, as a float16 one is."""
    g = {"w": torch.tensor([0.3, 0.4])}  # norm 0.5
    out = clip_by_global_norm(g, torch.tensor(2.0))["w"]
    assert torch.equal(out, g["w"])
    out = clip_by_global_norm(g, torch.tensor(0.25))["w"]
    assert torch.allclose(out, g["w"] / 2)
    b = {"w": torch.linspace(-3.0, 5.0, 65, dtype=torch.bfloat16)}
    norm = torch.linalg.vector_norm(b["w"], dtype=torch.float32)
    coef = 1.0 / norm
    out = clip_by_global_norm(b, 1.0)["w"]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (b["w"].float() * coef).bfloat16())


class _Grads(dict):
    """A dict subclass, which torch's pytree takes as one leaf (it walks dict itself)."""


@pytest.mark.parametrize("call", ["global_norm", "clip_by_global_norm", "clip_by_value",
                                  "grads_finite", "unscale"])
def test_a_container_torch_does_not_walk_is_refused_not_passed_over(call):
    # a dict subclass of gradients was one non-tensor leaf to these: its tensors were
    # passed over, so an overflow read as finite, a norm of 3 as 0, and clipping and
    # unscaling returned the gradients unchanged
    grads = _Grads(w=torch.tensor([3.0, float("inf")]))
    fns = {"global_norm": vega.global_norm,
           "clip_by_global_norm": lambda g: vega.clip_by_global_norm(g, 1.0),
           "clip_by_value": lambda g: vega.clip_by_value(g, 1.0),
           "grads_finite": vega.grads_finite,
           "unscale": vega.LossScale.static(2.0).unscale}
    for tree, where in ((grads, "grads"), ({"layer": grads}, "grads leaf 'layer'")):
        with pytest.raises(ValueError, match=f"{call}: {where} is a _Grads"):
            fns[call](tree)
    # (an OrderedDict is walked; None, a number and a torch.Size, no tensor, pass through)
    import collections
    tree = collections.OrderedDict(w=grads["w"], n=None, k=3, shape=torch.Size([2]))
    assert not vega.grads_finite(tree)
    assert vega.clip_by_value(tree, 1.0)["shape"] == torch.Size([2])
