"""The functions that a dynamo trace calls eagerly and takes the answer of as a constant
(``torch.compiler.assume_constant_result``).

Imported only from inside a trace (``vega.tracing``), where dynamo is loaded: marking a
function imports dynamo (with sympy, triton and ``torch.distributed.tensor``), which
``import vega``, the ``vega`` command and eager steps do without. dynamo runs an
``import`` in the code it traces at once, and reads the marked function after it, so
the first trace that asks for one of these already takes it as a constant.
"""
from __future__ import annotations

import torch

from vega.tracing import HELD


@torch.compiler.assume_constant_result
def held(make, *args) -> str:
    """dynamo calls this with the real arguments while tracing and keeps the name it
    returns as a constant: the attribute of ``vega.tracing.HELD`` that holds
    ``make(*args)``."""
    found = make(*args)
    name = f"v{id(found):x}"
    if getattr(HELD, name, None) is not found:
        setattr(HELD, name, found)
    return name


@torch.compiler.assume_constant_result
def default_backend(device_type: str) -> str:
    """``vega.codegen.default_backend``, whose answer a trace keeps (it looks for a
    compiler on the PATH, which dynamo cannot trace)."""
    from vega.codegen import chosen_backend
    return chosen_backend(device_type)
