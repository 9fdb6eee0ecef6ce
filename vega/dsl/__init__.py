"""The front end: spec text -> syntax tree -> checks -> typed IR."""
from __future__ import annotations

from dataclasses import dataclass, field

from vega.dsl import ast, ir
from vega.dsl.check import (_names, all_flag_settings, check, lower, reads_shape,
                            shape_conditions, static_value)
from vega.dsl.parser import parse
from vega.errors import SpecError

__all__ = ["Spec", "load", "ir", "ast"]


@dataclass
class Spec:
    """A parsed and checked spec; ``program(flags)`` lowers one specialization."""

    source: str
    filename: str
    tree: ast.Spec
    hypers: tuple[ir.HyperParam, ...]
    _programs: dict = field(default_factory=dict, repr=False)
    _chosen: dict = field(default_factory=dict, repr=False)  # see ``chosen``
    # the ifs that test a tensor's shape (ndim(p) >= 2), in source order, and the float
    # hyperparameters they read (their values, with the bool ones, pick each tensor's
    # program); computed once here: a cached_property's lock is not traceable by dynamo
    shape_conditions: list = field(init=False, repr=False)
    shape_hypers: tuple[str, ...] = field(init=False, repr=False)
    reads_shape: bool = field(init=False, repr=False)  # a condition asks ndim(p) or the like
    # the states declared under an if on hyperparameter values alone (sgd's v under
    # `if momentum > 0`): a class creates them when the values turn such an if on
    value_states: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.shape_conditions = shape_conditions(self.tree)
        floats = {h.name for h in self.hypers if h.type == "float"}
        names = (n.id for s in self.shape_conditions for n in _names(s.cond))
        self.shape_hypers = tuple(dict.fromkeys(n for n in names if n in floats))
        self.reads_shape = any(reads_shape(s.cond) for s in self.shape_conditions)
        self.value_states = frozenset(
            name for s in self.shape_conditions if not reads_shape(s.cond)
            for name in _declared(s.then + s.orelse))

    @property
    def name(self) -> str:
        return self.tree.name

    @property
    def doc(self) -> str:
        return self.tree.doc

    def program(self, flags: dict[str, bool], shapes: tuple[bool, ...] = ()) -> ir.Program:
        """The program for these bool hyperparameters and shape-condition outcomes (missing
        outcomes are false)."""
        n = len(self.shape_conditions)
        key = (tuple(sorted(flags.items())), (tuple(shapes) + (False,) * n)[:n])
        if key not in self._programs:
            self._programs[key] = _guard(lambda: lower(self.tree, dict(key[0]), key[1]),
                                         self.source, self.filename, self.tree)
        return self._programs[key]

    def shapes(self, values: dict, shape: tuple[int, ...]) -> tuple[bool, ...]:
        """The outcome of each shape condition for a tensor of ``shape``; ``values`` maps
        every hyperparameter to a Python bool or float."""
        return tuple(bool(static_value(s.cond, values, tuple(shape)))
                     for s in self.shape_conditions)

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


def _declared(stmts):
    """The names of the states declared in ``stmts``, in nested ifs too."""
    for s in stmts:
        if isinstance(s, ast.StateDecl):
            yield s.name
        elif isinstance(s, ast.If):
            yield from _declared(s.then + s.orelse)


def _guard(fn, source, filename, tree=None):
    """Run a compiler stage; every failure leaves as a SpecError pointing at the source."""
    try:
        return fn()
    except SpecError as err:
        raise err.with_source(source, filename) from None
    except RecursionError:
        raise SpecError("the spec nests too deeply to compile", None, source, filename) from None
    except Exception as err:  # a bug of ours: still say where, never a bare traceback
        span = tree.name_span if tree is not None else None
        raise SpecError(f"internal compiler error ({type(err).__name__}: {err}); please "
                        "report it with this spec", span, source, filename) from err


def load(source: str, filename: str = "<spec>") -> Spec:
    """Parse and check spec text. Raises SpecError on any mistake."""
    if not isinstance(source, str):
        raise TypeError(f"a spec is text, got {type(source).__name__}")
    tree = _guard(lambda: parse(source, filename), source, filename)
    hypers = _guard(lambda: check(tree), source, filename, tree)
    return Spec(source, filename, tree, hypers)
