"""8-bit blockwise state (``state_dtype=torch.uint8``, docs/precision.md).

- the maps: a value comes back within a step of its code, a block's largest value exactly,
  zeros exactly, a NaN makes its block NaN and no other;
- which map a state takes: the unsigned one only where the spec keeps the state >= 0;
- the reference's step is 8-bit AdamW written out in this file, code for code; the C
  and Triton kernels (their own, under the interpreter) agree with it over several steps,
  on the parameters and on every code and scale, with clipping, a skipped step and
  tensors split between threads; blocks of a subnormal absmax keep the maps' accuracy;
- tensors of fewer than 4,096 values keep float32 state; bytes of state per parameter;
- checkpoints: state_dict, torch.save, vega.save and dcp round trip bitwise and resume
  bitwise; a float state loaded into an 8-bit optimizer is quantized (and back), with a
  warning;
- bad uses are ValueErrors naming the problem.
"""
import io
import warnings

import pytest
import torch

import vega
from vega.codegen import c as c_backend
from vega.codegen import quant
from vega.runtime.tree import flatten
from tests.runtime.test_tensors import _one_rank

needs_c = pytest.mark.skipif(not c_backend.available(), reason="no C compiler")
BACKENDS = [pytest.param("c", marks=needs_c), "triton"]  # (Triton: its interpreter)
U8 = torch.uint8
SHAPES = {"w": (96, 200), "edge": (4096,), "odd": (4097,), "v": (70,), "t": (33, 131)}


def params_of(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def grads_of(params, k):
    g = torch.Generator().manual_seed(100 + k)
    # magnitudes spread over three decades within each block
    return {n: torch.randn(p.shape, generator=g) * torch.logspace(-3, 0, p.numel(),
                                                                  ).reshape(p.shape)[
        ..., torch.randperm(p.shape[-1], generator=g)] for n, p in params.items()}


# -- the maps, written out here (the module's docstring) -----------------------------------

def codes_written_out(x, signed):
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % 256
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, 256)
    absmax = blocks.abs().amax(1)
    up = torch.where(absmax < 2.0 ** -126, 2.0 ** 32, 1.0)  # (a subnormal absmax: 1 / it
    inv = torch.where(absmax > 0, 1.0 / (absmax * up), torch.zeros_like(absmax))  # overflows)
    y = ((blocks * up[:, None]) * inv[:, None]).reshape(-1)[:flat.numel()]
    y = torch.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)
    if signed:
        y = y.clamp(-1, 1)
        c = torch.round(torch.sign(y) * y.abs().sqrt() * 127) + 127
    else:
        c = torch.round(y.clamp(0, 1).sqrt().sqrt() * 255)
    return c.to(U8).reshape(x.shape), absmax


def values_written_out(codes, absmax, signed):
    c = codes.reshape(-1).float()
    t = (c - 127) * (1 / 127) if signed else c * (1 / 255)
    v = t * t.abs() if signed else (t * t) * (t * t)
    return (v * absmax.repeat_interleave(256)[:c.numel()]).reshape(codes.shape)


@pytest.mark.parametrize("signed", [True, False])
def test_map_round_trip(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=g) * torch.logspace(-4, 1, 10_000)
    if not signed:
        x = x.abs()
    codes, absmax = quant.quantize_t(x, signed)
    assert codes.dtype == U8 and codes.shape == x.shape and absmax.shape == (40,)
    want_codes, want_absmax = codes_written_out(x, signed)
    assert torch.equal(codes, want_codes) and torch.equal(absmax, want_absmax)
    back = quant.dequantize_t(codes, absmax, signed)
    assert torch.equal(back, values_written_out(codes, absmax, signed))
    scale = absmax.repeat_interleave(256)[:x.numel()]
    # within a step of the code at the value: at most 1/127 of the block's absmax
    assert ((back - x).abs() <= scale / 127 + 1e-12).all()
    tiny = x * 2.0 ** -140  # (blocks of subnormal absmax: written out alike)
    assert torch.equal(quant.quantize_t(tiny, signed)[0], codes_written_out(tiny, signed)[0])
    # each block's largest magnitude comes back exactly, its sign kept
    blocks = x.reshape(-1, 250)  # (not blocks: just a place to look for the largest)
    k = x.abs().reshape(-1)[:256].argmax()
    assert back[k] == x[k]
    assert blocks.numel() == x.numel()


def test_map_zeros_nan_and_inf():
    x = torch.zeros(1024)
    x[300] = float("nan")  # block 1
    x[600] = 2.0  # block 2
    codes, absmax = quant.quantize_t(x, True)
    back = quant.dequantize_t(codes, absmax, True)
    assert torch.equal(back[:256], torch.zeros(256))  # zeros exactly
    assert back[256:512].isnan().all()  # the NaN's block reads NaN, every value of it
    assert back[600] == 2.0 and (back[512:768] == 0).sum() == 255
    assert torch.equal(back[768:], torch.zeros(256))
    x = torch.full((256,), 1.0)
    x[5] = float("inf")
    back = quant.dequantize_t(*quant.quantize_t(x, False), False)
    assert not back.isfinite().any()  # an inf is not lost either


# a rule whose two 8-bit states are the gradient (signed map) and its magnitude (unsigned)
KEEP_G = """
optimizer keep_g(lr = 0.0 in [0, inf)) {
    state m = zeros
    state s = zeros
    m = g
    s = abs(g)
    p = p - lr * (m + s)
}
"""


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_blocks_of_subnormal_values_are_quantized_against_the_maps(backend):
    # 1 / absmax overflows to inf below about 2.9e-39 (2^-128): every value of a block of
    # such an absmax was coded as the block's largest (or 0), on every backend. Blocks of
    # absmax from 2^-149 to 2^-95: each block's codes are those of the same values times
    # 2^40 (a normal block: the maps do not see a power of two), its scale its absmax, and
    # its values come back within a step of the map (1/127 of the absmax, and a subnormal's
    # last place)
    spec = vega.compile(KEEP_G)
    x = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    x = (x / x.reshape(-1, 256).abs().amax(1).repeat_interleave(256)).double()
    exps = torch.tensor([-149 + 53 * k // 31 for k in range(32)], dtype=torch.float64)
    x = (x * (2.0 ** exps).repeat_interleave(256)).float()
    x[256 * 5:256 * 6] = 0.0  # (a block of zeros, whose scale is 0)
    absmax = x.abs().reshape(-1, 256).amax(1)
    assert absmax.amax() == 2.0 ** -96 and (absmax > 0).sum() == 31
    assert (absmax < 2.0 ** -128).sum() == 13  # (1 / absmax is infinite)

    def stepped(grad, backend):
        params = {"w": torch.zeros(8192)}
        state = spec.init(params, state_dtype=U8)
        return spec.step(params, {"w": grad}, state, backend=backend)[1]

    got, big, ref = stepped(x, backend), stepped(x * 2.0 ** 40, backend), stepped(x, "reference")
    for name, signed, want in (("m", True, x), ("s", False, x.abs())):
        codes, scales = got[name]["w"], got[name + "_absmax"]["w"]
        assert torch.equal(scales, absmax) and torch.equal(codes, big[name]["w"]), name
        back = quant.dequantize_t(codes, scales, signed)
        step = absmax.repeat_interleave(256) / 127 + 2.0 ** -149
        assert ((back - want).abs() <= step).all(), name
        # and the reference's codes but for values on a rounding boundary
        assert (codes.int() - ref[name]["w"].int()).abs().max() <= 1, name
        assert (codes != ref[name]["w"]).float().mean() < 2e-3, name



@pytest.mark.parametrize("backend", ["reference", pytest.param("c", marks=needs_c)])
def test_a_second_moment_under_the_maps_smallest_step_at_eps_0_divides_by_0(backend):
    # docs/precision.md: a value under half a map's smallest step reads back as 0, so at
    # eps = 0 an element whose second moment fell there and whose gradient is then 0 is
    # divided by 0 (NaN for good), where float32 state (and torch.optim.Adam) steps on;
    # any positive eps keeps it finite
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    g[1] = 1e-7
    ends = {}
    for state_dtype, eps in [(U8, 0.0), (U8, 1e-30), (None, 0.0), ("torch", 0.0)]:
        p = torch.zeros(4096, requires_grad=True)
        opt = (torch.optim.Adam([p], lr=1e-2, eps=eps) if state_dtype == "torch" else
               vega.optim.Adam([p], lr=1e-2, eps=eps, state_dtype=state_dtype,
                               backend=backend))
        for k in range(2):
            p.grad = g.clone()
            p.grad[1] = g[1] if k == 0 else 0.0
            opt.step()
        ends[state_dtype, eps] = p.detach()[1]
    assert ends[U8, 0.0].isnan()
    assert ends[U8, 1e-30] == -1e-2  # (its second step divides 0 by 1e-30)
    assert torch.allclose(ends[None, 0.0], ends["torch", 0.0], rtol=1e-6)
    assert -0.0168 < float(ends[None, 0.0]) < -0.0166

class made_sizes(list):
    """(numel, dtype) of each tensor ``fn()`` makes (no view of a tensor given to an
    operation); ``result``: what it returned."""

    def __init__(self, fn):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        made = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                         if isinstance(t, torch.Tensor)}
                made.extend((t.numel(), t.dtype) for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor)
                            and t.untyped_storage().data_ptr() not in given)
                return out
        super().__init__()
        with Record():
            self.result = fn()


@pytest.mark.parametrize("signed", [True, False])
def test_a_long_tensor_is_quantized_a_chunk_at_a_time(signed, monkeypatch):
    """quantize_t and dequantize_t take QUANT_CHUNK values at a time (whole blocks): the
    same codes, scales and values as at once, and no temporary longer than a chunk (at once,
    some ten float32 tensors the size of the input: 36 bytes a value at init, 72 GB for
    AdamW's two 8-bit states of a parameter of 2**31 values). A chunk of 4 blocks here, over
    a length that is no whole number of chunks or blocks, with a NaN, an inf and a zero
    block."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10_000, generator=g) * torch.logspace(-4, 1, 10_000)
    x = x if signed else x.abs()
    x[3000], x[5000], x[7000:7256] = float("nan"), float("inf"), 0.0
    want = quant.quantize_t(x, signed)  # (one chunk: the length is below 2**22)
    monkeypatch.setattr(quant, "QUANT_CHUNK", 4 * quant.BLOCK, raising=False)
    made = made_sizes(lambda: quant.quantize_t(x.reshape(100, 100), signed))
    codes, absmax = made.result
    assert codes.shape == (100, 100) and torch.equal(codes.reshape(-1), want[0])
    assert torch.equal(absmax.isnan(), want[1].isnan())
    assert torch.equal(absmax.nan_to_num(), want[1].nan_to_num())
    assert max(n for n, dtype in made if dtype != U8) <= 4 * quant.BLOCK
    # and back, into bfloat16: the same values as at once; no temporary but the result
    # longer than a chunk
    monkeypatch.setattr(quant, "QUANT_CHUNK", 2**22)
    back = quant.dequantize_t(codes, absmax, signed, torch.bfloat16)
    monkeypatch.setattr(quant, "QUANT_CHUNK", 4 * quant.BLOCK)
    made = made_sizes(lambda: quant.dequantize_t(codes, absmax, signed, torch.bfloat16))
    assert torch.equal(made.result.isnan(), back.isnan())
    assert torch.equal(made.result.nan_to_num(), back.nan_to_num())
    assert made.result.shape == (100, 100) and made.result.dtype == torch.bfloat16
    assert [n for n, _ in made if n > 4 * quant.BLOCK] == [10_000]


def test_init_quantizes_each_state_as_it_makes_it(monkeypatch):
    """8-bit init makes one state's float32 values at a time and quantizes them (AdamW's
    two were made before either was quantized, and each scale state's init made and copied
    values like the parameter, then dropped): at most two float32 tensors the size of the
    parameter are alive at once, its copy in float32 and one state's values (six before)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    n = 8192

    class Alive(TorchDispatchMode):
        made, most = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() == n and t.is_floating_point() \
                        and t.untyped_storage().data_ptr() not in given:
                    Alive.made.append(weakref.ref(t))
            Alive.most = max(Alive.most, sum(r() is not None for r in Alive.made))
            return out

    monkeypatch.setattr(quant, "QUANT_CHUNK", 4 * quant.BLOCK, raising=False)
    params = {"w": torch.ones(n, dtype=torch.bfloat16)}
    with Alive():
        state = vega.adamw_init(params, state_dtype=U8)
    assert state["mu"]["w"].dtype == state["nu"]["w"].dtype == U8
    assert Alive.most == 2


