"""Every example mistake gives a SpecError at the right place, in the user's terms."""
import random
import unicodedata

import pytest
import torch

import vega
from vega.dsl.parse_errors import PARSE_ERROR_EXAMPLES
from vega.errors import Span, SpecError

# Example mistakes: each a whole malformed spec with the message, line and column its
# SpecError must carry.
# (spec, message fragment, line, column)
ERROR_TABLE: list[tuple[str, str, int, int]] = [
    # syntax
    ("adam(lr = 1e-3) {\n  p = p - lr * g\n}\n", "starts with 'optimizer", 1, 1),
    ("optimizer o(lr) {\n  p = p - lr * g\n}\n", "needs a default", 1, 15),
    ("optimizer o(lr = 1 b2 = 2) {\n  p = p\n}\n", "separated by commas", 1, 20),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr *\n}\n", "needs a value", 3, 1),
    ("optimizer o(lr = 1e-3) {\n  p = (p - lr * g\n}\n", "'(' is never closed", 2, 7),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n", "'{' is never closed", 1, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g)\n}\n", "')' closes nothing", 2, 17),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g ** 2\n}\n", "'a ^ b'", 2, 18),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr @ g\n}\n",
     "'@' multiplies matrices (values of one per element, their transposes and products), "
     "but its left side is the same for every element (a number); use '*' to scale", 2, 11),
    ("optimizer o(b = 0.5 in [0 1]) {\n  p = p\n}\n", "range", 1, 27),
    ("optimizer o(lr = 1 in [0, 1), b = abc) {\n  p = p\n}\n",
     "unexpected 'abc': a hyperparameter's default is a number", 1, 35),
    ("optimizer o(f = true) {\n  if f p = p\n}\n",
     "'if f' needs '{' after its condition; an if's body goes in braces", 2, 3),
    # a left-out '{': at the block's head, not at the '}' left closing nothing at the end
    ("optimizer o(lr = 1e-3, cautious = false) {\n  state m = zeros\n  m = 0.9 * m + g\n"
     "  if cautious\n    m = m * 2\n  }\n  p = p - lr * m\n}\n",
     "'if cautious' needs '{' after its condition", 4, 3),
    ("optimizer o(lr = 1e-3, f = false) {\n  if f {\n    p = p - lr * g\n  } else\n"
     "    p = p - 2 * lr * g\n  }\n}\n",
     "'else' needs '{' or 'if' after it; an else's body goes in braces", 4, 5),
    ("optimizer o(lr = 1e-3, f = false) {\n  if f {\n    p = p - lr * g\n  } else\n"
     "    p = p - 2 * lr * g\n}\n", "'else' needs '{' or 'if' after it", 4, 5),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval\n    p = p\n  }\n}\n",
     "'mode eval' needs '{' after its name", 3, 3),
    ("optimizer o(lr = 1e-3) {\n  repeat 3\n    p = p - lr * g\n  }\n}\n",
     "'repeat 3' needs '{' after its count", 2, 3),
    # a near miss of a keyword at a statement's start
    ("optimizer o(lr = 1e-3) {\n  stat m = zeros\n  m = 0.9 * m + g\n  p = p - lr * m\n}\n",
     "unknown keyword 'stat' (did you mean 'state'?)", 2, 3),
    ("optimizer o(lr = 1e-3, f = true) {\n  iff f {\n    p = p - lr * g\n  }\n}\n",
     "unknown keyword 'iff' (did you mean 'if'?)", 2, 3),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f {\n    p = p - lr * g\n  } els {\n"
     "    p = p\n  }\n}\n", "unknown keyword 'els' (did you mean 'else'?)", 4, 5),
    ("optimizer o(lr = 1e-3) {\n  Repeat 2 {\n    p = p - lr * g\n  }\n}\n",
     "unknown keyword 'Repeat' (did you mean 'repeat'?)", 2, 3),
    ("optimizer o() {\n  p - g\n}\n", "a statement is", 2, 5),
    # a number with letters in it, at the number (not at the next line's first token)
    ("optimizer o() {\n  x = 0x10\n  p = p - x * g\n}\n", "'0x10' is not a number", 2, 7),
    ("optimizer o() {\r\n\tx = 1_000 # é\r\n\tp = p - x * g\r\n}\r\n",
     "'1_000' is not a number", 2, 6),
    ("optimizer o() {\n  p = p - g * 1.5e3f\n}\n", "'1.5e3f' is not a number", 2, 15),
    ("optimizer o(lr = 2x) {\n  p = p - lr * g\n}\n", "'2x' is not a number", 1, 18),
    # the words of expressions: no name, and where a value must stand, at the word
    ("optimizer o() {\n  not = g\n  p = p - not\n}\n", "cannot assign 'not': it is a word",
     2, 3),
    ("optimizer o(true = 1.0) {\n  p = p - g\n}\n", "'true' cannot name a hyperparameter", 1,
     13),
    ("optimizer o() {\n  x = g\n  p = p - not x\n}\n", "unexpected 'not': 'not' negates", 3, 11),
    # names
    ("optimizer o(lr = 1e-3, b1 = 0.9) {\n  state mu = zeros\n  mu = b1 * mu + g\n"
     "  p = p - lr * muu\n}\n", "undefined name 'muu' (did you mean 'mu'?)", 4, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lrr * g\n}\n", "did you mean 'lr'?", 2, 11),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * m\n  state m = zeros\n}\n",
     "undefined name 'm'", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  g = g * 2\n  p = p - lr * g\n}\n",
     "cannot assign to 'g'", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  t = 1\n  p = p - lr * g\n}\n", "cannot assign to 't'", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  lr = lr * 2\n  p = p - lr * g\n}\n",
     "'lr': it is a hyperparameter", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  state m = zeros\n  state m = ones\n  p = p - lr * g\n}\n",
     "state 'm' is already declared on line 2", 3, 9),
    ("optimizer o(lr = 1e-3, lr = 2) {\n  p = p - lr * g\n}\n", "already declared", 1, 24),
    ("optimizer o(g = 1) {\n  p = p - g\n}\n", "it is the gradient", 1, 13),
    ("optimizer o(lr = 1e-3) {\n  m = g\n  state m = zeros\n  p = p - lr * m\n}\n",
     "already a value assigned on line 2", 3, 9),
    ("optimizer o(lr = 1e-3) {\n  state m = g\n  p = p - lr * m\n}\n",
     "initial value may use only p", 2, 13),
    ("optimizer o(lr = 1e-3) {\n  m = zeros\n  p = p - lr * m\n}\n",
     "may only start a state", 2, 7),
    ("optimizer o(inf = 1) {\n  p = p\n}\n",
     "'inf' cannot name a hyperparameter: it is a number (inf, nan and pi are reserved "
     "names)", 1, 13),
    ("optimizer o(lr = 1e-3) {\n  state pi = zeros\n  p = p - lr * g\n}\n",
     "cannot declare a state 'pi': it is a number", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  nan = g != g\n  p = p - lr * g\n}\n",
     "cannot assign 'nan': it is a number", 2, 3),
    # a function's name taken for a value (AdamP's cosine) says how to name it instead
    ("optimizer o(lr = 1e-3) {\n  cos = sum(p * g) / (norm(p) * norm(g))\n"
     "  p = p - lr * cos * g\n}\n",
     "cannot assign 'cos': it is a function; give it a name of its own ('cos_' or a "
     "longer one)", 2, 3),
    ("optimizer o(lr = 1e-3, norm = 1.0) {\n  p = p - lr * g\n}\n",
     "'norm' cannot name a hyperparameter: it is a function; give it a name of its own", 1, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g * PI\n}\n",
     "undefined name 'PI' (did you mean 'pi'?)", 2, 20),
    # functions
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * sqr(g)\n}\n",
     "unknown function 'sqr' (did you mean 'sqrt' or 'rsqrt'?)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * sqrt(g, 2)\n}\n",
     "sqrt() takes 1 argument, got 2", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * where(g > 0, 1)\n}\n",
     "where() takes 3 arguments, got 2", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * norm(lr)\n}\n", "reduces a tensor", 2, 21),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * sqrt\n}\n", "is a function", 2, 16),
    # types
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * (g > 0)\n}\n", "needs a number, but this is a bool",
     2, 17),
    ("optimizer o(lr = 1e-3) {\n  p = where(g, p, p - lr)\n}\n",
     "condition of where() needs a bool", 2, 13),
    ("optimizer o(lr = 1e-3) {\n  p = g > 0\n}\n", "p must be a number", 2, 7),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g and g\n}\n", "'and' needs a bool", 2, 7),
    ("optimizer o(lr = 1e-3, f = true) {\n  p = p - lr * g * f\n}\n",
     "needs a number, but this is a bool", 2, 20),
    ("optimizer o(lr = 1e-3) {\n  if mean(g) > 0 {\n    p = p - lr * g\n  }\n}\n",
     "known when the spec compiles", 2, 6),
    ("optimizer o(lr = 1e-3) {\n  if lr {\n    p = p - lr * g\n  }\n}\n",
     "condition of an if must be a bool", 2, 6),
    ("optimizer o(f: bool = 0.5) {\n  p = p\n}\n", "needs a default of true or false", 1, 23),
    ("optimizer o(x: float = true) {\n  p = p\n}\n", "needs a numeric default", 1, 24),
    ("optimizer o(b1 = 1.5 in [0, 1)) {\n  p = p\n}\n", "outside its range [0, 1)", 1, 18),
    # numbers as written, not to six digits (where '1 is outside [0, 1]' would read false)
    ("optimizer o(b = 0.999999999 in [0, 0.99999999]) {\n  p = p\n}\n",
     "the default 0.999999999 of 'b' is outside its range [0, 0.99999999]", 1, 17),
    ("optimizer o(f: bool = 1.0000001) {\n  p = p\n}\n",
     "needs a default of true or false, not 1.0000001", 1, 23),
    ("optimizer o() {\n  p = p - where(g > 0, g, g > 1)\n}\n",
     "where() needs two values of one type, got a number and a bool", 2, 11),
    ("optimizer o() {\n  state s = p > 0\n  s = s\n  p = p\n}\n",
     "state 's' must start as a number, not a bool", 2, 13),
    ("optimizer o(b1 = 0.5 in [1, 0]) {\n  p = p\n}\n", "is empty", 1, 25),
    # (one bound open: empty, where no default can be inside it)
    ("optimizer o(b1 = 1 in (1, 1]) {\n  p = p\n}\n", "the range (1, 1] of 'b1' is empty", 1, 23),
    ("optimizer o(lr = nan) {\n  p = p\n}\n", "the default of 'lr' cannot be nan", 1, 18),
    ("optimizer o(lr = 1 in [0, nan]) {\n  p = p\n}\n",
     "the range [0, nan] of 'lr' has a nan bound", 1, 23),
    ("optimizer o(lr = pie) {\n  p = p\n}\n",
     "unexpected 'pie': a hyperparameter's default is a number, true, false, inf, nan or pi",
     1, 18),
    ("optimizer o(lr = 1 in [0, Inf)) {\n  p = p\n}\n",
     "unexpected 'Inf': a range's bounds are numbers, inf, -inf, pi or -pi", 1, 27),
    # flow
    ("optimizer o(lr = 1e-3) {\n  state m = zeros\n  m = m + g\n}\n", "never assigns p", 1, 11),
    # a state never assigned keeps its start: a misspelled update (mm) is named
    ("optimizer o(lr = 1e-3, b2 = 0.9) {\n  state m = zeros\n  mm = b2 * m + (1 - b2) * g\n"
     "  p = p - lr * m\n}\n",
     "state 'm' is never assigned, so it would keep its initial value at every step (did you "
     "mean 'm = ...' on line 3, where 'mm' is assigned and never read?)", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  state k: scalar = ones\n  p = p - lr * k * g\n}\n",
     "state 'k' is never assigned, so it would keep its initial value at every step; assign "
     "it (k = ...), or write the constant where it is read", 2, 9),
    ("optimizer o(lr = 1e-3, f = true) {\n  state v = zeros\n  if f {\n    vv = g * g\n"
     "  }\n  p = p - lr * g / (sqrt(v) + 1)\n}\n",
     "(did you mean 'v = ...' on line 4, where 'vv' is assigned and never read?)", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  state z = p\n  zz = z - lr * g\n  p = z\n}\n",
     "state 'z' is never assigned", 2, 9),
    ("optimizer o(lr = 1e-3, f = false) {\n  if f {\n    d = g\n  }\n  p = p - lr * d\n}\n",
     "assigned only in one branch of the if on line 2", 5, 16),
    ("optimizer o(lr = 1e-3, f = false) {\n  if f {\n    state m = zeros\n  }\n  m = g\n"
     "  p = p - lr * g\n}\n", "declared only inside the if on line 2, so only the tensors and "
     "settings that take that branch have it; assign it inside that if, or declare it "
     "before the if", 5, 3),
    # a state a branch declares, read after the if (or in a later if on the same condition):
    # declared there, not assigned, so 'assign it before the if' cannot help
    ("optimizer o(lr = 1e-3) {\n  if ndim(p) >= 2 {\n    state r = zeros\n    r = r + g\n"
     "  }\n  if ndim(p) >= 2 {\n    d = r\n  } else {\n    d = g\n  }\n  p = p - lr * d\n}\n",
     "state 'r' is declared only inside the if on line 2, so only the tensors and settings "
     "that take that branch have it; read it inside that if, or declare it before the if",
     7, 9),
    ("optimizer o(lr = 1e-3, f = false) {\n  if f {\n    d = g\n  } else {\n    d = g > 0\n  }\n"
     "  p = p - lr * g\n}\n", "a number in one branch", 2, 3),
    # rows, columns and shapes
    ("optimizer o(lr = 1e-3) {\n  state v: row = zeros\n  p = p - lr * g\n}\n",
     "not ': row' (did you mean 'rows'?)", 2, 12),
    ("optimizer o(lr = 1e-3) {\n  state v: rows = zeros\n  v = g * g\n  p = p - lr * g\n}\n",
     "state 'v' holds one value per row, but this value has one per element; reduce it with "
     "row_mean(...)", 3, 7),
    ("optimizer o(lr = 1e-3) {\n  state v: rows = zeros\n  v = lr\n  v = g\n  p = p - lr * v\n}\n",
     "state 'v' holds one value per row, but this value has one per element", 4, 7),
    ("optimizer o(lr = 1e-3, f = true) {\n  state v: cols = zeros\n  if f {\n"
     "    y = col_mean(g)\n  } else {\n    y = g\n  }\n  v = y\n  p = p - lr * v\n}\n",
     "state 'v' holds one value per column, but this value has one per element", 8, 7),
    ("optimizer o(lr = 1e-3) {\n  state v: cols = p\n  p = p - lr * g\n}\n",
     "holds one value per column, but this initial value has one per element", 2, 19),
    ("optimizer o(lr = 1e-3) {\n  r = row_mean(g)\n  p = p - lr * row_mean(r)\n}\n",
     "row_mean() reduces the column axis, but its argument has one per row", 3, 25),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * col_sum(lr)\n}\n",
     "col_sum() reduces an axis of a tensor", 2, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g * ndim(p)\n}\n",
     "use it only in the condition of an if", 2, 20),
    ("optimizer o(lr = 1e-3) {\n  if ndim(p) >= 2 and mean(g) > 0 {\n    p = p - lr * g\n"
     "  } else {\n    p = p\n  }\n}\n",
     "a condition on the shape or on float hyperparameters may use only", 2, 23),
    ("optimizer o(lr = 1e-3) {\n  if ndim(g * 2) >= 2 {\n    p = p - lr * g\n"
     "  } else {\n    p = p\n  }\n}\n", "ndim() takes the parameter: ndim(p)", 2, 6),
    ("optimizer o(lr = 1e-3) {\n  if nrows(p) {\n    p = p - lr * g\n"
     "  } else {\n    p = p\n  }\n}\n", "condition of an if must be a bool", 2, 6),
    # scalar state, reductions over a group, modes
    ("optimizer o(lr = 1e-3) {\n  state d: scalr = zeros\n  p = p - lr * g\n}\n",
     "not ': scalr' (did you mean 'scalar'?)", 2, 12),
    ("optimizer o(lr = 1e-3) {\n  state d: scalar = p\n  p = p - lr * g\n}\n",
     "state 'd' holds one number per tensor, but this initial value has one per element", 2, 21),
    ("optimizer o(lr = 1e-3) {\n  state d: scalar = zeros\n  d = d + g\n  p = p - lr * d\n}\n",
     "state 'd' holds one number per tensor, but this value has one per element; reduce it",
     3, 7),
    ("optimizer o(lr = 1e-3) {\n  if ndim(p) >= 2 {\n    p = p - lr * g / global_norm(g)\n"
     "  } else {\n    p = p\n  }\n}\n",
     "global_norm() reduces over every tensor of a group, so it cannot stand inside the if "
     "on line 2", 3, 22),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g / global_sum(lr)\n}\n",
     "global_sum() reduces over the tensors of a group, but its argument is the same for "
     "every tensor", 2, 31),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g / global_summ(g)\n}\n",
     "unknown function 'global_summ' (did you mean 'global_sum'", 2, 20),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    p = p * global_max(p)\n"
     "  }\n}\n", "global_max() cannot stand in mode 'eval'", 4, 13),
    # a repeat on a hyperparameter's value is said to be one (its body is written out as ifs
    # on the value, which the messages named as an if on the repeat's line)
    ("optimizer o(lr = 1e-3, n = 3.0 in [0, 5]) {\n  x = g\n  repeat n {\n    y = x * 0.5\n"
     "    x = y\n  }\n  p = p - lr * y\n}\n",
     "'y' is assigned only inside the repeat on line 3, whose body a tensor may run no times "
     "(by the value of 'n'); assign it before the repeat", 7, 16),
    ("optimizer o(lr = 1e-3, n = 3.0 in [0, 5]) {\n  x = g\n  repeat n {\n"
     "    x = x / global_norm(x)\n  }\n  p = p - lr * x\n}\n",
     "global_norm() reduces over every tensor of a group, so it cannot stand inside the repeat "
     "on line 3, which each tensor runs as many times as the value of its hyperparameter "
     "'n' says", 4, 13),
    ("optimizer o(lr = 1e-3, n = 3.0 in [0, 5]) {\n  x = g\n  repeat n {\n"
     "    x = x @ transpose(x)\n  }\n  p = p - lr * g\n}\n",
     "'x' is a rows x rows matrix after the body of this repeat and one value per element "
     "(the rows x columns matrix view) before it (a tensor may run it no times, by the value "
     "of 'n')", 3, 3),
    # size()'s axis: a whole number, inf and nan too (which int() refused inside the check:
    # an internal compiler error)
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * size(p, inf) * g\n}\n",
     "size()'s axis is a whole number from 0 to 63", 2, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * size(p, nan) * g\n}\n",
     "size()'s axis is a whole number from 0 to 63", 2, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * size(p, 1.5) * g\n}\n",
     "size()'s axis is a whole number from 0 to 63", 2, 24),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * size(p, 64) * g\n}\n",
     "size()'s axis is a whole number from 0 to 63", 2, 24),
    # a state's initial value is made for each tensor alone: a reduction over the group there
    # was each tensor's own (its sum, not the group's), silently
    ("optimizer o(lr = 1e-3) {\n  state n: scalar = global_sum(p)\n  n = n + 1\n"
     "  p = p - lr * g * n\n}\n", "global_sum() cannot start a state", 2, 21),
    ("optimizer o(lr = 1e-3) {\n  state m = p * global_max(abs(p))\n  m = m + g\n"
     "  p = p - lr * m\n}\n", "global_max() cannot start a state", 2, 17),
    ("optimizer o(lr = 1e-3, f = true) {\n  p = p - lr * g\n  if f {\n    mode eval {\n"
     "      p = p\n    }\n  }\n}\n", "mode 'eval' must stand at the top", 4, 5),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  repeat 1 {\n    mode eval {\n"
     "      p = p\n    }\n  }\n}\n", "outside every if, repeat and mode", 4, 5),
    ("optimizer o(lr = 1e-3) {\n  state z = p\n  p = p - lr * g\n  mode eval {\n"
     "    z = p\n  }\n}\n", "mode 'eval' cannot assign state 'z'", 5, 5),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    x = p * g\n  }\n}\n",
     "mode 'eval' cannot read 'g': a mode runs outside a step, without a gradient; it reads "
     "p, the states and the hyperparameters", 4, 13),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    p = p / t\n  }\n}\n",
     "mode 'eval' cannot read 't': a mode runs outside a step, without an update's index",
     4, 13),
    # a value of the step, read in a mode, was a bare "undefined name 'u'" though the spec
    # assigns it
    ("optimizer o(lr = 1e-3) {\n  u = lr * g\n  p = p - u\n  mode eval {\n    p = p + u\n"
     "  }\n}\n",
     "mode 'eval' cannot read 'u', a value of the step (assigned on line 2): a mode runs "
     "outside a step; it reads p, the states and the hyperparameters", 5, 13),
    ("optimizer o(lr = 1e-3) {\n  mode eval {\n    p = p + u\n  }\n  u = lr * g\n"
     "  p = p - u\n}\n",
     "mode 'eval' cannot read 'u', a value of the step (assigned on line 5)", 3, 13),
    # ... and a name read in its own first assignment in a mode was told to be a state,
    # which a mode cannot assign
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    q = q + p\n    p = q\n"
     "  }\n}\n",
     "'q' is read before it has a value: mode 'eval' keeps no value from one call to the next "
     "and assigns no state; it reads p, the states and the hyperparameters", 4, 9),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    x = p\n  }\n}\n",
     "mode 'eval' never assigns p", 3, 8),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  mode eval {\n    p = p\n  }\n"
     "  mode eval {\n    p = 2 * p\n  }\n}\n", "mode 'eval' is already declared on line 3",
     6, 8),
    # matrices
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g @ g\n}\n",
     "'@' of a rows x columns matrix and a rows x columns one: the left's columns must be "
     "the right's rows; transpose one of them", 2, 18),
    ("optimizer o(lr = 1e-3) {\n  A = g @ transpose(g)\n  p = A\n}\n",
     "the parameter p has one value per element, but this value is a rows x rows matrix",
     3, 7),
    ("optimizer o(lr = 1e-3) {\n  A = g @ transpose(g)\n  p = p - A\n}\n",
     "'-' combines a rows x rows matrix with one value per element (the rows x columns "
     "matrix view): a matrix of a product meets only matrices of its shape and numbers",
     3, 9),
    ("optimizer o(lr = 1e-3) {\n  A = g @ transpose(g)\n  p = p - lr * (A + g)\n}\n",
     "'+' combines a rows x rows matrix with one value per element", 3, 19),
    ("optimizer o(lr = 1e-3) {\n  A = g @ transpose(g)\n  p = p - lr * max(g, A)\n}\n",
     "max() combines a rows x rows matrix with one value per element", 3, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * transpose(lr) * g\n}\n",
     "transpose() takes a matrix", 2, 26),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * row_mean(g @ transpose(g))\n}\n",
     "row_mean() reduces an axis of the matrix view, but its argument is a rows x rows "
     "matrix", 2, 25),
    ("optimizer o(lr = 1e-3) {\n  state A = zeros\n  A = g @ transpose(g)\n  p = p\n}\n",
     "state 'A' holds one value per element, but this value is a rows x rows matrix", 3, 7),
    # a state of rows is said to hold one per row, and the message says what to do
    ("optimizer o(lr = 1e-3) {\n  state L: rows = zeros\n  L = g @ transpose(g)\n  p = p\n}\n",
     "state 'L' holds one value per row, but this value is a rows x rows matrix; no state "
     "or parameter keeps a matrix of a product between steps: multiply it back to one "
     "value per element (A @ x) or reduce it (norm(A))", 3, 7),
    ("optimizer o(lr = 1e-3) {\n  repeat 2.5 {\n    p = p - lr * g\n  }\n}\n",
     "a repeat count is a whole number from 0 to 64, not 2.5", 2, 10),
    ("optimizer o() {\n  repeat 2.0000001 { p = p }\n}\n",
     "a repeat count is a whole number from 0 to 64, not 2.0000001", 2, 10),
    ("optimizer o(lr = 1e-3, n = 2.0) {\n  repeat n {\n    p = p - lr * g\n  }\n}\n",
     "repeat n unrolls up to the bound of n's range, which must be at most 64", 2, 10),
    ("optimizer o(lr = 1e-3, steps = 2.0 in [0, 4]) {\n  repeat step {\n    p = p - lr * g\n"
     "  }\n}\n", "'step' is neither (did you mean 'steps'?)", 2, 10),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * size(g * 2, 0) * g\n}\n",
     "size() takes the parameter and an axis", 2, 21),
    ("optimizer o(lr = 1e-3) {\n  repeat 2 {\n    state s = zeros\n    s = s + g\n  }\n"
     "  p = p - lr * g\n}\n", "state 's' is declared inside a repeat", 3, 5),
    ("optimizer o(lr = 1e-3) {\n  if ndim(p) == 2 {\n    y = transpose(g)\n  } else {\n"
     "    y = g\n  }\n  p = p - lr * transpose(y)\n}\n",
     "'y' is a columns x rows matrix in one branch of this if and one value per element "
     "(the rows x columns matrix view) in the other", 2, 3),
    ("optimizer o(lr = 1e-3, k: int = 5) {\n  p = p - lr * k * g\n}\n",
     "unexpected 'int': a hyperparameter's type is float or bool (k: float = 2)", 1, 27),
    # a comparison of a comparison is a parse error, which says how to write a range test
    ("optimizer o(lr = 1e-3) {\n  p = where(0 < g < 1, p - lr * g, p)\n}\n",
     "unexpected '<': comparisons do not chain: write 'a < b and b < c'", 2, 19),
    ("optimizer o(lr = 1e-3) {\n  if lr > 0 > lr { p = p }\n}\n",
     "unexpected '>': comparisons do not chain", 2, 13),
    # another language's operator or function says how Vega writes it
    ("optimizer o(k = 2.0) {\n  p = where(t % k == 0, p, p - g)\n}\n",
     "unexpected character '%': Vega has no remainder operator: t mod k is "
     "t - k * floor(t / k)", 2, 15),
    ("optimizer o() {\n  p = where(g > 0 && p > 0, p, g)\n}\n",
     "unexpected character '&': Vega writes 'and'", 2, 19),
    # a bool kept as a state (SWATS's switch) says how to keep a flag
    ("optimizer o() {\n  state on: scalar = zeros\n  on = norm(g) > 1\n  p = p - g\n}\n",
     "state 'on' must be a number, but this value is a bool; keep a flag as a number, "
     "where(cond, 1, 0), and test it with flag > 0", 3, 8),
    ("optimizer o() {\n  p = p - g / min(abs(g))\n}\n",
     "min() takes 2 arguments, got 1; the smallest value of a tensor is -max(-x)", 2, 15),
    ("optimizer o() {\n  p = p - g / row_min(abs(g))\n}\n",
     "unknown function 'row_min'; the smallest value of each row is -row_max(-x)", 2, 15),
    ("optimizer o(k = 2.0) {\n  p = p - g * mod(t, k)\n}\n",
     "unknown function 'mod'; t mod k is t - k * floor(t / k)", 2, 15),
    # Python's conditional expression, at its 'if': inside brackets, and after an
    # assignment's value, where the parse takes 'if' for an if statement
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * (g if g > 0 else -g)\n}\n",
     "Vega has no conditional expression 'x if c else y': write where(c, x, y)", 2, 19),
    ("optimizer o(lr = 1e-3) {\n  u = g if g > 0 else -g\n  p = p - lr * u\n}\n",
     "Vega has no conditional expression 'x if c else y': write where(c, x, y)", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  p = where(g if g > 0 else p, p, g)\n}\n",
     "Vega has no conditional expression 'x if c else y'", 2, 15),
    ("optimizer o(lr = 1 if 2 > 1 else 2) {\n  p = p - lr * g\n}\n",
     "Vega has no conditional expression 'x if c else y'", 1, 20),
    # what a newcomer from Python writes says how Vega writes it, where it does
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.abs()\n}\n",
     "'g.abs()': Vega has no methods; write abs(g)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.clamp(-1, 1)\n}\n",
     "'g.clamp()': Vega has no methods; write clamp(g, ...)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.pow(2)\n}\n",
     "'g.pow()': Vega has no methods; a power is a ^ b", 2, 16),
    # a name read above the line that gives it its value says so (it was "undefined name")
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * mu\n  state mu = zeros\n  mu = g\n}\n",
     "undefined name 'mu' here: it is declared as a state on line 3, below; a spec runs top "
     "to bottom, once a step: give it its value, or declare its state, above this line", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * d\n  d = g\n}\n",
     "undefined name 'd' here: it is assigned on line 3, below", 2, 16),
    # ... on its own line too (it was a bare "undefined name 'd'")
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * d; d = g\n}\n",
     "undefined name 'd' here: it is assigned after it on line 2; a spec runs top to "
     "bottom", 2, 16),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f { p = p - lr * m; state m = zeros }\n}\n",
     "undefined name 'm' here: it is declared as a state after it on line 2", 2, 23),
    # a header without its brackets, or a typed hyperparameter without a default, said a
    # bare "unexpected '{'" ("unexpected ')'")
    ("optimizer o {\n  p = p - g\n}\n",
     "unexpected '{': the name is followed by its hyperparameters in brackets, () for none",
     1, 13),
    # (a class's name after the brackets was a bare "unexpected 'as'")
    ("optimizer o(lr = 1e-3) as O {\n  p = p - lr * g\n}\n",
     "unexpected 'as': the class's name comes after the spec's, before the hyperparameters: "
     "optimizer NAME as CLASS(hyperparameters) {", 1, 24),
    ("optimizer o(lr: float) {\n  p = p - lr * g\n}\n",
     "unexpected ')': a hyperparameter needs a default: NAME = VALUE", 1, 22),
    # torch.optim's code keeps a buffer as m = b1 * m + g: read before it has a value, a
    # name of its own assignment says to declare a state; grad, param, weight and step say
    # Vega's p, g and t
    ("optimizer o(lr = 1e-3, b1 = 0.9) {\n  m = b1 * m + g\n  p = p - lr * m\n}\n",
     "'m' is read before it has a value; a value kept from one step to the next is a state, "
     "declared before it is read: state m = zeros", 2, 12),
    # ... but where the spec declares its state below, the message says where, as for a
    # name read above its value ("state m = zeros" was asked for, which the spec has)
    ("optimizer o(lr = 1e-3, b1 = 0.9) {\n  m = b1 * m + g\n  state m = zeros\n"
     "  p = p - lr * m\n}\n",
     "undefined name 'm' here: it is declared as a state on line 3, below; a spec runs top "
     "to bottom, once a step", 2, 12),
    ("optimizer o(lr = 1e-3, b1 = 0.9, f = true) {\n  if f { m = b1 * m + g }\n"
     "  state m = zeros\n  p = p - lr * m\n}\n",
     "undefined name 'm' here: it is declared as a state on line 3, below", 2, 19),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * grad\n}\n",
     "undefined name 'grad': the gradient is g", 2, 16),
    # (beside a close name the spec has, which the hint had hidden: 'weight' for a
    # weight_decay said only that the parameter is p)
    ("optimizer o(lr = 1e-3, weight_decay = 0.1) {\n  p = p - lr * (g + weight * p)\n}\n",
     "undefined name 'weight': the parameter is p (or did you mean 'weight_decay'?)", 2, 21),
    ("optimizer o(step_size = 0.1) {\n  p = p - step * g\n}\n",
     "undefined name 'step': the update's index is t (1 at the first step) (or did you mean "
     "'step_size'?)", 2, 11),
    ("optimizer o(lr = 1e-3, b = 0.9) {\n  p = p - lr * g / (1 - b ^ step)\n}\n",
     "undefined name 'step': the update's index is t (1 at the first step)", 2, 29),
    # a value or state named as a keyword that begins a statement cannot be assigned: the
    # parse read the word as the keyword's and said a bare "unexpected '='"
    ("optimizer o(lr = 1e-3) {\n  mode = g\n  p = p - lr * mode\n}\n",
     "'mode' is a keyword ('mode NAME { ... }' begins a mode's block), so no value or state "
     "can be assigned by that name: give it a name of its own ('mode_' or a longer one)", 2, 3),
    # a state of such a name, never assigned, was told to assign it ("assign it (mode =
    # ...)"), which the parse refuses
    ("optimizer o(lr = 1e-3) {\n  state mode = zeros\n  p = p - lr * mode\n}\n",
     "state 'mode' is never assigned, so it would keep its initial value at every step; "
     "'mode' is a keyword ('mode NAME { ... }' begins a mode's block), which no assignment "
     "can name: give the state a name of its own ('mode_' or a longer one)", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  state repeat = zeros\n  repeat = g\n  p = p - repeat\n}\n",
     "'repeat' is a keyword ('repeat N { ... }' begins a repeat), so no value or state", 3, 3),
    ("optimizer o(lr = 1e-3) {\n  state = g\n  p = p - lr * state\n}\n",
     "'state' is a keyword ('state NAME = INIT' declares a state)", 2, 3),
    # a reduction's method along an axis is not the reduction of the whole tensor: the
    # message names the reductions along the matrix view's rows and columns
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.mean(dim=0)\n}\n",
     "'g.mean(...)': Vega has no methods; mean(x) over a tensor, row_mean(x) or col_mean(x) "
     "over the matrix view's rows or columns", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g / g.max(1)\n}\n",
     "'g.max(...)': Vega has no methods; max(a, b), or max(x) over a tensor, row_max(x) or "
     "col_max(x)", 2, 20),
    # (min too: g.min(0) was "'g.min()': ... the smallest value of x is -max(-x)", the
    # whole tensor's)
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.min(dim=0)\n}\n",
     "'g.min(...)': Vega has no methods; min(a, b), or the smallest value over a tensor "
     "-max(-x), -row_max(-x) or -col_max(-x) over the matrix view's rows or columns", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.min()\n}\n",
     "'g.min()': Vega has no methods; the smallest value of x is -max(-x)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.sum()\n}\n",
     "'g.sum()': Vega has no methods; write sum(g)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * sum(g, 0)\n}\n",
     "sum() takes 1 argument, got 2; sum(x) over a tensor, row_sum(x) or col_sum(x) over "
     "the matrix view's rows or columns", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g.grad\n}\n",
     "'g.grad': Vega has no attributes", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * math.sqrt(g)\n}\n",
     "'math.sqrt': Vega has no modules, and its functions are built in; write sqrt(...)",
     2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * torch.sign(g)\n}\n",
     "'torch.sign': Vega has no modules, and its functions are built in; write sign(...)",
     2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * torch.maximum(g, 0)\n}\n",
     "'torch.maximum': Vega has no modules, and its functions are built in; the larger "
     "of two values is max(a, b)", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * np.frobnicate(g)\n}\n",
     "'np.frobnicate': Vega has no modules, and its functions are built in: 'frobnicate' "
     "is not one of them", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * math.pi * g\n}\n",
     "'math.pi': Vega has no modules; write pi", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = p - 1e5.abs() * g\n}\n",  # (not e5's method)
     "unexpected character '.'", 2, 14),
    ("optimizer o(lr = 1e-3) {\n  p -= lr * g\n}\n",
     "Vega has no '-=': write 'p = p - ...'", 2, 5),
    ("optimizer o(lr = 1e-3) {\n  state m = zeros\n  m *= 0.9\n  p = p - lr * m\n}\n",
     "Vega has no '*=': write 'm = m * ...'", 3, 5),
    ("optimizer o(lr = 1e-3) {\n  p **= 2\n}\n", "Vega has no '**=': write 'p = p ^ ...'",
     2, 5),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g[0]\n}\n",
     "Vega has no indexing: each name is its value at the element a statement runs for", 2, 17),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g // 2\n}\n",
     "Vega has no '//': floor division is floor(a / b)", 2, 18),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  // a step\n}\n",  # (a C comment)
     "Vega's comments start with '#', not '//'", 3, 3),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n  [\n}\n",  # (no value indexed)
     "'[' is never closed", 3, 3),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f {\n    p = p - lr * g\n  }[\n}\n",
     "'[' is never closed", 4, 4),
    ("optimizer o(lr = 1e-3) {\n  state [ = zeros\n  p = p - lr * g\n}\n",
     "'[' is never closed", 2, 9),
    ("optimizer o(lr = if 1e-3) {\n  p = p - lr * g\n}\n",  # (no value before the if)
     "unexpected 'if': a hyperparameter needs a default", 1, 18),
    ("optimizer o(lr = 1e-3, f = true) {\n  for if f {\n    p = p - lr * g\n  }\n}\n",
     "Vega has no 'for'", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  p = where(g is 0, p, p - lr * g)\n}\n",
     "unexpected 'is': Vega compares with '==' and '!='", 2, 15),
    ("optimizer o(lr = 1e-3) {\n  c = g is p\n  p = where(c, p, p - lr * g)\n}\n",
     "unexpected 'is': Vega compares with '==' and '!='", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  c = g is not p\n  p = where(c, p, p - lr * g)\n}\n",
     "unexpected 'is': Vega compares with '==' and '!='", 2, 9),
    ("optimizer o(lr = 1e-3, f = True) {\n  p = p - lr * g\n}\n",
     "unexpected 'True': Vega writes true", 1, 28),
    ("optimizer o(lr = 1e-3) {\n  if True {\n    p = p - lr * g\n  }\n}\n",
     "undefined name 'True': Vega writes true", 2, 6),
    ("optimizer o(lr = 1e-3) {\n  p = where(False, p, p - lr * g)\n}\n",
     "undefined name 'False': Vega writes false", 2, 13),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f:\n    p = p - lr * g\n}\n",
     "a block goes in braces, not after ':'; an if's body goes in braces", 2, 7),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f { p = p } else:\n    p = p - lr * g\n}\n",
     "a block goes in braces, not after ':'; an else's body goes in braces", 2, 22),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f and lr > 0:\n    p = p - lr * g\n}\n",
     "a block goes in braces, not after ':'; an if's body goes in braces", 2, 18),
    ("optimizer o(lr = 1e-3) {\n  repeat 2:\n    p = p - lr * g\n}\n",
     "a block goes in braces, not after ':'; a repeat's body goes in braces", 2, 11),
    ("optimizer o(lr = 1e-3) {\n  def f(x):\n    return x\n  p = p - lr * g\n}\n",
     "Vega has no 'def'", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  f = lambda x: x * 2\n  p = p - lr * g\n}\n",
     "Vega has no 'lambda'", 2, 7),
    ("import math\noptimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n",
     "Vega has no 'import': its functions (sqrt, exp, sign, ...) are built in", 1, 1),
    ("optimizer o(lr = 1e-3) {\n  import math\n  p = p - lr * g\n}\n",
     "Vega has no 'import'", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  return p - lr * g\n}\n",
     "Vega has no 'return': a step assigns p its new value (p = ...)", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  for i in range(3) {\n    p = p - lr * g\n  }\n}\n",
     "Vega has no 'for': a statement runs for every element at once; repeat N { ... } "
     "runs a body N times", 2, 3),
    ("optimizer o(lr = 1e-3) {\n  while t < 3 {\n    p = p - lr * g\n  }\n}\n",
     "Vega has no 'while'", 2, 3),
    ("optimizer o(lr = 1e-3, f = true) {\n  if f { p = p } elif f { p = p - lr * g }\n}\n",
     "Vega writes 'else if', not 'elif'", 2, 18),
    ("from math import sqrt\noptimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n",
     "Vega has no 'from': its functions (sqrt, exp, sign, ...) are built in", 1, 1),
    ("optimizer o(lr = 1e-3) {\n  p = where(g > 0, lambda: 1, 2)\n}\n",
     "Vega has no 'lambda'", 2, 20),
    ("optimizer o(lr = 1e-3) {\n  f = lambda x, y: x * y\n  p = p - lr * g\n}\n",
     "Vega has no 'lambda'", 2, 7),
    ("optimizer o(lr = 1e-3) {\n  pass\n}\n", "Vega has no 'pass': an empty body is { }",
     2, 3),
    ("optimizer o(lr = 1e-3) {\n  a, b = g, p\n  p = p - lr * a\n}\n",
     "Vega assigns one name at a time: a = ...; b = ...", 2, 4),
    ("optimizer o(lr = 1e-3) {\n  state m = zeros\n  state v = zeros\n  m, v , w = g, g, g\n"
     "  p = p - lr * m * v * w\n}\n", "Vega assigns one name at a time: m = ...; v = ...; "
     "w = ...", 4, 4),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * clamp(g, min=-1, max=1)\n}\n",
     "clamp() takes its arguments in order, without names ('min='): clamp(x, lo, hi)", 2, 25),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g / sum(abs(g), dim=0)\n}\n",
     "sum() takes its arguments in order, without names ('dim='): sum(x) over a tensor, "
     "row_sum(x) or col_sum(x) over the matrix view's rows or columns", 2, 32),
    ("optimizer o(lr = 1e-3) {\n  p = where(g = 0, p, p - lr * g)\n}\n",
     "where() takes its arguments in order, without names ('g='): where(cond, a, b); "
     "'==' compares", 2, 13),
    ("optimizer o(lr = 1e-3) {\n  if lr = 0 {\n    p = p - g\n  }\n}\n",
     "'=' assigns a name, in a statement of its own; '==' compares", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  m = u = g\n  p = p - lr * m\n}\n",
     "'=' assigns a name, in a statement of its own; '==' compares", 2, 9),
    ("optimizer o(lr = 1e-3) {\n  p = where(g > 0 ? 1 : 0, p, g)\n}\n",
     "unexpected character '?': Vega writes a choice between values as where(cond, a, b)",
     2, 19),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * g / len(p)\n}\n",
     "unknown function 'len'; the length of axis k is size(p, k)", 2, 20),
    ("optimizer o(lr = 1e-3) {\n  p = p - lr * max(g, 0, p)\n}\n",
     "max() takes 1 or 2 arguments, got 3; of more than two values, max(a, max(b, c))", 2, 16),
    ("optimizer o(lr = 1e-3) {\n  p = where(isnan(g), p, p - lr * g)\n}\n",
     "unknown function 'isnan'; x != x holds where x is NaN", 2, 13),
    ("optimizer o(lr = 1e-3) {\n  p = where(torch.isfinite(g), p - lr * g, p)\n}\n",
     "'torch.isfinite': Vega has no modules, and its functions are built in; abs(x) < inf "
     "holds where x is finite", 2, 13),
    # the checker's refusals of names, states, conditions and counts
    ("optimizer o(f = true in [0, 1]) {\n  p = p - g\n}\n",
     "bool hyperparameter 'f' cannot have a range", 1, 25),
    ("optimizer o() {\n  state sqrt = zeros\n  p = p - g\n}\n",
     "cannot declare a state 'sqrt': it is a function; give it a name of its own", 2, 9),
    ("optimizer o() {\n  state zeros = ones\n  p = p - g\n}\n",
     "cannot declare a state 'zeros': it is a state initializer; give it a name of its own",
     2, 9),
    ("optimizer o() {\n  x = p\n  if x {\n    p = p - g\n  }\n}\n",
     "the condition of an if must be a bool, but this is a number", 3, 6),
    ("optimizer o(lr = 1.0) {\n  state lr = zeros\n  p = p - g\n}\n",
     "cannot declare a state 'lr': it is a hyperparameter", 2, 9),
    ("optimizer o() {\n  p = p - g\n  mode eval {\n    state m = zeros\n    p = p\n  }\n}\n",
     "a mode cannot declare a state: mode 'eval' only says how the parameters look", 4, 5),
    ("optimizer o() {\n  state m : rows int8 = zeros\n  m = g\n  p = p - m\n}\n",
     "a state is kept in float32, float64, bfloat16, float16 or uint8 (8-bit blockwise), "
     "not 'int8' (did you mean 'uint8'?)", 2, 18),
    ("optimizer o() {\n  state m : rows uint8 = zeros\n  m = g\n  p = p - m\n}\n",
     "state 'm' holds one value per row: only a state shaped like p is kept in 8 bits", 2, 18),
    ("optimizer o() {\n  state m : scalar uint8 = zeros\n  m = 1\n  p = p - m * g\n}\n",
     "state 'm' holds one number per tensor (a 0-d tensor): only a state shaped like p", 2, 20),
    ("optimizer o(lr = 1.0) {\n  if lr {\n    p = p - g\n  }\n}\n",
     "the condition of an if must be a bool, but this is a number", 2, 6),
    ("optimizer o() {\n  n = global_norm(g, g)\n  p = p - g / n\n}\n",
     "global_norm() takes 1 argument, got 2", 2, 7),
    ("optimizer o() {\n  if ndim(p) > zz {\n    p = p - g\n  }\n}\n",
     "undefined name 'zz'", 2, 16),
    ("optimizer o() {\n  x = 1\n  if ndim(p) > x {\n    p = p - g\n  }\n}\n",
     "may use only ndim(p), nrows(p), ncols(p), hyperparameters and numbers; 'x' is not a "
     "hyperparameter", 3, 16),
    ("optimizer o() {\n  if not ndim(p) {\n    p = p - g\n  }\n}\n",
     "'not' needs a bool", 2, 10),
    ("optimizer o() {\n  if -(ndim(p) > 1) {\n    p = p - g\n  }\n}\n",
     "'-' needs a number", 2, 8),
    ("optimizer o() {\n  if ndim(p) > 1 and ndim(p) {\n    p = p - g\n  }\n}\n",
     "'and' needs a bool on each side", 2, 22),
    ("optimizer o() {\n  if (ndim(p) > 1) + 1 > 0 {\n    p = p - g\n  }\n}\n",
     "'+' needs a number on each side", 2, 7),
    ("optimizer o(f = true) {\n  repeat f {\n    p = p - g\n  }\n}\n",
     "a repeat count is a whole number or a float hyperparameter; 'f' is a bool", 2, 10),
    ("optimizer o() {\n  p = p - g.foo()\n}\n",
     "'g.foo()': Vega has no methods: a function takes the value, f(x)", 2, 11),
    ("optimizer o() {\n  p = p - g.min()\n}\n",
     "'g.min()': Vega has no methods; the smallest value of x is -max(-x)", 2, 11),
    ("optimizer o() {\n  p = p - row_sum(g) @ g\n}\n",
     "but its left side is one value per row; use '*' to scale", 2, 11),
]



