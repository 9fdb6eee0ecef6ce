"""Text -> syntax tree, with lark. Parse errors become SpecErrors with a caret."""
from __future__ import annotations

import difflib
import math
import re
import sys
from functools import cache
from importlib.resources import files

import lark
from lark import Lark, Token, Transformer, v_args

from vega.dsl import ast
from vega.dsl.parse_errors import BLOCK_LABELS, MOD, PARSE_ERROR_EXAMPLES, STATEMENT_KEYWORDS
from vega.errors import Span, SpecError, source_lines


@cache
def _parser() -> Lark:
    grammar = files("vega.dsl").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _span(x) -> Span:
    return Span.of(x if isinstance(x, Token) else x.meta) or Span(1, 1, 1, 2)


def _join(a: Span, b: Span) -> Span:
    return Span(a.line, a.column, b.end_line, b.end_column)


def _line(source: str, n: int) -> str:
    """Line ``n`` of ``source`` as the parser counts lines; "" past its lines."""
    lines = source_lines(source)
    return lines[n - 1] if 0 < n <= len(lines) else ""


def _number(tok: Token) -> float:
    """A NUMBER or a CONSTANT (inf, nan, pi) token's value."""
    return ast.CONSTANTS[str(tok)] if tok.type == "CONSTANT" else float(tok)


class _Build(Transformer):
    """Builds the AST only; every check happens afterwards (see check.py)."""

    # expressions
    def number(self, children):
        (tok,) = children
        return ast.Num(float(tok), _span(tok))

    def true(self, children):
        return ast.Bool(True, _span(children[0]))

    def false(self, children):
        return ast.Bool(False, _span(children[0]))

    def name(self, children):
        (tok,) = children
        if str(tok) in ast.CONSTANTS:  # inf, nan, pi
            return ast.Num(ast.CONSTANTS[str(tok)], _span(tok))
        return ast.Name(str(tok), _span(tok))

    @v_args(meta=True)
    def call(self, meta, children):
        fn, *args = children
        args = tuple(a for a in args if a is not None)
        return ast.Call(str(fn), args, Span.of(meta), _span(fn))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ast.Unary("-", children[0], Span.of(meta))

    @v_args(meta=True)
    def not_(self, meta, children):
        return ast.Unary("not", children[0], Span.of(meta))

    def _chain(self, op, children):
        out = children[0]
        for nxt in children[1:]:
            out = ast.Binary(op, out, nxt, _join(out.span, nxt.span), _join(out.span, nxt.span))
        return out

    def or_(self, children):
        return self._chain("or", children)

    def and_(self, children):
        return self._chain("and", children)

    def binary(self, children):
        a, op, b = children
        return ast.Binary(str(op), a, b, _join(a.span, b.span), _span(op))

    def comparison(self, children):
        return self.binary(children)

    def pow(self, children):
        a, b = children
        return ast.Binary("^", a, b, _join(a.span, b.span), _join(a.span, b.span))

    # statements
    @v_args(meta=True)
    def state_decl(self, meta, children):
        name, shape, dtype, init = children
        if dtype is None and shape is not None and str(shape) in ast.STATE_DTYPE_WORDS:
            shape, dtype = None, shape  # (`state nu: bfloat16`: a dtype, no shape)
        return ast.StateDecl(str(name), init, Span.of(meta), _span(name),
                             None if shape is None else str(shape),
                             None if shape is None else _span(shape),
                             None if dtype is None else str(dtype),
                             None if dtype is None else _span(dtype))

    @v_args(meta=True)
    def assign(self, meta, children):
        name, value = children
        return ast.Assign(str(name), value, Span.of(meta), _span(name))

    def empty(self, children):
        return None

    def body(self, children):
        return tuple(c for c in children if c is not None)

    @v_args(meta=True)
    def if_stmt(self, meta, children):
        cond, then, *rest = children
        orelse = rest[0] if rest and rest[0] is not None else ()
        return ast.If(cond, then, orelse, Span.of(meta))

    @v_args(meta=True)
    def mode_block(self, meta, children):
        name, body = children
        return ast.Mode(str(name), body, Span.of(meta), _span(name))

    @v_args(meta=True)
    def repeat_stmt(self, meta, children):
        count, body = children
        value = ast.Name(str(count), _span(count)) if count.type == "NAME" else \
            ast.Num(_number(count), _span(count))
        return ast.Repeat(value, body, Span.of(meta))

    def if_chain(self, children):
        return (children[0],)

    # header
    def neg_number(self, children):
        return -_number(children[0]), _span(children[0])

    def signed(self, children):
        return _number(children[0]), _span(children[0])

    def bound(self, children):
        return children[0][0]

    @v_args(meta=True)
    def range(self, meta, children):
        lb, lo, hi, rb = children
        return ast.Range(lo, hi, lb, rb, Span.of(meta))

    def closed_end(self, children):
        return True

    def open_end(self, children):
        return False

    def hyper(self, children):
        name, type_, default, rng = children
        if isinstance(default, Token):  # true / false
            value, dspan = str(default) == "true", _span(default)
        else:
            value, dspan = default
        if type_ is None:
            kind = "bool" if isinstance(value, bool) else "float"
        else:
            kind = str(type_)
        return ast.Hyper(str(name), kind, value, rng, _join(_span(name), dspan),
                         _span(type_) if type_ is not None else None, dspan)

    def hypers(self, children):
        return tuple(h for h in children if h is not None)

    def class_name(self, children):
        return children[0]

    @v_args(meta=True)
    def optimizer(self, meta, children):
        name, cls, hypers, body = children
        return ast.Spec(str(name), str(cls) if cls is not None else None, hypers, body, "",
                        Span.of(meta), _span(name))

    def start(self, children):
        return children[0]


