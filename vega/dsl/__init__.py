"""The front end: spec text -> syntax tree -> checks -> typed IR."""
from __future__ import annotations

from dataclasses import dataclass, field

from vega.dsl import ast, ir
from vega.dsl.check import all_flag_settings, check, lower
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

    @property
    def name(self) -> str:
        return self.tree.name

    @property
    def doc(self) -> str:
        return self.tree.doc

    def program(self, flags: dict[str, bool]) -> ir.Program:
        key = tuple(sorted(flags.items()))
        if key not in self._programs:
            self._programs[key] = _guard(lambda: lower(self.tree, dict(key)), self.source,
                                         self.filename, self.tree)
        return self._programs[key]

    def flag_settings(self) -> list[dict[str, bool]]:
        return all_flag_settings(self.hypers)


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