@pytest.mark.parametrize("name, want", [
    ("adamw", {"mu": True, "nu": False}), ("rmsprop", {"nu": False}),
    ("adagrad", {"acc": False}), ("lion", {"m": True}), ("lamb", {"mu": True, "nu": False}),
])
def test_a_state_kept_nonnegative_takes_the_unsigned_map(name, want):
    program = getattr(vega, name).program()
    q = quant.variant(program, frozenset(want))
    assert {n: signed for n, (_, signed) in q.quant.items()} == want
    assert q.state_names[-len(want):] == tuple(n + "_absmax" for n in want)


def test_a_bias_corrected_step_size_is_known_nonnegative():
    """1 - b2 ^ t, with b2 in [0, 1), is not negative: AdaMod's average of step sizes takes
    the unsigned map (where the signed map's smallest value, 6e-5 of its block's largest,
    zeroed the small step sizes beside a large one, and those values stopped moving); a
    power whose base may exceed 1, or a constant below 1, proves nothing."""
    rule = ("optimizer o(lr = 1e-3 in [0, inf), b1 = 0.9 {}, b3 = 0.9 in [0, 1)) {{\n"
            "  state v = zeros\n  state s = zeros\n  v = 0.999 * v + 0.001 * g * g\n"
            "  s = b3 * s + (1 - b3) * lr / ({} - b1 ^ t) / (sqrt(v) + 1e-8)\n"
            "  p = p - min(s, lr) * g\n}}\n")
    for rng, c, signed in (("in [0, 1)", "1", False), ("", "1", True),
                           ("in [0, 2]", "1", True), ("in [0, 1)", "0.5", True)):
        program = vega.compile(rule.format(rng, c)).program()
        q = quant.variant(program, frozenset({"s"}))
        assert q.quant["s"][1] is signed, (rng, c)


@pytest.mark.parametrize("expr, rng, signed", [
    ("max(s - g, 0)", "", False), ("max(g, s)", "", False), ("min(s, g)", "", True),
    ("min(s, abs(g))", "", False), ("s + max(g)", "", True), ("s + max(abs(g))", "", False),
    ("where(g > 0, s, g)", "", True), ("where(g > 0, s, g * g)", "", False),
    ("s * g", "", True), ("s * g * g", "", False), ("abs(g) + (1 - b)", "in [0, 1]", False),
    ("abs(g) + (1 - b)", "in [0, 2]", True), ("abs(g) ^ b", "", False), ("g ^ b", "", True),
    ("abs(g) + -1", "", True), ("s + mean(abs(g))", "", False), ("s + sum(g)", "", True),
    ("floor(s + g * g)", "", False), ("round(g)", "", True),
])
def test_the_proof_of_a_nonnegative_state_by_operation(expr, rng, signed):
    """Each operation's rule in the proof that a state is never negative (an unsigned map
    where it holds, the signed one where it may fail): max of one value known >= 0, min and
    where of values all known so, a product with each factor of unknown sign an even number
    of times, a per-tensor max, sum or mean of a value known so, c - h with h at most c, a
    power of a base known so, a rounding of one, a literal's sign."""
    text = f"optimizer o(b = 0.5 {rng}) {{\n  state s = zeros\n  s = {expr}\n  p = p - s\n}}\n"
    q = quant.variant(vega.compile(text).program(), frozenset({"s"}))
    assert q.quant["s"][1] is signed


@pytest.mark.parametrize("init, signed", [("-1", True), ("1", False)])
def test_a_state_that_starts_negative_takes_the_signed_map(init, signed):
    text = (f"optimizer o() {{\n  state s = {init}\n  s = abs(g) + s * 0.5\n  p = p - s\n}}\n")
    q = quant.variant(vega.compile(text).program(), frozenset({"s"}))
    assert q.quant["s"][1] is signed


# -- the step --------------------------------------------------------------------------------

def adamw_8bit_written_out(params, grads_at, steps, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                           wd=0.01):
    """8-bit AdamW, float32 arithmetic, written out: (params, {name: (mu, nu) codes and
    scales}). Tensors under 4,096 values keep float32 moments."""
    p = {n: t.clone() for n, t in params.items()}
    st = {}
    for n, t in p.items():
        if t.numel() >= 4096:
            st[n] = [*codes_written_out(torch.zeros_like(t), True),
                     *codes_written_out(torch.zeros_like(t), False)]
        else:
            st[n] = [torch.zeros_like(t), torch.zeros_like(t)]
    for k in range(steps):
        g = grads_at(p, k)
        t = k + 1
        for n in p:
            if p[n].numel() >= 4096:
                mu = values_written_out(st[n][0], st[n][1], True)
                nu = values_written_out(st[n][2], st[n][3], False)
            else:
                mu, nu = st[n]
            mu = b1 * mu + (1 - b1) * g[n]
            nu = b2 * nu + (1 - b2) * g[n] * g[n]
            c1 = torch.tensor(1 - b1 ** t, dtype=torch.float64).float()
            c2 = torch.tensor(1 - b2 ** t, dtype=torch.float64).float()
            d = (mu / c1) / ((nu / c2).sqrt() + eps)
            p[n] = p[n] - lr * (d + wd * p[n])
            st[n] = [*codes_written_out(mu, True), *codes_written_out(nu, False)] \
                if p[n].numel() >= 4096 else [mu, nu]
    return p, st


def run_adamw(backend, steps=5, shapes=SHAPES, **kw):
    params = params_of(shapes)
    state = vega.adamw.init(params, state_dtype=U8)
    for k in range(steps):
        params, state = vega.adamw.step(params, grads_of(params, k), state, backend=backend,
                                        lr=1e-2, **kw)
    return params, state


def test_reference_is_8bit_adamw_written_out():
    got_p, got_s = run_adamw("reference")
    want_p, want_s = adamw_8bit_written_out(params_of(), grads_of, 5)
    for n in SHAPES:
        torch.testing.assert_close(got_p[n], want_p[n], rtol=1e-5, atol=1e-6)
        if got_p[n].numel() >= 4096:
            mine = [got_s["mu"][n], got_s["mu_absmax"][n], got_s["nu"][n],
                    got_s["nu_absmax"][n]]
            for label, a, b in zip(("mu", "mu scale", "nu", "nu scale"), mine, want_s[n]):
                assert a.dtype == b.dtype, (n, label)
                if a.dtype == U8:  # code for code, but for a value on a rounding boundary
                    assert (a.int() - b.int()).abs().max() <= 1, (n, label)
                    assert (a != b).float().mean() < 1e-3, (n, label)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=f"{n} {label}")
        else:
            assert got_s["mu_absmax"][n] is None and got_s["mu"][n].dtype == torch.float32


def assert_same_8bit(got, ref):
    (gp, gs), (rp, rs) = got, ref
    assert gs.keys() == rs.keys()
    for n in gp:
        torch.testing.assert_close(gp[n], rp[n], rtol=1e-4, atol=1e-5, msg=n)
    for field in gs:
        if field == "step":
            assert torch.equal(gs[field], rs[field])
            continue
        for n, r in rs[field].items():
            x = gs[field][n]
            if r is None:
                assert x is None
                continue
            assert x.dtype == r.dtype, (field, n)
            if r.dtype == U8:  # codes: the same but for values on a rounding boundary
                assert (x.int() - r.int()).abs().max() <= 1, (field, n)
                assert (x != r).float().mean() < 2e-3, (field, n)
            else:
                torch.testing.assert_close(x, r, rtol=1e-4, atol=1e-7, msg=f"{field} {n}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [{}, {"max_grad_norm": 0.5}], ids=["plain", "clipped"])
def test_backends_match_reference(backend, kw):
    assert_same_8bit(run_adamw(backend, **kw), run_adamw("reference", **kw))
    # the kernels are the backend's own, not a hand-off to the reference's
    # (the variants this step made: other tests of the process may have made others)
    q8 = [v for v in vega.adamw.program().variants.values() if v.quant and backend in v.kernels]
    assert q8 and all(type(v.kernels[backend]).__module__ != "vega.codegen.reference"
                      for v in q8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, hypers", [
    ("lamb", {"lr": 1e-2}), ("rmsprop", {"lr": 1e-3, "momentum": 0.9}),
    ("adagrad", {"lr": 1e-2}), ("lion", {"lr": 1e-3}), ("sgd", {"lr": 1e-2, "momentum": 0.9}),
    ("adam", {"lr": 1e-2, "amsgrad": True}),
])
def test_backends_match_reference_across_rules(name, hypers, backend):
    spec = getattr(vega, name)

    def run(backend):
        params = params_of()
        state = spec.init(params, state_dtype=U8, **hypers)
        for k in range(4):
            params, state = spec.step(params, grads_of(params, k), state, backend=backend,
                                      **hypers)
        return params, state
    got, ref = run(backend), run("reference")
    assert any(t is not None and t.dtype == U8 for tree in got[1].values()
               if isinstance(tree, dict) for t in tree.values())
    assert_same_8bit(got, ref)


@needs_c
def test_c_codes_from_the_table_or_the_roots_step_alike(monkeypatch):
    """The C kernels form their codes from a table or from the maps' roots, as
    ``render.q8_codes`` chooses for the CPU (``VEGA_C_Q8_TABLE`` decides instead): each
    way, on a spec compiled afresh, five steps give the same parameters, codes and scales
    bit for bit, and the reference's (``assert_same_8bit``)."""
    from vega.codegen.c import render
    runs = {}
    for forced, how in (("1", "table"), ("0", "code")):
        monkeypatch.setenv("VEGA_C_Q8_TABLE", forced)
        assert render.q8_codes() == how
        spec = vega.compile(vega.adamw.source_text + f"\n# VEGA_C_Q8_TABLE={forced}\n")
        params = params_of()
        state = spec.init(params, state_dtype=U8)
        for k in range(5):
            params, state = spec.step(params, grads_of(params, k), state, backend="c",
                                      lr=1e-2, max_grad_norm=0.5)
        kern = [v for v in spec.program().variants.values() if v.quant][0].kernels["c"]
        sources = [kern.source(dtypes) for dtypes in kern._libs]
        assert sources and all(f"c_[q] = q8_{how}_signed(B" in src for src in sources)
        assert all(("q8_cells_u[" in src) == (how == "table") for src in sources)
        runs[how] = params, state
    assert_same_8bit(runs["code"], run_adamw("reference", max_grad_norm=0.5))
    for tree_a, tree_b in zip(runs["table"], runs["code"]):
        flat_a, flat_b = flatten(tree_a)[0], flatten(tree_b)[0]
        assert len(flat_a) == len(flat_b) > 0
        for a, b in zip(flat_a, flat_b):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("name, block, small", [("adamw", 1024, 2048), ("adan", 512, 1024)])