def _doc(source: str) -> str:
    """The comment lines before `optimizer`: the spec's documentation."""
    lines = []
    for line in source_lines(source):
        s = line.strip()
        if s.startswith("optimizer"):
            break
        if s.startswith("#"):
            lines.append(s[1:].strip())
    return "\n".join(lines).strip()


# characters of other languages' operators, and how Vega writes what they do
CHARACTER_HINTS = {
    "%": f"Vega has no remainder operator: {MOD}",
    "&": "Vega writes 'and' ('a > 0 and b > 0')",
    "|": "Vega writes 'or' ('a > 0 or b > 0')",
    "!": "Vega writes 'not' ('not a > 0'; '!=' is 'not equal')",
    "?": "Vega writes a choice between values as where(cond, a, b)",
}


def _describe_unexpected(err: lark.exceptions.UnexpectedInput) -> str:
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        hint = CHARACTER_HINTS.get(err.char)
        return f"unexpected character {err.char!r}" + (f": {hint}" if hint else "")
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        return "unexpected end of file"
    tok = err.token
    if tok.type == "$END":
        return "unexpected end of file"
    return f"unexpected {str(tok)!r}"


@cache
def _example_errors() -> tuple[tuple[str, lark.exceptions.UnexpectedInput], ...]:
    out = []
    for label, examples in PARSE_ERROR_EXAMPLES.items():
        for text in examples:
            try:
                _parser().parse(text)
            except lark.exceptions.UnexpectedInput as err:
                out.append((label, err))
    return tuple(out)


def _position(state):
    """The parser's state in a lark error's ``state`` (the lexer's state, for a character no
    token begins with, as it is)."""
    return getattr(state, "position", state)


def _label(err: lark.exceptions.UnexpectedInput) -> str | None:
    """The label of the example mistake that fails as ``err`` does: one in the same parser
    state expecting the same tokens, at the same token if any, else at a token of its
    type (``lr = pie`` as ``lr = a``), else the first. lark's ``match_examples`` does
    this, but lark 1.3 raises TypeError (formatting a debug message) when two errors
    share a state and not their expected tokens. The state is the parser's state alone,
    not the depth of its stack (which lark's states also compare): the examples' mistakes
    stand in their body's first statement, and the same mistake in a later statement, or
    inside an if, is the same state deeper in the stack."""
    found = typed = None
    for label, ex in _example_errors():
        tokens = all(isinstance(e, lark.exceptions.UnexpectedToken) for e in (ex, err))
        if _position(ex.state) != _position(err.state) \
                or (tokens and ex.accepts != err.accepts):
            continue
        token, ex_token = getattr(err, "token", None), getattr(ex, "token", None)
        if token is not None and ex_token is not None:
            if token == ex_token:
                return label
            if typed is None and token.type == ex_token.type:
                typed = label
        found = found or label
    return typed or found


