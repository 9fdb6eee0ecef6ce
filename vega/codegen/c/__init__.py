"""The C backend: fused multi-tensor CPU kernels, compiled with OpenMP and SIMD.

One concern a module: ``render`` (the C source of a program that steps every tensor
alike), ``staged`` (of a program over a matrix view), ``build`` (compiling and the kernel
cache), ``native`` (the torch operator that runs a step: ``native.cpp``), ``launch``
(``Kernel``: a program's libraries, stepping lists of tensors).

One shared library per program and dtype group (parameter, gradient and state
dtypes). Its entry points each take the whole group at once -- a table with one
row per tensor (``numel, p, g, state..., step, hyperparameters, p out, state
out...`` as addresses) -- and split the work across threads by element ranges
over all tensors:

- ``vega_prelude``: adds the sum of squares of the unscaled gradients and the
  count of blocks holding a non-finite element into ``pre``;
- ``vega_phase<k>``: per-tensor reductions (``norm``, ``sum``, ``mean``, ``max``)
  of phase k, into ``red``; values needed on both sides are recomputed (but a state's
  new value that a phase computes anyway is stored there and loaded by the later loops:
  ``Source._early_stores``); ``vega_phase<k>_partial`` leaves them unfinished (a sum of
  squares for a norm, a sum for a mean), for ``vega.runtime.sharded`` to combine across
  processes;
- ``vega_update``: the spec's element program, skipping every write when
  ``pre`` counted a non-finite gradient. It reads p and the states at their
  addresses and writes them at the "out" ones: the same addresses for a step in
  place, new tensors for a pure step, which so takes one pass, not a copy and
  then a step (a skipped pure step copies the inputs there);
- ``vega_fused``: for a table of small tensors (``launch.FUSED_MAX``), each thread takes
  whole tensors and runs every phase and then the update on one before the next;
- ``vega_advance``: the step counters plus one, unless skipped.

Reductions sum each tensor in pieces of ``PRE_PIECE`` values from its start, each piece by
one thread, and combine the pieces in order (``vega_fused``: a tensor no longer than one
piece, by one thread), so a step's bits do not depend on the thread count.

A program over a matrix view (row/column reductions or state, ``Program.uses_axes``)
gets ``vega_axes_step`` instead of the phases and the update: it steps the tensors
one at a time, each through a sequence of loops over one domain (see
``AxesSource``), and its results do not depend on the thread count. Its table
rows have the same columns, with the geometry before the outputs. A step with a
non-contiguous tensor runs on contiguous copies, in place.

Each value x of the program (``vega.codegen.base.linearize``: p, g, t, h_<hyperparameter>,
s_<state>, v_<value>) is ``v_x`` in the compute type, ``d_x`` in double (the scalar
phase) and ``m_x`` where it is kept in a buffer; no other identifier of a kernel, nor a
macro of the headers it includes, begins with v_, d_ or m_, so that no spec name can meet
a C keyword, a macro or a local.
"""
from __future__ import annotations

from vega.codegen.c.launch import Kernel, available, kernel_of
from vega.codegen.c.render import Source
from vega.codegen.c.staged import NGEO, AxesSource, line_lengths

__all__ = ["Kernel", "available", "kernel_of", "Source", "AxesSource", "NGEO", "line_lengths"]
