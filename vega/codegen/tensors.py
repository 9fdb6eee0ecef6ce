"""What a step may read and write of a tensor, shared by the backends and the runtime.

- A tensor subclass with operations of its own (``__torch_dispatch__``: DTensor, a wrapper
  such as ``TwoTensor``) holds no storage of its own that a compiled kernel could read (its
  ``data_ptr()`` is 0): only the reference backend, which steps it through its own
  operations, takes it.
- A tensor with its negative or conjugate bit set (``x.conj().imag``, ``x.conj()``) stores
  its values negated or conjugated: a kernel that reads its memory reads it resolved
  (``resolve_neg``, ``resolve_conj``), and one that writes it in place writes a resolved
  copy that is copied back (``copy_`` negates or conjugates on the way).
- A step in place writes every parameter, state and step counter: none may be an inference
  tensor outside ``torch.inference_mode()`` (as torch's in-place operations refuse), none
  may have two elements at one memory location (an expanded tensor), and no two may share
  one. These are checked before anything is written (``inplace_problem``).
"""
from __future__ import annotations

import operator
import sys

import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin

from vega.dsl.ir import QBLOCK, SCALAR_STATE

# the types of tensors with no operations of their own (a pass over types finds them)
PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
PLAIN_OR_NONE = PLAIN_TYPES | {type(None)}
_NO_DISPATCH = torch.Tensor.__torch_dispatch__
_PLAIN_TUPLE = tuple(PLAIN_TYPES)
_CPU = torch.device("cpu")  # (a device, not its name, for ``mode_tensors``: no parse a step)

# ``gather``'s flags
NO_GRAD, NOT_PLAIN, NOT_STRIDED = 1, 2, 4


def native_passes():
    """The native module, for passes over a step's lists that it makes faster, where it is
    loaded and dynamo is not tracing (which cannot trace it); else None."""
    if torch.compiler.is_compiling():
        return None
    # (found where it is imported: a module not imported is not loaded; an import statement
    # here cost about a microsecond a call, twice a group each step)
    # (its record read here, not through ``native.loaded()``: a call fewer, seven times a step)
    native = sys.modules.get("vega.codegen.c.native")
    return None if native is None else native._state["module"]


# torch.func's own queries (torch has no public one): which transforms are running and
# whether a tensor is one of their wrappers. Where a torch lacks them, no transform is seen
# (a step then refuses a wrapper as it refuses any tensor without storage)
_FUNCTORCH = getattr(torch._C, "_functorch", None)
_STACK = getattr(_FUNCTORCH, "get_interpreter_stack", None)
_PEEK = getattr(_FUNCTORCH, "peek_interpreter_stack", None)
_WRAPPED = getattr(_FUNCTORCH, "is_functorch_wrapped_tensor", None)


def transforms() -> tuple[str, ...]:
    """The ``torch.func`` transforms a call runs under, innermost last (``"Vmap"``,
    ``"Grad"``, ``"Jvp"``, ...); none while dynamo traces (which cannot trace the query)."""
    return tuple(i.key().name for i in _STACK()) if _STACK is not None and transformed() \
        else ()


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, jvp, grad) is running (``transforms``)."""
    return _PEEK is not None and not torch.compiler.is_compiling() and _PEEK() is not None


def watched() -> bool:
    """Whether torch records or transforms the operations run now (autograd, dynamo's
    tracing, a ``torch.func`` transform): a step's own writes into temporaries, into parts
    of a tensor or through native loops give way to torch's whole-tensor operations."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling() or transformed()


def wrapped(t) -> bool:
    """Whether ``t`` is a ``torch.func`` transform's wrapper (a batched or dual tensor, whose
    type is ``torch.Tensor``'s but which has no storage of its own)."""
    return _WRAPPED is not None and not torch.compiler.is_compiling() and _WRAPPED(t)


