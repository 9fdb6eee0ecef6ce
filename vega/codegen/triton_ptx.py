"""The Triton backend's kernels compiled offline for a GPU this machine need not have.

Triton's wheel carries the whole NVIDIA tool chain (``ptxas`` included), so a kernel compiles
to PTX and a cubin for ``sm_90a`` without a GPU. What decides much of its speed can then be
read from the result: 128-bit global accesses (``ld.global.v4``, ``st.global.v4``), registers
a thread and spilled bytes (``ptxas -v``), libdevice functions (inlined, each leaves a label
``%__nv_log2.exit``), double-precision arithmetic, max instructions that drop a NaN
(PTX ``max`` returns the other operand), and, from Triton's IR, whether addresses are formed
from int32 or int64 offsets (a tensor may hold 2**31 elements or more).

Two halves, in two processes (Triton reads ``TRITON_INTERPRET`` when it is first imported):

- ``record(step)`` runs ``step`` where kernels are interpreted (CPU tensors), with the
  launches recorded instead of run and the block sizes and warps a GPU would get
  (``vega.codegen.triton_runtime.gpu_sizes``): each launch's kernel, module source, and
  arguments as the launcher specializes them (pointer dtypes, 16-byte alignment, integers
  divisible by 16, constexprs);
- ``compile_launches(launches)`` compiles each distinct one in a subprocess (this module's
  ``main``, without the interpreter, and without vega's packages: the module and
  ``vega.codegen.sources`` need the standard library and Triton alone) and returns its
  figures (``Figures``).
"""
from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

TARGET = ("cuda", 90, 32)  # an H100/H200: sm_90a, warps of 32
ARCH = "sm_90a"

_POINTER = {"float32": "*fp32", "float64": "*fp64", "bfloat16": "*bf16", "float16": "*fp16",
            "int64": "*i64", "int32": "*i32", "bool": "*i1"}


@dataclass(frozen=True)
class Launch:
    """One recorded launch, as a compiler sees it."""

    kernel: str  # the kernel's name
    module: str  # the name of the module (its source is ``source``)
    source: str
    signature: tuple[tuple[str, str], ...]  # (argument, Triton type), constexprs "constexpr"
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[int, ...]  # positions of arguments divisible by 16 (pointers: bytes)
    num_warps: int
    maxnreg: int | None = None  # the registers a thread may use, where the launch caps them
    fp_fusion: bool = True  # whether a product and a sum may contract into one fused op

    def key(self) -> tuple:
        return (self.kernel, self.source, self.signature, self.constexprs, self.aligned,
                self.num_warps, self.maxnreg, self.fp_fusion)


@dataclass(frozen=True)
class Figures:
    """What the compiled kernel shows."""

    kernel: str
    num_warps: int
    block: int | None  # its BLOCK constexpr
    registers: int
    spill_stores: int  # bytes
    spill_loads: int
    v4_loads: int  # ld.global...v4 instructions in the PTX
    v4_stores: int
    loads: int  # every ld.global
    stores: int
    libdevice: tuple[str, ...]  # the libdevice (__nv_) functions inlined or called
    f64_ops: int  # double-precision arithmetic instructions (fma, mul, add, ... .f64)
    max_dropping_nan: int  # max.f32/f64 whose result no select makes NaN on a NaN operand
    max_nan: int  # max.NaN.f32, or a max.f64 made NaN by a select (a propagating max)
    fmas: int = 0  # fused multiply-adds (fma.rn.f32/f64): a product and a sum rounded once
    approximate: int = 0  # approximate divisions, roots and reciprocals (div.full, .approx)
    flushed: int = 0  # float32 arithmetic that flushes subnormals to zero (.ftz)
    # float32 exp2 and log2 approximations (ex2.approx, lg2.approx: Triton's float32 tl.exp is
    # ex2.approx of x * log2(e) rounded to float32, tens of units in the last place off)
    fast_exp: int = 0
    # addresses formed in Triton's IR (tt.addptr): blocks of them from int32 offsets (within
    # 2**31 elements of their base), and blocks or single ones from int64 offsets
    i32_offsets: int = 0
    i64_offsets: int = 0


def _argument(value, name: str) -> tuple[str, bool]:
    """(Triton type, divisible by 16) of one argument, as Triton's launcher specializes it."""
    import torch

    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return _POINTER[dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"argument {name!r} of a recorded launch: {type(value).__name__}")


