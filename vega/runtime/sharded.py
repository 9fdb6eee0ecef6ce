"""Steps over tensors spread over processes: DTensor parameters (FSDP2's ``fully_shard``,
tensor parallel) and reductions across a process group (``reduce_group``: the parameters of
``ZeroRedundancyOptimizer``, each rank holding its own).

A DTensor's step runs on its local shard (``to_local()`` of the parameter, its gradient and
its state) in the same kernels as a plain tensor's. What a step reduces is computed here
as a partial result per process and combined across processes, all the tensors of a step in
one buffer, one collective per stage:

- the prelude's record (the gradients' sum of squares and non-finite count, which the
  global norm of ``max_grad_norm`` and the skip decision read): summed over the DTensors'
  mesh, then over ``reduce_group``, so that every rank clips by the same norm and skips
  the same steps;
- a spec's reductions of one tensor (LAMB's norms, ``sum``, ``mean``, ``max``) and along
  an axis (Adafactor's row and column means) where the shard holds part of what they
  reduce: each stage of a kernel's staged step (``Kernel.staged``, the stages of
  ``vega.codegen.reference.stages``) yields its partial results, which are combined over
  the mesh and given back. The C and Triton kernels run such a step for programs of
  element values and for those over a matrix view without reductions over a group
  (``Kernel.stageable``); the reference's staged step runs the others.

A state is a DTensor on its parameter's mesh: sharded as the parameter where it keeps the
sharded axis, replicated where it reduces that axis away (Adafactor's per-row factor of a
matrix sharded along its rows is sharded, the per-column one replicated), so that the
state dicts of FSDP2 and of ``torch.distributed.checkpoint`` hold it as torch's own.

Nothing is read back to the host: collectives run on the tensors where they lie.
"""
from __future__ import annotations

import sys
from itertools import repeat

import torch

from vega import codegen
from vega.codegen import quant
from vega.codegen.base import (Geometry, ShardView, geometry, refuse_split_results,
                               state_shape)
from vega.codegen.steps import drive
from vega.codegen.tensors import PLAIN_TYPES, any_complex, is_dtensor, on_one_device
from vega.dsl.check import matrix_axes
from vega.dsl.ir import QBLOCK, SCALAR_STATE, walk
from vega.runtime import engine


def check_group(owner: str, group) -> None:
    """``reduce_group``: None or a process group of an initialized ``torch.distributed``;
    ValueError naming it."""
    if group is None:
        return
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{owner}: reduce_group={engine.shown(group)} needs torch.distributed "
                         "initialized (torch.distributed.init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{owner}: reduce_group={engine.shown(group)} must be a "
                         "torch.distributed process group (or None: no reduction across "
                         "processes)")


# A whole optimizer's settings that are objects of its own (a process group, a loss scale),
# not values: ZeroRedundancyOptimizer keeps the keywords it passes on in its parameter groups
# and copies them into the groups of the optimizer it wraps, where they are the optimizer's.
OWN_OBJECTS = ("reduce_group", "loss_scale")


def _own_objects(optimizer, group: dict) -> list[str]:
    """The keys of ``OWN_OBJECTS`` that ``group`` holds as ``optimizer``'s own objects."""
    return [k for k in OWN_OBJECTS
            if group.get(k) is not None and group[k] is getattr(optimizer, k, None)]


def warn_group_objects(owner: str, optimizer, group: dict) -> None:
    """Warn where a parameter group holds ``optimizer``'s process group or loss scale (as
    ``ZeroRedundancyOptimizer``'s groups do where they are its keywords): its state dict, of
    those groups, cannot be saved (a process group cannot be pickled), and a loaded one
    would hold another loss scale object. Given through ``functools.partial``, they stay
    out of the groups."""
    from vega.errors import warn
    held = _own_objects(optimizer, group)
    if held:
        given = ", ".join(f"{k}=..." for k in held)
        warn(
            f"{owner}: a parameter group holds this optimizer's {' and '.join(held)} (as "
            "ZeroRedundancyOptimizer keeps the keywords it passes on in its groups): a state "
            "dict of such groups cannot be saved (a process group cannot be pickled) or "
            f"loaded; give them with optimizer_class=functools.partial({owner}, {given}) "
            "(docs/distributed.md)")


