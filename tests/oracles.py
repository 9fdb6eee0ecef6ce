"""Outside oracles for vega's optimizers, and a comparison that reads NaN and infinity.

Not a test file: ``tests/test_oracles.py`` drives it. The pieces:

- ``CASES``: a registry in the manner of torch's ``OptimizerInfo``. Each case names
  a shipped spec, every one of its hyperparameters (non-default values), how they
  map onto ``torch.optim`` and onto optax, and which torch / optax state holds
  each of vega's state fields.
- ``make_params`` / ``make_grads``: a fixed parameter structure (a matrix, a vector
  and a 0-d scalar) and seeded gradients whose scale differs by leaf and by step.
- Trajectories: each runner returns, for every step, a *snapshot* — a flat dict
  ``{'p.w': tensor, 'mu.w': tensor, ...}`` — so that vega (functional API or
  optimizer class), torch.optim and optax are compared leaf by leaf, step by step.
- ``assert_close``: NaN and infinity positions are part of the answer; the finite
  rest is compared with a relative tolerance and an absolute one scaled to the
  leaf's magnitude; failures name the leaf and the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

import vega

# -- the comparison --------------------------------------------------------------

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def assert_close(actual, expected, *, rtol: float, scale: float | None = None,
                 what: str = "value", step: int | None = None, check_dtype: bool = False):
    """``actual`` matches ``expected`` (tensors or arrays) elementwise.

    NaN, +inf and -inf must sit at the same positions in both. On the finite
    rest, ``|a - e| <= atol + rtol * |e|`` with ``atol = rtol * scale``, ``scale``
    the leaf's magnitude (by default ``max|e|``), so that a value that cancels to
    near zero is judged against the size of the numbers it came from.
    The message names ``what`` and ``step`` and shows the worst element.
    """
    where = f"{what}" + (f" at step {step}" if step is not None else "")
    if check_dtype:
        assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
        assert actual.dtype == expected.dtype, (
            f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    a, e = _as_float64(actual), _as_float64(expected)
    assert tuple(a.shape) == tuple(e.shape), (
        f"{where}: shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    for label, test in (("NaN", torch.isnan), ("+inf", lambda x: torch.isposinf(x)),
                        ("-inf", lambda x: torch.isneginf(x))):
        ma, me = test(a), test(e)
        if not torch.equal(ma, me):
            bad = (ma != me).nonzero().tolist()
            raise AssertionError(
                f"{where}: {label} positions differ at {len(bad)} element(s), first at index "
                f"{bad[0]}: actual {a[tuple(bad[0])].item()!r}, "
                f"expected {e[tuple(bad[0])].item()!r}")
    finite = torch.isfinite(e)
    if not finite.any():
        return
    af, ef = a[finite], e[finite]
    atol = rtol * (ef.abs().max().item() if scale is None else scale)
    err = (af - ef).abs()
    allowed = atol + rtol * ef.abs()
    if bool((err <= allowed).all()):
        return
    over = err - allowed
    k = int(over.argmax())
    index = finite.nonzero()[k].tolist()
    rel = err / ef.abs().clamp_min(torch.finfo(torch.float64).tiny)
    raise AssertionError(
        f"{where}: {int((err > allowed).sum())} of {ef.numel()} element(s) differ beyond "
        f"rtol={rtol:g}, atol={atol:.3g}; worst at index {index}: actual {af[k].item()!r}, "
        f"expected {ef[k].item()!r} (abs err {err[k].item():.3g}, rel err {rel[k].item():.3g}); "
        f"max abs err {err.max().item():.3g}")


def assert_trajectories_close(actual: list[dict], expected: list[dict], *, rtol: float,
                              who: str, check_dtype: bool = False):
    """Step by step, every leaf of ``expected`` is in ``actual`` and matches it.

    A leaf's absolute tolerance is ``rtol`` times its largest magnitude over the
    whole trajectory (a 0-d moment that cancels near zero at one step is judged
    against the values it had before).
    """
    assert len(actual) == len(expected), f"{who}: {len(actual)} steps, expected {len(expected)}"
    scale = {}
    for snap in expected:
        for name, value in snap.items():
            e = _as_float64(value)
            e = e[torch.isfinite(e)]
            scale[name] = max(scale.get(name, 0.0), e.abs().max().item() if e.numel() else 0.0)
    for step, (got, want) in enumerate(zip(actual, expected), start=1):
        missing = sorted(set(want) - set(got))
        assert not missing, f"{who}: step {step}: leaves {missing} missing from vega's answer"
        for name in want:
            assert_close(got[name], want[name], rtol=rtol, scale=scale[name],
                         what=f"{who}: leaf '{name}'", step=step, check_dtype=check_dtype)


# -- inputs ----------------------------------------------------------------------

SHAPES = {"w": (5, 7), "b": (7,), "s": ()}
# Gradient scale by leaf: the scalar's gradients are of the order of eps, so eps matters.
GRAD_SCALE = {"w": 1.0, "b": 1e-3, "s": 1e-6}
STEPS = 20


def make_params(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """A matrix, a vector and a 0-d scalar, drawn in float64 then cast."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
            for k, shape in SHAPES.items()}


