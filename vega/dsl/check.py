"""Checks and lowering: syntax tree -> typed IR, or a SpecError in the user's terms.

One walker does both jobs. In *check* mode (no flags) it walks every branch of
every compile-time ``if`` and reports the first mistake it finds; in *lower*
mode (the bool hyperparameters fixed) it follows the taken branches and
returns the program. A spec that passes the check lowers for every choice of
flags, so lowering never raises.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from dataclasses import dataclass

from vega.dsl import ast
from vega.dsl import ir
from vega.dsl.ir import Kind, Node, Op
from vega.dsl.parse_errors import MOD, STATEMENT_KEYWORDS
from vega.errors import Span, SpecError

# name -> (allowed argument counts, op by argument count)
FUNCTIONS: dict[str, dict[int, Op]] = {
    "sqrt": {1: Op.SQRT},
    "rsqrt": {1: Op.RSQRT},
    "exp": {1: Op.EXP},
    "log": {1: Op.LOG},
    "abs": {1: Op.ABS},
    "sign": {1: Op.SIGN},
    "atan2": {2: Op.ATAN2},
    "tanh": {1: Op.TANH},
    "sin": {1: Op.SIN},
    "cos": {1: Op.COS},
    "erf": {1: Op.ERF},
    "log1p": {1: Op.LOG1P},
    "expm1": {1: Op.EXPM1},
    "sigmoid": {1: Op.SIGMOID},
    "floor": {1: Op.FLOOR},
    "round": {1: Op.ROUND},
    "min": {2: Op.MIN},
    "max": {1: Op.AMAX, 2: Op.MAX},
    "clamp": {3: Op.MAX},  # lowered to min(max(x, lo), hi)
    "where": {3: Op.WHERE},
    "norm": {1: Op.NORM},
    "sum": {1: Op.SUM},
    "mean": {1: Op.MEAN},
    "row_sum": {1: Op.ROW_SUM},
    "row_mean": {1: Op.ROW_MEAN},
    "row_max": {1: Op.ROW_MAX},
    "col_sum": {1: Op.COL_SUM},
    "col_mean": {1: Op.COL_MEAN},
    "col_max": {1: Op.COL_MAX},
    "transpose": {1: Op.TRANSPOSE},
    "bfloat16": {1: Op.BF16},
    "widen": {1: Op.WIDEN},
    "size": {2: Op.SIZE},
}
# reductions over every tensor of a group: name -> the per-tensor reduction each tensor's
# part is (summed, or the maximum taken, over the group)
GLOBAL_FUNCTIONS = {"global_sum": Op.SUM, "global_norm": Op.NORM, "global_max": Op.AMAX}
# functions of other libraries that Vega writes another way: how (in place of a guess at
# a close name, which for 'mod' would be 'sigmoid')
WRITTEN_OTHERWISE = {
    "mod": MOD, "fmod": MOD, "remainder": MOD,
    "pow": "a power is a ^ b", "square": "a square is x * x",
    "maximum": "the larger of two values is max(a, b)",
    "minimum": "the smaller of two values is min(a, b)",
    "clip": "clamp(x, lo, hi) clips", "ceil": "the integer above x is -floor(-x)",
    "row_min": "the smallest value of each row is -row_max(-x)",
    "col_min": "the smallest value of each column is -col_max(-x)",
    "global_min": "the smallest value over the group is -global_max(-x)",
    "numel": "the mean of x is mean(x), and sum(where(p == p, 1, 1)) counts p's values",
    "len": "the length of axis k is size(p, k)",
    "isnan": "x != x holds where x is NaN", "isinf": "abs(x) == inf holds where x is infinite",
    "isfinite": "abs(x) < inf holds where x is finite",
}


# the words of expressions, which the parser reads as names where a word cannot stand
# (``not = g`` assigned a value 'not', and ``p - not x`` failed at the next statement)
WORDS = ("and", "or", "not", "true", "false")


def _axes(fn: str) -> str:
    """How a reduction goes over a tensor and along its matrix view's axes."""
    from vega.dsl.parser import _SIGNATURES
    return _SIGNATURES[fn]


def _own_name(name: str) -> str:
    """What to do where a name is a function's or a keyword's."""
    return f"give it a name of its own ('{name}_' or a longer one)"


# shape queries, known per tensor: allowed only in the condition of an if
SHAPE_QUERIES = {"ndim": "its number of axes", "nrows": "the length of its row axis",
                 "ncols": "the length of its column axis"}
DTYPES = ast.STATE_DTYPE_WORDS  # the dtypes a state declaration may name
STATE_SHAPES = {None: "rc", "rows": "r", "cols": "c", "scalar": ir.SCALAR_STATE}
BUILTINS = {"p": "the parameter", "g": "the gradient", "t": "the update's index (1, 2, ...)"}
INIT_NAMES = {"zeros": 0.0, "ones": 1.0}
# the builtins a mode's block cannot read, and why
MODE_UNREADABLE = {"g": "without a gradient", "t": "without an update's index"}
# the keyword arguments of init, step and the optimizer classes beside the hyperparameters,
# and the names a param group already holds: a hyperparameter of one of these names would
# be taken for the other
API_NAMES = ("params", "grads", "state", "self", "backend", "donate", "max_grad_norm",
             "loss_scale", "skip_nonfinite", "state_dtype", "master_weights",
             "stochastic_rounding", "rounding_seed", "reduce_group", "maximize", "foreach",
             "fused", "capturable", "differentiable", "mode")
STEP_COUNTER = "step"  # a state dict's step counter
BINARY = {"+": Op.ADD, "-": Op.SUB, "*": Op.MUL, "/": Op.DIV, "^": Op.POW, "<": Op.LT,
          "<=": Op.LE, ">": Op.GT, ">=": Op.GE, "==": Op.EQ, "!=": Op.NE, "and": Op.AND,
          "or": Op.OR, "@": Op.MATMUL}
MAX_FLAGS = 8  # 2**8 specializations is the most a spec may have


@dataclass(frozen=True)
class _Binding:
    node: Node
    role: str  # "builtin" | "hyper" | "state" | "value"
    span: Span | None
    only_if: Span | None = None  # set when defined in just one branch of an if