@pytest.mark.parametrize("source,fragment,line,column", ERROR_TABLE,
                         ids=[f"{i}:{e[1][:30]}" for i, e in enumerate(ERROR_TABLE)])
def test_error_table(source, fragment, line, column):
    with pytest.raises(SpecError) as info:
        vega.compile(source, "mistake.vega")
    err = info.value
    assert fragment in err.message, str(err)
    assert (err.line, err.column) == (line, column), str(err)
    text = str(err)
    assert text.startswith(f"mistake.vega:{line}:{column}: error: ")
    # the source line is quoted and the caret sits under the reported column
    src_line, caret = text.splitlines()[1:3]
    assert src_line.strip() == source.splitlines()[line - 1].strip()
    assert caret.index("^") - 4 == column - 1
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("label", list(PARSE_ERROR_EXAMPLES))
def test_parse_examples_are_labelled(label):
    """Each example of the parse-error table is itself explained by its own label."""
    for example in PARSE_ERROR_EXAMPLES[label]:
        with pytest.raises(SpecError) as info:
            vega.compile(example)
        assert label in info.value.message, (example, info.value.message)


@pytest.mark.parametrize("label", list(PARSE_ERROR_EXAMPLES))
def test_parse_examples_explain_a_later_statement(label):
    """A body's statement after the first, or one inside an if, fails as the example does at
    the start of the body (the same state of the parser, deeper in its stack): the label
    explains it too."""
    for example in PARSE_ERROR_EXAMPLES[label]:
        if not example.startswith("optimizer o() { "):
            continue
        body = example[len("optimizer o() { "):]
        for source in ("optimizer o() { m = p\n" + body,
                       "optimizer o(f = true) { if f { m = p\n" + body + " }"):
            with pytest.raises(SpecError) as info:
                vega.compile(source)
            assert label in info.value.message, (source, info.value.message)


