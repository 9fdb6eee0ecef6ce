"""torch.optim's keywords on the optimizer classes: ``betas``, ``maximize``, ``foreach``,
``fused``, ``capturable`` and ``differentiable``.

``betas`` is a second name for a spec's ``b1``, ``b2``, ... (the hyperparameters a spec
names so), as Rprop's ``etas`` and ``step_sizes`` are for its ``etaminus``, ``etaplus`` and
``step_size_min``, ``step_size_max``, and Muon's ``ns_coefficients`` for its ``a``, ``b``,
``c`` (``tuple_keys``): a group holds both, and whichever a
caller (or a torch LR scheduler, as ``OneCycleLR(cycle_momentum=True)``) changes, the other
follows at the next step.
"""
from __future__ import annotations

import collections
import inspect
import itertools
import numbers

import torch

from vega.codegen import quant
from vega.errors import warn
from vega.runtime import engine

# torch's keywords that choose among its implementations; vega has one, fused
_IMPLEMENTATION_KEYWORDS = ("foreach", "fused", "capturable")


def beta_names(spec) -> tuple[str, ...]:
    """The spec's ``b1``, ``b2``, ... in order (``betas`` names them), or () for none."""
    names = {h.name for h in spec.hypers}
    out: list[str] = []
    while f"b{len(out) + 1}" in names:
        out.append(f"b{len(out) + 1}")
    return tuple(out)


def _same(x, y) -> bool:
    """The same value: the same object, or equal plain numbers."""
    if x is y:
        return True
    plain = (isinstance(x, numbers.Real) and isinstance(y, numbers.Real)
             and not isinstance(x, bool) and not isinstance(y, bool))
    return plain and x == y


def same_betas(a, b) -> bool:
    return len(a) == len(b) and all(map(_same, a, b))


def _shown_betas(names) -> str:
    return f"({', '.join(names)})"


def split_betas(owner: str, names: tuple, betas, given: dict, key: str = "betas") -> dict:
    """``betas`` as ``{b1: ..., b2: ...}``; ValueError where it is not a sequence of
    ``len(names)`` values, or where it disagrees with a value ``given`` by its own name.
    (``key``: torch's name of the tuple, for another of ``TUPLES``.)"""
    if not isinstance(betas, (tuple, list)) or len(betas) != len(names):
        raise ValueError(f"{owner}: {key}={engine.shown(betas)} must be a tuple of "
                         f"{len(names)} values, {_shown_betas(names)}")
    out = dict(zip(names, betas))
    for name in names:
        if name in given and not _same(given[name], out[name]):
            raise ValueError(f"{owner}: {key}={engine.shown(tuple(betas))} and "
                             f"{name}={engine.shown(given[name])} disagree; {key} is "
                             f"{_shown_betas(names)}: give one of the two")
    return out


# torch's other tuple keywords, for the hyperparameters a spec names one by one (Rprop's,
# Muon's Newton-Schulz coefficients): split into the spec's names, and held by its groups
TUPLES = {"etas": ("etaminus", "etaplus"), "step_sizes": ("step_size_min", "step_size_max"),
          "ns_coefficients": ("a", "b", "c")}


def tuple_keys(spec) -> dict[str, tuple[str, ...]]:
    """torch's tuple keywords that name a spec's hyperparameters, each with those names:
    ``betas`` for ``b1``, ``b2``, ...; and each of ``TUPLES`` that torch.optim's class of the
    spec's class name takes, where the spec has its names (Muon's ``a``, ``b``, ``c`` are
    ``ns_coefficients``; a spec of its own with hyperparameters of those names is not)."""
    out = {}
    names = beta_names(spec)
    if names:
        out["betas"] = names
    have = {h.name for h in spec.hypers}
    takes = _torch_keywords(spec.class_name)
    out.update((key, names) for key, names in TUPLES.items()
               if key in takes and set(names) <= have)
    return out