def without_group_objects(optimizer, state_dict: dict) -> dict:
    """``state_dict`` with each group's entries of ``OWN_OBJECTS`` that are ``optimizer``'s
    own left out: not state (the loss scale's tensors are saved beside the groups), and a
    process group cannot be pickled (``ZeroRedundancyOptimizer.consolidate_state_dict``
    pickles the state dict of the optimizer it wraps)."""
    groups = state_dict.get("param_groups") or []
    held = [_own_objects(optimizer, g) for g in groups]
    if not any(held):
        return state_dict
    return {**state_dict, "param_groups": [{k: v for k, v in g.items() if k not in keys}
                                           for g, keys in zip(groups, held)]}


def group_device(group) -> torch.device:
    """Where a tensor the collectives of ``group`` take lives: this process's CUDA device
    for an NCCL group, the CPU otherwise (gloo; None: no group)."""
    if group is not None:
        import torch.distributed as dist
        if "nccl" in str(dist.get_backend(group)).lower():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def involved(params, reduce_group) -> bool:
    """Whether a step over ``params`` reduces across processes: a group is given, or a
    parameter is a DTensor."""
    if reduce_group is not None:
        return True
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or PLAIN_TYPES.issuperset(map(type, params)):  # (one pass over types)
        return False
    return any(map(isinstance, params, repeat(mod.DTensor)))


def view_of(where: str, t) -> ShardView:
    """The ``ShardView`` of a DTensor: its local shard's matrix view with the whole
    tensor's axes, the axes its placements split, and the weight of its partial sums.
    ValueError for a placement whose local values are partial sums (``Partial``)."""
    shape = tuple(t.shape)
    split, replicas = _placed(where, t)
    local = tuple(t.to_local().shape)
    return ShardView(Geometry(local, axes=matrix_axes(shape)), geometry(shape),
                     frozenset(split), 1.0 / replicas)


def _placed(where: str, t) -> tuple[set, int]:
    """(the axes the placements of DTensor ``t`` split, how many ranks hold each of its local
    values); ValueError for ``Partial`` placements."""
    mesh = t.device_mesh
    split, replicas = set(), 1
    for dim, pl in enumerate(t.placements):
        if pl.is_shard():
            if mesh.size(dim) > 1:
                split.add(pl.dim % t.dim())
        elif pl.is_replicate():
            replicas *= mesh.size(dim)
        else:
            raise ValueError(f"{where} is a DTensor with placements {tuple(t.placements)}: "
                             f"its local values are not its own ({pl}); redistribute it to "
                             "Shard or Replicate placements before the step")
    return split, replicas


def spanning_sum(owner: str, leaves, part, reduce_group) -> torch.Tensor:
    """``sum(part(x) for x in leaves)`` over every rank's leaves: a DTensor leaf adds
    ``part`` of its local shard (divided by the number of ranks holding each of its values,
    so that a replicated value counts once), and the sum is all-reduced over the leaves'
    mesh, then over ``reduce_group``: one collective each, whatever the number of leaves.
    ``part`` returns a 0-d tensor; the leaves are all DTensors on one mesh or all plain.
    Every rank of the group must call it (with no leaf, its sum is ``part``'s zero, on the
    group's device). The sum is float64 on every rank, whatever the leaves' dtypes (ranks
    holding float32 and float64 leaves reduce one buffer alike)."""
    box: list = []
    total = None
    for i, x in enumerate(leaves):
        where = f"{owner}: leaf {i}"
        if join_mesh(where, x, box, "a reduction", "one reduction spans one mesh"):
            _, replicas = _placed(where, x)
            value = part(x.to_local())
            value = value / replicas if replicas > 1 else value
        else:
            value = part(x)
        value = value.to(torch.float64)
        total = value if total is None else total + value.to(total.device)
    if total is None:
        total = part(torch.zeros(0, device=group_device(reduce_group))).to(torch.float64)
    mesh = box[0] if box else None
    groups = (mesh_groups(mesh) if mesh is not None else []) + (
        [reduce_group] if reduce_group is not None else [])
    return combine([("sum", total.reshape(1))], groups)[0].reshape(())


