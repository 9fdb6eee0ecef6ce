"""Features combined: a covering array of strength 2 over the classes' options.

Each option is tested on its own elsewhere; here every pair of values of two factors
meets in at least one row (a greedy covering array, fixed by its seed):

- the rule: eleven classes, Muon's matrices and Adafactor's factored ones among them;
- the parameters' dtype: float32, bfloat16 with master weights, float64, or a mix
  (a bfloat16 matrix with a master copy, a float32 vector, a float16 matrix);
- ``state_dtype``: None, bfloat16, 8 bits (tensors of 4,096 values and more; Muon and
  Adafactor refuse it, so those rows are left out);
- a fused option: none, ``max_grad_norm``, a dynamic loss scale with an overflow step,
  ``skip_nonfinite`` with one;
- ``lr``: a number, a tensor, a vega schedule, a torch LR scheduler;
- the groups: one, two with other hyperparameters, a parameter without a gradient at
  some steps;
- the life of the optimizer: plain, ``state_dict`` loaded into a fresh one mid-run, or a
  ``zero_grad(set_to_none=True)`` loop with gradients from ``backward``.

Each row holds the C backend to the reference at every step, on the parameters and on
every state tensor, and a resumed run to the uninterrupted one bit for bit.
"""
import copy
import itertools
import random

import pytest
import torch

import vega
from vega.codegen import c as c_backend

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="no C compiler")

HYPERS = {  # (the optimizer's, the second group's)
    "AdamW": ({"lr": 1e-2, "weight_decay": 0.1}, {"weight_decay": 0.0}),
    "Adam": ({"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}, {"amsgrad": False}),
    "SGD": ({"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"momentum": 0.0}),
    "Lion": ({"lr": 1e-3, "weight_decay": 0.1}, {"betas": (0.8, 0.9)}),
    "Adafactor": ({"lr": 1e-2, "min_dim_size_to_factor": 16}, {"use_momentum": True}),
    "LAMB": ({"lr": 1e-2, "weight_decay": 0.01}, {"weight_decay": 0.0}),
    "RMSprop": ({"lr": 1e-2, "momentum": 0.5, "centered": True}, {"alpha": 0.9}),
    "Adagrad": ({"lr": 1e-2, "weight_decay": 0.01}, {"lr_decay": 0.1}),
    "Muon": ({"lr": 1e-2}, {"nesterov": False, "ns_steps": 3}),
    "ScheduleFreeAdamW": ({"lr": 1e-2, "weight_decay": 0.01}, {"weight_decay": 0.0}),
    "Prodigy": ({"lr": 1.0, "weight_decay": 0.01}, {"weight_decay": 0.0}),
}
FACTORS = {
    "rule": list(HYPERS),
    "dtype": ["float32", "bfloat16+master", "float64", "mixed"],
    "state_dtype": [None, torch.bfloat16, torch.uint8],
    "fused": ["none", "clip", "scale", "skip"],
    "lr": ["number", "tensor", "schedule", "torch scheduler"],
    "groups": ["one", "two", "no grad"],
    "life": ["plain", "state_dict", "zero_grad"],
}
STEPS, BREAK = 4, 2
SHAPES = {"w": (64, 72), "b": (72,), "v": (72, 64)}  # (w, v: 8-bit; b: float32)


def allowed(row: dict) -> bool:
    """Muon's and Adafactor's matrices keep no 8-bit state (refused: test_quant.py)."""
    return not (row.get("rule") in ("Muon", "Adafactor")
                and row.get("state_dtype") is torch.uint8)


def covering_rows(seed: int = 0) -> list[dict]:
    """Rows in which every allowed pair of two factors' values meets at least once."""
    names = list(FACTORS)
    todo = {(a, x, b, y) for a, b in itertools.combinations(names, 2)
            for x in FACTORS[a] for y in FACTORS[b] if allowed({a: x, b: y})}
    rng = random.Random(seed)
    rows = []
    while todo:
        best, best_n = None, -1
        for _ in range(40):
            a, x, b, y = rng.choice(sorted(todo, key=repr))
            row = {n: rng.choice(FACTORS[n]) for n in names}
            row[a], row[b] = x, y
            if not allowed(row):
                continue
            n = sum(row[a] == x and row[b] == y for a, x, b, y in todo)
            if n > best_n:
                best, best_n = row, n
        rows.append(best)
        todo = {(a, x, b, y) for a, x, b, y in todo if not (best[a] == x and best[b] == y)}
    return rows


ROWS = covering_rows()


def make_params(row):
    dtypes = {"float32": dict.fromkeys(SHAPES, torch.float32),
              "bfloat16+master": dict.fromkeys(SHAPES, torch.bfloat16),
              "float64": dict.fromkeys(SHAPES, torch.float64),
              "mixed": {"w": torch.bfloat16, "b": torch.float32, "v": torch.float16}}
    gen = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)
                                  .to(dtypes[row["dtype"]][n])) for n, s in SHAPES.items()}


def make_optimizer(row, ps, backend):
    hypers, second = HYPERS[row["rule"]]
    hypers = dict(hypers)
    lr = hypers["lr"]
    if row["lr"] == "tensor":
        hypers["lr"] = torch.tensor(lr, dtype=torch.float64)
    elif row["lr"] == "schedule":
        hypers["lr"] = vega.schedule.linear(lr, lr / 4, 3)
    fused = {"none": {}, "clip": {"max_grad_norm": 0.5}, "skip": {"skip_nonfinite": True},
             "scale": {"loss_scale": vega.LossScale.dynamic(init=16.0, growth_interval=2)}}
    groups = [{"params": list(ps.values())}]
    if row["groups"] == "two":
        groups = [{"params": [ps["w"]]}, {"params": [ps["b"], ps["v"]], **second}]
    opt = getattr(vega.optim, row["rule"])(
        groups, backend=backend, state_dtype=row["state_dtype"],
        master_weights=row["dtype"] in ("bfloat16+master", "mixed"),
        **fused[row["fused"]], **hypers)
    sched = None
    if row["lr"] == "torch scheduler":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return opt, sched


def set_grads(row, opt, ps, k):
    scale = float(opt.loss_scale.loss_scale) if opt.loss_scale is not None else 1.0
    for n, p in ps.items():
        if row["groups"] == "no grad" and n == "v" and k in (1, 3):
            p.grad = None
            continue
        gen = torch.Generator().manual_seed(100 + 3 * k + len(n))
        g = 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if k == 2 and row["fused"] in ("scale", "skip") and n == "b":
            g[3] = float("inf")  # (a skipped step)
        g = (g * scale).to(p.dtype)
        if row["life"] == "zero_grad":
            assert p.grad is None
            (p * g).sum().backward()
        else:
            p.grad = g


def run(row, backend, resume=True):
    """Snapshots of the parameters, every state tensor and the loss scale, step by step."""
    ps = make_params(row)
    opt, sched = make_optimizer(row, ps, backend)
    snaps = []
    for k in range(STEPS):
        if row["life"] == "zero_grad":
            opt.zero_grad(set_to_none=True)
        set_grads(row, opt, ps, k)
        opt.step()
        if sched is not None:
            sched.step()
        snap = {}
        for n, p in ps.items():
            snap["p." + n] = p.detach().clone()
            for s, t in opt.state.get(p, {}).items():
                snap[f"{s}.{n}"] = t.clone()
        if opt.loss_scale is not None:
            snap["loss_scale"] = opt.loss_scale.loss_scale.clone()
        snaps.append(snap)
        if resume and row["life"] == "state_dict" and k + 1 == BREAK:
            saved = copy.deepcopy(opt.state_dict())
            saved_sched = copy.deepcopy(sched.state_dict()) if sched is not None else None
            ps = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ps.items()}
            opt, sched = make_optimizer(row, ps, backend)
            opt.load_state_dict(saved)
            if sched is not None:
                sched.load_state_dict(saved_sched)
    return snaps


