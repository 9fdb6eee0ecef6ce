"""One rank of the distributed checks of ``test_distributed.py``: ``python distributed_script.py
RANK WORLD OUTDIR CHECK...``. Each check asserts; the rank prints one JSON line of what
it measured (largest differences, collectives counted) at the end. With ``all`` for RANK,
every rank of WORLD: a process that makes the imports (about 3 s of a CPU) once and forks
the ranks (see ``fork_ranks``)."""
import contextlib
import copy
import functools
import json
import os
import sys
import tempfile

if any(c.startswith("triton-") for c in sys.argv[4:]):  # (set before triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import vega  # noqa: E402
from vega.codegen import quant  # noqa: E402
from vega.runtime import torch_names  # noqa: E402

RANK = None if sys.argv[1] == "all" else int(sys.argv[1])  # (all: set in each forked rank)
WORLD, OUT = int(sys.argv[2]), sys.argv[3]
CHECKS = sys.argv[4:]
found: dict = {}

# (class, hyperparameters): each a rule with a different kind of reduction
OPTIMIZERS = {
    "AdamW": (vega.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "LAMB": (vega.optim.LAMB, {"lr": 1e-2, "weight_decay": 0.01}),
    # factored: both weights (16x6: its column axis, the 16, is sharded; 5x16: its row axis)
    "Adafactor": (vega.optim.Adafactor, {"lr": 1e-2, "min_dim_size_to_factor": 2.0,
                                          "clipping_threshold": 0.5}),
    "SGD": (vega.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
# every other reduction: per tensor (max: combined by an all-gather, a NaN winning), and
# along each axis of the matrix view, one of which a shard splits
REDUCTIONS = vega.compile("""
optimizer reductions(lr = 0.01) {
    state m = zeros
    m = 0.5 * m + g
    big = max(abs(m)) + max(row_max(abs(g))) + max(col_max(g))
    p = p - lr * (m / (big + 1) + 0.01 * sum(m) + mean(g * g) + 0.1 * row_sum(g)
                  + 0.1 * col_sum(g) + 0.1 * row_mean(g * p) + 0.1 * col_mean(abs(g)))
}
""")
OPTIMIZERS["reductions"] = (REDUCTIONS.optimizer_class, {})
# the per-tensor reductions alone, in two phases (the second reads the first's results):
# the C kernels' phases of a program of element values (the other: its stages over a
# matrix view)
PER_TENSOR = vega.compile("""
optimizer per_tensor(lr = 0.01) {
    state m = zeros
    m = 0.5 * m + g
    scaled = m / (max(abs(m)) + 1)
    p = p - lr * (scaled / (norm(scaled) + 1) + 0.01 * sum(m) + mean(g * g))
}
""")
OPTIMIZERS["per_tensor"] = (PER_TENSOR.optimizer_class, {})
# the collectives of one step: the prelude's record, then one per stage of reductions
# that a shard splits (Adafactor's factored rule: row and column means, then the mean of
# the per-row factor, then the update's RMS)
COLLECTIVES = {"AdamW": 1, "LAMB": 2, "Adafactor": 4, "SGD": 1, "reductions": 3,
               "per_tensor": 3, "Prodigy": 2}
# sums over the whole parameter group (global_sum), in one stage: one collective for both
OPTIMIZERS["Prodigy"] = (vega.optim.Prodigy, {"lr": 1.0, "d0": 1e-3, "weight_decay": 0.01})


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # the last layer's weight and bias have one row: one rank's shards of them are empty
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 5), torch.nn.Linear(5, 1)).double()


def batch(k: int, rows: int = 8, cols: int = 6, seed: int = 100, scale: float = 10.0):
    gen = torch.Generator().manual_seed(seed + k)
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * scale, \
        torch.randn(rows, 1, generator=gen, dtype=torch.float64)


def loss_of(net, k, **shape):
    """The squared error of ``net`` on batch ``k`` (``shape``: ``batch``'s other arguments)."""
    x, y = batch(k, **shape)
    return ((net(x) - y) ** 2).sum()


class Counted:
    """Counts the collectives vega calls (torch.distributed's, by name) while active."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather", "broadcast",
             "reduce_scatter_tensor")

    def __enter__(self):
        self.n, self.saved = 0, {}
        for name in self.NAMES:
            fn = self.saved[name] = getattr(dist, name)

            def counted(*a, _fn=fn, **kw):
                self.n += 1
                return _fn(*a, **kw)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


class Staged:
    """Which kernels' staged steps (``Kernel.staged``: reductions a shard splits) ran while
    active: a sorted list of their backends."""

    def __enter__(self):
        from vega.codegen import reference, triton
        from vega.codegen.c import launch
        self.kinds, self.saved = set(), []
        for cls in (reference.Kernel, launch.Kernel, triton.Kernel):
            fn = cls.staged
            self.saved.append((cls, fn))

            def counted(kern, *a, _fn=fn, **kw):
                self.kinds.add(kern.backend)
                return _fn(kern, *a, **kw)
            cls.staged = counted
        return self

    def __exit__(self, *exc):
        for cls, fn in self.saved:
            cls.staged = fn
        self.kinds = sorted(self.kinds)


def sharded(net, mesh=None):
    """``net`` under FSDP2, each Linear a unit; ``mesh``: a 2-D (replicate, shard) mesh for
    HSDP, by default the world's 1-D one."""
    from torch.distributed.fsdp import fully_shard
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def fsdp_against_unsharded(name: str, hybrid: bool = False, backend=None,
                           meta: bool = False) -> None:
    """``name``'s class under FSDP2 against the same unsharded, five steps; ``hybrid``:
    HSDP over a 2 x (WORLD / 2) mesh, each shard replicated twice (a partial sum of a
    replicated value counting once, each collective once per mesh dimension); ``backend``:
    both on that backend (Triton's under its interpreter, on CPU tensors); ``meta``: the
    sharded steps under ``torch.device("meta")`` (the tables of the sharded reductions made
    on the host, whatever the default device)."""
    cls, hypers = OPTIMIZERS[name]
    if backend is not None:
        hypers = {**hypers, "backend": backend}
    plain = model()
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    net = sharded(copy.deepcopy(plain), mesh)
    opt_plain = cls(plain.parameters(), max_grad_norm=1.0, **hypers)
    opt = cls(net.parameters(), max_grad_norm=1.0, **hypers)
    counts = []
    for k in range(5):
        for m, o in ((plain, opt_plain), (net, opt)):
            o.zero_grad()
            loss_of(m, k).backward()
        norm = sum(q.grad.square().sum() for q in plain.parameters()).sqrt().item()
        assert norm > 1.0, norm  # (the clip acts)
        opt_plain.step()
        with Counted() as c, Staged() as where, \
                torch.device("meta") if meta else contextlib.nullcontext():
            opt.step()
        counts.append(c.n)
    worst = 0.0
    for (n, p), q in zip(net.named_parameters(), plain.parameters()):
        worst = max(worst, (p.full_tensor() - q).abs().max().item())
        for key, s in opt.state[p].items():
            ref = opt_plain.state[q][key]
            if key != "step":
                assert type(s).__name__ == "DTensor", (name, n, key, type(s))
                s = s.full_tensor()
            worst = max(worst, (s.double() - ref.double()).abs().max().item())
    if name == "Adafactor":  # factored: both weights
        assert sum("v_row" in opt.state[p] for p in net.parameters()) == 2
    assert worst <= 1e-9, (name, worst)
    if hybrid:  # (a collective over each of the mesh's two dimensions)
        assert counts == [2 * COLLECTIVES[name]] * 5, (name, counts)
        assert all(len(p.placements) == 2 for p in net.parameters())
        found[f"hsdp-{name}"] = {"diff": worst, "staged": where.kinds}
        return
    assert counts == [COLLECTIVES[name]] * 5, (name, counts)
    found[f"meta-{name}" if meta else name if backend is None else f"{backend}-{name}"] = {
        "diff": worst, "collectives": counts[0], "staged": where.kinds}


def without_prelude() -> None:
    """Without max_grad_norm, a loss scale or skip_nonfinite there is no prelude to reduce:
    a step of AdamW over shards makes no collective, LAMB's one (its norms' stage)."""
    counts = {}
    for name in ("AdamW", "LAMB"):
        cls, hypers = OPTIMIZERS[name]
        net = sharded(model())
        opt = cls(net.parameters(), **hypers)
        loss_of(net, 0).backward()
        with Counted() as c:
            opt.step()
        counts[name] = c.n
    assert counts == {"AdamW": 0, "LAMB": 1}, counts
    found["without-prelude"] = counts


def mixed_placements() -> None:
    """A step over DTensors of one mesh placed differently, one sharded and one replicated
    (a tensor-parallel layer's weight and bias), clips by their global norm, each
    replicated value counted once: the same step as over the whole tensors in one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(11)
    whole = [torch.randn(4 * WORLD, 3, generator=gen, dtype=torch.float64),
             torch.randn(5, generator=gen, dtype=torch.float64)]
    grads = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in whole]
    places = ([Shard(0)], [Replicate()])
    params = [distribute_tensor(x, mesh, pl) for x, pl in zip(whole, places)]
    dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, places)]
    state, want_state = vega.sgd_init(params), vega.sgd_init(whole)
    for _ in range(2):
        params, state = vega.sgd_step(params, dgrads, state, lr=0.1, max_grad_norm=0.5)
        whole, want_state = vega.sgd_step(whole, grads, want_state, lr=0.1,
                                            max_grad_norm=0.5)
    found["mixed-placements"] = max((a.full_tensor() - b).abs().max().item()
                                    for a, b in zip(params, whole))


def nan_skips() -> None:
    """A NaN in one rank's shard: every rank skips (parameters, state and counters kept),
    with AdamW and with LAMB (whose norms a shard splits: the C kernels' staged step)."""
    for cls in (vega.optim.AdamW, vega.optim.LAMB):
        nan_skips_with(cls)
    found["nan"] = "skipped"


def nan_skips_with(cls, **kw) -> None:
    net = sharded(model())
    opt = cls(net.parameters(), lr=1e-2, skip_nonfinite=True, **kw)
    loss_of(net, 0).backward()
    opt.step()
    before = [p.to_local().clone() for p in net.parameters()]
    states = [opt.state[p]["mu"].to_local().clone() for p in net.parameters()]
    opt.zero_grad()
    loss_of(net, 1).backward()
    if RANK == WORLD - 1:
        next(iter(net.parameters())).grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    for p, b, s in zip(net.parameters(), before, states):
        assert torch.equal(p.to_local(), b), RANK
        assert torch.equal(opt.state[p]["mu"].to_local(), s), RANK
        assert opt.state[p]["step"].item() == 1, RANK


def dcp_resume(wrap: str = "fsdp", q8: bool = False) -> None:
    """get_state_dict / dcp.save, then dcp.load / set_state_dict into a fresh model and
    optimizer: the next steps are bitwise those of the run that went on (under FSDP2, or
    DDP: ``wrap``; ``q8``: 8-bit state, its codes and scales; else with a loss scale that
    grows by 3 each step, whose tensors the checkpoint holds beside the optimizer's state
    dict, as docs/distributed.md shows: torch's optimizer state dict keeps 'state' and
    'param_groups' only, and its get_state_dict of a fresh optimizer steps it once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP
    folder = os.path.join(OUT, f"dcp-{wrap}{'-q8' if q8 else ''}")

    def local(x):
        return x.to_local() if type(x).__name__ == "DTensor" else x

    def make():
        net = (q8_model if q8 else model)()
        net = sharded(net) if wrap == "fsdp" else DDP(net)
        scale = None if q8 else vega.LossScale.dynamic(init=1000.0, growth_interval=1,
                                                       growth_factor=3.0)
        return net, vega.optim.AdamW(net.parameters(), lr=1e-2, max_grad_norm=1.0,
                                     state_dtype=torch.uint8 if q8 else None, loss_scale=scale)

    def steps(net, opt, ks):
        for k in ks:
            opt.zero_grad()
            loss = (q8_loss if q8 else loss_of)(net, k)
            (loss if opt.loss_scale is None else opt.loss_scale.scale(loss)).backward()
            opt.step()

    def scale_of(opt) -> dict:  # (the loss scale's tensors, which dcp.load writes in place)
        return {} if opt.loss_scale is None else {"loss_scale": dict(zip(
            ("scale", "good_steps", "skipped_steps", "min_scale"), opt.loss_scale.tensors()))}
    net, opt = make()
    steps(net, opt, range(2))
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd, **scale_of(opt)}, checkpoint_id=folder)
    steps(net, opt, range(2, 4))
    net2, opt2 = make()
    msd2, osd2 = get_state_dict(net2, opt2)
    state = {"model": msd2, "optim": osd2, **scale_of(opt2)}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(net2, opt2, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    steps(net2, opt2, range(2, 4))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(local(p), local(q)), RANK
        for key in opt.state[p]:
            a, b = local(opt.state[p][key]), local(opt2.state[q][key])
            assert torch.equal(a, b) and a.dtype == b.dtype, (RANK, key)
    if q8:
        assert any(s.dtype == torch.uint8 for st in opt2.state.values() for s in st.values())
    else:
        assert all(torch.equal(a, b) for a, b in zip(opt.loss_scale.tensors(),
                                                     opt2.loss_scale.tensors())), RANK
        assert float(opt2.loss_scale.loss_scale) == 1000.0 * 3 ** 4, RANK
    found[f"dcp-{wrap}{'-q8' if q8 else ''}"] = "bitwise"


def full_state_dict(cls_name: str) -> None:
    """get_state_dict / set_state_dict with ``full_state_dict=True`` (whole tensors, which
    torch gives back as DTensors, its 0-d values as plain tensors) under FSDP2, then two
    more steps: bitwise those of the run that went on, for a rule with states of one number
    (Prodigy's ``d``, D-Adaptation's, schedule-free's ``weight_sum``). ``AdamW-q8``: 8-bit
    state, and a group whose ``state_dtype`` is a dict of float dtypes (torch's functions
    of whole tensors take no ``torch.dtype`` in a state dict: the groups hold their names)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    q8 = cls_name == "AdamW-q8"
    cls = getattr(vega.optim, cls_name.removesuffix("-q8"))
    options = StateDictOptions(full_state_dict=True)

    def make():
        net = sharded((q8_model if q8 else model)())
        if q8:
            ps = list(net.parameters())
            return net, cls([{"params": ps[:4], "state_dtype": torch.uint8},
                             {"params": ps[4:], "state_dtype": {"nu": torch.bfloat16}}],
                            lr=1e-2)
        return net, cls(net.parameters(), lr=1e-2 if cls_name == "AdamW" else 1.0)

    def steps(net, opt, ks):
        for k in ks:
            opt.zero_grad()
            (q8_loss if q8 else loss_of)(net, k).backward()
            opt.step()
    net, opt = make()
    steps(net, opt, range(2))
    msd, osd = get_state_dict(net, opt, options=options)
    net2, opt2 = make()
    set_state_dict(net2, opt2, model_state_dict=msd, optim_state_dict=osd, options=options)
    steps(net, opt, range(2, 4))
    steps(net2, opt2, range(2, 4))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), (RANK, cls_name)
        assert opt.state[p].keys() == opt2.state[q].keys(), (RANK, cls_name)
        for key, a in opt.state[p].items():
            b = opt2.state[q][key]
            assert type(a) is type(b) and a.dtype == b.dtype, (RANK, cls_name, key)
            if type(a).__name__ == "DTensor":
                assert a.placements == b.placements, (RANK, cls_name, key)
                a, b = a.to_local(), b.to_local()
            assert torch.equal(a, b), (RANK, cls_name, key)
    if q8:
        assert any(s.dtype == torch.uint8 for st in opt2.state.values() for s in st.values())
        assert opt2.param_groups[1]["state_dtype"] == {"nu": torch.bfloat16}
    found.setdefault("full-state-dict", {})[cls_name] = "bitwise"


def docs_example() -> None:
    """docs/distributed.md's FSDP2 example, its train() in this process group: it learns."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    space = {"__name__": "fsdp_example"}
    exec(compile(block, "docs/distributed.md", "exec"), space)
    losses = space["train"](12)
    assert sum(losses[-3:]) < 0.6 * sum(losses[:3]), losses
    found["docs"] = "learns"


def muon_refused() -> None:
    """Muon's matrix products on an FSDP2 shard would see part of each matrix: refused
    before anything is written, naming the parameter."""
    net = sharded(model())
    opt = vega.optim.Muon(net.parameters(), lr=1e-2)
    loss_of(net, 0).backward()
    before = [p.full_tensor().clone() for p in net.parameters()]
    try:
        opt.step()
    except ValueError as err:
        assert "need each tensor whole on one process" in str(err), err
        found["muon-fsdp"] = "refused"
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(net.parameters(), before))
    # L-BFGS's inner products take whole tensors: refused as clearly, before it makes any
    # state (its ring buffers hold memory_size copies of each parameter), in both APIs
    lbfgs = vega.optim.LBFGS(net.parameters(), lr=0.1)
    for step in (lbfgs.step, lambda: vega.lbfgs_step(
            dict(net.named_parameters()), {n: p.grad for n, p in net.named_parameters()},
            vega.lbfgs_init({"x": torch.zeros(1)}))):
        try:
            step()
            raise AssertionError("an L-BFGS step over DTensors was taken")
        except ValueError as err:
            assert "L-BFGS does not step DTensors" in str(err), err
    assert not lbfgs.state
    assert all(torch.equal(p.full_tensor(), b) for p, b in zip(net.parameters(), before))
    found["lbfgs-fsdp"] = "refused"


def uneven_refused() -> None:
    """Prodigy with reduce_group where rank 1 has nothing to step in the group: every rank
    refuses the step with the same error, none waits for the others' collectives."""
    ps = [torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))]
    opt = vega.optim.Prodigy(ps, reduce_group=dist.group.WORLD)
    ps[0].grad = torch.ones(3, 2, dtype=torch.float64) if RANK == 0 else None
    try:
        opt.step()
    except ValueError as err:
        assert "step different programs" in str(err), err
        found["uneven"] = "refused"