# what each closing bracket may close: a range is half-open as well as closed, so ']'
# and ')' close '[' and '(' alike ([0, inf) is balanced)
_PAIRS = {")": "([", "}": "{", "]": "(["}


def _unbalanced(source: str) -> SpecError | None:
    """The first bracket that is never closed or never opened, if any."""
    stack: list[tuple[str, int, int]] = []
    for lineno, line in enumerate(source_lines(source), 1):
        for col, ch in enumerate(line.split("#", 1)[0], 1):
            if ch in "({[":
                stack.append((ch, lineno, col))
            elif ch in _PAIRS:
                opened = [o for o, _, _ in stack]
                if stack and stack[-1][0] not in _PAIRS[ch] \
                        and any(o in _PAIRS[ch] for o in opened):
                    open_ch, open_line, open_col = stack[-1]
                    return SpecError(f"unbalanced brackets: '{open_ch}' is never closed",
                                     Span(open_line, open_col, open_line, open_col + 1))
                if not stack or stack[-1][0] not in _PAIRS[ch]:
                    return SpecError(f"unbalanced brackets: '{ch}' closes nothing",
                                     Span(lineno, col, lineno, col + 1))
                stack.pop()
    if stack:
        ch, lineno, col = stack[-1]
        return SpecError(f"unbalanced brackets: '{ch}' is never closed",
                         Span(lineno, col, lineno, col + 1))
    return None


# tokens that may begin a statement or end a body: after an if's condition, an else, a
# mode's name or a repeat's count, one of these means the '{' was left out
_STATEMENT_TOKENS = {"NAME", "STATE", "IF", "MODE", "REPEAT", "SEMICOLON", "RBRACE", "$END"}
# what each block's head is, that its '{' follows
_BLOCK_HEADS = {"IF": "its condition", "MODE": "its name", "REPEAT": "its count"}
# the words that begin a statement (or continue an if)
_STATEMENT_KEYWORDS = ("state", "if", "else", "mode", "repeat")


def _end(x) -> tuple[int, int] | None:
    """Where a token or a tree built so far ends (line, column), if known."""
    meta = x if isinstance(x, Token) else getattr(x, "meta", None)
    if meta is None or getattr(meta, "empty", False) or getattr(meta, "end_line", None) is None:
        return None
    return meta.end_line, meta.end_column


def _quoted(source: str, start: Token, end: tuple[int, int] | None) -> str:
    """The text from ``start`` to ``end`` where it is one short line, else ``start``'s."""
    if end is not None and end[0] == start.line and end[1] - start.column <= 40:
        return " ".join(source_lines(source)[start.line - 1][start.column - 1:end[1] - 1].split())
    return str(start)


def _value_stack(err: lark.exceptions.UnexpectedInput) -> list:
    """What the parser had read before it failed: tokens and the trees made of them."""
    state = getattr(getattr(err, "interactive_parser", None), "parser_state", None)
    return getattr(state, "value_stack", None) or []


def _missing_brace(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """A block whose '{' was left out (``if cautious`` with its body on the next line, an
    ``else`` or a ``mode eval`` without one), at the head of the block: the parse fails
    only at the next statement, or at a '}' at the end that then closes nothing."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) \
            or err.token.type not in _STATEMENT_TOKENS or "LBRACE" not in err.accepts:
        return None
    stack = _value_stack(err)
    if err.accepts == {"LBRACE", "IF"} and stack and isinstance(stack[-1], Token) \
            and stack[-1].type == "ELSE":
        tok = stack[-1]
        return SpecError(f"'else' needs '{{' or 'if' after it; {BLOCK_LABELS['ELSE']}",
                         _span(tok))
    if err.accepts != {"LBRACE"} or len(stack) < 2 or not isinstance(stack[-2], Token) \
            or stack[-2].type not in _BLOCK_HEADS:
        return None
    head, end = stack[-2], _end(stack[-1])
    span = Span(head.line, head.column, *(end or (head.end_line, head.end_column)))
    return SpecError(f"'{_quoted(source, head, end)}' needs '{{' after "
                     f"{_BLOCK_HEADS[head.type]}; {BLOCK_LABELS[head.type]}", span)


def _statement_name(err: lark.exceptions.UnexpectedInput) -> Token | None:
    """The name the parse read as a statement's (the name it assigns) where it then failed,
    wanting that statement's '=': a word of another language there (``stat``, ``def``,
    ``p -= x``, ``a, b = ...``) is taken for a name to assign."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.accepts != {"EQUAL"}:
        return None
    stack = _value_stack(err)
    last = stack[-1] if stack else None
    return last if isinstance(last, Token) and last.type == "NAME" else None


