"""Example parse errors, next to the grammar: what a user might write, and what it means.

When a parse fails, the parser (``vega.dsl.parser``) finds the example here that
fails the same way, as lark's ``match_examples`` does, and its label is the
explanation. tests/dsl/test_errors.py checks that each example is explained by
its own label.
"""
from __future__ import annotations

# how Vega writes a remainder, which it has no operator or function for ('%', mod())
MOD = "t mod k is t - k * floor(t / k)"

# the labels of a block whose '{' is left out, by the keyword that starts it; the parser
# puts them after its own words, at the block's head (``'if f' needs '{' after ...``)
BLOCK_LABELS = {
    "IF": "an if's body goes in braces: if cond { ... }",
    "ELSE": "an else's body goes in braces: else { ... }, or else if cond { ... }",
    "MODE": "a mode's body goes in braces: mode NAME { ... }",
    "REPEAT": "a repeat's body goes in braces: repeat N { ... }",
}

PARSE_ERROR_EXAMPLES: dict[str, list[str]] = {
    "a spec starts with 'optimizer NAME(hyperparameters) {'": [
        "adam(lr = 1) { p = p }",
        "optimizer { p = p }",
        "state m = zeros",
    ],
    "the name is followed by its hyperparameters in brackets, () for none: "
    "optimizer NAME(hyperparameters) {": [
        "optimizer o { p = p }",
        "optimizer o as O { p = p }",
    ],
    "the class's name comes after the spec's, before the hyperparameters: "
    "optimizer NAME as CLASS(hyperparameters) {": [
        "optimizer o(lr = 1) as O { p = p }",
        "optimizer o() as O { p = p }",
    ],
    "a hyperparameter needs a default: NAME = VALUE": [
        "optimizer o(lr) { p = p }",
        "optimizer o(lr, b = 1) { p = p }",
        "optimizer o(lr = ) { p = p }",
        "optimizer o(lr: float) { p = p }",
        "optimizer o(b: bool, lr = 1) { p = p }",
    ],
    "a hyperparameter's type is float or bool (k: float = 2)": [
        "optimizer o(k: int = 5) { p = p }",
        "optimizer o(lr = 1, k: int = 5) { p = p }",
    ],
    "hyperparameters are separated by commas": [
        "optimizer o(lr = 1 b = 2) { p = p }",
    ],
    "a hyperparameter's default is a number, true, false, inf, nan or pi": [
        "optimizer o(lr = a) { p = p }",
        "optimizer o(lr = 1, b = a) { p = p }",
        "optimizer o(lr = 1 + 2) { p = p }",
    ],
    "an assignment needs a value after '='": [
        "optimizer o() { p = }",
        "optimizer o() { p = p - }",
        "optimizer o() { p = p * }",
        "optimizer o() { p = p - p * }",
        "optimizer o() { p = p ^ }",
        "optimizer o() { p = - }",
        "optimizer o() { p = sqrt(p, ) }",
        "optimizer o() { m = * p }",
    ],
    "a statement is 'state NAME = VALUE', 'NAME = VALUE' or an if": [
        "optimizer o() { p }",
        "optimizer o() { p + 1 }",
        "optimizer o() { 1 = p }",
        "optimizer o() { m = p 1 = p }",
        "optimizer o() { p == p }",
    ],
    "a range is written 'in [lo, hi]', '(lo, hi)', or half-open": [
        "optimizer o(b = 0.5 in 0, 1) { p = p }",
        "optimizer o(b = 0.5 in [0 1]) { p = p }",
    ],
    "a range's bounds are numbers, inf, -inf, pi or -pi": [
        "optimizer o(b = 0.5 in [a, 1]) { p = p }",
        "optimizer o(b = 0.5 in [0, a]) { p = p }",
    ],
    "comparisons do not chain: write 'a < b and b < c'": [
        "optimizer o() { p = where(p < p < p, p, p) }",
        "optimizer o() { m = p < p < p }",
        "optimizer o(f = true) { if p < p < p { p = p } }",
    ],
    BLOCK_LABELS["IF"]: [
        "optimizer o(f = true) { if f p = p }",
        "optimizer o(f = true) { if (f) p = p }",
    ],
    BLOCK_LABELS["ELSE"]: [
        "optimizer o(f = true) { if f { p = p } else p = p }",
    ],
    BLOCK_LABELS["MODE"]: [
        "optimizer o() { p = p mode eval p = p }",
    ],
    BLOCK_LABELS["REPEAT"]: [
        "optimizer o() { repeat 2 p = p }",
    ],
}


# the keywords that begin a statement, and what each begins: no assignment can name one
# (the parse reads the word as the keyword's), though a state may be declared by it
STATEMENT_KEYWORDS = {"state": "'state NAME = INIT' declares a state",
                      "if": "'if COND { ... }' begins an if",
                      "mode": "'mode NAME { ... }' begins a mode's block",
                      "repeat": "'repeat N { ... }' begins a repeat"}