def split_refused() -> None:
    """A matrix sharded along both of its axes (a 2 x 2 mesh): factored Adafactor's row and
    column means would be split themselves, which the step does not combine: refused before
    anything is made or written, naming the parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    w = torch.arange(64, dtype=torch.float64).reshape(8, 8) / 64
    p = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0), Shard(1)]))
    p.grad = distribute_tensor(w.flip(0), mesh, [Shard(0), Shard(1)])
    opt = vega.optim.Adafactor([p], lr=1e-2, min_dim_size_to_factor=2.0)
    try:
        opt.step()
        raise AssertionError("a step of a matrix sharded along both axes was taken")
    except ValueError as err:
        assert "Adafactor: parameter 0: a row_mean" in str(err), err
    assert torch.equal(p.full_tensor(), w) and not opt.state
    found["split"] = "refused"


def zero_against_ddp(cls=vega.optim.AdamW, lr=1e-2, key="zero", **hypers) -> None:
    """ZeroRedundancyOptimizer over vega's AdamW with max_grad_norm and reduce_group: the
    clip spans every rank's parameters, as under DDP with one optimizer per rank. Prodigy:
    its sums over the parameter group (global_sum) span them too."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp, zero = DDP(model()), DDP(model())
    opt_ddp = cls(ddp.parameters(), lr=lr, max_grad_norm=1.0, **hypers)
    opt_zero = ZeroRedundancyOptimizer(
        zero.parameters(), lr=lr, max_grad_norm=1.0, **hypers,
        optimizer_class=functools.partial(cls, reduce_group=dist.group.WORLD))
    for k in range(5):
        for m, o in ((ddp, opt_ddp), (zero, opt_zero)):
            o.zero_grad()
            x, y = batch(10 * k + RANK)  # each rank its own batch
            ((m(x) - y) ** 2).sum().backward()
            o.step()
    worst = max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), zero.parameters()))
    assert worst <= 1e-9, worst
    found[key] = {"diff": worst}
    if cls is vega.optim.Prodigy:  # (the estimate is the same in every tensor)
        d = [s["d"] for s in opt_ddp.state.values()]
        assert all(torch.equal(x, d[0]) for x in d), d


