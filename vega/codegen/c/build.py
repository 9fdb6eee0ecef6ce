"""The C toolchain: compile a kernel's source to a shared library, cached on disk.

The cache lives in ``$VEGA_CACHE_DIR`` (default ``$XDG_CACHE_HOME/vega``, or
``~/.cache/vega`` where ``XDG_CACHE_HOME`` is not set to an absolute path), one
``<key>.so`` per kernel in its ``c/`` directory, the key a hash of the source,
the compiler's version, the flags and the CPU ``-march=native`` builds for
(``target_cpu``). Libraries are written to a temporary name and renamed into
place, so two processes compiling the same kernel at once both succeed; a
library that does not load, or does not report its own key, is rebuilt.

Loading a library runs its code, so the cache is trusted only as far as it is
this user's own (``safe_dir``, ``untrusted``):

- the cache directory and its ``c/`` (or ``native/``) are created owner-only
  (0o700), and are used only if they are directories owned by this user, not
  writable by group or others, and writable by this user; where one is not (or
  ``VEGA_CACHE_DIR`` names a file, or a path under one), this process builds into
  a private directory of its own (``tempfile.mkdtemp``, removed at exit) instead,
  with a warning that names ``VEGA_CACHE_DIR``;
- a library is loaded only if it is a regular file (not a link, a FIFO, a
  directory) owned by this user, not writable by group or others, of at most
  ``LIBRARY_LIMIT`` bytes, and its SHA-256 is the one its build recorded beside it
  (``sha256-<name>``, a regular file of at most ``HASH_LIMIT`` bytes, written with
  it under the directory's lock, so that a reader sees a library and the hash of
  the same build); this is checked before it is opened, since opening runs its
  constructors, and without opening anything but a regular file (``read_capped``:
  a FIFO would block the read);
- what is loaded is a copy of the bytes checked, under a name of its own
  (``load_verified``), so that no later change to the cache reaches a mapped
  library and a rebuilt one is not handed the old one's handle;
- any other library is rebuilt in its place, with one warning per process
  (``warn_once``).
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import itertools
import os
import platform
import re
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from functools import cache
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: installs there are not locked
    fcntl = None

from vega.errors import VegaError, warn

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         "-fno-math-errno", "-ffp-contract=off", "-fno-strict-aliasing")
# in the keys: a cache written before libraries had their hashes recorded is not looked at
# (each of its libraries would only be rebuilt, with a warning)
FORMAT = "sha256-recorded"
_lock = threading.Lock()


def share_fenv(source: str) -> str:
    """``source`` with each OpenMP parallel region's threads computing in the calling
    thread's floating-point environment (its rounding, and whether it flushes subnormal
    values to zero: ``torch.set_flush_denormal(True)`` sets that on the calling thread
    alone, and the pool's other threads would keep their own, so that an element's value
    depended on which thread computed it, and on the thread count). Each region is wrapped
    in a block that reads the caller's environment; each thread takes it on entering the
    region and puts its own back on leaving. A ``parallel for`` becomes a ``parallel``
    region holding the ``for``: its ``schedule`` and ``simd`` go with the loop."""
    lines = source.split("\n")
    out: list[str] = []
    k = 0
    while k < len(lines):
        line = lines[k]
        m = re.match(r"^(\s*)#pragma omp parallel( for( simd)?)?\b(.*)$", line)
        if not m:
            out.append(line)
            k += 1
            continue
        ind, loop, simd, clauses = m.group(1), m.group(2), m.group(3), m.group(4)
        head = lines[k + 1]
        if not head.startswith(ind) or head[len(ind):][:1].isspace() or \
                not head.rstrip().endswith("{") or (not loop and head.strip() != "{"):
            raise AssertionError(f"a parallel region not followed by its block: {head!r}")
        end = next(j for j in range(k + 2, len(lines)) if lines[j].startswith(ind + "}")
                   and not lines[j][len(ind) + 1:].lstrip().startswith(("else", "while")))
        sched = re.search(r"\bschedule\([^)]*\)", clauses)
        par = re.sub(r"\s*\bschedule\([^)]*\)", "", clauses)
        body = lines[k + 1:end + 1]
        if loop:
            body = [ind + "{", ind + "    fesetenv(&vega_fe_caller);",
                    f"{ind}#pragma omp for{simd or ''}{' ' + sched.group(0) if sched else ''}",
                    *body, ind + "}"]
        else:
            body = [body[0], ind + "    fesetenv(&vega_fe_caller);", *body[1:]]
        # the thread's own environment back (its flags too): before the block's last brace
        body = [body[0], ind + "    fenv_t vega_fe_own; fegetenv(&vega_fe_own);", *body[1:-1],
                ind + "    fesetenv(&vega_fe_own);", body[-1]]
        out += [ind + "{  /* the caller's floating-point environment, in every thread */",
                ind + "fenv_t vega_fe_caller; fegetenv(&vega_fe_caller);",
                f"{ind}#pragma omp parallel{par}", *body, ind + "}"]
        k = end + 1
    return "\n".join(out)


class CompilerError(VegaError):
    """The C compiler rejected a generated kernel (a bug in vega, with the compiler's words),
    or cannot build vega's kernels here at all (``toolchain_problem``: what to install or
    set), or there is none."""


class CacheError(VegaError, OSError):
    """Neither the kernel cache directory nor a private temporary one can be used."""


def cache_dir() -> Path:
    """Where the kernels are cached (``safe_dir`` says whether they may be): a leading ``~``
    of ``VEGA_CACHE_DIR`` is the home directory (set where no shell expands it: a
    container's environment, a ``.env`` file), not a directory named ``~`` in the working
    directory. Unset, it is ``vega`` in ``XDG_CACHE_HOME`` where that is an absolute path
    (the XDG base directory rule, which torch's extension builder follows too; a relative
    one is ignored, as the rule says), else in ``~/.cache``. Where there is no home
    directory to hold the cache (no ``HOME``, and no entry in the password database: a
    container run under a uid of its own; or a ``~name`` of no user), this process's
    private directory, with one warning that says which."""
    root = os.environ.get("VEGA_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:
        if root:
            return Path(root).expanduser() / "c"
        return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "vega" / "c"
    except (RuntimeError, KeyError, OSError):  # (pathlib says "Could not determine home")
        head = Path(root).parts[0] if root else "~"  # (~ or ~name)
        problem = "this user's home directory cannot be determined (HOME is not set, and " \
            f"uid {os.geteuid()} has no entry in the password database)" if head == "~" else \
            f"the home directory {head} cannot be determined (no user {head[1:]!r} in the " \
            "password database)"
        return _private_root(Path(root or "~/.cache/vega"), problem) / "c"


_cache_warned = False


def warn_once(message: str) -> None:
    """Warn of a cache that cannot be trusted, once per process (not once per kernel)."""
    global _cache_warned
    if not _cache_warned:
        _cache_warned = True
        warn(f"{message} (further such problems in this process are not reported)",
             RuntimeWarning)


def _unsafe(st: os.stat_result) -> str | None:
    """What makes a file or directory with this status untrustworthy, or None."""
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if st.st_mode & bit)
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def _blocked(path: Path, error: OSError) -> str:
    """Why the directory ``path`` cannot be made or read: the first of its parents that is
    not a directory (a file where ``VEGA_CACHE_DIR`` names a directory under it), else the
    system's words."""
    for parent in reversed(path.parents):
        try:
            if not stat.S_ISDIR(os.stat(parent).st_mode):
                return f"{parent} is not a directory"
        except OSError:
            break
    return error.strerror or str(error)


def _private(path: Path) -> str | None:
    """Make the directory ``path`` owner-only where it is missing (its parents as the umask
    has them); what makes it unsafe or unusable to build into, or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)  # the umask can only take bits away
            os.chmod(path, 0o700)
        except FileExistsError:  # made by another process just now (or a parent is a file)
            pass
        except OSError as e:
            return f"it cannot be created ({_blocked(path, e)})"
        try:
            st = os.stat(path)
        except OSError as e:
            return f"it cannot be created ({_blocked(path, e)})"
    except OSError as e:
        how = "created" if isinstance(e, NotADirectoryError) else "read"
        return f"it cannot be {how} ({_blocked(path, e)})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is a file, not a directory" if stat.S_ISREG(st.st_mode) else \
            "it is not a directory"
    problem = _unsafe(st)
    if problem is None and not os.access(path, os.W_OK | os.X_OK):
        problem = "it is not writable"  # (a read-only file system, or mode 0o500)
    return problem


_fallback: Path | None = None  # this process's private directory, where the cache is unsafe


def _named() -> str:
    """Where the cache directory comes from, in words."""
    root = os.environ.get("VEGA_CACHE_DIR")
    if root:
        return f"VEGA_CACHE_DIR={root}"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return f"the default under XDG_CACHE_HOME={xdg}, as VEGA_CACHE_DIR is not set" \
        if os.path.isabs(xdg) else "the default, as VEGA_CACHE_DIR is not set"


def safe_dir(path: Path) -> Path:
    """``path`` (a directory in the cache, as ``cache_dir()``), created owner-only where
    missing, if it and the cache directory above it are this user's, not writable by group
    or others, and writable by this user; else the directory of the same name in a private
    directory of this process (removed at exit), with one warning that names
    ``VEGA_CACHE_DIR``. Raises ``CacheError`` where that private directory cannot be made
    either."""
    for directory in (path.parent, path):
        problem = _private(directory)
        if problem is not None:
            break
    else:
        return path
    private = _private_root(directory, problem) / path.name
    private.mkdir(mode=0o700, exist_ok=True)
    return private


def _private_root(directory: Path, problem: str) -> Path:
    """This process's private directory (made on the first call, removed at exit), in place
    of the cache directory ``directory``, which ``problem`` keeps from use: said in one
    warning that names ``VEGA_CACHE_DIR``. Raises ``CacheError`` where it cannot be made."""
    global _fallback
    if _fallback is None or not os.path.isdir(_fallback):  # (gone: a forked child's parent's)
        try:
            _fallback = Path(tempfile.mkdtemp(prefix="vega-cache-"))  # 0o700, a new name
        except OSError as e:
            raise CacheError(
                f"vega: the kernel cache directory {directory} ({_named()}) cannot be used: "
                f"{problem}; nor can a private one be made in {tempfile.gettempdir()} "
                f"({e.strerror}); set VEGA_CACHE_DIR to a directory of your own") from e
        atexit.register(_remove_private, _fallback, os.getpid())
    warn_once(f"vega: not using the kernel cache directory {directory} ({_named()}): "
              f"{problem}; building into {_fallback}, private to this process and removed "
              f"at exit, instead (set VEGA_CACHE_DIR to a directory of your own to keep "
              f"kernels between runs)")
    return _fallback


def _remove_private(path: Path, owner: int) -> None:
    """At exit, remove the private directory ``path`` if this process (pid ``owner``) made
    it: a child made by ``os.fork`` that ends as a script does runs its parent's exit
    handlers too, and would take the directory from under its parent. A child builds into
    its parent's directory, or into one of its own once its parent's is gone (the parent
    ended first)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def _forked() -> None:
    """In a child made by ``os.fork``: new locks, as one that another thread of the parent
    held at the fork (building a kernel) would be held in the child for ever, by a thread
    the child does not have."""
    global _lock, _loaded_lock
    _lock, _loaded_lock = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_forked)


