"""vega's C++ operator: ``vega_c::step`` and ``vega_c::prelude`` (``native.cpp``), a small
extension registered with ``TORCH_LIBRARY`` that checks the tensors of a C backend step through
ATen's public API, builds the kernels' address tables and calls the generated C kernels. It
takes a list of tensors in one call, about 0.1 us a tensor, against 1-2 us for the same work
in Python, which was most of the time a step over many small tensors took. Its eager
bindings take each tensor from its Python object by torch's own accessor
(``THPVariable_Unpack``, about 15 ns, where pybind11's conversion of a list costs 80-95 ns a
tensor). The same module checks a Triton step's tensors and builds its address tables
(``triton_rows``, ``triton_grad_rows``; ``vega.codegen.triton_runtime``), and makes a step's
passes over its lists (``gather``, ``distinct``, ``any_complex``: ``vega.codegen.tensors``,
``vega.codegen.base``) where it is loaded.

It is compiled against the installed torch with torch's own headers and flags
(``torch.utils.cpp_extension``'s include and library paths, its C++ ABI setting) by the system
C++ compiler, once, in the background (a minute or so): steps use the Python path
(``vega.codegen.c``, ctypes) until it is ready, and always where it cannot be built (no C++
compiler or Python headers, or no setuptools for ``torch.utils.cpp_extension`` to import).
The library is cached beside the kernels, keyed by its source, the compiler, the flags and
the torch and Python versions (it is built for the compiler's default target, not
``-march=native``, so the CPU is no part of its key), written atomically and trusted as the
kernels are: loaded only if it is this user's, not writable by others and hashes to its
recorded SHA-256 (``vega.codegen.c.build``).

``VEGA_NATIVE=0`` turns it off; ``VEGA_NATIVE=sync`` builds it on first use, waiting (or
waits for another process's build of it, by the same lock).
"""
from __future__ import annotations

import errno
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import torch

from vega.codegen.c import build as cbuild

SOURCE = Path(__file__).with_name("native.cpp")
# The source as this module was imported with it: the one keyed and compiled. A vega
# upgraded on disk while a process runs must not have the running code's key name, or
# the running code load, a library of the new file (its tables and calls another ABI's).
TEXT = SOURCE.read_text()
# NDEBUG: a release build, without pybind11's and c10's debug checks (a GIL check on every
# reference count); -fopenmp: at::parallel_for on torch's intra-op threads (``each_apart``); the
# default target, not -march=native
FLAGS = ("-O2", "-DNDEBUG", "-shared", "-fPIC", "-std=c++17", "-fopenmp", "-w")
NAME = "vega_native"

_lock_ = threading.Lock()
_state: dict = {"module": None, "pending": None, "failed": None, "next_poll": 0.0}
_LOADED: list = []  # the module once loaded: a process registers its operators once