def tolerance(row, dtype):
    """(rtol, atol relative to the tensor's largest value) of C against the reference.
    A rounding apart moves a bfloat16 or 8-bit state by a step of its own, which the
    following steps carry into float32 values (centered RMSprop's difference of two
    moments magnifies it)."""
    if dtype in (torch.bfloat16, torch.float16):
        return 1e-2, 1e-2
    if row["state_dtype"] is not None or row["dtype"] != "float64":
        return (1e-3, 1e-3) if row["state_dtype"] is not None else (1e-4, 1e-5)
    return 1e-10, 1e-12


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(map(str, r.values())))
def test_c_matches_the_reference_and_a_resumed_run_the_uninterrupted_one(row):
    ref, c = run(row, "reference"), run(row, "c")
    for k, (a, b) in enumerate(zip(c, ref), 1):
        assert a.keys() == b.keys(), f"step {k}: {sorted(a)} != {sorted(b)}"
        for name, x in a.items():
            y = b[name]
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"step {k}: {name}"
            if x.dtype == torch.uint8:  # codes: apart only where a value met a boundary
                apart = (x.int() - y.int()).abs()
                assert (apart > 0).float().mean() < 0.01, f"step {k}: {name}"
                continue
            if not x.is_floating_point():
                assert torch.equal(x, y), f"step {k}: {name}"
                continue
            rtol, atol = tolerance(row, x.dtype)
            scale = max(1.0, y.double().abs().max().item()) if y.numel() else 1.0
            torch.testing.assert_close(x.double(), y.double(), rtol=rtol, atol=atol * scale,
                                       equal_nan=True, msg=lambda m: f"step {k}: {name}: {m}")
    if row["life"] == "state_dict":
        plain = run(row, "c", resume=False)
        for k, (a, b) in enumerate(zip(c, plain), 1):
            for name in b:
                assert torch.equal(a[name], b[name]), f"resumed, step {k}: {name}"


def test_the_rows_cover_every_allowed_pair():
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            if allowed({a: x, b: y}):
                assert any(r[a] == x and r[b] == y for r in ROWS), (a, x, b, y)
