"""The C toolchain: compile a kernel's source to a shared library, cached on disk.

The cache lives in ``$VEGA_CACHE_DIR`` (default ``~/.cache/vega``), one
``<key>.so`` per kernel, the key a hash of the source, the compiler's version
and the flags. Libraries are written to a temporary name and renamed into
place, so two processes compiling the same kernel at once both succeed; a
library that does not load, or does not report its own key, is rebuilt.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from functools import cache
from pathlib import Path

from vega.errors import VegaError

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         "-fno-math-errno", "-ffp-contract=off", "-fno-strict-aliasing")
_lock = threading.Lock()


class CompilerError(VegaError):
    """The C compiler rejected a generated kernel: a bug in vega, with the compiler's words."""


def cache_dir() -> Path:
    root = os.environ.get("VEGA_CACHE_DIR")
    path = Path(root) if root else Path.home() / ".cache" / "vega"
    return path / "c"


@cache
def compiler() -> tuple[str, str] | None:
    """(path, version line) of the C compiler, or None where there is none."""
    return find_compiler(os.environ.get("CC"), "cc", "gcc", "clang")


def find_compiler(*names: str | None) -> tuple[str, str] | None:
    """(path, version line) of the first of ``names`` (None: skipped) that is on the PATH
    and answers ``--version``, or None."""
    for name in names:
        path = shutil.which(name) if name else None
        if path is None:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0:
            return path, (out.stdout.splitlines() or [""])[0]
    return None


_warned = False


def available() -> bool:
    """Whether kernels can be compiled here; warns once when they cannot."""
    global _warned
    if compiler() is not None:
        return True
    if not _warned:
        warnings.warn("vega: no C compiler found (set CC, or install gcc or clang); CPU steps "
                      "run on the slower reference backend", RuntimeWarning, stacklevel=3)
        _warned = True
    return False


# the arguments of the compiler proper (gcc's cc1, clang's -cc1) that say which CPU it builds for
_TARGET_ARGS = ("--param", "-target-cpu", "-target-feature", "-tune-cpu", "-triple")


def _native_target(verbose: str) -> str | None:
    """What ``-march=native`` resolved to, from ``cc -march=native -E -v``'s report of how it
    ran the compiler proper: gcc's cc1 line (``-march=skylake-avx512 -mavx2 -mno-sse4a ...
    --param l1-cache-size=32 ...``) or clang's -cc1 line (``-target-cpu ... -target-feature
    +avx2 ...``), its other words (file names, directories) left out; None if neither is there."""
    for line in verbose.splitlines():
        words = [w.strip('"') for w in line.split()]  # clang quotes each word
        cpu = [w for w in words if w.startswith("-march=")] or \
            [b for a, b in zip(words, words[1:]) if a == "-target-cpu"]
        if not cpu or cpu[0] in ("-march=native", "native"):
            continue
        kept = [f"{a} {b}" if a in _TARGET_ARGS else a for a, b in zip(words, words[1:] + [""])
                if a in _TARGET_ARGS or a.startswith("-m")]
        return " ".join(kept)
    return None


def _cpuinfo() -> str:
    """The CPU in /proc/cpuinfo's words (model and feature flags), or the platform's."""
    fields = ("vendor_id", "cpu family", "model", "model name", "flags", "Features",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in fields and name not in found:
                    found[name] = value.strip()
    except OSError:
        pass
    described = "; ".join(f"{k}: {found[k]}" for k in fields if k in found)
    return f"cpuinfo {platform.machine()} {described or platform.processor()}"


@cache
def target_cpu() -> str:
    """The CPU the kernels are built for: what ``-march=native`` means on this machine, asked
    of the compiler once per process (one preprocessor run, some 20-100 ms), or /proc/cpuinfo's
    model and flags where the compiler will not say. Part of the cache key, so that a cache
    shared between machines (a network home, a container image) never hands one CPU's kernel
    to another, where an instruction it lacks would kill the process (SIGILL)."""
    cc = compiler()
    if cc is not None:
        try:
            proc = subprocess.run([cc[0], "-march=native", "-E", "-v", "-x", "c", "-"],
                                  capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
            found = _native_target(proc.stderr) if proc.returncode == 0 else None
            if found:
                return found
        except (OSError, subprocess.SubprocessError):
            pass
    return _cpuinfo()


def key_of(source: str) -> str:
    """The cache key of ``source``: a hash of it, the compiler's version, the flags and the
    target CPU."""
    cc = compiler()
    text = "\0".join([source, cc[1] if cc else "", *FLAGS, target_cpu()])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(path: Path, key: str):
    try:
        lib = ctypes.CDLL(str(path))
        lib.vega_key.restype = ctypes.c_char_p
        if lib.vega_key().decode() == key:
            return lib
    except (OSError, AttributeError):
        pass
    return None


def build(source: str) -> tuple[ctypes.CDLL, Path, bool]:
    """The loaded library for ``source``: (library, path, whether it was compiled now).

    The source must define ``const char *vega_key(void)`` returning the
    placeholder ``@KEY@``, which is replaced by the cache key.
    """
    cc = compiler()
    if cc is None:
        raise CompilerError("no C compiler found")
    key = key_of(source)
    source = source.replace("@KEY@", key)
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{key}.so"
    with _lock:
        if target.exists():
            lib = _load(target, key)
            if lib is not None:
                return lib, target, False
        fd, tmp_c = tempfile.mkstemp(suffix=".c", prefix=f".{key}-", dir=out_dir)
        tmp_so = tmp_c[:-2] + ".so"
        try:
            with os.fdopen(fd, "w") as f:
                f.write(source)
            proc = subprocess.run([cc[0], *FLAGS, tmp_c, "-o", tmp_so, "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise CompilerError(f"{cc[0]} failed on a generated kernel (a bug in vega; "
                                    f"please report it):\n{proc.stderr[-4000:]}")
            os.replace(tmp_so, target)  # atomic: readers see the old file or the new one
        finally:
            for leftover in (tmp_c, tmp_so):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        lib = _load(target, key)
        if lib is None:
            raise CompilerError(f"the compiled kernel {target} does not load")
        return lib, target, True