def same(a: list, b: list) -> bool:
    """Whether lists ``a`` and ``b`` hold the same objects in the same order, by identity
    (in one pass of the native module where it is loaded: about 1 ns an item, where Python's
    ``all(map(operator.is_, a, b))`` takes about 30)."""
    mod = native_passes()
    if mod is not None:
        return mod.same(a, b)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def any_complex(tensors: list) -> bool:
    """Whether some tensor of ``tensors`` is complex (in one pass of the native module where
    it is loaded and they are plain tensors)."""
    mod = native_passes()
    found = None if mod is None else mod.any_complex(tensors, _PLAIN_TUPLE)
    return any(t.is_complex() for t in tensors) if found is None else found


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor: strided (no sparse layout) and not nested."""
    return t.layout == torch.strided and not t.is_nested


def not_dense(t: torch.Tensor) -> str:
    """What a tensor that is not ``dense`` is ("sparse (torch.sparse_coo)", "a nested
    tensor"), for a message that refuses it."""
    return "a nested tensor" if t.is_nested else f"sparse ({t.layout})"


def dense_words(t: torch.Tensor) -> str:
    """What a parameter that is not ``dense`` is, for a message that refuses it."""
    return f"{not_dense(t)}; vega steps dense (strided) parameters"


def uninitialized(t) -> bool:
    """Whether ``t`` is a lazy module's parameter (or buffer) not yet initialized, whose
    shape is not known: ``torch.nn.parameter.is_lazy``'s test, written as an ``isinstance``
    that dynamo evaluates (``is_lazy``, a torch function returning a bool, broke a compiled
    graph: ``*_init`` inside ``torch.compile(fullgraph=True)`` was refused)."""
    return isinstance(t, UninitializedTensorMixin)


# a lazy module's parameter not yet initialized (``uninitialized``), refused where its shape
# is needed
LAZY_WORDS = "is uninitialized (a lazy module's, before its first forward pass)"
LAZY_LOAD_WORDS = (f"{LAZY_WORDS}, so its state cannot be checked against its shape; run a "
                   "forward pass, or load the model's state_dict (which initializes it), "
                   "before the optimizer's")


def floats(tensors: list) -> bool:
    """Whether every item of ``tensors`` is a floating-point tensor (not complex, not another
    object), in one pass of the native module where it is loaded and they are plain."""
    mod = native_passes()
    found = None if mod is None else mod.floats(tensors, _PLAIN_TUPLE)
    if found is not None:
        return found
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors)


def like(refs: list, items: list) -> bool:
    """Whether every ``refs[i]`` (tensors) is on the device of ``refs[0]`` and ``items[i]``
    is, for every i, a plain strided tensor (``PLAIN_TYPES``) of the shape of ``refs[i]``,
    on that device, complex where ``refs[i]`` is: a functional step's quick check of its
    parameters, gradients and states (about 20 ns an item in the native module where it is
    loaded). False says nothing of what differs."""
    mod = native_passes()
    if mod is not None:
        return mod.like(refs, items, _PLAIN_TUPLE)
    if len(refs) != len(items):
        return False
    if not refs:
        return True
    device = refs[0].device
    return all(type(x) in PLAIN_TYPES and dense(x) and dense(r) and not uninitialized(r)
               and x.device == device
               and r.device == device and x.is_complex() == r.is_complex()
               and x.shape == r.shape for r, x in zip(refs, items))


_FIT_DOMS = {"rc": 0, SCALAR_STATE: 4, QBLOCK: 5}


def fit(params: list, col: list, dom: str, want: int = 0) -> bool:
    """Whether every ``col[i]`` is a plain strided tensor (``PLAIN_TYPES``) on the device of
    ``params[i]`` that a kernel takes as a state of domain ``dom`` of it (its shape, one
    number, or one a block of 256 of its elements: an 8-bit state's scales, float32), of a
    dtype the compiled kernels take (``want`` 0: float32, float64, bfloat16 or float16),
    8-bit codes (1: uint8) or step counters (3: int32, of one number): the quick check of a
    step's states before its first call writes (``engine.check_call``), in one pass of the
    native module where it is loaded. False says nothing of what differs (nor, without the
    module, anything at all)."""
    mod = native_passes()
    if mod is None or dom not in _FIT_DOMS:
        return False
    return mod.fit(params, col, _PLAIN_TUPLE, _FIT_DOMS[dom], 2 if dom == QBLOCK else want)