def test_triton_at_a_gpus_blocks_steps_as_at_the_interpreters(name, block, small):
    """With 8-bit state a bfloat16 parameter's update takes 4 values a thread (AdamW: BLOCK
    1024) or 2 (adan's four states: 512) on a GPU (``triton_runtime.update_block``); run so
    under the interpreter, the step is bitwise the one at the interpreter's own BLOCK."""
    from vega.codegen import triton_ptx, triton_runtime
    spec = getattr(vega, name)
    # (w: 8-bit state (MIN_NUMEL 4096 values or more), blocks of either size and a part of
    # one; every program costs the interpreter its time)
    shapes = {"w": (24, 200), "odd": (4097,), "v": (70,)}

    def run():
        params = {k: v.to(torch.bfloat16) for k, v in params_of(shapes).items()}
        state = spec.init(params, state_dtype=U8)
        for k in range(3):
            params, state = spec.step(params, grads_of(params, k), state, backend="triton",
                                      lr=1e-2)
        return params, state
    want = run()
    with triton_runtime.gpu_sizes():
        got = run()
        params = {k: v.to(torch.bfloat16) for k, v in params_of(shapes).items()}
        state = spec.init(params, state_dtype=U8)
        found = triton_ptx.record(lambda: spec.step(params, grads_of(params, 0), state,
                                                    backend="triton", lr=1e-2))
    assert {dict(x.constexprs)["BLOCK"] for x in found
            if x.kernel.endswith("_update")} == {block, small}  # (the small tensor's: floats)
    for n in shapes:
        assert torch.equal(got[0][n], want[0][n]), n
    for field, tree in want[1].items():
        if isinstance(tree, dict):
            for n, x in tree.items():
                assert (x is None and got[1][field][n] is None) or torch.equal(
                    got[1][field][n], x), (field, n)
    assert any(t is not None and t.dtype == U8 for tree in want[1].values()
               if isinstance(tree, dict) for t in tree.values())


@needs_c
def test_c_threads_split_a_tensor_at_blocks():
    """A tensor long enough to be split between threads (and one not a whole number of
    blocks; and a long one after such a tensor, whose blocks start off the whole blocks of
    all the values): every thread's share is whole blocks of its tensors, so the codes
    equal a single thread's."""
    before = torch.get_num_threads()
    for shapes in ({"big": (300_001,), "w": (96, 200)}, {"odd": (4097,), "big": (300_001,)}):
        try:
            torch.set_num_threads(1)
            one = run_adamw("c", steps=2, shapes=shapes)
            torch.set_num_threads(max(2, before))
            many = run_adamw("c", steps=2, shapes=shapes)
        finally:
            torch.set_num_threads(before)
        for field in ("mu", "nu", "mu_absmax", "nu_absmax"):
            for n in shapes:
                assert torch.equal(one[1][field][n], many[1][field][n]), (field, n)
        if "w" in shapes:  # (the second's codes differ from the reference's by one within
            # a rounding of a code's boundary, as docs/precision.md allows)
            assert_same_8bit(one, run_adamw("reference", steps=2, shapes=shapes))


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_skipped_step_leaves_codes_and_scales(backend):
    params = params_of()
    state = vega.adamw.init(params, state_dtype=U8)
    params, state = vega.adamw.step(params, grads_of(params, 0), state, backend=backend)
    bad = grads_of(params, 1)
    bad["w"][3, 4] = float("nan")
    new_p, new_s = vega.adamw.step(params, bad, state, backend=backend, skip_nonfinite=True)
    for field in ("mu", "nu", "mu_absmax", "nu_absmax"):
        for n, t in state[field].items():
            if t is not None:
                assert torch.equal(new_s[field][n], t), (field, n)
    assert all(torch.equal(new_p[n], params[n]) for n in params)


@needs_c
def test_class_in_place_on_c_matches_reference():
    def run(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                    torch.nn.Linear(128, 10))
        opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8, backend=backend,
                               max_grad_norm=1.0)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(32, 64, generator=g)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return model, opt
    (mc, oc), (mr, orf) = run("c"), run("reference")
    for pc, pr in zip(mc.parameters(), mr.parameters()):
        torch.testing.assert_close(pc, pr, rtol=1e-4, atol=1e-5)
        sc, sr = oc.state[pc], orf.state[pr]
        assert sc.keys() == sr.keys()
        for k in sc:
            if sc[k].dtype == U8:
                assert (sc[k].int() - sr[k].int()).abs().max() <= 1
            else:
                torch.testing.assert_close(sc[k], sr[k], rtol=1e-4, atol=1e-7)
    w = mc[0].weight
    assert oc.state[w]["mu"].dtype == U8 and oc.state[w]["mu_absmax"].shape == (32,)
    assert oc.state[mc[0].bias]["mu"].dtype == torch.float32  # 128 values: float32


def test_small_tensors_keep_float32_and_bytes_per_parameter():
    params = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    state = vega.adamw.init(params, state_dtype=U8)
    assert state["mu"]["b"].dtype == torch.float32 and state["mu_absmax"]["b"] is None
    big = sum(t.numel() * t.element_size() for f in ("mu", "nu", "mu_absmax", "nu_absmax")
              for t in [state[f]["w"]])
    assert big / params["w"].numel() == 2 + 2 * 4 / 256  # 2.03: codes, scales included
    assert big / params["w"].numel() <= 2.1
    # per state by name: only nu in 8 bits
    state = vega.adamw.init(params, state_dtype={"nu": U8})
    assert state["mu"]["w"].dtype == torch.float32 and state["nu"]["w"].dtype == U8
    assert "mu_absmax" not in state and state["nu_absmax"]["w"].shape == (256,)


def test_mode_reads_8bit_state():
    params = {"w": torch.randn(64, 100)}
    spec = vega.schedule_free_adamw
    state = spec.init(params, state_dtype={"z": U8, "nu": U8})  # (z named: a copy of p)
    assert state["z"]["w"].dtype == U8
    for k in range(3):
        params, state = spec.step(params, grads_of(params, k), state, lr=1e-2)
    ref_state = {**state}
    values = {n: quant.dequantize_t(state["z"][n], state["z_absmax"][n], True)
              for n in params}
    ref_state["z"] = values
    del ref_state["z_absmax"]
    got = spec.mode("eval", params, state, lr=1e-2)
    ref_state_f32 = {k: v for k, v in ref_state.items()}
    want = spec.mode("eval", params, ref_state_f32, lr=1e-2)
    torch.testing.assert_close(got["w"], want["w"])


# -- checkpoints -----------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()


def _same_state(opt_a, model_a, opt_b, model_b):
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_state_dict_round_trip_and_resume_bitwise():
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, 3, seed=1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    model2 = _model(seed=5)
    model2.load_state_dict(model.state_dict())
    opt2 = vega.optim.AdamW(model2.parameters(), lr=1e-2, state_dtype=U8)
    buf.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # codes into an 8-bit optimizer: nothing to say
        opt2.load_state_dict(torch.load(buf))
    _same_state(opt, model, opt2, model2)
    assert opt2.state[model2[0].weight]["mu"].dtype == U8
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    _same_state(opt, model, opt2, model2)


def test_8bit_state_saved_from_shards_cut_otherwise_is_refused():
    """A state dict's group holds, for a DTensor parameter's 8-bit states, how its shards
    were cut (``quant.LAYOUT_KEY``): a row of the scales holds one shard's blocks. Loaded
    where the parameter is cut otherwise (here one whole tensor), it is refused, naming the
    parameter and both layouts, the optimizer left as it was; a malformed entry is refused
    too. A plain parameter's state dict holds none, and one of its own layout loads."""
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, 2, seed=1)
    saved = opt.state_dict()
    assert all(quant.LAYOUT_KEY not in g for g in saved["param_groups"])
    opt2 = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    layouts = [None] * len(saved["param_groups"][0]["params"])
    for value, words in ((["Shard(dim=0) over 4"] + layouts[1:],
                          r"parameter 0 were saved from shards cut as 'Shard\(dim=0\) over 4', "
                          "and its shards here are cut as 'one whole tensor'"),
                         ("Shard(dim=0) over 4", r"vega_q8_shards='Shard\(dim=0\) over 4'"),
                         (layouts[1:], "a str\\), or None")):
        bad = {**saved, "param_groups": [{**saved["param_groups"][0],
                                          quant.LAYOUT_KEY: value}]}
        with pytest.raises(ValueError, match=words):
            opt2.load_state_dict(bad)
        assert not opt2.state and quant.LAYOUT_KEY not in opt2.param_groups[0]
    same = {**saved, "param_groups": [{**saved["param_groups"][0],
                                       quant.LAYOUT_KEY: [""] + layouts[1:]}]}
    opt2.load_state_dict(same)
    assert quant.LAYOUT_KEY not in opt2.param_groups[0]
    _same_state(opt, model, opt2, model)


def test_a_state_dict_loaded_shares_no_codes_with_the_optimizer_it_came_from():
    """Loading copies the 8-bit codes and their scales, as it copies float states: a state
    dict taken from a live optimizer (whose tensors it holds) and loaded into another leaves
    the two apart, each stepping its own codes."""
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, 2, seed=1)
    model2 = _model(seed=5)
    model2.load_state_dict(model.state_dict())
    opt2 = vega.optim.AdamW(model2.parameters(), lr=1e-2, state_dtype=U8)
    opt2.load_state_dict(opt.state_dict())  # (no copy: the live tensors)
    w, w2 = model[0].weight, model2[0].weight
    assert opt2.state[w2]["mu"].dtype == U8
    assert opt2.state[w2]["mu"].data_ptr() != opt.state[w]["mu"].data_ptr()
    before = {k: v.clone() for k, v in opt.state[w].items()}
    _train(model2, opt2, 1, seed=2)
    for k, v in before.items():
        assert torch.equal(opt.state[w][k], v), k


def test_codes_saved_under_other_maps_are_refused_on_loading():
    """A saved group holding 8-bit codes records the version of the maps they are read with
    ('vega_q8_maps', in the group, which torch's get_state_dict keeps): codes saved under
    other maps, or by a vega that did not record them, are refused by an 8-bit optimizer and
    by one that dequantizes them, changing nothing, where they were read with this vega's
    map, as other values (AdamW's nu saved in the square-root map before the fourth-root map
    came made the next steps hundreds of times too long). A group of float state records
    nothing and needs nothing."""
    model, _, saved = _saved_8bit(2)
    assert [g.get("vega_q8_maps") for g in saved["param_groups"]] == [3]
    for maps, said in ((None, "saved by a vega that did not record which maps"),
                       (2, "saved under vega's 8-bit maps version 2")):
        groups = [{k: v for k, v in g.items() if k != "vega_q8_maps"} for g in
                  saved["param_groups"]]
        if maps is not None:
            groups[0]["vega_q8_maps"] = maps
        for keeps in (U8, None):
            opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=keeps)
            with pytest.raises(ValueError, match=rf"AdamW\.load_state_dict: state 'mu' of "
                                                 rf"parameter id 0 \(group 0\) holds 8-bit "
                                                 rf"codes {said}"):
                opt.load_state_dict({**saved, "param_groups": groups})
            assert not opt.state and "vega_q8_maps" not in opt.param_groups[0]
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["vega_q8_maps"] == 3  # (for torch's flattened loading)
    with pytest.warns(UserWarning, match="the 8-bit states are dequantized to float32"):
        converted = opt.torch_state_dict()
    assert "vega_q8_maps" not in converted["param_groups"][0]
    floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, floats, 1, seed=2)
    assert "vega_q8_maps" not in floats.state_dict()["param_groups"][0]