def test_a_state_may_keep_what_it_started_from():
    """A state never assigned keeps its initial value: a mistake where that is a constant,
    but where it is taken from p or a float hyperparameter, what they were at the start
    (Prodigy's p0), where no close name is assigned and never read."""
    spec = vega.compile("optimizer o(lr = 0.5, k = 2.0) {\n  state p0 = p\n"
                        "  state k0: scalar = k\n  p = p - lr * g + 0 * (p0 - p) * k0\n}\n")
    p = torch.arange(3.0, dtype=torch.float64)
    state = spec.init(p)
    p1, state = spec.step(p, torch.ones(3, dtype=torch.float64), state)
    assert torch.equal(state["p0"], p) and state["k0"].item() == 2.0
    assert torch.equal(p1, p - 0.5)


def test_compile_file_names_the_file(tmp_path):
    path = tmp_path / "bad.vega"
    path.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * gg\n}\n")
    with pytest.raises(SpecError, match=r"bad\.vega:2:16: error: undefined name 'gg' \(did you "
                                        r"mean 'g'\?\)"):
        vega.compile_file(path)
    with pytest.raises(FileNotFoundError, match="missing.vega"):
        vega.compile_file(tmp_path / "missing.vega")


def test_a_file_given_for_the_text_and_the_text_for_a_file_say_which_function(tmp_path,
                                                                              monkeypatch):
    # vega.compile("mine.vega") read the name as a spec ("unexpected 'mine'"), and
    # vega.compile_file(text) looked for a file of that name: each says the other reads it
    path = tmp_path / "mine.vega"
    path.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecError, match=r"'mine\.vega' is a file's name, not a spec's text: "
                                        r"vega\.compile takes the text, and "
                                        r"vega\.compile_file\('mine\.vega'\) reads the file"):
        vega.compile("mine.vega")
    with pytest.raises(TypeError, match=r"is a path; vega\.compile takes a spec's text, and "
                                        r"vega\.compile_file\(path\) reads a spec file"):
        vega.compile(path)
    with pytest.raises(FileNotFoundError, match=r"is it a spec's text\? vega\.compile\(text\) "
                                                "compiles one"):
        vega.compile_file(path.read_text())
    with pytest.raises(SpecError, match="unexpected 'mine'"):  # (a word, not a file's name)
        vega.compile("mine")
    assert vega.compile_file("mine.vega").name == "o"