def make_grads(dtype: torch.dtype, steps: int = STEPS, seed: int = 1) -> list[dict]:
    """Seeded gradients, one dict per step; each step has its own overall scale so that
    the second moment rises and falls (AMSGrad's running max then matters)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = float(torch.exp(torch.randn((), generator=gen, dtype=torch.float64)))
        out.append({k: (scale * GRAD_SCALE[k] *
                        torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
                    for k, shape in SHAPES.items()})
    return out


# -- the registry ----------------------------------------------------------------

def _sgd_torch(h: dict) -> dict:
    return dict(lr=h["lr"], momentum=h["momentum"], dampening=h["dampening"],
                nesterov=h["nesterov"],
                weight_decay=h["weight_decay"])


def _adam_torch(h: dict) -> dict:
    return dict(lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                weight_decay=h["weight_decay"], amsgrad=h["amsgrad"])


def _l2(h: dict, tx):
    """An L2 penalty added to the gradient before ``tx`` (torch's weight_decay)."""
    import optax
    if h["weight_decay"] == 0:
        return tx
    return optax.chain(optax.add_decayed_weights(h["weight_decay"]), tx)


def _sgd_optax(h: dict):
    import optax
    assert h["dampening"] == 0, "optax's sgd has no dampening"
    return _l2(h, optax.sgd(h["lr"], momentum=h["momentum"] or None, nesterov=h["nesterov"]))


def _adam_optax(h: dict):
    import optax
    return _l2(h, optax.adam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"]))


def _adamw_optax(h: dict):
    import optax
    return optax.adamw(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                       weight_decay=h["weight_decay"])


ADAM_TORCH_STATE = {"mu": "exp_avg", "nu": "exp_avg_sq"}
AMSGRAD_TORCH_STATE = {**ADAM_TORCH_STATE, "nu_max": "max_exp_avg_sq"}
ADAM_OPTAX_STATE = {"mu": "mu", "nu": "nu"}
ADAM_HYPERS = dict(lr=3e-2, b1=0.8, b2=0.95, eps=1e-6)


@dataclass(frozen=True)
class OracleCase:
    """One optimizer setting and its counterparts outside vega."""

    id: str
    spec: str                               # a shipped spec: vega.builtin(spec)
    hypers: dict                            # every hyperparameter of the spec, spelled out
    torch_cls: type                         # the torch.optim class
    to_torch: Callable[[dict], dict]        # hypers -> the torch class's keyword arguments
    torch_state: dict[str, str]             # vega state field -> torch state key
    to_optax: Callable[[dict], object] | None = None  # hypers -> an optax transformation
    optax_state: dict[str, str] = field(default_factory=dict)  # field -> optax state attr

    @property
    def compiled(self) -> vega.CompiledSpec:
        return vega.builtin(self.spec)

    @property
    def optimizer_class(self) -> type:
        return getattr(vega.optim, self.compiled.class_name)

    @property
    def flags(self) -> dict:
        return {h.name: self.hypers[h.name] for h in self.compiled.hypers if h.type == "bool"}

    def __repr__(self) -> str:  # pytest ids
        return self.id


CASES: list[OracleCase] = [
    # without momentum neither vega nor torch keeps a buffer (optax: momentum=None)
    OracleCase("sgd", "sgd", dict(lr=3e-2, momentum=0.0, nesterov=False, weight_decay=0.0,
                                  dampening=0.0),
               torch.optim.SGD, _sgd_torch, {}, to_optax=_sgd_optax),
    *[OracleCase(f"sgd-{kind}{'-wd' if wd else ''}", "sgd",
                 dict(lr=3e-2, momentum=0.7, nesterov=kind == "nesterov", weight_decay=wd,
                      dampening=0.0),
                 torch.optim.SGD, _sgd_torch, {"v": "momentum_buffer"},
                 to_optax=_sgd_optax, optax_state={"v": "trace"})
      for kind in ("momentum", "nesterov") for wd in (0.0, 0.05)],
    # dampening (torch's; optax has none): the first step's buffer is the gradient
    OracleCase("sgd-dampening", "sgd", dict(lr=3e-2, momentum=0.7, nesterov=False,
                                            weight_decay=0.05, dampening=0.3),
               torch.optim.SGD, _sgd_torch, {"v": "momentum_buffer"}),
    OracleCase("adam", "adam", dict(ADAM_HYPERS, weight_decay=0.0, amsgrad=False),
               torch.optim.Adam, _adam_torch, ADAM_TORCH_STATE,
               to_optax=_adam_optax, optax_state=ADAM_OPTAX_STATE),
    OracleCase("adam-amsgrad", "adam", dict(ADAM_HYPERS, weight_decay=0.0, amsgrad=True),
               torch.optim.Adam, _adam_torch, AMSGRAD_TORCH_STATE),
    OracleCase("adam-wd", "adam", dict(ADAM_HYPERS, weight_decay=0.05, amsgrad=False),
               torch.optim.Adam, _adam_torch, ADAM_TORCH_STATE,
               to_optax=_adam_optax, optax_state=ADAM_OPTAX_STATE),
    OracleCase("adamw", "adamw", dict(ADAM_HYPERS, weight_decay=0.05, amsgrad=False),
               torch.optim.AdamW, _adam_torch, ADAM_TORCH_STATE,
               to_optax=_adamw_optax, optax_state=ADAM_OPTAX_STATE),
    OracleCase("adamw-amsgrad", "adamw", dict(ADAM_HYPERS, weight_decay=0.05, amsgrad=True),
               torch.optim.AdamW, _adam_torch, AMSGRAD_TORCH_STATE),
]

OPTAX_CASES = [c for c in CASES if c.to_optax is not None]


# -- trajectories: one snapshot per step ------------------------------------------

def _clone_tree(tree: dict) -> dict:
    return {k: v.clone() for k, v in tree.items()}


def functional_trajectory(cspec: vega.CompiledSpec, hypers: dict, params: dict,
                          grads: list[dict]) -> list[dict]:
    """vega's functional API: ``cspec.init`` then ``cspec.step`` once per gradient."""
    params = _clone_tree(params)
    state = cspec.init(params, **hypers)
    snaps = []
    for g in grads:
        params, state = cspec.step(params, g, state, **hypers)
        snap = {f"p.{k}": v.clone() for k, v in params.items()}
        for fld, sub in state.items():
            if fld != "step":
                snap.update({f"{fld}.{k}": v.clone() for k, v in sub.items()})
        snap["step"] = state["step"].clone()
        snaps.append(snap)
    return snaps


def class_trajectory(cls: type, hypers: dict, params: dict, grads: list[dict]) -> list[dict]:
    """vega's ``torch.optim`` class over the same leaves, stepped with ``p.grad`` set."""
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = cls(list(tensors.values()), **hypers)
    snaps = []
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
        snap = {f"p.{k}": p.detach().clone() for k, p in tensors.items()}
        for k, p in tensors.items():
            snap.update({f"{fld}.{k}": value.clone() for fld, value in opt.state[p].items()})
        snaps.append(snap)
    return snaps


def torch_trajectory(case: OracleCase, params: dict, grads: list[dict]) -> list[dict]:
    """torch.optim's for-loop implementation (``foreach=False``), as vega-named leaves."""
    tensors = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = case.torch_cls(list(tensors.values()), foreach=False, **case.to_torch(case.hypers))
    snaps = []
    for g in grads:
        for k, p in tensors.items():
            p.grad = g[k].clone()
        opt.step()
        snap = {f"p.{k}": p.detach().clone() for k, p in tensors.items()}
        for fld, key in case.torch_state.items():
            snap.update({f"{fld}.{k}": opt.state[p][key].clone() for k, p in tensors.items()})
        snaps.append(snap)
    return snaps


def _optax_find(state, attr: str):
    """The ``attr`` field of the first optax state (a namedtuple) that has one."""
    if hasattr(state, "_fields"):
        if attr in state._fields:
            return getattr(state, attr)
    if isinstance(state, (tuple, list)):
        for sub in state:
            found = _optax_find(sub, attr)
            if found is not None:
                return found
    return None


def optax_trajectory(case: OracleCase, params: dict, grads: list[dict]) -> list[dict]:
    """optax on JAX in float64 (needs ``jax_enable_x64``), as vega-named leaves.

    Also records optax's ``count`` (where the transformation has one) as ``step``.
    """
    import jax
    import jax.numpy as jnp
    import optax

    assert jax.config.jax_enable_x64, "optax oracles need jax_enable_x64 (float64)"
    tx = case.to_optax(case.hypers)
    jp = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    assert all(v.dtype == jnp.float64 for v in jp.values())
    opt_state = tx.init(jp)
    snaps = []
    for g in grads:
        jg = {k: jnp.asarray(v.numpy()) for k, v in g.items()}
        updates, opt_state = tx.update(jg, opt_state, jp)
        jp = optax.apply_updates(jp, updates)
        snap = {f"p.{k}": torch.from_numpy(np.array(v)) for k, v in jp.items()}
        for fld, attr in case.optax_state.items():
            sub = _optax_find(opt_state, attr)
            assert sub is not None, f"{case.id}: no optax state has a field {attr!r}"
            snap.update({f"{fld}.{k}": torch.from_numpy(np.array(v)) for k, v in sub.items()})
        count = _optax_find(opt_state, "count")
        if count is not None:
            snap["step"] = torch.tensor(int(count))
        snaps.append(snap)
    return snaps