def join_mesh(where: str, x, box: list, what: str, one_mesh: str) -> bool:
    """Whether ``x`` (``where`` names it) is a DTensor, checked against the tensors before
    it: ``box`` holds nothing before the first, then ``[None]`` where they are plain, or
    ``[their mesh]``. ValueError where ``x`` mixes plain tensors and DTensors in ``what``
    (a step, a reduction), or is on another mesh (``one_mesh`` says what to do)."""
    if not is_dtensor(x):
        if box and box[0] is not None:
            raise ValueError(f"{where} is a plain tensor, others DTensors: {what} over "
                             "DTensors takes DTensors only (shard every module with "
                             "fully_shard, or step the plain ones with an optimizer of their "
                             "own)")
        box[:] = [None]
        return False
    if box and box[0] is None:
        raise ValueError(f"{where} is a DTensor, others plain tensors: {what} over DTensors "
                         "takes DTensors only")
    if not box:
        box.append(x.device_mesh)
    elif x.device_mesh != box[0]:
        raise ValueError(f"{where} is a DTensor on mesh {x.device_mesh}, another on "
                         f"{box[0]}: {one_mesh}")
    return True


def rewrapped(new: torch.Tensor, like):
    """``new``, a local tensor, as a DTensor with the mesh, placements, shape and strides of
    DTensor ``like``; ``new`` itself where ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return new
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(new, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def replicated_scalar(p, value: torch.Tensor):
    """``value``, a plain tensor of one number, as DTensor ``p``'s state of one number:
    replicated over ``p``'s mesh, on its local device (``state_placements``)."""
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value.reshape(()).to(p.to_local().device), p.device_mesh,
                              state_placements(p, SCALAR_STATE), run_check=False)


def state_placements(p, dom: str) -> tuple:
    """The placements of a state of domain ``dom`` of DTensor ``p``: ``p``'s, each
    ``Shard`` of an axis the state has moved to where that axis sits in the state, and
    ``Replicate`` where the state reduces the axis away."""
    from torch.distributed.tensor import Replicate, Shard
    if dom == "rc":
        return tuple(p.placements)
    if dom == SCALAR_STATE:  # one number, the same on every rank
        return tuple(Replicate() for _ in p.placements)
    if dom == QBLOCK:  # an 8-bit state's scales: a row per shard
        return quant.scale_placements(p)
    geo = geometry(tuple(p.shape))
    out = []
    for pl in p.placements:
        if pl.is_shard():
            axis = pl.dim % p.dim()
            out.append(Shard(geo.position(axis, dom)) if geo.keeps(dom, axis) else Replicate())
        else:
            out.append(pl)
    return tuple(out)


def _strides(shape) -> tuple[int, ...]:
    out, at = [], 1
    for n in reversed(shape):
        out.append(at)
        at *= max(n, 1)
    return tuple(reversed(out))


def init_leaf(program, p, values: dict, state_dtype, where="") -> list:
    """The initial state of DTensor ``p``: made on its local shard, each a DTensor of
    ``state_placements``. ``where``: the parameter a refusal names (or a function giving
    it)."""
    from torch.distributed.tensor import DTensor
    at = engine.at_where(where) or f"{program.name}: a parameter"
    if p.is_complex():
        raise ValueError(f"{at} is a complex DTensor, which does not step; vega steps "
                         "complex parameters that are plain tensors")
    local = p.to_local()
    view = view_of(at, p)
    sd = engine.state_dtypes(local, program, state_dtype, where)
    kern = codegen.kernel("reference", program)
    out = []
    for s, leaf in zip(program.states, kern.init(local, values, sd, geo=view.local)):
        if s.dom == QBLOCK:  # (a row per shard: quant.scale_shape)
            out.append(quant.scales_of(leaf, p))
            continue
        shape = state_shape(p, s.dom)
        out.append(DTensor.from_local(leaf, p.device_mesh, state_placements(p, s.dom),
                                      run_check=False, shape=torch.Size(shape),
                                      stride=_strides(shape)))
    return out


def mesh_groups(mesh) -> list:
    """The process groups a sum over every rank of ``mesh`` runs through, one per mesh
    dimension of more than one rank (one for FSDP2's one-dimensional mesh)."""
    return [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]