def test_state_dict_of_float_state_asks_no_parameter_for_codes(monkeypatch):
    """state_dict() records the maps in each group whose states hold 8-bit codes, and it and
    load_state_dict ask each parameter's state for codes only where some state holds them
    (the union of the states' keys answers for float state at C speed: asked of each, 2,000
    parameters' states took 3 ms, over twice torch's packing); a group of float state beside
    one of codes still records nothing, and an entry of the caller's own is no code."""
    from vega.runtime import optimizer as optimizer_module
    asked = []
    real = optimizer_module._codes_in
    monkeypatch.setattr(optimizer_module, "_codes_in", lambda st: asked.append(1) or real(st))
    model = _model()
    floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, floats, 1, seed=2)
    floats.state[model[0].weight]["mine"] = torch.zeros(3, dtype=U8)  # (no "mine_absmax")
    floats.state[model[0].bias][7] = "a key not a str"
    assert "vega_q8_maps" not in floats.state_dict()["param_groups"][0]
    clean = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, clean, 1, seed=2)
    clean.load_state_dict(clean.state_dict())  # (loading asks the saved states alike)
    assert not asked
    big, small = model[0].weight, model[0].bias
    both = vega.optim.AdamW([{"params": [big], "state_dtype": U8}, {"params": [small]},
                             {"params": list(model[2].parameters()), "state_dtype": U8}],
                            lr=1e-2)
    _train(model, both, 1, seed=2)
    assert [g.get("vega_q8_maps") for g in both.state_dict()["param_groups"]] == [3, None, None]
    assert asked  # (the 8-bit group's, 64 x 96: codes; the last's 96 x 8 and 8: float32)


@pytest.mark.parametrize("maps", [torch.tensor([3, 3]), torch.tensor(3), "3", 3.0, True],
                         ids=["tensor2", "tensor", "str", "float", "bool"])
def test_a_record_of_the_maps_not_an_integer_is_refused_by_name(maps):
    """A saved group's or a pickle's record of the maps that is not an integer is refused
    as another version, naming it, the optimizer unchanged: a tensor of two values made the
    check raise torch's "Boolean value of Tensor with more than one value is ambiguous"."""
    model, opt, saved = _saved_8bit(2)
    groups = [{**g, "vega_q8_maps": maps} for g in saved["param_groups"]]
    fresh = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    with pytest.raises(ValueError, match=r"holds 8-bit codes saved under vega's 8-bit maps "
                                         r"version "):
        fresh.load_state_dict({**saved, "param_groups": groups})
    assert not fresh.state
    state = {**opt.__getstate__(), "_vega_q8_maps": maps}
    copy = vega.optim.AdamW.__new__(vega.optim.AdamW)
    with pytest.raises(ValueError, match=r"codes pickled under vega's 8-bit maps version "):
        copy.__setstate__(state)


