"""The front end: spec text -> syntax tree -> checks -> typed IR."""
from __future__ import annotations

from dataclasses import dataclass, field

from vega.dsl import ast, ir
from vega.dsl.check import (GLOBAL_FUNCTIONS, _calls, _names, all_flag_settings, check,
                            expressions, lower, open_value, reads_shape, shape_conditions,
                            state_decls, static_value, unroll)
from vega.dsl.parser import parse
from vega.errors import Span, SpecError

__all__ = ["Spec", "load", "ir", "ast"]


@dataclass
class Spec:
    """A parsed and checked spec; ``program(flags)`` lowers one specialization."""

    source: str
    filename: str
    tree: ast.Spec
    hypers: tuple[ir.HyperParam, ...]
    # the width of each reduction's argument as the check saw it (``check``, ``lower``)
    widths: dict = field(default_factory=dict, repr=False)
    _programs: dict = field(default_factory=dict, repr=False)
    _chosen: dict = field(default_factory=dict, repr=False)  # see ``chosen``
    # the ifs that test a tensor's shape (ndim(p) >= 2), in source order, and the float
    # hyperparameters they read (their values, with the bool ones, pick each tensor's
    # program); computed once here: a cached_property's lock is not traceable by dynamo
    shape_conditions: list = field(init=False, repr=False)
    shape_hypers: tuple[str, ...] = field(init=False, repr=False)
    reads_shape: bool = field(init=False, repr=False)  # a condition asks ndim(p) or the like
    # whether any program reduces over a parameter group (global_sum ...): under
    # reduce_group, every rank's step then meets the others' (vega.runtime.sharded)
    spans_group: bool = field(init=False, repr=False)
    # the states declared under an if on hyperparameter values alone (sgd's v under
    # `if momentum > 0`): a class creates them when the values turn such an if on
    value_states: frozenset[str] = field(init=False, repr=False)
    flag_states: frozenset[str] = field(init=False, repr=False)
    # per shape condition: the float hyperparameters it reads, and the states its then
    # branch declares, where it reads values alone (None where it reads the shape)
    _value_ifs: tuple = field(init=False, repr=False)
    # the dtype each state's declaration names (`state nu: bfloat16 = zeros`): its default
    # state_dtype (vega.runtime.engine.state_dtype_of)
    declared_dtypes: dict = field(init=False, repr=False)

    def __post_init__(self):
        self.shape_conditions = shape_conditions(self.tree)
        self.declared_dtypes = {d.name: d.dtype for d in state_decls(self.tree.body)
                                if d.dtype is not None}
        floats = {h.name for h in self.hypers if h.type == "float"}
        names = (n.id for s in self.shape_conditions for n in _names(s.cond))
        self.shape_hypers = tuple(dict.fromkeys(n for n in names if n in floats))
        self.reads_shape = any(reads_shape(s.cond) for s in self.shape_conditions)
        self.spans_group = any(isinstance(c, ast.Call) and c.fn in GLOBAL_FUNCTIONS
                               for e in expressions(self.tree.body) for c in _calls(e))
        self.value_states = frozenset(
            name for s in self.shape_conditions if not reads_shape(s.cond)
            for name in _declared(s.then + s.orelse))
        self.flag_states = frozenset(_flag_declared(self.tree.body, self.shape_conditions)) - \
            frozenset(d.name for d in self.tree.body if isinstance(d, ast.StateDecl))
        self._value_ifs = tuple(
            None if reads_shape(s.cond) else
            (frozenset(n.id for n in _names(s.cond) if n.id in floats),
             frozenset(_declared(s.then)))
            for s in self.shape_conditions)

    @property
    def name(self) -> str:
        return self.tree.name

    @property
    def state_names(self) -> tuple[str, ...]:
        """Every state the spec declares, under any if, in source order."""
        return tuple(dict.fromkeys(_declared(self.tree.body)))

    @property
    def doc(self) -> str:
        return self.tree.doc

    def program(self, flags: dict[str, bool], shapes: tuple[bool, ...] = ()) -> ir.Program:
        """The program for these bool hyperparameters and shape-condition outcomes (missing
        outcomes are false)."""
        n = len(self.shape_conditions)
        key = (tuple(sorted(flags.items())), (tuple(shapes) + (False,) * n)[:n])
        found = self._programs.get(key)
        if found is None:  # (setdefault: two threads lowering it at once both take the one
            found = self._programs.setdefault(  # kept first: ``precision.variant`` says why)
                key, _guard(lambda: lower(self.tree, dict(key[0]), key[1], self.widths),
                            self.source, self.filename, self.tree))
        return found

    def shapes(self, values: dict, shape: tuple[int, ...]) -> tuple[bool, ...]:
        """The outcome of each shape condition for a tensor of ``shape``; ``values`` maps
        every hyperparameter to a Python bool or float."""
        return tuple(bool(static_value(s.cond, values, tuple(shape)))
                     for s in self.shape_conditions)

    def held_open(self, flags: dict, values: dict, open_names, present=None) -> tuple:
        """The conditions on values alone (``if momentum > 0``) to take as true whatever
        the values of ``open_names`` (float hyperparameters) are: those that other values
        (``flags``, and ``values`` of the names not open) do not decide and that read an
        open name; with ``present`` (a state's field names), only those whose then
        branch declares states, all of them present. A tuple of bools, one per shape
        condition, for ``program``'s ``shapes`` (or-ed in)."""
        out = []
        for s, info in zip(self.shape_conditions, self._value_ifs):
            hold = False
            if info is not None and info[0] & set(open_names):
                known = {**flags, **{k: v for k, v in values.items() if k not in open_names}}
                hold = open_value(s.cond, known) is None and (
                    present is None or (bool(info[1]) and info[1] <= set(present)))
            out.append(hold)
        return tuple(out)

    @property
    def value_hypers(self) -> frozenset:
        """The float hyperparameters that an if on values alone reads."""
        return frozenset().union(*(i[0] for i in self._value_ifs if i is not None))

    def chosen(self, values: dict) -> dict:
        """The programs already chosen by shape for these hyperparameter values (every
        name a shape condition reads, and the flags): a dict ``shape -> program`` the
        caller fills, kept across steps, so that a step of a thousand tensors of different
        shapes does not evaluate the conditions a thousand times."""
        key = tuple(sorted(values.items()))
        found = self._chosen.get(key)
        if found is None:
            if len(self._chosen) > 64 or sum(map(len, self._chosen.values())) > 100_000:
                self._chosen.clear()
            found = self._chosen[key] = {}
        return found

    def flag_settings(self) -> list[dict[str, bool]]:
        return all_flag_settings(self.hypers)