def zero_save(cls_name: str) -> None:
    """A checkpoint of ZeroRedundancyOptimizer over a vega class with its reduce_group given
    through ``functools.partial`` (out of ZeRO's groups, which its state_dict pickles):
    consolidated on rank 0, saved, loaded into a fresh ZeRO on every rank; the next steps
    are bitwise those of the run that went on. Given as ZeRO's keyword, the group is in
    ZeRO's groups: a warning says so, and consolidating still works (the wrapped
    optimizer's state dict leaves it out)."""
    import warnings

    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    cls = getattr(vega.optim, cls_name)
    lr = 1e-2 if cls_name == "AdamW" else 0.1
    path = os.path.join(OUT, f"zero-{cls_name}.pt")

    def make():
        net = DDP(model())
        return net, ZeroRedundancyOptimizer(
            net.parameters(), lr=lr,
            optimizer_class=functools.partial(cls, reduce_group=dist.group.WORLD))

    def steps(net, opt, ks):
        for k in ks:
            opt.zero_grad()
            x, y = batch(10 * k + RANK)
            ((net(x) - y) ** 2).sum().backward()
            opt.step()
    net, opt = make()
    steps(net, opt, range(2))
    opt.consolidate_state_dict(to=0)
    if RANK == 0:
        torch.save(opt.state_dict(), path)
    dist.barrier()
    net2, opt2 = make()
    net2.load_state_dict(net.state_dict())
    opt2.load_state_dict(torch.load(path, weights_only=False))
    steps(net, opt, range(2, 4))
    steps(net2, opt2, range(2, 4))
    for p, q in zip(net.parameters(), net2.parameters()):
        assert torch.equal(p, q), (RANK, cls_name)
        for key, a in opt.optim.state.get(p, {}).items():
            assert torch.equal(a, opt2.optim.state[q][key]), (RANK, cls_name, key)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kept = ZeroRedundancyOptimizer(DDP(model()).parameters(), optimizer_class=cls, lr=lr,
                                       reduce_group=dist.group.WORLD)
    assert any("functools.partial" in str(w.message) for w in seen), (RANK, cls_name)
    kept.consolidate_state_dict(to=0)
    found.setdefault("zero-save", {})[cls_name] = "bitwise"