# what each keyword that begins a statement does, for a statement that assigns to it
_KEYWORD_STATEMENTS = {word.upper(): does for word, does in STATEMENT_KEYWORDS.items()}


def _keyword_assigned(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """A statement that assigns to a keyword of the language (``mode = ...``, ``state =
    ...``; ``state mode = zeros`` then ``mode = g``): the parse reads the word as the
    keyword's and fails at the '='."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.token.type != "EQUAL":
        return None
    stack = _value_stack(err)
    word = stack[-1] if stack else None
    if not isinstance(word, Token) or word.type not in _KEYWORD_STATEMENTS:
        return None
    return SpecError(f"'{word}' is a keyword ({_KEYWORD_STATEMENTS[word.type]}), so no value "
                     f"or state can be assigned by that name: give it a name of its own "
                     f"('{word}_' or a longer one)", _span(word))


def _misspelled_keyword(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """A statement that starts with a near miss of a keyword (``stat m = zeros``): the
    parse takes the word for a name to assign and fails at the next token."""
    word = _statement_name(err)
    if word is None:
        return None
    close = difflib.get_close_matches(str(word).lower(), _STATEMENT_KEYWORDS, n=1, cutoff=0.6)
    if not close:
        return None
    return SpecError(f"unknown keyword '{word}' (did you mean '{close[0]}'?)",
                     _span(word))


def _glued_number(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """A number with letters or '_' in it (``0x10``, ``1_000``, ``2x``): the parse reads the
    digits as a number and the rest as a name that starts a statement, and fails at the
    token after that name, on the next line where the number ends one (in the header, at
    the name, as a missing comma)."""
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    lines = source_lines(source)
    for word in (err.token, *_value_stack(err)[-1:]):  # (in the header, the name fails)
        if isinstance(word, Token) and word.type == "NAME" and 0 < word.line <= len(lines):
            line = lines[word.line - 1]
            number = re.search(r"(?<![A-Za-z0-9_.])(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$",
                               line[:word.column - 1])
            if number is not None:
                break
    else:
        return None
    start = number.start()
    text = line[start:word.end_column - 1]
    return SpecError(f"'{text}' is not a number: Vega writes a number in decimal digits, "
                     "with a point and an exponent if any (16, 1000, 0.5, 1e-3)",
                     Span(word.line, start + 1, word.line, word.end_column))


# modules a spec written from Python calls into; their constants, and a tensor's methods
# and attributes in Python, as Vega writes them
_MODULES = ("math", "cmath", "torch", "np", "numpy", "jnp", "jax", "lax", "F", "nn", "tl",
            "optax", "scipy")
_MODULE_CONSTANTS = {"pi": "pi", "inf": "inf", "nan": "nan", "e": "exp(1)"}
_METHODS = {"min": "the smallest value of x is -max(-x)",
            "t": "a matrix's transpose is transpose(x)", "neg": "a negation is -x",
            "reciprocal": "a reciprocal is 1 / x", "item": "a value is read as it is"}
_ATTRIBUTES = {"grad": "the gradient is g", "data": "the parameter is p",
               "T": "a matrix's transpose is transpose(x)",
               "mT": "a matrix's transpose is transpose(x)",
               "shape": "size(p, k) is the length of axis k",
               "ndim": "ndim(p) is the number of axes, in an if's condition"}


# reductions of a tensor's values, which torch's methods take along an axis too
_REDUCTIONS = ("sum", "mean", "max", "norm", "min")
# how Vega writes one whose signature (_SIGNATURES) does not say it: min(x) is no reduction
_ALONG_AXES = {"min": "min(a, b), or the smallest value over a tensor -max(-x), -row_max(-x) "
                      "or -col_max(-x) over the matrix view's rows or columns"}


def _dotted(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """A name with a '.' after it, as Python writes a module's function or constant
    (``math.sqrt(x)``, ``torch.sign(g)``, ``math.pi``) or a tensor's method or attribute
    (``g.abs()``, ``p.grad``): the lexer finds no token at the '.'. Said at the name, with
    Vega's spelling where it has one."""
    from vega.dsl.check import FUNCTIONS, GLOBAL_FUNCTIONS, SHAPE_QUERIES, WRITTEN_OTHERWISE
    if not isinstance(err, lark.exceptions.UnexpectedCharacters) or err.char != ".":
        return None
    line = _line(source, err.line)
    # (a name, not the tail of a number: 1e5.abs() is no method of e5's)
    before = re.search(r"(?<![\w.])[A-Za-z_][A-Za-z0-9_]*$", line[:err.column - 1])
    after = re.match(r"\.([A-Za-z_][A-Za-z0-9_]*)(\s*\()?", line[err.column - 1:])
    if before is None or after is None:
        return None
    base, attr, called = before.group(), after.group(1), after.group(2) is not None
    known = {**FUNCTIONS, **dict.fromkeys(GLOBAL_FUNCTIONS, {1: None}),
             **dict.fromkeys(SHAPE_QUERIES, {1: None})}
    if base in _MODULES:
        shown = f"'{base}.{attr}'"
        if not called:
            how = f"Vega has no modules; write {_MODULE_CONSTANTS[attr]}" \
                if attr in _MODULE_CONSTANTS else \
                "Vega has no modules, and its constants are numbers: pi, inf, nan"
        elif attr in known:
            how = f"Vega has no modules, and its functions are built in; write {attr}(...)"
        elif attr in WRITTEN_OTHERWISE:
            how = ("Vega has no modules, and its functions are built in; "
                   f"{WRITTEN_OTHERWISE[attr]}")
        else:
            how = (f"Vega has no modules, and its functions are built in: '{attr}' is not "
                   "one of them (sqrt, exp, log, abs, sign, min, max, clamp, ...; see the "
                   "language's functions)")
    elif called:
        shown = f"'{base}.{attr}()'"
        # (a reduction's method given an axis, g.mean(0) or g.sum(dim=1), is no call of
        # mean(g), which reduces the whole tensor: say how Vega reduces along an axis)
        axis = attr in _REDUCTIONS and not line[err.column - 1 + after.end():].lstrip() \
            .startswith(")")
        if axis:
            shown = f"'{base}.{attr}(...)'"
            how = f"Vega has no methods; {_ALONG_AXES.get(attr, _SIGNATURES[attr])}"
        elif attr in _METHODS:
            how = f"Vega has no methods; {_METHODS[attr]}"
        elif attr in known:
            args = base if 1 in known[attr] else f"{base}, ..."
            how = f"Vega has no methods; write {attr}({args})"
        elif attr in WRITTEN_OTHERWISE:
            how = f"Vega has no methods; {WRITTEN_OTHERWISE[attr]}"
        else:
            how = "Vega has no methods: a function takes the value, f(x)"
    else:
        shown = f"'{base}.{attr}'"
        how = "Vega has no attributes" + (f"; {_ATTRIBUTES[attr]}" if attr in _ATTRIBUTES
                                          else ": a name is one value per element")
    return SpecError(f"{shown}: {how}", Span(err.line, before.start() + 1, err.line,
                                             err.column + 1 + len(attr)))


def _augmented(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """Python's augmented assignment, ``p -= x`` (``m *= b1``, ``p **= 2``): the parse reads
    the name as a statement's and fails at the operator, where it wants '='."""
    name = _statement_name(err)
    if name is None:
        return None
    found = re.match(r"(\*\*|//|[-+*/^@])=", _line(source, err.line)[err.column - 1:])
    if found is None:
        return None
    op = found.group(1)
    value = {"**": f"{name} ^ ...", "//": f"floor({name} / ...)"}.get(op, f"{name} {op} ...")
    return SpecError(f"Vega has no '{op}=': write '{name} = {value}'",
                     Span(err.line, err.column, err.line, err.column + len(op) + 1))


# the tokens after which a '[' would begin a value (a list), not index one
_BEFORE_A_VALUE = {"EQUAL", "LPAR", "COMMA", "ADD_OP", "MUL_OP", "MINUS", "CIRCUMFLEX",
                   "COMP_OP", "LBRACE"}


def _first_on_its_line(tok: Token, source: str) -> bool:
    lines = source_lines(source)
    return 0 < tok.line <= len(lines) and not lines[tok.line - 1][:tok.column - 1].strip()


def _indexing(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """Python's indexing and floor division in a statement: ``g[0]`` (a '[' right after a
    name, a number or a ')' on its line, in the body: in the header it begins a range) and
    ``a // b`` (a '/' after a '/'); a '//' that begins its line is a C comment."""
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    stack, tok = _value_stack(err), err.token
    if not stack:
        return None
    last = stack[-1]
    if tok.type == "LSQB" and any(isinstance(v, Token) and v.type == "LBRACE" for v in stack) \
            and isinstance(last, Token) and last.type in ("NAME", "NUMBER", "RPAR", "RSQB") \
            and not _first_on_its_line(tok, source):
        return SpecError("Vega has no indexing: each name is its value at the element a "
                         "statement runs for; a reduction reads a whole tensor (sum(x), "
                         "norm(x), row_sum(x)), and size(p, k) is the length of axis k",
                         _span(tok))
    if str(tok) == "/" and isinstance(last, Token) and str(last) == "/" \
            and (last.end_line, last.end_column) == (tok.line, tok.column):
        how = "Vega's comments start with '#', not '//'" if _first_on_its_line(last, source) \
            else "Vega has no '//': floor division is floor(a / b)"
        return SpecError(how, Span(last.line, last.column, tok.end_line, tok.end_column))
    return None


def _python_word(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """A word of Python's where Vega has its own: ``True`` and ``False`` as a default (in
    the body they are undefined names, which the check says), ``is`` in a comparison: where
    the parse fails at it, or, after an assignment's value on its line (``x = p is g``),
    where the parse took it for the name of the next statement and fails after it."""
    from vega.dsl.check import PYTHON_WORDS
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    tok, name = err.token, _statement_name(err)
    if name is not None and str(name) == "is" and not _first_on_its_line(name, source):
        tok = name
    if tok.type != "NAME":
        return None
    if str(tok) in PYTHON_WORDS:
        how = f"Vega writes {PYTHON_WORDS[str(tok)]}"
    elif str(tok) == "is":
        how = "Vega compares with '==' and '!='"
    else:
        return None
    return SpecError(f"unexpected '{tok}': {how}", _span(tok))


def _colon_block(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """A block's head ended with Python's ':' (``if f:``, ``else:``, ``repeat 2:``) where
    its '{' goes: said at the ':'."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.token.type != "COLON" \
            or "LBRACE" not in err.accepts:
        return None
    head = next((v for v in reversed(_value_stack(err)) if isinstance(v, Token)
                 and v.type in (*_BLOCK_HEADS, "ELSE", "LBRACE")), None)
    if head is None or head.type not in BLOCK_LABELS:
        return None
    tok = err.token
    return SpecError(f"a block goes in braces, not after ':'; {BLOCK_LABELS[head.type]}",
                     _span(tok))


# Python's statements, which a spec has not, and what it does instead
_FUNCTIONS_BUILT_IN = "its functions (sqrt, exp, sign, ...) are built in"
_NO_FUNCTIONS = ("a spec defines no functions; a name assigned a value (x = ...) holds it "
                 "for the statements after")
_NO_LOOPS = ("a statement runs for every element at once; repeat N { ... } runs a body N "
             "times")
_PYTHON_STATEMENTS = {
    "def": _NO_FUNCTIONS, "lambda": _NO_FUNCTIONS,
    "import": _FUNCTIONS_BUILT_IN, "from": _FUNCTIONS_BUILT_IN,
    "return": "a step assigns p its new value (p = ...)",
    "for": _NO_LOOPS, "while": _NO_LOOPS,
    "pass": "an empty body is { }",
}


def _python_statement(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """A Python statement (``def``, ``import``, ``return``, ``for``, ``while``, ``pass``,
    ``elif``) where a statement starts, or before the spec (``import math``): the parse
    takes its word for a name to assign and fails at the next token. And ``lambda`` with
    its arguments before the ':' where the parse fails (not a name 'lambda' elsewhere on
    the line). Said at the word."""
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    word, name = None, _statement_name(err)
    if not _value_stack(err) and err.token.type == "NAME" \
            and str(err.token) in ("import", "from"):
        word, span = str(err.token), _span(err.token)
    elif name is not None and (str(name) in _PYTHON_STATEMENTS or str(name) == "elif"):
        word, span = str(name), _span(name)
    elif err.token.type in ("COLON", "COMMA"):  # (lambda x: ..., lambda x, y: ...)
        tok = err.token
        found = re.search(r"\blambda\b(?=(\s*[A-Za-z_]\w*\s*(,\s*[A-Za-z_]\w*\s*)*)?\s*$)",
                          _line(source, tok.line)[:tok.column - 1])
        if found is not None:
            word = "lambda"
            span = Span(tok.line, found.start() + 1, tok.line, found.end() + 1)
    if word is None:
        return None
    how = "Vega writes 'else if', not 'elif'" if word == "elif" else \
        f"Vega has no '{word}': {_PYTHON_STATEMENTS[word]}"
    return SpecError(how, span)


def _tuple_assignment(err: lark.exceptions.UnexpectedInput, source: str) -> SpecError | None:
    """Python's assignment of several names at once, ``a, b = x, y``: the parse reads the
    first name as a statement's and fails at the ',', where it wants '='."""
    first = _statement_name(err)
    if first is None or err.token.type != "COMMA":
        return None
    found = re.match(r"[A-Za-z_]\w*(\s*,\s*[A-Za-z_]\w*)+(?=\s*=)",
                     _line(source, first.line)[first.column - 1:])
    if found is None:
        return None
    names = [n.strip() for n in found.group().split(",")]
    tok = err.token
    return SpecError("Vega assigns one name at a time: " + "; ".join(f"{n} = ..." for n in names),
                     _span(tok))


# how a function's arguments go, for a call that named one
_SIGNATURES = {
    "clamp": "clamp(x, lo, hi)", "where": "where(cond, a, b); '==' compares",
    "size": "size(p, k)", "atan2": "atan2(y, x)", "min": "min(a, b)",
    "max": "max(a, b), or max(x) over a tensor, row_max(x) or col_max(x) over the matrix "
           "view's rows or columns",
    "sum": "sum(x) over a tensor, row_sum(x) or col_sum(x) over the matrix view's rows or "
           "columns",
    "mean": "mean(x) over a tensor, row_mean(x) or col_mean(x) over the matrix view's rows "
            "or columns",
    "norm": "norm(x), the L2 norm of a tensor",
}


def _misused_equal(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """An '=' where an expression goes on: Python's keyword argument (``clamp(g, min=0,
    max=1)``, ``sum(g, dim=0)``), said at its name with how the function's arguments go;
    else an '=' meant as '==' (``if lr = 0``) or a second assignment (``m = u = g``)."""
    if not isinstance(err, lark.exceptions.UnexpectedToken) or err.token.type != "EQUAL" \
            or "COMP_OP" not in err.accepts:
        return None
    stack, tok = _value_stack(err), err.token
    depth, fn = 0, None
    for k in range(len(stack) - 1, -1, -1):  # (the call whose arguments the '=' is among)
        v = stack[k]
        if isinstance(v, Token) and v.type == "RPAR":
            depth += 1
        elif isinstance(v, Token) and v.type == "LPAR":
            if depth == 0:
                before = stack[k - 1] if k > 0 else None
                fn = before if isinstance(before, Token) and before.type == "NAME" else None
                break
            depth -= 1
    name = stack[-1] if stack else None
    if fn is not None and isinstance(name, Token) and name.type == "NAME" \
            and isinstance(stack[-2], Token) and stack[-2].type in ("LPAR", "COMMA"):
        from vega.dsl.check import FUNCTIONS
        how = _SIGNATURES.get(str(fn)) or (f"{fn}(x)" if 1 in FUNCTIONS.get(str(fn), ())
                                           else "give the values alone")
        return SpecError(f"{fn}() takes its arguments in order, without names ('{name}='): "
                         f"{how}", Span(name.line, name.column, tok.end_line, tok.end_column))
    return SpecError("'=' assigns a name, in a statement of its own; '==' compares",
                     _span(tok))


def _conditional_expression(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """Python's conditional expression, ``x if c else y``, at its 'if': an 'if' where an
    expression goes on (inside brackets, a default), or, after an assignment's value, an
    if statement whose condition 'else' follows (the parse takes 'if' for one)."""
    if not isinstance(err, lark.exceptions.UnexpectedToken):
        return None
    # (an 'if' where a bracket or a default may close or go on: after a value, not where a
    # value or a statement's '=' goes)
    tok = err.token if err.token.type == "IF" and err.accepts & {"RPAR", "COMMA", "RSQB"} \
        else None
    stack = _value_stack(err)
    if tok is None and str(err.token) == "else" and len(stack) >= 2 \
            and isinstance(stack[-2], Token) and stack[-2].type == "IF":
        tok = stack[-2]
    if tok is None:
        return None
    return SpecError("Vega has no conditional expression 'x if c else y': write "
                     "where(c, x, y), which chooses element by element",
                     _span(tok))


def _misplaced_word(err: lark.exceptions.UnexpectedInput) -> SpecError | None:
    """``and``, ``or`` or ``not`` where a value must stand (``p - not x``): the parse reads
    the word as a name, and fails at a later token (a '}' on the next line)."""
    for v in _value_stack(err):
        tokens = [v] if isinstance(v, Token) else \
            list(v.scan_values(lambda x: isinstance(x, Token))) if hasattr(v, "scan_values") \
            else []
        for tok in tokens:
            if tok.type == "NAME" and str(tok) in ("and", "or", "not"):
                how = ("'not' negates a bool, and binds more loosely than arithmetic and "
                       "comparisons: not (a > b), where(not (g > 0), x, y)" if tok == "not"
                       else f"'{tok}' combines two bools: a > 0 {tok} b > 0")
                return SpecError(f"unexpected '{tok}': {how}",
                                 _span(tok))
    return None


def _check_numbers(tree, source: str, filename: str) -> None:
    """Refuse a number literal that float64 cannot hold: past its range it would read as
    inf, below its smallest value as 0, with no word."""
    for tok in tree.scan_values(lambda v: isinstance(v, Token) and v.type == "NUMBER"):
        value = float(tok)
        if math.isinf(value):
            why = (f"the number {tok} is past float64's range (at most "
                   f"{sys.float_info.max:.4g}); write inf for infinity")
        elif value == 0 and any(c in "123456789" for c in str(tok).lower().split("e")[0]):
            why = (f"the number {tok} is below float64's smallest (about 4.9e-324), so it "
                   "would be 0; write 0 for zero")
        else:
            continue
        raise SpecError(why, _span(tok), source, filename)


def parse(source: str, filename: str = "<spec>") -> ast.Spec:
    """Parse a spec's text into its syntax tree, or raise a SpecError."""
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedInput as err:
        # (before the brackets: a left-out '{' leaves a '}' that closes nothing at the end)
        found = _conditional_expression(err) or _dotted(err, source) or \
            _augmented(err, source) or _indexing(err, source) or _python_word(err, source) or \
            _colon_block(err) or _python_statement(err, source) or \
            _tuple_assignment(err, source) or _misused_equal(err) or \
            _missing_brace(err, source) or _glued_number(err, source) or \
            _misplaced_word(err) or _keyword_assigned(err) or _misspelled_keyword(err)
        if found is not None:
            raise found.with_source(source, filename) from None
        bracket = _unbalanced(source)
        if bracket is not None:
            raise bracket.with_source(source, filename) from None
        if isinstance(err, lark.exceptions.UnexpectedToken) and str(err.token) == "*":
            lines = source_lines(source)
            if 0 < err.line <= len(lines) and 1 < err.column <= len(lines[err.line - 1]) + 1 \
                    and lines[err.line - 1][err.column - 2] == "*":
                raise SpecError("Vega writes powers as 'a ^ b', not 'a ** b'",
                                Span(err.line, err.column - 1, err.line, err.column + 1),
                                source, filename) from None
        # a character with a hint of its own is explained by it, not by a token's example
        hinted = getattr(err, "char", None) in CHARACTER_HINTS
        label = None if hinted else _label(err)
        what = _describe_unexpected(err)
        message = f"{what}: {label}" if label else what
        line, col = err.line, err.column
        if line is None or line < 0:  # at the end of input
            lines = source_lines(source) or [""]
            line, col = len(lines), len(lines[-1]) + 1
        width = len(str(err.token)) if isinstance(err, lark.exceptions.UnexpectedToken) else 1
        raise SpecError(message, Span(line, col, line, col + max(1, width)), source,
                        filename) from None
    _check_numbers(tree, source, filename)
    spec = _Build().transform(tree)
    return ast.Spec(spec.name, spec.class_name, spec.hypers, spec.body, _doc(source), spec.span,
                    spec.name_span)