@contextlib.contextmanager
def recording():
    """Within: ``vega.codegen.triton_runtime.launch`` records each launch (``Launch``) into
    the list yielded instead of running it, with a GPU's block sizes and warps."""
    from vega.codegen import triton_runtime as tr

    found: list[Launch] = []

    def record_one(fn, grid, *args, **meta):
        py = getattr(fn, "fn", fn)  # an InterpretedFunction's Python function
        filename = py.__code__.co_filename
        source = "".join(linecache.getlines(filename))
        names = list(py.__code__.co_varnames[:py.__code__.co_argcount])
        warps = meta.pop("num_warps", tr.WARPS_GPU)
        maxnreg = meta.pop("maxnreg", None)  # (launch options, not constexprs)
        fp_fusion = meta.pop("enable_fp_fusion", True)
        signature, aligned = [], []
        for k, (name, value) in enumerate(zip(names, args)):
            ty, div = _argument(value, name)
            signature.append((name, ty))
            if div:
                aligned.append(k)
        signature += [(name, "constexpr") for name in meta]
        found.append(Launch(py.__name__, filename, source, tuple(signature),
                            tuple(meta.items()), tuple(aligned), warps, maxnreg, fp_fusion))

    old = tr.launch
    tr.launch = record_one
    try:
        with tr.gpu_sizes():
            yield found
    finally:
        tr.launch = old


def record(step) -> list[Launch]:
    """The launches ``step()`` makes (see ``recording``)."""
    with recording() as found:
        step()
    return found


# the tensors of a recorded step: a vector, a small matrix, and a matrix with both axes long
# enough to be factored (adafactor's staged kernels) and a row count that is not a multiple of 4
SHAPES = ((1000,), (30, 40), (257, 160))