def hash_file(path: Path) -> Path:
    """Where the SHA-256 of the library at ``path`` is recorded."""
    return path.with_name(f"sha256-{path.name}")


@contextmanager
def locked(directory: Path, exclusive: bool):
    """Hold ``directory``'s lock (flock on the directory itself): installs take it
    exclusive, readers shared, so that a reader sees a library and its hash of one build.
    It is let go by unlocking, not by closing its descriptor alone: a flock belongs to the
    open file, which a child made by ``os.fork`` while it is held (a DataLoader's worker,
    forked while another thread installs) shares, and would hold while it runs."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(directory, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:  # a file system without locks: unlocked, as before
            pass
    try:
        yield
    finally:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)


# not following a link, not inherited by compilers, and not waiting on a FIFO (its open for
# reading blocks until something writes to it; O_NONBLOCK makes no difference to a file)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | \
    getattr(os, "O_NONBLOCK", 0)
LIBRARY_LIMIT = 64 << 20  # bytes: a kernel's library is some 100 KB, the native operator's a few MB
HASH_LIMIT = 4096  # bytes: a recorded SHA-256 is one line
COMPILE_TIMEOUT = 300  # seconds a kernel's compile may take (a shipped spec's: about one)
_KINDS = ((stat.S_ISLNK, "a symbolic link (a link is not followed)"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(st: os.stat_result) -> str | None:
    """Why an entry with this (l)status is not a regular file, or None."""
    if stat.S_ISREG(st.st_mode):
        return None
    kind = next((what for test, what in _KINDS if test(st.st_mode)), "no regular file")
    return f"it is not a regular file but {kind}"


def read_capped(path: Path, limit: int) -> tuple[bytes | None, str | None]:
    """The bytes of the regular file at ``path``, of this user's and not writable by group or
    others, at most ``limit`` of them, read from one open file; or (None, why not). Nothing
    else is opened (a FIFO, a device), no link followed, and nothing larger read."""
    try:
        problem = _not_regular(os.lstat(path))
    except OSError as e:
        return None, f"it cannot be read ({e.strerror})"
    if problem is not None:
        return None, problem
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        return None, f"it cannot be opened ({e.strerror}; a link is not followed)"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())  # (what was opened: it may have been replaced since)
        problem = _not_regular(st) or _unsafe(st)
        if problem is None and st.st_size > limit:
            problem = f"it is {st.st_size} bytes, more than the {limit} it may be"
        if problem is not None:
            return None, problem
        data = f.read(limit + 1)
        return (None, f"it grew past {limit} bytes") if len(data) > limit else (data, None)


def _verified(path: Path) -> tuple[bytes | None, str | None]:
    """The bytes of the library at ``path`` if they may be loaded, else (None, why not)."""
    data, problem = read_capped(path, LIBRARY_LIMIT)
    if problem is not None:
        return None, problem
    recorded = hash_file(path)
    if not os.path.lexists(recorded):
        return None, f"no SHA-256 was recorded for it ({recorded.name} is missing)"
    digest, problem = read_capped(recorded, HASH_LIMIT)
    if problem is not None:
        return None, f"its recorded SHA-256 {recorded.name} is unusable: {problem}"
    if digest.split()[:1] != [hashlib.sha256(data).hexdigest().encode()]:
        return None, f"its SHA-256 differs from the one its build recorded in {recorded.name}"
    return data, None


def untrusted(path: Path) -> str | None:
    """Why the library at ``path`` must not be loaded, or None where it may: it must be a
    regular file of this user's, not writable by group or others, of at most
    ``LIBRARY_LIMIT`` bytes, and hash to the SHA-256 recorded beside it."""
    return _verified(path)[1]


def remove(path: Path) -> None:
    """Remove whatever is at ``path`` in the cache (a file, a link, a FIFO, a directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def install(built: str | Path, target: Path) -> None:
    """Move the library ``built`` (in ``target``'s directory) to ``target``, owner-only,
    its SHA-256 recorded beside it: both renamed into place (atomic: a reader sees the old
    file or the new one) under the directory's lock."""
    os.chmod(built, 0o700)
    with open(built, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    fd, tmp = tempfile.mkstemp(suffix=".sha256", prefix=f".{target.name}-", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {target.name}\n")  # as sha256sum writes it
        with locked(target.parent, exclusive=True):
            for path in (hash_file(target), target):  # (a directory there is not replaced)
                if os.path.isdir(path) and not os.path.islink(path):
                    remove(path)
            os.replace(tmp, hash_file(target))
            os.replace(built, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_copies = itertools.count()


def load_verified(path: Path, load):
    """``(load(copy), None)`` if the library at ``path`` may be loaded (``untrusted``), else
    ``(None, why not)``. It is checked under its directory's lock, so that no install comes
    in between, and what is loaded is a copy of the very bytes checked, under a name of its
    own (removed once loaded): no later change to the file in the cache can reach a library
    once mapped (a file truncated under a mapping kills the process with SIGBUS), and a
    library rebuilt at the same path is not handed the old one (the dynamic loader keeps
    libraries by path, and never unloads a ctypes one)."""
    with locked(path.parent, exclusive=False):
        data, problem = _verified(path)
    if problem is not None:
        return None, problem
    suffix = path.name[path.name.index("."):] if "." in path.name else ""
    fd, copy = tempfile.mkstemp(suffix=suffix, dir=path.parent,
                                prefix=f".load-{os.getpid()}-{next(_copies)}-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(copy, 0o700)
        return load(Path(copy)), None
    finally:
        os.unlink(copy)


class Compiler(tuple):
    """A compiler found: (path of its program, first line of its ``--version``), and
    ``args``, the words after the program where ``CC`` or ``CXX`` gives a command
    (``CC='ccache gcc'``: ``/usr/bin/ccache`` and ``('gcc',)``). Run as ``command(cc)``."""

    def __new__(cls, path: str, version: str, args=()):
        self = super().__new__(cls, (path, version))
        self.args = tuple(args)
        return self

    def __getnewargs__(self):
        return (self[0], self[1], self.args)

    def __repr__(self) -> str:
        return f"Compiler({self[0]!r}, {self[1]!r}, args={self.args!r})"


def command(cc) -> list[str]:
    """The words that run compiler ``cc`` (a ``Compiler``, or a (path, version) pair): its
    program, then the arguments its variable gave."""
    return [cc[0], *getattr(cc, "args", ())]


def shown(cc) -> str:
    """Compiler ``cc``'s command, as a shell would take it."""
    return shlex.join(command(cc))


def identity(cc) -> str:
    """What a cache key holds of compiler ``cc``: its version line, and where its variable
    gave a command with arguments, the whole command (``gcc -O0`` builds other code than
    ``gcc``; a plain compiler's keys are as they were)."""
    return cc[1] if not getattr(cc, "args", ()) else f"{cc[1]}\0{shown(cc)}"


@cache
def compiler() -> Compiler | None:
    """(path, version line) of the C compiler, or None where there is none (a ``Compiler``:
    ``command`` runs it)."""
    return named_compiler("CC", "C", "cc", "gcc", "clang")


def named_compiler(variable: str, language: str, *others: str) -> Compiler | None:
    """``find_compiler`` of the compiler the environment variable ``variable`` names, else of
    the first of ``others``. The variable names a program (a path, or a name on the PATH;
    a path with spaces too) or, as make and setuptools take it, a command with arguments,
    split as a shell splits it (``CC='ccache gcc'``, ``CC='gcc -m32'``): the arguments come
    before vega's on every run of it. A compiler the user named that is not found, or does
    not run, is passed over with a warning that names the variable and its value, and the
    compiler taken instead (it had been passed over without a word, and kernels built by
    another compiler than the one asked for)."""
    named = os.environ.get(variable)
    if not named:
        return find_compiler(*others)
    found = find_compiler(named)
    if found is None:
        try:
            words = shlex.split(named)
        except ValueError:  # (an unclosed quote)
            words = []
        if words and words != [named]:
            found = _answers(words)
    if found is not None:
        return found
    found = find_compiler(*others)
    instead = f"building with {found[0]} instead" if found is not None else \
        f"and no other {language} compiler ({', '.join(others)}) is found either"
    warn(f"vega: {variable}={named!r} names no {language} compiler that runs here (its "
         f"program is not found on the PATH, or it does not answer --version); "
         f"{instead}", RuntimeWarning)
    return found


def find_compiler(*names: str | None) -> Compiler | None:
    """(path, version line) of the first of ``names`` (None: skipped), each one program,
    that is on the PATH and answers ``--version``, or None."""
    for name in names:
        found = _answers([name]) if name else None
        if found is not None:
            return found
    return None


def _answers(words: list[str]) -> Compiler | None:
    """The compiler that the command ``words`` runs, if its program is on the PATH and the
    command answers ``--version``; else None."""
    path = shutil.which(words[0])
    if path is None:
        return None
    try:
        out = subprocess.run([path, *words[1:], "--version"], capture_output=True, text=True,
                             timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return Compiler(path, (out.stdout.splitlines() or [""])[0], words[1:])


_warned = False


def available() -> bool:
    """Whether kernels can be compiled here; warns once when they cannot."""
    global _warned
    if compiler() is not None:
        return True
    if not _warned:
        warn("vega: no C compiler found (set CC, or install gcc or clang); CPU steps "
             "run on the slower reference backend", RuntimeWarning)
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


def compiler_env() -> dict[str, str]:
    """The environment a compiler runs in: this process's, in the C locale, so that what it
    says is in the words ``killed`` and ``toolchain_problem`` read (a gcc in another
    language said its program was killed in that language, and the build was recorded as
    failed)."""
    return {**os.environ, "LC_ALL": "C"}


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
            proc = subprocess.run([*command(cc), "-march=native", "-E", "-v", "-x", "c",
                                   "-"],
                                  capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL, env=compiler_env())
            found = _native_target(proc.stderr) if proc.returncode == 0 else None
            if found:
                return found
        except (OSError, subprocess.SubprocessError):
            pass
    return _cpuinfo()


# what a compiler driver says where the program it ran was killed (gcc: "c++: fatal error:
# Killed signal terminated program cc1plus", and it exits 1; clang: "unable to execute
# command: Killed"): by the out-of-memory killer, or stopped from outside
_KILLED = re.compile(r"\b(Killed|Terminated|Interrupt) signal terminated program|"
                     r"unable to execute command: (Killed|Terminated|Interrupt)")


# the signals that kill a compiler from outside (the out-of-memory killer, a time limit, the
# user): a status of 128 plus one of them is a shell's report of it. Not SIGSEGV or SIGABRT,
# which are a compiler's own crash, a verdict on the source it was given
_SHELL_KILLS = {signal.SIGHUP, signal.SIGINT, signal.SIGKILL, signal.SIGTERM}


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "an unknown signal"


def killed(proc: subprocess.CompletedProcess) -> str | None:
    """How the compiler run ``proc`` (its output captured as text) was killed by a signal,
    itself or the program its driver ran (out of memory: no verdict on the source), in
    words; None where it ran to its end. A wrapper run by a shell (``CC="ccache gcc"`` in a
    script, a shell function) says a program killed by signal n with the status 128 + n."""
    if proc.returncode < 0:
        return f"was killed by signal {-proc.returncode} ({_signal_name(-proc.returncode)})"
    if proc.returncode - 128 in _SHELL_KILLS:
        n = proc.returncode - 128
        return (f"ended with status {proc.returncode}, a shell's word for a program killed by "
                f"signal {n} ({_signal_name(n)})")
    found = _KILLED.search(proc.stderr or "")
    return None if proc.returncode == 0 or found is None else \
        f"had the program it ran killed ({found.group(0)})"


# what a compiler says where a file it writes found no room (gcc: "fatal error: error
# writing to /tmp/ccX.s: No space left on device"; ld: "final link failed: No space left on
# device"; a quota), in the C locale it runs in (``compiler_env``): no verdict on the source
_NO_ROOM = re.compile(r".*\b(No space left on device|Disk quota exceeded)\b.*")


def no_room(proc: subprocess.CompletedProcess) -> str | None:
    """The line in which the compiler run ``proc`` (its output captured as text) says that a
    file it wrote found no room (a full disk or quota), where it failed; else None."""
    found = _NO_ROOM.search(f"{proc.stderr or ''}\n{proc.stdout or ''}")
    return None if proc.returncode == 0 or found is None else found.group(0).strip()


def key_of(source: str) -> str:
    """The cache key of ``source``: a hash of it, the compiler's version, the flags and the
    target CPU."""
    cc = compiler()
    text = "\0".join([source, identity(cc) if cc else "", *FLAGS, target_cpu(), FORMAT])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load(path: Path, key: str):
    """The library at ``path`` if it loads and reports ``key``; else why not, in words (the
    loader's, where it refuses the file: a cache on a file system mounted noexec)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"the loader refuses it: {e}"
    try:
        lib.vega_key.restype = ctypes.c_char_p
        found = lib.vega_key().decode()
    except (AttributeError, UnicodeDecodeError):
        return "it reports no key"
    return lib if found == key else f"it reports another key ({found!r})"


# cache key -> the library this process loaded for it (``library``)
_LOADED: dict[str, ctypes.CDLL] = {}
_loaded_lock = threading.Lock()


def library(source: str) -> ctypes.CDLL:
    """The loaded library for ``source``: the one this process loaded already for the same
    key, else ``build``'s. A library is never unloaded, and each load maps a copy of its
    own (``load_verified``): a program that compiles the same spec again and again (a
    search over hyperparameters that calls ``vega.compile`` in each trial) would otherwise
    map one more copy each time, until the process runs out of memory maps."""
    key = key_of(source)
    with _loaded_lock:
        lib = _LOADED.get(key)
        if lib is None:
            lib = _LOADED[key] = build(source)[0]
        return lib


def build(source: str) -> tuple[ctypes.CDLL, Path, bool]:
    """The loaded library for ``source``: (library, path, whether it was compiled now).

    The source must define ``const char *vega_key(void)`` returning the
    placeholder ``@KEY@``, which is replaced by the cache key.
    """
    cc = compiler()
    if cc is None:
        raise CompilerError("backend 'c' compiles its kernels with a C compiler, and none is "
                            "found here: set CC, or install gcc or clang; or step on "
                            "backend='reference'")
    key = key_of(source)
    source = source.replace("@KEY@", key)
    with _lock:
        out_dir = safe_dir(cache_dir())
        target = out_dir / f"{key}.so"
        if os.path.lexists(target):
            lib, problem = load_verified(target, lambda path: _load(path, key))
            if problem is None and not isinstance(lib, str):
                return lib, target, False
            warn_once(f"vega: not loading the cached kernel {target}: {problem or lib}; "
                      f"rebuilding it")
        fd, tmp_c = tempfile.mkstemp(suffix=".c", prefix=f".{key}-", dir=out_dir)
        tmp_so = tmp_c[:-2] + ".so"
        try:
            with os.fdopen(fd, "w") as f:
                f.write(source)
            try:
                proc = subprocess.run([*command(cc), *FLAGS, tmp_c, "-o", tmp_so, "-lm"],
                                      capture_output=True, text=True, timeout=COMPILE_TIMEOUT,
                                      env=compiler_env())
            except subprocess.TimeoutExpired:  # (no verdict on the source either)
                raise CompilerError(
                    f"{shown(cc)} did not finish compiling a generated kernel ({len(source)} "
                    f"bytes of C) in {COMPILE_TIMEOUT} s, and was stopped: on a loaded machine a "
                    "later step compiles it again; a spec this large steps on "
                    "backend='reference'") from None
            except OSError as e:
                if e.errno not in (errno.ENOMEM, errno.EAGAIN):
                    raise
                raise CompilerError(f"{shown(cc)} could not be started to compile a kernel: "
                                    f"{e.strerror}; a later step compiles it again") from None
            how = killed(proc)
            if how is not None:
                raise CompilerError(f"{shown(cc)} {how} while compiling a kernel (out of "
                                    f"memory?); a later step compiles it again")
            room = no_room(proc)
            if room is not None:  # (a full disk: the probe would fail too)
                raise CompilerError(f"{shown(cc)} found no room for its files while compiling "
                                    f"a kernel ({room}): free some space in {out_dir} and the "
                                    f"temporary directory; a later step compiles it again")
            if proc.returncode != 0:
                raise CompilerError(toolchain_problem(cc, out_dir) or
                                    f"{shown(cc)} failed on a generated kernel (a bug in vega; "
                                    f"please report it):\n{proc.stderr[-4000:]}")
            install(tmp_so, target)
        finally:
            for leftover in (tmp_c, tmp_so):
                if os.path.exists(leftover):
                    os.unlink(leftover)
        lib, problem = load_verified(target, lambda path: _load(path, key))
        if problem is not None or isinstance(lib, str):
            raise CompilerError(f"the compiled kernel {target} does not load: {problem or lib}")
        return lib, target, True


# what every kernel asks of the toolchain: the C library's headers, libm, an OpenMP loop, a
# shared library with vega's flags
PROBE = """#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
double vega_probe(const double *x, int64_t n) {
    double total = 0;
    #pragma omp parallel for reduction(+:total)
    for (int64_t i = 0; i < n; i++) total += sqrt(x[i]);
    return total;
}
"""


def toolchain_problem(cc: tuple[str, str], directory: Path) -> str | None:
    """Where ``cc`` failed on a kernel: whether it fails on ``PROBE`` too (built in
    ``directory``), that is, cannot build any kernel here (no OpenMP runtime for -fopenmp,
    no C headers), said with what to do; None where the probe builds (the kernel was at
    fault, or the probe could not be run: the kernel's own error stands)."""
    src = out = None
    try:
        fd, src = tempfile.mkstemp(suffix=".c", prefix=".probe-", dir=directory)
        out = src[:-2] + ".so"
        with os.fdopen(fd, "w") as f:
            f.write(PROBE)
        proc = subprocess.run([*command(cc), *FLAGS, src, "-o", out, "-lm"],
                              capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL,
                              env=compiler_env())
    except (OSError, subprocess.SubprocessError):  # (a full disk: no word on the compiler)
        return None
    finally:
        for leftover in (src, out):
            if leftover is not None and os.path.exists(leftover):
                os.unlink(leftover)
    if proc.returncode == 0:
        return None
    said = (proc.stderr or proc.stdout)[-2000:]
    return (f"vega: the C compiler {shown(cc)} ({cc[1]}) cannot build vega's C kernels here: it "
            f"fails on a minimal OpenMP library with their flags ({' '.join(FLAGS)}) too:\n"
            f"{said.rstrip()}\nInstall what it lacks (for -fopenmp, libgomp with gcc or "
            f"libomp with clang; the C library's headers), set CC to a C compiler that "
            f"builds it, or pass backend='reference' (slower)")
