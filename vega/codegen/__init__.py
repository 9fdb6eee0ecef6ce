"""Backends: each renders the IR and runs it on lists of tensors.

A backend is a module with a ``Kernel(program)`` class: callable on lists of
parameters, gradients, states, step counters and hyperparameter values (see
``vega.codegen.reference.Kernel``), with ``source()`` and ``init(...)``.
"""
from __future__ import annotations

from functools import _CacheInfo

import torch

from vega.codegen import c, reference, triton
from vega.codegen.c.runs import CRuns
from vega.codegen.triton_runs import TritonRuns
from vega.dsl.ir import Program
from vega.tracing import untraced

BACKENDS = {"reference": reference, "c": c}
if triton.available():  # where triton is installed (Linux); CPU tensors need TRITON_INTERPRET=1
    BACKENDS["triton"] = triton
KNOWN = ("reference", "c", "triton")


def check_backend(name: str | None) -> None:
    if name is not None and name not in KNOWN:
        raise ValueError(f"backend={name!r} is not one of {', '.join(map(repr, KNOWN))}")
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend={name!r} needs the {name} package, which is not installed "
                         f"here (vega asks for it on Linux only: pip install {name}, where "
                         f"it has a build for this system); available: "
                         f"{', '.join(map(repr, BACKENDS))}")


def default_backend(device_type: str) -> str:
    """The backend for tensors on a device: triton on CUDA, c on the CPU, where built.

    A constant to ``torch.compile``: dynamo calls ``chosen_backend`` while tracing and
    keeps its answer (it looks for a compiler on the PATH, which dynamo cannot trace;
    ``vega.constants``)."""
    if torch.compiler.is_compiling():
        from vega.constants import default_backend as constant
        return constant(device_type)
    return chosen_backend(device_type)


def chosen_backend(device_type: str) -> str:
    """``default_backend``, worked out: not to be traced."""
    preferred = {"cuda": "triton", "cpu": "c"}.get(device_type)
    if preferred == "c" and not c.available():
        return "reference"
    return preferred if preferred in BACKENDS else "reference"


_COUNTS = {"hits": 0, "misses": 0, "size": 0}


def kernel(backend: str, program: Program):
    """The compiled kernel of ``program`` on ``backend``, built once and kept on the
    program (``program.kernels``, by backend name).

    Not ``functools.cache`` nor a dict keyed by programs: dynamo traces through a
    cached function as if it were not cached (building a new kernel inside every
    compiled step), and a dict keyed by programs makes it hash every key, each a
    whole expression DAG, node by node. While dynamo traces a step, the lookup (and a
    build, where this kernel is new) runs outside the trace (``vega.tracing``).
    """
    if torch.compiler.is_compiling():
        return untraced(_kernel, backend, program, False)
    return _kernel(backend, program, True)


def _kernel(backend: str, program: Program, counting: bool):
    found = program.kernels.get(backend)
    if found is None and program.torch_only and backend in _RUNS and _RUNS[backend][1]():
        check_backend(backend)  # (the reference's kernel, its element runs in the backend's
        # loops: vega.codegen.runs)
        found = program.kernels[backend] = reference.Kernel(program, runs=_RUNS[backend][0])
    elif found is None and backend != "reference" and _reference_only(program):
        check_backend(backend)  # (what only the reference computes runs there on any device)
        found = program.kernels[backend] = _kernel("reference", program, counting)
    elif found is None:
        check_backend(backend)
        found = program.kernels[backend] = BACKENDS[backend].Kernel(program)
        if counting:
            _COUNTS["misses"] += 1
            _COUNTS["size"] += 1
    elif counting:
        _COUNTS["hits"] += 1
    return found


# backend -> (its ``vega.codegen.runs.Runs`` class, whether it is there)
_RUNS = {"c": (CRuns, c.available), "triton": (TritonRuns, triton.available)}


def _reference_only(program: Program) -> bool:
    """Whether every backend hands ``program`` to the reference kernels: matrices (only they
    compute them); over a matrix view, a state of one number per tensor. (The C and Triton
    kernels hand a program with reductions over a group whose stages they do not run to
    the reference's themselves: ``Kernel.__call__``.)"""
    return program.torch_only or bool(program.scalar_states and program.uses_axes)


def _cache_info():
    """``functools.cache``'s statistics, for tests that count kernel builds."""
    return _CacheInfo(_COUNTS["hits"], _COUNTS["misses"], None, _COUNTS["size"])


kernel.cache_info = _cache_info
