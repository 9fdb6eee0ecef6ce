"""Running the Triton kernels: tables, block maps, launches and the torch custom ops.

``step`` is the glue that ``torch.compile`` traces: it checks dtypes, allocates
outputs (pure steps) and calls the custom op ``vega::triton_step``, whose
implementation builds the tables and launches the kernels. Nothing here reads
a device value on the host:

- tables of addresses are built on the host from ``data_ptr()`` (host metadata)
  and copied to the device from pinned memory without blocking, only when no
  table with the same addresses is on the device already (gradients
  reallocated by ``zero_grad(set_to_none=True)`` or the fresh outputs of a
  pure step give new ones); tables are never overwritten and their pinned
  sources stay alive, so a captured CUDA graph replays the addresses it was
  captured with;
- block maps (block -> tensor, first element) depend only on the tensors'
  sizes and are built once per parameter set;
- tables and block maps are kept in a ``Kept`` cache that never drops what a
  CUDA graph capture used, and a capture's new tables are copied through pinned
  memory taken before any capture (``Staging``): nothing a graph replays is freed,
  and nothing is allocated pinned while it is captured;
- hyperparameters are a float64 device array: Python floats are copied once
  per distinct set of values; 0-d tensors (schedules evaluated on the device)
  are gathered into it on the device.

``launch`` is the only place a kernel is launched (tests count its calls).
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import operator
import os
import threading
import weakref
from collections import OrderedDict
from itertools import accumulate

import torch
from torch.autograd.graph import increment_version

from vega.codegen.base import (HyperRows, axis_geometry, check_state_devices, check_states,
                               distinct, shard_geometries, state_key)
from vega.codegen.c import native
from vega.codegen.record import finite_of
from vega.codegen.sources import run_source
from vega.codegen.steps import (Done, axis_part, finish_combined, finished, shard_part,
                                tensor_parts)
from vega.codegen.tensors import (copy_back, first_with_own_ops, has_own_ops, memory_order,
                                  mode_tensors, own_ops_words, readable, refuse_inplace)
from vega.dsl.ir import AXIS_REDUCTIONS, QBLOCK, SCALAR_STATE, Op

# on a GPU: warps a program, and bytes of its narrowest tensor each thread reads or writes
# at once (one 128-bit access); a program's BLOCK is 32 * WARPS_GPU threads times the elements
# that make those bytes: 1024 for float32, 2048 where a tensor is bfloat16 or float16. More
# elements a thread hold more values live (float32 at 2048: 73 registers, past the 64 that
# let half of an SM's 2,048 threads run at once; see docs/gpu.md)
WARPS_GPU, BYTES_PER_ACCESS = 8, 16
# registers a thread of an update kernel may use (ptxas' .maxnreg): 64 let 1,024 threads of
# an sm_90 SM's 2,048 run at once. ptxas fits every update kernel in 64 without spilling
# (up to 80 uncapped), but for a master copy, stochastic rounding or float64 parameters,
# which are left to it
# (tests/codegen/test_triton_ptx.py compiles every shipped spec's update so). A program that
# streams more than UPDATE_STATES states of the parameter's shape besides p and g (adan's
# four), or keeps 8-bit state, holds too many values at 8 a thread: its phases and update
# take 4 elements a thread whatever the dtypes (``update_block``; a bfloat16 tensor then read
# 64 bits at a time), and fit in 64 registers so (adan 48, bfloat16 AdamW with 8-bit state
# 64, against 80 and 118-121 at 8 a thread, which spill under the cap). A state of one
# number per tensor whose new value the update computes (``triton.first_block``) counts as
# one such state (D-Adaptation's three and two: 8 bytes spilled at 8 a thread, none at 4)
UPDATE_REGISTERS, UPDATE_STATES, NARROW_ELEMENTS = 64, 3, 4
ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
# (8-bit codes, vega.codegen.quant, do not set the block: a block of their tensor's floats)
BLOCK_INTERPRETER = 4096  # under the interpreter every program costs ~1 ms: fewer, larger ones
# loops over a reduced axis: outputs per program, and values along the axis at a time
WIDE_GPU, WIDE_INTERPRETER = (64, 64), (512, 16)
PRELUDE_PROGRAMS = 1024  # the prelude's programs each take every PRELUDE_PROGRAMS-th block
FINISH_BLOCK = 1024  # partial results combined at a time
SCALAR_BLOCK = 256  # tensors per program of the scalars kernel

# key -> a weak reference to the vega.codegen.triton.Kernel, for the custom ops: a kernel is
# released with its program (one a torch.compile'd step uses is held by ``vega.tracing``)
_KERNELS: dict[str, weakref.ref] = {}


def register(kernel) -> None:
    """Let the custom ops find ``kernel`` by its key (unique to it), while it lives."""
    key = kernel.key
    _KERNELS[key] = weakref.ref(kernel, lambda _, key=key: _KERNELS.pop(key, None))


def kernel_of(key: str):
    """The live kernel named ``key``."""
    ref = _KERNELS.get(key)
    found = ref() if ref is not None else None
    if found is None:
        raise RuntimeError(f"vega: the Triton kernel {key!r} was released with its optimizer")
    return found


# the values of TRITON_INTERPRET that Triton reads as on (its knobs' getenv_bool: any case,
# nothing stripped); every other value is off
_INTERPRET_ON = ("1", "true", "yes", "on", "y")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), as
    Triton reads the variable."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _INTERPRET_ON


_SIZES_FOR_GPU = [False]  # gpu_sizes(): a GPU's sizes, under the interpreter too


@contextlib.contextmanager
def gpu_sizes():
    """Within: the block sizes a GPU gets, under the interpreter too (for recording the
    launches a GPU would see, ``vega.codegen.triton_ptx``)."""
    _SIZES_FOR_GPU.append(True)
    try:
        yield
    finally:
        _SIZES_FOR_GPU.pop()


def _small_blocks() -> bool:
    return interpreting() and not _SIZES_FOR_GPU[-1]


def block_size(dtypes=("float32",)) -> int:
    """Elements a program of an elementwise launch takes, for a group of these dtypes."""
    if _small_blocks():
        return BLOCK_INTERPRETER
    return 32 * WARPS_GPU * BYTES_PER_ACCESS // min(ITEMSIZE[d] for ds in dtypes
                                                    for d in ds.split(",") if d != "uint8")


def update_block(dtypes, kern) -> int:
    """``block_size`` for the phases and update of ``kern``'s program: at most
    NARROW_ELEMENTS a thread where it streams more than UPDATE_STATES states like the
    parameter, or keeps 8-bit state (see UPDATE_REGISTERS)."""
    block = block_size(dtypes)
    program = kern.program
    wide = sum(st.dom == "rc" or (kern.first_block and st.dom == SCALAR_STATE)
               for st in program.states) > UPDATE_STATES
    ways = bool(program.quant) + wide  # (adan with 8-bit state, both: 2 a thread)
    if _small_blocks() or not ways:
        return block
    return min(block, 32 * WARPS_GPU * NARROW_ELEMENTS // ways)


# (name, hash of the source, interpreted) -> the namespace executed from that source, for
# every kernel of the same source: executed again, it would make new jit functions, each
# compiling and loading its kernels anew (and Triton never unloads a loaded CUDA module).
# The most recently used _MODULES_KEPT (a search over many specs keeps not every one's
# compiled kernels; a kernel keeps its own namespaces)
_MODULES: OrderedDict = OrderedDict()
_MODULES_KEPT = 64


def load_module(text: str, name: str) -> dict:
    """Execute generated source as a module, once per process for each source (its
    namespace is read, never written); its text is kept in ``linecache`` (where
    ``@triton.jit`` and tracebacks read it)."""
    import triton  # noqa: F401  (a clear ImportError here, not inside exec)

    key = (name, hashlib.sha256(text.encode()).hexdigest(), interpreting())
    found = _MODULES.get(key)
    if found is not None:
        with contextlib.suppress(KeyError):  # (another thread may have let it go just now)
            _MODULES.move_to_end(key)
        return found
    namespace = run_source(text, f"<vega triton {name}>",
                           f"vega_triton_{name.replace('-', '_')}")
    _MODULES[key] = namespace
    while len(_MODULES) > _MODULES_KEPT:
        _MODULES.popitem(last=False)
    return namespace


def update_registers(program, dtypes) -> dict:
    """The launch option capping an update kernel's registers (``UPDATE_REGISTERS``), where
    the program is one ptxas fits so; none otherwise: a master copy, stochastic rounding,
    float64 parameters (a value takes two registers: AdEMAMix's would spill 48 bytes), and
    none on ROCm (an NVIDIA option)."""
    if program.master or program.rounding is not None or dtypes[0] == "float64" \
            or torch.version.hip is not None:
        return {}
    return {"maxnreg": UPDATE_REGISTERS}


# Triton's interpreter is not thread-safe: while it runs a kernel it patches triton.language
# (its functions and the program's grid) for the duration, and a second thread's launch at
# that moment ran with the first's patches, or none ("Did you forget to add @triton.jit ?",
# "x >= grid_dim[0]"): interpreted launches run one at a time
_INTERPRETER = threading.Lock()


def _forked() -> None:
    """In a child made by ``os.fork``: a new lock, as one that another thread of the parent
    held at the fork (running a kernel) would be held in the child for ever."""
    global _INTERPRETER
    _INTERPRETER = threading.Lock()


os.register_at_fork(after_in_child=_forked)


def launch(fn, grid, *args, **meta) -> None:
    """Launch one kernel (every launch of the backend goes through here)."""
    if interpreting():
        import numpy as np

        # (the interpreter's numpy warns on inf and NaN)
        with _INTERPRETER, np.errstate(all="ignore"):
            fn[grid](*args, **meta)
    else:
        fn[grid](*args, num_warps=meta.pop("num_warps", WARPS_GPU), **meta)


def check_device(device: torch.device) -> None:
    if device.type == "cpu" and not interpreting():
        raise ValueError("backend='triton' on CPU tensors runs in Triton's interpreter: set the "
                         "environment variable TRITON_INTERPRET=1 before triton is imported "
                         "(or use backend='c' or 'reference'; an optimizer's group takes the "
                         "backend of a state_dict it loads, as torch takes a saved group's "
                         "settings: set group['backend'] = None to choose by the device)")
    if device.type == "cpu" and not library_interpreted():
        raise ValueError("TRITON_INTERPRET=1 was set after triton was imported (torch._dynamo "
                         "imports it), so triton.language is not interpreted: set it before "
                         "(in the environment, or first thing in the program)")
    if device.type != "cpu" and interpreting():
        raise ValueError(f"TRITON_INTERPRET=1 runs Triton kernels on the CPU, but the tensors "
                         f"are on {device}: unset it to run on the GPU")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='triton' runs on CUDA tensors, got tensors on {device}")


def check_mode() -> None:
    """ValueError for a step of real tensors under ``FakeTensorMode``, before anything is
    made: the tensors a step makes there (its outputs, the prelude's record, the address
    tables the native operator builds, the tables kept for later steps) are FakeTensors of
    address 0, which the kernels and the native operator wrote at (a segmentation fault),
    and a table kept so would serve every later step. While dynamo traces, the custom ops'
    fake implementations run there instead, and this is not asked. ``FunctionalTensorMode``
    (non-strict export's) is refused alike (``mode_tensors``)."""
    if mode_tensors() is not None:
        raise ValueError("backend 'triton': a step under a mode that makes its own tensors "
                         "(FakeTensorMode, FunctionalTensorMode): they have no memory for its "
                         "kernels to write; step outside the mode, or use backend='reference'")


def library_interpreted() -> bool:
    """Whether triton.language's own jit functions (tl.sum, ...) run in the interpreter:
    they are decorated when triton is imported, so only if TRITON_INTERPRET was set then."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


# -- tables -------------------------------------------------------------------

class Kept:
    """Device objects (tables, block maps) by key: the least recently used dropped past
    ``limit``, except those a CUDA graph captured, which are held as long as the process
    lives (a graph replays their addresses: freed, their memory could be handed out again)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.items: OrderedDict = OrderedDict()
        self.held: dict = {}

    def get(self, key, make, capturing: bool):
        """The object for ``key``, made by ``make()`` if there is none; held if
        ``capturing``."""
        if self.held and key in self.held:
            return self.held[key]
        value = self.items.get(key)  # (a key is hashed once a lookup: a tuple of the lengths
        if value is None:            # of a step's tensors, on a hit, is hashed twice)
            value = make()
        elif not capturing:
            with contextlib.suppress(KeyError):  # (the most recently used last; another
                self.items.move_to_end(key)      # thread may have dropped it just now)
            return value
        if capturing:
            self.items.pop(key, None)
            self.held[key] = value
            return value
        self.items[key] = value
        while len(self.items) > self.limit:
            self.items.popitem(last=False)
        return value


class Staging:
    """Pinned host memory taken once, outside any capture, from which the tables a CUDA
    graph capture first needs are copied (the capture records the copy; nothing is
    allocated pinned while it runs). Each piece taken is the graph's for good."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.used = 0

    def take(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` in the staging memory (16-byte aligned); RuntimeError when it is
        used up."""
        nbytes = host.numel() * host.element_size()
        start = -(-self.used // 16) * 16
        if start + nbytes > self.buffer.numel():
            raise RuntimeError(
                f"vega: a CUDA graph capture needs {nbytes} bytes of tables it has not made "
                f"before, past the {self.buffer.numel()} bytes staged for captures; run "
                f"the step once eagerly with the same tensors before capturing it")
        self.used = start + nbytes
        piece = self.buffer[start:start + nbytes].view(host.dtype).view(host.shape)
        piece.copy_(host)
        return piece


STAGING_BYTES = 1 << 20  # pinned memory for the tables of captures (taken at the first step)
_STAGING: list = []


def _staged_copy(host: torch.Tensor, device: torch.device, capturing: bool):
    """(``host`` on ``device``, copied without blocking, and its pinned source, kept alive:
    a graph may replay the copy): pinned anew, or from the staging memory while capturing."""
    if not _STAGING and not capturing:
        _STAGING.append(Staging(STAGING_BYTES))
    if capturing:
        if not _STAGING:
            raise RuntimeError("vega: a CUDA graph captured a step before any step ran "
                               "eagerly; run one step before capturing it")
        pinned = _STAGING[0].take(host)
    else:
        pinned = host.pin_memory()
    return pinned.to(device, non_blocking=True), pinned


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _constants(kept: "Kept", key: tuple, values, device: torch.device) -> torch.Tensor:
    """float64 ``values`` on ``device``, made once per ``key`` in ``kept``; under
    torch.compile a tensor the graph makes (dynamo traces neither the capture query nor the
    pinned copy; the compiled graph holds its constants itself)."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.float64, device=device)
    return kept.get(key, lambda: _device(_host(values, torch.float64), device),
                    _capturing(device))


def _host(values, dtype: torch.dtype) -> torch.Tensor:
    """A small table of ``values`` on the host: on the CPU whatever device a context makes
    the default (``with torch.device("meta")``, ``torch.set_default_device``), where a
    table made there would be cached (``Kept``) for every later step."""
    return torch.tensor(values, dtype=dtype, device="cpu")


def _device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small table) on ``device``, copied from pinned memory without blocking.

    Tables are kept by content (``Kept``): a step whose addresses did not change reuses its
    table, a table is never overwritten, and one a captured CUDA graph uses is never freed,
    nor is its pinned source (the graph replays the copy)."""
    if device.type == "cpu":
        return host
    key = (device, host.dtype, tuple(host.shape), host.numpy().tobytes())
    capturing = _capturing(device)
    return _TABLES.get(key, lambda: _staged_copy(host, device, capturing), capturing)[0]


class BlockMap:
    """Which tensor, and which elements of it, each program of a launch works on."""

    def __init__(self, numels: tuple[int, ...] | bytes, block: int, device: torch.device,
                 capturing: bool = False, every: bool = False):
        # (``every``: an empty tensor has a block too, whose program reads no element)
        numels = _lengths(numels)
        counts = _host([max(-(-n // block), int(every)) for n in numels], torch.int64)
        first = torch.zeros(len(numels) + 1, dtype=torch.int64, device="cpu")
        torch.cumsum(counts, 0, out=first[1:])
        self.nblocks = int(first[-1])
        tensor = torch.repeat_interleave(
            torch.arange(len(numels), dtype=torch.int64, device="cpu"), counts)
        start = (torch.arange(self.nblocks, dtype=torch.int64, device="cpu")
                 - first[tensor]) * block
        host = [tensor.to(torch.int32), start, first]
        if device.type == "cpu":
            self.tensor, self.start, self.first = host
        else:  # (the pinned sources stay alive with the map)
            copies = [_staged_copy(x, device, capturing) for x in host]
            self._host = [pinned for _, pinned in copies]
            self.tensor, self.start, self.first = (dev for dev, _ in copies)


def _lengths(numels: tuple[int, ...] | bytes) -> tuple[int, ...]:
    """Tensors' lengths given as ints, or as the bytes of int64s in the machine's order (the
    native operator's ``triton_rows`` gives them so: one object a step, hashed and compared
    as one)."""
    return tuple(memoryview(numels).cast("q")) if isinstance(numels, bytes) else numels


def block_map(numels: tuple[int, ...] | bytes, block: int, device: torch.device,
              every: bool = False) -> BlockMap:
    """The BlockMap of tensors of ``numels`` elements (ints, or ``_lengths``' bytes);
    ``every``: an empty one has a block too (a program writing the states of one number per
    tensor: ``triton.Source``'s ``first_block``)."""
    capturing = _capturing(device)
    return _MAPS.get((numels, block, device, every),
                     lambda: BlockMap(numels, block, device, capturing, every), capturing)


_TABLES = Kept(256)  # (device, content) -> (device table, its pinned source)
_MAPS = Kept(64)  # (numels, block, device, every) -> BlockMap


def _hyper_array(device, nhyper, ndicts, tensors, floats, slots) -> torch.Tensor:
    """float64 [dicts, hyperparameters] on the device; ``slots[d * nhyper + k]`` is
    ``j >= 0`` for ``tensors[j]``, ``-1 - j`` for ``floats[j]``."""
    width = max(nhyper, 1)
    if not slots and len(tensors) == 1 and tensors[0].dim() == 2:  # a HyperRows table
        return tensors[0].to(device=device, dtype=torch.float64).contiguous()
    values = [floats[-1 - s] if s < 0 else 0.0 for s in slots] or [0.0] * (ndicts * width)
    base = _device(_host(values, torch.float64).reshape(ndicts, width), device)
    # each tensor's value where its slots are (a mask made once per layout): one operation a
    # tensor (two if it is not float64), where a copy, a stack and a scatter took four
    out = base
    for j in dict.fromkeys(s for s in slots if s >= 0):
        mask = _device(_host([s == j for s in slots], torch.bool)
                       .reshape(ndicts, width), device)
        out = torch.where(mask, tensors[j].detach().to(device, torch.float64).reshape(()), out)
    return out


# -- the custom ops -------------------------------------------------------------

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
          torch.float16: "float16", torch.uint8: "uint8"}  # (uint8: 8-bit states' codes)


_DTYPE = operator.attrgetter("dtype")


def _groups(params, grads, flat_states, n: int, nstate: int) -> dict[tuple, list[int]]:
    """The tensors' positions by dtype group (``_dtype_key``): in one pass over the dtypes
    where every parameter, gradient and state shares one (the common case)."""
    pd, gd, sd = (list(map(_DTYPE, x)) for x in (params, grads, flat_states))
    if n and pd.count(pd[0]) == n and gd.count(gd[0]) == n and (
            not sd or sd.count(sd[0]) == len(sd)):
        return {_dtype_key(params[0], grads[0], flat_states[0::n] if nstate else []):
                list(range(n))}
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        groups.setdefault(_dtype_key(params[i], grads[i], flat_states[i::n] if nstate else []),
                          []).append(i)
    return groups


def _dtype_key(p, g, s):
    """(p, g, state) dtype names; ``s``: a state tensor, or a list of each state's (the
    state part is ``state_key``'s)."""
    if isinstance(s, list):
        return DTYPES[p.dtype], DTYPES[g.dtype], state_key([DTYPES[x.dtype] for x in s],
                                                           DTYPES[p.dtype])
    return DTYPES[p.dtype], DTYPES[g.dtype], DTYPES[s.dtype]


_DONE = Kept(64)  # (device, stream) -> int32 [1]: the prelude's count of finished programs,
# 0 at rest: one a stream, as preludes on two streams may run at once; and one for each
# prelude a CUDA graph captures (keyed by a number of its own): graphs captured on one stream
# (torch.cuda.graph's default capture stream serves every capture) may be replayed at once on
# two, and two launches counting on one counter each miss their last program
_CAPTURED = itertools.count()
_SETTINGS = Kept(64)  # (device, max_norm, check) -> float64 [3]: 1, max_norm, check


def settings(device: torch.device, max_norm, check: bool) -> torch.Tensor:
    """The record's settings on ``device`` (an inverse loss scale of 1, ``max_norm``, 0 for
    none, and ``check``), made once per value: a step reads them, copies nothing."""
    device = torch.device(device)
    norm = float(max_norm) if max_norm is not None else 0.0
    return _constants(_SETTINGS, (device, norm, bool(check)), [1.0, norm, float(bool(check))],
                      device)


def _prelude_impl(kernel: str, grads: list[torch.Tensor], pre: torch.Tensor,
                setting: torch.Tensor | None, inv: torch.Tensor | None) -> None:
    """Adds the gradients' sum of squares and non-finite count into ``pre``; or, given
    ``setting`` (``settings``: the record is new, its contents undefined), writes the
    whole record: the sums, the inverse loss scale (``inv``: float64, or a float32 loss
    scale inverted in float64 here; else the setting's), the max norm and the check. One
    launch per dtype group, the last of its programs combining theirs."""
    kern = kernel_of(kernel)
    check_device(pre.device)
    groups: dict[str, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_dtype_key(g, g, g)[0], []).append(g)
    _prelude_launch(kern, [(gdt, _host([[g.numel(), g.data_ptr()] for g in gs],
                                                     torch.int64), tuple(g.numel() for g in gs))
                           for gdt, gs in groups.items()], pre, setting, inv)


def _prelude_launch(kern, found, pre: torch.Tensor, setting: torch.Tensor | None,
                    inv: torch.Tensor | None) -> None:
    """The prelude's launches (``_prelude_impl``) given its tables: ``found``, a (dtype,
    table on the host: a row (length, address) a gradient, the lengths) per dtype group."""
    name = kern.prefix
    capturing = _capturing(pre.device)
    stream = torch.cuda.current_stream(pre.device).cuda_stream \
        if pre.device.type == "cuda" else 0
    # (made while a graph is captured, its zero fill is the graph's, run first at each replay)
    key = (pre.device, stream, next(_CAPTURED)) if capturing else (pre.device, stream)
    done = _DONE.get(key, lambda: torch.zeros(1, dtype=torch.int32, device=pre.device),
                     capturing)
    with on_device(pre.device):
        for gdt, rows, numels in found:
            block = block_size((gdt,))
            bmap = block_map(numels, block, pre.device)
            if bmap.nblocks == 0:
                continue
            table = _device(rows, pre.device)
            mod = kern.module((gdt, gdt, gdt))
            programs = min(bmap.nblocks, PRELUDE_PROGRAMS)
            part = torch.empty((programs, 2), dtype=torch.float64, device=pre.device)
            launch(mod[f"{name}_prelude"], (programs,), table, bmap.tensor, bmap.start,
                   bmap.nblocks, pre, part, done, setting if setting is not None else pre,
                   inv if inv is not None else pre, SET=setting is not None,
                   HAS_INV=inv is not None, FROM_SCALE=inv is not None and
                   inv.dtype == torch.float32, BLOCK=block, PARTS=PRELUDE_PROGRAMS)
            setting = inv = None  # (the next groups add to the record)
    if setting is not None:  # no gradient element at all: the record without sums
        if inv is not None and inv.dtype == torch.float32:  # (a scale: its inverse)
            inv = inv.double().reciprocal()
        pre.copy_(torch.cat([setting.new_zeros(2), (inv if inv is not None else setting[0])
                             .to(pre.device, torch.float64).reshape(1), setting[1:]]))


# the custom op that torch.compile traces; eagerly the function is called as it is (torch's
# dispatch of an operator over hundreds of tensor arguments costs more than the step's host
# work: about 1.4 ms for GPT-2 small's 148 tensors)
_prelude_op = torch.library.custom_op("vega::triton_prelude", mutates_args=("pre",))(
    _prelude_impl)


@_prelude_op.register_fake
def _(kernel, grads, pre, setting, inv) -> None:
    return None


def _step_impl(kernel: str, params: list[torch.Tensor], states: list[torch.Tensor],
             steps: list[torch.Tensor], finite: torch.Tensor, grads: list[torch.Tensor],
             old_params: list[torch.Tensor], old_states: list[torch.Tensor],
             old_steps: list[torch.Tensor], step_index: list[int],
             hyper_tensors: list[torch.Tensor], hyper_floats: list[float],
             hyper_slots: list[int], hyper_index: list[int], pre: torch.Tensor | None,
             inplace: bool, scale_state: list[torch.Tensor],
             scale_config: torch.Tensor | None) -> None:
    """One step of every tensor: writes params, states (state-major), steps and finite.
    ``old_*`` are the inputs of a pure step (empty when ``inplace``). ``scale_state``: a
    dynamic loss scale's tensors (``LossScale.tensors()``), adjusted in place by the launch
    that advances the counters (``scale_config``: its interval and factors, float64), or
    none."""
    kern = kernel_of(kernel)
    device = finite.device
    check_device(device)
    src_t = steps if inplace else old_steps
    with on_device(device):
        found, hyp = _tables(kern, params, states, grads, old_params, old_states, src_t,
                             step_index, hyper_tensors, hyper_floats, hyper_slots,
                             hyper_index, inplace, device)
        _launch_groups(kern, found, params, src_t, steps, finite, pre, hyp, scale_state,
                       scale_config, device)


def _tables(kern, params, states, grads, old_params, old_states, src_t, step_index,
            hyper_tensors, hyper_floats, hyper_slots, hyper_index, inplace, device, geos=None):
    """(the tables of a step, per dtype group: its dtypes, positions, rows on the host,
    whether every address is 16-byte aligned and the tensors' lengths; the
    hyperparameters' device array), called within ``on_device``: ``_step_impl``'s arguments;
    ``geos``: ``_launches``'."""
    n, nstate = len(params), len(kern.program.states)
    src_p, src_s = (params, states) if inplace else (old_params, old_states)
    nhyper = len(kern.program.float_hypers)
    width = max(nhyper, 1) * 8
    groups = _groups(src_p, grads, src_s, n, nstate)
    # every address once (a step in place reads and writes the same tensors)
    ptr = torch.Tensor.data_ptr
    p_out, s_out = list(map(ptr, params)), list(map(ptr, states))
    p_in, s_in = (p_out, s_out) if inplace else (list(map(ptr, src_p)), list(map(ptr, src_s)))
    g_at, t_at = list(map(ptr, grads)), list(map(ptr, src_t))
    numels = list(map(torch.Tensor.numel, params))
    hyp = _hyper_array(device, nhyper, max(hyper_index, default=-1) + 1, hyper_tensors,
                       hyper_floats, hyper_slots)
    h_at = hyp.data_ptr()
    found = []  # (dtypes, positions, the table's rows on the host, aligned, lengths)
    for key, idx in groups.items():
        rows = []
        misaligned = 0
        for i in idx:
            ins = s_in[i::n] if nstate else []
            outs = s_out[i::n] if nstate else []
            rows.append([numels[i], p_in[i], g_at[i], *ins, t_at[step_index[i]],
                         h_at + hyper_index[i] * width, p_out[i], *outs])
            for a in (p_in[i], g_at[i], p_out[i], *ins, *outs):
                misaligned |= a
        if kern.plan is not None:
            rows = [row + extra for row, extra in zip(rows, _geometry(
                kern, [params[i].shape for i in idx],
                [geos[i] for i in idx] if geos is not None else None))]
        found.append((key, idx, _host(rows, torch.int64), misaligned % 16 == 0,
                      tuple(numels[i] for i in idx)))
    return found, hyp


def _launch_groups(*args, **kwargs) -> None:
    """``_launches`` of a step whose reductions are all this process's (it yields
    nothing)."""
    for _ in _launches(*args, **kwargs):
        raise AssertionError("a step without shards stopped for combined reductions")


def _launches(kern, found, params, src_t, steps, finite, pre, hyp, scale_state,
              scale_config, device, counters=None, views=None, geos=None):
    """The launches of a step (``_step_impl``) given its tables: ``found``, a (dtypes,
    positions, the table's rows on the host, whether every address is 16-byte aligned, the
    tensors' lengths, as ``block_map`` takes them) per dtype group, within ``on_device``;
    ``counters``: the step counters' table on the host (each one's address read, then
    written), or None to make it here. ``geos``: each tensor's ``Geometry`` where it is not
    its shape's own (a shard's). A generator: given ``views`` (each tensor's ``ShardView`` or
    None, the step over shards: ``staged``), it yields each phase's per-tensor partial
    results and is sent them back combined across processes (``vega.codegen.steps.drive``);
    otherwise it yields nothing."""
    name = kern.prefix
    has_pre = pre is not None
    # each group's table and this step's scalars, all computed before any counter moves
    work = []
    for key, idx, rows, aligned, numels in found:
        mod = kern.module(key)
        table = _device(rows, device)
        ct = torch.float64 if key[0] == "float64" else torch.float32
        scal = torch.empty((len(idx), mod["NSCAL"].value), dtype=ct, device=device)
        launch(mod[f"{name}_scalars"], (-(-len(idx) // SCALAR_BLOCK),), table, len(idx),
               pre if has_pre else hyp, scal, HAS_PRE=has_pre, BLOCK=SCALAR_BLOCK, num_warps=4)
        work.append((key, idx, mod, table, scal, aligned, numels))
    if counters is None and steps:
        counters = _host([[a.data_ptr(), b.data_ptr()] for a, b in zip(src_t, steps)],
                         torch.int64)
    counters = _device(counters, device) if steps else None
    advanced = not steps
    adjust = bool(scale_state) and bool(steps)
    scale_tab = _device(_host([t.data_ptr() for t in scale_state], torch.int64),
                        device) if adjust else finite
    scale_cfg = scale_config if adjust else finite
    # each element-wise group's blocks and per-tensor reductions (a step over shards steps
    # a group without blocks too: its partial results count, as zeros)
    maps = []
    for key, idx, mod, table, scal, aligned, numels in work:
        if kern.plan is not None:
            maps.append(None)
            continue
        block = update_block(key, kern)
        bmap = block_map(numels, block, device, kern.first_block)
        maps.append((block, bmap, torch.empty((len(idx), max(kern.nred, 1)),
                                              dtype=torch.float64, device=device))
                    if bmap.nblocks or views is not None else None)
    slot = 0
    for k, nparts in enumerate(kern.phase_sizes if kern.plan is None else []):
        for (key, idx, mod, table, scal, aligned, _), m in zip(work, maps):
            if m is None:
                continue
            block, bmap, red = m
            part = torch.empty((max(bmap.nblocks, 1), nparts), dtype=torch.float64,
                               device=device)
            if bmap.nblocks:
                launch(mod[f"{name}_phase{k}"], (bmap.nblocks,), table, bmap.tensor,
                       bmap.start, scal, red, part, HAS_PRE=has_pre, ALIGNED=aligned,
                       BLOCK=block)
            launch(mod[f"{name}_finish{k}"], (len(idx),), table, bmap.first, part, red,
                   BLOCK=FINISH_BLOCK, RAW=views is not None, num_warps=4)
        if views is not None:
            yield from _combined(kern, work, maps, views, k, slot)
        slot += nparts
    if kern.plan is not None:
        yield from _axes_launches(kern, [
            (mod, table, idx, key, scal, [params[i].shape for i in idx],
             [geos[i] for i in idx] if geos is not None else None)
            for key, idx, mod, table, scal, _, _ in work], pre, device, views)
    # the last update launch advances the counters (a group of empty tensors launches none)
    final = max((w for w, m in enumerate(maps) if m is not None and m[1].nblocks), default=-1)
    for w, ((key, idx, mod, table, scal, aligned, numels), m) in enumerate(zip(work, maps)):
        if m is None or m[1].nblocks == 0:
            continue
        block, bmap, red = m
        last = w == final and not advanced
        launch(mod[f"{name}_update"], (bmap.nblocks,), table, bmap.tensor, bmap.start,
               scal, red, counters if last else table, len(steps) if last else 0, finite,
               scale_tab, scale_cfg, ADVANCE=last, ADJUST=last and adjust,
               HAS_PRE=has_pre, ALIGNED=aligned, BLOCK=block,
               **update_registers(kern.program, key))
        advanced = advanced or last
    if not advanced:
        mod = work[-1][2] if work else kern.module(("float32",) * 3)
        launch(mod[f"{name}_advance"], (1,), counters, len(steps),
               pre if has_pre else hyp, finite, scale_tab, scale_cfg, HAS_PRE=has_pre,
               ADJUST=adjust, num_warps=4)


def _combined(kern, work, maps, views, k, slot):
    """Phase ``k``'s reductions over shards (``_launches``): each tensor's raw partial
    result (the finish kernels' ``RAW``), a sum times its ``ShardView.weight``, yielded as
    ``vega.codegen.c.Kernel.staged`` yields them, one tensor a reduction and dtype group;
    the totals sent back finished (a norm's square root, a mean divided by the whole
    tensor's count) into the reduction buffers for the next phase and the update to
    read."""
    phase = kern.phases[k]
    parts, finish = [], []
    for (_, idx, *_, numels), m in zip(work, maps):
        if m is None:
            continue
        red = m[2]
        # (tables made on the host, copied without blocking: ``_device``)
        weights = [views[i].weight if views[i] is not None else 1.0 for i in idx]
        weight = None if all(w == 1.0 for w in weights) else _device(
            _host(weights, torch.float64), red.device)
        count = _device(_host(
            [math.prod(views[i].full.full) if views[i] is not None else n
             for i, n in zip(idx, _lengths(numels))], torch.float64), red.device) \
            if any(n.op is Op.MEAN for n in phase) else None
        for q, node in enumerate(phase):
            parts.append(shard_part(node.op, red[:, slot + q].clone(), weight,
                                    kern.global_keys.get(id(node))))
            finish.append((red, slot + q, node.op, count))
    combined = yield parts
    for (red, c, op, count), value in zip(finish, combined):
        red[:, c] = finished(op, value, count)


def _axis_geometries(shapes, geos=None) -> list[tuple[int, ...]]:
    """``axis_geometry`` of each shape, or of each ``Geometry`` of ``geos`` (a shard's:
    ``ShardView.local``) where given."""
    if geos is None:
        return [axis_geometry(shape) for shape in shapes]
    return [axis_geometry(g.full, (g.r, g.c)) for g in geos]


def _geometry(kern, shapes, geos=None) -> list[list[int]]:
    """The geometry columns, then the temporaries' offsets, of each row of a program that
    uses the matrix view (``geos``: ``_axis_geometries``')."""
    _, temps = kern.plan
    out, total = [], 0
    for geo in _axis_geometries(shapes, geos):
        offsets = []
        for d in temps:
            offsets.append(total)
            total += geo[d]
        out.append(list(geo[1:]) + offsets)
    return out


def _axes_launches(kern, groups, pre, device, views=None):
    """The launches of a program that uses the matrix view (see
    ``vega.codegen.plan.axis_plan``), stage by stage over every dtype group (``groups``:
    its module, table, positions, dtypes, scalars, and its tensors' shapes and
    ``Geometry``s, or None for their shapes' own), each over the values of one domain of
    every tensor of a group. A generator: given ``views`` (each tensor's ``ShardView`` or
    None: the step over shards), the stages leave their sums along an axis and per tensor
    unfinished (``RAW``), and ``_combined_axes`` yields and finishes them between stages;
    otherwise it yields nothing."""
    launches, temps = kern.plan
    name, has_pre, raw = kern.prefix, pre is not None, views is not None
    (wide, kblock) = WIDE_INTERPRETER if _small_blocks() else WIDE_GPU
    work = []
    for mod, table, idx, dtypes, scal, shapes, gs in groups:
        geo = _axis_geometries(shapes, gs)
        total = sum(x[d] for x in geo for d in temps)  # the temporaries, one after another
        ct = torch.float64 if dtypes[0] == "float64" else torch.float32
        tmp = torch.empty(max(total, 1), dtype=ct, device=device)
        red = torch.empty((len(geo), max(kern.nred, 1)), dtype=torch.float64, device=device)
        if raw:  # (a skipped step writes nothing, and its partial results are combined)
            tmp.zero_()
            red.zero_()
        # int32 index arithmetic where every index and size fits (an element's, a temporary's)
        i32 = max([total, *(x[0] for x in geo)]) < 2**31 - block_size(dtypes)
        # each tensor's temporaries, in order (the table's T_ columns: ``_geometry``)
        sizes = [[x[d] for d in temps] for x in geo]
        starts = accumulate((n for row in sizes for n in row), initial=0)
        spots = [[(next(starts), n) for n in row] for row in sizes]
        work.append((mod, table, idx, dtypes, scal, gs, spots, tmp, red, i32, geo))
    for stage in range(kern.axes.nstages + 1):
        for mod, table, _, dtypes, scal, _, _, tmp, red, i32, geo in work:
            parts = {}
            for kind, fn, dom, is_wide, nparts, at in launches:
                if at != stage:
                    continue
                block = wide if is_wide else block_size(dtypes)
                bmap = block_map(tuple(x[dom] for x in geo), block, device)
                if kind == "finish":
                    launch(mod[f"{name}_{fn}"], (len(geo),), table, bmap.first, parts[dom], red,
                           BLOCK=FINISH_BLOCK, RAW=raw, num_warps=4)
                    continue
                args = [table, bmap.tensor, bmap.start, scal, red, tmp]
                if nparts:
                    parts[dom] = torch.empty((max(bmap.nblocks, 1), nparts),
                                             dtype=torch.float64, device=device)
                    args.append(parts[dom])
                if bmap.nblocks:
                    launch(mod[f"{name}_{fn}"], (bmap.nblocks,), *args, HAS_PRE=has_pre,
                           I32=i32, BLOCK=block,
                           **({"KBLOCK": kblock, "RAW": raw} if is_wide else {}))
        if raw and stage < kern.axes.nstages:
            yield from _combined_axes(kern, work, views, stage)


def _combined_axes(kern, work, views, stage):
    """Stage ``stage``'s results of a step over shards (``_axes_launches``), each tensor's:
    a reduction along an axis, or per tensor, that other processes hold part of is yielded
    (times the tensor's ``ShardView.weight``, but a maximum) and its combined total
    finished; the others are finished as they are."""
    gathers, reds = kern.axes.stage(stage)
    slots = {id(n): j for j, n in enumerate(n for ph in kern.phases for n in ph)}
    temp = {id(n): q for q, n in enumerate(kern.axes.temps)}
    parts, finish = [], []
    for _, _, idx, _, _, gs, spots, tmp, red, _, _ in work:
        for i, g, spot in zip(idx, gs, spots):
            v = views[i]
            for m in gathers:
                which, how = AXIS_REDUCTIONS[m.op]
                lo, size = spot[temp[id(m)]]
                out = tmp[lo:lo + size]
                axis = g.axis(which)
                if v is not None and v.spans(which, m.src[0].dom):
                    axis_part(how, out, out, v, v.full.full[axis], parts, finish)
                elif how == "mean":  # all here
                    out.div_(g.full[axis] if axis is not None else 1)
        for m in reds:
            tensor_parts(m, red[:, slots[id(m)]], [views[i] for i in idx], gs, parts, finish,
                         lambda t: _device(t, red.device))
    if parts:
        finish_combined(finish, (yield parts))


_step_op = torch.library.custom_op("vega::triton_step",
                                   mutates_args=("params", "states", "steps", "finite",
                                                 "scale_state"))(
    _step_impl)


@_step_op.register_fake
def _(kernel, params, states, steps, finite, grads, old_params, old_states, old_steps,
      step_index, hyper_tensors, hyper_floats, hyper_slots, hyper_index, pre, inplace,
      scale_state, scale_config) -> None:
    return None


def on_device(device: torch.device):
    """Within: ``device`` (a CUDA device) is the current one, where Triton launches."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# -- the glue that torch.compile traces -------------------------------------------

_DEVICE_OF = operator.attrgetter("device")


def _check_all(kern, params, grads, states, steps, device) -> None:
    """``_check`` of every parameter, gradient and state, every one on ``device`` (the
    kernels read and write each at its address there: a state on ``meta``, whose address is
    0, crashed the process), and ``_check_counters`` of the distinct step counters ``steps``:
    in a few passes over their types, dtypes and devices where all is well (the common
    case), tensor by tensor to say which is wrong otherwise."""
    _check_counters(steps, device)
    if not torch.compiler.is_compiling():  # (dynamo traces the checks one by one)
        every = [*params, *grads, *(x for col in states for x in col)]
        if first_with_own_ops(every) is None and _FLOATS.issuperset(map(_DTYPE, params)) \
                and _FLOATS.issuperset(map(_DTYPE, grads)) \
                and _KNOWN.issuperset(map(_DTYPE, every)) \
                and all(d == device for d in map(_DEVICE_OF, every)):
            return
    for p, g in zip(params, grads):
        _check(kern, "parameters", p)
        _check(kern, "gradients", g)
        if p.device != device or g.device != device:
            raise ValueError(f"backend 'triton' needs every tensor of a step on one device, got "
                             f"{p.device} and {g.device} besides {device}")
    for col in states:
        for x in col:
            _check(kern, "state", x)
    check_state_devices("triton", kern.program, params, states)  # (each on its parameter's)


_KNOWN = frozenset(DTYPES)
_FLOATS = _KNOWN - {torch.uint8}  # (a parameter's and a gradient's: uint8 is 8-bit codes')


def _check_counters(steps, device) -> None:
    """Every step counter a 0-d int32 tensor on ``device``, as the kernels read and advance
    it (a float32 counter's bits were advanced as an int32's, and its step read as one: a
    wrong update, silently), else ValueError naming it, as the C backend's."""
    for t in steps:  # (one not a tensor is named before: by the class, the functional step)
        if t.dtype != torch.int32 or t.dim() != 0 or t.device != device:
            raise ValueError(f"backend 'triton': a step counter must be a 0-d int32 tensor on "
                             f"{device}, got shape {tuple(t.shape)} and dtype {t.dtype} on "
                             f"{t.device}")


def _check(kern, what: str, x: torch.Tensor) -> None:
    if has_own_ops(x):  # (no storage of its own to read: DTensor)
        raise ValueError(f"backend 'triton': {what} {own_ops_words(x)}; use "
                         f"backend='reference'")
    if x.dtype not in DTYPES or (x.dtype == torch.uint8 and what != "state"):
        raise ValueError(f"backend 'triton' does not support {what} of dtype {x.dtype} "
                         f"(float32, float64, bfloat16 and float16 only)")


def prelude(kern, grads, pre: torch.Tensor, init=None) -> None:
    """The kernel's ``prelude``; ``init``: ``(inverse loss scale or None, max_norm, check,
    loss scale or None)`` (a float32 scale, whose inverse the kernel forms; another's is
    formed here), where ``pre`` is new (``torch.empty``) and this launch writes all of it."""
    found = None
    mod = None if torch.compiler.is_compiling() else _table_builder()
    if mod is not None:  # each gradient checked and its row made in C++
        check_device(pre.device)
        try:
            found, checked = mod.triton_grad_rows(grads, pre.device)
        except ValueError:  # (the checks below say what)
            pass
        else:  # (for this step's triton_rows: the record is made for the step, and goes)
            kept = pre.__dict__.setdefault(_CHECKED, {})
            kept[id(grads)] = checked
    if found is None:
        for g in grads:
            _check(kern, "gradients", g)
    setting = inv = None
    if init is not None:
        inv_scale, max_norm, check, scale = init
        setting = settings(pre.device, max_norm, check)
        if scale is not None:  # a float32 loss scale, inverted by the kernel; one of another
            # dtype inverted here, in float64 (engine.inverse_scale's: a float64 scale
            # rounded to float32 first gave another inverse)
            inv = scale.detach().reshape(()).to(pre.device)
            if inv.dtype != torch.float32:
                inv = inv.to(torch.float64).reciprocal()
        elif inv_scale is not None:
            # (the scale's device named: a context's default device would take the tensor)
            inv = torch.as_tensor(inv_scale, dtype=torch.float64,
                                  device=pre.device).detach().reshape(())
    if found is not None:
        _prelude_launch(kern, found, pre, setting, inv)
        return
    op = torch.ops.vega.triton_prelude if torch.compiler.is_compiling() else _prelude_impl
    op(kern.key, readable(grads), pre, setting, inv)


_SCALE_CONFIGS = Kept(16)  # (device, interval, growth, backoff) -> float64 [3]


def _scale_args(adjust, device) -> tuple[list, torch.Tensor | None]:
    """A dynamic ``LossScale``'s tensors and its settings (interval and factors, float64 on
    ``device``: made once per value) for the launch that adjusts it; ([], None) for none."""
    if adjust is None:
        return [], None
    key = (device, float(adjust.growth_interval), float(adjust.growth_factor),
           float(adjust.backoff_factor))
    return list(adjust.tensors()), _constants(_SCALE_CONFIGS, key, list(key[1:]), device)


# the record's attribute that holds what the prelude's ``triton_grad_rows`` found of each
# list of gradients (by the list's id), which the step's ``triton_rows`` takes where they are
# the same tensors in the same order (it compares them): their checks are not done twice
_CHECKED = "_vega_checked_grads"


def _table_builder():
    """The C backend's native module, which checks a step's tensors and builds its tables
    (``triton_rows``, ``triton_grad_rows``), or None where it is not built."""
    return native.module()


# a state's domain as the native operator's checks name it (vega.codegen.c.native.cpp)
_NATIVE_DOMS = {"rc": 0, SCALAR_STATE: 4, QBLOCK: 5}


def _native_step(kern, params, grads, states, uniq_steps, step_index, hypers, pre, adjust,
                 device):
    """A step in place whose tensors the C++ operator's ``triton_rows`` checks (every one a
    plain tensor on ``device``, contiguous, as stored, of a dtype the kernels take, of the
    shape its parameter needs, no two written sharing memory) and whose tables it builds, in
    one call: about 0.4 us for a parameter with its gradient and two states, against several
    in Python. Returns the step's all-finite
    flag; False where that operator is not built, or the program or the tensors need the
    Python path (a matrix-view program, a tensor subclass, a copy to step, a mistake it
    names), which then runs from the start."""
    mod = _table_builder()
    program = kern.program
    doms = [_NATIVE_DOMS.get(s.dom) for s in program.states]
    if mod is None or kern.plan is not None or None in doms:
        return False
    check_device(device)
    scales = {sc for sc, _ in program.quant.values()}
    names = program.state_names
    hyper_tensors, hyper_floats, hyper_slots, hyper_index, sets = hypers
    nhyper = len(program.float_hypers)
    kept = pre.__dict__.get(_CHECKED) if pre is not None else None
    checked = kept.pop(id(grads), None) if kept else None
    with on_device(device):
        hyp = _hyper_array(device, nhyper, sets, hyper_tensors, hyper_floats, hyper_slots)
        try:
            groups, counters = mod.triton_rows(  # (None: one row of hyperparameters)
                kern.native_id, params, grads, states, uniq_steps, step_index, hyp.data_ptr(),
                max(nhyper, 1) * 8, None if sets == 1 else hyper_index, doms,
                [n in program.quant for n in names], [n in scales for n in names], device,
                checked)
        except ValueError:
            return False
        finite = torch.empty((), dtype=torch.bool, device=device)
        scale_state, scale_config = _scale_args(adjust, device)
        _launch_groups(kern, [(tuple(key.split(" ")), idx, rows, aligned, numels)
                              for key, idx, rows, aligned, numels in groups],
                       params, uniq_steps, uniq_steps, finite, pre, hyp, scale_state,
                       scale_config, device, counters)
    # (the parameters' version counters: bumped by triton_rows, as an in-place torch operation
    # bumps them)
    return finite


def _hypers(kern, values, device=None) -> tuple[list, list, list, list, int]:
    """The hyperparameters of a step's tensors as ``vega::triton_step`` takes them: (0-d
    tensors, floats, each value's place among those, each tensor's set of values), and the
    number of those sets (the rows of ``_hyper_array``'s array). While dynamo traces (on
    ``device``), a number is a 0-d float64 tensor made in the graph: a float argument of the
    operator is a constant of the graph, which a new value (a torch LR scheduler's) would
    compile again, step after step."""
    hyper_tensors, hyper_floats, hyper_slots = [], [], []
    as_tensor = device is not None and torch.compiler.is_compiling()
    if isinstance(values, HyperRows):  # the table as it is: _hyper_array takes it whole
        uniq_values, hyper_index = [], values.index
        hyper_tensors.append(values.table)
        sets = values.table.shape[0]
    else:
        uniq_values, hyper_index = distinct(values)
        sets = len(uniq_values)
    for vals in uniq_values:
        for h in kern.program.float_hypers:
            v = vals[h]
            if as_tensor and not isinstance(v, torch.Tensor):
                v = torch.full((), v, dtype=torch.float64, device=device)
            if isinstance(v, torch.Tensor):
                hyper_slots.append(len(hyper_tensors))
                hyper_tensors.append(v)
            else:
                hyper_slots.append(-1 - len(hyper_floats))
                hyper_floats.append(float(v))
    return hyper_tensors, hyper_floats, hyper_slots, hyper_index, sets


def step(kern, params, grads, states, steps, values, donate, pre, adjust=None):
    """See ``vega.codegen.reference.Kernel.__call__``. ``adjust``: a dynamic ``LossScale``
    on the parameters' device, adjusted in place by this step's last launch (eagerly, in
    place, with parameters: ``Kernel.adjusts``), after ``finite_of(pre)``."""
    n, nstate = len(params), len(states)
    device = params[0].device if n else (pre.device if pre is not None else torch.device("cpu"))
    # distinct step counters and hyperparameter sets (the same object is shared by many tensors)
    uniq_steps, step_index = distinct(steps)
    hypers = _hypers(kern, values, device)
    hyper_tensors, hyper_floats, hyper_slots, hyper_index, _ = hypers
    if donate and n and not torch.compiler.is_compiling():
        finite = _native_step(kern, params, grads, states, uniq_steps, step_index, hypers, pre,
                              adjust, device)
        if finite is not False:  # (False: the tensors need the checks and copies below)
            if pre is None:
                finite = None
            elif not uniq_steps:
                finite = finite_of(pre)
            # (the lists as given, the tensors stepped in place: engine.run copies them)
            return params, states, uniq_steps if len(uniq_steps) == n else \
                [uniq_steps[k] for k in step_index], finite
    _check_all(kern, params, grads, states, uniq_steps, device)
    check_states("triton", kern.program, params, states)
    # each read as its values (resolved: no negative bit), contiguous (as they are, in the
    # common case: a pass over the flags, not a copy's call a tensor)
    flat_states = [s for col in states for s in col]
    # a parameter stored in another order than its dimensions' (channels_last), with its
    # gradient and states: stepped in place as its memory, not as contiguous copies
    aliased = memory_order(kern.program, params, grads, flat_states) \
        if donate and not torch.compiler.is_compiling() else None
    given, grads = grads, readable(grads if aliased is None else aliased[1])
    finite = torch.empty((), dtype=torch.bool, device=device)
    if donate:
        if not torch.compiler.is_compiling():  # all checked before any is written
            refuse_inplace("triton", kern.program.state_names, params, flat_states,
                           uniq_steps, given)
        src_p, src_s = (params, flat_states) if aliased is None else (aliased[0], aliased[2])
        work_p, work_s = readable(src_p), readable(src_s)
        compiling = torch.compiler.is_compiling()
        op = torch.ops.vega.triton_step if compiling else _step_impl
        scale_state, scale_config = _scale_args(adjust, device) if not compiling else ([], None)
        op(kern.key, work_p, work_s, uniq_steps, finite, grads, [], [], [], step_index,
           hyper_tensors, hyper_floats, hyper_slots, hyper_index, pre, True, scale_state,
           scale_config)
        if not compiling:  # (what the operator's dispatch does for a mutated argument)
            increment_version(work_p)
        copy_back([*src_p, *src_s], [*work_p, *work_s])
        new_p, new_s, new_t = list(params), [list(col) for col in states], uniq_steps
    else:
        old_p = readable(params)
        old_s = readable(flat_states)
        new_p = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]
        flat = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in flat_states]
        new_t = [torch.empty((), dtype=s.dtype, device=s.device) for s in uniq_steps]
        op = torch.ops.vega.triton_step if torch.compiler.is_compiling() else _step_impl
        op(kern.key, new_p, flat, new_t, finite, grads, old_p, old_s, uniq_steps, step_index,
           hyper_tensors, hyper_floats, hyper_slots, hyper_index, pre, False, [], None)
        new_s = [flat[k * n:(k + 1) * n] for k in range(nstate)]
    if pre is None:
        finite = None
    elif not uniq_steps:  # no counter to advance: the flag from the prelude's record
        finite = finite_of(pre)
    return new_p, new_s, [new_t[j] for j in step_index], finite


def staged(kern, params, grads, states, steps, values, donate, pre, views):
    """``vega.codegen.reference.Kernel.staged`` in these kernels (where
    ``Kernel.stageable``): each phase's kernels leave every tensor's partial results (a sum
    of squares, a sum, a maximum) in the reduction buffer; they are yielded (``_combined``),
    sent back combined over all processes and finished there, for the next phase and the
    update to read. In place on copies where not ``donate``."""
    n = len(params)
    device = params[0].device if n else (pre.device if pre is not None else torch.device("cpu"))
    uniq_steps, step_index = distinct(steps)
    hyper_tensors, hyper_floats, hyper_slots, hyper_index, _ = _hypers(kern, values)
    _check_all(kern, params, grads, states, uniq_steps, device)
    geos = shard_geometries("triton", params, views, kern.axes.temps) \
        if kern.plan is not None else None
    check_states("triton", kern.program, params, states, geos)
    given, grads = grads, readable(grads)
    flat = [s for col in states for s in col]
    if donate:
        refuse_inplace("triton", kern.program.state_names, params, flat, uniq_steps, given)
    else:
        params, flat = [p.clone() for p in params], [s.clone() for s in flat]
        uniq_steps = [s.clone() for s in uniq_steps]
    work_p, work_s = readable(params), readable(flat)
    finite = torch.empty((), dtype=torch.bool, device=device)
    check_device(device)
    with on_device(device):
        found, hyp = _tables(kern, work_p, work_s, grads, [], [], uniq_steps, step_index,
                             hyper_tensors, hyper_floats, hyper_slots, hyper_index, True,
                             device, geos)
    gen = _launches(kern, found, work_p, uniq_steps, uniq_steps, finite, pre, hyp, [], None,
                    device, views=views, geos=geos)
    answer = None
    while True:  # (the device made current for the launches alone, not between them)
        with on_device(device):
            try:
                parts = gen.send(answer)
            except StopIteration:
                break
        answer = yield parts
    increment_version(work_p)
    copy_back([*params, *flat], [*work_p, *work_s])
    if pre is None:
        finite = None
    elif not uniq_steps:
        finite = finite_of(pre)
    yield Done((params, [flat[k * n:(k + 1) * n] for k in range(len(states))],
                [uniq_steps[k] for k in step_index], finite))