def combine(parts: list[tuple[str, torch.Tensor]], groups: list) -> list[torch.Tensor]:
    """Each partial result of ``parts`` (``(how, float64 tensor)``, how: "sum" or "max")
    combined over every rank of ``groups``: one buffer, one collective per group (an
    all-reduce of sums; an all-gather where there is a maximum, combined here, where a NaN
    wins as in one process)."""
    import torch.distributed as dist
    if not parts or not groups:
        return [x for _, x in parts]
    sums = [x.reshape(-1) for how, x in parts if how == "sum"]
    maxes = [x.reshape(-1) for how, x in parts if how == "max"]
    nsum = sum(x.numel() for x in sums)
    buf = torch.cat(sums + maxes) if len(parts) > 1 else parts[0][1].reshape(-1).clone()
    for group in groups:
        if not maxes:
            dist.all_reduce(buf, group=group)
            continue
        size = dist.get_world_size(group)
        every = buf.new_empty(size * buf.numel())
        dist.all_gather_into_tensor(every, buf, group=group)
        every = every.view(size, -1)
        buf = torch.cat([every[:, :nsum].sum(0), every[:, nsum:].amax(0)])
    out, at_sum, at_max = [], 0, nsum
    for how, x in parts:
        n = x.numel()
        if how == "sum":
            out.append(buf[at_sum:at_sum + n].reshape(x.shape))
            at_sum += n
        else:
            out.append(buf[at_max:at_max + n].reshape(x.shape))
            at_max += n
    return out


class _Local:
    """One ``engine.run`` call's tensors as this process holds them: the local shards of
    DTensors (plain tensors as they are), each tensor's ``ShardView``, and how to make the
    new values DTensors again."""

    def __init__(self, owner: str, item, mesh_box: list, plain: bool = False):
        program, backend, params, grads, states, steps, values = item
        if isinstance(values, dict):  # (a class's group: one dict for all its tensors)
            values = [values] * len(params)
        self.program, self.backend, self.steps, self.values = program, backend, steps, values
        self.params, self.grads, self.states = params, grads, states
        self.complex = None  # (params, states) where stepped as real views (``fused``)
        if plain and params and (not mesh_box or mesh_box[0] is None):
            # every tensor known to be a plain one (the class step's ``PLAIN_TYPES``), as
            # are the items' before it: all of them this process's, as they are
            mesh_box[:] = [None]
            self.views = [None] * len(params)
            self.lp, self.lg, self.ls = list(params), list(grads), [list(c) for c in states]
            return
        self.views = []
        self.lp, self.lg = [], []
        self.ls = [[] for _ in states]
        for i, p in enumerate(params):
            where = f"{owner}: parameter {i}"
            if not join_mesh(where, p, mesh_box, "a step", "one step reduces over one mesh; "
                             "give each mesh's parameters an optimizer of their own"):
                self.views.append(None)
                self.lp.append(p)
                self.lg.append(grads[i])
                for col, out in zip(states, self.ls):
                    out.append(col[i])
                continue
            self.views.append(view_of(where, p))
            if program.uses_axes and len(self.views[-1].split) > 1:
                try:  # (every backend refuses it in its step, naming no parameter)
                    refuse_split_results(walk(node for _, node in program.updates),
                                         self.views[-1:])
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
            if program.needs_whole and self.views[-1].split:
                raise ValueError(
                    f"{where} is a DTensor split over processes (placements "
                    f"{tuple(p.placements)}), but {program.name}'s matrix operations (@, "
                    "transpose) and size(p, k) need each tensor whole on one process; step "
                    "such a rule under DDP or ZeroRedundancyOptimizer (reduce_group), or "
                    "keep its tensors replicated")
            self.lp.append(p.to_local())
            self.lg.append(self._local(f"{where}'s gradient", grads[i], p, tuple(p.placements)))
            for s, col, out in zip(program.states, states, self.ls):
                x = self._local(f"{where}'s state '{s.name}'", col[i], p,
                                state_placements(p, s.dom))
                if s.dom == QBLOCK:  # the scales of this shard's blocks, in its row
                    want = quant.scale_shape(p)
                    if tuple(col[i].shape) != want:
                        raise ValueError(
                            f"{where}'s state '{s.name}' has shape {tuple(col[i].shape)}, but "
                            f"the 8-bit scales of a DTensor of shape {tuple(p.shape)} placed "
                            f"{tuple(p.placements)} on {p.device_mesh} have shape {want} (a "
                            "row per shard: docs/distributed.md)")
                    x = quant.shard_scales(x, self.lp[-1].numel())
                out.append(x)

    @staticmethod
    def _local(where: str, x, p, placements):
        if not is_dtensor(x):
            raise ValueError(f"{where} is a {type(x).__name__}, not a DTensor like its "
                             "parameter")
        if x.device_mesh != p.device_mesh or tuple(x.placements) != tuple(placements):
            raise ValueError(f"{where} has placements {tuple(x.placements)} on "
                             f"{x.device_mesh}; the step needs {tuple(placements)} on "
                             f"{p.device_mesh}")
        return x.to_local()

    def staged(self) -> bool:
        """Whether a reduction of this call's program spans processes, or every tensor of
        its group (``global_sum``)."""
        return self.program.spans_group or any(v is not None and v.split for v in self.views) \
            and codegen.kernel("reference", self.program).nstages > 0

    def wrap(self, result):
        """``engine.run``'s answer over the locals, with new values DTensors again."""
        new_p, new_s, new_steps, finite = result
        return ([rewrapped(n, o) for n, o in zip(new_p, self.params)],
                [[quant.scales_of(n, p) if st.dom == QBLOCK else rewrapped(n, o)
                  for n, o, p in zip(ncol, col, self.params)]
                 for st, ncol, col in zip(self.program.states, new_s, self.states)],
                new_steps, finite)


def check_meta(owner: str, tensors: list, name, why: str, group_of=None) -> None:
    """ValueError, naming two of ``tensors``, where those of one group (``group_of(k)``,
    tensor ``k``'s; None: one group) are some on meta and some not: what ``why`` says spans
    the group, and a meta tensor has no values to add to the others'. ``name(k)`` names
    tensor ``k`` in the message; ``why`` ends in who steps on meta all together."""
    if on_one_device(tensors):
        return  # (the common case: one pass, native where the module is loaded)
    first: dict = {}  # group -> (is_meta, k) of its first tensor
    for k, t in enumerate(tensors):
        seen = first.setdefault(0 if group_of is None else group_of(k), (t.is_meta, k))
        if seen[0] == t.is_meta:
            continue
        meta, real = (k, seen[1]) if t.is_meta else (seen[1], k)
        raise ValueError(f"{owner}: {name(meta)} is on meta, which holds no values, and "
                         f"{name(real)} on {tensors[real].device}: {why} on meta all "
                         "together or not at all (a model made on meta: move it with "
                         "to_empty, then make its optimizer)")


def check_meta_sums(owner: str, items, group_of, name) -> None:
    """ValueError, naming a parameter, where a parameter group whose rule sums over it
    (``spans_group``: Prodigy's, D-Adaptation's) holds parameters on meta beside others: the
    sum adds every tensor's part, and a meta tensor has none (the reference's step failed
    inside the sum, or wrote the other parameters before it failed on the meta one's write).
    ``items``: a step's calls (``fused``'s); ``group_of``: each one's parameter group (None:
    one group); ``name(j, k)``: parameter ``k`` of call ``j`` in a message."""
    tensors = [p for item in items if item[0].spans_group for p in item[2]]
    if on_one_device(tensors):
        return  # (the common case: one pass, native where the module is loaded)
    at = [(j, k) for j, item in enumerate(items) if item[0].spans_group
          for k in range(len(item[2]))]
    check_meta(owner, tensors, lambda i: name(*at[i]),
               "the rule sums over its parameter group, so a group steps",
               None if group_of is None else lambda i: group_of[at[i][0]])