def test_8bit_state_resumes_through_flattened_dcp_state_dicts(tmp_path):
    """torch's set_state_dict with flatten_optimizer_state_dict=True (torchtitan's way)
    rebuilds each saved group from the keys of the optimizer's own groups: these hold
    'vega_q8_maps' where their states hold 8-bit codes (made by a step, or loaded), so the
    record of the maps comes through and the state loads, bitwise, through dcp.save and
    dcp.load and in memory, twice, where it was dropped and the load refused as codes
    saved by a vega that did not record their maps. A group of float state holds no key."""
    out = _one_rank("""
        import sys
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_state_dict, set_state_dict)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        def made(sd=torch.uint8):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 4))
            return m, vega.optim.AdamW(m.parameters(), lr=1e-3, state_dtype=sd)
        m, opt = made()
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        assert opt.param_groups[0]["vega_q8_maps"] == 3
        mu = opt.state[m[0].weight]["mu"]
        _, osd = get_state_dict(m, opt, options=opts)
        dcp.save({"optim": osd}, checkpoint_id=sys.argv[1])
        m2, opt2 = made()
        _, osd2 = get_state_dict(m2, opt2, options=opts)
        dcp.load({"optim": osd2}, checkpoint_id=sys.argv[1])
        set_state_dict(m2, opt2, model_state_dict={}, optim_state_dict=osd2, options=opts)
        assert torch.equal(opt2.state[m2[0].weight]["mu"], mu)
        for _ in range(2):  # (in memory, into a fresh optimizer and into a loaded one)
            m3, opt3 = made() if _ == 0 else (m3, opt3)
            set_state_dict(m3, opt3, model_state_dict={},
                           optim_state_dict=get_state_dict(m, opt, options=opts)[1],
                           options=opts)
            assert torch.equal(opt3.state[m3[0].weight]["mu"], mu)
        m4, floats = made(None)
        for p in m4.parameters():
            p.grad = torch.randn_like(p)
        floats.step()
        assert "vega_q8_maps" not in floats.param_groups[0]
        dist.destroy_process_group()
        print("ok")
    """, str(tmp_path / "ckpt"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_8bit_dtensor_cut_otherwise_is_refused_through_flattened_dcp_state_dicts():
    """(One rank: a DTensor all the same.) An optimizer's group with 8-bit DTensor state
    holds 'vega_q8_shards' as state_dict saves it, so that torch's set_state_dict with
    flatten_optimizer_state_dict=True, which rebuilds a saved group from the keys of the
    optimizer's groups, keeps it: a state saved from shards cut otherwise is refused, where
    the key was dropped and the state loaded unchecked."""
    out = _one_rank("""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_state_dict, set_state_dict)
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        def made():
            torch.manual_seed(0)
            m = torch.nn.Linear(128, 64, bias=False)
            m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh,
                                                            [Shard(0)]))
            return m, vega.optim.AdamW(m.parameters(), lr=1e-3, state_dtype=torch.uint8)
        m, opt = made()
        m.weight.grad = torch.ones_like(m.weight)
        opt.step()
        assert opt.param_groups[0]["vega_q8_shards"] == [""]
        _, osd = get_state_dict(m, opt, options=opts)
        m2, opt2 = made()
        set_state_dict(m2, opt2, model_state_dict={}, optim_state_dict=dict(osd),
                       options=opts)
        osd["param_groups.weight.vega_q8_shards"] = ["Shard(dim=0) over 4"]
        m3, opt3 = made()
        try:
            set_state_dict(m3, opt3, model_state_dict={}, optim_state_dict=osd, options=opts)
        except ValueError as err:
            assert "saved from shards cut as 'Shard(dim=0) over 4'" in str(err), err
        else:
            raise AssertionError("a state saved from shards cut otherwise loaded")
        dist.destroy_process_group()
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_an_8bit_optimizer_pickled_under_other_maps_is_refused(monkeypatch):
    """A pickled optimizer records the version of the maps its 8-bit codes are read with:
    one pickled without it (by a vega before the record, whose codes may be of the other
    map: AdamW's nu before the fourth-root map came) or under other maps is refused when
    unpickled, where it stepped its codes read as other values; one pickled now steps as
    the original."""
    import pickle
    from vega.runtime import optimizer as vopt
    model, opt, _ = _saved_8bit(2)
    twin_model, twin = pickle.loads(pickle.dumps((model, opt)))
    _train(model, opt, 1, seed=2)
    _train(twin_model, twin, 1, seed=2)
    _same_state(opt, model, twin, twin_model)
    mine = vopt.SpecOptimizer.__getstate__
    for maps, said in ((None, "pickled by a vega that did not record which maps"),
                       (2, "pickled under vega's 8-bit maps version 2")):
        with monkeypatch.context() as m:
            m.setattr(vopt.SpecOptimizer, "__getstate__", lambda self, maps=maps: {
                k: v for k, v in mine(self).items() if k != "_vega_q8_maps"}
                | ({} if maps is None else {"_vega_q8_maps": maps}))
            data = pickle.dumps(opt)
        with pytest.raises(ValueError, match=rf"^AdamW: the pickled optimizer's state 'mu' "
                                             rf"holds 8-bit codes {said}"):
            pickle.loads(data)
    floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, floats, 1, seed=3)
    with monkeypatch.context() as m:
        m.setattr(vopt.SpecOptimizer, "__getstate__", lambda self: {
            k: v for k, v in mine(self).items() if k != "_vega_q8_maps"})
        data = pickle.dumps(floats)
    assert pickle.loads(data).state  # (float state: nothing to check)


def test_vega_save_and_load_keep_codes_and_scales(tmp_path):
    params = params_of()
    state = vega.adamw.init(params, state_dtype=U8)
    params, state = vega.adamw.step(params, grads_of(params, 0), state)
    vega.save(tmp_path / "s.safetensors", state)
    back = vega.load(tmp_path / "s.safetensors", like=vega.adamw.init(params, state_dtype=U8))
    for field in state:
        if field == "step":
            assert torch.equal(back[field], state[field])
            continue
        for n, t in state[field].items():
            assert (back[field][n] is None) == (t is None)
            if t is not None:
                assert back[field][n].dtype == t.dtype and torch.equal(back[field][n], t)


def _with_a_negative_scale(params):
    """An 8-bit AdamW state of ``params`` after a step, a copy of it whose scales of one
    parameter's nu hold a negative value, and that parameter's name."""
    state = vega.adamw.init(params, state_dtype=U8)
    params, state = vega.adamw.step(params, grads_of(params, 0), state)
    n = next(n for n, t in state["nu_absmax"].items() if t is not None)
    bad = vega.set_leaf(state, f"nu_absmax.{n}", state["nu_absmax"][n] * 1)  # (a copy)
    bad["nu_absmax"][n][0] = -1.0
    return state, bad, n


def test_vega_load_and_set_leaf_refuse_a_negative_8bit_scale(tmp_path):
    """A negative scale (a damaged or edited file) turns its block's values over: the next
    step gave NaN parameters. vega.load and vega.set_leaf refuse it, as load_state_dict
    does, naming the leaf."""
    state, bad, n = _with_a_negative_scale(params_of())
    name = f"nu_absmax.{n}"
    vega.save(tmp_path / "s.safetensors", bad)
    with pytest.raises(ValueError, match=rf"vega.load: .*: leaf '{name}' holds a negative "
                                         "value; it is a state's 8-bit scales"):
        vega.load(tmp_path / "s.safetensors", like=state)
    with pytest.raises(ValueError, match=rf"vega.set_leaf: the value for leaf '{name}' "
                                         "holds a negative value"):
        vega.set_leaf(state, name, bad["nu_absmax"][n])
    vega.save(tmp_path / "s.safetensors", state)  # (its own scales load)
    vega.load(tmp_path / "s.safetensors", like=state)


@pytest.mark.parametrize("held", ["dict", "list"])
def test_a_negative_8bit_scale_of_a_state_held_deeper_is_refused(tmp_path, held):
    """A state saved inside a checkpoint's own tree ({"opt": state, ...}, in a list):
    its scales are checked there too, as at the top (a negative one loaded unrefused, and
    the next step gave NaN parameters); a parameter's own name ending in _absmax is no
    scale."""
    state, bad, n = _with_a_negative_scale({**params_of(), "w_absmax": torch.randn(300)})
    wrap = ({"opt": bad, "epoch": torch.tensor(3)} if held == "dict" else
            {"runs": [torch.tensor(3), bad]})
    ok = ({"opt": state, "epoch": torch.tensor(3)} if held == "dict" else
          {"runs": [torch.tensor(3), state]})
    at = "opt" if held == "dict" else "runs.1"
    name = f"{at}.nu_absmax.{n}"
    vega.save(tmp_path / "s.safetensors", wrap)
    with pytest.raises(ValueError, match=rf"vega.load: .*: leaf '{name}' holds a negative "
                                         "value; it is a state's 8-bit scales"):
        vega.load(tmp_path / "s.safetensors", like=ok)
    with pytest.raises(ValueError, match=rf"vega.set_leaf: the value for leaf '{name}' "
                                         "holds a negative value"):
        vega.set_leaf(ok, name, bad["nu_absmax"][n])
    # a float state of a parameter named w_absmax, negative where the mean moved down
    mu = f"{at}.mu.w_absmax"
    vega.save(tmp_path / "s.safetensors", vega.set_leaf(ok, mu, -torch.ones(300)))
    loaded = vega.load(tmp_path / "s.safetensors", like=ok)  # (its own scales load)
    assert torch.equal(vega.get_leaf(loaded, mu), -torch.ones(300))


@pytest.mark.parametrize("shape", [(4, 5), (1, 40)])
def test_a_2d_state_of_a_parameter_named_absmax_beside_8bit_codes_is_no_scale(tmp_path,
                                                                              shape):
    """A matrix parameter 'w_absmax' beside an 8-bit 'w', in a state held in a tree of
    one's own: its float state ('opt.mu.w_absmax', negative where the mean moved down) is
    no 8-bit scales, whatever its shape (any 2-D one was taken for a DTensor's), and
    loads; the scales beside it are still checked."""
    params = {"w": torch.randn(100, 100), "w_absmax": torch.randn(shape)}
    ok = {"opt": vega.adamw.init(params, state_dtype=U8)}
    assert ok["opt"]["mu"]["w_absmax"].dtype == torch.float32
    mu = vega.set_leaf(ok, "opt.mu.w_absmax", -torch.ones(shape))
    vega.save(tmp_path / "s.safetensors", mu)
    loaded = vega.load(tmp_path / "s.safetensors", like=ok)
    assert torch.equal(vega.get_leaf(loaded, "opt.mu.w_absmax"), -torch.ones(shape))
    with pytest.raises(ValueError, match=r"leaf 'opt.nu_absmax.w' holds a negative value"):
        vega.set_leaf(ok, "opt.nu_absmax.w", -torch.ones(40))


@pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_distributed_checkpoint_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, 3, seed=1)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "ckpt"))
    model2 = _model(seed=3)
    opt2 = vega.optim.AdamW(model2.parameters(), lr=1e-2, state_dtype=U8)
    target = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(target["model"])
    set_optimizer_state_dict(model2, opt2, target["optim"])
    _same_state(opt, model, opt2, model2)
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    _same_state(opt, model, opt2, model2)


@pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_a_distributed_checkpoint_of_8bit_state_loaded_as_float_state_is_refused(tmp_path):
    """torch.distributed.checkpoint loads into the state dict of the optimizer given: one of
    float state has no scales, so an 8-bit checkpoint's codes came as float values (0 to 254
    where the moments were 1e-3) with no word. Refused, naming the state (dcp.load itself
    wrote them into the optimizer's state tensors: loading changes nothing more)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, 3, seed=1)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
    model2 = _model()
    opt2 = vega.optim.AdamW(model2.parameters(), lr=1e-2)
    _train(model2, opt2, 1, seed=3)
    target = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    before = {k: {n: v.clone() for n, v in st.items()} for k, st in opt2.state.items()}
    with pytest.raises(ValueError, match=r"state 'mu' of parameter \S+ was saved in 8 bits "
                                         r"\(its group's state_dtype is torch.uint8\), but "
                                         r"holds torch.float32 values without its scales"):
        set_optimizer_state_dict(model2, opt2, target["optim"])
    assert all(torch.equal(v, before[k][n]) for k, st in opt2.state.items()
               for n, v in st.items())


def test_float_state_loaded_into_an_8bit_optimizer_is_quantized_and_back():
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    opt8 = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt8.load_state_dict(opt.state_dict())
    said = [str(w.message) for w in said]
    # the first layer's two moments, in one warning: the other tensors keep float32
    assert said == ["AdamW.load_state_dict: 2 state(s) saved in floats are quantized to 8 "
                    "bits, as this optimizer keeps them (state_dtype torch.uint8): 'mu' of "
                    "parameter 0 (saved in torch.float32), 'nu' of parameter 0 (saved in "
                    "torch.float32)"], said
    w = model[0].weight
    st = opt8.state[w]
    assert st["mu"].dtype == U8 and st["nu"].dtype == U8 and st["mu_absmax"].shape == (24,)
    for name, signed in (("mu", True), ("nu", False)):
        back = quant.dequantize_t(st[name], st[name + "_absmax"], signed)
        scale = st[name + "_absmax"].repeat_interleave(256)[:w.numel()].reshape(w.shape)
        assert ((back - opt.state[w][name]).abs() <= scale / 127).all()
    assert opt8.state[model[0].bias]["mu"].dtype == torch.float32  # 96 values
    opt32 = vega.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt32.load_state_dict(opt8.state_dict())
    assert [str(w.message) for w in said] == [
        "AdamW.load_state_dict: 2 state(s) saved in 8 bits are dequantized to the dtype this "
        "optimizer keeps them in: 'mu' of parameter 0, 'nu' of parameter 0"], said
    assert set(opt32.state[w]) == {"mu", "nu", "step"}
    assert opt32.state[w]["mu"].dtype == torch.float32
    _train(model, opt32, 1, seed=2)
    _train(model, opt8, 1, seed=2)


def test_a_state_dtype_applies_to_state_when_it_is_made():
    """As for every state_dtype: state made in float32 stays so when the group's dtype
    changes (a fresh state, or a loaded one, takes the new dtype)."""
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, seed=1)
    opt.param_groups[0]["state_dtype"] = U8
    _train(model, opt, 1, seed=2)
    assert opt.state[model[0].weight]["mu"].dtype == torch.float32


# -- bad uses --------------------------------------------------------------------------------

def _saved_8bit(steps):
    """(model, its 8-bit AdamW after ``steps`` steps, that optimizer's state_dict)."""
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    _train(model, opt, steps, seed=1)
    return model, opt, opt.state_dict()


def test_8bit_state_for_a_complex_parameter_is_refused_naming_it():
    """docs/precision.md: a complex parameter with 8-bit state is a ValueError; it names the
    parameter (its leaf, or its place in a class's groups) and its dtype, and a class refused
    so keeps no state."""
    params = {"a": torch.randn(64, 64), "z": torch.randn(64, 64, dtype=torch.complex64)}
    for sd in (torch.uint8, {"mu": torch.uint8}):
        with pytest.raises(ValueError, match=r"^adamw_init: params leaf 'z' is torch\.complex64: "
                           r"state_dtype=torch\.uint8 \(8-bit state\) is kept for real "
                           r"parameters"):
            vega.adamw_init(params, state_dtype=sd)
    ps = [torch.nn.Parameter(t) for t in params.values()]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = vega.optim.AdamW(ps, state_dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^AdamW: parameter 1 of group 0 is torch\.complex64: "
                       r"state_dtype=torch\.uint8 \(8-bit state\)"):
        opt.step()
    assert not opt.state


def test_codes_without_scales_refused():
    model, _, saved = _saved_8bit(1)
    for st in saved["state"].values():
        st.pop("mu_absmax", None)
    with pytest.raises(ValueError, match="holds 8-bit codes without their scales 'mu_absmax'"):
        vega.optim.AdamW(model.parameters(), lr=1e-2).load_state_dict(saved)


@pytest.mark.parametrize("keeps", [None, U8])
def test_codes_without_any_scales_or_with_misshaped_ones_refused_on_loading(keeps):
    """Codes without a single scale (every ``*_absmax`` gone) are refused on loading as
    without one, by an optimizer keeping floats and by an 8-bit one (whose small tensors
    keep floats too); scales of the wrong length, by one that dequantizes them, before it
    reads them. The optimizer is left as it was and still steps."""
    model, _, saved = _saved_8bit(1)
    bare = {k: {n: v for n, v in st.items() if not n.endswith("_absmax")}
            for k, st in saved["state"].items()}
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=keeps)
    with pytest.raises(ValueError, match="holds 8-bit codes without their scales"):
        opt.load_state_dict({**saved, "state": bare})
    assert not opt.state
    if keeps is None:
        for k, st in saved["state"].items():
            if "nu_absmax" in st:
                st["nu_absmax"] = torch.cat([st["nu_absmax"], st["nu_absmax"]])
                break
        with pytest.raises(ValueError, match=r"holds \d+ 8-bit codes and \d+ scales, but the "
                                             r"parameter, of shape \(\d+, \d+\), needs"):
            opt.load_state_dict(saved)
        assert not opt.state
    _train(model, opt, 1, seed=2)


@pytest.mark.parametrize("wrong", ["codes cast to float32", "a negative scale",
                                   "scales cast to uint8"])
@pytest.mark.parametrize("keeps", [None, U8])
def test_codes_cast_to_a_float_or_negative_scales_refused_on_loading(keeps, wrong):
    """A saved 8-bit state whose codes were cast to float32 beside their scales (read as
    values, the codes, up to 255, took their place) or a scale made negative (its block's
    values turned over: NaN parameters at the next step) is refused on loading, by an
    optimizer keeping floats and by an 8-bit one, and the optimizer is left as it was. A NaN
    or infinite scale, which a step leaves where its block held one, loads."""
    model, _, saved = _saved_8bit(1)
    st = next(st for st in saved["state"].values() if "nu_absmax" in st)
    if wrong == "codes cast to float32":
        st["nu"] = st["nu"].float()
        words = (r"state 'nu' of parameter \d+ is torch.float32 beside its 8-bit scales "
                 r"'nu_absmax': 8-bit codes are torch.uint8")
    elif wrong == "scales cast to uint8":  # (their fractions dropped: other values)
        st["nu_absmax"] = st["nu_absmax"].to(torch.uint8)
        words = (r"the scales 'nu_absmax' of state 'nu' of parameter \d+ are torch.uint8, "
                 r"not floating-point")
    else:
        st["nu_absmax"] = st["nu_absmax"].clone()
        st["nu_absmax"][0] = -st["nu_absmax"][0]
        words = r"the scales 'nu_absmax' of state 'nu' of parameter \d+ hold a negative value"
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=keeps)
    _train(model, opt, 1, seed=3)
    before = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with pytest.raises(ValueError, match=rf"^AdamW.load_state_dict: {words}"):
        opt.load_state_dict(saved)
    assert {id(p): st.keys() for p, st in opt.state.items()} == \
        {k: v.keys() for k, v in before.items()}
    assert all(torch.equal(v, before[id(p)][k]) for p, st in opt.state.items()
               for k, v in st.items())
    if wrong == "a negative scale":
        import warnings
        st["nu_absmax"][0] = float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (dequantized, where the loader keeps floats)
            opt.load_state_dict(saved)


@pytest.mark.parametrize("wrong", ["codes", "scales"])
@pytest.mark.parametrize("rule", ["adamw", "prodigy"])  # (prodigy's: a staged step)
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_float_state_where_codes_are_kept_refused(backend, rule, wrong):
    params = params_of({"w": (64, 100)})
    state = getattr(vega, rule).init(params, state_dtype=U8)
    if wrong == "codes":  # (named by its leaf, before a backend sees it)
        state["mu"]["w"] = torch.zeros(64, 100)
        words = r"state leaf 'mu\.w' is torch.float32 beside 8-bit scales 'mu_absmax\.w'"
    else:
        state["mu_absmax"]["w"] = state["mu_absmax"]["w"].double()
        words = r"state 'mu_absmax' is kept in 8 bits .*torch.float32.* but a tensor of " \
            r"it is torch.float64"
    with pytest.raises(ValueError, match=words):
        getattr(vega, rule).step(params, grads_of(params, 0), state, backend=backend)


@pytest.mark.parametrize("wrong, words", [
    ("the large tensor's scales lost", r"state leaf 'nu\.w' holds 8-bit codes \(torch.uint8\) "
                                       r"without their scales: 'nu_absmax\.w' is None"),
    ("its codes cast to float32", r"state leaf 'nu\.w' is torch.float32 beside 8-bit scales "
                                  r"'nu_absmax\.w'"),
    ("scales beside the small tensor's floats", r"state leaf 'nu\.b' is torch.float32 beside "
                                                r"8-bit scales 'nu_absmax\.b'")])
def test_a_functional_step_names_the_leaf_of_codes_and_scales_that_do_not_pair(wrong, words):
    """8-bit codes without their scales, or scales beside float values, are named by the
    leaf (the scales of the only 8-bit tensor lost read as an extra field: "state has
    fields [...] but this step needs [...]; make it with adamw_init(...)")."""
    params = {"w": torch.randn(5000)} if "large" in wrong else \
        {"w": torch.randn(5000), "b": torch.randn(7)}
    state = vega.adamw_init(params, state_dtype=U8)
    if "lost" in wrong:
        state["nu_absmax"]["w"] = None
    elif "cast" in wrong:
        state["nu"]["w"] = state["nu"]["w"].float()
    else:
        state["nu_absmax"]["b"] = torch.zeros(1)
    with pytest.raises(ValueError, match=rf"^adamw_step: {words}"):
        vega.adamw_step(params, grads_of(params, 0), state)


@pytest.mark.parametrize("wrong", ["codes", "scales"])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_a_class_step_refuses_codes_or_scales_of_another_dtype(name, wrong):
    """An 8-bit state's codes set by hand to float32, or its scales to float64: the step
    in place (the operator's, on the C backend) refuses them by name and writes nothing;
    read as codes and scales, they would be garbage."""
    p = torch.nn.Parameter(torch.randn(64, 100))
    opt = getattr(vega.optim, name)([p], state_dtype=U8)
    p.grad = torch.randn(64, 100)
    opt.step()
    key = "mu" if wrong == "codes" else "mu_absmax"
    opt.state[p][key] = opt.state[p][key].float() if wrong == "codes" else \
        opt.state[p][key].double()
    before = p.detach().clone()
    with pytest.raises(ValueError, match=f"state '{key}' is kept in 8 bits"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("way", ["operator", "python"])
@pytest.mark.parametrize("name", ["AdamW", "Prodigy"])
def test_scales_as_a_row_are_refused_on_every_path(name, way, monkeypatch):
    """An 8-bit state's scales made a row, ``[None]`` (a view: the same address and length),
    are refused by name and nothing is written: by the operator, and on the Python path
    (``VEGA_NATIVE=0``; its plan of a recent call: test_native_step.py)."""
    if way == "python":
        from vega.codegen.c import native
        monkeypatch.setattr(native, "module", lambda wait=None: None)
    p = torch.nn.Parameter(torch.randn(64, 100))
    opt = getattr(vega.optim, name)([p], state_dtype=U8)
    for _ in range(2):
        p.grad = torch.randn(64, 100)
        opt.step()
    opt.state[p]["mu_absmax"] = opt.state[p]["mu_absmax"][None]
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"state 'mu_absmax' (of parameter 0 )?has shape "
                                         r"\(1, 25\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("wrong", ["an int32 state", "a state of another shape",
                                   "codes of float32", "scales of float64", "scales as a row"])
def test_a_class_step_of_two_programs_checks_both_before_either_writes(wrong):
    """An 8-bit class step over a matrix (codes and scales) and a bias (small: float32
    state) makes two calls; a wrong state of either is named before the first writes."""
    w, b = torch.nn.Parameter(torch.randn(64, 100)), torch.nn.Parameter(torch.randn(7))
    opt = vega.optim.AdamW([w, b], state_dtype=U8)
    w.grad, b.grad = torch.randn(64, 100), torch.randn(7)
    opt.step()
    assert opt.state[b]["mu"].dtype == torch.float32 and opt.state[w]["mu"].dtype == U8
    sw, sb = opt.state[w], opt.state[b]
    if wrong == "an int32 state":
        sb["nu"], words = sb["nu"].to(torch.int32), "state 'nu' has a tensor of dtype torch.int32"
    elif wrong == "a state of another shape":
        sb["nu"], words = torch.zeros(6), r"state 'nu' has shape \(6,\)"
    elif wrong == "codes of float32":
        sw["mu"], words = sw["mu"].float(), "state 'mu' is kept in 8 bits"
    elif wrong == "scales of float64":
        sw["nu_absmax"], words = sw["nu_absmax"].double(), "state 'nu_absmax' is kept in 8 bits"
    else:
        sw["nu_absmax"] = sw["nu_absmax"][None]
        words = r"state 'nu_absmax' has shape \(1, 25\), but its parameter, of shape"
    before = [w.detach().clone(), b.detach().clone()]
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert torch.equal(w.detach(), before[0]) and torch.equal(b.detach(), before[1])


@pytest.mark.parametrize("wrong, words", [
    ("an int32 state", r"state 'mu' has a tensor of dtype torch.int32|does not support state "
                       r"of dtype torch.int32"),
    ("codes without scales", r"state 'mu' holds 8-bit codes \(torch.uint8\) without their "
                             r"scales 'mu_absmax'")])
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_a_staged_step_refuses_the_states_a_plain_step_refuses(backend, wrong, words):
    """Prodigy's step runs in stages (``staged``: its sums over the group between them); its
    states' dtypes are checked as a plain step checks them, on every backend: an integer
    state would be truncated, codes without their scales read as numbers."""
    params = params_of({"w": (64, 100)})
    state = vega.prodigy.init(params)
    state["mu"]["w"] = torch.zeros(64, 100, dtype=torch.int32 if wrong == "an int32 state"
                                   else U8)
    with pytest.raises(ValueError, match=words):
        vega.prodigy.step(params, grads_of(params, 0), state, backend=backend)


@pytest.mark.parametrize("make, words", [
    (lambda: vega.adafactor.init({"w": torch.randn(256, 300)}, state_dtype=U8),
     "8-bit state .* is kept for programs of values one per element"),
    (lambda: vega.adamw.init({"w": torch.randn(64, 100, dtype=torch.complex64)},
                             state_dtype=U8),
     "8-bit state\\) is kept for real parameters"),
    (lambda: vega.adamw.init({"w": torch.randn(64, 100)}, state_dtype={"mu": torch.int8}),
     r"state_dtype\['mu'\]=torch.int8 must be one of .*torch.uint8 \(8-bit blockwise\)"),
    (lambda: vega.optim.AdamW([torch.nn.Parameter(torch.randn(64, 100))],
                              state_dtype=torch.int8),
     "state_dtype=torch.int8 .*torch.uint8 \\(8-bit blockwise\\)"),
    (lambda: vega.lbfgs_init([torch.randn(64, 100)], state_dtype=U8),
     "lbfgs_init: state_dtype=torch.uint8 \\(8-bit state\\) is kept by the optimizers "
     "written as specs"),
    # a state of one number per tensor, and one whose scales' name the spec takes
    (lambda: vega.compile("optimizer o() {\n  state n: scalar = 0\n  n = n + norm(g)\n"
                          "  p = p - 0.01 * g * n\n}\n").init({"w": torch.randn(5000)},
                                                             state_dtype={"n": U8}),
     "state 'n' is one number per tensor; only states shaped like the parameter are kept "
     "in 8 bits"),
    (lambda: vega.compile("optimizer o() {\n  state mu = zeros\n  state mu_absmax = zeros\n"
                          "  mu = 0.9 * mu + g\n  mu_absmax = mu_absmax\n  p = p - 0.01 * mu\n"
                          "}\n").init({"w": torch.randn(5000)}, state_dtype={"mu": U8}),
     "8-bit state 'mu' keeps its scales in a state named 'mu_absmax', but the spec declares "
     "one of that name"),
])
def test_bad_8bit_requests(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_named_8bit_states_leave_a_matrix_program_without_them_in_floats():
    """Muon's AdamW moments named for 8 bits, beside a matrix whose program keeps only
    ``buf`` (and Adafactor's unfactored ``v`` beside a factored tensor): the vector's
    moments are 8-bit, the matrix steps in floats. Both were refused, for states the
    matrix's program does not have; state_dtype=torch.uint8 (each state) still is."""
    params = {"w": torch.randn(64, 128), "b": torch.randn(8192)}
    state = vega.muon_init(params, state_dtype={"mu": U8, "nu": U8})
    assert state["buf"]["w"].dtype == torch.float32 and state["buf"]["b"] is None
    assert state["mu"]["b"].dtype == U8 and state["mu"]["w"] is None
    new, state = vega.muon_step(params, grads_of(params, 0), state, lr=0.02)
    assert state["nu"]["b"].dtype == U8 and torch.isfinite(new["w"]).all()
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = vega.optim.Muon(ps, lr=0.02, state_dtype={"mu": U8, "nu": U8})
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert opt.state[ps[0]].keys() == {"buf", "step"} and opt.state[ps[1]]["mu"].dtype == U8
    params = {"w": torch.randn(256, 300), "b": torch.randn(8192)}
    state = vega.adafactor.init(params, state_dtype={"v": U8})
    assert state["v"]["b"].dtype == U8 and state["v_row"]["w"].dtype == torch.float32
    with pytest.raises(ValueError, match="8-bit state .* is kept for programs of values one "
                                         "per element"):
        vega.muon_init(params, state_dtype=U8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_makes_its_block_nan_as_on_the_reference(backend):
    def run(backend):
        params = params_of({"w": (41, 100)})
        state = vega.adamw.init(params, state_dtype=U8)
        grads = grads_of(params, 0)
        grads["w"][10, 30] = float("nan")  # value 1030: block 4
        return vega.adamw.step(params, grads, state, backend=backend)
    (cp, cs), (rp, rs) = run(backend), run("reference")
    for s in (cs, rs):
        scale = s["mu_absmax"]["w"]
        assert scale[4].isnan() and not scale[:4].isnan().any() and not scale[5:].isnan().any()
        assert s["nu_absmax"]["w"][4].isnan()
    assert torch.equal(cs["mu"]["w"], rs["mu"]["w"]) and torch.equal(cs["nu"]["w"], rs["nu"]["w"])
    assert torch.equal(cp["w"].isnan(), rp["w"].isnan())


@needs_c
def test_compiled_step_with_8bit_state():
    """A whole functional step with 8-bit state traced by torch.compile (fullgraph): the
    codes, scales and parameters of an eager step."""
    params = params_of({"w": (64, 100), "b": (100,)})
    grads = grads_of(params, 0)
    state = vega.adamw.init(params, state_dtype=U8)
    step = torch.compile(lambda p, g, s: vega.adamw.step(p, g, s, backend="c",
                                                         max_grad_norm=1.0), fullgraph=True)
    got_p, got_s = step(params, grads, state)
    want_p, want_s = vega.adamw.step(params, grads, state, backend="c", max_grad_norm=1.0)
    for field in ("mu", "nu", "mu_absmax", "nu_absmax"):
        assert torch.equal(got_s[field]["w"], want_s[field]["w"]), field
    assert torch.equal(got_p["w"], want_p["w"]) and torch.equal(got_p["b"], want_p["b"])


def test_a_dtensor_parameter_keeps_8bit_state_as_a_plain_one():
    """(One process, one rank: a DTensor all the same.) Its 8-bit state is made and stepped
    on its shard, bitwise the plain tensor's, the scales a (shards, blocks) DTensor; a
    float DTensor state quantizes and its codes dequantize, each a DTensor. Distributed
    shards: tests/runtime/test_distributed.py."""
    import os
    import textwrap
    from pathlib import Path

    from tests import forks
    root = Path(__file__).resolve().parents[2]
    code = textwrap.dedent("""
        import os, socket, torch, torch.distributed as dist, vega
        from vega.codegen import quant
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        w = torch.randn(64, 100)
        params = {"w": w.clone()}
        dparams = {"w": distribute_tensor(w.clone(), mesh, [Shard(0)])}
        state = vega.adamw.init(params, state_dtype=torch.uint8)
        dstate = vega.adamw.init(dparams, state_dtype=torch.uint8)
        assert dstate["mu_absmax"]["w"].shape == (1, 25), dstate["mu_absmax"]["w"].shape
        assert dstate["mu"]["w"].dtype == torch.uint8
        for k in range(3):
            g = torch.randn(64, 100, generator=torch.Generator().manual_seed(k))
            params, state = vega.adamw.step(params, {"w": g}, state, lr=0.1)
            dparams, dstate = vega.adamw.step(
                dparams, {"w": distribute_tensor(g, mesh, [Shard(0)])}, dstate, lr=0.1)
        assert torch.equal(dparams["w"].to_local(), params["w"])
        for f in ("mu", "nu", "mu_absmax", "nu_absmax"):
            got = dstate[f]["w"]
            assert type(got).__name__ == "DTensor", f
            assert torch.equal(got.to_local().reshape(state[f]["w"].shape), state[f]["w"]), f
        codes, scales = quant.quantize_t(dstate["nu"]["w"].to(torch.float32) * 0 + 1, False)
        assert type(scales).__name__ == "DTensor" and scales.shape == (1, 25)
        back = quant.dequantize_t(codes, scales, False)
        assert type(back).__name__ == "DTensor" and torch.equal(back.to_local(),
                                                                 torch.ones(64, 100))
        try:
            quant.dequantize_t(codes, scales.to_local(), False)
        except ValueError as e:
            print(e)
        from torch.distributed.tensor import DTensor
        wrong = dict(dstate, mu_absmax={"w": DTensor.from_local(
            torch.zeros(1, 30), mesh, [Shard(0)], run_check=False)})
        try:
            vega.adamw.step(dparams, {"w": distribute_tensor(g, mesh, [Shard(0)])}, wrong)
        except ValueError as e:
            print(e)
        q = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        opt = vega.optim.AdamW([q], state_dtype=torch.uint8)
        q.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
        opt.state[q]["nu_absmax"] = wrong["mu_absmax"]["w"]
        try:
            opt.step()
        except ValueError as e:
            print(e)
        dist.destroy_process_group()
        print("same")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # (forked from a server that has imported torch and vega, as the script does first:
    # tests/forks.py)
    done = forks.run(code, cwd=root, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "same", done.stdout
    assert "are a DTensor of shape (1, 25), got Tensor of shape (1, 25)" in done.stdout
    assert "state leaf 'mu_absmax.w' has shape (1, 30) on cpu, but its parameter (64, 100) " \
        "needs one value per block of 256 (an 8-bit state's scales): (1, 25)" in done.stdout
    assert "parameter 0's state 'nu_absmax' has shape (1, 30), but the 8-bit scales of a " \
        "DTensor of shape (64, 100) placed (Shard(dim=0),) on" in done.stdout, done.stdout


# -- a state's dtype named in the spec ------------------------------------------------------

ADAM8 = """
optimizer adam8(lr = 1e-3, b1 = 0.9 in [0, 1), b2 = 0.999 in [0, 1), eps = 1e-8) {
    state mu: uint8 = zeros
    state nu: bfloat16 = zeros
    state v_row: rows float16 = zeros
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * g * g
    v_row = row_mean(g * g)
    p = p - lr * (mu / (1 - b1 ^ t)) / (sqrt(nu / (1 - b2 ^ t)) + eps)
}
"""

ADAM8_FLAT = ADAM8.replace("    state v_row: rows float16 = zeros\n", "").replace(
    "    v_row = row_mean(g * g)\n", "")


def _dtypes(state):
    return {f: {n: None if t is None else t.dtype for n, t in tree.items()}
            for f, tree in state.items() if f != "step"}


def test_a_spec_names_its_states_dtypes():
    params = {"w": torch.randn(64, 100), "b": torch.randn(100)}
    rows = vega.compile(ADAM8.replace("state mu: uint8", "state mu"))
    assert _dtypes(rows.init(params)) == {
        "mu": {"w": torch.float32, "b": torch.float32},
        "nu": {"w": torch.bfloat16, "b": torch.bfloat16},
        "v_row": {"w": torch.float16, "b": torch.float16}}
    # 8 bits in a program with per-row values: refused when the state is made
    with pytest.raises(ValueError, match="8-bit state .* is kept for programs of values one "
                                         "per element"):
        vega.compile(ADAM8).init(params)
    flat = vega.compile(ADAM8_FLAT)
    assert _dtypes(flat.init(params)) == {
        "mu": {"w": U8, "b": torch.float32}, "nu": {"w": torch.bfloat16, "b": torch.bfloat16},
        "mu_absmax": {"w": torch.float32, "b": None}}
    # the caller's dtypes win: by name over the spec's, or one for every state
    assert _dtypes(flat.init(params, state_dtype={"nu": torch.float32}))["nu"] == {
        "w": torch.float32, "b": torch.float32}
    assert _dtypes(flat.init(params, state_dtype=torch.float32)) == {
        "mu": {"w": torch.float32, "b": torch.float32},
        "nu": {"w": torch.float32, "b": torch.float32}}
    model = torch.nn.Linear(100, 64)
    opt = flat.optimizer(model.parameters(), lr=1e-2)
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    assert opt.state[model.weight]["mu"].dtype == U8
    assert opt.state[model.weight]["nu"].dtype == torch.bfloat16
    assert opt.state[model.bias]["mu"].dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_spec_with_declared_dtypes_matches_reference(backend):
    spec = vega.compile(ADAM8_FLAT)

    def run(b):
        params = params_of()
        state = spec.init(params)
        for k in range(3):
            params, state = spec.step(params, grads_of(params, k), state, backend=b)
        return params, state
    got, ref = run(backend), run("reference")
    for n in SHAPES:
        torch.testing.assert_close(got[0][n], ref[0][n], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1]["nu"][n].float(), ref[1]["nu"][n].float(),
                                   rtol=1e-2, atol=1e-6)
        if ref[1]["mu_absmax"][n] is not None:
            assert (got[1]["mu"][n].int() - ref[1]["mu"][n].int()).abs().max() <= 1


@pytest.mark.parametrize("decl, words, caret", [
    ("state m: bfloat61 = zeros", "not ': bfloat61' (did you mean 'bfloat16'?)", "bfloat61"),
    ("state m: rows int8 = zeros", "not 'int8' (did you mean 'uint8'?)", "int8"),
    ("state m: rows uint8 = zeros", "state 'm' holds one value per row: only a state shaped "
     "like p is kept in 8 bits (uint8)", "uint8"),
    ("state m: scalar uint8 = zeros", "state 'm' holds one number per tensor", "uint8"),
])
def test_a_bad_declared_dtype_is_a_spec_error(decl, words, caret):
    src = f"optimizer bad(lr = 1e-3) {{\n    {decl}\n    p = p - lr * g\n}}\n"
    with pytest.raises(vega.SpecError) as err:
        vega.compile(src)
    text = str(err.value)
    assert words in text and ":2:" in text, text
    line = src.splitlines()[1]
    col = line.index(caret)
    assert " " * col + "^" * len(caret) in text, text


# -- found by probing -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_subnormal_block_gets_the_references_codes(backend):
    """A block whose largest value is subnormal: 1 / absmax overflows, and the codes are
    the clamped ones, as the reference's (not a conversion of inf)."""
    def run(b):
        p = {"w": torch.zeros(4096)}
        s = vega.lion.init(p, state_dtype=U8)
        for _ in range(20):
            p, s = vega.lion.step(p, {"w": torch.full((4096,), 1e-39)}, s, backend=b,
                                  lr=1e-3, b1=0.99, b2=0.9)
        return p, s
    (gp, gs), (rp, rs) = run(backend), run("reference")
    assert torch.equal(gs["m"]["w"], rs["m"]["w"]) and rs["m"]["w"][0] == 254
    assert torch.equal(gp["w"], rp["w"]) and rp["w"][0] < 0


@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_codes_without_their_scales_are_refused_by_a_step(backend):
    params = {"w": torch.randn(64, 80)}
    state = vega.adamw.init(params, state_dtype=U8)
    state = {k: v for k, v in state.items() if not k.endswith("_absmax")}
    for donate in (False, True):
        with pytest.raises(ValueError, match="state 'mu' holds 8-bit codes \\(torch.uint8\\) "
                                             "without their scales 'mu_absmax'"):
            vega.adamw.step(params, grads_of(params, 0), state, backend=backend,
                            donate=donate)
    state = vega.adamw.init(params, state_dtype=U8)
    state["mu_absmax"]["w"] = state["mu_absmax"]["w"][:-1]
    with pytest.raises(ValueError, match=r"'mu_absmax.w' has shape \(19,\).* needs one value "
                                         r"per block of 256 .*\(20,\)"):
        vega.adamw.step(params, grads_of(params, 0), state, backend=backend)


def test_every_state_in_8_bits_leaves_copies_of_the_weights_in_floats():
    """schedule-free's z and Prodigy's p0 start from p: 8 bits would blur the weights (and
    Prodigy's p0 - p), so torch.uint8 for every state leaves them; naming them keeps them
    in 8 bits."""
    params = {"w": torch.randn(64, 100)}
    sf = vega.schedule_free_adamw.init(params, state_dtype=U8)
    assert sf["z"]["w"].dtype == torch.float32 and sf["nu"]["w"].dtype == U8
    pr = vega.prodigy.init(params, state_dtype=U8)
    assert pr["p0"]["w"].dtype == torch.float32
    assert {pr[n]["w"].dtype for n in ("mu", "nu", "s")} == {U8}
    assert vega.schedule_free_adamw.init(params, state_dtype={"z": U8})["z"]["w"].dtype == U8


@pytest.mark.parametrize("sd", [U8, {"v": U8}], ids=["every", "named"])
def test_a_state_made_later_takes_the_groups_8_bits(sd):
    w = torch.nn.Parameter(torch.randn(5000))
    opt = vega.optim.SGD([w], lr=1e-2, state_dtype=sd)
    w.grad = torch.randn(5000)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9  # sgd's v, made now
    w.grad = torch.randn(5000)
    opt.step()
    assert opt.state[w]["v"].dtype == U8 and opt.state[w]["v_absmax"].shape == (20,)


def test_a_spec_with_a_state_named_like_scales_steps():
    spec = vega.compile("""optimizer clash(lr = 1e-2) {
        state m = zeros
        state m_absmax = zeros
        m = 0.9 * m + g
        m_absmax = max(m_absmax, abs(m))
        p = p - lr * m / (m_absmax + 1e-8)
    }""")
    params = {"w": torch.randn(5000)}
    new, state = spec.step(params, {"w": torch.randn(5000)}, spec.init(params))
    assert state["m"]["w"].dtype == torch.float32 and new["w"].isfinite().all()


def test_torch_state_dict_dequantizes():
    model = torch.nn.Linear(100, 64)
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    model(torch.randn(8, 100)).sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="the 8-bit states are dequantized to float32"):
        sd = opt.torch_state_dict()
    st = sd["state"][0]
    assert set(st) == {"exp_avg", "exp_avg_sq", "step"} and st["exp_avg"].dtype == torch.float32
    mine = opt.state[model.weight]
    assert torch.equal(st["exp_avg"], quant.dequantize_t(mine["mu"], mine["mu_absmax"], True))
    torch.optim.AdamW(model.parameters(), lr=1e-2).load_state_dict(sd)


@pytest.mark.parametrize("sd", [U8, {"nu": U8}], ids=["every", "named"])
@pytest.mark.parametrize("name,hypers", [("AdamW", {}), ("SGD", {"momentum": 0.9}),
                                         ("RMSprop", {"momentum": 0.5, "centered": True})])
def test_torch_optims_state_dict_loads_into_an_8bit_optimizer_quantized(name, hypers, sd):
    """torch.optim's states are floats: an 8-bit optimizer quantizes them as it quantizes
    its float32 twin's state dict of the same values (they were refused as 8-bit codes
    cast to floats, the optimizer's own state_dtype taken for the saved one)."""
    if name != "AdamW":
        sd = U8 if sd is U8 else {"nu" if name == "RMSprop" else "v": U8}
    model = torch.nn.Linear(64, 100)
    theirs = getattr(torch.optim, name)(model.parameters(), lr=1e-2, foreach=False, **hypers)
    model(torch.randn(8, 64)).sum().backward()
    theirs.step()
    saved = theirs.state_dict()
    ours = getattr(vega.optim, name)(model.parameters(), lr=1e-2, state_dtype=sd, **hypers)
    with pytest.warns(UserWarning, match="quantized to 8 bits"):
        ours.load_state_dict(saved)
    twin = getattr(vega.optim, name)(model.parameters(), lr=1e-2, **hypers)
    twin.load_state_dict(saved)
    again = getattr(vega.optim, name)(model.parameters(), lr=1e-2, state_dtype=sd, **hypers)
    with pytest.warns(UserWarning, match="quantized to 8 bits"):
        again.load_state_dict(twin.state_dict())
    w = model.weight
    assert any(v.dtype == U8 for v in ours.state[w].values())
    assert ours.state[w].keys() == again.state[w].keys()
    for key, value in ours.state[w].items():
        assert torch.equal(value, again.state[w][key]), key
    assert ours.param_groups[0]["state_dtype"] == sd
    _train(model, ours, 1, seed=2)


def test_float_state_kept_after_the_group_turned_8bit_loads():
    """A group's state_dtype set to torch.uint8 after its states were made leaves them
    floats (docs/precision.md); its state_dict was refused by every optimizer, its own
    too, as 8-bit codes cast to floats. It loads: as floats into a float optimizer,
    quantized into an 8-bit one."""
    model = _model()
    opt = vega.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, seed=1)
    opt.param_groups[0]["state_dtype"] = U8
    _train(model, opt, 1, seed=2)
    w = model[0].weight
    assert opt.state[w]["mu"].dtype == torch.float32
    saved = opt.state_dict()
    floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    floats.load_state_dict(saved)
    assert torch.equal(floats.state[w]["mu"], opt.state[w]["mu"])
    eight = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    with pytest.warns(UserWarning, match="quantized to 8 bits"):
        eight.load_state_dict(saved)
    assert eight.state[w]["mu"].dtype == U8
    _train(model, eight, 1, seed=3)


def test_scales_saved_in_another_float_dtype_load_as_float32():
    model, opt, saved = _saved_8bit(2)
    for st in saved["state"].values():
        if "mu_absmax" in st:
            st["mu_absmax"] = st["mu_absmax"].double()
    again = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    again.load_state_dict(saved)
    w = model[0].weight
    assert again.state[w]["mu_absmax"].dtype == torch.float32
    assert torch.equal(again.state[w]["mu_absmax"], opt.state[w]["mu_absmax"])
    _train(model, again, 1, seed=2)


_CODES_DRIVER = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#define ROW 1
#define COL_NUMEL 0
%s
void codes_of(const float *x, const float *absmax, int64_t n, int sgn, int table,
              uint8_t *out) {
    for (int64_t b = 0; b < n; b += QBLOCK) {  /* a block at a time, as the kernels */
        const int m = n - b < QBLOCK ? (int)(n - b) : QBLOCK;
        float v[QBLOCK];
        for (int q = 0; q < m; q++) v[q] = x[b + q];
        const float inv = q8_tiny(v, m, absmax[b / QBLOCK]);
        for (int q = 0; q < m; q++)
            out[b + q] = table ? (sgn ? q8_table_signed(v[q], inv) : q8_table_unsigned(v[q], inv))
                               : (sgn ? q8_code_signed(v[q], inv) : q8_code_unsigned(v[q], inv));
    }
}
int64_t tables_differ(int sgn, int64_t stride) {  /* floats whose codes the two ways differ */
    int64_t bad = 0;
    for (int64_t b = 0; b < (1LL << 32); b += stride) {
        union { uint32_t i; float f; } u = {(uint32_t)b};
        bad += sgn ? q8_table_signed(u.f, 1.0f) != q8_code_signed(u.f, 1.0f)
                   : q8_table_unsigned(u.f, 1.0f) != q8_code_unsigned(u.f, 1.0f);
    }
    return bad;
}
"""


def _boundary_blocks(signed: bool) -> torch.Tensor:
    """Blocks whose values sit on, and one float either side of, the value between two codes
    (each block's absmax its first value), with zeros of both signs, subnormals, a NaN, an
    infinity and a block of subnormal absmax (1 / absmax overflows)."""
    k = torch.arange(127 if signed else 255, dtype=torch.float64)
    edge = ((k + 0.5) / (127 if signed else 255)) ** (2 if signed else 4)
    edge = edge.to(torch.float32)
    up = torch.nextafter(edge, torch.tensor(2.0))
    down = torch.nextafter(edge, torch.tensor(-1.0))
    vals = []
    for a in (1.0, 3.0, 0.7, 1e-30, 1e30, 2.0 ** -130):  # (the last: subnormals)
        vals.append(torch.cat([torch.tensor([a]), edge * a, up * a, down * a]))
    rest = torch.tensor([1.0, 0.0, -0.0, 1e-45, -1e-45, 0.5, float("nan"), 0.25,
                         1.0, float("inf"), 0.5, 0.0, 1e-40, 5e-41, 0.0, 1e-45])
    flat = torch.cat([*vals, rest])
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 256)])
    if signed:  # the same magnitudes negative, in blocks of their own
        flat = torch.cat([flat, -flat])
    return flat


def _codes_correctly_rounded(x: torch.Tensor, absmax: torch.Tensor, signed: bool):
    """``quantize_t``'s map in numpy float32, whose square root is correctly rounded (torch's
    float32 ``sqrt`` on a CPU may be a unit in the last place away, which moves a value on a
    rounding boundary to the next code)."""
    import numpy as np
    with np.errstate(all="ignore"):
        s = absmax.numpy().astype(np.float32)
        up = np.where(s < np.float32(quant.TINY), np.float32(quant.TINY_UP), np.float32(1))
        s = (s * up).astype(np.float32)
        inv = np.where(s > 0, np.float32(1) / s, np.float32(0)).astype(np.float32)
        y = (x.numpy().astype(np.float32) * np.repeat(up, 256)[:x.numel()]).astype(np.float32)
        y = y * np.repeat(inv, 256)[:x.numel()]
        y = np.where(np.isnan(y), np.float32(0), y)
        if signed:
            y = np.clip(y, np.float32(-1), np.float32(1))
            c = np.rint(np.sign(y) * np.sqrt(np.abs(y)) * np.float32(127)) + np.float32(127)
        else:
            y = np.clip(y, np.float32(0), np.float32(1))
            c = np.rint(np.sqrt(np.sqrt(y)) * np.float32(255))
    return torch.from_numpy(c.astype(np.uint8))


@needs_c
def test_512_bit_vectors_are_asked_of_gcc_for_x86_only():
    """``prefer-vector-width`` is an x86 option that gcc for other CPUs (aarch64) refuses
    as an error: the 8-bit kernels ask for it only where gcc builds for x86."""
    import subprocess

    from vega.codegen.c import build
    cc = build.command(build.compiler())

    def preprocessed(*flags: str) -> str:
        return subprocess.run([*cc, "-E", "-P", *flags, "-x", "c", "-"],
                              input=quant.C_HELPERS, capture_output=True, text=True,
                              check=True).stdout
    assert "prefer-vector-width" not in preprocessed("-U__x86_64__", "-U__i386__")
    gcc_x86 = subprocess.run(
        [*cc, "-E", "-P", "-x", "c", "-"], capture_output=True, text=True,
        input="#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8 && "
              "defined(__x86_64__)\nGCC_X86\n#endif\n", check=True).stdout
    if "GCC_X86" in gcc_x86:  # (this machine's compiler: the option is asked for)
        assert 'target("prefer-vector-width=512")' in preprocessed()


@needs_c
@pytest.mark.parametrize("how", ["table", "code"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_c_codes_are_the_maps_codes_bit_for_bit(tmp_path, signed, how):
    """The C kernels' code of each value, either way ``render.q8_codes`` may choose (from
    the table, ``quant.C_TABLE``, or from the roots, ``quant.C_HELPERS``), is the map's,
    computed with correctly rounded float32 operations, value for value: on and beside every
    rounding boundary, at zeros, NaN, infinities and subnormal scales. (Against
    ``quantize_t`` itself codes may differ by one on a boundary: ``assert_same_8bit``.) The
    table's codes are the roots' on one float in 251 of all 2^32 bit patterns."""
    import ctypes
    import subprocess

    from vega.codegen.c import build
    g = torch.Generator().manual_seed(3)
    x = torch.cat([_boundary_blocks(signed),
                   torch.randn(4096, generator=g) * torch.logspace(-6, 2, 4096)])
    if not signed:
        x = x.abs()
    absmax = quant.absmax_t(x)
    want = _codes_correctly_rounded(x, absmax, signed)
    src = tmp_path / "codes.c"
    src.write_text(_CODES_DRIVER % (quant.C_HELPERS + quant.C_TABLE))
    lib = tmp_path / "codes.so"
    subprocess.run([*build.command(build.compiler()), *build.FLAGS, str(src), "-o", str(lib),
                    "-lm"],
                   check=True, capture_output=True)
    codes = torch.empty_like(want)
    ctypes.CDLL(str(lib)).codes_of(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(absmax.data_ptr()),
        ctypes.c_int64(x.numel()), ctypes.c_int(int(signed)), ctypes.c_int(how == "table"),
        ctypes.c_void_p(codes.data_ptr()))
    assert torch.equal(codes, want), (codes != want).nonzero()[:10]
    differ = ctypes.CDLL(str(lib)).tables_differ
    differ.restype = ctypes.c_int64
    assert differ(ctypes.c_int(int(signed)), ctypes.c_int64(251)) == 0


def test_8bit_state_a_compiled_step_made_is_shown_in_the_groups_by_state_dict():
    """A step that dynamo traces does not set a group's 'vega_q8_maps' (its records, for
    torch's set_state_dict with flatten_optimizer_state_dict=True); state_dict, which torch's
    get_state_dict calls on the optimizer that set_state_dict then loads into, sets it:
    an 8-bit optimizer compiled from its first step kept no key, and a flattened load into
    it was refused."""
    torch._dynamo.reset()
    w = torch.nn.Parameter(torch.randn(64, 128))
    w.grad = torch.randn(64, 128)
    opt = vega.optim.AdamW([w], lr=1e-3, state_dtype=U8)
    torch.compile(opt.step, backend="eager")()
    assert opt.state[w]["mu"].dtype == U8
    assert opt.state_dict()["param_groups"][0]["vega_q8_maps"] == 3
    assert opt.param_groups[0]["vega_q8_maps"] == 3


def test_a_specs_own_state_named_absmax_is_no_8bit_scale(tmp_path):
    """A spec may name a state m_absmax (a float state of its own, beside no 8-bit codes):
    its negative values are no negative scales, and the state vega.save wrote loads."""
    spec = vega.compile("optimizer own(lr = 0.1) {\n    state m_absmax = zeros\n"
                        "    m_absmax = m_absmax - g\n    p = p - lr * m_absmax\n}")
    params = {"w": torch.ones(10)}
    _, state = spec.step(params, {"w": torch.ones(10)}, spec.init(params))
    assert torch.equal(state["m_absmax"]["w"], -torch.ones(10))
    vega.save(tmp_path / "s.safetensors", state)
    loaded = vega.load(tmp_path / "s.safetensors", like=state)
    assert torch.equal(loaded["m_absmax"]["w"], -torch.ones(10))
    vega.set_leaf(state, "m_absmax.w", -2 * torch.ones(10))