def test_a_one_line_spec_that_ends_in_dot_vega_keeps_its_own_mistake():
    """A spec's text on one line without its '{' that happens to end in '.vega' (a value
    named so) is a spec, not a file's name: its own mistake is said (it was "'optimizer
    o(lr = 1) p = p - g.vega' is a file's name, not a spec's text")."""
    with pytest.raises(SpecError, match="unexpected 'p'") as info:
        vega.compile("optimizer o(lr = 1) p = p - lr * g.vega")
    assert "file's name" not in str(info.value)
    with pytest.raises(SpecError) as info:
        vega.compile("optimizer\to.vega")
    assert "file's name" not in str(info.value)


def test_a_spec_file_name_the_file_system_cannot_take_is_named(tmp_path):
    """compile_file of a name no file can have (a NUL in it, a lone surrogate) said
    Python's bare 'embedded null byte' (a ValueError of os.stat), naming no file; it is
    a file that cannot be read, as a missing one is."""
    for name in ("mine\0.vega", str(tmp_path / "a\ud800.vega")):
        with pytest.raises(FileNotFoundError, match=r"\.vega: error: cannot read spec file: "):
            vega.compile_file(name)


def test_compile_rejects_non_text():
    with pytest.raises(TypeError, match="a spec is text"):
        vega.compile(b"optimizer o() { p = p }")