def functions_over_group() -> None:
    """global_norm, clip_by_global_norm, grads_finite, LossScale.step and lbfgs_step with
    ``reduce_group``, each rank holding every WORLD-th leaf: equal to the same function over
    all leaves in one process; and the LBFGS class under ZeroRedundancyOptimizer against
    DDP."""
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    every = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (5, 3, 8, 1, 4)]
    mine = every[RANK::WORLD]
    out = {}
    # torch.distributed initialized, a reduce_group that is no process group is refused by name
    for call in (lambda: vega.global_norm(mine, reduce_group="world"),
                 lambda: vega.optim.AdamW([torch.zeros(2, requires_grad=True)],
                                          reduce_group=dist.group)):
        try:
            call()
        except ValueError as e:
            assert "must be a torch.distributed process group" in str(e), e
        else:
            raise AssertionError("a reduce_group that is no process group was taken")
    with Counted() as c:
        norm = vega.global_norm(mine, reduce_group=group)
    assert c.n == 1, c.n
    out["norm"] = abs(norm - vega.global_norm(every)).item()
    clipped = vega.clip_by_global_norm(mine, 0.5, reduce_group=group)
    out["clip"] = max((a - b).abs().max().item() for a, b in zip(
        clipped, vega.clip_by_global_norm(every, 0.5)[RANK::WORLD]))
    assert vega.grads_finite(mine, reduce_group=group).item()
    bad = [x.clone() for x in mine]
    if RANK == WORLD - 1:
        bad[0][1] = float("inf")
    with Counted() as c:
        assert not vega.grads_finite(bad, reduce_group=group).item(), RANK
    assert c.n == 1, c.n
    ls = vega.LossScale.dynamic(init=1.0)
    params = [x.clone() for x in mine]
    (new, _), ls = ls.step(bad, lambda g: (params[0] - g[0], 0), (params[0], 0),
                           reduce_group=group)
    assert torch.equal(new, params[0]), RANK  # skipped on every rank
    assert ls.loss_scale.item() == 0.5
    # lbfgs_step: four steps on a quadratic, each rank its leaves
    target = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in every]
    p_all, p_mine = [x.clone() for x in every], [x.clone() for x in mine]
    s_all, s_mine = vega.lbfgs_init(p_all, memory_size=3), vega.lbfgs_init(p_mine, memory_size=3)
    for _ in range(4):
        g_all = [3 * (p - t) for p, t in zip(p_all, target)]
        g_mine = [3 * (p - t) for p, t in zip(p_mine, target[RANK::WORLD])]
        p_all, s_all = vega.lbfgs_step(p_all, g_all, s_all, lr=0.5)
        with Counted() as c:
            p_mine, s_mine = vega.lbfgs_step(p_mine, g_mine, s_mine, lr=0.5, reduce_group=group)
        assert c.n == 2 * 3 + 1, c.n
    out["lbfgs"] = max((a - b).abs().max().item() for a, b in zip(p_mine, p_all[RANK::WORLD]))
    # ranks whose leaves differ in dtype (float32 here, float64 there), and a rank with none
    # (each rank within float32's precision of the float64 answer: they differ in the last
    # bits, so only that they agree so is reported)
    mixed = [x.float() for x in mine] if RANK == 1 else mine
    rel = abs(vega.global_norm(mixed, reduce_group=group).double()
              - vega.global_norm(every)).item() / vega.global_norm(every).item()
    assert rel < 1e-6, rel
    some = [] if RANK == 0 else every
    worst = abs(vega.global_norm(some, reduce_group=group) - vega.global_norm(every).float())
    assert worst.item() < 1e-5, worst
    assert vega.grads_finite(some, reduce_group=group).item()
    p_mixed = [x.clone() for x in mixed]
    s_mixed = vega.lbfgs_init(p_mixed, memory_size=3)
    p_all = [x.clone() for x in every]
    s_all = vega.lbfgs_init(p_all, memory_size=3)
    for _ in range(3):
        p_all, s_all = vega.lbfgs_step(p_all, [3 * (p - t) for p, t in zip(p_all, target)],
                                       s_all, lr=0.5)
        p_mixed, s_mixed = vega.lbfgs_step(
            p_mixed, [3 * (p - t.to(p.dtype)) for p, t in zip(p_mixed, target[RANK::WORLD])],
            s_mixed, lr=0.5, reduce_group=group)
    worst = max((a.double() - b).abs().max().item() for a, b in zip(p_mixed, p_all[RANK::WORLD]))
    assert worst < 1e-5, worst
    found["mixed-dtypes"] = "agree"
    # the LBFGS class under ZeroRedundancyOptimizer (each rank its parameters) against DDP
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp, zero = DDP(model()), DDP(model())
    opt_ddp = vega.optim.LBFGS(ddp.parameters(), lr=0.1, memory_size=3)
    opt_zero = ZeroRedundancyOptimizer(
        zero.parameters(), lr=0.1, memory_size=3,
        optimizer_class=functools.partial(vega.optim.LBFGS, reduce_group=group))
    for k in range(4):
        for m, o in ((ddp, opt_ddp), (zero, opt_zero)):
            o.zero_grad()
            x, y = batch(10 * k + RANK)
            ((m(x) - y) ** 2).sum().backward()
            o.step()
    out["lbfgs-zero"] = max((p - q).abs().max().item()
                            for p, q in zip(ddp.parameters(), zero.parameters()))
    # DTensor leaves (FSDP2's gradients): one collective over the mesh, DTensors back
    plain, net = model(), sharded(model())
    for m in (plain, net):
        loss_of(m, 0).backward()
    grads = [p.grad for p in net.parameters()]
    with Counted() as c:
        norm = vega.global_norm(grads)
    assert c.n == 1, c.n
    out["dtensor-norm"] = abs(norm - vega.global_norm([p.grad for p in plain.parameters()])).item()
    clipped = vega.clip_by_global_norm(grads, 1.0)
    assert all(type(g).__name__ == "DTensor" for g in clipped)
    out["dtensor-clip"] = max((a.full_tensor() - b).abs().max().item() for a, b in zip(
        clipped, vega.clip_by_global_norm([p.grad for p in plain.parameters()], 1.0)))
    # a replicated DTensor leaf counts once, beside a sharded one (each rank holds all of it)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = grads[0].device_mesh
    placed = [distribute_tensor(every[0], mesh, [Replicate()]),
              distribute_tensor(every[2], mesh, [Shard(0)])]
    out["dtensor-replicated-norm"] = abs(vega.global_norm(placed)
                                         - vega.global_norm([every[0], every[2]])).item()
    assert vega.grads_finite(grads).item()
    if RANK == WORLD - 1:
        grads[0].to_local().view(-1)[0] = float("nan")
    assert not vega.grads_finite(grads).item(), RANK
    for key, worst in out.items():
        assert worst <= 1e-9, (key, worst)
    found["functions"] = out


