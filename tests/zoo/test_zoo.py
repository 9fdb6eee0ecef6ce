"""The optimizer zoo against outside oracles: optax, torch.optim, or a transcription.

Registry-driven: ``CASES`` lists, per case, a shipped spec, its hyperparameters
(non-default values), the oracles it is held to and how each oracle's state
maps onto vega's state fields. The oracles are

- optax (float64), stepped with the same gradients, compared at every step;
- torch.optim (foreach=False, float64), where torch has the same algorithm,
  stepped through vega's ``torch.optim`` class side by side;
- a hand-written implementation of vega's rule, where optax's differs
  (Adan: the official code's difference term; see ``adan_official``).

Conventions are in docs/conventions.md and each spec's header.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import jax  # test dependencies (like optax): a missing one fails, never skips
import jax.numpy as jnp
import optax
import torch

import vega
from vega.demo import model, spirals

jax.config.update("jax_enable_x64", True)

STEPS = 20
RTOL = 1e-9


# -- parameters, gradients, comparison -----------------------------------------------

def make_params() -> dict:
    """A 5x7 matrix, a (7,) vector that starts at zero (a zero norm for the trust
    ratios' first step) and a 0-d scalar, in float64."""
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 7, generator=gen, dtype=torch.float64),
            "b": torch.zeros(7, dtype=torch.float64),
            "s": torch.tensor(0.75, dtype=torch.float64)}


def make_grads(k: int) -> dict:
    """Seeded gradients for step k, with a scale that differs by leaf and by step."""
    gen = torch.Generator().manual_seed(1000 + k)
    scale = 1.0 + 0.5 * np.sin(k)
    return {"w": scale * torch.randn(5, 7, generator=gen, dtype=torch.float64),
            "b": 0.1 * scale * torch.randn(7, generator=gen, dtype=torch.float64),
            "s": 3.0 * torch.randn((), generator=gen, dtype=torch.float64)}


def _f64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))


def assert_close(actual, expected, what: str, step: int):
    """Relative to each element, with an absolute floor scaled to the leaf's size."""
    a, e = _f64(actual), _f64(expected)
    assert a.shape == e.shape, f"{what} at step {step}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(e).all(), f"{what} at step {step}: the oracle is not finite"
    atol = RTOL * e.abs().max().item()
    err = (a - e).abs()
    bad = err > atol + RTOL * e.abs()
    if bad.any():
        i = int(torch.argmax((err - RTOL * e.abs()).reshape(-1)))
        raise AssertionError(f"{what} at step {step}: {a.reshape(-1)[i].item()!r} != "
                             f"{e.reshape(-1)[i].item()!r} (worst element {i})")


# -- the hand-written oracle: Adan as the official code (sail-sg/Adan) steps -----------

def adan_official(params: dict, grads_at: Callable[[int], dict], h: dict, steps: int):
    """Snapshots of sail-sg/Adan's ``_single_tensor_adan`` with no_prox=True, transcribed.

    optax's adan scales the gradient difference by (1 - b2) where the paper's
    code uses b2, so for b2 != 0.5 optax is not an oracle for vega's Adan.
    Kept in the code's in-place order: neg_pre_grad = -g_prev, set to -g at the first
    step, so that the first difference is 0.
    """
    b1, b2, b3 = h["b1"], h["b2"], h["b3"]
    lr, eps, wd = h["lr"], h["eps"], h["weight_decay"]
    p = {k: v.clone() for k, v in params.items()}
    st = {k: {"m": torch.zeros_like(v), "v": torch.zeros_like(v), "n": torch.zeros_like(v)}
          for k, v in p.items()}
    out = []
    for k in range(steps):
        step = k + 1
        bc1, bc2, bc3 = 1 - b1 ** step, 1 - b2 ** step, 1 - b3 ** step
        grads = grads_at(k)
        snap = {}
        for name, param in p.items():
            grad, s = grads[name], st[name]
            if step == 1:
                s["neg_pre_grad"] = -grad.clone()
            neg_grad_or_diff = s["neg_pre_grad"]
            neg_grad_or_diff.add_(grad)                                    # g - g_prev
            s["m"].mul_(b1).add_(grad, alpha=1 - b1)
            s["v"].mul_(b2).add_(neg_grad_or_diff, alpha=1 - b2)
            neg_grad_or_diff.mul_(b2).add_(grad)                           # g + b2 * diff
            s["n"].mul_(b3).addcmul_(neg_grad_or_diff, neg_grad_or_diff, value=1 - b3)
            denom = (s["n"].sqrt() / bc3 ** 0.5).add_(eps)
            param.mul_(1 - lr * wd)
            param.addcdiv_(s["m"], denom, value=-lr / bc1)
            param.addcdiv_(s["v"], denom, value=-lr * b2 / bc2)
            neg_grad_or_diff.zero_().add_(grad, alpha=-1.0)
            snap.update({f"p.{name}": param.clone(), f"m.{name}": s["m"].clone(),
                         f"v.{name}": s["v"].clone(), f"n.{name}": s["n"].clone(),
                         f"g_prev.{name}": -s["neg_pre_grad"]})
        out.append(snap)
    return out


def adam_atan2_paper(params: dict, grads_at: Callable[[int], dict], h: dict, steps: int):
    """Snapshots of Adam-atan2 as Everett et al. (2024, section 4.3) write it, with AdamW's
    decoupled decay: p <- p (1 - lr wd) - lr a atan2(m_hat, b sqrt(v_hat))."""
    b1, b2, lr, wd, a, b = (h[k] for k in ("b1", "b2", "lr", "weight_decay", "a", "b"))
    p = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    out = []
    for k in range(steps):
        t, grads, snap = k + 1, grads_at(k), {}
        for n in p:
            mu[n] = b1 * mu[n] + (1 - b1) * grads[n]
            nu[n] = b2 * nu[n] + (1 - b2) * grads[n] ** 2
            m_hat, v_hat = mu[n] / (1 - b1 ** t), nu[n] / (1 - b2 ** t)
            p[n] = p[n] * (1 - lr * wd) - lr * a * torch.atan2(m_hat, b * torch.sqrt(v_hat))
            snap.update({f"p.{n}": p[n].clone(), f"mu.{n}": mu[n].clone(),
                         f"nu.{n}": nu[n].clone()})
        out.append(snap)
    return out


# -- Muon: torch.optim.Muon's step written out in float64, and optax on transposed layouts --

