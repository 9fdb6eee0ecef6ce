"""The Triton backend's address tables made by the C++ operator (``triton_rows`` and
``triton_grad_rows`` of ``vega.codegen.c.native``, which also check every tensor) against the
same tables made in Python: every launch of a step, its grid, constexprs, scalars and the
content of each tensor argument, recorded (not run) on both paths and compared."""
import pytest
import torch

import vega
from vega.codegen import triton_runtime
from vega.codegen.c import native

pytestmark = pytest.mark.skipif(native.module(wait=True) is None,
                                reason="the native operator needs a C++ compiler")
DEVICE = "cpu" if triton_runtime.interpreting() else "cuda"


def _launches(step, monkeypatch, python: bool) -> list:
    """Each launch of one call of ``step``: (kernel, grid, arguments, constexprs), a tensor
    argument as a copy of its values; on the Python path where ``python``. Also how many
    steps took the native path."""
    found, native_steps = [], []

    def record(fn, grid, *args, **meta):
        py = getattr(fn, "fn", fn)  # (its module's name holds the dtype group's)
        found.append((f"{py.__module__}.{py.__name__}", grid,
                      [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args],
                      sorted(meta.items())))

    real = triton_runtime._native_step

    def native_step(*args, **kwargs):
        if python:
            return False
        out = real(*args, **kwargs)
        native_steps.append(out is not False)
        return out

    with monkeypatch.context() as m:
        m.setattr(triton_runtime, "launch", record)
        # one hyperparameter array for both paths (on the CPU each step makes its own: the
        # tables' column of its address would differ)
        m.setattr(triton_runtime, "_hyper_array", lambda *a: _HYPERS.setdefault(
            repr(a), _REAL_HYPER_ARRAY(*a)))
        m.setattr(triton_runtime, "_native_step", native_step)
        if python:
            m.setattr(native, "module", lambda wait=None: None)
        step()
    return found, native_steps


_REAL_HYPER_ARRAY = triton_runtime._hyper_array
_HYPERS: dict = {}


def _same(a, b) -> None:
    assert len(a) == len(b)
    for (name, grid, args, meta), (name2, grid2, args2, meta2) in zip(a, b):
        assert (name, grid, meta) == (name2, grid2, meta2)
        assert len(args) == len(args2)
        for x, y in zip(args, args2):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape, name
                # (a table made for this step holds addresses of this step's tensors; the
                # scalars buffer and partial sums are torch.empty: their values are garbage)
                if x.dtype == torch.int64 and x.dim() == 2:
                    assert torch.equal(x, y), name
            else:
                assert x == y, name


def _params(dtypes, shapes, unaligned: bool = False):
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(s, device=DEVICE).to(d)) for s, d in zip(shapes, dtypes)]
    if unaligned:  # the first parameter 4 bytes into its storage: no 128-bit accesses
        ws[0] = torch.nn.Parameter(torch.randn(ws[0].numel() + 1, device=DEVICE)[1:])
    for w in ws:
        w.grad = torch.randn_like(w)
    return ws