def _suggest(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


# Python's spellings of Vega's words
PYTHON_WORDS = {"True": "true", "False": "false"}
# torch.optim's names of what a spec calls p, g and t
TORCH_WORDS = {"grad": "the gradient is g", "param": "the parameter is p",
               "weight": "the parameter is p",
               "step": "the update's index is t (1 at the first step)"}


def _undefined(name: str, env) -> str:
    """An undefined name's message: Vega's spelling of a word of Python's (a value where a
    value goes: true is no shape, dtype or repeat count) or of torch.optim's (``grad``,
    ``step``), else the closest name defined."""
    close = _suggest(name, env)
    how = f": Vega writes {PYTHON_WORDS[name]}" if name in PYTHON_WORDS else \
        f": {TORCH_WORDS[name]}{close.replace(' (did', ' (or did')}" \
        if name in TORCH_WORDS and name not in env else close
    return f"undefined name '{name}'{how}"


def _what(node: Node) -> str:
    return "a bool" if node.dtype == "bool" else "a number"


class _Walker:
    def __init__(self, spec: ast.Spec, flags: dict[str, bool] | None,
                 shapes: tuple[bool, ...] = (), widths: dict | None = None):
        self.spec = spec
        # the kind and domain of each reduction's argument as the check saw it, every
        # setting at once (the wider value of a name after an if), by the reduction's place:
        # written by the check, read by the lowering of each setting (``counted``)
        self.widths = {} if widths is None else widths
        self.where: tuple = ()  # the place of the statement being walked (``block``)
        self.flags = flags
        self.checking = flags is None
        self.shapes = shapes
        self.static_index = {id(s): k for k, s in enumerate(shape_conditions(spec))}
        self.declared: dict[str, Span] = {}  # every state declaration seen (check mode)
        # in declaration order: the program's (lower mode), or every branch's (check mode,
        # where an assignment and a mode's block look up a state's declared shape)
        self.states: list[ir.StateVar] = []
        self.assigns_p = False
        self.in_shape_if: Span | None = None  # the per-tensor if being walked (check mode)
        self.in_mode: str | None = None  # the mode whose block is being walked
        self.in_init = False  # walking a state's initial value (made for each tensor alone)
        self.mode_blocks = [s for s in spec.body if isinstance(s, ast.Mode)]
        # the spans of the ifs that ``unroll`` wrote for a repeat, with its count's name
        self.repeats = {s.span: s.repeat for s in _ifs(spec.body) if s.repeat is not None}

    # -- header -------------------------------------------------------------
    def hypers(self) -> tuple[ir.HyperParam, ...]:
        seen: dict[str, Span] = {}
        out = []
        for h in self.spec.hypers:
            if h.name in seen:
                raise SpecError(f"hyperparameter '{h.name}' is already declared on line "
                                f"{seen[h.name].line}", h.span)
            reserved = self._reserved(h.name) or (
                "a keyword of vega's steps or optimizer classes" if h.name in API_NAMES
                else None)
            if reserved:
                raise SpecError(f"'{h.name}' cannot name a hyperparameter: it is {reserved}; "
                                f"{_own_name(h.name)}", h.span)
            seen[h.name] = h.span
            if h.type == "bool" and not isinstance(h.default, bool):
                raise SpecError(f"bool hyperparameter '{h.name}' needs a default of true or "
                                f"false, not {ast.number_text(h.default)}", h.default_span)
            if h.type == "float" and isinstance(h.default, bool):
                raise SpecError(f"float hyperparameter '{h.name}' needs a numeric default, "
                                f"not {str(h.default).lower()}", h.default_span)
            if h.type == "float" and h.default != h.default:
                raise SpecError(f"the default of '{h.name}' cannot be nan: a hyperparameter "
                                "that is not a number is refused at every step",
                                h.default_span)
            if h.range is not None:
                r = h.range
                if h.type == "bool":
                    raise SpecError(f"bool hyperparameter '{h.name}' cannot have a range", r.span)
                if r.lo != r.lo or r.hi != r.hi:
                    raise SpecError(f"the range {r} of '{h.name}' has a nan bound; an open "
                                    "end is written -inf or inf", r.span)
                if r.lo > r.hi or (r.lo == r.hi and not (r.lo_closed and r.hi_closed)):
                    raise SpecError(f"the range {r} of '{h.name}' is empty", r.span)
                if not r.contains(h.default):
                    raise SpecError(f"the default {ast.number_text(h.default)} of '{h.name}' is "
                                    f"outside its range {r}", h.default_span)
            out.append(ir.HyperParam(h.name, h.type, h.default, h.range, h.span))
        nflags = sum(h.type == "bool" for h in out)
        if nflags > MAX_FLAGS:
            raise SpecError(f"a spec may have at most {MAX_FLAGS} bool hyperparameters, this "
                            f"one has {nflags}", self.spec.name_span)
        return tuple(out)

    @staticmethod
    def _reserved(name: str) -> str | None:
        if name in BUILTINS:
            return BUILTINS[name]
        if name in FUNCTIONS or name in SHAPE_QUERIES or name in GLOBAL_FUNCTIONS:
            return "a function"
        if name in INIT_NAMES:
            return "a state initializer"
        if name in ast.CONSTANTS:
            return "a number (inf, nan and pi are reserved names)"
        if name in WORDS:
            return ("a word of the language (and, or and not combine bools; true and false "
                    "are bools)")
        return None

    # -- body ---------------------------------------------------------------
    def run(self):
        hypers = self.hypers()
        env: dict[str, _Binding] = {
            "p": _Binding(ir.leaf(Op.PARAM, Kind.ELEMENT, "p"), "builtin", None),
            "g": _Binding(ir.leaf(Op.GRAD, Kind.ELEMENT, "g"), "builtin", None),
            "t": _Binding(ir.leaf(Op.T, Kind.SCALAR, "t"), "builtin", None),
        }
        for h in hypers:
            if h.type == "float":
                node = ir.leaf(Op.HYPER, Kind.SCALAR, h.name, h.span)
            elif self.checking:  # unknown until lowering, but known at compile time
                node = Node(Op.HYPER, (), h.name, "bool", Kind.CONST, h.span)
            else:
                node = ir.const(self.flags[h.name], h.span)
            env[h.name] = _Binding(node, "hyper", h.span)
        self.hyper_names = {h.name for h in hypers}
        start = dict(env)
        env = self.block(self.spec.body, env)
        if not self.assigns_p and self.checking:  # (a setting may leave p as it is)
            raise SpecError(f"optimizer '{self.spec.name}' never assigns p, so it would not "
                            "change the parameters", self.spec.name_span)
        modes = self.modes(start, env)
        if self.checking:
            self.check_states_assigned()
            return hypers
        updates = [("p", env["p"].node)] + [(s.name, env[s.name].node) for s in self.states]
        return ir.cse(ir.Program(self.spec.name, hypers, tuple(sorted(self.flags.items())),
                                 tuple(self.states), tuple(updates), tuple(self.shapes),
                                 modes))

    def check_states_assigned(self):
        """Every state is assigned somewhere in the body (in some branch of an if too), or
        keeps what it was given at the start: p, or a float hyperparameter's value then
        (prodigy's ``state p0 = p``). One that starts as a constant and is never assigned
        keeps it at every step, most likely because its update was written to a
        misspelled name (``mm = b2 * m + ...``): that is an error, at the declaration,
        which names a close name assigned but never read; so is a state that keeps what
        it was given where such a name is there."""
        body = self.spec.body
        assigned = _assigned_values(body)
        if all(decl.name in assigned for decl in state_decls(body)):
            return
        floats = {h.name for h in self.spec.hypers if h.type == "float"}
        read = {n.id for e in expressions(body, modes=False) for n in _names(e)}
        unread = {n: line for n, line in assigned.items()
                  if n not in read and n not in self.declared and n != "p"}
        for decl in state_decls(body):
            if decl.name in assigned:
                continue
            close = difflib.get_close_matches(decl.name, sorted(unread), n=1, cutoff=0.6)
            keeps = any(n.id == "p" or n.id in floats for n in _names(decl.init))
            if keeps and not close:
                continue
            hint = (f"; '{decl.name}' is a keyword ({STATEMENT_KEYWORDS[decl.name]}), which "
                    f"no assignment can name: give the state a name of its own "
                    f"('{decl.name}_' or a longer one)" if decl.name in STATEMENT_KEYWORDS else
                    f" (did you mean '{decl.name} = ...' on line {unread[close[0]]}, where "
                    f"'{close[0]}' is assigned and never read?)" if close else
                    f"; assign it ({decl.name} = ...), or write the constant where it is read")
            raise SpecError(f"state '{decl.name}' is never assigned, so it would keep its "
                            f"initial value at every step{hint}", decl.name_span)

    def modes(self, start, env) -> tuple[tuple[str, Node], ...]:
        """Each ``mode NAME { ... }``: p's value in that mode, of p, the states as stored
        (those declared outside every if) and the hyperparameters."""
        out, seen = [], {}
        for m in self.mode_blocks:
            if m.name in seen:
                raise SpecError(f"mode '{m.name}' is already declared on line {seen[m.name]}",
                                m.name_span)
            seen[m.name] = m.name_span.line
            menv = {n: b for n, b in start.items() if b.role == "hyper"}
            menv["p"] = _Binding(ir.leaf(Op.PARAM, Kind.ELEMENT, "p"), "builtin", None)
            for name, b in env.items():
                if b.role == "state":
                    dom = next(v.dom for v in self.states if v.name == name)
                    leaf = ir.leaf(Op.STATE, Kind.TENSOR, name, b.span) \
                        if dom == ir.SCALAR_STATE else \
                        ir.leaf(Op.STATE, Kind.ELEMENT, name, b.span, dom)
                    menv[name] = _Binding(leaf, "state", b.span, b.only_if)
            self.in_mode = m.name
            try:
                menv = self.block(m.body, menv, f"mode {m.name}")
            finally:
                self.in_mode = None
            p = menv["p"].node
            if not _assigns(m.body, "p"):
                raise SpecError(f"mode '{m.name}' never assigns p: a mode says how the "
                                "parameters look in it", m.name_span)
            out.append((m.name, p))
        return tuple(out)

    def block(self, stmts, env, tag: str = ""):
        """Walk ``stmts``, the body (``tag`` ""), a branch of an if ("then", "else") or a
        mode's block ("mode NAME"); a statement's place is the path of (tag, index) down to
        it, the same in the check and in every lowering (the copies of a repeat's body have
        places of their own)."""
        outer = self.where
        try:
            for k, stmt in enumerate(stmts):
                self.where = outer + ((tag, k),)
                env = self.stmt(stmt, env)
        finally:
            self.where = outer
        return env

    def stmt(self, s, env):
        env = dict(env)
        if isinstance(s, ast.Mode):
            if self.in_mode is not None or not any(s is m for m in self.mode_blocks):
                raise SpecError(f"mode '{s.name}' must stand at the top of the spec's body, "
                                "outside every if, repeat and mode", s.span)
            return env  # (walked after the body: ``modes``)
        if isinstance(s, ast.StateDecl) and self.in_mode is not None:
            raise SpecError(f"a mode cannot declare a state: mode '{self.in_mode}' only says "
                            "how the parameters look", s.span)
        if isinstance(s, ast.StateDecl):
            self._check_new_name(s.name, s.name_span, env, "declare a state")
            if s.name == STEP_COUNTER:
                raise SpecError("cannot declare state 'step': it is the step counter every "
                                "state holds", s.name_span)
            if s.name in self.declared:
                raise SpecError(f"state '{s.name}' is already declared on line "
                                f"{self.declared[s.name].line}", s.name_span)
            self.declared[s.name] = s.name_span
            if s.shape not in STATE_SHAPES:
                raise SpecError(f"a state is shaped like p, or declared ': rows' (one value per "
                                f"row), ': cols' (one per column) or ': scalar' (one number per "
                                f"tensor), and may name the dtype it is kept in (': bfloat16', "
                                f"': rows float16'), not ': {s.shape}'"
                                f"{_suggest(s.shape, ['rows', 'cols', 'scalar', *DTYPES])}",
                                s.shape_span)
            dom = STATE_SHAPES[s.shape]
            if s.dtype is not None and s.dtype not in DTYPES:
                raise SpecError(f"a state is kept in {', '.join(DTYPES[:-1])} or {DTYPES[-1]} "
                                f"(8-bit blockwise), not '{s.dtype}'"
                                f"{_suggest(s.dtype, list(DTYPES))}", s.dtype_span)
            if s.dtype == "uint8" and dom != "rc":
                raise SpecError(f"state '{s.name}' holds "
                                f"{ir.DOMAIN_WORDS[dom]}: only a "
                                "state shaped like p is kept in 8 bits (uint8)", s.dtype_span)
            init = self.init_expr(s.init, env)
            if init.dtype != "float":
                raise SpecError(f"state '{s.name}' must start as a number, not a bool",
                                s.init.span)
            if dom == ir.SCALAR_STATE and init.kind == Kind.ELEMENT:
                raise SpecError(f"state '{s.name}' holds one number per tensor, but this initial "
                                f"value has {_short(init.dom)}; reduce it with sum(...), "
                                "norm(...), mean(...) or max(...)", s.init.span)
            if dom == ir.SCALAR_STATE:
                self.states.append(ir.StateVar(s.name, init, s.span, dom))
                env[s.name] = _Binding(ir.leaf(Op.STATE, Kind.TENSOR, s.name, s.name_span),
                                       "state", s.name_span)
                return env
            if init.kind == Kind.ELEMENT and ir.join(init.dom, dom) != dom:
                raise SpecError(f"state '{s.name}' holds {ir.DOMAIN_WORDS[dom]}, but this "
                                f"initial value has {_short(init.dom)}"
                                f"{_reduce_hint(init.dom, dom)}", s.init.span)
            self.states.append(ir.StateVar(s.name, init, s.span, dom))
            env[s.name] = _Binding(ir.leaf(Op.STATE, Kind.ELEMENT, s.name, s.name_span, dom),
                                   "state", s.name_span)
        elif isinstance(s, ast.Assign):
            if s.name not in env:
                # (m = b1 * m + g, as torch.optim's code keeps a buffer: read before it has a
                # value, the name is one a step keeps, which a state declares)
                for read in _names(s.value):
                    if read.id == s.name:
                        self._later(read)  # (declared or assigned below: where)
                        if self.in_mode is not None:
                            raise SpecError(f"'{s.name}' is read before it has a value: mode "
                                            f"'{self.in_mode}' keeps no value from one call "
                                            "to the next and assigns no state; it reads p, "
                                            "the states and the hyperparameters", read.span)
                        raise SpecError(f"'{s.name}' is read before it has a value; a value "
                                        "kept from one step to the next is a state, declared "
                                        f"before it is read: state {s.name} = zeros", read.span)
            value = self.expr(s.value, env)
            old = env.get(s.name)
            if old is None:
                self._check_new_name(s.name, s.name_span, env, "assign")
            elif old.role == "builtin" and s.name != "p":
                raise SpecError(f"cannot assign to '{s.name}': it is {BUILTINS[s.name]}; give "
                                "the new value a name of its own", s.name_span)
            elif old.role == "hyper":
                raise SpecError(f"cannot assign to '{s.name}': it is a hyperparameter, fixed "
                                "for the whole step; give the new value a name of its own",
                                s.name_span)
            elif old.role == "state" and self.in_mode is not None:
                raise SpecError(f"mode '{self.in_mode}' cannot assign state '{s.name}': a mode "
                                "only says how the parameters look (p = ...)", s.name_span)
            elif old.role == "state" and old.only_if is not None:
                raise SpecError(f"state '{s.name}' is declared only inside "
                                f"{self._block(old.only_if)}, so only the tensors and "
                                "settings that take that branch have it; assign it inside "
                                "that if, or declare it before the if", s.name_span)
            if value.kind == Kind.ELEMENT and value.dom in ir.MATRIX_DOMAINS and (
                    s.name == "p" or (old is not None and old.role == "state")):
                if s.name == "p":
                    what = "the parameter p has one value per element"
                else:  # as declared: a state of rows (': rows') holds one per row
                    dom = next(v.dom for v in self.states if v.name == s.name)
                    what = f"state '{s.name}' holds {ir.DOMAIN_WORDS[dom]}"
                raise SpecError(f"{what}, but this value is {ir.DOMAIN_WORDS[value.dom]}; "
                                "no state or parameter keeps a matrix of a product between "
                                "steps: multiply it back to one value per element (A @ x) "
                                "or reduce it (norm(A))", s.value.span)
            if (s.name == "p" or (old is not None and old.role == "state")) \
                    and value.dtype != "float":
                what = "the parameter p" if s.name == "p" else f"state '{s.name}'"
                raise SpecError(f"{what} must be a number, but this value is a bool; keep "
                                "a flag as a number, where(cond, 1, 0), and test it with "
                                "flag > 0", s.value.span)
            if old is not None and old.role == "state" and value.kind == Kind.ELEMENT:
                # against the declared shape, not the value the state holds by now (a
                # state like p may hold a per-row value, and take a per-element one again)
                dom = next(v.dom for v in self.states if v.name == s.name)
                if dom == ir.SCALAR_STATE:
                    raise SpecError(f"state '{s.name}' holds one number per tensor, but this "
                                    f"value has {_short(value.dom)}; reduce it with sum(...), "
                                    "norm(...), mean(...), max(...) or global_sum(...)",
                                    s.value.span)
                if ir.join(value.dom, dom) != dom:
                    raise SpecError(f"state '{s.name}' holds {ir.DOMAIN_WORDS[dom]}, but this "
                                    f"value has {_short(value.dom)}"
                                    f"{_reduce_hint(value.dom, dom)}", s.value.span)
            if s.name == "p":
                self.assigns_p = True
            role = old.role if old is not None and old.role in ("builtin", "state") else "value"
            span = old.span if role == "state" else s.name_span
            env[s.name] = _Binding(ir.named(value, s.name), role, span)
        else:
            env = self.if_stmt(s, env)
        return env

    def _check_new_name(self, name, span, env, doing):
        reserved = self._reserved(name)
        if reserved:
            raise SpecError(f"cannot {doing} '{name}': it is {reserved}; {_own_name(name)}",
                            span)
        old = env.get(name)
        if old is not None:
            if old.role == "hyper":
                raise SpecError(f"cannot {doing} '{name}': it is a hyperparameter", span)
            if old.role == "value":
                raise SpecError(f"cannot declare state '{name}': the name is already a value "
                                f"assigned on line {old.span.line}", span)

    def if_stmt(self, s: ast.If, env):
        if id(s) in self.static_index:
            return self.shape_if(s, env)
        cond = self.expr(s.cond, env)
        if cond.dtype != "bool":
            raise SpecError("the condition of an if must be a bool, but this is a number",
                            s.cond.span)
        if cond.kind != Kind.CONST:
            raise SpecError("an if needs a condition known when the spec compiles (bool "
                            "hyperparameters, true, false) or at the step from float "
                            "hyperparameters and ndim(p), nrows(p), ncols(p); to choose "
                            "between values use where(cond, a, b)", s.cond.span)
        if not self.checking:
            return self.block(s.then if cond.arg else s.orelse, env,
                              "then" if cond.arg else "else")
        return self.both_branches(s, env)

    def shape_if(self, s: ast.If, env):
        """An if on the shape of the tensor (ndim, nrows, ncols): chosen per tensor."""
        if not self.checking:
            taken = self.shapes[self.static_index[id(s)]]
            return self.block(s.then if taken else s.orelse, env, "then" if taken else "else")
        if _static_type(s.cond, env) != "bool":
            raise SpecError("the condition of an if must be a bool, but this is a number",
                            s.cond.span)
        outer, self.in_shape_if = self.in_shape_if, self.in_shape_if or s.span
        try:
            return self.both_branches(s, env)
        finally:
            self.in_shape_if = outer

    def both_branches(self, s: ast.If, env):
        then = self.block(s.then, env, "then")
        orelse = self.block(s.orelse, env, "else")
        merged = {}
        for name in then.keys() | orelse.keys():
            a, b = then.get(name), orelse.get(name)
            if a is not None and b is not None:
                # (an if that ``unroll`` wrote: its branches are after a repeat's body and
                # before it)
                where = ("in one branch of this if and {} in the other" if s.repeat is None
                         else "after the body of this repeat and {} before it (a tensor may "
                         f"run it no times, by the value of '{s.repeat}')")
                if a.node.dtype != b.node.dtype:
                    raise SpecError(f"'{name}' is {_what(a.node)} "
                                    f"{where.format(_what(b.node))}", s.span)
                mats = {n.dom for n in (a.node, b.node) if n.kind == Kind.ELEMENT}
                if len(mats) > 1 and mats & set(ir.MATRIX_DOMAINS):
                    raise SpecError(f"'{name}' is {_matrix_words(a.node)} "
                                    f"{where.format(_matrix_words(b.node))}: a matrix of a "
                                    "product has one shape after an if or a repeat", s.span)
                only = a.only_if or b.only_if
                node = _wider(a.node, b.node)
                merged[name] = _Binding(node, a.role, a.span, only)
            else:
                one = a or b
                merged[name] = _Binding(one.node, one.role, one.span, s.span)
        return merged

    # -- expressions --------------------------------------------------------
    def init_expr(self, e, env):
        """A state's initial value: p, constants and hyperparameters only."""
        init_env = {n: b for n, b in env.items() if b.role == "hyper"}
        # the parameter as the optimizer receives it, also where the body has assigned p
        init_env["p"] = _Binding(ir.leaf(Op.PARAM, Kind.ELEMENT, "p"), "builtin", None)
        for n, v in INIT_NAMES.items():
            init_env[n] = _Binding(ir.const(v), "builtin", None)
        for node in _names(e):
            if node.id not in init_env and node.id in env:
                raise SpecError(f"a state's initial value may use only p, hyperparameters and "
                                f"constants; '{node.id}' has no value before the first step",
                                node.span)
        self.in_init = True
        try:
            return self.expr(e, init_env)
        finally:
            self.in_init = False

    def _later(self, e: ast.Name) -> None:
        """SpecError where ``e``, read where it has no value, is declared or assigned further
        down the body; in a mode's block, which reads no values wherever it stands, where it
        is a value the step assigns."""
        if self.in_mode is not None:
            line = _assigned_values(self.spec.body).get(e.id)
            if line is not None:  # (a value of the step, which a mode does not see)
                raise SpecError(f"mode '{self.in_mode}' cannot read '{e.id}', a value of the "
                                f"step (assigned on line {line}): a mode runs outside a step; "
                                "it reads p, the states and the hyperparameters", e.span)
            return
        later = _defined_later(self.spec.body, e.id, e.span)
        if later is not None:  # (a spec runs top to bottom)
            raise SpecError(f"undefined name '{e.id}' here: it is {later}; a spec runs "
                            "top to bottom, once a step: give it its value, or declare its "
                            "state, above this line", e.span)

    def expr(self, e, env) -> Node:
        if isinstance(e, ast.Num):
            return ir.const(e.value, e.span)
        if isinstance(e, ast.Bool):
            return ir.const(e.value, e.span)
        if isinstance(e, ast.Name):
            b = env.get(e.id)
            if b is None:
                if e.id in INIT_NAMES:
                    raise SpecError(f"'{e.id}' may only start a state: state x = {e.id}",
                                    e.span)
                if e.id in FUNCTIONS or e.id in GLOBAL_FUNCTIONS:
                    raise SpecError(f"'{e.id}' is a function; call it as {e.id}(...)", e.span)
                if self.in_mode is not None and e.id in MODE_UNREADABLE:
                    raise SpecError(f"mode '{self.in_mode}' cannot read '{e.id}': a mode runs "
                                    f"outside a step, {MODE_UNREADABLE[e.id]}; it reads p, the "
                                    "states and the hyperparameters", e.span)
                if e.id.lower() in ast.CONSTANTS:  # Inf, NaN, PI
                    raise SpecError(f"undefined name '{e.id}' (did you mean "
                                    f"'{e.id.lower()}'?)", e.span)
                self._later(e)
                raise SpecError(_undefined(e.id, env), e.span)
            if b.only_if is not None and b.only_if in self.repeats:
                raise SpecError(f"'{e.id}' is assigned only inside {self._block(b.only_if)}, "
                                "whose body a tensor may run no times (by the value of "
                                f"'{self.repeats[b.only_if]}'); assign it before the repeat",
                                e.span)
            if b.only_if is not None and b.role == "state":
                # (a state is declared, not assigned, in its branch: there is nothing to
                # assign before the if or in the other branch)
                raise SpecError(f"state '{e.id}' is declared only inside "
                                f"{self._block(b.only_if)}, so only the tensors and settings "
                                "that take that branch have it; read it inside that if, or "
                                "declare it before the if", e.span)
            if b.only_if is not None:
                raise SpecError(f"'{e.id}' is assigned only in one branch of the if on line "
                                f"{b.only_if.line}; assign it before the if or in both "
                                "branches", e.span)
            return b.node
        if isinstance(e, ast.Unary):
            x = self.expr(e.x, env)
            if e.op == "-":
                self._need("float", x, e.x, "'-'")
                return ir.apply(Op.NEG, x, span=e.span)
            self._need("bool", x, e.x, "'not'")
            return ir.apply(Op.NOT, x, span=e.span)
        if isinstance(e, ast.Binary):
            a, b = self.expr(e.a, env), self.expr(e.b, env)
            op = BINARY[e.op]
            need = "bool" if op in ir.LOGIC else "float"
            self._need(need, a, e.a, f"'{e.op}'")
            self._need(need, b, e.b, f"'{e.op}'")
            if op is Op.MATMUL:
                _matmul_check(a, b, e)
            else:
                _same_matrices(f"'{e.op}'", [a, b], e.op_span)
            return ir.apply(op, a, b, span=e.span)
        return self.call(e, env)

    def call(self, e: ast.Call, env) -> Node:
        if e.fn in SHAPE_QUERIES:
            raise SpecError(f"{e.fn}(p), {SHAPE_QUERIES[e.fn]}, differs from tensor to tensor: "
                            "use it only in the condition of an if", e.span)
        if e.fn in GLOBAL_FUNCTIONS:
            return self.global_call(e, env)
        arities = FUNCTIONS.get(e.fn)
        if arities is None:
            known = sorted([*FUNCTIONS, *GLOBAL_FUNCTIONS])
            close = difflib.get_close_matches(e.fn, known, n=3, cutoff=0.6)
            hint = (f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else
                    f"; the functions are {', '.join(known)}")
            if e.fn in WRITTEN_OTHERWISE:
                hint = f"; {WRITTEN_OTHERWISE[e.fn]}"
            if e.fn in env:
                hint = f"; '{e.fn}' is a value, not a function"
            raise SpecError(f"unknown function '{e.fn}'{hint}", e.fn_span)
        if len(e.args) not in arities:
            counts = " or ".join(str(n) for n in sorted(arities))
            plural = "" if counts == "1" else "s"
            hint = ("; the smallest value of a tensor is -max(-x)"
                    if e.fn == "min" and len(e.args) == 1 else
                    f"; of more than two values, {e.fn}(a, {e.fn}(b, c))"
                    if e.fn in ("min", "max") and len(e.args) > 2 else
                    f"; {_axes(e.fn)}"
                    if e.fn in ("sum", "mean", "norm") and len(e.args) > 1 else "")
            raise SpecError(f"{e.fn}() takes {counts} argument{plural}, got {len(e.args)}"
                            f"{hint}", e.span)
        if e.fn == "size":
            return _size(e)
        args = [self.expr(a, env) for a in e.args]
        op = arities[len(args)]
        if op is Op.TRANSPOSE:
            self._need("float", args[0], e.args[0], "transpose()")
            x = args[0]
            if x.kind != Kind.ELEMENT or x.dom not in ("rc", *ir.MATRIX_DOMAINS):
                raise SpecError(f"transpose() takes a matrix: a value of one per element (the "
                                f"matrix view) or a product of such, but this is "
                                f"{_matrix_words(x)}", e.args[0].span)
            return ir.apply(op, x, span=e.span)
        if op in ir.AXIS_REDUCTIONS and args[0].kind == Kind.ELEMENT \
                and args[0].dom in ir.MATRIX_DOMAINS:
            raise SpecError(f"{e.fn}() reduces an axis of the matrix view, but its argument is "
                            f"{ir.DOMAIN_WORDS[args[0].dom]}", e.args[0].span)
        if op not in ir.REDUCTIONS:
            _same_matrices(f"{e.fn}()", args, e.fn_span)
        if op in ir.AXIS_REDUCTIONS:
            x = args[0]
            self._need("float", x, e.args[0], f"{e.fn}()")
            axis = ir.AXIS_REDUCTIONS[op][0]
            if not self.checking and (x.kind != Kind.ELEMENT or axis not in x.dom):
                x = _spread(x, e.span)
            if x.kind != Kind.ELEMENT:
                raise SpecError(f"{e.fn}() reduces an axis of a tensor, but its argument is the "
                                "same for every element", e.args[0].span)
            if axis not in x.dom:
                gone = "column" if axis == "c" else "row"
                raise SpecError(f"{e.fn}() reduces the {gone} axis, but its argument has "
                                f"{_short(x.dom)}: it has no {gone} axis left",
                                e.args[0].span)
            return ir.apply(op, x, span=e.span)
        if op is Op.WHERE:
            self._need("bool", args[0], e.args[0], "the condition of where()")
            if args[1].dtype != args[2].dtype:
                raise SpecError(f"where() needs two values of one type, got {_what(args[1])} "
                                f"and {_what(args[2])}", e.span)
            return ir.apply(op, *args, span=e.span)
        for a, node in zip(e.args, args):
            self._need("float", node, a, f"{e.fn}()")
        if op in ir.REDUCTIONS:
            args[0] = self.counted(args[0], e.span)
        if op in ir.REDUCTIONS and args[0].kind != Kind.ELEMENT:
            raise SpecError(f"{e.fn}() reduces a tensor, but its argument is the same for "
                            "every element", e.args[0].span)
        if e.fn == "clamp":
            lo = ir.apply(Op.MAX, args[0], args[1], span=e.span)
            return ir.apply(Op.MIN, lo, args[2], span=e.span)
        return ir.apply(op, *args, span=e.span)

    def global_call(self, e: ast.Call, env) -> Node:
        """``global_sum(x)``, ``global_norm(x)``, ``global_max(x)``: over every tensor of the
        group, the same value in each."""
        if len(e.args) != 1:
            raise SpecError(f"{e.fn}() takes 1 argument, got {len(e.args)}", e.span)
        if self.in_shape_if is not None:
            how = (f"runs as many times as the value of its hyperparameter "
                   f"'{self.repeats[self.in_shape_if]}' says"
                   if self.in_shape_if in self.repeats else
                   "takes or not by its shape or the values of its hyperparameters")
            raise SpecError(f"{e.fn}() reduces over every tensor of a group, so it cannot stand "
                            f"inside {self._block(self.in_shape_if)}, which each tensor {how}",
                            e.span)
        if self.in_mode is not None:
            raise SpecError(f"{e.fn}() cannot stand in mode '{self.in_mode}': a mode's values "
                            "are each tensor's own", e.span)
        if self.in_init:
            raise SpecError(f"{e.fn}() cannot start a state: a state's initial value is made "
                            "for each tensor on its own; start it as a number and set it at "
                            f"the first step (n = where(t == 1, {e.fn}(...), n))", e.span)
        x = self.expr(e.args[0], env)
        self._need("float", x, e.args[0], f"{e.fn}()")
        x = self.counted(x, e.span)
        if x.kind < Kind.TENSOR:
            raise SpecError(f"{e.fn}() reduces over the tensors of a group, but its argument "
                            "is the same for every tensor (it would count the tensors)",
                            e.args[0].span)
        return ir.global_reduction(GLOBAL_FUNCTIONS[e.fn], x, e.span)

    def counted(self, x: Node, span: Span) -> Node:
        """The argument ``x`` of the reduction at ``span`` as wide as the check saw it: a
        setting that takes the branch of an if assigning a number, one per row or one per
        tensor where the other assigns one per element (or one per row, or per tensor)
        reduces it as that wider value, each number counted once for each element (row,
        tensor) it stands for, as in the setting that takes the other branch."""
        key = (self.where, span)
        if self.checking:
            self.widths[key] = (x.kind, x.dom)
            return x
        kind, dom = self.widths.get(key, (x.kind, x.dom))
        if kind == Kind.ELEMENT and dom in ir.DOMAINS and dom != "rc" and \
                (x.kind < kind or ir.join(x.dom, dom) != x.dom):
            # one per row, column or matrix: a condition of that domain, by p's sums
            p = ir.leaf(Op.PARAM, Kind.ELEMENT, "p")
            if "c" not in dom:
                p = ir.apply(Op.ROW_SUM, p, span=span)
            if "r" not in dom:
                p = ir.apply(Op.COL_SUM, p, span=span)
            return ir.apply(Op.WHERE, ir.apply(Op.EQ, p, p, span=span), x, x, span=span)
        if kind == Kind.ELEMENT and (x.kind < kind or ir.join(x.dom, dom) != x.dom):
            return _spread(x, span)
        if kind == Kind.TENSOR and x.kind < kind:  # one per tensor: a condition of p's sum
            s = ir.apply(Op.SUM, ir.leaf(Op.PARAM, Kind.ELEMENT, "p"), span=span)
            return ir.apply(Op.WHERE, ir.apply(Op.EQ, s, s, span=span), x, x, span=span)
        if x.kind < Kind.TENSOR:  # (a number, where the check saw none here)
            return _spread(x, span)
        return x

    def _block(self, span: Span) -> str:
        """The if (or the repeat, where ``unroll`` wrote the if) that starts at ``span``."""
        return f"the {'repeat' if span in self.repeats else 'if'} on line {span.line}"

    @staticmethod
    def _need(dtype, node, e, where):
        if node.dtype != dtype:
            if dtype == "float":
                raise SpecError(f"{where} needs a number, but this is a bool; use "
                                "where(cond, 1, 0) to turn a bool into a number", e.span)
            raise SpecError(f"{where} needs a bool, but this is a number; compare it, "
                            "e.g. x > 0", e.span)


_MATRIX_WORDS = {"rc": "rows x columns", "rr": "rows x rows", "cc": "columns x columns",
                 "cr": "columns x rows"}


def _matrix_words(x: Node) -> str:
    if x.kind != Kind.ELEMENT:
        return "the same for every element (a number)"
    if x.dom == "rc":
        return "one value per element (the rows x columns matrix view)"
    if x.dom in _MATRIX_WORDS:
        return f"a {_MATRIX_WORDS[x.dom]} matrix"
    return ir.DOMAIN_WORDS[x.dom]


def _matmul_check(a: Node, b: Node, e) -> None:
    """``a @ b``: two matrices of the matrix view (rows x columns, their transposes and
    products), the left's columns the right's rows; SpecError otherwise."""
    for side, x in (("left", a), ("right", b)):
        if x.kind != Kind.ELEMENT or x.dom not in _MATRIX_WORDS:
            raise SpecError(f"'@' multiplies matrices (values of one per element, their "
                            f"transposes and products), but its {side} side is "
                            f"{_matrix_words(x)}; use '*' to scale",
                            (e.a if side == "left" else e.b).span)
    if a.dom[1] != b.dom[0]:
        raise SpecError(f"'@' of a {_MATRIX_WORDS[a.dom]} matrix and a {_MATRIX_WORDS[b.dom]} "
                        "one: the left's columns must be the right's rows; transpose one "
                        "of them", e.op_span)


def _same_matrices(what: str, nodes, span) -> None:
    """A matrix of a product (rows x rows, ...) combines only with matrices of its own
    shape and with values the same for every element; SpecError otherwise, at ``span``:
    the operator or the function that combines them (as a mismatched '@' is marked)."""
    mats = [n for n in nodes if n.kind == Kind.ELEMENT]
    doms = {n.dom for n in mats}
    if len(doms) > 1 and doms & set(ir.MATRIX_DOMAINS):
        first = next(n for n in mats if n.dom in ir.MATRIX_DOMAINS)
        other = next(n for n in mats if n.dom != first.dom)
        raise SpecError(f"{what} combines {_matrix_words(first)} with {_matrix_words(other)}"
                        ": a matrix of a product meets only matrices of its shape and "
                        "numbers", span)


def _size(e: ast.Call) -> Node:
    """``size(p, k)``: the length of the tensor's axis k (1 where it has fewer axes)."""
    what, k = e.args
    if not (isinstance(what, ast.Name) and what.id in ("p", "g")):
        raise SpecError("size() takes the parameter and an axis: size(p, 0)", what.span)
    if not (isinstance(k, ast.Num) and 0 <= k.value < 64 and k.value == int(k.value)):
        raise SpecError("size()'s axis is a whole number from 0 to 63: size(p, 0)", k.span)
    return Node(Op.SIZE, (), int(k.value), "float", Kind.TENSOR, e.span)


def _wider(a: Node, b: Node) -> Node:
    """Of the values of a name after the two branches of an if, the one a later statement
    must accept in every setting: the higher kind (per element over a number), and of
    two per-element values the larger domain (a per-element one over a per-column one;
    per row and per column together are per element)."""
    if a.kind != b.kind:
        return a if a.kind > b.kind else b
    if a.kind != Kind.ELEMENT:
        return a
    dom = ir.join(a.dom, b.dom)
    return a if a.dom == dom else b if b.dom == dom else _spread(a, a.span)


def _spread(x: Node, span) -> Node:
    """``x`` as one value per element (``where(p == p, x, x)``), for a reduction whose
    argument the check saw per element and this setting made smaller: a bool
    hyperparameter that folded ``where(f, g, 0)`` to 0, or an if that took the branch
    assigning a number or a per-row value."""
    p = ir.leaf(Op.PARAM, Kind.ELEMENT, "p")
    return ir.apply(Op.WHERE, ir.apply(Op.EQ, p, p, span=span), x, x, span=span)


def _short(dom: str) -> str:
    return ir.DOMAIN_WORDS[dom].replace("one value per", "one per")


def _reduce_hint(have: str, want: str) -> str:
    fns = [f for a, f in (("c", "row_mean"), ("r", "col_mean")) if a in have and a not in want]
    return f"; reduce it with {' and '.join(f + '(...)' for f in fns)}" if fns else ""


def reads_shape(e) -> bool:
    """Whether an expression asks for the tensor's shape (ndim(p) ...)."""
    return any(isinstance(c, ast.Call) and c.fn in SHAPE_QUERIES for c in _calls(e))


def _is_shape_cond(e, floats: set[str]) -> bool:
    """Whether an if's condition is decided at each step from the tensor's shape or the
    values of float hyperparameters (``if momentum > 0``): it asks for either."""
    return reads_shape(e) or any(n.id in floats for n in _names(e))


def _calls(e):
    if isinstance(e, ast.Call):
        yield e
        for a in e.args:
            yield from _calls(a)
    elif isinstance(e, ast.Unary):
        yield from _calls(e.x)
    elif isinstance(e, ast.Binary):
        yield from _calls(e.a)
        yield from _calls(e.b)


def shape_conditions(spec: ast.Spec) -> list[ast.If]:
    """The ifs whose condition asks for the tensor's shape or a float hyperparameter's
    value, in source order."""
    out = []
    floats = {h.name for h in spec.hypers if h.type == "float"}

    def visit(stmts):
        for s in stmts:
            if isinstance(s, ast.If):
                if _is_shape_cond(s.cond, floats):
                    out.append(s)
                visit(s.then)
                visit(s.orelse)
            elif isinstance(s, ast.Mode):  # (a mode's ifs choose by the tensor alike)
                visit(s.body)
    visit(spec.body)
    return out


_SHAPE_COND_USE = ("a condition on the shape or on float hyperparameters may use only "
                   "ndim(p), nrows(p), ncols(p), hyperparameters and numbers")


def _static_type(e, env) -> str:
    """The type of a shape condition's expression, or a SpecError."""
    if isinstance(e, ast.Num):
        return "float"
    if isinstance(e, ast.Bool):
        return "bool"
    if isinstance(e, ast.Name):
        b = env.get(e.id)
        if b is None:
            raise SpecError(_undefined(e.id, env), e.span)
        if b.role != "hyper":
            raise SpecError(f"{_SHAPE_COND_USE}; '{e.id}' is not a hyperparameter", e.span)
        return b.node.dtype
    if isinstance(e, ast.Call):
        if e.fn not in SHAPE_QUERIES:
            raise SpecError(f"{_SHAPE_COND_USE}, not {e.fn}()", e.fn_span)
        if len(e.args) != 1 or not (isinstance(e.args[0], ast.Name)
                                    and e.args[0].id in ("p", "g")):
            raise SpecError(f"{e.fn}() takes the parameter: {e.fn}(p)", e.span)
        return "float"
    if isinstance(e, ast.Unary):
        x = _static_type(e.x, env)
        want = "float" if e.op == "-" else "bool"
        if x != want:
            raise SpecError(f"'{e.op}' needs {'a number' if want == 'float' else 'a bool'}",
                            e.x.span)
        return want
    op = BINARY[e.op]
    want = "bool" if op in ir.LOGIC else "float"
    for side in (e.a, e.b):
        if _static_type(side, env) != want:
            raise SpecError(f"'{e.op}' needs {'a number' if want == 'float' else 'a bool'} "
                            "on each side", side.span)
    return "bool" if op in ir.COMPARISONS or op in ir.LOGIC else "float"


def static_value(e, values: dict, shape: tuple[int, ...]):
    """A shape condition's value for a tensor of ``shape``; ``values`` holds every
    hyperparameter as a Python bool or float."""
    if isinstance(e, (ast.Num, ast.Bool)):
        return e.value
    if isinstance(e, ast.Name):
        return values[e.id]
    if isinstance(e, ast.Call):
        r, c = matrix_axes(shape)
        if e.fn == "ndim":
            return float(len(shape))
        axis = r if e.fn == "nrows" else c
        return 1.0 if axis is None else float(shape[axis])
    if isinstance(e, ast.Unary):
        x = static_value(e.x, values, shape)
        return -x if e.op == "-" else not x
    op = BINARY[e.op]
    a = static_value(e.a, values, shape)
    if op is Op.AND and not a:
        return False
    if op is Op.OR and a:
        return True
    return ir._FOLD[op](a, static_value(e.b, values, shape))


def open_value(e, values: dict):
    """A condition on hyperparameter values alone where a name missing from ``values``
    may take any value: True or False where the known names decide it, else None."""
    if isinstance(e, (ast.Num, ast.Bool)):
        return e.value
    if isinstance(e, ast.Name):
        return values.get(e.id)
    if isinstance(e, ast.Unary):
        x = open_value(e.x, values)
        return None if x is None else (-x if e.op == "-" else not x)
    op = BINARY[e.op]
    a, b = open_value(e.a, values), open_value(e.b, values)
    if op is Op.AND and ((a is not None and not a) or (b is not None and not b)):
        return False
    if op is Op.OR and ((a is not None and a) or (b is not None and b)):
        return True
    if a is None or b is None:
        return None
    return ir._FOLD[op](a, b)


def matrix_axes(shape) -> tuple[int | None, int | None]:
    """The (row, column) axes of a shape's matrix view: its two largest axes, the column
    axis the largest (ties: the later axis), as optax's Adafactor factors a tensor. A
    vector has no row axis (it is one row), a scalar neither."""
    order = sorted(range(len(shape)), key=lambda a: (shape[a], a))
    if len(order) >= 2:
        return order[-2], order[-1]
    return None, (order[-1] if order else None)


def _defined_later(stmts, name: str, read: Span) -> str | None:
    """How ``name``, read at ``read`` where it has no value, is given one further down the
    body (``declared as a state on line 5, below``, ``assigned after it on line 4``: on the
    line read, after ``;``), if it is."""
    for s in stmts:
        if isinstance(s, ast.If):
            found = _defined_later(s.then + s.orelse, name, read)
            if found is not None:
                return found
        elif isinstance(s, (ast.StateDecl, ast.Assign)) and s.name == name \
                and (s.name_span.line, s.name_span.column) > (read.line, read.column):
            how = "declared as a state" if isinstance(s, ast.StateDecl) else "assigned"
            if s.name_span.line == read.line:
                return f"{how} after it on line {read.line}"
            return f"{how} on line {s.name_span.line}, below"
    return None


def _assigns(stmts, name: str) -> bool:
    """Whether ``stmts`` assign ``name``, in some branch of an if too."""
    return any(isinstance(s, ast.Assign) and s.name == name
               or isinstance(s, ast.If) and _assigns(s.then + s.orelse, name) for s in stmts)


def _assigned_values(stmts, out=None) -> dict[str, int]:
    """Each name ``stmts`` assign (in the branches of ifs too), with the line of its first
    assignment."""
    out = {} if out is None else out
    for s in stmts:
        if isinstance(s, ast.Assign):
            out.setdefault(s.name, s.name_span.line)
        elif isinstance(s, ast.If):
            _assigned_values(s.then + s.orelse, out)
    return out


def expressions(stmts, modes: bool = True):
    """Every expression ``stmts`` evaluate: values, initial values, conditions, in ifs, and
    in modes' blocks where ``modes`` (a mode's block has names of its own)."""
    for s in stmts:
        if isinstance(s, (ast.Assign, ast.StateDecl)):
            yield s.value if isinstance(s, ast.Assign) else s.init
        elif isinstance(s, ast.If):
            yield s.cond
            yield from expressions(s.then + s.orelse, modes)
        elif isinstance(s, ast.Mode) and modes:
            yield from expressions(s.body, modes)


def _names(e):
    if isinstance(e, ast.Name):
        yield e
    elif isinstance(e, ast.Unary):
        yield from _names(e.x)
    elif isinstance(e, ast.Binary):
        yield from _names(e.a)
        yield from _names(e.b)
    elif isinstance(e, ast.Call):
        for a in e.args:
            yield from _names(a)


MAX_REPEAT = 64  # the most times a repeat's body is unrolled
# the most statements the repeats of a spec write out in all (a repeat nested in a repeat
# multiplies: four of 64 nested would write out 16.7M copies of the body from 100 bytes)
MAX_UNROLLED = 4096


def unroll(spec: ast.Spec) -> ast.Spec:
    """``spec`` with every ``repeat N { body }`` written out: N copies of the body for a
    number N; for a float hyperparameter N (``repeat ns_steps``), nested ifs on its value
    (``if ns_steps >= 1 { body; if ns_steps >= 2 { ... } }``) up to its range's bound,
    each tensor's program chosen by the value like any condition on values."""
    hypers = {h.name: h for h in spec.hypers}

    def count_of(r: ast.Repeat):
        c = r.count
        if isinstance(c, ast.Num):
            if c.value != int(c.value) or not 0 <= c.value <= MAX_REPEAT:
                raise SpecError(f"a repeat count is a whole number from 0 to {MAX_REPEAT}, not "
                                f"{ast.number_text(c.value)}", c.span)
            return int(c.value)
        h = hypers.get(c.id)
        if h is None:
            raise SpecError(f"a repeat count is a whole number or a float hyperparameter; "
                            f"'{c.id}' is neither{_suggest(c.id, hypers)}", c.span)
        if h.type != "float":
            raise SpecError(f"a repeat count is a whole number or a float hyperparameter; "
                            f"'{c.id}' is a bool", c.span)
        if h.range is None or not h.range.hi <= MAX_REPEAT:
            raise SpecError(f"repeat {c.id} unrolls up to the bound of {c.id}'s range, which "
                            f"must be at most {MAX_REPEAT}: declare it as {c.id} = "
                            f"{ast.number_text(h.default)} in [0, 10]", c.span)
        return None

    def written(stmts) -> int:
        """How many statements ``stmts`` are once their repeats are written out (an if and
        a mode count one each, with their blocks; a repeat on a hyperparameter writes an if
        a time round)."""
        total = 0
        for st in stmts:
            if isinstance(st, ast.Repeat):
                n = count_of(st)
                total += written(st.body) * n if n is not None else \
                    (written(st.body) + 1) * int(math.floor(hypers[st.count.id].range.hi))
            elif isinstance(st, ast.If):
                total += 1 + written(st.then) + written(st.orelse)
            elif isinstance(st, ast.Mode):
                total += 1 + written(st.body)
            else:
                total += 1
        return total

    def bounded(stmts, total: int = 0) -> int:
        """Refuse the repeat (outside every other) where the statements that the repeats
        write out pass ``MAX_UNROLLED``, before any is written out."""
        for st in stmts:
            if isinstance(st, ast.Repeat):
                total += written((st,))
                if total > MAX_UNROLLED:
                    raise SpecError(f"a spec's repeats write out at most {MAX_UNROLLED} "
                                    f"statements in all; with this one, {total} (a repeat "
                                    "nested in another multiplies its count)", st.span)
            elif isinstance(st, ast.If):
                total = bounded(st.orelse, bounded(st.then, total))
            elif isinstance(st, ast.Mode):
                total = bounded(st.body, total)
        return total

    def walk(stmts) -> tuple:
        out = []
        for st in stmts:
            if isinstance(st, ast.Repeat):
                body = walk(st.body)
                mode = next((m for m in body if isinstance(m, ast.Mode)), None)
                if mode is not None:  # (one inside an if is refused as any such mode)
                    raise SpecError(f"mode '{mode.name}' must stand at the top of the spec's "
                                    "body, outside every if, repeat and mode", mode.span)
                decl = next(state_decls(body), None)
                if decl is not None:
                    raise SpecError(f"state '{decl.name}' is declared inside a repeat, which "
                                    "would declare it again each time round; declare it before "
                                    "the repeat", decl.span)
                n = count_of(st)
                if n is not None:
                    out.extend(body * n)
                    continue
                c = st.count
                inner: tuple = ()
                for k in range(int(math.floor(hypers[c.id].range.hi)), 0, -1):
                    cond = ast.Binary(">=", c, ast.Num(float(k), c.span), c.span, c.span)
                    inner = (ast.If(cond, body + inner, (), st.span, c.id),)
                out.extend(inner)
            elif isinstance(st, ast.If):
                out.append(dataclasses.replace(st, then=walk(st.then), orelse=walk(st.orelse)))
            elif isinstance(st, ast.Mode):
                out.append(dataclasses.replace(st, body=walk(st.body)))
            else:
                out.append(st)
        return tuple(out)
    bounded(spec.body)
    return dataclasses.replace(spec, body=walk(spec.body))


def _ifs(stmts):
    """The ifs of ``stmts``, nested ones and those in modes' blocks too."""
    for st in stmts:
        if isinstance(st, ast.If):
            yield st
            yield from _ifs(st.then + st.orelse)
        elif isinstance(st, ast.Mode):
            yield from _ifs(st.body)


def state_decls(stmts):
    """The state declarations of ``stmts``, in nested ifs too."""
    for st in stmts:
        if isinstance(st, ast.StateDecl):
            yield st
        elif isinstance(st, ast.If):
            yield from state_decls(st.then + st.orelse)


def check(spec: ast.Spec, widths: dict | None = None) -> tuple[ir.HyperParam, ...]:
    """Raise a SpecError (without source attached) for the first mistake in ``spec``;
    ``widths`` (a dict) receives the width of each reduction's argument, for ``lower``."""
    return _Walker(spec, None, widths=widths).run()


def lower(spec: ast.Spec, flags: dict[str, bool], shapes: tuple[bool, ...] = (),
          widths: dict | None = None) -> ir.Program:
    """The program for one setting of the bool hyperparameters and of the shape conditions
    (``shapes``, one outcome per ``shape_conditions(spec)``); ``spec`` must be checked, and
    ``widths`` is what its check wrote (a reduction of a value that this setting makes
    narrower counts it as wide as every setting's value)."""
    if widths is None:
        widths = {}
        check(spec, widths)
    return _Walker(spec, flags, shapes, widths).run()


def all_flag_settings(hypers) -> list[dict[str, bool]]:
    names = [h.name for h in hypers if h.type == "bool"]
    return [dict(zip(names, vals)) for vals in itertools.product((False, True), repeat=len(names))]
