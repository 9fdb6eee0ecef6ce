"""The C backend past 32-bit indexing: a tensor may hold 2**31 elements or more (a
256k-vocabulary embedding at width 8192), a step's tensors together far more.

The source check runs everywhere. The steps over more than 2**31 elements need about 4.5 GB
(6.8 GB with 8-bit state) and 3-7 s each: they run where the machine has 12 GiB available
(room beside another test process), or with ``VEGA_LARGE=1``; ``VEGA_LARGE=0`` leaves them
out. They take turns on the machine (a lock file: pytest-xdist's processes, or two runs of
the suite, each saw the same 12 GiB and would step at once), the memory looked at again
when a step's turn comes. Their gradients are zeros that numpy's calloc leaves untouched
(the pages read as zero without being made), so only the bfloat16 parameters (and the 8-bit
codes) take memory.
"""
import contextlib
import math
import os
import re
import tempfile

import numpy as np
import pytest
import torch

import vega
from vega import codegen
from vega.codegen import precision, quant
from vega.codegen.c import build as cbuild

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler here")



def _available_gib() -> float:
    """The memory the kernel says is available for new work (0 where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0.0
    return kib / 2**20


_LARGE = os.environ.get("VEGA_LARGE")
_ROOM = "steps over 2**31 elements need 4.5-6.8 GB: they run with 12 GiB available, or " \
    "with VEGA_LARGE=1"
LOCK = os.path.join(tempfile.gettempdir(), f"vega-tests-large-{os.getuid()}.lock")


@contextlib.contextmanager
def one_at_a_time():
    """Hold the machine's turn of the large steps (``LOCK``, flock), waiting for it."""
    import fcntl
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # (released as the file closes)


@pytest.fixture
def turn():
    """This test's turn of the large steps, skipped where the memory is gone by then."""
    with one_at_a_time():
        if _LARGE != "1" and _available_gib() < 12:
            pytest.skip(_ROOM)
        yield


def large(test):
    """A step over more than 2**31 elements: run where there is room, in its turn."""
    marked = pytest.mark.usefixtures("turn")(test)
    return pytest.mark.skipif(_LARGE == "0" or (_LARGE != "1" and _available_gib() < 12),
                              reason=_ROOM)(marked)

B = 2**31


def _sources() -> dict[str, str]:
    """The C source of AdamW (with 8-bit state, and with bfloat16 parameters rounded
    stochastically from a master copy), LAMB's phases and Adafactor's staged loops."""
    adamw = vega.adamw.program()
    return {"adamw": vega.adamw.source("c"), "lamb": vega.lamb.source("c"),
            "adafactor": vega.adafactor.source("c", shape=(512, 768)),
            "adamw 8-bit": codegen.kernel("c", quant.variant(adamw, frozenset({"mu", "nu"})))
            .source(),
            "adamw rounded": codegen.kernel("c", precision.variant(adamw, True, 7)).source(
                ("bfloat16", "bfloat16", "float32"))}


def test_loops_and_offsets_count_in_64_bits():
    """Every loop of the kernels counts in int64_t (or size_t), but those over the threads
    and within one 8-bit block (at most QBLOCK values); every int variable is a thread's
    number or count, a flag, or such a block's length."""
    small = {"tid", "nthr", "nth", "t", "nonfinite", "MS_", "raw", "nb_", "q", "recip_ok"}
    for name, src in _sources().items():
        for ty, var, bound in re.findall(r"for \((?:const )?(\w+) (\w+) = [^;]*; \w+ < ([^;]+);",
                                         src):
            assert ty in ("int64_t", "size_t") or (ty, var, bound) in (
                ("int", "t", "(nth > 0 ? nth : 1)"), ("int", "q", "nb_")), (name, ty, var, bound)
        for ty, var in re.findall(r"\b(int|unsigned|long|int32_t|uint32_t)\s+(\w+)\s*[=;,)]", src):
            # (v_...: a program's value, a bool; int32_t/uint32_t: float bits, a step counter)
            assert var in small or var.startswith("v_") or ty in ("int32_t", "uint32_t"), \
                (name, ty, var)
        assert "(int)(je_ - jb_)" in src or "nb_" not in src


def _zeros(n: int) -> torch.Tensor:
    """n bfloat16 zeros in pages calloc leaves untouched (no memory until written)."""
    return torch.from_numpy(np.zeros(n, dtype=np.int16)).view(torch.bfloat16)


PLAIN = "optimizer plain(lr = 0.1) {\n    p = p - lr * g\n}\n"