def _torch_keywords(cls_name: str) -> dict:
    """The parameters of ``torch.optim.<cls_name>.__init__`` (none where torch has no such
    optimizer)."""
    theirs = getattr(torch.optim, cls_name, None)
    if not (isinstance(theirs, type) and issubclass(theirs, torch.optim.Optimizer)):
        return {}
    return dict(inspect.signature(theirs.__init__).parameters)


_SETTINGS = (*_IMPLEMENTATION_KEYWORDS, "maximize", "differentiable")


def _torch_order(cls_name: str, spec) -> list[str]:
    """The names torch.optim's class of ``cls_name`` takes by position after ``params``, its
    settings (``foreach``, ...) too; ``lr`` alone where torch has no such class and the spec
    has an ``lr``."""
    theirs = _torch_keywords(cls_name)
    if not theirs:
        return ["lr"] if any(h.name == "lr" for h in spec.hypers) else []
    return [n for n, p in theirs.items() if n not in ("self", "params")
            and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def positional_names(cls_name: str, spec, order: list[str] | None = None) -> list[str]:
    """The hyperparameters a class takes by position after ``params``, in order
    (``positional``): torch's order (``order``, where found already) up to its first
    setting, RMSprop's ``capturable``."""
    order = _torch_order(cls_name, spec) if order is None else order
    return list(itertools.takewhile(lambda n: n not in _SETTINGS, order))


def positional(owner: str, cls_name: str, spec, args: tuple, hypers: dict) -> None:
    """Hyperparameters given by position, as torch.optim's classes take them
    (``SGD(model.parameters(), 0.1, momentum=0.9)``), put into ``hypers`` by name: in the
    order of torch's class of the name, or ``lr`` alone where torch has none (a spec's
    own). TypeError for more than that order holds, a name given twice, or a position of
    a setting the class takes only by name (RMSprop's ``capturable``, ...)."""
    if not args:
        return
    order = _torch_order(cls_name, spec)
    if not spec.hypers:
        raise TypeError(f"{owner} takes no hyperparameters, but {len(args)} "
                        f"{'was' if len(args) == 1 else 'were'} given by position")
    if not order:
        raise TypeError(f"{owner} takes its hyperparameters by name "
                        f"({', '.join(h.name + '=...' for h in spec.hypers)}), not by position")
    if len(args) > len(order):
        # (torch's settings after its hyperparameters, RMSprop's capturable, foreach, ...,
        # are not counted: the class takes them by name only)
        taken = positional_names(cls_name, spec, order)
        named = f"{', '.join(taken)}, in torch.optim.{cls_name}'s order" \
            if _torch_keywords(cls_name) else "lr"
        raise TypeError(f"{owner} takes {len(taken)} hyperparameter{'s' * (len(taken) != 1)} "
                        f"by position ({named}), but {len(args)} were given: give the others "
                        "by name")
    for name, value in zip(order, args):
        if name in _SETTINGS:
            raise TypeError(f"{owner}: give {name} by name ({name}=...), not by position")
        if name in hypers:
            raise TypeError(f"{owner} got multiple values for {name!r}: by position and by "
                            "name")
        hypers[name] = value


def torch_only(spec) -> dict[str, object]:
    """The keywords of torch.optim's class of the spec's class name that the class does not
    take (neither hyperparameters, ``tuple_keys`` nor torch's implementation keywords), each
    with the value at which torch's rule is the class's: its default there, or
    ``_TORCH_RULES``' (RAdam's ``weight_decay`` 0). A group may hold one at that value, as a
    framework's groups for torch's class do; at another, torch would step another rule."""
    mine = {h.name for h in spec.hypers} | set(tuple_keys(spec)) | {
        "maximize", "differentiable", *_IMPLEMENTATION_KEYWORDS}
    rules = _TORCH_RULES.get(spec.class_name, {})
    theirs = _torch_keywords(spec.class_name)
    if not theirs and "weight_decay" not in mine:
        # a class torch has not (AdaBelief, a spec of one's own) whose rule does not decay:
        # a group's weight_decay (a framework's decay and no-decay groups) would be lost
        return {"weight_decay": 0}
    return {name: rules.get(name, p.default)
            for name, p in theirs.items()
            if name not in ("self", "params") and name not in mine
            and p.default is not inspect.Parameter.empty}


def _not_taken(cls_name: str, key: str) -> str:
    """Who does not take ``key``: torch's class of the name has it, or none has."""
    if _torch_keywords(cls_name):
        return f"a setting of torch.optim.{cls_name} that vega.optim.{cls_name} does not take"
    return f"which {cls_name}'s rule does not take (it has no {key})"


def _hint(key: str) -> str:
    """Where a refused keyword of torch's has a vega name at another value (Muon's)."""
    return ("; torch's adjust_lr_fn='match_rms_adamw' is match_rms_adamw=True"
            if key == "adjust_lr_fn" else "")


def _at(given, value) -> bool:
    """Whether a group's ``given`` is torch's ``value`` of a keyword (``torch_only``)
    (Muon's ``adjust_lr_fn="original"`` is its None)."""
    if given == "original" and value is None:
        return True
    if isinstance(value, bool):
        return isinstance(given, int) and bool(given) == value  # (torch takes 0 for False)
    if value is None:
        return given is None
    if isinstance(value, tuple):
        return isinstance(given, (tuple, list)) and len(given) == len(value) \
            and all(map(_same, given, value))
    return _same(given, value)


def check_torch_only(owner: str, cls_name: str, only: dict, group: dict) -> None:
    """ValueError where ``group`` holds one of ``only`` (``torch_only``) at a value other than
    torch's value for this class's rule: the class would step as if it were absent."""
    for key, value in only.items():
        if key in group and not _at(group[key], value):
            at = (f"its rule is torch's at {key}={value!r}" if _torch_keywords(cls_name)
                  else f"only {key}={value!r} is taken")
            raise ValueError(f"{owner}: a parameter group has {key}={engine.shown(group[key])}, "
                             f"{_not_taken(cls_name, key)}: {at}, and the group would step "
                             f"as without it{_hint(key)}")


def split_tuples(owner: str, spec, hypers: dict) -> None:
    """``hypers`` with each of torch's tuples the spec takes (``tuple_keys``: ``betas``, and
    those of ``TUPLES``) split into the names it gives."""
    for key, names in tuple_keys(spec).items():
        if key in hypers:
            hypers.update(split_betas(owner, names, hypers.pop(key), hypers, key))


def check_keywords(owner: str, maximize, foreach, fused, capturable, differentiable) -> None:
    """torch's keywords as torch takes them; ValueError naming one it does not, and for
    ``differentiable=True`` (a step autograd can differentiate: vega's kernels are not)."""
    if not isinstance(maximize, bool):
        raise ValueError(f"{owner}: maximize={engine.shown(maximize)} must be True or False")
    for name, value in zip(_IMPLEMENTATION_KEYWORDS, (foreach, fused, capturable)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{owner}: {name}={engine.shown(value)} must be None, True or "
                             "False (vega's step is always one fused kernel)")
    if not isinstance(differentiable, bool):
        raise ValueError(f"{owner}: differentiable={engine.shown(differentiable)} must be "
                         "True or False")
    if differentiable:
        raise ValueError(f"{owner}: differentiable=True is not supported: vega's fused step "
                         "is not differentiable by autograd; use torch.optim for a "
                         "differentiable step")


def take_rule_keywords(owner: str, cls_name: str, spec, hypers: dict, only: dict) -> None:
    """torch's keywords that pick its rule, taken out of ``hypers`` where the class has no
    hyperparameter of the name: those of ``_TORCH_RULES`` torch's own class takes
    (``decoupled_weight_decay``) and the others of ``only`` (``torch_only``: RAdam's
    ``weight_decay``, Muon's ``adjust_lr_fn``), each at the value where torch's rule is this
    class's, as a group may hold them; ValueError at another. Muon's
    ``adjust_lr_fn="match_rms_adamw"`` is its ``match_rms_adamw=True``."""
    names = {h.name for h in spec.hypers}
    takes = _torch_keywords(cls_name)
    rules = {**only, **{n: v for n, v in _TORCH_RULES.get(cls_name, {}).items() if n in takes}}
    for name, value in rules.items():
        if name not in hypers or name in names:
            continue
        given = hypers.pop(name)
        if name == "adjust_lr_fn" and _at(given, value) and "match_rms_adamw" in names \
                and hypers.get("match_rms_adamw", False) is not False:
            # (torch's None and "original" are match_rms_adamw=False: both given, they
            # disagree, as adjust_lr_fn="match_rms_adamw" with False does)
            raise ValueError(f"{owner}: adjust_lr_fn={given!r} is match_rms_adamw=False, but "
                             f"match_rms_adamw={engine.shown(hypers['match_rms_adamw'])} is "
                             "given too")
        if _at(given, value):
            continue
        if name == "adjust_lr_fn" and given == "match_rms_adamw" and "match_rms_adamw" in names:
            if hypers.setdefault("match_rms_adamw", True) is not True:
                raise ValueError(f"{owner}: adjust_lr_fn='match_rms_adamw' is "
                                 "match_rms_adamw=True, but match_rms_adamw="
                                 f"{engine.shown(hypers['match_rms_adamw'])} is given too")
            continue
        other = " (vega.optim.AdamW)" if cls_name == "Adam" else ""
        if not takes:  # (no torch class of the name: a rule that does not decay)
            raise ValueError(f"{owner}: {name}={engine.shown(given)}, {_not_taken(cls_name, name)}"
                             f": only {name}={value} is taken, and it would step as without it")
        raise ValueError(f"{owner}: {name}={engine.shown(given)}: vega.optim.{cls_name}'s "
                         f"rule is torch's at {name}={value}; another rule is another "
                         f"class{other}{_hint(name)}")


def loading(opt, state_dict, load) -> None:
    """``opt.load_state_dict`` in torch's order around vega's own loading ``load``: the
    load_state_dict pre-hooks (``register_load_state_dict_pre_hook``) first, on a shallow
    copy of what the caller gave, each one's answer replacing it (so that a hook migrating an
    old checkpoint runs before vega converts or checks it); then ``load`` of the result, with
    the hooks held off (the loading of torch's class inside it would run them again, and the
    values vega casts after it would undo what they changed); then the post-hooks, on the
    state as loaded."""
    if isinstance(state_dict, dict):
        state_dict = state_dict.copy()
    # (the optimizer's own dicts, put back as they were: an empty one's stand-in ``{}`` put
    # back in its place took no more hooks, as torch's handles take a weak reference to it)
    back = pre, post = tuple(collections.OrderedDict() if hooks is None else hooks for hooks in (
        opt.__dict__.get("_optimizer_load_state_dict_pre_hooks"),
        opt.__dict__.get("_optimizer_load_state_dict_post_hooks")))
    for hook in list(pre.values()):
        answer = hook(opt, state_dict)
        if answer is not None:
            state_dict = answer
    # (each pair set in one statement, which calls nothing between its two stores, in the
    # try: a KeyboardInterrupt between the two, or before the try, lost the hooks)
    none = (collections.OrderedDict(), collections.OrderedDict()) if pre or post else None
    try:
        if none is not None:
            (opt._optimizer_load_state_dict_pre_hooks,
             opt._optimizer_load_state_dict_post_hooks) = none
        load(state_dict)
    finally:
        if none is not None:
            (opt._optimizer_load_state_dict_pre_hooks,
             opt._optimizer_load_state_dict_post_hooks) = back
    for hook in list(post.values()):
        hook(opt)


def saving(opt, save) -> dict:
    """``opt.state_dict()`` in torch's order around vega's own saving ``save``: the
    state_dict pre-hooks (``register_state_dict_pre_hook``) first, then ``save`` with the
    hooks held off (torch's saving inside it would run them again), then the post-hooks on
    what ``save`` returns, each one's answer replacing it, so that they see (and may change)
    the whole state dict, the entries vega adds to torch's (the loss scale, the rule's name)
    too. The pre-hooks run outside the hold, on the optimizer's own dicts: a hook that a
    pre-hook registers is kept, and a ``state_dict()`` called from one runs its hooks."""
    for hook in list((opt.__dict__.get("_optimizer_state_dict_pre_hooks") or {}).values()):
        hook(opt)
    back = pre, post = tuple(collections.OrderedDict() if hooks is None else hooks for hooks in (
        opt.__dict__.get("_optimizer_state_dict_pre_hooks"),
        opt.__dict__.get("_optimizer_state_dict_post_hooks")))
    # (made before the try, each pair set in one statement: ``loading``)
    none = (collections.OrderedDict(), collections.OrderedDict()) if pre or post else None
    try:
        if none is not None:
            opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = none
        state_dict = save()
    finally:
        if none is not None:
            opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = back
    for hook in list(post.values()):
        answer = hook(opt, state_dict)
        if answer is not None:
            state_dict = answer
    return state_dict


def drop_strays(owner: str, opt) -> None:
    """Before torch's ``state_dict()`` (which names each state by its parameter's position in
    the groups, and fails with a bare ``KeyError`` of a tensor's id on one in no group): an
    empty state of a tensor in no group dropped (``opt.state`` is a defaultdict, and reading
    the state of a tensor not in the optimizer makes one), and a ValueError naming one that
    is not empty (a parameter removed from its group's ``params`` after it stepped), which
    the caller drops or keeps by putting the parameter back: a state dict without it would
    lose it without a word."""
    ids = set(map(id, itertools.chain.from_iterable(g["params"] for g in opt.param_groups)))
    if ids.issuperset(map(id, opt.state)):  # (the common case, at C speed: a pass of Python
        return                              # over the states cost 0.25 us a parameter)
    strays = [t for t in opt.state if isinstance(t, torch.Tensor) and id(t) not in ids]
    for t in strays:
        st = opt.state[t]
        if st:
            raise ValueError(
                f"{owner}: the state holds {sorted(map(str, st))} of a tensor of shape "
                f"{tuple(t.shape)} that is in no parameter group (removed from its group's "
                "'params' after it stepped): a state_dict names each state by its "
                "parameter's position in the groups, so this one has none; drop it "
                "(del optimizer.state[p]) or put the parameter back in a group")
    for t in strays:
        del opt.state[t]


def negated(grads: list) -> list:
    """``grads`` negated (``maximize``), None kept where a parameter has no gradient: a
    new list of new tensors, as torch's foreach step negates them."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    neg = iter(torch._foreach_neg(present))
    return [None if g is None else next(neg) for g in grads]


class TupleSync:
    """Each group's torch tuples (``betas``; Rprop's ``etas``, ``step_sizes``: ``tuple_keys``)
    as last seen in step with the hyperparameters they name: which of the two names a caller
    changed since (kept off torch's state, by the group)."""

    def __init__(self, keys: dict[str, tuple[str, ...]]):
        self.keys = keys
        self.seen: dict[int, tuple] = {}  # id(group) -> (group, {key: its tuple})
        self.made: dict | None = None  # {key: the defaults' tuple as last made to agree}

    def fill(self, owner: str, param_group: dict, defaults: dict) -> None:
        """A group being added: each tuple from its own names (or theirs from the tuple),
        defaults for the rest (``sync_defaults``); ValueError where the two disagree."""
        self.sync_defaults(owner, defaults)
        for key, names in self.keys.items():
            given = {n: param_group[n] for n in names if n in param_group}
            if key in param_group:
                param_group.update(split_betas(owner, names, param_group[key], given, key))
            param_group[key] = tuple(param_group.get(n, defaults[n]) for n in names)

    def sync_defaults(self, owner: str, defaults: dict) -> None:
        """The optimizer's ``defaults`` (from which ``add_param_group`` fills a new group)
        made to agree as a group's tuples and names are (``sync``), against their values
        when they last agreed (``made``: the optimizer made, or a group added):
        ``opt.defaults['betas']`` edited, as torch's classes read it, and a ``b1`` edited
        are each taken (a group added after took ``b1`` and ``b2`` as they were made, the
        edited ``betas`` lost); where both changed a value to values that disagree, a
        ValueError. Without ``made`` (an unpickled or copied optimizer), the tuple, as
        torch's classes read it."""
        for key, names in self.keys.items():
            if key not in defaults or not all(n in defaults for n in names):
                continue
            ours, theirs = tuple(defaults[n] for n in names), defaults[key]
            if not isinstance(theirs, (tuple, list)) or len(theirs) != len(names):
                raise ValueError(f"{owner}: its defaults have {key}={engine.shown(theirs)}; "
                                 f"it must be a tuple of {len(names)} values, "
                                 f"{_shown_betas(names)}")
            if not same_betas(ours, theirs):
                last = self.made.get(key) if self.made is not None else None
                now = _merged(f"{owner}: its defaults have", key, names, ours, theirs, last)
                defaults.update(zip(names, now))
                defaults[key] = tuple(now)
            self.made = {**(self.made or {}), key: tuple(defaults[key])}  # (agreed, as now)

    def remember(self, group: dict) -> None:
        if self.keys:
            self.seen[id(group)] = (group, {key: tuple(group[key]) for key in self.keys})

    def keep(self, groups: list) -> None:
        """Forget the groups not in ``groups`` (the optimizer's, after a step): a group
        dropped from ``param_groups`` is not held, nor its parameters."""
        if len(self.seen) > len(groups):
            now = {id(g) for g in groups}
            self.seen = {k: v for k, v in self.seen.items() if k in now}

    def sync(self, owner: str, k: int, group: dict) -> None:
        """Make each of ``group``'s tuples and the hyperparameters it names agree, taking,
        value by value, the one changed since the last step (a ``betas[0]`` a scheduler
        wrote and a ``b2`` set by hand are both taken); ValueError where one value changed
        by both names, to values that disagree. A group not seen before (loaded from a
        state dict, or of a copied or unpickled optimizer) takes the tuple, as torch's
        classes read it: a scheduler that cycles momentum (``OneCycleLR``) writes ``betas``
        between steps, so a state saved after it disagrees with ``b1`` until the next
        step."""
        if not self.keys:
            return
        seen = self.seen.get(id(group))
        lasts = seen[1] if seen is not None and seen[0] is group else None
        for key, names in self.keys.items():
            ours = tuple(group[n] for n in names)
            theirs = group.get(key)
            if theirs is None:  # (a state saved before groups held the tuple)
                group[key] = ours
            elif not isinstance(theirs, (tuple, list)) or len(theirs) != len(names):
                raise ValueError(f"{owner}: group {k} has {key}={engine.shown(theirs)}; it "
                                 f"must be a tuple of {len(names)} values, "
                                 f"{_shown_betas(names)}")
            elif not same_betas(ours, theirs):
                last = lasts.get(key) if lasts is not None else None
                if last is None:  # (not seen: the tuple, as torch reads it)
                    group.update(zip(names, theirs))
                    continue
                now = _merged(f"{owner}: group {k} has", key, names, ours, theirs, last)
                group.update(zip(names, now))
                group[key] = tuple(now)
        self.remember(group)


def _merged(where: str, key: str, names: tuple, ours: tuple, theirs, last) -> tuple:
    """A tuple (``theirs``) and the values it names (``ours``) that disagree, made one:
    value by value, the one changed since ``last`` (a scheduler's betas[0], OneCycleLR's,
    and a b2 set by hand are both taken); the tuple where ``last`` is None (as torch's
    classes read it); ValueError (``where``: whose) where both changed and disagree."""
    if last is None:
        return tuple(theirs)
    now = []
    for our, their, was in zip(ours, theirs, last):
        if _same(our, their) or _same(our, was):
            now.append(their)
        elif _same(their, was):
            now.append(our)
        else:
            mine = ", ".join(f"{n}={engine.shown(v)}" for n, v in zip(names, ours))
            raise ValueError(f"{where} {key}={engine.shown(tuple(theirs))} but {mine}; {key} "
                             f"is {_shown_betas(names)}: change one of the two")
    return tuple(now)


# -- torch.optim's state dicts --------------------------------------------------------------

# The classes whose rule torch.optim's class of the same name steps, each state under
# torch's name (vega's -> torch's; None: torch keeps none); and the values of torch's group
# keys at which its rule is vega's (a key absent from a saved group is taken as that value).
# the entry of vega's state dicts that names the rule (``SpecOptimizer.state_dict``)
RULE_KEY = "vega_rule"
# the key of a saved group that holds 8-bit codes: the version of the maps they are read
# with (``quant.MAPS``), which ``load_state_dict`` checks; in the group, as torch's
# get_state_dict (DCP) keeps only 'state' and 'param_groups'
Q8_MAPS_KEY = "vega_q8_maps"

TORCH_STATES = {
    "SGD": {"v": "momentum_buffer", "step": None},
    "Adam": {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"},
    "AdamW": {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"},
    "RAdam": {"mu": "exp_avg", "nu": "exp_avg_sq"},
    "Adagrad": {"acc": "sum"},
    "RMSprop": {"nu": "square_avg", "mu": "grad_avg", "buf": "momentum_buffer"},
}
_TORCH_RULES = {
    "Adam": {"decoupled_weight_decay": False}, "AdamW": {"decoupled_weight_decay": True},
    "RAdam": {"weight_decay": 0, "decoupled_weight_decay": False},
}
# torch's keywords a group of torch's class may hold
KEYWORDS = ("foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay")
# vega's keys of a group for the precision of its parameters (docs/precision.md), with the
# value a group lacking one (a state saved before they existed) takes
PRECISION_DEFAULTS = {"master_weights": False, "stochastic_rounding": False,
                      "rounding_seed": 0}
PRECISION_KEYS = tuple(PRECISION_DEFAULTS)


def is_torch_format(state_dict, cls_name: str, want: frozenset) -> bool:
    """Whether ``state_dict`` is torch.optim's state of the class of this name: groups
    without vega's ``backend`` and ``state_dtype`` that, ``betas`` aside, hold the rest of
    ``want`` (vega's group keys)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if cls_name not in TORCH_STATES or not isinstance(groups, (list, tuple)) or not groups:
        return False
    mine = want - {"backend", "state_dtype"}
    for group in groups:
        if not isinstance(group, dict) or "backend" in group or "state_dtype" in group:
            return False
        keys = set(group) | ({f"b{i + 1}" for i in range(len(group["betas"]))}
                             if isinstance(group.get("betas"), (tuple, list)) else set())
        if not mine <= keys:
            return False
    return True


def from_torch(owner: str, cls_name: str, state_dict: dict, current: list) -> dict:
    """torch.optim's state dict of ``cls_name`` in vega's format: states renamed, ``betas``
    spread over ``b1``, ``b2``, groups given ``current``'s (this optimizer's groups')
    ``backend`` and precision settings, and ``state_dtype`` None: torch keeps its states in
    floats (an 8-bit optimizer quantizes them on loading; this optimizer's ``state_dtype``
    would say they were saved as 8-bit codes); torch's step counters are converted on
    loading (and SGD's, which torch does not keep, is 1 where a buffer is). ValueError
    naming a setting under which torch's rule is not vega's."""
    names = TORCH_STATES[cls_name]
    rules = _TORCH_RULES.get(cls_name, {})
    groups = []
    for k, group in enumerate(state_dict["param_groups"]):
        if group.get("differentiable"):
            raise ValueError(f"{owner}: group {k} of torch.optim.{cls_name}'s state has "
                             "differentiable=True, which vega's fused step is not")
        for key, value in rules.items():
            if key in group and group[key] != value:
                other = next((f" (the state of torch.optim.{name}: load it into "
                              f"vega.optim.{name})" for name, r in _TORCH_RULES.items()
                              if key == "decoupled_weight_decay" and name in ("Adam", "AdamW")
                              and r.get(key) == group[key]), "")
                raise ValueError(
                    f"{owner}: group {k} of the state in torch.optim's format has "
                    f"{key}={engine.shown(group[key])}{other}, but vega.optim.{cls_name}'s "
                    f"rule is torch's at {key}={value!r}")
        here = current[k] if k < len(current) else current[-1]
        out = {key: v for key, v in group.items() if key not in KEYWORDS}
        if isinstance(group.get("betas"), (tuple, list)):
            out.update((f"b{i + 1}", b) for i, b in enumerate(group["betas"]))
            out["betas"] = tuple(group["betas"])
        out.update(backend=here["backend"], state_dtype=None,
                   **{key: here[key] for key in PRECISION_KEYS if key in here})
        groups.append(out)
    back = {theirs: mine for mine, theirs in names.items() if theirs is not None}
    state = {}
    for pid, st in state_dict["state"].items():
        new = {back.get(key, key): v for key, v in st.items() if v is not None}
        if "step" not in new and new:  # (torch's SGD counts no steps)
            new["step"] = torch.ones((), dtype=torch.int32)
        state[pid] = new
    return {**state_dict, "state": state, "param_groups": groups}


def to_torch(owner: str, cls_name: str, betas: tuple, state_dict: dict) -> dict:
    """vega's state dict of ``cls_name`` in torch.optim's format, for torch.optim's class
    of the same name (``betas``: the spec's b1, b2, ..., which torch calls betas); ValueError
    where a group holds a schedule, or a tensor for a keyword that torch's class takes only as
    a number (its ``lr``, SGD's ``weight_decay``, Adam's ``betas`` may be tensors, as torch's
    own groups hold them; so may a scheduler's ``initial_lr`` beside a tensor ``lr``), or the
    class has no torch counterpart."""
    if cls_name not in TORCH_STATES:
        raise ValueError(f"{owner}: vega.optim.{cls_name}'s state is not converted to torch's "
                         f"format; it is for {', '.join(sorted(TORCH_STATES))}")
    names = TORCH_STATES[cls_name]
    rules = _TORCH_RULES.get(cls_name, {})
    takes = inspect.signature(getattr(torch.optim, cls_name).__init__).parameters
    tensors = {key for key, p in takes.items() if "Tensor" in str(p.annotation)}
    groups = []
    for k, group in enumerate(state_dict["param_groups"]):
        out = {key: v for key, v in group.items()
               if key not in ("backend", "state_dtype", Q8_MAPS_KEY, quant.LAYOUT_KEY,
                              *PRECISION_KEYS, *betas)}
        for key, v in out.items():
            values = v if key == "betas" else (v,)
            if any(callable(x) for x in values):
                raise ValueError(f"{owner}: group {k} has {key}={engine.shown(v)}; torch's "
                                 "state format holds plain numbers")
            if key in takes and key not in tensors and any(isinstance(x, torch.Tensor)
                                                           for x in values):
                raise ValueError(f"{owner}: group {k} has {key}={engine.shown(v)}; torch.optim."
                                 f"{cls_name} takes {key} as a plain number (a tensor only "
                                 f"for {', '.join(sorted(tensors - {'params'}))})")
        out.update((key, v) for key, v in dict(foreach=None, fused=None, capturable=False,
                                               differentiable=False).items() if key in takes)
        out.update(rules)
        groups.append(out)
    state, masters = {}, False
    for pid, st in state_dict["state"].items():
        new = {names.get(key, key): v for key, v in st.items()}
        new.pop(None, None)
        masters = new.pop(engine.MASTER, None) is not None or masters
        if "step" in new:  # (torch's counters are float32, on the host)
            new["step"] = new["step"].to(device="cpu", dtype=torch.float32)
        state[pid] = new
    if masters:  # (torch's class would keep it as a state, cast to the parameter's dtype)
        warn(f"{owner}: the master copies of the half-precision parameters "
             "(master_weights=True) are left out: torch.optim keeps none, and steps "
             "the parameters as they are")
    return {**{k: v for k, v in state_dict.items() if k not in ("loss_scale", RULE_KEY)},
            "state": state, "param_groups": groups}
