"""Generated Python source run as a module: what the Triton backend's kernels are made of.

Light on purpose (the standard library alone), so that ``vega.codegen.triton_ptx``'s compiling
process can load a recorded kernel's module without importing vega's packages, torch and
dynamo (seconds of a CPU each time)."""
from __future__ import annotations

import linecache


def run_source(text: str, filename: str, module: str) -> dict:
    """The namespace of ``text`` executed as the module ``module``, its text kept in
    ``linecache`` under ``filename`` (where ``@triton.jit`` and tracebacks read it)."""
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"__name__": module}
    exec(compile(text, filename, "exec"), namespace)
    return namespace
