"""The records the backends and the runtime pass between them, each defined once.

Two layouts are shared by Python and generated code; both are written here as
ordered tables, and every language takes its names from them:

- the prelude's record ``pre``: a float64 tensor of ``len(PRE_SLOTS)`` values,
  filled before a fused step (``make_pre``) and read by its kernels. Python
  indexes it with ``Pre`` (``pre[Pre.NONFINITE]``); generated C has
  ``#define PRE_NONFINITE 1`` (``c_defines``), generated Triton
  ``PRE_NONFINITE = tl.constexpr(1)`` (``named``);
- the C backend's address table: one int64 row per tensor, its columns
  ``TABLE_COLUMNS`` in order, some repeated per state (``table_columns`` gives
  their positions for a program; generated C reads ``row[COL_P]``,
  ``row[COL_STATE + k]``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cache

import torch

# the prelude's record, in order: (slot, meaning)
PRE_SLOTS = (
    ("sum_sq", "sum of squares of the gradients, each times the inverse loss scale"),
    ("nonfinite", "non-zero where a gradient is NaN or inf (counts, read as a flag)"),
    ("inv_scale", "inverse loss scale the gradients are multiplied by (1: none)"),
    ("max_norm", "global norm the gradients are clipped to (0: no clipping)"),
    ("check", "1: a step with a non-finite gradient leaves everything as it was"),
)

Pre = enum.IntEnum("Pre", [(name.upper(), k) for k, (name, _) in enumerate(PRE_SLOTS)])
Pre.__doc__ = "The slots of the prelude's record, by name (``PRE_SLOTS``)."
Pre.__module__ = __name__

# the C address table's row, in order: (column, how many, meaning); "state" repeats once per
# state variable, "geometry" holds the integers of a program over a matrix view
TABLE_COLUMNS = (
    ("numel", "one", "number of elements"),
    ("p", "one", "address of the parameter"),
    ("g", "one", "address of the gradient"),
    ("state", "state", "address of each state, in the program's order"),
    ("step", "one", "address of the int32 step counter"),
    ("hyper", "one", "address of the float64 hyperparameter values"),
    ("geo", "geometry", "axis_geometry and line lengths (a program over a matrix view)"),
    ("p_out", "one", "address the new parameter is written to"),
    ("state_out", "state", "address each new state is written to"),
)


@dataclass(frozen=True)
class Columns:
    """Where each column of ``TABLE_COLUMNS`` starts in a table row, and the row's width."""

    nstate: int
    ngeo: int
    numel: int
    p: int
    g: int
    state: int  # state k at state + k
    step: int
    hyper: int
    geo: int  # geometry integer j at geo + j
    p_out: int
    state_out: int  # the new state k at state_out + k
    width: int

    def arrange(self, **blocks) -> list:
        """A table's columns in row order, from each name of ``TABLE_COLUMNS`` to its list
        of columns (one, one per state, or one per geometry integer)."""
        out: list = []
        for name, _, _ in TABLE_COLUMNS:
            assert len(out) == getattr(self, name), (name, len(out))
            out += list(blocks.pop(name))
        assert not blocks and len(out) == self.width, (sorted(blocks), len(out))
        return out

    def c_defines(self) -> list[str]:
        """``#define COL_<NAME> <index>`` per column, then ``ROW`` (the width)."""
        size = {"one": 1, "state": self.nstate, "geometry": self.ngeo}
        return [f"#define COL_{name.upper()} {getattr(self, name)}  /* {what}"
                f"{'' if count == 'one' else f' (k-th at COL_{name.upper()} + k)'} */"
                for name, count, what in TABLE_COLUMNS if size[count]] + \
            [f"#define ROW {self.width}  /* int64 values per table row */"]


@cache
def table_columns(nstate: int, ngeo: int = 0) -> Columns:
    """The columns of a row for a program of ``nstate`` states (``ngeo`` geometry integers)."""
    count = {"one": 1, "state": nstate, "geometry": ngeo}
    at, start = 0, {}
    for name, how_many, _ in TABLE_COLUMNS:
        start[name] = at
        at += count[how_many]
    return Columns(nstate, ngeo, **start, width=at)


def named(prefix: str, slots) -> list[tuple[str, int, str]]:
    """(``PREFIX_NAME``, index, meaning) of each slot of an ordered table of (name, meaning)."""
    return [(f"{prefix}_{name.upper()}", k, what) for k, (name, what) in enumerate(slots)]


def c_defines() -> list[str]:
    """The prelude record's slots as C: ``#define PRE_NONFINITE 1  /* ... */``."""
    return [f"#define {name} {k}  /* {what} */" for name, k, what in named("PRE", PRE_SLOTS)]


# (device, max_norm, check) -> a record without a loss scale, never written; at most
# _BLANK_KEPT (a search over max_grad_norm makes a record for each value it tries)
_BLANK: dict = {}
_BLANK_KEPT = 16


def make_pre(device, inv_scale=None, max_norm=None, check=False) -> torch.Tensor:
    """A fresh prelude record on ``device``: nothing summed or counted yet, the inverse loss
    scale (a 0-d tensor, or None for 1), ``max_norm`` (None: no clipping) and ``check``.
    Without a loss scale, one copy of a record made once (one launch on a GPU, not four)."""
    device = torch.device(device)
    key = (device, max_norm, check)
    # (asked only outside torch.compile: dynamo cannot trace the capture query, and a traced
    # step makes its record afresh anyway)
    if (inv_scale is None and not torch.compiler.is_compiling()
            and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        blank = _BLANK.get(key)  # (one lookup: another thread may clear it in between)
        if blank is None:
            if len(_BLANK) >= _BLANK_KEPT:
                _BLANK.clear()
            blank = _BLANK[key] = _new_pre(device, None, max_norm, check)
        return blank.clone()
    return _new_pre(device, inv_scale, max_norm, check)


def _new_pre(device, inv_scale, max_norm, check) -> torch.Tensor:
    pre = torch.zeros(len(PRE_SLOTS), dtype=torch.float64, device=device)
    if inv_scale is not None:
        # (the record's device named: a context's default device would take the tensor)
        pre[Pre.INV_SCALE:Pre.INV_SCALE + 1].copy_(torch.as_tensor(
            inv_scale, dtype=torch.float64, device=device).detach().reshape(1))
    else:
        pre[Pre.INV_SCALE] = 1.0
    pre[Pre.MAX_NORM] = float(max_norm) if max_norm is not None else 0.0
    pre[Pre.CHECK] = 1.0 if check else 0.0
    return pre


def finite_of(pre: torch.Tensor | None) -> torch.Tensor | None:
    """The step's all-finite flag from the prelude's record (True when not checked); None
    without a record."""
    if pre is None:
        return None
    return (pre[Pre.NONFINITE] == 0) | (pre[Pre.CHECK] == 0)