def muon_torch_float64(params: dict, grads_at: Callable[[int], dict], h: dict, steps: int):
    """Snapshots of torch.optim.Muon's ``_single_tensor_muon`` transcribed with its
    Newton-Schulz iteration in the parameters' dtype (torch's runs it in bfloat16: see
    test_muon_bf16_against_torch), on the matrices; the others step as vega's AdamW side
    (torch's Muon takes no other parameter), with Nesterov's mix as optax's adamw."""
    p = {k: v.clone() for k, v in params.items()}
    st = {k: {"buf": torch.zeros_like(v), "mu": torch.zeros_like(v), "nu": torch.zeros_like(v)}
          for k, v in p.items()}
    a, b, c = h["a"], h["b"], h["c"]
    out = []
    for k in range(steps):
        t = k + 1
        grads = grads_at(k)
        snap = {}
        for name, param in p.items():
            grad, s = grads[name], st[name]
            if param.dim() == 2:
                s["buf"].lerp_(grad, 1 - h["momentum"])
                update = grad.lerp(s["buf"], h["momentum"]) if h["nesterov"] else s["buf"]
                x = update.clone()
                tall = x.size(0) > x.size(1)
                x = x.T if tall else x
                x = x / x.norm().clamp(min=h["eps"])
                for _ in range(int(h["ns_steps"])):
                    gram = x @ x.T
                    x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x,
                                    beta=a)
                x = x.T if tall else x
                rows, cols = param.shape
                scale = 0.2 * max(rows, cols) ** 0.5 if h["match_rms_adamw"] else \
                    max(1, rows / cols) ** 0.5
                param.mul_(1 - h["lr"] * h["weight_decay"])
                param.add_(x, alpha=-h["lr"] * scale)
                snap[f"buf.{name}"] = s["buf"].clone()
            else:
                b1, b2 = h["adam_b1"], h["adam_b2"]
                lr = h["lr"] if h["adam_lr"] < 0 else h["adam_lr"]
                s["mu"].mul_(b1).add_(grad, alpha=1 - b1)
                s["nu"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                m = (b1 * s["mu"] / (1 - b1 ** (t + 1)) + (1 - b1) * grad / (1 - b1 ** t)) \
                    if h["nesterov"] else s["mu"] / (1 - b1 ** t)
                param.sub_(lr * (m / ((s["nu"] / (1 - b2 ** t)).sqrt() + h["adam_eps"])
                                 + h["adam_weight_decay"] * param))
                snap[f"mu.{name}"], snap[f"nu.{name}"] = s["mu"].clone(), s["nu"].clone()
            snap[f"p.{name}"] = param.clone()
        out.append(snap)
    return out


def muon_optax_transposed(params: dict, grads_at: Callable[[int], dict], h: dict, steps: int):
    """optax.contrib.muon stepped on the transposed matrices (its (fan_in, fan_out) layout,
    torch's (out, in) transposed), snapshots transposed back; the rule vega's is without
    nesterov and at eps = 0 (the spec's header), its AdamW side's eps optax's one eps."""
    assert not h["nesterov"] and h["eps"] == 0 and h["adam_eps"] == 0

    def flip(tree):
        return {n: (v.T if v.ndim == 2 else v) for n, v in tree.items()}
    tx = optax.contrib.muon(h["lr"], ns_coeffs=(h["a"], h["b"], h["c"]),
                            ns_steps=int(h["ns_steps"]), beta=h["momentum"], eps=0.0,
                            weight_decay=h["weight_decay"], nesterov=False,
                            adam_b1=h["adam_b1"], adam_b2=h["adam_b2"],
                            adam_weight_decay=h["adam_weight_decay"],
                            adam_learning_rate=h["adam_lr"])
    snaps = optax_trajectory(tx, {}, flip(params), lambda k: flip(grads_at(k)), steps)
    return [{k: (np.asarray(v).T if np.ndim(v) == 2 else v) for k, v in snap.items()}
            for snap in snaps]


# -- the registry ----------------------------------------------------------------------

def _adagrad_lr(h):
    # torch's lr / (1 + (step - 1) * lr_decay) as an optax schedule (count 0 at step 1)
    return lambda count: h["lr"] / (1 + count * h["lr_decay"])


def _momentum(h):
    return h["momentum"] or None


@dataclass(frozen=True)
class Case:
    """One spec, one setting, the oracles it must match.

    optax: hypers -> GradientTransformation; optax_state: vega field -> (optax state -> tree).
    torch: (params, hypers) -> torch.optim.Optimizer; torch_state: vega field -> torch key.
    reference: (params, grads_at, hypers, steps) -> list of snapshots {"p.w": ..., "mu.w": ...}.
    bad: out-of-range values that must raise ValueError naming the argument.
    """
    spec: str
    hypers: dict
    optax: Callable | None = None
    optax_state: dict = field(default_factory=dict)
    torch: Callable | None = None
    torch_state: dict = field(default_factory=dict)
    reference: Callable | None = None
    bad: dict = field(default_factory=dict)
    lr: float = 1e-2  # for the demo model
    label: str = ""

    @property
    def id(self) -> str:
        return self.spec + (f"-{self.label}" if self.label else "")


ADAM_LIKE_BAD = {"lr": -1e-3, "b1": 1.0, "b2": -0.1}
RMSPROP_STATE = {"nu": lambda s: s[1][0].nu}
RMSPROP_CENTERED_STATE = {"nu": lambda s: s[1][0].nu, "mu": lambda s: s[1][0].mu}


def _rmsprop_optax(h):
    # L2 weight decay added to the gradient first, as torch does
    return optax.chain(optax.add_decayed_weights(h["weight_decay"]),
                       optax.rmsprop(h["lr"], decay=h["alpha"], eps=h["eps"], eps_in_sqrt=False,
                                     centered=h["centered"], momentum=_momentum(h)))


def _rmsprop_torch(ps, h):
    return torch.optim.RMSprop(ps, lr=h["lr"], alpha=h["alpha"], eps=h["eps"],
                               weight_decay=h["weight_decay"], momentum=h["momentum"],
                               centered=h["centered"], foreach=False)


def _rmsprop_case(momentum: float, centered: bool) -> Case:
    # torch keeps momentum_buffer only for momentum > 0; optax's trace holds lr * buf
    torch_state = {"nu": "square_avg"}
    if centered:
        torch_state["mu"] = "grad_avg"
    if momentum:
        torch_state["buf"] = "momentum_buffer"
    return Case("rmsprop", dict(lr=3e-3, alpha=0.9, eps=1e-3, weight_decay=0.05,
                                momentum=momentum, centered=centered),
                optax=_rmsprop_optax,
                optax_state=RMSPROP_CENTERED_STATE if centered else RMSPROP_STATE,
                torch=_rmsprop_torch, torch_state=torch_state,
                bad={"lr": -1e-3, "alpha": 1.0, "momentum": -0.5}, lr=1e-2,
                label=f"momentum{momentum}" + ("-centered" if centered else ""))


def _decay_f64(count, rate):
    """optax's second-moment decay 1 - t^-rate, in float64: optax computes it in float32,
    vega (docs/conventions.md) in float64 rounded to the parameters' precision."""
    return 1.0 - jnp.asarray(count + 1, jnp.float64) ** -rate


def _adafactor_optax(h):
    """optax.adafactor's chain, transform for transform (see optax/_src/alias.py), with the
    float64 decay; test_adafactor_alias_differs_only_by_the_decay checks it against the alias.
    vega's relative_step is the schedule min(lr, 1/sqrt(t)), t = count + 1."""
    lr = h["lr"] if not h["relative_step"] else (
        lambda count: jnp.minimum(h["lr"], 1.0 / jnp.sqrt(count + 1.0)))
    tx = [optax.scale_by_factored_rms(h["factored"], h["decay_rate"], h["decay_offset"],
                                      int(h["min_dim_size_to_factor"]), h["eps"],
                                      decay_rate_fn=_decay_f64),
          optax.clip_by_block_rms(h["clipping_threshold"]),
          optax.scale_by_learning_rate(lr, flip_sign=False)]
    if h["multiply_by_parameter_scale"]:
        tx.append(optax.scale_by_param_block_rms(h["param_scale_min"]))
    if h["use_momentum"]:
        tx.append(optax.ema(h["momentum"], debias=False, accumulator_dtype=jnp.float64))
    tx += [optax.add_decayed_weights(h["weight_decay_rate"]), optax.scale(-1)]
    return optax.chain(*tx)


def _factored_only(field_name):
    """optax keeps a (1,) placeholder where a leaf is not factored (vega: no leaf)."""
    def get(s):
        tree = getattr(s[0], field_name)
        return {n: v for n, v in tree.items() if v.shape != (1,) or field_name == "v"}
    return get


def _adafactor_state(h):
    out = {"v_row": _factored_only("v_row"), "v_col": _factored_only("v_col"),
           "v": lambda s: {n: v for n, v in s[0].v.items() if v.shape != (1,)}}
    if h["use_momentum"]:
        out["m"] = lambda s: next(x for x in s if isinstance(x, optax.EmaState)).ema
    return out


def _adafactor_case(label, **h):
    hypers = dict(lr=0.05, decay_rate=0.7, decay_offset=0.0, min_dim_size_to_factor=4.0,
                  clipping_threshold=0.5, momentum=0.8, weight_decay_rate=0.01, eps=1e-20,
                  param_scale_min=0.01, factored=True, multiply_by_parameter_scale=True,
                  relative_step=False, use_momentum=True)
    hypers.update(h)
    return Case("adafactor", hypers, optax=_adafactor_optax,
                optax_state=_adafactor_state(hypers),
                bad={"lr": -1.0, "decay_rate": -0.5, "clipping_threshold": 0.0,
                     "momentum": 1.0, "min_dim_size_to_factor": -1.0}, label=label)


LEAVES = ("w", "b", "s")


def _each_leaf(get):
    """A state of one number per group (optax keeps one for the whole tree) as vega holds
    it: the same number in each tensor's state."""
    return lambda s: {n: get(s) for n in LEAVES}


def _prodigy_case(label, **h):
    hypers = dict(lr=0.5, b1=0.8, b2=0.95, b3=-1.0, eps=1e-6, d0=1e-3, d_coef=2.0,
                  weight_decay=0.1, safeguard_warmup=False)
    hypers.update(h)
    return Case(
        "prodigy", hypers,
        optax=lambda h: optax.contrib.prodigy(
            h["lr"], betas=(h["b1"], h["b2"]), beta3=None if h["b3"] < 0 else h["b3"],
            eps=h["eps"], estim_lr0=h["d0"], estim_lr_coef=h["d_coef"],
            weight_decay=h["weight_decay"], safeguard_warmup=h["safeguard_warmup"]),
        optax_state={"mu": lambda s: s.exp_avg, "nu": lambda s: s.exp_avg_sq,
                     "s": lambda s: s.grad_sum, "p0": lambda s: s.params0,
                     "d": _each_leaf(lambda s: s.estim_lr),
                     "num": _each_leaf(lambda s: s.numerator_weighted)},
        bad={"lr": -1.0, "b1": 1.0, "d0": 0.0, "b3": 1.0}, lr=1.0, label=label)


def _warmup_f64(h):
    """optax's warmup_steps (warmup_constant_schedule from 0), in float64: optax computes that
    schedule in float32 (test_schedule_free_warmup_differs_only_in_float32 checks it)."""
    if not h["warmup_steps"]:
        return h["lr"]
    return lambda count: h["lr"] * jnp.minimum(jnp.asarray(count, jnp.float64)
                                               / h["warmup_steps"], 1.0)


def _schedule_free_case(label, **h):
    hypers = dict(lr=0.02, warmup_steps=0.0, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1,
                  weight_lr_power=1.5)
    hypers.update(h)
    return Case(
        "schedule_free_adamw", hypers,
        optax=lambda h: optax.contrib.schedule_free_adamw(
            _warmup_f64(h), b1=h["b1"], b2=h["b2"],
            eps=h["eps"], weight_decay=h["weight_decay"],
            weight_lr_power=h["weight_lr_power"]),
        optax_state={"z": lambda s: s.z, "nu": lambda s: s.base_optimizer_state[0].nu,
                     "weight_sum": _each_leaf(lambda s: s.weight_sum),
                     "max_lr": _each_leaf(lambda s: s.max_lr)},
        bad={"lr": -1.0, "b1": 0.0, "b2": 1.0, "warmup_steps": -1.0}, label=label)


def _float64_scalars(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` stepping with float64 as torch's default dtype, in which torch keeps a step's
    own scalars (NAdam's mu_product; float32 otherwise, against float64 parameters)."""
    step = opt.step

    def stepped(*args, **kwargs):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return step(*args, **kwargs)
        finally:
            torch.set_default_dtype(old)
    opt.step = stepped
    return opt


def _nadam_case(label, **h):
    hypers = dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1, momentum_decay=0.05,
                  decoupled_weight_decay=False)
    hypers.update(h)
    return Case(
        "nadam", hypers,
        torch=lambda ps, h: _float64_scalars(torch.optim.NAdam(
            ps, lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
            weight_decay=h["weight_decay"], momentum_decay=h["momentum_decay"],
            decoupled_weight_decay=h["decoupled_weight_decay"], foreach=False)),
        torch_state={"m": "exp_avg", "v": "exp_avg_sq", "mu_product": "mu_product"},
        bad={**ADAM_LIKE_BAD, "momentum_decay": -1.0}, label=label)


CASES = [
    # optax's eps convention (after the bias correction); b2 = 0.95 rectifies from step 6 on,
    # so both branches run within 20 steps
    Case("radam", dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-3),
         optax=lambda h: optax.radam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"]),
         optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
         bad=ADAM_LIKE_BAD),
    # torch.optim.RAdam adds eps to sqrt(nu) before the bias correction (sqrt(1 - b2^t) /
    # (sqrt(nu) + eps)), unlike optax and vega: the two agree only at eps = 0, so torch is
    # an oracle for that setting only (see test_radam_torch_eps_differs)
    Case("radam", dict(lr=0.02, b1=0.8, b2=0.95, eps=0.0),
         optax=lambda h: optax.radam(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"]),
         optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
         torch=lambda ps, h: torch.optim.RAdam(ps, lr=h["lr"], betas=(h["b1"], h["b2"]),
                                               eps=h["eps"], foreach=False),
         torch_state={"mu": "exp_avg", "nu": "exp_avg_sq"}, label="eps0"),
    Case("lamb", dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1),
         optax=lambda h: optax.lamb(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                    weight_decay=h["weight_decay"]),
         optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
         bad=ADAM_LIKE_BAD),
    *[Case("lars", dict(lr=0.5, weight_decay=0.05, trust_coefficient=0.02, eps=1e-3,
                        momentum=0.8, nesterov=nesterov),
           optax=lambda h: optax.lars(h["lr"], weight_decay=h["weight_decay"],
                                      trust_coefficient=h["trust_coefficient"], eps=h["eps"],
                                      momentum=h["momentum"], nesterov=h["nesterov"]),
           optax_state={"v": lambda s: s[-1].trace},
           bad={"lr": -1.0, "momentum": -0.1, "trust_coefficient": -1e-3}, lr=5.0,
           label="nesterov" if nesterov else "")
      for nesterov in (False, True)],
    Case("lion", dict(lr=0.01, b1=0.8, b2=0.95, weight_decay=0.1),
         optax=lambda h: optax.lion(h["lr"], b1=h["b1"], b2=h["b2"],
                                    weight_decay=h["weight_decay"]),
         optax_state={"m": lambda s: s[0].mu},
         bad={"lr": -1e-4, "b1": 1.5, "b2": 1.0}, lr=1e-3),
    # optax puts eps inside the square root and starts the sum at 0.1: with eps = 0 and the
    # same initial value it is the same rule; lr_decay as an optax schedule, weight_decay
    # (L2, torch's) as add_decayed_weights before it
    Case("adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1,
                         initial_accumulator_value=0.2, eps=0.0),
         optax=lambda h: optax.chain(
             optax.add_decayed_weights(h["weight_decay"]),
             optax.adagrad(_adagrad_lr(h), initial_accumulator_value=h[
                 "initial_accumulator_value"], eps=h["eps"])),
         optax_state={"acc": lambda s: s[1][0].sum_of_squares},
         torch=lambda ps, h: torch.optim.Adagrad(
             ps, lr=h["lr"], lr_decay=h["lr_decay"], weight_decay=h["weight_decay"],
             initial_accumulator_value=h["initial_accumulator_value"], eps=h["eps"],
             foreach=False),
         torch_state={"acc": "sum"},
         bad={"lr": -0.1, "initial_accumulator_value": -0.1, "eps": -1.0}, lr=0.05),
    # where eps goes: a large eps outside the square root, as torch.optim.Adagrad (optax
    # would need it inside)
    Case("adagrad", dict(lr=0.1, lr_decay=0.05, weight_decay=0.1,
                         initial_accumulator_value=0.0, eps=0.3),
         torch=lambda ps, h: torch.optim.Adagrad(
             ps, lr=h["lr"], lr_decay=h["lr_decay"], weight_decay=h["weight_decay"],
             initial_accumulator_value=h["initial_accumulator_value"], eps=h["eps"],
             foreach=False),
         torch_state={"acc": "sum"}, label="eps"),
    *[_rmsprop_case(momentum, centered) for momentum in (0.0, 0.7) for centered in (False, True)],
    # vega's Adan (the official code's b2 * diff) against its transcription
    Case("adan", dict(lr=0.01, b1=0.9, b2=0.8, b3=0.95, eps=1e-3, weight_decay=0.1),
         reference=adan_official,
         bad={"lr": -1e-3, "b1": 1.0, "b2": -0.5, "b3": 2.0}),
    # at b2 = 0.5 the official code's b2 * diff equals optax's (1 - b2) * diff: optax is an
    # oracle for that setting, and a check of the transcription above
    Case("adan", dict(lr=0.01, b1=0.9, b2=0.5, b3=0.95, eps=1e-3, weight_decay=0.1),
         optax=lambda h: optax.adan(h["lr"], b1=h["b1"], b2=h["b2"], b3=h["b3"], eps=h["eps"],
                                    eps_root=0.0, weight_decay=h["weight_decay"]),
         optax_state={"m": lambda s: s[0].m, "v": lambda s: s[0].v, "n": lambda s: s[0].n,
                      "g_prev": lambda s: s[0].g},
         reference=adan_official, label="b2half"),
    # the 5x7 matrix factored (min_dim_size_to_factor 4), the vector and scalar not;
    # clipping active (threshold 0.5), momentum, weight decay, parameter scale
    _adafactor_case("factored"),
    # not factored; the relative step size min(lr, 1/sqrt(t)) switches at t = 4
    _adafactor_case("relative", lr=0.5, factored=False, multiply_by_parameter_scale=False,
                    relative_step=True, use_momentum=False, decay_offset=0.0),
    # factored with the parameter scale's floor reached by the zero vector, no momentum,
    # and a decay offset
    _adafactor_case("offset", decay_offset=0.5, param_scale_min=0.2, use_momentum=False,
                    clipping_threshold=float("inf")),
    # torch and optax agree (eps inside the max); optax has no weight decay of its own
    Case("adamax", dict(lr=0.01, b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1),
         optax=lambda h: optax.chain(optax.add_decayed_weights(h["weight_decay"]),
                                     optax.adamax(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"])),
         optax_state={"m": lambda s: s[1][0].mu, "u": lambda s: s[1][0].nu},
         torch=lambda ps, h: torch.optim.Adamax(ps, lr=h["lr"], betas=(h["b1"], h["b2"]),
                                                eps=h["eps"], weight_decay=h["weight_decay"],
                                                foreach=False),
         torch_state={"m": "exp_avg", "u": "exp_inf"}, bad=ADAM_LIKE_BAD),
    Case("adadelta", dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1),
         optax=lambda h: optax.adadelta(h["lr"], rho=h["rho"], eps=h["eps"],
                                        weight_decay=h["weight_decay"]),
         optax_state={"v": lambda s: s[1].e_g, "acc": lambda s: s[1].e_x},
         torch=lambda ps, h: torch.optim.Adadelta(ps, lr=h["lr"], rho=h["rho"], eps=h["eps"],
                                                  weight_decay=h["weight_decay"],
                                                  foreach=False),
         torch_state={"v": "square_avg", "acc": "acc_delta"},
         bad={"lr": -1.0, "rho": 1.5, "eps": -1e-6}, lr=1.0),
    # step sizes hit both clamps within 20 steps (0.02 * 1.5^k passes 0.3; 0.4^k passes 1e-3)
    Case("rprop", dict(lr=0.02, etaminus=0.4, etaplus=1.5, step_size_min=1e-3,
                       step_size_max=0.3),
         torch=lambda ps, h: torch.optim.Rprop(ps, lr=h["lr"], etas=(h["etaminus"], h["etaplus"]),
                                               step_sizes=(h["step_size_min"],
                                                           h["step_size_max"]),
                                               foreach=False),
         torch_state={"g_prev": "prev", "step_size": "step_size"},
         bad={"lr": -1.0, "etaminus": 1.0, "etaplus": 0.9}, lr=1e-3),
    Case("yogi", dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-2, initial_accumulator_value=1e-3),
         optax=lambda h: optax.chain(
             optax.scale_by_yogi(b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                 initial_accumulator_value=h["initial_accumulator_value"]),
             optax.scale_by_learning_rate(h["lr"])),
         optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
         bad={**ADAM_LIKE_BAD, "initial_accumulator_value": -1.0}),
    Case("adabelief", dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-6, eps_root=1e-8),
         optax=lambda h: optax.adabelief(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                         eps_root=h["eps_root"]),
         optax_state={"mu": lambda s: s[0].mu, "s": lambda s: s[0].nu},
         bad=ADAM_LIKE_BAD),
    Case("adam_atan2", dict(lr=0.02, b1=0.8, b2=0.95, weight_decay=0.1, a=1.5, b=2.0),
         reference=adam_atan2_paper, bad={**ADAM_LIKE_BAD, "a": -1.0}),
    *[Case("adopt", dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-3, nesterov=nesterov,
                         use_clipping=clip),
           optax=lambda h: optax.contrib.adopt(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                               nesterov=h["nesterov"],
                                               use_clipping=h["use_clipping"]),
           optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
           bad=ADAM_LIKE_BAD, label=label)
      for nesterov, clip, label in ((False, True, ""), (True, False, "nesterov-noclip"))],
    Case("ademamix", dict(lr=0.02, b1=0.8, b2=0.95, b3=0.99, alpha=3.0, eps=1e-3,
                          weight_decay=0.1),
         optax=lambda h: optax.contrib.ademamix(h["lr"], b1=h["b1"], b2=h["b2"], b3=h["b3"],
                                                alpha=h["alpha"], eps=h["eps"],
                                                weight_decay=h["weight_decay"]),
         optax_state={"m1": lambda s: s[0].m1, "m2": lambda s: s[0].m2,
                      "nu": lambda s: s[0].nu},
         bad={**ADAM_LIKE_BAD, "b3": 1.0, "alpha": -1.0}),
    # d grows within 20 steps (test_prodigy_estimate_grows); b3 = -1 is sqrt(b2)
    _prodigy_case(""),
    _prodigy_case("b3-safeguard", b3=0.9, safeguard_warmup=True),
    _schedule_free_case(""),
    # the warmup's schedule read at t for the weights and t - 1 for the base step
    _schedule_free_case("warmup", warmup_steps=5.0),
    Case("novograd", dict(lr=0.02, b1=0.8, b2=0.5, eps=1e-3, eps_root=1e-4, weight_decay=0.1),
         optax=lambda h: optax.novograd(h["lr"], b1=h["b1"], b2=h["b2"], eps=h["eps"],
                                        eps_root=h["eps_root"],
                                        weight_decay=h["weight_decay"]),
         optax_state={"mu": lambda s: s[0].mu, "nu": lambda s: s[0].nu},
         bad=ADAM_LIKE_BAD),
    _nadam_case(""),
    _nadam_case("decoupled", decoupled_weight_decay=True),
    Case("dadapt_adamw", dict(lr=0.5, b1=0.8, b2=0.95, eps=1e-6, d0=1e-3, weight_decay=0.1),
         optax=lambda h: optax.contrib.dadapt_adamw(
             h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"], estim_lr0=h["d0"],
             weight_decay=h["weight_decay"]),
         optax_state={"mu": lambda s: s.exp_avg, "nu": lambda s: s.exp_avg_sq,
                      "s": lambda s: s.grad_sum, "d": _each_leaf(lambda s: s.estim_lr),
                      "num": _each_leaf(lambda s: s.numerator_weighted)},
         bad={"lr": -1.0, "b1": 1.0, "d0": 0.0}, lr=1.0),
    # Newton-Schulz in float64 (bf16 = false): torch's step written out, with Nesterov and
    # without, and the RMS-matching scale; optax's where the two rules meet
    *[Case("muon", dict(lr=0.02, weight_decay=0.05, momentum=0.9, a=3.0, b=-3.2, c=1.2,
                        eps=1e-3, ns_steps=4.0, adam_lr=0.01, adam_b1=0.8, adam_b2=0.95,
                        adam_eps=1e-3, adam_weight_decay=0.05, nesterov=nesterov,
                        match_rms_adamw=rms, bf16=False),
           reference=muon_torch_float64, bad={"lr": -1.0, "momentum": 1.0, "ns_steps": 17.0},
           label=label)
      for nesterov, rms, label in ((True, False, "torch"), (False, True, "torch-plain-rms"))],
    Case("muon", dict(lr=0.02, weight_decay=0.05, momentum=0.9, a=3.0, b=-3.2, c=1.2,
                      eps=0.0, ns_steps=4.0, adam_lr=0.01, adam_b1=0.8, adam_b2=0.95,
                      adam_eps=0.0, adam_weight_decay=0.05, nesterov=False,
                      match_rms_adamw=False, bf16=False),
         reference=muon_optax_transposed, label="optax"),
]

SPECS = ["radam", "lamb", "lars", "lion", "adagrad", "rmsprop", "adan", "adafactor", "adamax",
         "adadelta", "rprop", "yogi", "adabelief", "adam_atan2", "adopt", "ademamix",
         "prodigy", "schedule_free_adamw", "novograd", "nadam", "muon", "dadapt_adamw"]


def _cases(attr):
    return [pytest.param(c, id=c.id) for c in CASES if getattr(c, attr)]


def _first_case_per_spec():
    seen = {}
    for c in CASES:
        seen.setdefault(c.spec, c)
    return [pytest.param(c, id=c.spec) for c in seen.values()]


# -- trajectories --------------------------------------------------------------------------

def vega_functional(case: Case, steps: int = STEPS) -> list[dict]:
    opt = vega.builtin(case.spec)
    params = make_params()
    state = opt.init(params, **case.hypers)
    out = []
    for k in range(steps):
        params, state = opt.step(params, make_grads(k), state, **case.hypers)
        assert int(state["step"]) == k + 1
        snap = {f"p.{n}": v for n, v in params.items()}
        for f, tree in state.items():
            if f != "step":
                snap.update({f"{f}.{n}": v for n, v in tree.items()})
        out.append(snap)
    return out


def optax_run(case: Case, steps: int = STEPS) -> list[dict]:
    return optax_trajectory(case.optax(case.hypers), case.optax_state, make_params(),
                            make_grads, steps)


def optax_trajectory(tx, getters: dict, start: dict, grads_at, steps: int) -> list[dict]:
    """Snapshots {"p.w": ..., "<field>.w": ...} of ``tx`` stepped from ``start`` with
    ``grads_at(k)``; ``getters`` map vega's state fields to optax's state trees."""
    params = {n: jnp.asarray(v.numpy()) for n, v in start.items()}
    state = tx.init(params)
    out = []
    for k in range(steps):
        grads = {n: jnp.asarray(v.numpy()) for n, v in grads_at(k).items()}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        snap = {f"p.{n}": v for n, v in params.items()}
        for f, get in getters.items():
            snap.update({f"{f}.{n}": v for n, v in get(state).items()})
        out.append(snap)
    return out


def compare(actual: list[dict], expected: list[dict], oracle: str):
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert e, "empty snapshot"
        for key, value in e.items():
            assert key in a, f"vega has no {key} to compare with {oracle}'s"
            assert_close(a[key], value, f"{key} against {oracle}", k + 1)


# -- tests ---------------------------------------------------------------------------------

def test_every_zoo_spec_has_a_case():
    names = set(vega.builtin_names())
    assert set(SPECS) <= names, f"missing specs: {set(SPECS) - names}"
    assert {c.spec for c in CASES} == set(SPECS)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_hypers_are_not_defaults(case):
    defaults = vega.builtin(case.spec).defaults
    assert set(case.hypers) == set(defaults), "each case sets every hyperparameter"
    assert "lr" in case.hypers and case.hypers["lr"] != defaults["lr"]


@pytest.mark.parametrize("case", _cases("optax"))
def test_matches_optax(case):
    compare(vega_functional(case), optax_run(case), "optax")


@pytest.mark.parametrize("case", _cases("reference"))
def test_matches_reference(case):
    compare(vega_functional(case), case.reference(make_params(), make_grads, case.hypers, STEPS),
            "the hand-written reference")


@pytest.mark.parametrize("case", _cases("torch"))
def test_matches_torch(case):
    """vega's torch.optim class against torch.optim's, on the same float64 tensors."""
    start = make_params()
    ours = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    theirs = {n: torch.nn.Parameter(v.clone()) for n, v in start.items()}
    opt = vega.builtin(case.spec).optimizer(list(ours.values()), **case.hypers)
    ref = case.torch(list(theirs.values()), case.hypers)
    for k in range(STEPS):
        grads = make_grads(k)
        for n in start:
            ours[n].grad = grads[n].clone()
            theirs[n].grad = grads[n].clone()
        opt.step()
        ref.step()
        for n in start:
            assert_close(ours[n], theirs[n], f"p.{n} against torch", k + 1)
            for f, key in case.torch_state.items():
                assert_close(opt.state[ours[n]][f], ref.state[theirs[n]][key],
                             f"{f}.{n} against torch's {key}", k + 1)
            assert int(opt.state[ours[n]]["step"]) == k + 1


def test_radam_torch_eps_differs():
    """torch.optim.RAdam's eps is not optax's (nor vega's): with eps != 0 they part."""
    h = dict(lr=0.02, b1=0.8, b2=0.95, eps=1e-3)
    p = torch.nn.Parameter(make_params()["w"].clone())
    ref = torch.optim.RAdam([p], lr=h["lr"], betas=(h["b1"], h["b2"]), eps=h["eps"],
                            foreach=False)
    opt = vega.builtin("radam")
    params = {"w": make_params()["w"]}
    state = opt.init(params, **h)
    for k in range(STEPS):
        p.grad = make_grads(k)["w"].clone()
        ref.step()
        params, state = opt.step(params, {"w": make_grads(k)["w"]}, state, **h)
    assert not torch.allclose(params["w"], p.detach(), rtol=1e-6, atol=0)


def test_radam_torch_threshold_differs_where_rho_t_is_5():
    """At eps = 0 vega's RAdam parts from torch's only at a step whose rho_t is exactly 5
    (vega rectifies at rho_t >= 5, torch at rho_t > 5): b2 = 1 - 1e-12 gives rho_3 = 5.0."""
    start = make_params()["w"]
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = vega.optim.RAdam([ours], lr=0.1, b2=1 - 1e-12, eps=0.0)
    ref = torch.optim.RAdam([theirs], lr=0.1, betas=(0.9, 1 - 1e-12), eps=0.0, foreach=False)
    for k in range(3):
        ours.grad = make_grads(k)["w"].clone()
        theirs.grad = make_grads(k)["w"].clone()
        before = ours.detach().clone()
        opt.step()
        ref.step()
        if k < 2:
            assert_close(ours, theirs, "p.w against torch", k + 1)
    assert (ours.detach() - before).abs().max() < 1e-5 < (theirs.detach() - before).abs().max()


@pytest.mark.parametrize("case", _first_case_per_spec())
def test_trains_demo_model(case):
    torch.manual_seed(0)
    x, y = spirals()
    net = model(0)
    opt = vega.builtin(case.spec).optimizer(net.parameters(), lr=case.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        initial = loss_fn(net(x), y).item()
    for _ in range(60):
        loss = loss_fn(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = loss_fn(net(x), y).item()
    assert final < initial, f"{case.spec}: loss {initial:.4f} -> {final:.4f}"


def _bad_values():
    seen = set()
    for c in CASES:
        for name, value in c.bad.items():
            if (c.spec, name) not in seen:
                seen.add((c.spec, name))
                yield pytest.param(c.spec, name, value, id=f"{c.spec}-{name}")


@pytest.mark.parametrize("spec,name,value", list(_bad_values()))
def test_rejects_out_of_range(spec, name, value):
    opt = vega.builtin(spec)
    params = make_params()
    match = rf"\b{name}={value!r}"
    with pytest.raises(ValueError, match=match):
        opt.init(params, **{name: value})
    state = opt.init(params)
    with pytest.raises(ValueError, match=match):
        opt.step(params, make_grads(0), state, **{name: value})
    with pytest.raises(ValueError, match=match):
        opt.optimizer([torch.nn.Parameter(params["w"])], **{name: value})



@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES
                                  if c.spec in ("prodigy", "dadapt_adamw")])
def test_prodigy_estimate_grows_on_a_quadratic(case):
    """On a quadratic (the gradient 2 (p - 1) of each side's own parameters) Prodigy's
    and D-Adaptation's estimate d grows, by the maximum of the group's sums, as optax's
    estim_lr does."""
    opt = vega.builtin(case.spec)
    params = make_params()
    state = opt.init(params, **case.hypers)
    tx = case.optax(case.hypers)
    theirs = {n: jnp.asarray(v.numpy()) for n, v in params.items()}
    ostate = tx.init(theirs)
    for k in range(STEPS):
        params, state = opt.step(params, {n: 2 * (v - 1) for n, v in params.items()}, state,
                                 **case.hypers)
        updates, ostate = tx.update({n: 2 * (v - 1) for n, v in theirs.items()}, ostate,
                                    theirs)
        theirs = optax.apply_updates(theirs, updates)
        for n in params:
            assert_close(params[n], theirs[n], f"p.{n} against optax", k + 1)
            assert_close(state["d"][n], ostate.estim_lr, f"d.{n} against optax", k + 1)
    assert float(state["d"]["w"]) > 10 * case.hypers["d0"]


@pytest.mark.parametrize("name", ["prodigy", "dadapt_adamw"])
@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_step_of_zero_gradients_keeps_the_estimate(name, backend):
    """Where every gradient until then is 0, the group's |s|_1 is 0: d is kept and the step
    moves nothing, as the authors' implementations skip it (optax's d is 0 / 0, NaN, and so
    is every parameter after it, for good); the steps after it adapt d as usual."""
    spec = vega.builtin(name)
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=torch.float64))
    opt = getattr(vega.optim, spec.class_name)([p], backend=backend)
    before = p.detach().clone()
    p.grad = torch.zeros(6, dtype=torch.float64)
    opt.step()
    assert torch.equal(p.detach(), before)
    assert float(opt.state[p]["d"]) == 1e-6 and int(opt.state[p]["step"]) == 1
    for _ in range(20):
        p.grad = 2 * (p.detach() - 1)
        opt.step()
    assert torch.isfinite(p).all() and float(opt.state[p]["d"]) > 1e-5


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_adopt_at_eps_0_reads_no_update_at_its_first_step(clip, backend):
    """ADOPT's first step only records g^2; it read g / max(sqrt(nu), eps) at nu = 0 all
    the same and multiplied it by 1 - b1 = 0: at eps = 0 (in its range) that was g / 0,
    so that 0 * inf made mu NaN in every element without clipping, and in every element
    whose first gradient was 0 with it (0 / 0), for good (optax's too). It steps as optax
    at an eps too small to matter, where optax's is finite."""
    g0 = torch.tensor([1.0, 0.0, -2.0, 0.5, 3.0, 0.0], dtype=torch.float64)
    if not clip:
        g0 = g0 + (g0 == 0)  # (optax's step 2 divides by |g0|: finite where g0 is not 0)
    grads = [g0] + [torch.linspace(-1, 2, 6, dtype=torch.float64) * k for k in (1, 2, 3)]
    h = dict(lr=0.02, b1=0.8, b2=0.95, nesterov=not clip, use_clipping=clip)
    params = {"w": torch.ones(6, dtype=torch.float64)}
    state = vega.adopt_init(params)
    tx = optax.contrib.adopt(h["lr"], b1=h["b1"], b2=h["b2"], eps=1e-300,
                             nesterov=h["nesterov"], use_clipping=clip)
    theirs = jnp.ones(6, dtype=jnp.float64)
    ostate = tx.init(theirs)
    for g in grads:
        params, state = vega.adopt_step(params, {"w": g}, state, eps=0.0, backend=backend,
                                        **h)
        update, ostate = tx.update(jnp.asarray(g.numpy()), ostate, theirs)
        theirs = optax.apply_updates(theirs, update)
        assert torch.isfinite(state["mu"]["w"]).all(), state["mu"]["w"]
        assert_close(params["w"], theirs, "p.w against optax", int(state["step"]))


def test_schedule_free_warmup_differs_only_in_float32():
    """optax's own warmup_steps computes its schedule in float32: against the float64
    schedule of the comparison, its trajectory parts at float32's precision, no further."""
    case = next(c for c in CASES if c.id == "schedule_free_adamw-warmup")
    h = case.hypers
    alias = optax.contrib.schedule_free_adamw(
        h["lr"], warmup_steps=int(h["warmup_steps"]), b1=h["b1"], b2=h["b2"], eps=h["eps"],
        weight_decay=h["weight_decay"], weight_lr_power=h["weight_lr_power"])
    ours = optax_run(case)
    theirs = optax_trajectory(alias, case.optax_state, make_params(), make_grads, STEPS)
    worst = max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k]))
                             / (np.abs(np.asarray(b[k])) + 1e-3)))
                for a, b in zip(ours, theirs) for k in b)
    assert 1e-12 < worst < 1e-5, worst


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES
                                  if c.spec == "schedule_free_adamw"])
def test_schedule_free_eval_params_match_optax(case):
    """Mode eval (vega.schedule_free_adamw.mode) against optax's schedule_free_eval_params,
    at every step; the class's eval() and train() the same, and back."""
    opt = vega.builtin("schedule_free_adamw")
    params = make_params()
    state = opt.init(params, **case.hypers)
    tx = case.optax(case.hypers)
    theirs = {n: jnp.asarray(v.numpy()) for n, v in params.items()}
    ostate = tx.init(theirs)
    net = {n: torch.nn.Parameter(v.clone()) for n, v in params.items()}
    cls = opt.optimizer(list(net.values()), **case.hypers)
    for k in range(STEPS):
        grads = make_grads(k)
        params, state = opt.step(params, grads, state, **case.hypers)
        updates, ostate = tx.update({n: jnp.asarray(v.numpy()) for n, v in grads.items()},
                                    ostate, theirs)
        theirs = optax.apply_updates(theirs, updates)
        want = optax.contrib.schedule_free_eval_params(ostate, theirs)
        got = opt.mode("eval", params, state, **case.hypers)
        for n in params:
            assert_close(got[n], want[n], f"eval p.{n} against optax", k + 1)
        for n, p in net.items():
            p.grad = grads[n].clone()
        cls.step()
        cls.eval()
        for n, p in net.items():
            assert_close(p, want[n], f"class eval p.{n} against optax", k + 1)
        cls.train()
        for n, p in net.items():
            assert_close(p, theirs[n], f"class train p.{n} against optax", k + 1)


@pytest.mark.parametrize("shape, bound", [((32, 32), 1.0), ((64, 64), 1.0), ((64, 256), 2.2),
                                          ((256, 64), 2.2)])
def test_muon_bfloat16_iteration_is_about_as_close_to_float64_as_torchs(shape, bound):
    """Muon's update in bfloat16 (lr 1, no momentum, no decay: the iteration's result, from
    four random gradients), its distance from the float64 iteration against torch.optim.
    Muon's: a and b, given as numbers, are torch.addmm's exact beta, and c its exact alpha,
    in the steps as written (square matrices: torch's distance, the iteration torch's to
    the bit; with c * A rounded to bfloat16 first, 1.1x) and in the Gram form's products
    (wide and tall: within 2.2x; its P is formed once a run). Added on the diagonal in
    bfloat16, where they round, the distance was about 3.5x torch's; and a's digits past
    bfloat16's changed nothing."""
    h = dict(lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)
    opt = vega.builtin("muon")
    ours = theirs = 0.0
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        p, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        new, _ = opt.step([p], [g], opt.init([p]), **h)
        w = torch.nn.Parameter(p.clone())
        torch_opt = torch.optim.Muon([w], lr=1.0, weight_decay=0.0, momentum=0.0,
                                     nesterov=False)
        w.grad = g.clone()
        torch_opt.step()
        x = g.double() if shape[0] <= shape[1] else g.double().T
        x = x / x.norm()
        for _ in range(5):
            a = x @ x.T
            x = 3.4445 * x + (-4.775 * a + 2.0315 * a @ a) @ x
        x = x if shape[0] <= shape[1] else x.T

        def far(u):
            u = u.double()
            return float((u / u.norm() - x / x.norm()).norm())
        ours += far(p - new[0])
        theirs += far(p - w.detach())
        if seed == 0:  # a's digits past bfloat16's count
            other, _ = opt.step([p], [g], opt.init([p]), a=3.4375, **h)
            assert not torch.equal(other[0], new[0])
    assert ours <= bound * theirs, (ours, theirs)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muons_iteration_as_written_is_torchs_to_the_bit(nesterov):
    """Where the Newton-Schulz steps keep their form (square matrices, and a side up to 1.5
    times the other), vega's bfloat16 iteration is torch.optim.Muon's bit for bit: the same
    rounding to bfloat16 and norm, and each product torch.addmm with a and b its exact beta
    and c its exact alpha (``reference.fuse_products``). With lr 1, no momentum and no
    decay, the parameters after 3 steps are torch's to the bit (float32, rows up to
    columns: the scale is 1), two matrices of one shape stepped side by side (one batched
    product, ``render_batched``) among them."""
    h = dict(lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=nesterov)
    gen = torch.Generator().manual_seed(8)
    shapes = {"s": (40, 40), "t": (40, 40), "w": (48, 64)}
    ours = {k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()}
    theirs = {k: torch.nn.Parameter(p.detach().clone()) for k, p in ours.items()}
    opt = vega.optim.Muon(list(ours.values()), **h)
    ref = torch.optim.Muon(list(theirs.values()), **h)
    for _ in range(3):
        for k, p in ours.items():
            p.grad = torch.randn(p.shape, generator=gen)
            theirs[k].grad = p.grad.clone()
        opt.step()
        ref.step()
    for k in shapes:
        assert torch.equal(ours[k].detach(), theirs[k].detach()), k


def test_a_product_factor_is_exact_only_where_a_number_gives_what_a_tensor_gives():
    """A hyperparameter that is a product's factor (``c``, the alpha of ``B``'s product) and
    is used elsewhere too reaches every use as a 0-d tensor, given as a number or not (a
    float32 0-d tensor times a bfloat16 matrix rounds to bfloat16 first, a number does
    not). Factors of 0, or past float32's range, given as numbers, step as the tensors
    would, NaN and all (torch.addmm ignores an operand times 0, its NaN too, and refuses
    1e39)."""
    text = """
    optimizer o(lr = 1.0, b = -4.775, c = 2.0315) {
        x = bfloat16(g)
        A = x @ transpose(x)
        B = b * A + c * A @ A
        p = p - widen(B @ x)OTHER
    }"""
    gen = torch.Generator().manual_seed(2)
    p, g = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    spec = vega.compile(text.replace("OTHER", " - widen(c * x)"))
    number, _ = spec.step([p], [g], spec.init([p]), c=2.0315)
    tensor, _ = spec.step([p], [g], spec.init([p]), c=torch.tensor(2.0315))
    assert torch.equal(number[0], tensor[0])
    g[0, 0] = float("inf")
    for x in ("bfloat16(g)", "g"):  # (float32's addmm drops a NaN times 0; bfloat16's not)
        spec = vega.compile(text.replace("OTHER", "").replace("bfloat16(g)", x).replace(
            "widen(B @ x)", "widen(B @ x)" if x != "g" else "B @ x"))
        for b, c in ((0.0, 0.0), (1e39, 1e39), (-4.775, 1e39)):
            number, _ = spec.step([p], [g], spec.init([p]), b=b, c=c)
            tensor, _ = spec.step([p], [g], spec.init([p]), b=torch.tensor(b),
                                  c=torch.tensor(c))
            assert torch.equal(number[0].isnan(), tensor[0].isnan()), (x, b, c)
            assert torch.equal(number[0].nan_to_num(), tensor[0].nan_to_num()), (x, b, c)


def test_muon_steps_alike_whether_or_not_a_hyperparameter_is_scheduled():
    """A schedule among the hyperparameters (``lr``) gives every tensor its values from a
    table; a and b, given as numbers, stay numbers there, the products' exact beta: the
    step is bitwise the one without a schedule."""
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)
    steps = [vega.muon_step([p], [g], vega.muon_init([p]), lr=lr)[0][0]
             for lr in (1e-2, vega.schedule.constant(1e-2), lambda t: 1e-2)]
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[0], steps[2])


def test_muon_bf16_against_torch():
    """With bf16 (the default), the Newton-Schulz iteration runs in bfloat16 as
    torch.optim.Muon's: with momentum, the two agree to bfloat16's precision, not bitwise
    (torch's momentum is a lerp, vega's a sum of products; and 24x16 is in the Gram form),
    each as far from the float64 iteration as from the other
    (``test_muons_iteration_as_written_is_torchs_to_the_bit`` takes the iteration alone).
    (Two matrices of one shape: their products batched.)"""
    gen = torch.Generator().manual_seed(3)
    shapes = [(16, 24), (24, 16), (20, 20), (16, 24)]
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
             for _ in range(STEPS)]
    runs = {}
    for who in ("torch", "bf16", "float64"):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.Muon(ps, lr=0.02) if who == "torch" else \
            vega.optim.Muon(ps, lr=0.02, bf16=who == "bf16")
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        runs[who] = [p.detach() for p in ps]

    def apart(x, y):
        return max(float((a - b).abs().max()) for a, b in zip(runs[x], runs[y]))
    moved = max(float((a - b).abs().max()) for a, b in zip(runs["torch"], start))
    # 20 steps of lr 0.02 move each weight by up to ~0.4; bfloat16 keeps 8 bits
    assert moved > 0.1
    assert apart("bf16", "torch") < 0.05 * moved, apart("bf16", "torch")
    assert apart("float64", "torch") < 0.05 * moved
    assert apart("bf16", "float64") > 1e-4  # (the flag takes effect)


def muon_class_against_torch_float64(shapes: dict, seed: int) -> None:
    """vega.optim.Muon in float64 (``bf16 = false``) on parameters of ``shapes``, 20 steps of
    random gradients: after each, every parameter and momentum equal to torch's step
    written out in float64 (``muon_torch_float64``)."""
    gen = torch.Generator().manual_seed(seed)
    start = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
             for _ in range(STEPS)]
    h = dict(lr=0.02, weight_decay=0.05, momentum=0.9, a=3.0, b=-3.2, c=1.2, eps=1e-3,
             ns_steps=5.0, adam_lr=0.01, adam_b1=0.8, adam_b2=0.95, adam_eps=1e-3,
             adam_weight_decay=0.05, nesterov=True, match_rms_adamw=False, bf16=False)
    want = muon_torch_float64(start, lambda k: grads[k], h, STEPS)
    ps = {n: torch.nn.Parameter(p.clone()) for n, p in start.items()}
    opt = vega.optim.Muon(list(ps.values()), **h)
    for k in range(STEPS):
        for n, p in ps.items():
            p.grad = grads[k][n].clone()
        opt.step()
        for n, p in ps.items():
            assert_close(p.detach(), want[k][f"p.{n}"], f"p.{n}", k)
            if p.dim() == 2:
                assert_close(opt.state[p]["buf"], want[k][f"buf.{n}"], f"buf.{n}", k)


def test_muon_matrices_of_one_shape_against_torch_float64(monkeypatch):
    """Matrices of one shape in float64 (``bf16 = false``): each matrix's parameter and
    momentum are torch's step written out in float64, over 20 steps; their products are
    float64, so they step one by one (only bfloat16 products are batched: no tensor asks
    for a product side by side, nothing is stacked)."""
    from vega.codegen import reference
    batches = []
    real = reference._products
    monkeypatch.setattr(reference, "_products",
                        lambda asked, kept: batches.append(len(asked)) or real(asked, kept))
    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(len(ts)) or
                        real_stack(ts, *a, **k))
    muon_class_against_torch_float64({"w0": (6, 9), "w1": (6, 9), "w2": (6, 9), "t0": (9, 6),
                                      "t1": (9, 6), "v": (9,)}, 5)
    assert not batches and not stacked


def muon_class_steps(monkeypatch, start: list, grads: list, elements: int) -> list:
    """vega.optim.Muon (lr 0.02, its other defaults: bfloat16 products) from ``start``, a
    step for each list of ``grads``, up to ``elements`` values of a shape batched
    (``reference.BATCH_ELEMENTS``): the parameters."""
    from vega.codegen import reference
    monkeypatch.setattr(reference, "BATCH_ELEMENTS", elements)
    ps = [torch.nn.Parameter(p.clone()) for p in start]
    opt = vega.optim.Muon(ps, lr=0.02)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return ps


def test_muon_bfloat16_products_of_one_shape_are_one_batched_product(monkeypatch):
    """In bfloat16, the matrices of one shape take each product as one batched product of
    their stacked matrices: each stacked once a step (x; every square an iteration
    multiplies is a product's result, found again with its transpose, ``c`` taken as the
    products' alpha, not multiplied into ``A`` first). The step matches the step of one matrix at a time to bfloat16's
    rounding of the products."""
    gen = torch.Generator().manual_seed(6)
    shapes = [(6, 9), (6, 9), (6, 9), (9, 6), (9, 6), (9,)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]

    def run(elements):
        return muon_class_steps(monkeypatch, start, grads, elements)
    stacked = []
    real = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(
        (len(ts), ts[0].dtype)) or real(ts, *a, **k))
    batched = run(1 << 24)
    batches = list(stacked)
    alone = run(0)
    # 2 batches (3 wide, 2 tall), 5 steps: x alone (the shifts are addmm's beta, c its
    # alpha: no square made between the products)
    assert sorted(set(batches)) == [(2, torch.bfloat16), (3, torch.bfloat16)]
    assert len(batches) == 2 * 5 and len(stacked) == len(batches)
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(alone, start))
    for p, q in zip(batched, alone):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0.01 * moved)


def test_muon_wide_and_tall_matrices_in_the_gram_form_against_torch_float64(monkeypatch):
    """Where a matrix's longer side is more than 1.5 times its shorter one, the Newton-Schulz
    steps run in the Gram form (``vega.codegen.gram``): on the small Gram matrix, the
    matrix itself multiplied once a run (runs of 3 and 2 steps). The same function: in
    float64 each matrix's parameter and momentum are torch's step written out, 20 steps,
    with two products of the matrix's size a step where the iteration as written takes
    five."""
    products = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: products.append(
        tuple(a.shape[-2:]) + tuple(b.shape[-1:])) or real(a, b))
    muon_class_against_torch_float64({"w": (4, 12), "t": (12, 4), "s": (5, 5), "v": (12,)}, 8)
    # a step: R x, twice for each of the two 4 x 12 views; x x^T twice each (its restart)
    assert products.count((4, 4, 12)) == 2 * 2 * STEPS, products[:40]
    assert products.count((4, 12, 4)) == 2 * 2 * STEPS
    # the square as written: x x^T a step, its two products with a shift torch.addmm's
    assert products.count((5, 5, 5)) == 5 * STEPS


def test_muon_gram_form_in_bfloat16_is_as_close_to_float64_as_the_iteration_as_written(
        monkeypatch):
    """Muon's orthogonalization of one matrix in bfloat16 (lr 1, no momentum, no decay: the
    update is the iteration's result), against the float64 iteration: the Gram form's error
    at most the iteration as written's, and 5% more, on a nearly low-rank matrix and one of
    widely spread singular values; on a random one, 25% more (the iteration as written is
    torch.optim.Muon's to the bit, ``c`` its products' exact alpha: 0.0149 against the Gram
    form's 0.0178, where before both took ``c * A`` rounded, 0.0245 against 0.0214).
    (Without its restart, the Gram form's rounding grows without bound on the nearly
    low-rank one.)"""
    from vega.codegen import gram
    opt = vega.builtin("muon")
    h = dict(lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)

    def update(g, bf16):
        p = torch.zeros_like(g)
        new, _ = opt.step([p], [g], opt.init([p], bf16=bf16, **h), bf16=bf16, **h)
        return -new[0]
    gen = torch.Generator().manual_seed(9)
    m, n = 32, 128
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    cases = {"random": torch.randn(m, n, generator=gen),
             "low rank": torch.randn(m, 4, generator=gen) @ torch.randn(4, n, generator=gen)
             + 1e-3 * torch.randn(m, n, generator=gen),
             "spread": ((u * torch.logspace(-6, 0, m, dtype=torch.float64)) @ v.T).float()}
    for name, g in cases.items():
        exact = update(g.double(), False).float()
        errors = {}
        for form in ("gram", "written"):
            monkeypatch.setattr(gram.Gram, "pays", lambda self, rows, cols, f=form: f == "gram")
            errors[form] = float((update(g, True) - exact).norm() / exact.norm())
        assert errors["gram"] <= (1.25 if name == "random" else 1.05) * errors["written"], \
            (name, errors)
        assert errors["written"] > 1e-3  # (bfloat16's rounding is there to compare)


def test_muon_gram_form_of_matrices_of_one_shape_is_batched(monkeypatch):
    """bfloat16, three 4 x 16 matrices: each product of the Gram form is one batched product
    of the three (a stack of 3), as the iteration as written's are; the step matches the
    step of one matrix at a time to bfloat16's rounding of the products."""
    gen = torch.Generator().manual_seed(10)
    start = [torch.randn(4, 16, generator=gen) for _ in range(3)]
    grads = [[torch.randn(4, 16, generator=gen) for _ in range(3)] for _ in range(5)]
    batches = []
    for name in ("matmul", "baddbmm"):
        def recorded(*args, _fn=getattr(torch, name), **kwargs):
            out = _fn(*args, **kwargs)
            if out.dim() == 3:  # (a stack of matrices)
                batches.append(tuple(out.shape))
            return out
        monkeypatch.setattr(torch, name, recorded)

    def run(elements):
        return muon_class_steps(monkeypatch, start, grads, elements)
    batched = run(1 << 24)
    # a step: x x^T and R x a run (two runs), A^2 a Newton-Schulz step (five), P A and
    # (P A) P^T a step but a run's last (three), R's product a step but a run's first (three)
    assert set(batches) == {(3, 4, 4), (3, 4, 16)}, set(batches)
    assert batches.count((3, 4, 16)) == 2 * 5 and len(batches) == 5 * (4 + 5 + 2 * 3 + 3)
    batches.clear()
    alone = run(0)
    assert not batches
    moved = max(float((p.detach() - q).abs().max()) for p, q in zip(alone, start))
    for p, q in zip(batched, alone):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0.01 * moved)


def test_muon_takes_the_shorter_side_as_rows(monkeypatch):
    """The matrix view's rows are a matrix's shorter side, so x @ transpose(x) is the smaller
    Gram matrix for a tall and a wide matrix alike; the two updates are each other's
    transpose, up to torch's scale."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    g = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    opt = vega.builtin("muon")
    h = dict(bf16=False, lr=0.1, weight_decay=0.0)
    products = []
    for name in ("matmul", "addmm", "baddbmm"):
        def recorded(*args, _fn=getattr(torch, name), **kwargs):
            out = _fn(*args, **kwargs)
            products.append(tuple(out.shape[-2:]))
            return out
        monkeypatch.setattr(torch, name, recorded)
    wide, _ = opt.step([w], [g], opt.init([w], **h), **h)
    tall, _ = opt.step([w.T.contiguous()], [g.T.contiguous()], opt.init([w.T], **h), **h)
    # per iteration: the 6 x 6 Gram matrix, its square, then back to 6 x 9; never 9 x 9
    assert set(products) == {(6, 6), (6, 9)}, set(products)
    # (torch's scale sqrt(max(1, size0 / size1)) is the layout's: 1 wide, sqrt(1.5) tall)
    torch.testing.assert_close((tall[0].T - w) / 1.5 ** 0.5, wide[0] - w, rtol=1e-12,
                               atol=1e-12)