def fused(owner: str, items, inv_scale, max_norm, check: bool, donate: bool,
          reduce_group=None, group_of=None, spans: bool = False, plain=None, name=None):
    """``engine.prelude`` over every item's gradients and ``engine.run`` of each item
    (``(program, backend, params, grads, states, steps, values)``, values a dict per
    tensor, or one for all), reducing across
    processes (the module's doc): returns (the prelude's record, each item's answer).
    ``group_of``: each item's parameter group, over whose tensors a spec's reductions over
    a group (``global_sum``) run (None: the items are one group). ``spans``: the spec has
    such reductions (a rank without tensors to step knows it so). ``plain``: for each item,
    whether its every tensor is known to be a plain one, not a DTensor (None: none known).
    ``name(j, k)``: how a refusal of the prelude names gradient ``k`` of item ``j``
    (``engine.prelude``)."""
    box: list = []
    locs = [_Local(owner, item, box, plain is not None and plain[k])
            for k, item in enumerate(items)]
    for loc in locs:  # (a step in stages over complex parameters: over their real views)
        if loc.staged() and any_complex(loc.lp):
            loc.complex = (loc.lp, loc.ls)
            loc.lp, loc.lg, loc.ls = engine.as_real(loc.program, loc.lp, loc.lg, loc.ls, donate)
    if reduce_group is not None and (spans or any(loc.program.spans_group for loc in locs)):
        _same_programs(owner, locs, group_of, reduce_group)
    mesh = box[0] if box else None
    groups = mesh_groups(mesh) if mesh is not None else []
    spanning = groups + ([reduce_group] if reduce_group is not None else [])
    weights = sorted({v.weight for loc in locs for v in loc.views if v is not None} or {1.0})
    pre = None
    for w in weights:  # (one class of weight, in the common case)
        kept = [[i for i, v in enumerate(loc.views) if (v.weight if v is not None else 1.0) == w]
                for loc in locs]
        part = engine.prelude([(loc.program, loc.backend, [loc.lg[i] for i in ks])
                               for loc, ks in zip(locs, kept)], inv_scale, max_norm, check,
                              name=None if name is None else
                              (lambda j, k, kept=kept: name(j, kept[j][k])))
        if part is None:
            break
        if pre is None:
            pre = part if w == 1 else _scaled(part, w)
        else:
            pre[:2] += part[:2] * w
    if pre is not None and spanning:
        pre[:2].copy_(combine([("sum", pre[:2].clone())], spanning)[0])
    results: list = [None] * len(locs)
    gens, kerns = {}, {}
    for k, loc in enumerate(locs):
        if loc.staged():
            kern = codegen.kernel(loc.backend, loc.program)
            if not getattr(kern, "stageable", False):  # (``Kernel.stageable``)
                kern = codegen.kernel("reference", loc.program)
            values = engine.tensor_values(loc.program, kern, loc.values, loc.steps)
            gens[k] = kern.staged(loc.lp, loc.lg, loc.ls, loc.steps, values, donate, pre,
                                  loc.views)
            kerns[k] = kern
        else:
            results[k] = engine.run(loc.program, loc.backend, loc.lp, loc.lg, loc.ls,
                                    loc.steps, loc.values, donate, pre)
    # (without a reduce_group, the reductions over a group span the mesh alone: one
    # collective a stage for both kinds)
    needs = {k: set(kern.global_keys.values()) for k, kern in kerns.items()}
    drive(gens, results, (lambda parts: combine(parts, groups)) if groups else None,
          (lambda parts: combine(parts, spanning))
          if reduce_group is not None else None, group_of, needs)
    for k, loc in enumerate(locs):
        if loc.complex is not None:
            new_p, new_s, new_steps, finite = results[k]
            results[k] = (*engine.as_complex(*loc.complex, loc.lp, loc.ls, new_p, new_s, donate),
                          new_steps, finite)
    if not donate:
        results = [loc.wrap(r) for loc, r in zip(locs, results)]
    return pre, results


def _same_programs(owner: str, locs, group_of, reduce_group) -> None:
    """Every rank of ``reduce_group`` steps the same programs in each parameter group (its
    tensors take the same branches of the spec's shape conditions), or the ranks' collectives
    of the reductions over a group would not match: one all-reduce of a signature of the
    programs, and a ValueError on every rank where they differ, never a wait."""
    import zlib

    import torch.distributed as dist
    held = sorted({(group_of[k] if group_of is not None else 0, loc.program.flags,
                    loc.program.shapes) for k, loc in enumerate(locs)
                   if loc.program.spans_group})
    sig = float(zlib.crc32(repr(held).encode()))
    both = torch.tensor([sig, -sig], dtype=torch.float64, device=group_device(reduce_group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=reduce_group)
    if float(both[0]) != -float(both[1]):
        raise ValueError(
            f"{owner}: the ranks of reduce_group step different programs of a rule with "
            "reductions over a parameter group (a rank without tensors in a group, or with "
            "tensors that take other branches of its shape conditions): their collectives "
            "would not match. Give every rank tensors of each group, alike in shape "
            "(docs/distributed.md)")


def _scaled(pre: torch.Tensor, w: float) -> torch.Tensor:
    pre[:2] *= w
    return pre