def spec_launches(name: str, dtype: str = "float32", fused: bool = False,
                  shapes=SHAPES, state_dtype=None, **hypers) -> list[Launch]:
    """The launches of one step of a shipped spec (by name) with the triton backend, on
    parameters of ``dtype``; ``fused``: with clipping and a skip of non-finite steps;
    ``state_dtype``: the state's (``torch.uint8``: 8-bit state in the largest tensor)."""
    import torch

    import vega
    from vega.codegen.triton_runtime import interpreting

    spec = vega.builtin(name)
    device = "cpu" if interpreting() else "cuda"
    params = {str(k): torch.randn(s, dtype=getattr(torch, dtype), device=device)
              for k, s in enumerate(shapes)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = spec.init(params, state_dtype=state_dtype, **hypers)
    more = dict(max_grad_norm=1.0, skip_nonfinite=True) if fused else {}
    return record(lambda: spec.step(params, grads, state, backend="triton", donate=True,
                                    **more, **hypers))


def distinct(launches) -> list[Launch]:
    seen, out = set(), []
    for x in launches:
        if x.key() not in seen:
            seen.add(x.key())
            out.append(x)
    return out


# The compiling process: this module and vega.codegen.sources, of this vega (the directory
# given), as modules of packages that are not imported (vega's and vega.codegen's import
# torch, dynamo and the backends: seconds of a CPU, for a process that needs Triton alone)
_CHILD = """
import os, sys, types
codegen = sys.argv[1]
for name, path in (("vega", os.path.dirname(codegen)), ("vega.codegen", codegen)):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [path]
from vega.codegen import triton_ptx
triton_ptx.main()
"""


def compile_launches(launches, timeout: float = 600) -> list[Figures]:
    """Each distinct launch compiled for ``ARCH`` in a subprocess without the interpreter.
    RuntimeError where Triton's wheel has no ``ptxas`` (``ptxas``), which the compile runs."""
    if ptxas() is None:
        raise RuntimeError("the offline compile needs the ptxas of Triton's wheel "
                           "(triton/backends/nvidia/bin/ptxas), and there is no ptxas to run "
                           "there: install a Triton with its NVIDIA backend (the wheel from PyPI)")
    todo = distinct(launches)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    payload = json.dumps([asdict(x) for x in todo])
    done = subprocess.run([sys.executable, "-c", _CHILD, os.path.dirname(os.path.abspath(
        __file__))], input=payload, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the offline compile failed:\n{done.stderr[-4000:]}")
    return [Figures(**{**f, "libdevice": tuple(f["libdevice"])})
            for f in json.loads(done.stdout)]


def ptxas() -> str | None:
    """The ptxas of Triton's wheel, if there is one."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin",
                        "ptxas")
    return path if os.access(path, os.X_OK) else None


def _offsets(ttir: str) -> tuple[int, int]:
    """(tt.addptr of a block of addresses by int32 offsets, tt.addptr by int64 offsets) in
    Triton's IR: each one's operand types, ``: <pointers>, <offsets>``."""
    i32 = i64 = 0
    for line in ttir.splitlines():
        if "tt.addptr" not in line:
            continue
        text = re.sub(r"\{[^{}]*\}", "", line.split(" loc(")[0])  # (attributes have types)
        ptr, off = text.rsplit(" : ", 1)[-1].strip().rsplit(", ", 1)
        i32 += ptr.startswith("tensor<") and off.endswith("xi32>")
        i64 += off == "i64" or off.endswith("xi64>")
    return i32, i64


def figures(kernel: str, ptx: str, ptxas_out: str, num_warps: int, block,
            ttir: str = "") -> Figures:
    """The figures of one kernel from its PTX and ``ptxas -v``'s report (and Triton's IR)."""
    regs = re.search(r"Used (\d+) registers", ptxas_out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_out)
    # libdevice is inlined: each function leaves a label %__nv_<name>.exit (or is called)
    called = sorted(set(re.findall(r"%(__nv_[a-z0-9_]+?)\.exit", ptx)) |
                    set(re.findall(r"call[^;]*?(__nv_\w+)", ptx, re.S)))
    f64 = len(re.findall(r"^\s*(?:fma|mul|add|sub|div|rcp|sqrt|max|min|ex2|lg2)\.[\w.]*f64\b",
                         ptx, re.M))
    # PTX max returns the other operand where one is NaN; Triton's propagating max is max.NaN
    # (float32) or a max followed by a select of NaN where an operand is NaN (float64)
    plain = re.findall(r"\bmax\.(f32|f64)\s+(%\w+),", ptx)
    nan = {"f32": "0f7FC00000", "f64": "0d7FF8000000000000"}
    guarded = sum(1 for ty, reg in plain if re.search(
        rf"selp\.{ty}\s+%\w+,\s*{nan[ty]},\s*{re.escape(reg)}\b", ptx))
    nan_max = len(re.findall(r"\bmax\.NaN\.f32\b", ptx))
    offsets = _offsets(ttir)
    return Figures(
        kernel=kernel, num_warps=num_warps, block=block,
        registers=int(regs.group(1)) if regs else -1,
        spill_stores=int(spills.group(1)) if spills else -1,
        spill_loads=int(spills.group(2)) if spills else -1,
        v4_loads=len(re.findall(r"\bld\.global[\w.]*\.v4\b", ptx)),
        v4_stores=len(re.findall(r"\bst\.global[\w.]*\.v4\b", ptx)),
        loads=len(re.findall(r"\bld\.global\b", ptx)),
        stores=len(re.findall(r"\bst\.global\b", ptx)),
        libdevice=tuple(called),
        f64_ops=f64,
        max_dropping_nan=len(plain) - guarded, max_nan=nan_max + guarded,
        fmas=len(re.findall(r"^\s*fma\.rn\.(?:ftz\.)?f(?:32|64)\b", ptx, re.M)),
        approximate=len(re.findall(r"^\s*(?:div|sqrt|rcp|rsqrt)\.(?:full|approx)\b", ptx, re.M)),
        flushed=len(re.findall(r"^\s*\w+\.(?:\w+\.)*ftz\.(?:\w+\.)*f32\b", ptx, re.M)),
        fast_exp=len(re.findall(r"^\s*(?:ex2|lg2)\.approx\.(?:ftz\.)?f32\b", ptx, re.M)),
        i32_offsets=offsets[0], i64_offsets=offsets[1])


def _compile_one(launch: dict, tmp: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vega.codegen.sources import run_source

    mod = run_source(launch["source"], launch["module"], "vega_triton_offline")
    fn = mod[launch["kernel"]]
    signature = dict((name, ty) for name, ty in launch["signature"])
    constexprs = dict((name, value) for name, value in launch["constexprs"])
    attrs = {(k,): [["tt.divisibility", 16]] for k in launch["aligned"]}
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": launch["num_warps"]}
    if launch.get("maxnreg") is not None:
        options["maxnreg"] = launch["maxnreg"]
    if not launch.get("fp_fusion", True):
        options["enable_fp_fusion"] = False
    compiled = triton.compile(src, target=GPUTarget(*TARGET), options=options)
    ptx = compiled.asm["ptx"]
    # (not named by the kernel: a spec's name, and so its kernels', may be longer than a
    # file's name may be)
    path = os.path.join(tmp, "kernel.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    done = subprocess.run([ptxas(), f"-arch={ARCH}", "-v", path, "-o", os.devnull],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on {launch['kernel']}: {done.stderr[-2000:]}")
    return asdict(figures(launch["kernel"], ptx, done.stderr, launch["num_warps"],
                          constexprs.get("BLOCK"), compiled.asm["ttir"]))


def main() -> None:
    launches = json.loads(sys.stdin.read())
    with tempfile.TemporaryDirectory() as tmp:
        out = [_compile_one(x, tmp) for x in launches]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
