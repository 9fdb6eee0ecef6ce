"""Host-side work that a compiled step needs but dynamo cannot trace.

A step looks up (and, the first time, builds) its programs and kernels: lowering a
spec, running a C compiler, loading a library, executing generated code. Under
``torch.compile`` dynamo would try to trace all of that and break the graph on the
first system call. ``untraced(make, *args)`` runs ``make(*args)`` eagerly instead,
also while dynamo traces, and hands the result to the trace as an attribute of a
holder object, which dynamo reads with a guard on its identity and whose methods it
traces as usual. ``make`` must be a plain function whose result depends only on its
arguments (constants, or objects compared by identity): dynamo keeps the answer.

Inside a trace the answer passes through ``vega.constants.held``, which dynamo calls
eagerly with the real arguments, keeping the name it returns
(``torch.compiler.assume_constant_result``). That module is imported by the first trace
that gets here (dynamo runs an ``import`` at once, and reads the function after it):
marking a function imports dynamo, about a second and a half of a CPU with sympy and
triton, which ``import vega`` and eager steps do without.
"""
from __future__ import annotations

import torch


class _Held:
    """What ``untraced`` handed to a trace, one attribute each."""


# Held for the life of the process, on purpose: a compiled graph calls a kernel by its name
# (the custom ops vega::c_step, vega::triton_step), and dynamo keeps that graph as long as
# it likes, so the kernels a trace used must outlive the optimizer that made them (the
# backends' own tables of kernels are weak). One entry per kernel a trace used, not per spec.
HELD = _Held()


def untraced(make, *args):
    """``make(*args)``, computed outside dynamo's trace when called inside one."""
    if not torch.compiler.is_compiling():
        return make(*args)
    from vega.constants import held  # (see the module's docstring)
    return getattr(HELD, held(make, *args))