GOOD = vega.adam.source_text


def _mutations(text, rng, n):
    alphabet = list("(){}[],=+-*/^<>#;:.0123456789 \n") + ["state", "if", "else", "optimizer",
                                                          "where(", "sqrt(", "true", "and", "p",
                                                          "g", "t", "mu", "lr"]
    for _ in range(n):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                del chars[i]
            elif op < 0.8:
                chars.insert(i, rng.choice(alphabet))
            else:
                chars[i] = rng.choice(alphabet)
        yield "".join(chars)


def test_no_input_escapes_as_a_traceback():
    """Random edits of a real spec either compile or raise SpecError with a location."""
    rng = random.Random(1234)
    compiled = 0
    for text in _mutations(GOOD, rng, 400):
        try:
            spec = vega.compile(text, "fuzz.vega")
        except SpecError as err:
            assert str(err).startswith("fuzz.vega")
            assert "internal compiler error" not in err.message, (text, str(err))
        else:
            compiled += 1
            for flags in spec._spec.flag_settings():
                spec._spec.program(flags)
    assert compiled < 400  # the mutations do break specs


@pytest.mark.parametrize("expr", ["(" * 3000 + "p" + ")" * 3000, "-(" * 1000 + "g" + ")" * 1000,
                                  "^".join(["g"] * 1000), " + ".join(["g"] * 2000)],
                         ids=["brackets", "negations", "powers", "a long sum"])