def q8_model() -> torch.nn.Module:
    """The weights keep 8-bit state (4,096 values or more), the biases float state. The
    first weight's shards start on a block of 256 values on 2 and 4 ranks (rows of 256); the
    second's do not (rows of 32: a shard of 65 or 33 rows, of fewer than 4,096 values: the
    whole tensor's size decides); the last has one row: the other ranks' shards are
    empty."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 130), torch.nn.Tanh(),
                               torch.nn.Linear(130, 4096, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(4096, 1)).double()


def q8_loss(net, k):
    """``loss_of`` on batches of ``q8_model``'s 256 inputs."""
    return loss_of(net, k, rows=16, cols=256, seed=200, scale=1.0)


Q8 = {"lr": 1e-2, "weight_decay": 0.1, "state_dtype": torch.uint8}


def q8_shards(hybrid: bool = False) -> None:
    """8-bit AdamW under FSDP2, five steps. Each step of each rank's shard is bitwise the
    functional 8-bit step of that shard as a plain tensor (its blocks from the shard's first
    value), from the same codes and scales; the scales are a (shards, blocks) DTensor, each
    rank's row zero past its shard's blocks. With max_grad_norm, the weight whose shards
    start on a block boundary matches the unsharded optimizer (the blocks are the same).
    ``hybrid``: HSDP over a 2 x (WORLD / 2) mesh (a row of scales per shard, each held by
    two ranks)."""
    mesh, shards = None, WORLD
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
        shards = WORLD // 2
    net = sharded(q8_model(), mesh)
    opt = vega.optim.AdamW(net.parameters(), **Q8)
    hypers = {k: v for k, v in Q8.items() if k != "state_dtype"}
    eight = 0
    for k in range(5):
        opt.zero_grad()
        q8_loss(net, k).backward()
        before = {}
        for i, p in enumerate(net.parameters()):
            st = opt.state[p]
            if "mu_absmax" not in st:
                continue
            local = p.to_local()
            state = {"step": st["step"].clone()}
            for name in ("mu", "nu"):
                state[name] = {"w": st[name].to_local().clone()}
                row = st[name + "_absmax"].to_local()
                assert row.shape == (1, st[name + "_absmax"].shape[1]), row.shape
                n = -(-local.numel() // 256)
                assert not row[0, n:].any()  # (zeros past this shard's blocks)
                state[name + "_absmax"] = {"w": row.reshape(-1)[:n].clone()}
            before[i] = ({"w": local.clone()}, {"w": p.grad.to_local().clone()}, state)
        opt.step()
        for i, p in enumerate(net.parameters()):
            if i not in before:
                continue
            eight += 1
            new_p, new_s = vega.adamw.step(*before[i], backend="c", **hypers)
            st = opt.state[p]
            assert torch.equal(p.to_local(), new_p["w"]), (RANK, k, i)
            for name in ("mu", "nu"):
                assert torch.equal(st[name].to_local(), new_s[name]["w"]), (RANK, k, i, name)
                n = new_s[name + "_absmax"]["w"].numel()
                assert torch.equal(st[name + "_absmax"].to_local().reshape(-1)[:n],
                                   new_s[name + "_absmax"]["w"]), (RANK, k, i, name)
    weights = [p for p in net.parameters() if p.dim() == 2]
    assert eight == 4 * len(weights) == 16
    for p in weights:  # a row per shard, as long as the first shard (the largest) needs
        rows, cols = p.shape
        assert opt.state[p]["mu_absmax"].shape == (shards,
                                                   -(-(-(-rows // shards)) * cols // 256))
    # clipped by the global norm, against the unsharded optimizer: the aligned weight in 8
    # bits (the other's blocks differ from the unsharded tensor's: it is kept in float32)
    plain = q8_model()
    net = sharded(copy.deepcopy(plain), mesh)
    opts = [vega.optim.AdamW([{"params": list(m.parameters())[:1], "state_dtype": torch.uint8},
                              {"params": list(m.parameters())[1:]}], max_grad_norm=1.0,
                             lr=1e-2, weight_decay=0.1) for m in (plain, net)]
    for k in range(5):
        for m, o in zip((plain, net), opts):
            o.zero_grad()
            q8_loss(m, k).backward()
            o.step()
    worst = max((p.full_tensor() - q).abs().max().item()
                for p, q in zip(net.parameters(), plain.parameters()))
    p, q = next(iter(net.parameters())), next(iter(plain.parameters()))
    assert opts[1].state[p]["mu"].dtype == torch.uint8
    for name in ("mu", "nu"):
        assert torch.equal(opts[1].state[p][name].full_tensor(), opts[0].state[q][name])
        assert torch.equal(opts[1].state[p][name + "_absmax"].full_tensor().reshape(-1),
                           opts[0].state[q][name + "_absmax"])
    assert worst <= 1e-9, worst
    found["q8-hsdp" if hybrid else "q8"] = {"steps": eight, "aligned": worst}


def q8_loads() -> None:
    """A float FSDP2 state loaded into an 8-bit optimizer is quantized on each shard (with a
    warning), and steps; an 8-bit one loaded into a float optimizer is dequantized, as is
    one given in torch.optim's format (``torch_state_dict``); an 8-bit one round-trips
    bitwise."""
    import warnings
    net = sharded(q8_model())
    f32 = vega.optim.AdamW(net.parameters(), lr=1e-2)
    q8 = vega.optim.AdamW(net.parameters(), **Q8)
    q8_loss(net, 0).backward()
    f32.step()
    q8.step()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        q8.load_state_dict(f32.state_dict())
    assert any("quantized to 8 bits" in str(w.message) for w in said), said
    p = next(iter(net.parameters()))
    codes, scales = q8.state[p]["mu"], q8.state[p]["mu_absmax"]
    assert codes.dtype == torch.uint8 and tuple(scales.shape) == (WORLD, 32 // WORLD)
    back = quant.dequantize_t(codes, scales, True).full_tensor()
    ref = f32.state[p]["mu"].full_tensor()
    assert (back - ref).abs().max() <= 0.02 * ref.abs().max()
    with warnings.catch_warnings(record=True) as said:  # torch.optim's format: floats
        warnings.simplefilter("always")
        theirs = q8.torch_state_dict()["state"][0]
    assert any("dequantized to float32" in str(w.message) for w in said), said
    assert type(theirs["exp_avg"]).__name__ == "DTensor" and "mu_absmax" not in theirs
    assert torch.equal(theirs["exp_avg"].full_tensor(), back)
    saved = q8.state_dict()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f32.load_state_dict(saved)
    assert any("dequantized" in str(w.message) for w in said), said
    assert f32.state[p]["mu"].dtype == torch.float64 and "mu_absmax" not in f32.state[p]
    assert torch.equal(f32.state[p]["mu"].full_tensor(), back.double())
    again = vega.optim.AdamW(net.parameters(), **Q8)
    again.load_state_dict(saved)
    for key in ("mu", "mu_absmax", "nu", "nu_absmax"):
        assert torch.equal(again.state[p][key].to_local(), q8.state[p][key].to_local()), key
    net.zero_grad()
    q8_loss(net, 1).backward()
    q8.step()
    assert all(p.full_tensor().isfinite().all() for p in net.parameters())
    found["q8-load"] = "converted"


def q8_move(phase: str) -> None:
    """8-bit state moved to a mesh of another size (docs/distributed.md): ``save`` (on 2
    ranks) checkpoints it as it is and through float state; ``load`` (on 4) finds the first
    refused by DCP (the scales' shape differs), and loads the second into float state, then
    into the 8-bit optimizer: the values are the saved ones (exactly, for the weight whose
    shards start on block boundaries on both meshes), and it steps."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    folder = os.path.dirname(OUT.rstrip("/"))  # (both launches' common folder)
    net = sharded(q8_model())
    opt = vega.optim.AdamW(net.parameters(), lr=1e-2, state_dtype=torch.uint8)
    for k in range(2):
        opt.zero_grad()
        q8_loss(net, k).backward()
        opt.step()
    floats = vega.optim.AdamW(net.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dequantized: test_distributed's other checks)
        floats.load_state_dict(opt.state_dict())
    weights = [p for p in net.parameters() if p.dim() == 2]
    if phase == "save":
        values = [floats.state[p]["mu"].full_tensor() for p in weights]
        if RANK == 0:
            torch.save(values, os.path.join(folder, "q8-values.pt"))
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "q8-codes"))
        msd, osd = get_state_dict(net, floats)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "q8-floats"))
        found["q8-move"] = "saved"
        return
    msd, osd = get_state_dict(net, opt)
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "q8-codes"))
        raise AssertionError("8-bit state loaded on another mesh")
    except CheckpointException as err:
        assert "Size mismatch" in str(err) and "mu_absmax" in str(err), err
    msd, osd = get_state_dict(net, floats)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.path.join(folder, "q8-floats"))
    set_state_dict(net, floats, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt.load_state_dict(floats.state_dict())
    assert any("quantized to 8 bits" in str(w.message) for w in said), said
    saved = torch.load(os.path.join(folder, "q8-values.pt"))
    for k, (p, want) in enumerate(zip(weights, saved)):
        st = opt.state[p]
        assert st["mu"].dtype == torch.uint8 and st["mu_absmax"].shape[0] == WORLD
        got = quant.dequantize_t(st["mu"], st["mu_absmax"], True).full_tensor()
        if k == 0:  # (shards of 256-value rows: blocks on both meshes)
            assert torch.equal(got, want), k
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), k
    opt.zero_grad()
    q8_loss(net, 5).backward()
    opt.step()
    assert all(p.full_tensor().isfinite().all() for p in net.parameters())
    found["q8-move"] = "moved"


def q8_other_layout() -> None:
    """8-bit state saved from a 1-D mesh's row shards (four of 8 x 256 values) and loaded
    into as many shards cut otherwise (a 2 x 2 mesh's row and column shards, of 16 x 128):
    the scales' shapes agree, (4, 8), but each row holds the blocks of a saved shard, which
    here holds other values. load_state_dict refuses it, naming the parameter and both
    layouts, and leaves the state as it was: through DCP and through a full state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    folder = os.path.join(OUT, "q8-layout")
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(32, 256, generator=gen), torch.randn(32, 256, generator=gen)

    def make(mesh, places):
        m = torch.nn.Module()
        m.w = torch.nn.Parameter(distribute_tensor(w, mesh, places))
        m.w.grad = distribute_tensor(g, mesh, places)
        o = vega.optim.AdamW(m.parameters(), lr=1e-2, state_dtype=torch.uint8)
        o.step()
        return m, o
    m1, o1 = make(init_device_mesh("cpu", (WORLD,)), [Shard(0)])
    msd, osd = get_state_dict(m1, o1)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    full = StateDictOptions(full_state_dict=True)
    whole = get_state_dict(m1, o1, options=full)[1]
    m2, o2 = make(init_device_mesh("cpu", (2, WORLD // 2)), [Shard(0), Shard(1)])
    assert o2.state[m2.w]["mu_absmax"].shape == o1.state[m1.w]["mu_absmax"].shape == (4, 8)
    before = {k: v.to_local().clone() for k, v in o2.state[m2.w].items()
              if type(v).__name__ == "DTensor"}
    msd, osd = get_state_dict(m2, o2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    for given, options in ((state["optim"], None), (whole, full)):
        for k, v in before.items():  # (dcp.load writes the optimizer's tensors in place)
            o2.state[m2.w][k].to_local().copy_(v)
        try:
            set_state_dict(m2, o2, model_state_dict={}, optim_state_dict=given,
                           options=options)
            raise AssertionError("8-bit state loaded into shards cut otherwise")
        except ValueError as err:
            assert "parameter w were saved from shards cut as 'Shard(dim=0) over 4'" in \
                str(err) and "'Shard(dim=0) over 2, Shard(dim=1) over 2'" in str(err), err
        for k, v in before.items():
            assert torch.equal(o2.state[m2.w][k].to_local(), v), k
    # a checkpoint whose groups hold no vega_q8_shards or vega_q8_maps (an older vega's):
    # refused by dcp.load, and loaded on the same cut with allow_partial_load
    # (docs/distributed.md), bitwise
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException
    msd, osd = get_state_dict(m1, o1)
    for group in osd["param_groups"]:
        del group[quant.LAYOUT_KEY], group[torch_names.Q8_MAPS_KEY]
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder + "-without")
    m3, o3 = make(init_device_mesh("cpu", (WORLD,)), [Shard(0)])
    o3.step()  # (other state than o1's)
    for planner in (None, DefaultLoadPlanner(allow_partial_load=True)):
        msd, osd = get_state_dict(m3, o3)
        state = {"model": msd, "optim": osd}
        try:
            dcp.load(state, checkpoint_id=folder + "-without", planner=planner)
        except CheckpointException as err:  # (each rank's error)
            assert planner is None and "Missing key in checkpoint state_dict: " \
                "optim.param_groups.0.vega_q8_" in str(err), err
            continue
        set_state_dict(m3, o3, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for k, v in o1.state[m1.w].items():
        if k != "step":
            v = v.to_local()
        assert torch.equal(o3.state[m3.w][k].to_local() if k != "step" else
                           o3.state[m3.w][k], v), k
    found["q8-layout"] = "refused"


def sharded_from_plain(net, opt, plain, opt_plain, strict: bool = False) -> float:
    """The largest difference between the parameters and every state of a sharded model's
    optimizer and those of the same model stepped unsharded (8-bit scales, a row of blocks
    per shard, compared flat); each parameter holds the same states, of the same shapes
    (``strict``: and dtypes, each state but the counter a DTensor)."""
    worst = 0.0
    for (n, p), q in zip(net.named_parameters(), plain.parameters()):
        worst = max(worst, (p.full_tensor() - q).abs().max().item())
        assert opt.state[p].keys() == opt_plain.state[q].keys(), (n, opt.state[p].keys())
        for key, s in opt.state[p].items():
            ref = opt_plain.state[q][key]
            assert not strict or key == "step" or type(s).__name__ == "DTensor", (n, key)
            if type(s).__name__ == "DTensor":
                s = s.full_tensor()
            if key.endswith("_absmax"):
                s = s.reshape(-1)
            assert s.shape == ref.shape, (n, key, s.shape, ref.shape)
            assert not strict or s.dtype == ref.dtype, (n, key, s.dtype, ref.dtype)
            worst = max(worst, (s.double() - ref.double()).abs().max().item())
    return worst


def hsdp_against_reference(name: str) -> None:
    """HSDP over a 2 x (WORLD / 2) mesh against the same model stepped in this process on the
    reference backend, five steps with max_grad_norm and a dynamic loss scale (a NaN in one
    rank's shard in the third: every rank skips it, as the plain run does, and the scales
    agree), parameters and every state."""
    from torch.distributed.device_mesh import init_device_mesh
    cls, hypers = OPTIMIZERS[name]
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    plain = model()
    net = sharded(copy.deepcopy(plain), mesh)
    scales = [vega.LossScale.dynamic(init=1024.0, growth_interval=2) for _ in range(2)]
    opt_plain = cls(plain.parameters(), max_grad_norm=1.0, backend="reference",
                    loss_scale=scales[0], **hypers)
    opt = cls(net.parameters(), max_grad_norm=1.0, loss_scale=scales[1], **hypers)
    for k in range(5):
        for m, o in ((plain, opt_plain), (net, opt)):
            o.zero_grad()
            o.loss_scale.scale(loss_of(m, k)).backward()
        if k == 2:
            next(iter(plain.parameters())).grad.view(-1)[0] = float("nan")
            if RANK == WORLD - 1:
                next(iter(net.parameters())).grad.to_local().view(-1)[0] = float("nan")
        opt_plain.step()
        opt.step()
    worst = sharded_from_plain(net, opt, plain, opt_plain, strict=True)
    for a, b in zip(scales[0].tensors(), scales[1].tensors()):
        assert torch.equal(a, b), (name, a, b)
    assert int(scales[1].skipped_steps) == 1, scales[1].tensors()
    found[f"scaled-hsdp-{name}"] = worst


def three_placements() -> None:
    """One 2 x 2 mesh, parameters placed four ways at once: Shard(0) x Replicate (each value
    on two ranks), Replicate x Replicate (on four), Shard(0) x Shard(1) (on one; Shard(0) x
    Shard(0) for the rules with reductions along an axis, which refuse a matrix split along
    both) and Replicate x Shard(0): the global norm, the clip, and three steps with
    max_grad_norm of a rule of each kind of reduction equal those of the whole tensors in
    one process (on the reference backend), parameters and every state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    gen = torch.Generator().manual_seed(5)
    shapes = [(8, 6), (5,), (8, 8), (6, 3)]
    places = [[Shard(0), Replicate()], [Replicate(), Replicate()], [Shard(0), Shard(1)],
              [Replicate(), Shard(0)]]
    whole = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=torch.float64) * 3 for s in shapes]
    dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, places)]
    out = {}
    out["norm"] = abs(vega.global_norm(dgrads) - vega.global_norm(grads)).item()
    out["clip"] = max((a.full_tensor() - b).abs().max().item() for a, b in zip(
        vega.clip_by_global_norm(dgrads, 1.0), vega.clip_by_global_norm(grads, 1.0)))
    for cname in ("AdamW", "LAMB", "SGD", "per_tensor", "Adafactor", "reductions", "Prodigy"):
        cls, hypers = OPTIMIZERS[cname]
        if cname in ("Adafactor", "reductions"):  # (no matrix split along both axes)
            places[2] = [Shard(0), Shard(0)]
            dgrads = [distribute_tensor(g, mesh, pl) for g, pl in zip(grads, places)]
        ps = [torch.nn.Parameter(x.clone()) for x in whole]
        dps = [torch.nn.Parameter(distribute_tensor(x, mesh, pl)) for x, pl in zip(whole, places)]
        o1 = cls(ps, max_grad_norm=1.0, backend="reference", **hypers)
        o2 = cls(dps, max_grad_norm=1.0, **hypers)
        for k in range(3):
            for p, g in zip(ps, grads):
                p.grad = g * (k + 1)
            for p, g in zip(dps, dgrads):
                p.grad = g * (k + 1)
            o1.step()
            o2.step()
        worst = 0.0
        for p, q in zip(dps, ps):
            worst = max(worst, (p.full_tensor() - q).abs().max().item())
            for key, s in o2.state[p].items():
                if key != "step":
                    s = s.full_tensor()
                worst = max(worst, (s.double() - o1.state[q][key].double()).abs().max().item())
        out[cname] = worst
    for key, worst in out.items():
        assert worst <= 1e-9, (key, worst)
    found["three-placements"] = out


def scaled_hsdp_q8() -> None:
    """``hsdp_against_reference`` of 8-bit AdamW (the weight whose shards start on block
    boundaries; the others in float32), an inf in one rank's shard: its codes and scales
    equal the reference's too."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    plain = q8_model()
    net = sharded(copy.deepcopy(plain), mesh)
    scales = [vega.LossScale.dynamic(init=1024.0, growth_interval=2) for _ in range(2)]
    opts = [vega.optim.AdamW([{"params": list(m.parameters())[:1], "state_dtype": torch.uint8},
                              {"params": list(m.parameters())[1:]}], max_grad_norm=1.0,
                             lr=1e-2, weight_decay=0.1, loss_scale=s, **kw)
            for m, s, kw in ((plain, scales[0], {"backend": "reference"}), (net, scales[1], {}))]
    for k in range(5):
        for m, o in zip((plain, net), opts):
            o.zero_grad()
            o.loss_scale.scale(q8_loss(m, k)).backward()
        if k == 2:
            next(iter(plain.parameters())).grad.view(-1)[0] = float("inf")
            if RANK == 0:
                next(iter(net.parameters())).grad.to_local().view(-1)[0] = float("inf")
        for o in opts:
            o.step()
    worst = 0.0
    for p, q in zip(net.parameters(), plain.parameters()):
        worst = max(worst, (p.full_tensor() - q).abs().max().item())
        for key, s in opts[1].state[p].items():
            r = opts[0].state[q][key]
            if key != "step":
                s = s.full_tensor()
            if key.endswith("_absmax"):
                s = s.reshape(-1)
            assert s.dtype == r.dtype and s.shape == r.shape, (key, s.shape, r.shape)
            worst = max(worst, (s.double() - r.double()).abs().max().item())
    assert opts[1].state[next(iter(net.parameters()))]["mu"].dtype == torch.uint8
    for a, b in zip(scales[0].tensors(), scales[1].tensors()):
        assert torch.equal(a, b), (a, b)
    found["scaled-hsdp-q8"] = worst


def dtensor_reduce_group() -> None:
    """A 2 x 2 mesh (dp, tp): each dp rank holds its own parameters (as under ZeRO), each
    sharded over the tp submesh; reduce_group the dp group. The clip's norm spans all four
    shards of both sets; LAMB's per-tensor norms the tp mesh alone; Prodigy's sums over the
    group both. Against one process over both sets."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh.get_group("dp")
    d = mesh.get_coordinate()[0]
    gen = torch.Generator().manual_seed(9)
    sets = [[torch.randn(6, 4, generator=gen, dtype=torch.float64),
             torch.randn(5, generator=gen, dtype=torch.float64)] for _ in range(2)]
    grads = [[torch.randn(x.shape, generator=gen, dtype=torch.float64) * 4 for x in s]
             for s in sets]
    out = {"norm": abs(vega.global_norm([distribute_tensor(g, tp, [Shard(0)])
                                         for g in grads[d]], reduce_group=dp)
                       - vega.global_norm(grads[0] + grads[1])).item()}
    for cname in ("AdamW", "LAMB", "Prodigy"):
        cls, hypers = OPTIMIZERS[cname]
        ps = [torch.nn.Parameter(x.clone()) for x in sets[0] + sets[1]]
        dps = [torch.nn.Parameter(distribute_tensor(x, tp, [Shard(0)])) for x in sets[d]]
        o1 = cls(ps, max_grad_norm=1.0, **hypers)
        o2 = cls(dps, max_grad_norm=1.0, reduce_group=dp, **hypers)
        for k in range(3):
            for p, g in zip(ps, grads[0] + grads[1]):
                p.grad = g * (k + 1)
            for p, g in zip(dps, grads[d]):
                p.grad = distribute_tensor(g * (k + 1), tp, [Shard(0)])
            o1.step()
            o2.step()
        out[cname] = max((p.full_tensor() - q).abs().max().item()
                         for p, q in zip(dps, ps[2 * d:2 * d + 2]))
    for key, worst in out.items():
        assert worst <= 1e-9, (key, worst)
    every = torch.tensor(list(out.values()), dtype=torch.float64)  # (each dp rank its set)
    dist.all_reduce(every, op=dist.ReduceOp.MAX)
    found["dtensor-reduce-group"] = dict(zip(out, every.tolist()))


def reshard(phase: str, name: str, layout: str = "fsdp") -> None:
    """A DCP checkpoint moved between 2 and 4 ranks: ``save`` two steps of ``name``'s class
    under FSDP2 with max_grad_norm; ``load`` on the other number of ranks (the checkpoint
    of a launch of 4 on 2, of 2 on 4), two more steps: equal to four steps of the same
    optimizer unsharded, parameters and every state. ``layout``: this launch's mesh, "fsdp"
    (1-D) or "hsdp" (2 x WORLD / 2). A name ending in ``q8``: the first weight's state in
    8 bits, whose shards must be cut alike on both (FSDP2's 2 and HSDP's 2 x 2)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    q8 = name.endswith("q8")
    cls, hypers = OPTIMIZERS[name.removesuffix("q8")]
    saved = WORLD if phase == "save" else {2: 4, 4: 2}[WORLD]
    folder = os.path.join(os.path.dirname(OUT.rstrip("/")), f"reshard-{name}-{saved}")
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")) \
        if layout == "hsdp" else None
    make = q8_model if q8 else model
    loss = q8_loss if q8 else loss_of

    def optimizer(m):
        ps = list(m.parameters())
        groups = [{"params": ps[:1], "state_dtype": torch.uint8}, {"params": ps[1:]}] \
            if q8 else ps
        return cls(groups, max_grad_norm=1.0, **hypers)
    net = sharded(make(), mesh)
    opt = optimizer(net)

    def steps(m, o, ks):
        for k in ks:
            o.zero_grad()
            loss(m, k).backward()
            o.step()
    if phase == "save":
        steps(net, opt, range(2))
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        found[f"reshard-saved-{name}"] = WORLD
        return
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps(net, opt, range(2, 4))
    plain = make()
    opt_plain = optimizer(plain)
    steps(plain, opt_plain, range(4))
    worst = sharded_from_plain(net, opt, plain, opt_plain)
    assert worst <= 1e-9, (name, worst)
    found[f"reshard-{name}"] = worst


def main() -> None:
    # (the ranks meet through a file of the test's own folder: no port to share)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(OUT, 'rendezvous')}",
                            rank=RANK, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("cpu", (WORLD,))
    for check in CHECKS:
        if check in OPTIMIZERS:
            fsdp_against_unsharded(check)
        elif check.startswith("meta-"):
            fsdp_against_unsharded(check.removeprefix("meta-"), meta=True)
        elif check.startswith("hsdp-"):
            fsdp_against_unsharded(check.removeprefix("hsdp-"), hybrid=True)
        elif check == "triton-nan":  # (LAMB's norms, split by shards, in Triton's phases)
            nan_skips_with(vega.optim.LAMB, backend="triton")
            found[check] = "skipped"
        elif check.startswith("zero-save-"):
            zero_save(check.removeprefix("zero-save-"))
        elif check.startswith("full-"):
            full_state_dict(check.removeprefix("full-"))
        elif check == "scaled-hsdp-q8":
            scaled_hsdp_q8()
        elif check.startswith("scaled-hsdp-"):
            hsdp_against_reference(check.removeprefix("scaled-hsdp-"))
        elif check.startswith("reshard-"):
            reshard(*check.removeprefix("reshard-").split("-"))
        elif check.startswith("triton-"):
            fsdp_against_unsharded(check.removeprefix("triton-"), backend="triton")
        else:
            {"nan": nan_skips, "dcp": dcp_resume, "zero": zero_against_ddp,
             "dcp-ddp": lambda: dcp_resume("ddp"), "docs": docs_example,
             "functions": functions_over_group, "muon-fsdp": muon_refused,
             "uneven": uneven_refused, "split": split_refused,
             "without-prelude": without_prelude, "mixed-placements": mixed_placements,
             "q8": q8_shards, "q8-layout": q8_other_layout,
             "three-placements": three_placements,
             "dtensor-reduce-group": dtensor_reduce_group, "q8-load": q8_loads,
             "q8-hsdp": lambda: q8_shards(hybrid=True),
             "q8-move-save": lambda: q8_move("save"), "q8-move-load": lambda: q8_move("load"),
             "dcp-q8": lambda: dcp_resume("fsdp", q8=True),
             "zero-prodigy": lambda: zero_against_ddp(vega.optim.Prodigy, 1.0,
                                                      "zero-prodigy", d0=1e-3)}[check]()
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(found))


def fork_ranks() -> None:
    """Every rank, each a child forked from this process (whose imports, and the specs
    compiled above, the children share), its stdout and stderr in OUT/rank<r>.log. Prints a
    JSON line [rank, exit status] as each ends (an exception: its traceback, status 1); where
    one fails, the others, which would wait for it in a collective, are killed at once."""
    from tests import forks

    def rank(r: int) -> None:
        global RANK
        RANK = r
        tempfile.tempdir = OUT
        main()

    forks.fork_each(list(range(WORLD)), rank,
                    lambda k, r: [os.path.join(OUT, f"rank{r}.log")] * 2, kill_on_failure=True)


if __name__ == "__main__":
    if RANK is None:
        fork_ranks()
        os._exit(0)
    tempfile.tempdir = OUT
    main()
    # (every check ran and its answer is printed: no interpreter teardown, where gloo's threads
    # ended a rank of a loaded machine with "terminate called without an active exception"
    # after its answer, once in many runs)
    sys.stdout.flush()
    os._exit(0)