def _flag_declared(stmts, shape_ifs, under_shape: bool = False):
    """The names of the states declared under an if on bool hyperparameters (amsgrad's
    ``nu_max``), none of them under an if on the tensor's shape."""
    for s in stmts:
        if isinstance(s, ast.If):
            shaped = under_shape or any(s is c and reads_shape(c.cond) for c in shape_ifs)
            flag = not any(s is c for c in shape_ifs)
            for d in state_decls(s.then + s.orelse):
                if flag and not shaped:
                    yield d.name
            yield from _flag_declared(s.then + s.orelse, shape_ifs, shaped)


def _declared(stmts):
    """The names of the states declared in ``stmts``, in nested ifs too."""
    return (d.name for d in state_decls(stmts))


_TOO_DEEP = ("the spec nests too deeply to compile: an expression of more than a few hundred "
             "operators or parentheses inside one another (a long sum is one inside another "
             "too); split it into values")


def _deepest_line(source: str) -> Span | None:
    """Where an expression too deep to compile most likely is: the line with the most
    operators and opening parentheses (comments aside), the whole of its text."""
    best, score = None, 0
    for k, line in enumerate(source.split("\n"), 1):
        text = line.split("#", 1)[0]
        n = sum(text.count(c) for c in "(+-*/^@")
        if n > score and text.strip():
            start = len(text) - len(text.lstrip()) + 1
            best, score = Span(k, start, k, len(text.rstrip()) + 1), n
    return best


def _guard(fn, source, filename, tree=None):
    """Run a compiler stage; every failure leaves as a SpecError pointing at the source."""
    try:
        return fn()
    except SpecError as err:
        raise err.with_source(source, filename) from None
    except RecursionError:
        raise SpecError(_TOO_DEEP, _deepest_line(source), source, filename) from None
    except Exception as err:  # a bug of ours: still say where, never a bare traceback
        if isinstance(getattr(err, "orig_exc", None), RecursionError):  # (lark's VisitError)
            raise SpecError(_TOO_DEEP, _deepest_line(source), source, filename) from None
        span = tree.name_span if tree is not None else None
        raise SpecError(f"internal compiler error ({type(err).__name__}: {err}); please "
                        "report it with this spec", span, source, filename) from err


def load(source: str, filename: str = "<spec>") -> Spec:
    """Parse and check spec text. Raises SpecError on any mistake."""
    if not isinstance(source, str):
        raise TypeError(f"a spec is text, got {type(source).__name__}")
    source = source.replace("\r\n", "\n").replace("\r", "\n")  # (as a file is read)
    tree = _guard(lambda: unroll(parse(source, filename)), source, filename)
    widths: dict = {}
    hypers = _guard(lambda: check(tree, widths), source, filename, tree)
    return Spec(source, filename, tree, hypers, widths)
