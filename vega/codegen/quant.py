"""8-bit blockwise state: each state asked for in ``torch.uint8`` keeps one code (a byte)
a value and one float32 scale per block of 256 values, the block's largest magnitude
(absmax). Every backend does it alike.

A state ``mu`` quantized so is a program transformation (``variant``): the program gains
a state ``mu_absmax`` of domain ``QBLOCK`` (one value per block of ``BLOCK`` values; the
last block of a tensor may be short, blocks never straddle tensors) and a map, kept in
``Program.quant``: ``{"mu": ("mu_absmax", signed)}``. The kernels read the code of each
value and its block's scale, compute in float32 as for any state, and write the new codes
and scales in the same pass (the C kernels go through a tensor's values a block at a time).

The maps (``y``: the value over its block's absmax, in [-1, 1]):

- **signed** (a state that may be negative, Adam's first moment): the square-root map,
  ``code = 127 + rint(127 * sign(y) * sqrt(|y|))`` in [0, 254], and back
  ``t = (code - 127) * r``, ``value = t * |t| * absmax`` (``r``: 1 / 127 in float32).
  Steps of 1.6 % of the absmax near it; the smallest value kept is 6.2e-5 of the absmax
  (smaller ones, below 1.6e-5 of it, are kept as 0).
- **unsigned** (a state the spec keeps non-negative, ``nonnegative``: Adam's second
  moment): the fourth-root map, ``code = rint(255 * sqrt(sqrt(y)))`` in [0, 255], and
  back ``t = code * r``, ``value = (t * t) * (t * t) * absmax`` (``r``: 1 / 255 in
  float32). The smallest value kept is 2.4e-10 of the absmax (of a second moment's square
  root, the denominator, 1.5e-5): a small gradient beside a large one in its block does
  not divide by ``eps`` alone.

``y`` is formed as ``x * (1 / absmax)`` in float32 (0 where the absmax is not positive, or
where ``x * (1 / absmax)`` is a NaN); in a block whose absmax is subnormal, as
``(x * 2^32) * (1 / (absmax * 2^32))`` (``TINY``), the same number where ``1 / absmax`` is
finite, where below about 2.9e-39 it is not. A NaN in a block makes its absmax a NaN, and
so every value of the block reads back as NaN: a NaN is never lost.
"""
from __future__ import annotations

import math

import torch

from vega.codegen.precision import MASTER
from vega.codegen.tensors import is_dtensor
from vega.dsl import ir
from vega.dsl.ir import QBLOCK, Kind, Op, Program, StateVar

BLOCK = 256  # values a scale
MIN_NUMEL = 4096  # a smaller tensor keeps its 8-bit states in float32
SUFFIX = "_absmax"
# Which map each 8-bit state's codes are read with, as a number that a state file and a
# state dict record beside their codes: 1, every state the signed map; 2, the unsigned map
# for a state ``nonnegative`` proves so; 3, that proof taking a bias correction ``1 - b ^
# t`` as non-negative. Codes written under another number may be read here with the other
# map, as other values, so they are refused (``vega.load``, ``load_state_dict``): a change
# to ``nonnegative``, to the maps or to the IR a proof reads raises it.
MAPS = 3
# The values quantize_t and dequantize_t take at a time (a multiple of BLOCK): their
# temporaries, some ten float32 tensors the size of their input, were 36 bytes a value for
# each 8-bit state at init (72 GB for AdamW's two states of a parameter of 2**31 values;
# the states are 4 GB).
QUANT_CHUNK = 2**22
# A block whose absmax is subnormal (under TINY, 2^-126, float32's smallest normal number)
# has its values and absmax taken times TINY_UP (2^32) before y is formed: 1 / absmax
# overflows to inf below about 2.9e-39, and every value of such a block was read as the
# block's largest. Both products are exact (a power of two, no overflow), so y is the same
# float32 number as x * (1 / absmax) wherever that reciprocal is finite.
TINY = 2.0**-126
TINY_UP = 2.0**32


