"""Vega's exceptions: one root, and spec errors that point into the source."""
from __future__ import annotations

import os
import sys
import unicodedata
import warnings
from dataclasses import dataclass

_VEGA = os.path.dirname(os.path.abspath(__file__)) + os.sep


def shown(value) -> str:
    """``repr(value)`` for a message, cut short where long (an int of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the line that called into vega: the first frame, going
    out, that is neither vega's nor torch's (torch's where vega is called through it, as
    ``Optimizer.__init__`` calls ``add_param_group``), so that the warning names the caller's
    file and line, and a filter on the caller's module (``-W error::UserWarning:train``)
    holds it, at whatever depth in vega it is raised."""
    torch = sys.modules.get("torch")
    inside = (_VEGA, *((os.path.dirname(torch.__file__) + os.sep,)
                       if getattr(torch, "__file__", None) else ()))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


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
        """The 1-based line of the mistake in ``source``; None where no place is known."""
        return self.span.line if self.span else None

    @property
    def column(self) -> int | None:
        """The 1-based column of the mistake on its line; None where no place is known."""
        return self.span.column if self.span else None

    def with_source(self, source: str, filename: str) -> SpecError:
        """The same error, attached to the text it came from."""
        return SpecError(self.message, self.span, source, filename)

    def render(self) -> str:
        """The message as ``str(err)`` gives it: ``file:line:col: error: message``, the
        source line and carets under the offending text (``file: error: message`` where
        no place is known)."""
        if self.span is None:
            return f"{self.filename}: error: {self.message}"
        sp = self.span
        head = f"{self.filename}:{sp.line}:{sp.column}: error: {self.message}"
        lines = source_lines(self.source)
        if not 1 <= sp.line <= len(lines):
            return head
        line = lines[sp.line - 1]
        end = sp.end_column if sp.end_line == sp.line else len(line) + 1
        shown = [_cell(c) for c in line]
        before = sum(w for _, w in shown[:sp.column - 1])
        width = max(1, sum(w for _, w in shown[sp.column - 1:end - 1]))
        text = "".join(c for c, _ in shown)
        return f"{head}\n    {text}\n    {' ' * before}{'^' * width}"


# what a character of a quoted source line is shown as: a tab or form feed (which the
# grammar reads as a space) as a space, any other character that is not printed as itself
# (a control, ESC and NUL among them: a terminal would act on it, move the cursor or hide
# the rest of the line; a format character: a bidirectional override that reorders the
# line; a line or paragraph separator; a lone surrogate, which no encoding writes) as '?';
# the message names the character itself, by its escape
_BLANK = {"\t": " ", "\f": " ", "\r": " "}
_UNSHOWN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _cell(c: str) -> tuple[str, int]:
    """A character of a quoted source line as it is shown, and the columns of a terminal it
    takes (0 for a combining mark, 2 for a wide East Asian one), for the caret under it."""
    if c in _BLANK:
        return _BLANK[c], 1
    category = unicodedata.category(c)
    if category in _UNSHOWN:
        return "?", 1
    if category in ("Mn", "Me"):
        return c, 0
    return c, 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


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