def test_deep_nesting_is_a_spec_error(expr):
    """Nesting past what the compiler's recursion takes is a SpecError saying so (a chain of
    powers failed inside the parser's transformer: an internal compiler error), at the line
    that most likely holds it (it had no line: a 2,000-term sum, which nests as deep)."""
    text = "optimizer o(lr = 0.1) {\n    x = g * 2 # (a comment: ((((\n    p = p - lr * " + \
        expr + "\n}"
    with pytest.raises(SpecError, match=r"^<spec>:3:5: error: the spec nests too deeply to "
                                        r"compile: .* split it into values\n\s*p = p - lr"):
        vega.compile(text)


@pytest.mark.parametrize("sep", ["\r", "\r\n", "\f\n", "\n    # a \v\x1c\x85\u2028 b\n"],
                         ids=["cr", "crlf", "form feed", "breaks in a comment"])
@pytest.mark.parametrize("body, message, quoted", [
    ("p = p - lr * qq", "undefined name 'qq'", "p = p - lr * qq"),
    ("p = p - lr * g ** 2", "Vega writes powers as 'a ^ b', not 'a ** b'", "p = p - lr * g ** 2"),
])
def test_an_error_quotes_its_line_whatever_the_line_ends(sep, body, message, quoted):
    """Line ends other than \\n (a lone \\r, as an old Mac wrote them) and characters that
    str.splitlines breaks at but the grammar reads as spaces or within a comment (form feed,
    \\x85, \\u2028, ...) leave an error's line, column and quoted line right (the quote was
    another line, or the hint for ** failed as an internal compiler error)."""
    text = "optimizer o(lr = 0.1) {" + sep + "    " + body + sep + "}"
    with pytest.raises(SpecError) as info:
        vega.compile(text, "o.vega")
    head, line, caret = str(info.value).split("\n")
    assert head.startswith(f"o.vega:{3 if '#' in sep else 2}:") and head.endswith(message)
    column = int(head.split(":")[2])
    assert line.strip() == quoted and caret.index("^") - 4 == column - 1