def variant(program: Program, names: frozenset[str]) -> Program:
    """``program`` with the states ``names`` kept in 8 bits (each with its scale state);
    itself where ``names`` is empty. Made once per (program, names). A name the program
    has no state of asks nothing of it: Muon's AdamW moments named (``{"mu": torch.uint8,
    "nu": torch.uint8}``) leave its matrices' program, which keeps only ``buf``, as it is
    (it was refused, for states it does not have); every state (``"*"``) is refused for a
    program over a matrix view, whichever states it has."""
    every = "*" in names
    if every or any(n.startswith("!") for n in names):
        names = _resolved(program, names)
    names = names & frozenset(program.state_names)
    if (names or every) and (program.uses_axes or program.torch_only):
        raise ValueError(f"{program.name}: 8-bit state (state_dtype torch.uint8) is kept for "
                         "programs of values one per element; this one has row, column or "
                         "matrix values: keep its states in a float dtype")
    if not names:
        return program
    key = ("q8", names)
    found = program.variants.get(key)
    if found is not None:
        return found
    quant, states, updates = {}, list(program.states), list(program.updates)
    for st in program.states:
        if st.name not in names:
            continue
        if st.dom != "rc":
            raise ValueError(f"{program.name}: state '{st.name}' is one number per tensor; "
                             "only states shaped like the parameter are kept in 8 bits")
        scale = st.name + SUFFIX
        if scale in program.state_names:
            raise ValueError(f"{program.name}: 8-bit state '{st.name}' keeps its scales in a "
                             f"state named '{scale}', but the spec declares one of that name")
        quant[st.name] = (scale, not nonnegative(program, st.name))  # (scale, signed)
        states.append(StateVar(scale, ir.const(0.0), None, QBLOCK))
        # the kernels write the scales beside the codes; as a value, a scale is its own
        updates.append((scale, ir.leaf(Op.STATE, Kind.ELEMENT, arg=scale, dom=QBLOCK)))
    out = Program(program.name, program.hypers, program.flags, tuple(states), tuple(updates),
                  program.shapes, program.modes)
    for attr in ("master", "rounding"):
        object.__setattr__(out, attr, getattr(program, attr))
    object.__setattr__(out, "quant", quant)
    return program.variants.setdefault(key, out)  # (one for two threads: as ``precision``)


def _resolved(program: Program, names: frozenset[str]) -> frozenset[str]:
    """``names`` with ``"*"`` standing for every state shaped like the parameter that does
    not start from it (a master copy, schedule-free's ``z``, Prodigy's ``p0``: copies of
    the weights, which 8 bits would blur), and ``"!x"`` taking ``x`` out (a state a class
    made in float before)."""
    out = {n for n in names if n != "*" and not n.startswith("!")}
    if "*" in names:
        out |= {s.name for s in program.states if s.dom == "rc"
                and not (program.master and s.name == MASTER) and not weight_copy(s)}
    return frozenset(out - {n[1:] for n in names if n.startswith("!")})


def weight_copy(state) -> bool:
    """Whether ``state`` (a program's, shaped like its parameter) starts from the parameter:
    a copy of the weights (schedule-free's ``z``, Prodigy's ``p0``), which a state dtype of
    fewer bits than the parameter's would blur."""
    return state.dom == "rc" and any(n.op is Op.PARAM for n in ir.walk([state.init]))


def scale_names(program: Program) -> frozenset[str]:
    """The scale states of ``program``'s 8-bit states."""
    return frozenset(s for s, _ in program.quant.values())


def nonnegative(program: Program, name: str) -> bool:
    """Whether state ``name`` of ``program`` is never negative: its initial value is not,
    and its new value is not wherever its old value is not (a proof over the expression,
    with the hyperparameters' declared ranges: ``b2 * nu + (1 - b2) * g * g``)."""
    hypers = {h.name: h for h in program.hypers}
    memo: dict[int, bool] = {}

    def lo(h) -> float:
        r = hypers[h].range if h in hypers else None
        return r.lo if r is not None else float("-inf")

    def hi(h) -> float:
        r = hypers[h].range if h in hypers else None
        return r.hi if r is not None else float("inf")

    def nn(node) -> bool:  # provably >= 0 (or a NaN)
        known = memo.get(id(node))
        if known is not None:
            return known
        op, src = node.op, node.src
        if op is Op.CONST:
            out = not isinstance(node.arg, bool) and node.arg >= 0
        elif op is Op.HYPER:
            out = lo(node.arg) >= 0
        elif op is Op.T:
            out = True
        elif op is Op.STATE:
            out = node.arg == name
        elif op in (Op.ABS, Op.SQRT, Op.RSQRT, Op.EXP, Op.SIGMOID, Op.NORM, Op.AMAX):
            out = op is not Op.AMAX or nn(src[0])
        elif op in (Op.ADD, Op.DIV, Op.MIN):
            out = all(nn(s) for s in src)
        elif op is Op.MUL:  # each factor not known >= 0 an even number of times: (1-b2)*g*g
            counts: dict[int, int] = {}
            for f in factors(node):
                if not nn(f):
                    counts[id(f)] = counts.get(id(f), 0) + 1
            out = all(c % 2 == 0 for c in counts.values())
        elif op is Op.MAX:
            out = any(nn(s) for s in src)
        elif op is Op.WHERE:
            out = nn(src[1]) and nn(src[2])
        elif op is Op.SUB:  # c - h with h at most c: 1 - b2; c - h ^ x, h in [0, 1], c >= 1
            a, b = src    # and x >= 0: a bias correction 1 - b2 ^ t
            out = a.op is Op.CONST and (
                (b.op is Op.HYPER and hi(b.arg) <= a.arg)
                or (b.op is Op.POW and b.src[0].op is Op.HYPER and a.arg >= 1
                    and lo(b.src[0].arg) >= 0 and hi(b.src[0].arg) <= 1 and nn(b.src[1])))
        elif op is Op.POW:
            out = nn(src[0])
        elif op in (Op.SUM, Op.MEAN, Op.ROUND, Op.FLOOR, Op.WIDEN, Op.BF16):
            out = nn(src[0])
        else:
            out = False
        memo[id(node)] = out
        return out

    def factors(node) -> list:
        return [f for s in node.src for f in (factors(s) if s.op is Op.MUL else [s])]

    state = next(s for s in program.states if s.name == name)
    new = dict(program.updates).get(name)
    return nn(state.init) and (new is None or nn(new))


# -- the maps, on torch tensors (the reference; the C and Triton kernels do the same
# float32 operations in the same order) ---------------------------------------------------

def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


# -- a DTensor's 8-bit state (FSDP2, tensor parallel) ----------------------------------------
# Each shard of a DTensor parameter is stepped as a tensor of its own, so its blocks start at
# the shard's first value. The codes are a DTensor placed as the parameter. The scales are a
# DTensor of shape (shards, m): one row per shard of the parameter (``Shard(0)`` over each
# mesh dimension that shards it, ``Replicate`` over the others), m the blocks of the largest
# shard; a rank's row holds its shard's scales first, then zeros. A checkpoint of them
# resumes on the same layout: loaded on another (other shards, other rows), the shapes differ.

def scale_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the scales of an 8-bit state of parameter ``p``: one per block, or for a
    DTensor, (its shards, the blocks of its largest shard)."""
    if not is_dtensor(p):
        return (blocks(p.numel()),)
    sizes, shards = list(p.shape), 1
    for dim, pl in enumerate(p.placements):
        if pl.is_shard():  # (torch.chunk's sizes: the first shard is the largest)
            k = p.device_mesh.size(dim)
            axis = pl.dim % p.dim()
            sizes[axis] = -(-sizes[axis] // k)
            shards *= k
    return (shards, blocks(math.prod(sizes)))


def scale_placements(p) -> tuple:
    """The placements of the scales of DTensor ``p``'s 8-bit states (``scale_shape``)."""
    from torch.distributed.tensor import Replicate, Shard
    return tuple(Shard(0) if pl.is_shard() else Replicate() for pl in p.placements)


# the key of a state dict's group that holds, for each of its parameters, how the shards
# of its 8-bit states were cut (``shard_layout``; None: no 8-bit DTensor state)
LAYOUT_KEY = "vega_q8_shards"


def shard_layout(p) -> str:
    """How the shards of DTensor ``p`` are cut, which the rows of its 8-bit scales follow
    (``scale_shape``): each mesh dimension of more than one rank that splits it, in the
    mesh's order ("Shard(dim=0) over 4"; replicated dimensions leave the shards as they
    are); "" for a plain tensor, or a DTensor split nowhere. Under two layouts of one
    description each row of the scales holds the blocks of the same shard."""
    if not is_dtensor(p):
        return ""
    from torch.distributed.tensor import Shard
    parts = []
    for dim, pl in enumerate(p.placements):
        k = p.device_mesh.size(dim)
        if pl.is_shard() and k > 1:
            shown = f"Shard(dim={pl.dim % p.dim()})" if type(pl) is Shard else repr(pl)
            parts.append(f"{shown} over {k}")
    return ", ".join(parts)


def shard_scales(local: torch.Tensor, numel: int) -> torch.Tensor:
    """A rank's scales of its shard of ``numel`` values: the first blocks of its row
    (``local``, the scales' local tensor: a view the kernels write through)."""
    return local.reshape(-1)[:blocks(numel)]


def scales_of(scales: torch.Tensor, like) -> torch.Tensor:
    """``scales``, one rank's scales of its shard of DTensor ``like`` (its parameter or a
    state placed as it), as the DTensor of ``scale_shape``; ``scales`` itself where
    ``like`` is a plain tensor."""
    if not is_dtensor(like):
        return scales
    from torch.distributed.tensor import DTensor
    shape = scale_shape(like)
    if scales.numel() > shape[1]:
        raise ValueError(f"a shard's {scales.numel()} blocks exceed the {shape[1]} of the "
                         f"largest shard of a tensor of shape {tuple(like.shape)} placed "
                         f"{tuple(like.placements)}")
    row = scales.new_zeros(1, shape[1])
    row[0, :scales.numel()] = scales.reshape(-1)
    return DTensor.from_local(row, like.device_mesh, scale_placements(like), run_check=False,
                              shape=torch.Size(shape), stride=(shape[1], 1))


def any_negative(scales: torch.Tensor) -> bool:
    """Whether floating-point 8-bit scales hold a negative value, which a scale (a block's
    largest magnitude) cannot: it would turn its block's values over. A NaN or infinite one
    is what a step leaves where its block held one. Read on the host, for loading (a
    DTensor's local shard; a meta tensor has no values)."""
    if is_dtensor(scales):
        scales = scales.to_local()
    return scales.device.type != "meta" and bool((scales < 0).any())


def like_codes(values: torch.Tensor) -> bool:
    """Whether float ``values`` could be 8-bit codes cast to a float: whole numbers from 0
    to 255, not all 0 (a state of zeros reads as zeros either way: the unsigned map's code
    0 is 0). A float state rarely is: its group's ``state_dtype``, set to torch.uint8 after
    the state was made, does not make it codes. Read on the host, for loading (a DTensor's
    local shard; a meta tensor has no values)."""
    if is_dtensor(values):
        values = values.to_local()
    if values.device.type == "meta" or not values.is_floating_point():
        return False
    return bool(((values >= 0) & (values <= 255) & (values == values.round())).all()
                and (values != 0).any())


def absmax_t(x: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude (float32, NaN where the block holds one)."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    pad = blocks(n) * BLOCK - n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.abs().reshape(-1, BLOCK).amax(dim=1)


def _per_value(scale: torch.Tensor, numel: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK)[:numel]


def quantize_t(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes: uint8 shaped like ``x``, scales: float32 one per block) of float ``x``. A
    DTensor's on each rank's shard (``scale_shape``). A tensor of more than QUANT_CHUNK
    values is quantized that many at a time (whole blocks: the same codes and scales),
    outside a compiled graph."""
    if is_dtensor(x):
        from torch.distributed.tensor import DTensor
        codes, scale = quantize_t(x.to_local(), signed)
        return (DTensor.from_local(codes, x.device_mesh, x.placements, run_check=False,
                                   shape=x.shape, stride=x.stride()), scales_of(scale, x))
    n = x.numel()
    if n <= QUANT_CHUNK or torch.compiler.is_compiling():
        codes, scale = _quantize(x, signed)
        return codes.reshape(x.shape), scale
    flat = x.reshape(-1)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    scale = torch.empty(blocks(n), dtype=torch.float32, device=x.device)
    for a in range(0, n, QUANT_CHUNK):
        b = min(n, a + QUANT_CHUNK)
        codes[a:b], scale[a // BLOCK:blocks(b)] = _quantize(flat[a:b], signed)
    return codes.reshape(x.shape), scale


def _quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat codes, scales) of ``x`` (quantize_t's, at once)."""
    scale = absmax_t(x)
    flat = x.reshape(-1).to(torch.float32)
    # a subnormal block is taken times TINY_UP first (exactly), so that 1 / absmax is finite
    up = torch.where(scale < TINY, torch.full_like(scale, TINY_UP), torch.ones_like(scale))
    big = scale * up
    inv = torch.where(big > 0, torch.ones_like(big) / big, torch.zeros_like(big))
    y = (flat * _per_value(up, flat.numel())) * _per_value(inv, flat.numel())
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    if signed:
        y = y.clamp(-1.0, 1.0)
        c = torch.round(torch.sign(y) * torch.sqrt(y.abs()) * 127.0) + 127.0
    else:
        y = y.clamp(0.0, 1.0)
        c = torch.round(torch.sqrt(torch.sqrt(y)) * 255.0)
    return c.to(torch.uint8), scale


def dequantize_t(codes: torch.Tensor, scale: torch.Tensor, signed: bool,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float values of ``codes`` with their blocks' ``scale`` (``quantize_t``). A
    DTensor's on each rank's shard. QUANT_CHUNK values at a time, as quantize_t."""
    if is_dtensor(codes):
        from torch.distributed.tensor import DTensor
        local = codes.to_local()
        if not is_dtensor(scale) or tuple(scale.shape) != scale_shape(codes):
            raise ValueError(f"the scales of 8-bit codes of shape {tuple(codes.shape)} placed "
                             f"{tuple(codes.placements)} are a DTensor of shape "
                             f"{scale_shape(codes)}, got {type(scale).__name__} of shape "
                             f"{tuple(scale.shape)}")
        values = dequantize_t(local, shard_scales(scale.to_local(), local.numel()), signed,
                              dtype)
        return DTensor.from_local(values, codes.device_mesh, codes.placements,
                                  run_check=False, shape=codes.shape, stride=codes.stride())
    n = codes.numel()
    if n <= QUANT_CHUNK or torch.compiler.is_compiling():
        return _dequantize(codes, scale, signed).reshape(codes.shape).to(dtype)
    flat = codes.reshape(-1)  # (QUANT_CHUNK values at a time, as quantize_t)
    out = torch.empty(n, dtype=dtype, device=codes.device)
    for a in range(0, n, QUANT_CHUNK):
        b = min(n, a + QUANT_CHUNK)
        out[a:b] = _dequantize(flat[a:b], scale[a // BLOCK:blocks(b)], signed).to(dtype)
    return out.reshape(codes.shape)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The flat float32 values of ``codes`` (dequantize_t's, at once)."""
    c = codes.reshape(-1).to(torch.float32)
    if signed:  # (times the float32 reciprocal: as fast as a product, on every backend)
        t = (c - 127.0) * (1.0 / 127.0)
        v = t * t.abs()
    else:
        t = c * (1.0 / 255.0)
        v = (t * t) * (t * t)
    return v * _per_value(scale.to(torch.float32), c.numel())


C_HELPERS = r"""
/* 8-bit blockwise state (vega.codegen.quant): codes and one float32 absmax a block */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8 \
    && (defined(__x86_64__) || defined(__i386__))
/* the update of 8-bit state is bound by arithmetic, not memory: with AVX-512, it took
   about 0.9x the time in gcc's 512-bit vectors as in its default 256-bit ones (an x86
   option: gcc for other CPUs refuses it) */
#pragma GCC target("prefer-vector-width=512")
#endif
#define QBLOCK 256
static inline float q8_signed(uint8_t c, float s) {
    float t = (float)((int)c - 127) * (1.0f / 127.0f); return (t * fabsf(t)) * s;
}
static inline float q8_unsigned(uint8_t c, float s) {
    float t = (float)c * (1.0f / 255.0f); return ((t * t) * (t * t)) * s;
}
/* Codes: the reference's clamp of y to [-1, 1] taken after the root (the same codes: the
   root keeps order, and a negative y's unsigned root is a NaN, whose code is that of 0, as
   the clamp's 0); y is past 1 only by rounding (a block of a subnormal absmax is scaled
   first, q8_tiny: 1 / absmax would overflow). Branch-free: a loop of them is a SIMD loop.
   The signed code is the magnitude's, clamped and rounded, given y's sign: the bits of
   rint(clamp(copysign(sqrt|y|, y) * 127)) + 127 (rounding and the clamp are symmetric; a
   NaN y is 0 first, so the clamp is a plain min), with one select where that form took
   three, whose masks gcc moved through general registers (the loop ran about 1.4x slower) */
static inline uint8_t q8_code_signed(float x, float inv) {
    float y = x * inv;
    y = y == y ? y : 0.0f;
    float a = sqrtf(fabsf(y)) * 127.0f;
    a = 127.0f < a ? 127.0f : a;
    return (uint8_t)(int)(127.0f + copysignf(rintf(a), y));
}
static inline uint8_t q8_code_unsigned(float x, float inv) {
    float r = sqrtf(sqrtf(x * inv)) * 255.0f;
    r = r == r ? r : 0.0f;
    r = r < 255.0f ? r : 255.0f;
    return (uint8_t)(int)rintf(r);
}
static inline float q8_inv(float s) { return s > 0 ? 1.0f / s : 0.0f; }
/* A block whose absmax s is subnormal (q8_inv(s) is infinite below about 2.9e-39): its nb_
   values (at most QBLOCK) times 2^32, exactly, and the reciprocal of s * 2^32, so that
   the codes are those of (x * 2^32) * (1 / (s * 2^32)), the same number as x * (1 / s)
   where that is finite (quant.TINY). A block at a time, outside the codes' SIMD loop: a
   normal block pays one comparison. */
static inline float q8_tiny(float *v, int nb_, float s) {
    if (!(s > 0.0f && s < 0x1p-126f)) return q8_inv(s);
    for (int q = 0; q < nb_; q++) v[q] *= 0x1p32f;
    return q8_inv(s * 0x1p32f);
}
/* starts() with each tensor's length rounded up to whole blocks: a thread's share, in
   whole blocks, never splits one */
static int64_t *starts_q(int64_t nt, const int64_t *tab) {
    int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (nt + 1));
    start[0] = 0;
    for (int64_t i = 0; i < nt; i++)
        start[i + 1] = start[i] + (tab[i * ROW + COL_NUMEL] + QBLOCK - 1) / QBLOCK * QBLOCK;
    return start;
}
"""

# The codes from a table (``vega.codegen.c.render.q8_codes``: on CPUs whose gathers are fast)
C_TABLE = r"""
/* The same codes from a table, where ``vega.codegen.c.render.q8_codes`` chooses it:
   one gather where the roots took one or two square roots, which are slow in SIMD on an
   Intel Xeon (one thread, 512-bit vectors: the unsigned map's loop took 0.35-0.47 ns a
   value against 0.57-0.64 with its roots; an AMD Zen 4's gathers are slower still). A
   code is a step function of y's magnitude, rising with its float bits. A cell holds the
   magnitudes that share their top 14 bits (the exponent and 6 bits of the fraction: they
   span a factor of at most 1 + 1/64 = 1.0156, less than the factor between two
   neighbouring boundaries, at least (254.5/253.5)^4 = 1.0159), so it holds at most one
   boundary. A cell's entry is the code at its first magnitude, times 2^18, plus the low
   17 bits at which the next code starts (2^17: none in the cell). Magnitudes below the
   first cell are code 0 (the boundary of code 1 is 2^-36.0 for the unsigned map, 2^-16.0
   for the signed one), those from 2 on the top code. Built from q8_code_* when the
   library is loaded; a test compares the two on and beside every boundary, and on one
   float in 251 of all. */
#define Q8_TOP 0x3FFFFFFF  /* the bits of the largest float below 2 */
#define Q8_LO_U (90 << 23)  /* 2^-37 */
#define Q8_LO_S (109 << 23)  /* 2^-18 */
#define Q8_CELLS_U (((Q8_TOP - Q8_LO_U) >> 17) + 1)
#define Q8_CELLS_S (((Q8_TOP - Q8_LO_S) >> 17) + 1)
static int32_t q8_cells_u[Q8_CELLS_U], q8_cells_s[Q8_CELLS_S];
static int q8_code_of_bits(int sgn, int32_t b) {
    union { int32_t i; float f; } u = {b};
    return sgn ? q8_code_signed(u.f, 1.0f) - 127 : q8_code_unsigned(u.f, 1.0f);
}
static void q8_cells(int sgn, int32_t lo, int32_t *cells, int n) {
    for (int i = 0; i < n; i++) {
        const int32_t b0 = lo + (i << 17), b1 = b0 + (1 << 17) - 1;
        const int c0 = q8_code_of_bits(sgn, b0);
        int32_t a = b0, z = b1, next = 1 << 17;
        if (q8_code_of_bits(sgn, b1) != c0) {  /* bisect: code(a) = c0, code(z) > c0 */
            while (z - a > 1) {
                const int32_t m = a + (z - a) / 2;
                if (q8_code_of_bits(sgn, m) == c0) a = m; else z = m;
            }
            next = z - b0;
        }
        cells[i] = (c0 << 18) | next;
    }
}
__attribute__((constructor)) static void q8_tables(void) {
    q8_cells(0, Q8_LO_U, q8_cells_u, Q8_CELLS_U);
    q8_cells(1, Q8_LO_S, q8_cells_s, Q8_CELLS_S);
}
/* (the cells named, not passed: gcc then gathers with 32-bit indices, 16 a gather) */
#define Q8_CELL_CODE(cells, lo, a, out) do { \
    union { float f; int32_t i; } u_ = {(a) > 0.0f ? (a) : 0.0f};  /* (a NaN: 0) */ \
    int32_t b_ = u_.i > (lo) ? u_.i : (lo); \
    b_ = b_ < Q8_TOP ? b_ : Q8_TOP; \
    const int32_t e_ = cells[(b_ - (lo)) >> 17]; \
    (out) = (e_ >> 18) + ((b_ & 0x1FFFF) >= (e_ & 0x3FFFF)); \
} while (0)
static inline uint8_t q8_table_signed(float x, float inv) {
    const float y = x * inv, a = fabsf(y);
    int32_t m;
    Q8_CELL_CODE(q8_cells_s, Q8_LO_S, a, m);
    return (uint8_t)(y < 0.0f ? 127 - m : 127 + m);
}
static inline uint8_t q8_table_unsigned(float x, float inv) {
    const float y = x * inv;
    int32_t c;
    Q8_CELL_CODE(q8_cells_u, Q8_LO_U, y, c);
    return (uint8_t)c;
}
"""

R127 = 0.007874015718698502  # 1 / 127 in float32 (exactly this double)
R255 = 0.003921568859368563  # 1 / 255 in float32

TRITON_HELPERS = f'''

@triton.jit
def q8_rint(x):
    """x rounded to the nearest integer, halves to even (x >= 0 or an integer away)."""
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(0.5 * f)) == 1.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d == 0.5, tl.where(odd, f + 1.0, f), f))


@triton.jit
def q8_signed(c, s):
    """The values of 8-bit codes c (signed map) with their blocks' scales s."""
    t = (c.to(tl.float32) - 127.0) * {R127!r}
    return (t * tl.abs(t)) * s


@triton.jit
def q8_unsigned(c, s):
    """The values of 8-bit codes c (unsigned map) with their blocks' scales s."""
    t = c.to(tl.float32) * {R255!r}
    return ((t * t) * (t * t)) * s


@triton.jit
def q8_store(v, mask, n, codes_ptr, scale_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Store the float32 values v of one block of a tensor (its first n valid) as codes
    and one scale a block of {BLOCK} (vega.codegen.quant): the block's largest magnitude,
    NaN where the block holds one."""
    v2 = tl.reshape(tl.where(mask, v, 0.0), (BLOCK // {BLOCK}, {BLOCK}))
    a2 = tl.abs(v2)
    amax = tl.max(a2, axis=1)
    amax = tl.where(tl.max((a2 != a2).to(tl.int32), axis=1) > 0, float("nan"), amax)
    # a block of a subnormal amax times {TINY_UP!r} first, exactly (TINY)
    up = tl.where(amax < {TINY!r}, {TINY_UP!r}, 1.0)
    big = amax * up
    inv = tl.where(big > 0, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), big), 0.0)
    y = (v2 * tl.expand_dims(up, 1)) * tl.expand_dims(inv, 1)
    if SIGNED:
        r = tl.sqrt_rn(tl.abs(y))
        r = tl.where(y < 0, -r, r) * 127.0
        r = tl.where(r == r, r, 0.0)
        c = q8_rint(tl.where(r < 127.0, tl.where(r > -127.0, r, -127.0), 127.0)) + 127.0
    else:
        r = tl.sqrt_rn(tl.sqrt_rn(y)) * 255.0
        r = tl.where(r == r, r, 0.0)
        c = q8_rint(tl.where(r < 255.0, r, 255.0))
    tl.store(codes_ptr + tl.arange(0, BLOCK), tl.reshape(c, (BLOCK,)).to(tl.uint8), mask=mask)
    q = tl.arange(0, BLOCK // {BLOCK})
    tl.store(scale_ptr + q, amax, mask=q * {BLOCK} < n)
'''
