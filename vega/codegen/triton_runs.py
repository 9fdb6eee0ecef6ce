"""The element runs of a program with matrix products as Triton kernels
(``vega.codegen.runs``).

On the Triton backend each run of element lines around a program's matrix products (which
run on cuBLAS through torch) is one kernel launch over every element, all its values in
registers: one pass over the GPU's memory for the run, where torch's operations make one
launch and one pass for each line. A kernel computes what torch's CUDA operations compute,
bit for bit:

- division is ``tl.div_rn`` in float32 (Triton's ``/`` is an approximate division there),
  and a division by a number stays on torch's operations (CUDA's torch multiplies by the
  number's reciprocal);
- the kernels are compiled without contracting a product and a sum into one fused
  multiply-add (``enable_fp_fusion=False``), as torch computes them one operation at a time;
- a value is negated by multiplying it by -1 (Triton's ``-x`` is ``0 - x``: +0.0 for 0.0);
- float32 is rounded to bfloat16 to nearest even by bit arithmetic (``to_bf16``: Triton's
  interpreter truncates in its cast).

On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, as the
rest of the backend), and compute what torch's CPU operations compute. Elsewhere (CPU
tensors without the interpreter) the runs stay on torch's operations.
"""
from __future__ import annotations

import hashlib
import math

import torch

from vega.codegen import precision, runs, triton_runtime
from vega.codegen.triton import negative_zero

_TL = {torch.float32: "tl.float32", torch.float64: "tl.float64"}  # (the compute dtypes)

HEADER = '''"""vega: an element run of a program with matrix products (vega.codegen.triton_runs)"""
import triton
import triton.language as tl


''' + precision.TRITON_TO_BF16 + '''


@triton.jit
def widen(x):
    """bfloat16 -> float32, exactly (the interpreter's cast mistakes subnormals)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
'''


# the Triton of each form of a loop's steps (``vega.codegen.runs.expression``)
_FORMS = {
    "arith": "{0} {op} {1}", "compare": "{0} {op} {1}",
    # (float32's ``/`` is approximate, div.full.f32: tl.div_rn; float64's is div.rn.f64)
    "divide": lambda step, t: (f"tl.div_rn({t[0]}, {t[1]})" if step.dtype == torch.float32
                               else f"{t[0]} / {t[1]}"),
    # (two wheres, as vega.codegen.triton._minmax)
    "min": "{nan}tl.where({0} {cmp} {1}, {0}, {1}){close}",
    "max": "{nan}tl.where({0} {cmp} {1}, {0}, {1}){close}",
    "nan": "tl.where({0} != {0}, {0}, ",
    "and": "{0} & {1}", "or": "{0} | {1}", "not": "~{0}",
    "neg": "{0} * -1.0",  # (Triton's -x is 0 - x: +0.0 for 0.0)
    "abs": "tl.abs({0})", "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, {0})).to({ct})",
    "where": "tl.where({0}, {1}, {2})", "round": "to_bf16({0})",
    "widen": "widen({0}).to({ct})",  # (exact: the interpreter's cast mistakes subnormals)
    "same": "{0}",
}


def _expr(step: runs.Step, loop: runs.Loop) -> str:
    """The Triton expression of one step of ``loop``."""
    ct = _TL[loop.compute]

    def number(v) -> str:
        if isinstance(v, bool):
            return repr(v)
        if negative_zero(v):  # (tl.full of -0.0 is +0.0)
            return f"(tl.full((), 0.0, {ct}) * -1.0)"
        lit = repr(v) if v == v and abs(v) != math.inf else f'float("{v!r}")'
        return f"tl.full((), {lit}, {ct})"
    return runs.expression(step, _FORMS, number, ct=ct, close=")" if step.nan else "")


def source(loop: runs.Loop) -> str:
    """The Triton source of ``loop``: a module defining the kernel ``vega_run``, whose
    arguments are the full inputs, the values (0-d tensors), the
    outputs, the count ``n`` and ``BLOCK``; program ``k`` computes the elements
    ``[k BLOCK, (k + 1) BLOCK)``."""
    full, values, made = loop.full, loop.values, loop.made
    names = [f"A{k}" for k in range(len(full))] + [f"V{k}" for k in range(len(values))] + \
        [f"O{k}" for k in range(len(made))]
    body = [f"    {n} = tl.load(A{k} + i, mask=mask)" for k, (n, _) in enumerate(full)]
    body += [f"    {n} = tl.load(V{k})" for k, (n, _) in enumerate(values)]
    body += [f"    {s.var} = {_expr(s, loop)}" for s in loop.steps]
    body += [f"    tl.store(O{k} + i, {n}, mask=mask)" for k, (n, _) in enumerate(made)]
    args = [n for n, _ in (*full, *values)]
    return "\n".join([
        HEADER, "",
        "@triton.jit",
        f"def vega_run({', '.join(names)}, n, BLOCK: tl.constexpr):",
        f'    """{loop.run.name}: {", ".join(n for n, _ in made)} from {", ".join(args)}"""',
        "    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
        "    mask = i < n",
        *body,
        ""])


class TritonRuns(runs.Runs):
    """The runs of one linear program's functions as Triton kernels on the GPU (on the CPU
    under Triton's interpreter)."""

    NOTE = ("\n# The Triton backend computes each run of element lines given to _tiled in one "
            "Triton\n# kernel where its operations and its tensors' dtypes allow "
            "(vega.codegen.triton_runs).\n")
    DIVIDES_BY_NUMBERS = False

    def device_ok(self, device: torch.device) -> bool:
        if device.type == "cuda":
            return not triton_runtime.interpreting()
        return device.type == "cpu" and triton_runtime.interpreting() \
            and triton_runtime.library_interpreted()

    def build(self, loop: runs.Loop):
        text = source(loop)
        name = f"run_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        return triton_runtime.load_module(text, name)["vega_run"]

    def call(self, built, loop: runs.Loop, n: int, full: tuple, values: list,
             outs: list) -> None:
        block = triton_runtime.block_size(
            tuple(str(d).removeprefix("torch.") for _, d in (*loop.full, *loop.made)
                  if d != torch.bool) or ("float32",))
        device = full[0].device
        with triton_runtime.on_device(device):  # (Triton launches on the current device)
            triton_runtime.launch(built, (max(1, -(-n // block)),), *full, *values, *outs, n,
                                  BLOCK=block, enable_fp_fusion=False)