_UNSHOWN = [("\t", " "), ("\f", " "), ("\v", "?"), ("\x1b", "?"), ("\x00", "?"),
             ("\x7f", "?"), ("\x85", "?"), ("\u202e", "?"), ("\u2028", "?"), ("\ud800", "?"),
             ("中", "中")]
_UNSHOWN_IDS = ["tab", "form feed", "vertical tab", "escape", "nul", "del", "nel",
                "rtl override", "line separator", "lone surrogate", "wide"]


def _no_control(text: str) -> bool:
    return not any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")
                   for c in text.replace("\n", ""))


@pytest.mark.parametrize("char, shown", _UNSHOWN, ids=_UNSHOWN_IDS)
def test_a_quoted_line_shows_no_control_character_and_its_caret_stays_under_the_fault(
        char, shown):
    """A character in the line an error quotes that a terminal would act on (ESC beginning
    a sequence that recolours or clears the screen, a vertical tab or form feed moving the
    cursor down, NUL, a bidirectional override reordering the line) is shown as '?' (a tab
    or form feed, which the grammar reads as a space, as a space), and the caret stays
    under the fault, the character itself or one after it (it was printed as it was: the
    terminal acted on it, and the caret stood under another column); a wide character
    takes two columns, and its caret two carets."""
    wide = 2 if char == "中" else 1
    source = f"ab{char}cd{char}ef\n"
    for column, end, under, before in [(4, 6, "cd", 2 + wide), (3, 4, shown, 2)]:
        text = str(SpecError("m", Span(1, column, 1, end), source, "o.vega"))
        head, line, caret = text.split("\n")
        assert _no_control(text) and line == f"    ab{shown}cd{shown}ef", repr(text)
        assert caret == " " * (4 + before) + "^" * (len(under) if under != shown else wide)
        assert line[line.index(under, 4 + len("ab"))] == under[0]
    # as a spec's error says it: the character, named by its escape in the message, or a
    # fault after it in the line
    if shown != " " and char != "\ud800":  # (a blank is read as a space: no fault)
        with pytest.raises(SpecError) as info:
            vega.compile(f"optimizer o(lr = 0.1) {{\n  p = p - lr{char} * g\n}}\n", "o.vega")
        head, line, caret = str(info.value).split("\n")
        assert _no_control(str(info.value)) and repr(char)[1:-1] in head, str(info.value)
        assert line == f"      p = p - lr{shown} * g" and caret == " " * 16 + "^" * wide
    with pytest.raises(SpecError) as info:
        vega.compile(f"optimizer o(lr = 0.1) {{\n  p = p - lr * qq  # {char}\n}}\n", "o.vega")
    head, line, caret = str(info.value).split("\n")
    assert _no_control(str(info.value)) and line == f"      p = p - lr * qq  # {shown}"
    assert caret == " " * 19 + "^^"