def _key(cxx: tuple[str, str], include: list[str]) -> str:
    text = "\0".join([TEXT, cbuild.identity(cxx), *FLAGS, *include, torch.__version__,
                      sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", cbuild.FORMAT])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@cache
def _cxx() -> cbuild.Compiler | None:
    """(path, version line) of the C++ compiler, or None (``cbuild.command`` runs it)."""
    return cbuild.named_compiler("CXX", "C++", "c++", "g++", "clang++")


NOT_BUILDABLE = "no C++ compiler, Python headers or torch headers"


@cache
def _cpp_extension():
    """``torch.utils.cpp_extension``, for torch's include and library paths, imported where a
    build is wanted (it imports setuptools, which a user may not have: vega imports and
    steps without it, on the Python path); or the ImportError's words."""
    try:
        from torch.utils import cpp_extension
    except ImportError as e:
        return f"torch.utils.cpp_extension cannot be imported ({e})"
    return cpp_extension


def _why_not() -> str:
    """Why ``_paths`` found no way to build the operator."""
    found = _cpp_extension()
    return found if isinstance(found, str) else NOT_BUILDABLE


def _paths():
    """(command without output, target) or None where it cannot be built (``_why_not``).
    The command names ``SOURCE`` as the file to compile; ``build`` compiles ``TEXT`` in its
    place."""
    cxx = _cxx()
    py_include = sysconfig.get_paths().get("include")
    if cxx is None or not py_include or not (Path(py_include) / "Python.h").exists():
        return None
    cpp_extension = _cpp_extension()
    if isinstance(cpp_extension, str):
        return None
    torch_include = cpp_extension.include_paths()
    if not (Path(torch_include[0]) / "torch" / "library.h").exists():
        return None
    include = [*(f"-I{d}" for d in torch_include), f"-I{py_include}",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
               f"-DTORCH_EXTENSION_NAME={NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    libs = [*(f"-L{d}" for d in cpp_extension.library_paths()), "-lc10", "-ltorch",
            "-ltorch_cpu", "-ltorch_python",
            *(f"-Wl,-rpath,{d}" for d in cpp_extension.library_paths())]
    key = _key(cxx, include)
    out_dir = cbuild.cache_dir().parent / "native"
    target = out_dir / f"{NAME}-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    return [*cbuild.command(cxx), *FLAGS, *include, str(SOURCE), *libs], target


def _load(path: Path):
    if _LOADED:  # (its operators are registered: a second library could not register them)
        return _LOADED[0]
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    _register_fakes()
    _LOADED.append(module)
    return module


def _register_fakes() -> None:
    """The operators' fake implementations, for torch.compile: every output is a mutated
    argument, so they do nothing."""
    def step(kernel, params, grads, states, steps, step_index, hypers, hyper_index, pre,
             geometry, outs):
        return None

    def prelude(kernel, grads, pre):
        return None
    torch.library.register_fake("vega_c::step", step)
    torch.library.register_fake("vega_c::prelude", prelude)


_BUILT = "built, but it "  # (what a library built but not usable is said with: not rebuilt)
# (what a library that could not be loaded now is said with: kept for a later process, which
# loads it; neither rebuilt nor recorded)
_NOW = "built, but not loadable now"
# what keeps the loader from mapping a library now but not later: no file descriptor or memory
# left (a process at its limit), as the loader says an errno (": " and the strerror of this
# process's locale; not "cannot allocate memory in static TLS block", which is the library's)
_LOAD_NOW = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def _opened(path: Path):
    """(the module of the library at ``path``, None) if it may be loaded (``cbuild.untrusted``:
    checked before it is opened) and has the operators; else (None, why not)."""
    try:
        found, problem = cbuild.load_verified(path, _checked)
    except OSError as e:  # (its copy could not be written: a full disk, no descriptor left)
        return None, f"{_NOW} ({e}); a later process loads it"
    if problem is not None:
        return None, f"{path} is not trusted: {problem}"
    return (found, None) if not isinstance(found, str) else (None, found)


def _checked(path: Path):
    """The module of the library at ``path``, if it loads and registered its operators;
    else why not, in the loader's words (``_BUILT``; ``_NOW`` where it is out of descriptors
    or memory)."""
    try:
        module = _load(path)
    except (ImportError, OSError, AttributeError, TypeError, ValueError, RuntimeError) as e:
        said = f"{type(e).__name__}: {e}"
        if any(f": {os.strerror(n)}" in said for n in _LOAD_NOW):  # (the loader's errno)
            return f"{_NOW} ({said}); a later process loads it"
        return f"{_BUILT}does not load ({said})"
    if not all(hasattr(module, f) for f in ("step", "prelude", "add_kernel", "add_library")) \
            or not hasattr(torch.ops.vega_c, "step"):
        return f"{_BUILT}does not have the operators"
    return module


def _unusable(target: Path, problem: str | None) -> str | None:
    """``problem``, a library at ``target`` built but not usable (``_BUILT``: not worth
    building again), recorded beside it and said with where; any other as it is."""
    if problem is None or not problem.startswith(_BUILT):
        return problem
    problem += f" (kept in {_failed_file(target)}: delete it to try again)"
    _record_failure(target, problem)
    return problem


def _failed_file(target: Path) -> Path:
    """Where a failed build of ``target`` says why: later processes do not try again (a new
    torch, compiler or source is a new target)."""
    return target.with_name(target.name + ".failed")


FAILED_LIMIT = 64 << 10  # bytes: a failure record holds the last 2000 characters of an error


def _failure(target: Path) -> str | None:
    """Why a build of ``target`` failed, as recorded beside it, or None where nothing is. A
    record that is not a regular file of this user's (a FIFO, a directory), or is larger
    than ``FAILED_LIMIT``, is not read (a FIFO would block the read) but removed, with one
    warning: the library is built again. Bytes that are not text are replaced."""
    path = _failed_file(target)
    if not os.path.lexists(path):
        return None
    data, problem = cbuild.read_capped(path, FAILED_LIMIT)
    if problem is None:
        return data.decode(errors="replace")
    cbuild.warn_once(f"vega: not reading {path}: {problem}; removing it and building the "
                     f"native operator again")
    cbuild.remove(path)
    return None


def _record_failure(target: Path, text: str) -> None:
    """Record ``text`` as why a build of ``target`` failed: written to a new file renamed into
    place, so that whatever was there (a FIFO: writing into it would block) is replaced. A
    record that cannot be written is not: the build is tried again by a later process."""
    path = _failed_file(target)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if os.path.isdir(path) and not os.path.islink(path):
            cbuild.remove(path)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def _lock(target: Path) -> Path:
    return target.with_name(target.name + ".building")


def _target_of(lock: Path) -> Path:
    return lock.with_name(lock.name.removesuffix(".building"))


# seconds: the compiler's time limit (``build``), and the most a lock is held: that limit and
# the start of the build's process (which imports vega and torch)
BUILD_LIMIT = 600
LOCK_LIMIT = BUILD_LIMIT + 60
# the first line of a lock: the builder, as a C++ comment before the source it compiles
_HOLDER = "// vega native build: "


def _machine() -> str:
    """This machine and its process-id namespace: where a lock's pid means this process."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()} {ns}".strip()


HOLDER_LIMIT = 4096  # bytes: the line that names a lock's builder


def _read_lock(lock: Path, fd: int | None = None) -> tuple[dict | None, str | None]:
    """What ``lock`` holds: the builder it names ({"pid", "machine"}, or None where it names
    none: a lock being written, or one of a vega that wrote the source alone) and the source
    after that line (the text the target's key names, which the build compiles; None where
    it holds none). Read from ``fd`` (the lock as taken) or from a regular file opened
    without following a link or waiting on a FIFO; anything else reads as neither."""
    try:
        own = os.open(lock, cbuild.READ_FLAGS) if fd is None else None
        try:
            use = fd if own is None else own
            if not stat.S_ISREG(os.fstat(use).st_mode):
                return None, None
            data, want = b"", HOLDER_LIMIT + MAX_SOURCE + 1
            while len(data) < want:
                chunk = os.pread(use, want - len(data), len(data))
                if not chunk:
                    break
                data += chunk
        finally:
            if own is not None:
                os.close(own)
    except OSError:
        return None, None
    found = None
    if data.startswith(_HOLDER.encode()):
        line, _, data = data.partition(b"\n")
        try:
            found = json.loads(line[len(_HOLDER):].decode(errors="replace")) \
                if len(line) <= HOLDER_LIMIT else None
        except ValueError:
            found = None
    ok = isinstance(found, dict) and type(found.get("pid")) is int and found["pid"] > 0 \
        and isinstance(found.get("machine"), str)
    text = data.decode(errors="replace") if 0 < len(data) <= MAX_SOURCE else None
    return (found if ok else None), text


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, dead but not yet waited for
    by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's: it runs)
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != b"Z"


def _held_elsewhere(fd: int) -> bool | None:
    """Whether a process holds the lock open at ``fd`` (its flock: taken by the process that
    took the lock, and held by its build while that runs); None where the file system has
    no such locks."""
    if cbuild.fcntl is None:
        return None
    try:
        cbuild.fcntl.flock(fd, cbuild.fcntl.LOCK_SH | cbuild.fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    cbuild.fcntl.flock(fd, cbuild.fcntl.LOCK_UN)
    return False


def _stale(lock: Path) -> bool:
    """Whether ``lock`` is missing, or its build is over though the lock is left: no process
    holds it (its flock, held by the build's process while it runs) and it names this
    machine, or it is older than any build takes (``LOCK_LIMIT``: a builder on another
    machine, whose flock this file system may not show; one that names none). A live
    build's lock is not stale, however long it has run. Where the file system has no
    flock, the process it names on this machine is gone."""
    try:
        fd = os.open(lock, cbuild.READ_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:  # (a link, not followed, or a file that cannot be read: its age alone)
        try:
            return time.time() - os.lstat(lock).st_mtime > LOCK_LIMIT
        except FileNotFoundError:
            return True
    try:
        st = os.fstat(fd)
        if time.time() - st.st_mtime > LOCK_LIMIT:
            return True
        if not stat.S_ISREG(st.st_mode):  # (a FIFO, a directory: its age alone)
            return False
        held = _held_elsewhere(fd)
        if held:
            return False
        holder = _read_lock(lock, fd)[0]
        if holder is None or holder["machine"] != _machine():
            return False
        return held is False or not _alive(holder["pid"])
    finally:
        os.close(fd)


def _placed(target: Path) -> Path:
    """``target`` in the cache if its directory is safe, else in this process's private one."""
    return cbuild.safe_dir(target.parent) / target.name


# what keeps a compiler from running now but not later: no memory or no process slot to
# fork it (several processes building at once); not written as the build's failure
_TRANSIENT = (errno.ENOMEM, errno.EAGAIN)


def build(target: Path | None = None, text: str | None = None) -> str | None:
    """Compile the library into a temporary file and rename it into place (atomic: another
    process sees no library or a whole one) at ``target`` (default: ``_paths``'s, placed
    by ``_placed``); the compiler's complaint (also written beside the target: later
    processes do not build it again), or None. A compiler killed by a signal, or whose
    driver says the program it ran was (out of memory), or one stopped at the time limit
    or that could not be started for want of memory or processes, made no complaint about
    the source, nor did a build whose files could not be written or installed (a full disk,
    the compiler's files too): that is said, not written.
    ``text``: the source to compile (default ``TEXT``; the background build's, its parent's,
    which the target's key names)."""
    found = _paths()
    if found is None:
        return _why_not()
    command, default = found
    target = _placed(default) if target is None else target
    tmp = source = None
    doing = "written"  # (what an OSError stopped: writing its files, the compiler, the install)
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{target.stem}-", dir=target.parent)
        os.close(fd)
        fd, source = tempfile.mkstemp(suffix=".cpp", prefix=f".{target.stem}-",
                                      dir=target.parent)
        with os.fdopen(fd, "w") as f:
            f.write(TEXT if text is None else text)  # (the text keyed, whatever the file holds)
        command = [source if c == str(SOURCE) else c for c in command]
        doing = "run"
        proc = subprocess.run([*command, "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_LIMIT, stdin=subprocess.DEVNULL,
                              env=cbuild.compiler_env())
        if proc.returncode == 0:
            doing = "installed"
            cbuild.install(tmp, target)
            return None
        how = cbuild.killed(proc)
        if how is not None:  # (out of memory: no verdict on the source)
            return f"the C++ compiler {how}; a later process builds it again"
        room = cbuild.no_room(proc)
        if room is not None:  # (a full disk: no verdict on the source either)
            return (f"the C++ compiler could not write its files ({room}); a later process "
                    "builds it again")
        error = "the C++ compiler failed: " + (proc.stderr or proc.stdout)[-2000:]
    except subprocess.TimeoutExpired as e:  # (stopped at the limit, on a loaded machine)
        return (f"the C++ compiler ran past {e.timeout:g} s and was stopped; a later "
                "process builds it again")
    except OSError as e:
        if doing != "run":  # (a full disk, no file descriptor left: no verdict on the source)
            return (f"its files could not be {doing} in {target.parent}: {e}; a later "
                    "process builds it again")
        if e.errno in _TRANSIENT:  # (no memory, or no process, to run it now)
            return f"the C++ compiler could not run now: {e}; a later process builds it again"
        error = f"the C++ compiler could not run: {e}"
    except subprocess.SubprocessError as e:
        error = f"the C++ compiler could not run: {e}"
    finally:
        for leftover in (tmp, source):
            if leftover is not None and os.path.exists(leftover):
                os.unlink(leftover)
    error += f" (kept in {_failed_file(target)}: delete it to try again)"
    _record_failure(target, error)
    return error


def checkout_env() -> dict | None:
    """The environment of a Python process that imports vega (the build's, ``vega bench``'s
    timings in a process of their own): this one's, and where this vega is a source
    checkout's (pyproject.toml beside the package), that checkout first on PYTHONPATH, so
    that it imports this vega where the checkout is on this process's path only (a
    script beside it, a ``sys.path`` entry added by hand); None, unchanged, for an installed
    vega (its site directory first on the path could hide the standard library's modules)."""
    tree = Path(__file__).resolve().parents[3]
    if not (tree / "pyproject.toml").is_file():
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}


# the locks this process holds (each its descriptor, flocked): the build's, until it ends
_held: dict[Path, int] = {}
# the descriptors of the locks this process is taking (flocked, not yet in ``_held``)
_taking: set[int] = set()


def _taken(target: Path) -> Path | None:
    """The build lock of ``target``, taken by this process for a build of its own; None where
    another process holds it (``_stale``: building now). The lock is made whole (this
    process named in it as its taker, and the source, ``TEXT``, for the build) and flocked
    (``_held``) before it is linked into place, and the stale lock it replaces is removed
    and the new one linked under the directory's lock: of processes that find a lock stale
    at once, one takes it and the others find it held (else each would remove the lock
    there, whoever's, and make its own: each would build)."""
    lock = _lock(target)
    if not _stale(lock):
        return None
    fd, tmp = tempfile.mkstemp(prefix=f".{lock.name}-", dir=lock.parent)
    _taking.add(fd)  # (closed in a child forked before it is held: _forked)
    taken = False
    try:
        if cbuild.fcntl is not None:
            try:
                cbuild.fcntl.flock(fd, cbuild.fcntl.LOCK_EX | cbuild.fcntl.LOCK_NB)
            except OSError:  # (a file system without locks: the pid it names tells)
                pass
        data = (_HOLDER + json.dumps({"pid": os.getpid(), "machine": _machine()}) + "\n"
                + TEXT).encode()
        while data:
            data = data[os.write(fd, data):]
        with cbuild.locked(lock.parent, exclusive=True):
            if not _stale(lock):
                return None
            cbuild.remove(lock)
            try:
                os.link(tmp, lock)
            except FileExistsError:  # (taken just now where the directory has no lock)
                return None
            except OSError:  # (a file system without links)
                if os.path.lexists(lock):
                    return None
                os.rename(tmp, lock)
        if lock in _held:
            os.close(_held.pop(lock))
        _held[lock] = fd  # (before it leaves _taking: a fork between would keep it)
        taken = True
    finally:
        _taking.discard(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if not taken:
            os.close(fd)
    return lock


def _release(lock: Path) -> None:
    """Remove ``lock``, taken by this process (``_held``), if it is still the lock there (one
    past ``LOCK_LIMIT`` is replaced by the process that takes it over), and let it go."""
    fd = _held.pop(lock, None)
    try:
        with cbuild.locked(lock.parent, exclusive=True):
            try:
                there = os.lstat(lock)
            except FileNotFoundError:
                return
            mine = None if fd is None else os.fstat(fd)
            if mine is None or (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                lock.unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)


def _spawn(target: Path) -> None:
    """Build in a process of its own (``python -m vega.codegen.c.native``), unless another is
    building it now (its lock not stale): it installs the library even if this process
    ends first, and holds the lock while it runs (its descriptor of the lock, and so the
    flock, passed to it). A build that cannot start leaves the Python path."""
    lock = log = None
    try:
        lock = _taken(target)
        if lock is None:
            _state["pending"] = (target, None, None)
            return
        fd = _held[lock]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", "vega.codegen.c.native", str(lock),
                                 str(fd)], stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=checkout_env(), pass_fds=(fd,))
        _state["pending"] = (target, proc, log)
    except OSError as e:
        if log is not None:  # (the build's log, which no build writes)
            log.close()
        if lock is not None:
            _release(lock)
        _state["pending"], _state["failed"] = None, f"its build could not start: {e}"
        return
    os.close(_held.pop(lock))  # (the build's copy holds it)


def _same_key(lock: Path) -> bool:
    """Whether the library that ``lock`` asks for is named by this process's key (for a lock
    that holds no source: a parent that wrote none)."""
    found = _paths()
    return found is not None and found[1].name == _target_of(lock).name


MAX_SOURCE = 1 << 20  # bytes: native.cpp is some 40 KiB


def _forked() -> None:
    """In a child made by ``os.fork`` (a DataLoader's worker, a pool's process) while its
    parent's build runs: that build is not this process's child, so its exit status cannot
    be waited for (``poll`` would say 0 at once, and the build would be taken as failed);
    the child waits for it as for another process's, by its lock and its library. Its
    ``_lock_`` is new: one that another thread of the parent held at the fork would be held
    in the child for ever, and it lets go of its copies of the build locks its parent holds
    or is taking (held by the child, a lock would be held while it runs, after its parent's
    build)."""
    global _lock_
    _lock_ = threading.Lock()
    for fd in [*_held.values(), *_taking]:
        os.close(fd)
    _held.clear()
    _taking.clear()
    pending = _state["pending"]
    if pending is not None and pending[1] is not None:
        _state["pending"] = (pending[0], None, None)
        if pending[2] is not None:
            pending[2].close()  # (this process's copy of the log's descriptor)


os.register_at_fork(after_in_child=_forked)


WAIT_LIMIT = 900  # seconds: the most a step waits for a build (``BUILD_LIMIT`` and more)


def _poll(wait: bool) -> None:
    """Load the library if its build has finished (at most twice a second unless waiting)."""
    now = time.monotonic()
    if not wait and now < _state["next_poll"]:
        return
    _state["next_poll"] = now + 0.5
    target, proc, log = _state["pending"]
    stopped = False
    if proc is not None:
        if wait:
            try:
                proc.wait(timeout=WAIT_LIMIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                stopped = True
        elif proc.poll() is None:
            return
    else:  # another process builds it: wait for it (or for its lock to go stale)
        deadline = now + WAIT_LIMIT
        while not os.path.lexists(target) and not _stale(_lock(target)) and not \
                os.path.lexists(_failed_file(target)) and wait and time.monotonic() < deadline:
            time.sleep(0.2)
        if not os.path.lexists(target) and not os.path.lexists(_failed_file(target)):
            if _stale(_lock(target)):  # it died, or gave up: build here
                _spawn(target)
                if wait and _state["pending"] is not None:
                    _poll(True)
            return
    _state["pending"] = None
    if os.path.lexists(target):
        _state["module"], problem = _opened(target)
        if problem is not None and not problem.startswith((_BUILT, _NOW)):
            cbuild.warn_once(f"vega: not loading the native operator: {problem}")
        _state["failed"] = _unusable(target, problem)
    else:
        failure = recorded = _failure(target)
        if failure is None and log is not None:
            log.seek(0)
            failure = log.read().decode(errors="replace")[-2000:]
        if proc is not None and recorded is None and (stopped or not failure or
                                                      proc.returncode < 0):
            # (killed, or ended without a word: no verdict on the source, none recorded)
            how = f"ran past {WAIT_LIMIT} s and was stopped" if stopped else cbuild.killed(
                subprocess.CompletedProcess(proc.args, proc.returncode)) \
                or f"ended with status {proc.returncode} without a word"
            failure = f"its build process {how}; a later process builds it again" + (
                f":\n{failure}" if failure else "")
        _state["failed"] = failure or "the build failed"
    if log is not None:
        log.close()


def _off() -> bool:
    return os.environ.get("VEGA_NATIVE", "").lower() in ("0", "off", "false", "no")


def module(wait: bool | None = None):
    """The operator's Python module if it is ready, else None (starting its build on the first
    call). ``wait``: block until it is built (default: ``VEGA_NATIVE=sync``)."""
    module = _state["module"]
    if module is not None or _state["failed"] is not None:
        return module
    if _off():
        return None
    wait = os.environ.get("VEGA_NATIVE", "").lower() == "sync" if wait is None else wait
    with _lock_:
        if _state["module"] is not None or _state["failed"] is not None:
            return _state["module"]
        if _state["pending"] is not None:
            _poll(wait)
            return _state["module"]
        found = _paths()
        if found is None:
            _state["failed"] = _why_not()
            return None
        target = _placed(found[1])
        failure = _failure(target)
        if failure is not None:
            _state["failed"] = failure
            return None
        if os.path.lexists(target):
            _state["module"], problem = _opened(target)
            if _state["module"] is not None:
                return _state["module"]
            if problem.startswith(_NOW):
                _state["failed"] = problem
                return None
            if not problem.startswith(_BUILT):
                cbuild.warn_once(f"vega: not loading the native operator: {problem}; "
                                 f"rebuilding it")
            cbuild.remove(target)  # corrupt or untrusted: rebuilt
        if wait:
            try:
                lock = _taken(target)
            except OSError:  # (no lock can be made there: the build says what it can)
                lock = False
            if lock is None:  # another process builds it now: its library, not a second
                _state["pending"] = (target, None, None)  # build beside it (every rank of
                _poll(True)                               # a job with VEGA_NATIVE=sync)
                return _state["module"]
            try:
                error = build(target)
            finally:
                if lock:
                    _release(lock)
            if error is None:
                _state["module"], error = _opened(target)
            _state["failed"] = _unusable(target, error)
            return _state["module"]
        _spawn(target)
        if _state["pending"] is not None and _state["pending"][1] is None:
            _poll(False)  # (another process's build may have finished already)
        return None


def loaded():
    """The operator's Python module where it is loaded already, else None (no build started:
    for helpers that only go faster with it, ``vega.codegen.tensors.gather``)."""
    return _state["module"]


def status() -> str:
    """Whether steps use the operator, in words (``vega bench`` prints it)."""
    if _state["module"] is not None:
        return "native operator in use"
    if _off():
        return "native operator off (VEGA_NATIVE=0)"
    if _state["failed"] is not None:
        return f"native operator unavailable: {_state['failed']}"
    return "native operator still building" if _state["pending"] else \
        "native operator not started"


# the background build of ``_spawn``: python -m vega.codegen.c.native LOCK FD, FD its
# parent's descriptor of the lock (flocked), which it holds until it ends
if __name__ == "__main__":
    # It imports vega anew: one upgraded since its parent imported it, or another on its
    # path, has another native.cpp. It compiles the parent's, which the lock holds: another
    # under the name the parent asked for would be loaded as the parent's.
    lock = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if lock is not None and len(sys.argv) > 2:
        _held[lock] = int(sys.argv[2])
    try:  # the library goes where the lock is (the cache, or the parent's private directory)
        given = None if lock is None else _read_lock(lock, _held.get(lock))[1]
        if lock is None or given is not None or _same_key(lock):
            message = build(None if lock is None else _target_of(lock), given)
        else:
            message = (f"not building {_target_of(lock).name}: its lock holds no source, and "
                       "the vega this build imports has another native.cpp, compiler or torch "
                       "than that name's key: the library would not be the one it names")
    finally:
        if lock is not None:
            _release(lock)
    if message is not None:
        print(message, file=sys.stderr)
        sys.exit(1)