SHAPES = [(300,), (30, 40), (), (0,), (4100,), (7,)]
CASES = {
    "adamw": (vega.optim.AdamW, {}),
    "adamw, clip + skip": (vega.optim.AdamW, dict(max_grad_norm=1.0, skip_nonfinite=True)),
    "adamw, loss scale": (vega.optim.AdamW, dict(max_grad_norm=1.0,
                                                 loss_scale=vega.LossScale.dynamic())),
    "adamw, a bfloat16 nu": (vega.optim.AdamW, dict(state_dtype={"nu": torch.bfloat16})),
    "adamw, 8-bit state": (vega.optim.AdamW, dict(state_dtype=torch.uint8)),
    "sgd, no state": (vega.optim.SGD, dict(momentum=0.0)),
    "lamb": (vega.optim.LAMB, {}),
    "adamw, a parameter not 16-byte aligned": (vega.optim.AdamW, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_tables_are_the_python_tables(case, monkeypatch):
    """Parameters of two dtypes (two groups), a scalar, an empty one and one long enough for
    8-bit state; each case's launches on both paths alike, the native path taken."""
    cls, kw = CASES[case]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.float32,
              torch.bfloat16]
    opt = cls(_params(dtypes, SHAPES, unaligned="aligned" in case), lr=1e-3, backend="triton",
              **kw)
    with monkeypatch.context() as m:  # (the states made, the kernels loaded)
        m.setattr(triton_runtime, "launch", lambda *a, **k: None)
        opt.step()
    ours, taken = _launches(opt.step, monkeypatch, python=False)
    theirs, _ = _launches(opt.step, monkeypatch, python=True)
    assert taken and all(taken)  # (8-bit state: two programs, two calls)
    assert any(name.endswith("_update") for name, *_ in ours)
    aligned = {dict(meta).get("ALIGNED") for *_, meta in ours} - {None}
    assert aligned == ({False, True} if "aligned" in case else {True})  # (one a dtype group)
    _same(ours, theirs)


def test_a_step_through_native_tables_steps_as_the_reference():
    """Run (under the interpreter, or on a GPU): the native path's results against the
    reference backend's over three steps, parameters and states."""
    dtypes = [torch.float32] * 3
    shapes = [(300,), (30, 40), ()]
    a = vega.optim.AdamW(_params(dtypes, shapes), lr=0.1, backend="triton", max_grad_norm=0.5)
    b = vega.optim.AdamW(_params(dtypes, shapes), lr=0.1, backend="reference", max_grad_norm=0.5)
    for _ in range(3):
        a.step()
        b.step()
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
        torch.testing.assert_close(p, q)
        for name in ("mu", "nu"):
            torch.testing.assert_close(a.state[p][name], b.state[q][name])
        assert int(a.state[p]["step"]) == int(b.state[q]["step"]) == 3


@pytest.mark.parametrize("what", ["non-contiguous gradient", "negative bit", "shared state",
                                  "subclass"])
def test_tensors_the_native_checks_refuse_take_the_python_path(what, monkeypatch):
    """What ``triton_rows`` refuses steps as before, on the Python path: copies of a gradient
    not stored as the kernels read it, and the Python checks' own error for memory that two
    written tensors share."""
    params = {"w": torch.randn(30, 40, device=DEVICE), "b": torch.randn(40, device=DEVICE)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = vega.adamw_init(params)
    if what == "non-contiguous gradient":
        grads["w"] = torch.randn(40, 30, device=DEVICE).t()
    elif what == "negative bit":
        grads["w"] = torch.randn(30, 40, device=DEVICE)._neg_view()
    elif what == "shared state":
        state["nu"]["b"] = state["mu"]["b"]
    else:
        class Marked(torch.Tensor):
            pass
        grads["b"] = grads["b"].as_subclass(Marked)
    calls = []
    real = triton_runtime._native_step
    monkeypatch.setattr(triton_runtime, "_native_step",
                        lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    ref = {k: v.clone() for k, v in params.items()}
    ref_state = vega.adamw_init(ref)
    ref_grads = {k: v.clone() for k, v in grads.items()}
    if what == "shared state":
        with pytest.raises(ValueError, match="share"):
            vega.adamw_step(params, grads, state, lr=0.1, backend="triton", donate=True)
        assert calls in ([], [False])  # (the functional step's own check may come first)
        return
    vega.adamw_step(params, grads, state, lr=0.1, backend="triton", donate=True)
    vega.adamw_step(ref, ref_grads, ref_state, lr=0.1, backend="reference", donate=True)
    assert calls == [False]
    for k in params:
        torch.testing.assert_close(params[k], ref[k])


@pytest.mark.parametrize("change", ["none", "replaced", "swapped"])
def test_the_step_takes_what_its_prelude_found_only_of_the_same_gradients(change, monkeypatch):
    """A fused step's prelude checks its gradients and hands what it found (their lengths,
    addresses and dtypes) to the step's ``triton_rows``, which takes it only where it is
    given the same tensors in the same order: a gradient replaced by another tensor, or two
    swapped, between the two are read anew (their addresses in the table)."""
    ws = _params([torch.float32] * 3, [(300,), (300,), (7,)])
    opt = vega.optim.AdamW(ws, lr=1e-3, backend="triton", max_grad_norm=1.0)
    with monkeypatch.context() as m:  # (the states made, the kernels loaded)
        m.setattr(triton_runtime, "launch", lambda *a, **k: None)
        opt.step()
    mod, given, tables, used = native.module(), [], [], []

    class Recording:
        def __getattr__(self, name):
            return getattr(mod, name)

        def triton_rows(self, *args):
            given.append(args[-1] is not None)
            out = mod.triton_rows(*args)
            tables.append([rows for _, _, rows, _, _ in out[0]])
            return out

    real = triton_runtime._native_step

    def native_step(kern, params, grads, *rest):
        if change == "replaced":
            grads[0] = grads[0].clone()
        elif change == "swapped":
            grads[0], grads[1] = grads[1], grads[0]
        used.append([g.data_ptr() for g in grads])
        return real(kern, params, grads, *rest)

    with monkeypatch.context() as m:
        m.setattr(triton_runtime, "launch", lambda *a, **k: None)
        m.setattr(triton_runtime, "_table_builder", lambda: Recording())
        m.setattr(triton_runtime, "_native_step", native_step)
        opt.step()
    assert given == [True]  # (offered: triton_rows decides)
    assert len(tables) == 1 and len(tables[0]) == 1  # (one dtype group)
    assert tables[0][0][:, 2].tolist() == used[0]


def test_a_step_in_place_on_the_python_path_advances_the_parameters_versions(monkeypatch):
    """A gradient the native checks refuse (non-contiguous): the Python path's step in place
    advances the parameters' versions too, so a graph that saved one refuses backward."""
    calls = []
    real = triton_runtime._native_step
    monkeypatch.setattr(triton_runtime, "_native_step",
                        lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    w = torch.randn(30, 40, device=DEVICE).requires_grad_(True)
    params, grads = {"w": w}, {"w": torch.randn(40, 30, device=DEVICE).t()}
    state = vega.adamw_init(params)
    loss = (w * w).sum()
    version = w._version
    with torch.no_grad():
        vega.adamw_step(params, grads, state, lr=0.1, backend="triton", donate=True)
    assert calls == [False]
    assert w._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