@pytest.mark.parametrize("text, column, why", [
    ("optimizer o(lr = 0.1) { p = p - lr * g * 1e400 }", 42, "past float64's range"),
    ("optimizer o(lr = 0.1) { p = p - lr * g * 2.5E+309 }", 42, "past float64's range"),
    ("optimizer o(lr = 1e-400) { p = p - lr * g }", 18, "below float64's smallest"),
    ("optimizer o(lr = 0.1 in [0, 1e999)) { p = p - lr * g }", 29, "past float64's range"),
])
def test_a_number_float64_cannot_hold_is_named(text, column, why):
    """A literal past float64's range read as inf, one below its smallest as 0, with no
    word; each is now an error at its place, saying what to write (inf, 0). The smallest
    subnormal and zero written with an exponent stay numbers."""
    with pytest.raises(SpecError, match=rf"^<spec>:1:{column}: error: the number \S+ is "
                                        rf"{why}") as info:
        vega.compile(text)
    assert info.value.span.end_column - info.value.span.column == len(
        text[column - 1:].split()[0].rstrip(")"))
    ok = vega.compile("optimizer o(lr = 0.1) { p = p - lr * g * 4.9e-324 + 0.0e-999 * g }")
    assert ok.name == "o"


def test_a_repeat_count_of_the_largest_allowed_compiles():
    """64, the largest repeat count, and a hyperparameter whose range ends at 64 (from 0,
    the least) are repeat counts; 65 is not."""
    vega.compile("optimizer o() {\n  repeat 64 {\n    p = p + 1\n  }\n}\n").program()
    vega.compile("optimizer o() {\n  repeat 0 {\n    p = p + 1\n  }\n  p = p\n}\n").program()
    vega.compile("optimizer o(n = 2.0 in [0, 64]) {\n  repeat n {\n    p = p + 1\n  }\n}\n")
    with pytest.raises(SpecError, match="a repeat count is a whole number from 0 to 64, not 65"):
        vega.compile("optimizer o() {\n  repeat 65 {\n    p = p + 1\n  }\n}\n")


def test_nested_repeats_that_write_out_too_much_are_refused_where_they_start():
    """Repeats nested in repeats multiply: four of 64 around one statement, a spec of some
    100 bytes, would write out 16.7M statements (the checker ran for minutes and gigabytes;
    three took 15 s). A spec's repeats write out at most 4096 statements in all, the first
    repeat past that refused at its line and column before anything is written out; 64
    times 64 one-statement bodies is the most."""
    def spec(*repeats):
        return "optimizer o() {\n" + "".join(repeats) + "  p = p\n}\n"

    vega.compile(spec("  repeat 64 { repeat 64 { p = p + 1 } }\n"))
    vega.compile(spec("  repeat 64 { repeat 32 { p = p + 1 } }\n",
                      "  repeat 32 { repeat 64 { p = p * 1 } }\n"))
    with pytest.raises(SpecError) as e:
        vega.compile(spec("  repeat 64 { repeat 64 { repeat 64 { repeat 64 { p = p + 1 } } } }"
                          "\n"))
    assert (e.value.line, e.value.column) == (2, 3)
    assert "at most 4096 statements in all; with this one, 16777216" in str(e.value)
    with pytest.raises(SpecError) as e:  # one after another add up
        vega.compile(spec("  repeat 64 { repeat 64 { p = p + 1 } }\n",
                          "  if true { repeat 1 { p = p } }\n"))
    assert (e.value.line, e.value.column) == (3, 13)
    with pytest.raises(SpecError) as e:  # a repeat on a hyperparameter writes an if each time
        vega.compile("optimizer o(n = 2.0 in [0, 64]) {\n  repeat 64 {\n    repeat n { p = p + 1 "
                     "}\n  }\n}\n")
    assert (e.value.line, e.value.column) == (2, 3)
    assert "with this one, 8192 " in str(e.value)


def test_a_spec_may_have_eight_bool_hyperparameters_and_not_nine():
    def spec(n):
        flags = ", ".join(f"f{k} = false" for k in range(n))
        return f"optimizer o({flags}) {{\n  p = p\n}}\n"
    vega.compile(spec(8))
    with pytest.raises(SpecError, match="at most 8 bool hyperparameters, this one has 9"):
        vega.compile(spec(9))


@pytest.mark.parametrize("body,said", [
    ("state m: True = zeros\n  p = p - lr * g", "not ': True'"),
    ("repeat True {\n    p = p - lr * g\n  }", "'True' is neither"),
])
def test_a_python_word_where_no_value_goes_is_not_answered_with_a_value(body, said):
    """True is Python's true where a value goes (an undefined name), but no shape, dtype or
    repeat count: 'not ': True': Vega writes true' said true would do there."""
    with pytest.raises(SpecError) as info:
        vega.compile(f"optimizer o(lr = 1e-3) {{\n  {body}\n}}\n")
    assert said in info.value.message and "Vega writes true" not in info.value.message, \
        info.value.message
