"""Vega's exceptions: one root, and spec errors that point into the source."""
from __future__ import annotations

from dataclasses import dataclass


def shown(value) -> str:
    """``repr(value)`` for a message, cut short where long (an int of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


class VegaError(Exception):
    """The root of every error Vega raises on purpose."""


@dataclass(frozen=True)
class Span:
    """A region of a spec's source: 1-based line and column, end exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def of(meta) -> Span | None:
        """The span of a lark tree's meta or a token, if it has one."""
        if meta is None or getattr(meta, "empty", False) or getattr(meta, "line", None) is None:
            return None
        return Span(meta.line, meta.column, meta.end_line, meta.end_column)


class SpecError(VegaError, ValueError):
    """A spec that cannot be compiled, with where and why.

    ``str(err)`` renders ``file:line:col: message``, the source line and a caret
    under the offending text, like a C compiler.
    """

    def __init__(self, message: str, span: Span | None = None, source: str = "",
                 filename: str = "<spec>"):
        self.message = message
        self.span = span
        self.source = source
        self.filename = filename
        super().__init__(self.render())

    @property
    def line(self) -> int | None:
        return self.span.line if self.span else None

    @property
    def column(self) -> int | None:
        return self.span.column if self.span else None

    def with_source(self, source: str, filename: str) -> SpecError:
        """The same error, attached to the text it came from."""
        return SpecError(self.message, self.span, source, filename)

    def render(self) -> str:
        if self.span is None:
            return f"{self.filename}: error: {self.message}"
        sp = self.span
        head = f"{self.filename}:{sp.line}:{sp.column}: error: {self.message}"
        lines = source_lines(self.source)
        if not 1 <= sp.line <= len(lines):
            return head
        text = lines[sp.line - 1].expandtabs(1)
        end = sp.end_column if sp.end_line == sp.line else len(text) + 1
        width = max(1, min(end, len(text) + 1) - sp.column)
        caret = " " * (sp.column - 1) + "^" * width
        return f"{head}\n    {text}\n    {caret}"


def source_lines(text: str) -> list[str]:
    """The lines of a spec's text as its parser counts them: split at ``\n`` alone, where
    ``str.splitlines`` splits at ``\f``, ``\v``, ``\x1c``-``\x1e``, ``\x85``, ``\u2028`` and
    ``\u2029`` too (which the grammar reads as spaces, or within a line); a last ``\n``
    ends the last line, as for ``splitlines``."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines
