"""Master weights and stochastic rounding, as every backend does them alike.

**Master weights** are a program transformation (``variant``): the program keeps a state
``master``, a float32 copy of the parameter made from it at init; every read of ``p`` reads
the master instead, and the step writes the new value to the master in float32 and, rounded,
to the parameter, in the same pass (no backend does anything of its own for it).

**Stochastic rounding** of a float32 value ``x`` to bfloat16: add 16 random bits to the low
half of its bit pattern and keep the high half (``(bits(x) + r) >> 16``; a NaN stays a quiet
NaN). The result is one of the two bfloat16 values around ``x``, the upper one with
probability equal to ``x``'s distance from the lower one over their gap: its expected value is
``x``. ``r`` comes from a counter-based generator, the same bits on every backend:

    mix(x)      = lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
                  x ^= x >> 16   (uint32 arithmetic, wrapping)
    base        = mix(mix(mix(seed) ^ step) ^ tensor)
    r(slot, j)  = mix(mix(base + slot) ^ j) & 0xffff

``seed`` is the optimizer's ``rounding_seed``; ``step`` the tensor's step counter before the
step (completed steps); ``tensor`` the tensor's position among the tensors of its dtype group
in the step (see ``group_positions``); ``slot`` 0 for the parameter and 1 + k for state k;
``j`` the element's index in the tensor (its low 32 bits). The kernels compute ``base`` once
per tensor (Triton: in its scalars kernel, stored as two 16-bit halves) and ``r`` per element.
"""
from __future__ import annotations

import torch

from vega.dsl import ir
from vega.dsl.ir import Kind, Node, Op, Program, StateVar

MASTER = "master"  # the state holding a parameter's float32 master copy
M1, M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
MASK = 0xFFFFFFFF


def variant(program: Program, master: bool, seed: int | None) -> Program:
    """``program`` with a float32 master copy of the parameter (``master``) and bfloat16
    values stored stochastically rounded with ``seed`` (None: to nearest even); itself when
    neither. Made once per (program, master, seed)."""
    if not master and seed is None:
        return program
    key = (master, seed)
    found = program.variants.get(key)
    if found is not None:
        return found
    states, updates = program.states, program.updates
    if master:
        if MASTER in program.state_names:
            raise ValueError(f"{program.name}: master_weights=True keeps a state named "
                             f"'{MASTER}', but the spec declares one of that name")
        copy = ir.leaf(Op.STATE, Kind.ELEMENT, arg=MASTER)
        memo: dict[int, Node] = {}

        def swap(node: Node) -> Node:  # every read of p reads the master copy instead
            done = memo.get(id(node))
            if done is None:
                if node.op is Op.PARAM:
                    done = copy
                elif not node.src:
                    done = node
                else:
                    src = tuple(swap(s) for s in node.src)
                    done = node if all(a is b for a, b in zip(src, node.src)) else Node(
                        node.op, src, node.arg, node.dtype, node.kind, node.span, node.name,
                        node.dom)
                memo[id(node)] = done
            return done
        updates = tuple((t, swap(n)) for t, n in updates)
        new_p = next(n for t, n in updates if t == "p")
        states = (*states, StateVar(MASTER, ir.leaf(Op.PARAM, Kind.ELEMENT)))
        updates = (*updates, (MASTER, new_p))
    out = Program(program.name, program.hypers, program.flags, states, updates, program.shapes,
                  program.modes)
    object.__setattr__(out, "master", master)
    object.__setattr__(out, "rounding", seed)
    # (setdefault: of two threads making it at once, both take the one kept first, so that
    # a step's tensors of one program are not split between two: a stochastically rounded
    # tensor draws its bits by its position in its program's call)
    return program.variants.setdefault(key, out)


def mix(x: int) -> int:
    """lowbias32 on a Python int (uint32)."""
    x &= MASK
    x ^= x >> 16
    x = (x * M1) & MASK
    x ^= x >> 15
    x = (x * M2) & MASK
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c`` mod 2**32 for int64 tensors of uint32 values (in 16-bit halves of c: no
    int64 overflow)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK


def mix_t(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of uint32 values."""
    x = x & MASK
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def base_t(seed: int, step: torch.Tensor, tensor: int) -> torch.Tensor:
    """The generator's per-tensor key (0-d int64), from the 0-d int32 step counter."""
    s = torch.tensor(mix(seed), dtype=torch.int64, device=step.device)
    return mix_t(mix_t(s ^ (step.to(torch.int64) & MASK)) ^ tensor)


def bits_t(base: torch.Tensor, slot: int, numel: int) -> torch.Tensor:
    """The 16 random bits of each element of output ``slot`` (int64, flat)."""
    j = torch.arange(numel, dtype=torch.int64, device=base.device) & MASK
    return mix_t(mix_t(base + slot) ^ j) & 0xFFFF


def round_bf16_t(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` stochastically rounded to bfloat16 with the random bits ``r``."""
    x = x.to(torch.float32).contiguous()
    u = x.view(torch.int32).to(torch.int64).reshape(-1) & MASK
    up = ((u + r) >> 16) & 0xFFFF
    nan = ((u >> 16) | 0x40) & 0xFFFF  # a NaN: quiet, as the round to nearest even
    out = torch.where(torch.isnan(x).reshape(-1), nan, up)
    return out.to(torch.int32).to(torch.int16).view(torch.bfloat16).reshape(x.shape)


def group_positions(keys: list) -> list[int]:
    """Each tensor's position among those of its dtype group (``keys``: each tensor's group
    key), the groups taken in order of first appearance: the ``tensor`` of the generator."""
    seen: dict = {}
    out = []
    for k in keys:
        out.append(seen.get(k, 0))
        seen[k] = out[-1] + 1
    return out


C_HELPERS = r"""
static inline uint32_t vega_mix(uint32_t x) {  /* lowbias32 */
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r) {  /* stochastic rounding */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}
"""

# Round to nearest even to bfloat16 in Triton, for the generated modules (vega.codegen.triton's
# template, vega.codegen.triton_runs): by bit arithmetic, as the interpreter's cast truncates;
# a float64 value (a float64 parameter's step) rounded to float32 first, as the C backend
# and torch's cast round it (a bitcast of its 64 bits to 32 is refused).
TRITON_TO_BF16 = '''@triton.jit
def to_bf16(x):
    """float32 -> bfloat16 rounded to nearest even (float64 through float32)."""
    x = x.to(tl.float32)
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)  # NaN stays a quiet NaN
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)'''

TRITON_HELPERS = '''

@triton.jit
def mix(x):
    """lowbias32 on uint32 values (wrapping)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def to_bf16_sr(x, key, j):
    """float32 -> bfloat16 stochastically rounded: the bits of mix(key ^ j) (uint32); a
    float64 value rounded to float32 first, as the C backend and torch cast it."""
    x = x.to(tl.float32)
    u = x.to(tl.uint32, bitcast=True)
    r = mix(key ^ j.to(tl.uint32)) & 0xFFFF
    out = (u + r) >> 16
    out = tl.where(x != x, (u >> 16) | 0x40, out)  # NaN stays a quiet NaN
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
'''