def test_the_large_steps_take_turns_on_the_machine():
    """Each large step holds the machine's lock while it runs: another process (another
    test process of pytest-xdist, another run) cannot take it meanwhile."""
    import subprocess
    import sys
    steps = [v for k, v in globals().items() if k.startswith("test_") and
             any(m.name == "skipif" for m in getattr(v, "pytestmark", []))]
    assert len(steps) == 3
    assert all(any(m.name == "usefixtures" and m.args == ("turn",) for m in t.pytestmark)
               for t in steps)
    try_lock = ("import fcntl, sys\nwith open(sys.argv[1], 'a') as f:\n    try:\n"
                "        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
                "    except BlockingIOError:\n        print('held')\n")
    with one_at_a_time():
        out = subprocess.run([sys.executable, "-c", try_lock, LOCK], capture_output=True,
                             text=True, timeout=60)
    assert out.stdout.strip() == "held", out.stderr


def _step_views(sizes: list[int]):
    """A step of ``p = p - lr * g`` with clipping over bfloat16 parameters of ``sizes`` (views
    of one storage of ones), gradients 2 at a few places and 0 elsewhere: at 2**31 - 2 to
    2**31 + 1 of the storage and at each tensor's first and last element. Returns the
    storage, those places and the step counter."""
    total = sum(sizes)
    p = torch.ones(total, dtype=torch.bfloat16)
    g = _zeros(total)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    spots = sorted({B - 2, B - 1, B, B + 1, *starts, *(s + n - 1 for s, n in zip(starts, sizes))})
    spots = [s for s in spots if s < total]
    g[spots] = 2.0
    params = {str(k): p[s:s + n] for k, (s, n) in enumerate(zip(starts, sizes))}
    grads = {str(k): g[s:s + n] for k, (s, n) in enumerate(zip(starts, sizes))}
    spec = vega.compile(PLAIN)
    state = spec.init({k: torch.ones(1, dtype=torch.bfloat16) for k in params})
    _, state = spec.step(params, grads, state, lr=0.25, donate=True, backend="c",
                         max_grad_norm=1.0)
    return p, spots, state["step"]


def _check(p: torch.Tensor, spots: list[int], step: torch.Tensor) -> None:
    """The clipped step moved the places of the gradient's 2s (the prelude's sum of squares
    counted each once) and nothing else (every 2**20 + 1-th element checked)."""
    coef = 1.0 / math.sqrt(4.0 * len(spots))
    want = torch.tensor(1.0 - 0.25 * 2.0 * coef).to(torch.bfloat16)
    assert [float(p[s]) for s in spots] == [float(want)] * len(spots)
    idx = torch.arange(0, p.numel(), 2**20 + 1)
    idx = idx[~torch.isin(idx, torch.tensor(spots))]
    assert bool((p[idx] == 1).all())
    assert int(step) == 1


@large
def test_a_tensor_past_2_31_elements():
    _check(*_step_views([B + 4096 + 37]))


@large
def test_tensors_whose_sizes_sum_past_2_31():
    _check(*_step_views([2**30 + 3, 2**30 + 4099, 5000]))


@large
def test_8_bit_state_past_2_31_elements():
    """A momentum kept in 8 bits over one bfloat16 tensor of more than 2**31 elements: each
    place's new parameter, and its block's scale (the largest magnitude of the block)."""
    n = B + 3 * quant.BLOCK + 17
    p = torch.ones(n, dtype=torch.bfloat16)
    g = _zeros(n)
    codes = torch.full((n,), 127, dtype=torch.uint8)  # (the signed map's code of 0)
    scales = torch.zeros(quant.blocks(n), dtype=torch.float32)
    spots = [0, 5, B - quant.BLOCK, B - 1, B, B + 1, B + 300, n - 1]
    for k, s in enumerate(spots):
        g[s] = float(k + 1)
    spec = vega.compile("optimizer mom(lr = 0.1) {\n    state m = zeros\n"
                        "    m = 0.5 * m + g\n    p = p - lr * m\n}\n")
    small = spec.init({"w": torch.ones(quant.MIN_NUMEL, dtype=torch.bfloat16)},
                      state_dtype=torch.uint8)
    state = {"m": {"w": codes}, "m" + quant.SUFFIX: {"w": scales}, "step": small["step"]}
    _, state = spec.step({"w": p}, {"w": g}, state, lr=0.25, donate=True, backend="c")
    for k, s in enumerate(spots):
        assert float(p[s]) == float(torch.tensor(1.0 - 0.25 * (k + 1)).to(torch.bfloat16))
    top: dict[int, float] = {}
    for k, s in enumerate(spots):
        top[s // quant.BLOCK] = max(top.get(s // quant.BLOCK, 0.0), float(k + 1))
    assert {b: float(scales[b]) for b in top} == top
    assert int((scales != 0).sum()) == len(top)
    idx = torch.arange(0, n, 2**20 + 1)
    idx = idx[~torch.isin(idx, torch.tensor(spots))]
    assert bool((p[idx] == 1).all()) and bool((codes[idx] == 127).all())
    assert int(state["step"]) == 1