def uniform(tensors: list) -> bool:
    """Whether every item of ``tensors`` is a plain (``PLAIN_TYPES``) dense real tensor on the
    first one's device (a fused step's gradients, in the common case: one pass, native where
    the module is loaded, where the prelude's checks took three); False while dynamo traces.
    False says nothing of what differs."""
    mod = native_passes()
    if mod is not None:
        return mod.uniform(tensors, _PLAIN_TUPLE)
    if torch.compiler.is_compiling():
        return False
    return all(type(t) in PLAIN_TYPES and dense(t) and not t.is_complex()
               and t.device == tensors[0].device for t in tensors)


def on_one_device(tensors: list) -> bool:
    """Whether every tensor of ``tensors`` is on the first one's device (in one native pass
    where it is loaded and they are plain strided tensors)."""
    mod = native_passes()
    if mod is not None and mod.like(tensors, tensors, _PLAIN_TUPLE):
        return True
    return not tensors or all(t.device == tensors[0].device for t in tensors)


def gather(params, sts, names) -> tuple[list, list[list], int]:
    """What a class step reads of a group, in one pass of the native module where it is
    loaded (``vega.codegen.c.native``: about 50 ns a parameter with three state tensors,
    where the same passes in Python take about 490 ns): (each parameter's gradient, as
    ``p.grad`` reads it; for each of ``names``, the list of ``st[name]`` over the state
    dicts ``sts``; flags: ``NO_GRAD``, some gradient is None; ``NOT_PLAIN``, some gradient
    or state is not a plain tensor (``PLAIN_TYPES``); ``NOT_STRIDED``, some gradient is
    sparse or of another layout).
    KeyError where a state dict lacks a name."""
    mod = native_passes()
    got = None if mod is None else mod.gather(params, sts, names, _PLAIN_TUPLE)
    if got is not None:  # (None: a parameter or a state dict it leaves to this path)
        return got
    grads = [p.grad for p in params]
    cols = [[st[n] for st in sts] for n in names]
    present = [g for g in grads if g is not None]
    flags = (NO_GRAD if len(present) < len(grads) else 0) | \
        (0 if PLAIN_TYPES.issuperset(map(type, present)) and
         all(PLAIN_TYPES.issuperset(map(type, col)) for col in cols) else NOT_PLAIN) | \
        (NOT_STRIDED if any(g.layout != torch.strided for g in present) else 0)
    return grads, cols, flags


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (asked only where torch's DTensor module is loaded: no
    DTensor exists before)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def has_own_ops(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass with operations of its own (``__torch_dispatch__``)."""
    cls = type(t)
    return cls not in PLAIN_TYPES and \
        getattr(cls, "__torch_dispatch__", _NO_DISPATCH) is not _NO_DISPATCH


def first_with_own_ops(tensors) -> int | None:
    """The position of the first tensor with operations of its own (``has_own_ops``), or None
    (one pass over the types, in the common case of plain tensors and parameters). ``None``
    items are skipped."""
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    if PLAIN_OR_NONE.issuperset(map(type, tensors)):
        return None
    return next((i for i, t in enumerate(tensors)
                 if t is not None and has_own_ops(t)), None)


def own_ops_words(t: torch.Tensor) -> str:
    """What is wrong with a tensor ``has_own_ops`` finds, for a compiled backend's message."""
    return (f"is a {type(t).__name__}, a tensor subclass with operations of its own, whose "
            f"storage vega's compiled kernels cannot read")


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values as stored: itself, or a copy without the conjugate and negative
    bits (asked by resolving, which returns ``t`` itself where neither is set: dynamo
    cannot trace ``is_conj()``)."""
    return t.resolve_conj().resolve_neg()


def readable(tensors: list) -> list:
    """Each tensor as a compiled kernel reads it: itself where it is contiguous and holds its
    values as they are (no negative or conjugate bit; one pass over the flags, the common
    case), else a contiguous copy of its values (``resolved``). Under dynamo, each resolved
    (it traces no flag)."""
    if not torch.compiler.is_compiling() and all(map(torch.Tensor.is_contiguous, tensors)) \
            and not any(map(torch.Tensor.is_neg, tensors)) \
            and not any(map(torch.Tensor.is_conj, tensors)):
        return list(tensors)
    return [resolved(t).contiguous() for t in tensors]


def dense_run(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one run of memory, each once, in some order of its
    dimensions (a contiguous tensor, a channels_last one, a transposed one; not a slice,
    not an expanded one)."""
    extent = 1  # the elements the inner dimensions fill
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride != extent:
            return False
        extent *= size
    return True


def as_runs(tensors: list) -> list | None:
    """``tensors`` with each plain one stored densely in another order than its dimensions'
    (``dense_run``) as a 1-d alias of its memory, for a pass that reads every element once
    in any order (a sum of squares, a count of non-finite values); None where none is."""
    out, changed = list(tensors), False
    for i, t in enumerate(tensors):
        if type(t) in PLAIN_TYPES and not t.is_contiguous() and dense_run(t):
            out[i] = t.as_strided((t.numel(),), (1,))
            changed = True
    return out if changed else None


def in_memory_order(program) -> bool:
    """Whether ``program`` may step a parameter's tensors as the runs of memory they are
    (``memory_order``): each value is its element's alone (no matrix view, no row or column
    state, no ``size(p, k)``, no matrices), or a tensor's sum over all its elements, which
    the order does not change but for rounding; not 8-bit states (their scales cover blocks
    of 256 elements in the parameter's order), stochastic rounding (its random bits are
    drawn by the element's place) or sums over a group (a step in stages)."""
    return not (program.uses_axes or program.quant or program.rounding is not None
                or program.needs_whole or program.torch_only or program.spans_group)


def like_layout(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A new state ``x`` of parameter ``p``, of its shape, in ``p``'s layout where ``p`` is
    dense in another order than its dimensions' (a channels_last convolution's weight, a
    transposed one), as ``torch.zeros_like`` makes torch.optim's: its values in ``x``'s
    dtype, a tensor of its own (``memory_order`` then steps the three without copies)."""
    if x.shape != p.shape or p.is_contiguous() or not dense_run(p):
        return x.clone(memory_format=torch.contiguous_format)  # (stride 0 kept by contiguous())
    return torch.empty_like(p, dtype=x.dtype).copy_(x)


def memory_order(program, params: list, grads: list, flat_states: list):
    """(params, grads, flat_states) of a step (``flat_states``: each state's tensors, one
    state after another) with each parameter stored in another order than its dimensions',
    densely, read as the run of memory it is: a 1-d alias of its memory, and so its
    gradient and its states shaped like it, where all have its strides (a channels_last
    convolution's weight, its gradient and states made by ``like_layout``). Element i of
    each alias is then the same element of each tensor, which an element-wise step
    (``in_memory_order``) steps in place without copies. None where nothing changes, or a
    parameter stored in another order is not so (its gradient in another layout): the
    caller steps contiguous copies."""
    if not in_memory_order(program):
        return None
    n = len(params)
    rc = [k for k, st in enumerate(program.states) if st.dom == "rc"]
    params, grads, flat_states = list(params), list(grads), list(flat_states)
    changed = False
    for i, p in enumerate(params):
        if type(p) not in PLAIN_TYPES or p.is_contiguous():
            continue
        g = grads[i]
        if not dense_run(p) or type(g) not in PLAIN_TYPES:
            return None
        shape, strides = p.shape, p.stride()
        of = [g, *(flat_states[k * n + i] for k in rc)]
        if not all(type(t) in PLAIN_TYPES and t.shape == shape and t.stride() == strides
                   for t in of):
            return None
        line = (p.numel(),)
        params[i] = p.as_strided(line, (1,))
        grads[i] = g.as_strided(line, (1,))
        for k in rc:
            t = flat_states[k * n + i]
            flat_states[k * n + i] = t.as_strided(line, (1,))
        changed = True
    return (params, grads, flat_states) if changed else None


def copy_back(originals, works) -> None:
    """The values a kernel wrote into ``works`` (``readable``'s copies, or the tensors
    themselves) into ``originals``."""
    for orig, work in zip(originals, works):
        if work is not orig:
            orig.copy_(work)


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location (an expanded tensor, a
    stride-0 axis of length > 1, or any other overlapping layout)."""
    if t.numel() < 2 or t.is_contiguous():
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    extent = 1  # elements each axis leaves room for, inner axes first
    for st, sz in dims:
        if st < extent:
            break
        extent += (sz - 1) * st
    else:
        return False
    if dims[0][0] == 0:
        return True
    return _offsets(t).unique().numel() != t.numel()  # some unusual layout: every element


def _offsets(t: torch.Tensor) -> torch.Tensor:
    """The offset in elements from ``t.data_ptr()`` of every element of ``t``."""
    at = torch.zeros((), dtype=torch.int64, device="cpu")  # (whatever the default device)
    for sz, st in zip(t.shape, t.stride()):
        at = at.unsqueeze(-1) + torch.arange(sz, dtype=torch.int64, device="cpu") * st
    return at.reshape(-1)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that ``t``'s elements lie within (0, 0 when it has none)."""
    lo = t.data_ptr()
    if t.numel() == 0 or lo == 0:
        return 0, 0
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def inference_outside(t: torch.Tensor) -> bool:
    """Whether ``t`` is an inference tensor and this is not inside inference mode."""
    return t.is_inference() and not torch.is_inference_mode_enabled()


INFERENCE_WORDS = ("is an inference tensor (made under torch.inference_mode()), which a step "
                   "in place cannot update outside inference mode (torch: \"Inplace update "
                   "to inference tensor outside InferenceMode is not allowed\"); clone it, "
                   "or step inside torch.inference_mode()")
FAKE_MODE_WORDS = ("is a real tensor, and a {mode} is active, whose operations make "
                   "{made}s of real ones: a step in place there would write none of it "
                   "(and keep {made} states); step outside the mode, or give it {made}s")


def mode_tensors() -> type | None:
    """The class of the tensors that the active dispatch modes make in place of real ones
    (``FakeTensor`` under a ``FakeTensorMode``, which with ``allow_non_fake_inputs=True``
    takes real tensors in and gives fake ones out; ``FunctionalTensor`` under non-strict
    export's mode), or None where they make plain tensors, and while dynamo traces (the
    fake implementations of vega's ops run there). Asked through torch's public API, by
    making an empty tensor (some 2 microseconds)."""
    if torch.compiler.is_compiling():
        return None
    made = type(torch.empty(0, device=_CPU))
    return None if made is torch.Tensor else made


def mode_words(made: type) -> dict[str, str]:
    """The names of ``made`` (``mode_tensors``'s class) and of the mode that makes it, for
    a refusal's words: ``FakeTensor`` and ``FakeTensorMode``, ``FunctionalTensor`` and
    ``FunctionalTensorMode``; another's (a mode of the user's) as "dispatch mode"."""
    name = made.__name__
    known = name in ("FakeTensor", "FunctionalTensor")
    return {"made": name, "mode": f"{name}Mode" if known else "dispatch mode"}


def first_real(tensors, made: type) -> int | None:
    """The position of the first tensor of ``tensors`` that is not of the class ``made``
    (``mode_tensors``: a real tensor beside a mode's), or None."""
    return next((i for i, t in enumerate(tensors)
                 if isinstance(t, torch.Tensor) and not isinstance(t, made)), None)


OVERLAP_WORDS = ("has elements at one memory location (an expanded tensor, a stride 0): a "
                 "step in place cannot write it; pass a contiguous copy (.contiguous())")
SHARE_WORDS = "shares memory with {other}: a step in place would write that memory twice"
MISSING_WORDS = ("is not a tensor (None, or another object, where the step writes one); "
                 "a state entry set by hand must be a tensor")
NOT_DENSE_WORDS = "is {what}; a step in place writes dense (strided) tensors"


def inplace_problem(tensors, reads=()) -> tuple[int, int | None, str] | None:
    """The first problem a step in place would meet writing all of ``tensors`` (None where
    there is none): (position, another position or None, a ``*_WORDS`` text, where ``{other}``
    stands for the other's name); and reading ``reads`` (the gradients: a position among
    them is ``len(tensors)`` and on) after it has written a tensor that shares memory with
    one. Where the C backend's native operator is built, one call of it answers for
    contiguous tensors (the common case)."""
    tensors = tensors if isinstance(tensors, list) else list(tensors)
    reads = reads if isinstance(reads, list) else list(reads)
    made = mode_tensors()
    if made is not None:
        real = first_real(tensors, made)
        if real is not None:
            return real, None, FAKE_MODE_WORDS.format(**mode_words(made))
    if not torch.compiler.is_compiling():
        from vega.codegen.c import native  # (the C backend imports this module)
        mod = native.module()
        try:
            if mod is not None and mod.writable(tensors, reads or None):
                return None
        except TypeError:  # (an object not a tensor: named below)
            pass
    spans = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            return i, None, MISSING_WORDS
        if not dense(t):  # (no strides, nor memory of its own, to write)
            return i, None, NOT_DENSE_WORDS.format(what=not_dense(t))
        if inference_outside(t):
            return i, None, INFERENCE_WORDS
        if overlaps_itself(t):
            return i, None, OVERLAP_WORDS
        spans.append(_span(t))
    lo = np.array([s[0] for s in spans], dtype=np.int64)
    hi = np.array([s[1] for s in spans], dtype=np.int64)
    pair = shared_pair(tensors, lo, hi)
    if pair is not None or not reads:
        return pair
    found = read_written_pair(tensors, reads, lo, hi)
    return None if found is None else (len(tensors) + found[0], found[1], READ_SHARE_WORDS)


def sorted_spans(lo: np.ndarray, hi: np.ndarray):
    """The spans ``[lo, hi)`` that hold an element, by their starts: (their positions, their
    starts, how far those up to each reach), for ``meeting``."""
    keep = np.flatnonzero(hi > lo)
    order = keep[np.argsort(lo[keep], kind="stable")]
    return order, lo[order], np.maximum.accumulate(hi[order]) if len(order) else hi[:0]


def meeting(starts: np.ndarray, reach: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """For each span ``[lo, hi)``, the range ``[first, last)`` of the sorted spans
    (``sorted_spans``) it may meet: those that start before it ends, from the first whose
    span or one before it reaches past its start; it meets one where ``last > first`` (and
    it holds an element: an empty one's range is empty)."""
    first = np.searchsorted(reach, lo, side="right")
    last = np.where(hi > lo, np.searchsorted(starts, hi, side="left"), 0)
    return first, last


READ_SHARE_WORDS = ("shares memory with {other}, which the step writes: a step in place could "
                    "read it after writing there; give a copy (p.grad = g.clone())")


def read_written_pair(written, reads, lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    """(a position in ``reads``, one in ``written``) of a read tensor and a written one that
    share an element's memory (None where none do), by the written ones' spans ``[lo, hi)``
    (none of which meet): each read span is looked up among them (sorted by their starts),
    and spans that meet are compared as ``_cluster_pair`` compares them."""
    at = [k for k, t in enumerate(reads) if isinstance(t, torch.Tensor) and dense(t)]
    if not at or not len(lo):
        return None
    spans = np.array([_span(reads[k]) for k in at], dtype=np.int64).reshape(-1, 2)
    order, starts, reach = sorted_spans(lo, hi)
    first, last = meeting(starts, reach, spans[:, 0], spans[:, 1])
    for r in np.flatnonzero(last > first):
        for w in order[first[r]:last[r]]:
            if _cluster_pair([written[w], reads[at[r]]], [0, 1],
                             np.array([lo[w], spans[r, 0]]),
                             np.array([hi[w], spans[r, 1]])) is not None:
                return at[r], int(w)
    return None


def roles(state_names, n: int, nsteps: int) -> list[str]:
    """What each tensor a kernel's step in place writes is, for a message: the ``n``
    parameters, then each state's (flat, state by state), then the ``nsteps`` counters."""
    return [*(f"parameter {i}" for i in range(n)),
            *(f"state '{s}' of parameter {i}" for s in state_names for i in range(n)),
            *(f"step counter {k}" for k in range(nsteps))]


def refuse_inplace(backend: str, state_names, params, flat_states, steps, grads=()) -> None:
    """Raise ValueError where a kernel's step in place cannot write these parameters, states
    (flat, state by state) and step counters, or read ``grads`` (``inplace_problem``)."""
    problem = inplace_problem([*params, *flat_states, *steps], grads)
    if problem is not None:
        i, j, words = problem
        named = roles(state_names, len(params), len(steps)) + \
            [f"the gradient of parameter {k}" for k in range(len(grads))]
        raise ValueError(f"backend '{backend}': {named[i]} "
                         f"{words.format(other=named[j]) if j is not None else words}")


def shared_pair(tensors, lo: np.ndarray, hi: np.ndarray) -> tuple[int, int, str] | None:
    """Two tensors that share a memory location, by their spans ``[lo, hi)`` (empty where
    ``hi <= lo``: no element, or no storage to read): where spans meet, contiguous tensors
    share memory; others (views of one matrix's columns) are compared element by element."""
    keep = np.flatnonzero(hi > lo)
    if len(keep) < 2:
        return None
    order = keep[np.argsort(lo[keep], kind="stable")]
    reach = np.maximum.accumulate(hi[order])
    meets = lo[order[1:]] < reach[:-1]  # order[k + 1] meets a span before it
    if not meets.any():  # (the common case)
        return None
    found = []
    k = 0
    while k < len(meets):  # each run of spans that meet: a cluster
        if not meets[k]:
            k += 1
            continue
        end = k
        while end < len(meets) and meets[end]:
            end += 1
        pair = _cluster_pair(tensors, [int(i) for i in order[k:end + 1]], lo, hi)
        if pair is not None:
            found.append(pair)
        k = end
    if not found:
        return None
    a, b = min(found, key=lambda ab: (max(ab), min(ab)))
    return max(a, b), min(a, b), SHARE_WORDS


def _cluster_pair(tensors, members: list[int], lo, hi) -> tuple[int, int] | None:
    """Two of ``members`` (spans that meet, by ``lo``) that share an element's memory."""
    ts = [tensors[i] for i in members]
    if all(t.is_contiguous() for t in ts):
        for k in range(1, len(members)):  # the first whose span meets one before it
            j = members[k]
            i = next(i for i in members[:k] if hi[i] > lo[j])
            return i, j
    size = ts[0].element_size()
    base = ts[0].data_ptr()
    if any(t.element_size() != size or (t.data_ptr() - base) % size for t in ts):
        j = members[1]  # (views of one memory as several dtypes: taken as shared)
        return members[0], j
    at = torch.cat([_offsets(t) + (t.data_ptr() - base) // size for t in ts])
    who = torch.cat([torch.full((t.numel(),), k, dtype=torch.int64, device="cpu")
                     for k, t in enumerate(ts)])
    at, order = torch.sort(at, stable=True)
    who = who[order]
    same = torch.nonzero(at[1:] == at[:-1]).reshape(-1)
    if same.numel() == 0:
        return None
    k = int(same[0])
    return members[int(who[k])], members[int(who[k + 1])]
