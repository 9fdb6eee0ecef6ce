"""The C backend's native operator is built like the kernels are cached (atomic, a corrupt file
rebuilt, a failure remembered, off with VEGA_NATIVE=0), in the background, and loaded once
per process."""
import contextlib
import errno
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import vega
from vega.codegen.c import native

REPO = Path(vega.__file__).resolve().parents[1]

needs_cxx = pytest.mark.skipif(native._paths() is None,
                               reason="no C++ compiler or Python headers here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A new cache directory and no operator loaded; the session's back afterwards."""
    saved = dict(native._state)
    monkeypatch.setenv("VEGA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VEGA_NATIVE", raising=False)
    native._state.update(module=None, pending=None, failed=None, next_poll=0.0)
    yield tmp_path
    native._state.clear()
    native._state.update(saved)


@needs_cxx
def test_built_once_in_the_background_then_loaded_from_the_cache(copying, fresh, monkeypatch,
                                                                  tmp_path):
    # the build's own process finds the stand-in as its C++ compiler (CXX)
    stand_in = tmp_path / "c++"
    stand_in.write_text(f"#!{sys.executable}\nimport shutil, sys\n"
                        f"print('stand-in 1') if sys.argv[1:] == ['--version'] else "
                        f"shutil.copy({str(copying)!r}, sys.argv[-1])\n")
    stand_in.chmod(0o700)
    monkeypatch.setenv("CXX", str(stand_in))
    assert native.module() is None  # the build starts in a process of its own
    assert native.status() == "native operator still building"
    deadline = time.monotonic() + 600
    while native.module() is None and time.monotonic() < deadline:
        assert native._state["failed"] is None, native._state["failed"]
        time.sleep(0.2)
    assert native.module() is not None
    libraries = list((fresh / "native").glob("vega_native-*"))
    assert [p.name for p in libraries if p.name.endswith(".building")] == []
    assert len(libraries) == 1 and not list((fresh / "native").glob(".*"))  # no leftovers
    native._state.update(module=None, pending=None, failed=None)
    began = time.monotonic()
    assert native.module() is not None  # from the cache, at once
    assert time.monotonic() - began < 5


@needs_cxx
def test_a_corrupt_library_is_rebuilt(copying, fresh, monkeypatch):
    _, target = native._paths()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a shared library")  # as a build cut short might leave
    monkeypatch.setattr(native.cbuild, "_cache_warned", False)  # (one warning a process)
    with pytest.warns(RuntimeWarning, match=r"^vega: not loading the native operator: .* is "
                                            r"not trusted: .*; rebuilding it"):
        assert native.module(wait=True) is not None
    assert target.read_bytes() == copying.read_bytes()


def test_off_with_vega_native_0(fresh, monkeypatch):
    monkeypatch.setenv("VEGA_NATIVE", "0")
    assert native.module() is None and native.module(wait=True) is None
    assert native.status() == "native operator off (VEGA_NATIVE=0)"
    assert not (fresh / "native").exists()  # nothing built


def test_no_compiler_means_the_python_path(fresh, monkeypatch):
    monkeypatch.setattr(native, "_paths", lambda: None)
    assert native.module(wait=True) is None
    assert "no C++ compiler" in native.status()
    # and a C step still runs, on the Python path
    import vega
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    vega.optim.SGD([p], lr=0.5, backend="c").step()
    assert torch.equal(p.detach(), torch.full((4,), 0.5))


def test_the_background_build_imports_this_checkouts_vega(fresh, monkeypatch, tmp_path):
    # the build is "python -m vega.codegen.c.native": where this checkout is on the path of
    # this process only (a script beside it), it found no vega, or another one
    seen = {}

    class Recorded:
        pid = os.getpid()  # (a process that runs)

        def __init__(self, args, **kwargs):
            seen.update(args=args, env=kwargs.get("env"))

        def poll(self):
            return 1
    monkeypatch.setattr(native.subprocess, "Popen", Recorded)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    target = tmp_path / "native" / "vega_native-test.so"
    target.parent.mkdir()
    native._spawn(target)
    tree = os.path.abspath(os.path.join(os.path.dirname(native.__file__), *[".."] * 3))
    assert seen["args"][1:3] == ["-m", "vega.codegen.c.native"]
    assert os.path.isfile(os.path.join(tree, "pyproject.toml"))  # (the tests' checkout)
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [tree, "elsewhere"]
    native._lock(target).unlink()
    native._state["pending"][2].close()  # (the build's log)


WITHOUT_SETUPTOOLS = r"""
import json, sys
sys.modules["setuptools"] = None  # its import fails, as where it is not installed
import torch, vega
from vega.codegen.c import native
p = torch.nn.Parameter(torch.ones(4))
p.grad = torch.ones(4)
vega.optim.SGD([p], lr=0.5, backend="c").step()
print(json.dumps({"p": p.tolist(), "status": native.status()}))
"""


def test_vega_imports_and_steps_without_setuptools(tmp_path):
    # torch.utils.cpp_extension, which the operator's build asks for torch's paths, imports
    # setuptools (torch asks for it, but an install may lack it): import vega failed without it
    from vega.codegen.c import build as cbuild
    if cbuild.compiler() is None:
        pytest.skip("no C compiler here")
    repo = os.path.abspath(os.path.join(os.path.dirname(native.__file__), *[".."] * 3))
    env = {**os.environ, "PYTHONPATH": repo,
           "VEGA_CACHE_DIR": str(tmp_path), "VEGA_NATIVE": "sync"}
    run = subprocess.run([sys.executable, "-c", WITHOUT_SETUPTOOLS], capture_output=True,
                         text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = json.loads(run.stdout.splitlines()[-1])
    assert ran["p"] == [0.5] * 4
    assert "torch.utils.cpp_extension cannot be imported" in ran["status"], ran["status"]
    assert not (tmp_path / "native").exists()


@needs_cxx
def test_a_failing_compiler_is_said_once_and_remembered(fresh, monkeypatch):
    command, target = native._paths()
    failing = [sys.executable, "-c", "import sys; sys.exit('the compiler says no')"]
    monkeypatch.setattr(native, "_paths", lambda: (failing, target))
    assert native.module(wait=True) is None
    assert "the compiler says no" in native.status()
    assert native._failed_file(target).exists()
    native._state.update(module=None, pending=None, failed=None)
    assert native.module() is None  # no second build: the failure is remembered
    assert native._state["pending"] is None and "the compiler says no" in native.status()


KILLED = {  # a compiler killed, and what is said of it
    "itself": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
               "was killed by signal 9 (SIGKILL)"),
    # gcc's driver, whose cc1plus the out-of-memory killer took: it says so and exits 1
    "its program": ("import sys; sys.exit('c++: fatal error: Killed signal terminated "
                    "program cc1plus')", "Killed signal terminated program"),
    # a wrapper run by a shell (ccache in a script), whose compiler was killed: 128 + 9
    "under a shell": ("import sys; sys.exit(137)", "ended with status 137, a shell's word for "
                      "a program killed by signal 9 (SIGKILL)"),
    # the same driver in another language, as the user's locale has it: it runs in C's
    "its program, in a locale": (
        "import os, sys; sys.exit('c++: fatal error: Killed signal terminated program "
        "cc1plus' if os.environ.get('LC_ALL') == 'C' else 'c++: erreur fatale: le signal "
        "Killed a terminé le programme cc1plus')", "Killed signal terminated program"),
}


@needs_cxx
@pytest.mark.parametrize("how", sorted(KILLED))
def test_a_compiler_killed_by_a_signal_is_not_remembered(fresh, monkeypatch, how):
    """A compiler killed by a signal (the kernel's out-of-memory killer: several processes
    building at once on a small machine) said nothing of the source, but its failure was
    recorded beside the target: no later process built the operator again until the record
    was deleted by hand. It is said in this process alone; the next one builds again."""
    command, target = native._paths()
    code, said = KILLED[how]
    monkeypatch.setattr(native, "_paths", lambda: ([sys.executable, "-c", code], target))
    assert native.module(wait=True) is None
    assert said in native.status() and "a later process builds it again" in native.status()
    assert not native._failed_file(target).exists()
    assert not [f for f in os.listdir(target.parent) if f.startswith(".")]  # no temporaries
    native._state.update(module=None, pending=None, failed=None)
    says_no = [sys.executable, "-c", "import sys; sys.exit('built again')"]
    monkeypatch.setattr(native, "_paths", lambda: (says_no, target))
    assert native.module(wait=True) is None
    assert "built again" in native.status()  # (a build ran: nothing kept it from trying)


STOPPED = {  # a compiler that could not finish or start now, and what is said of it
    "past its time": (subprocess.TimeoutExpired(["c++"], 600), "ran past 600 s"),
    "no memory": (OSError(errno.ENOMEM, "Cannot allocate memory"), "Cannot allocate memory"),
}


@needs_cxx
@pytest.mark.parametrize("how", sorted(STOPPED))
def test_a_compiler_stopped_or_not_started_now_is_not_remembered(fresh, monkeypatch, how):
    """A build stopped at its time limit (several processes building at once on a small
    machine), or whose compiler could not be forked for want of memory, said nothing of the
    source, but was recorded beside the target as failed: no later process built the
    operator again until the record was deleted by hand. The next one builds again."""
    found = native._paths()
    error, said = STOPPED[how]

    def stopped(*args, **kwargs):
        raise error
    monkeypatch.setattr(native, "_paths", lambda: found)
    monkeypatch.setattr(native.subprocess, "run", stopped)
    assert native.module(wait=True) is None
    assert said in native.status() and "a later process builds it again" in native.status()
    assert not native._failed_file(found[1]).exists()
    assert not [f for f in os.listdir(found[1].parent) if f.startswith(".")]


@needs_cxx
def test_a_build_that_cannot_start_leaves_the_python_path(fresh, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(native.subprocess, "Popen", refuse)
    logs, make = [], tempfile.TemporaryFile

    def log_file():
        logs.append(make())
        return logs[-1]
    monkeypatch.setattr(native.tempfile, "TemporaryFile", log_file)
    assert native.module() is None
    assert "could not start" in native.status()
    _, target = native._paths()
    assert not native._lock(target).exists()
    assert logs and all(f.closed for f in logs)  # (left open: a ResourceWarning)


@needs_cxx
def test_a_stale_lock_is_taken_over(copying, fresh, monkeypatch):
    _, target = native._paths()
    target.parent.mkdir(parents=True)
    lock = native._lock(target)
    lock.touch()
    assert native.module() is None
    assert native._state["pending"][1] is None  # a fresh lock: another process builds
    an_hour_ago = time.time() - 3600
    os.utime(lock, (an_hour_ago, an_hour_ago))  # ... which died
    native._state["next_poll"] = 0.0
    # this process builds it now (in a process of its own, which the stand-in compiler
    # cannot reach: here)
    spawned = []

    def spawn(t):
        spawned.append(t)
        native.build(t)
        native._state["pending"] = (t, None, None)
    monkeypatch.setattr(native, "_spawn", spawn)
    native.module()
    assert spawned == [target]
    assert native.module(wait=True) is not None
    assert target.exists()


def _aged(lock, age):
    then = time.time() - age
    os.utime(lock, (then, then))


def test_a_lock_is_stale_when_its_builder_is_gone_not_when_it_is_old(tmp_path):
    """A build may run for ten minutes (its compiler's limit): a lock older than two minutes
    was taken as its builder's death, and a second process built beside a live build on a
    loaded machine. A lock is held by its builder (a flock) and names its machine: it is
    stale once no process holds it, at once, or once it is older than a build may take,
    whoever holds it."""
    target = tmp_path / "vega_native-0.so"
    lock = native._taken(target)  # this process builds...
    assert lock == native._lock(target)
    assert native._read_lock(lock) == ({"pid": os.getpid(), "machine": native._machine()},
                                       native.TEXT)
    _aged(lock, 300)  # ... for five minutes now
    assert not native._stale(lock) and native._taken(target) is None
    native._release(lock)
    assert not lock.exists()
    pid = os.fork()
    if pid == 0:  # a build whose process dies...
        os._exit(0 if native._taken(target) == lock else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert native._read_lock(lock)[0]["pid"] == pid
    assert native._stale(lock)  # ... at once
    assert native._taken(target) == lock and not native._stale(lock)  # (taken over)
    _aged(lock, native.LOCK_LIMIT + 5)  # a live holder past any build's time
    assert native._stale(lock)
    native._release(lock)
    lock.write_text(native.TEXT)  # a lock that names no builder: its age alone
    assert native._read_lock(lock) == (None, native.TEXT)
    assert not native._stale(lock)
    _aged(lock, native.LOCK_LIMIT + 5)
    assert native._stale(lock)
    lock.unlink()
    os.mkfifo(lock)  # (not opened for a read that would wait for a writer: its age alone)
    assert not native._stale(lock) and native._read_lock(lock) == (None, None)
    _aged(lock, native.LOCK_LIMIT + 5)
    assert native._stale(lock) and native._taken(target) == lock
    assert native._read_lock(lock)[1] == native.TEXT
    native._release(lock)
    assert not lock.exists()


def test_a_background_builds_lock_is_held_by_its_process(fresh, monkeypatch):
    """The background build outlives the process that started it: its lock is held by the
    build's process (the flock, its descriptor passed to it), held while that runs, stale
    once it has ended though the process that started it runs on."""
    target = fresh / "vega_native-0.so"
    builds, real = [], subprocess.Popen

    def popen(args, **kwargs):  # a build that runs until it is ended
        assert kwargs["pass_fds"] == (int(args[-1]),)
        builds.append(real([sys.executable, "-c", "import time; time.sleep(60)"],
                           pass_fds=kwargs["pass_fds"]))
        return builds[-1]
    monkeypatch.setattr(native.subprocess, "Popen", popen)
    native._spawn(target)
    lock = native._lock(target)
    try:
        assert native._held == {}  # (this process's copy let go)
        assert native._read_lock(lock)[1] == native.TEXT and not native._stale(lock)
    finally:
        builds[0].kill()
        builds[0].wait()
    assert native._stale(lock)
    native._state["pending"][2].close()


@needs_cxx
def test_a_build_waited_for_waits_for_another_processes_and_holds_the_lock_for_its_own(
        copying, fresh, monkeypatch):
    """VEGA_NATIVE=sync (``wait=True``): where another process holds the build's lock, this
    one loads that build's library once it is placed, and compiles nothing (every rank of a
    job, every worker of a test run, had compiled its own at once); where none does, its own
    build holds the lock (the source in it) until the library is placed."""
    import threading
    from vega.codegen.c import build as cbuild
    _, target = native._paths()
    target.parent.mkdir(parents=True)
    lock = native._lock(target)
    lock.touch()  # another process builds it now
    built = []
    real_build = native.build
    monkeypatch.setattr(native, "build", lambda t=None, text=None: built.append(t))

    def the_other():
        time.sleep(0.5)
        tmp = target.with_name(".other.so")
        tmp.write_bytes(copying.read_bytes())
        cbuild.install(tmp, target)
        lock.unlink()
    other = threading.Thread(target=the_other)
    other.start()
    try:
        assert native.module(wait=True) is not None, native.status()
    finally:
        other.join()
    assert built == [] and target.exists()
    # no other build: this process's own, the lock held (its source in it) while it runs
    native._state.update(module=None, pending=None, failed=None)
    target.unlink()
    cbuild.hash_file(target).unlink()
    held = []

    def build(t=None, text=None):
        held.append(native._read_lock(lock)[1] == native.TEXT)
        return real_build(t, text)
    monkeypatch.setattr(native, "build", build)
    assert native.module(wait=True) is not None, native.status()
    assert held == [True] and not lock.exists()


@needs_cxx
def test_a_second_library_loads_as_the_first():
    """A process registers the operators once: a rebuilt library at another path gives the
    module already loaded (a second TORCH_LIBRARY of one namespace would be refused)."""
    first = native.module(wait=True)
    assert native._load(native._placed(native._paths()[1])) is first


def _both(monkeypatch, fn, *args):
    """``fn(*args)`` with the native module (where it is built) and on the Python path."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip("the native operator cannot be built here")
    fast = fn(*args)
    monkeypatch.setitem(native._state, "module", None)
    return fast, fn(*args)


def test_distinct_native_is_the_python_one(monkeypatch):
    from vega.codegen.base import distinct
    a, b, c = (torch.zeros(1) for _ in range(3))
    for items in ([a, b, a, c, b, b], [a, b, c], [c] * 4, [a], [a, a, a, b], [],
                  list(range(300)) + [5, 7]):
        fast, slow = _both(monkeypatch, distinct, items)
        monkeypatch.undo()
        assert fast[1] == slow[1] and len(fast[0]) == len(slow[0])
        assert all(x is y for x, y in zip(fast[0], slow[0]))
        # each its own (and more than one): the positions are range(n) on both paths (no
        # int made an item), the distinct ones a new list
        each = len(set(map(id, items))) == len(items) > 1
        assert (type(fast[1]) is range) == (type(slow[1]) is range) == each
        assert fast[0] is not items and type(fast[0]) is list


def test_same_native_is_the_python_one(monkeypatch):
    """Two lists hold the same objects in the same order, by identity: not equal ones."""
    from vega.codegen.tensors import same
    a, b = torch.zeros(1), torch.zeros(1)
    for x, y, want in (([a, b], [a, b], True), ([a, b], (a, b), True), ([], [], True),
                       ([a, b], [b, a], False), ([a], [a, a], False), ([a, a], [a], False),
                       ([a, b], [a, torch.zeros(1)], False), ([1000, 2000], [1000, 2000], None)):
        fast, slow = _both(monkeypatch, same, x, y)
        monkeypatch.undo()
        assert fast == slow and (want is None or fast == want)


def test_same_reads_a_list_subclass_as_it_iterates(monkeypatch):
    """A list or tuple is compared as it holds its items; any other sequence (a subclass
    of list that iterates its own way) as it iterates, on both paths."""
    from vega.codegen.tensors import same
    a, b = torch.zeros(1), torch.zeros(1)

    class Backwards(list):
        def __iter__(self):
            return reversed(list(super().__iter__()))
    for x, y, want in (([a, b], Backwards([b, a]), True), (Backwards([a, b]), [a, b], False),
                       ((a, b), Backwards([b, a]), True)):
        fast, slow = _both(monkeypatch, same, x, y)
        monkeypatch.undo()
        assert fast == slow == want


def test_same_survives_a_sequence_whose_iteration_changes_the_other():
    """``b`` read as it iterates may change list ``a``: both are held before either's items
    are read (a freed array of 2M items was read, and the process died)."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip("the native operator cannot be built here")
    a = [object() for _ in range(2_000_000)]

    class Clears(list):
        def __iter__(self):
            a.clear()
            return super().__iter__()
    b = Clears(a)
    assert mod.same(a, b) is False  # (a is empty by the time its items are read)
    assert mod.same(Clears([1]), []) is False


def test_the_prelude_tables_give_the_same_lengths_object_for_the_same_lengths():
    """A dtype group's lengths (the bytes of their int64s, a block map's key) are the same
    object as a recent call's where they are equal: the map's lookup hashes nothing; other
    lengths of as many bytes are other bytes."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip("the native operator cannot be built here")
    cpu = torch.device("cpu")

    def lengths(*numels):
        found, _ = mod.triton_grad_rows([torch.zeros(n) for n in numels], cpu)
        (_, _, out), = found
        assert list(memoryview(out).cast("q")) == list(numels)
        return out
    first = lengths(3, 5, 7)
    assert lengths(3, 5, 7) is first
    assert lengths(5, 3, 7) is not first and lengths(7, 5, 3) is not first
    assert lengths(3, 5, 7) is first  # (still held among the last few)
    for k in range(1, 12):  # more than are held: the first made again, equal
        lengths(k)
    assert lengths(3, 5, 7) == first


def test_gather_native_is_the_python_one(monkeypatch):
    from torch.testing._internal.two_tensor import TwoTensor
    from vega.codegen import tensors
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)]
    sts = [{"mu": torch.zeros(3), "step": torch.zeros((), dtype=torch.int32)} for _ in ps]
    cases = {0: lambda: None,
             tensors.NO_GRAD: lambda: setattr(ps[2], "grad", None),
             tensors.NOT_STRIDED: lambda: setattr(ps[1], "grad", torch.zeros(3).to_sparse()),
             tensors.NOT_PLAIN: lambda: sts[3].__setitem__("mu", TwoTensor(torch.zeros(3),
                                                                           torch.zeros(3)))}
    for flag, change in cases.items():
        for p in ps:
            p.grad = torch.ones(3)
        sts[3]["mu"] = torch.zeros(3)
        change()
        fast, slow = _both(monkeypatch, tensors.gather, ps, sts, ["mu", "step"])
        monkeypatch.undo()
        assert fast[2] == slow[2] == flag
        assert all(x is y for x, y in zip(fast[0], slow[0]))
        assert all(x is y for c, d in zip(fast[1], slow[1]) for x, y in zip(c, d))
    # a dict subclass reads its items its own way: both paths call its __getitem__
    class Counting(dict):
        reads = 0

        def __getitem__(self, key):
            Counting.reads += 1
            return super().__getitem__(key)
    sts[0], sts[3]["mu"] = Counting(sts[0]), torch.zeros(3)
    for p in ps:
        p.grad = torch.ones(3)
    fast, slow = _both(monkeypatch, tensors.gather, ps, sts, ["mu", "step"])
    monkeypatch.undo()
    assert Counting.reads == 4 and fast[2] == slow[2] == 0
    assert all(x is y for c, d in zip(fast[1], slow[1]) for x, y in zip(c, d))
    with pytest.raises(TypeError, match="gather: params must be a sequence"):
        native.module().gather(None, sts, ["mu"], (torch.Tensor,))
    del sts[1]["step"]
    with pytest.raises(KeyError):  # natively
        tensors.gather(ps, sts, ["mu", "step"])
    monkeypatch.setitem(native._state, "module", None)
    with pytest.raises(KeyError):  # in Python
        tensors.gather(ps, sts, ["mu", "step"])


def test_gather_reads_a_state_dict_in_any_key_order(monkeypatch):
    """The native pass reads a state dict's entries in order while its keys are the names
    asked for, in order, and looks the rest up: any other order, keys equal to the names
    but other objects, and other keys before, between or after them give what ``st[name]``
    gives, as the Python path does."""
    from vega.codegen import tensors
    names = ["mu", "nu", "step"]
    other = ["".join(["m", "u"]), "".join(["n", "u"]), "".join(["st", "ep"])]
    assert all(a == b and a is not b for a, b in zip(names, other))
    made = [lambda t: dict(zip(names, t)),  # (in order, the names themselves)
            lambda t: dict(zip(reversed(names), reversed(t))),
            lambda t: {names[1]: t[1], names[0]: t[0], names[2]: t[2]},
            lambda t: dict(zip(other, t)),
            lambda t: {names[0]: t[0], other[1]: t[1], names[2]: t[2]},
            lambda t: {"extra": torch.ones(1), **dict(zip(names, t))},
            lambda t: {names[0]: t[0], "extra": torch.ones(1), names[1]: t[1], names[2]: t[2]},
            lambda t: {**dict(zip(names, t)), "extra": torch.ones(1)}]
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in made]
    for p in ps:
        p.grad = torch.ones(3)
    values = [[torch.full((3,), float(k)), torch.full((3,), -float(k)),
               torch.tensor(k, dtype=torch.int32)] for k in range(len(made))]
    sts = [make(t) for make, t in zip(made, values)]
    fast, slow = _both(monkeypatch, tensors.gather, ps, sts, names)
    monkeypatch.undo()
    for got in (fast, slow):
        assert got[2] == 0
        assert all(x is y for c, d in zip(got[1], zip(*values)) for x, y in zip(c, d))
    del sts[4][other[1]]  # (one of those looked up, missing)
    with pytest.raises(KeyError):
        tensors.gather(ps, sts, names)


def test_any_complex_native_is_the_python_one(monkeypatch):
    from vega.codegen import tensors
    real = [torch.zeros(2), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    for ts, want in ((real, False), (real + [torch.zeros(2, dtype=torch.complex64)], True),
                     ([], False)):
        assert _both(monkeypatch, tensors.any_complex, ts) == (want, want)
        monkeypatch.undo()


def test_uniform_native_is_the_python_one(monkeypatch):
    """A fused step's gradients in one pass (``tensors.uniform``): plain dense real tensors on
    one device, and each case where it must say no, alike in both passes."""
    from torch.testing._internal.two_tensor import TwoTensor
    from vega.codegen import tensors
    ok = [torch.ones(3), torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64)),
          torch.ones((), dtype=torch.bfloat16)]
    nested = torch.nested.nested_tensor([torch.ones(3)])
    for items, want in ((ok, True), ([], True), (ok[:1], True),
                        (ok + [torch.ones(2, dtype=torch.complex64)], False),
                        (ok + [TwoTensor(torch.ones(3), torch.ones(3))], False),
                        (ok + [None], False), (ok + [torch.ones(3).to_sparse()], False),
                        (ok + [torch.ones(3, device="meta")], False), (ok + [nested], False)):
        assert _both(monkeypatch, tensors.uniform, items) == (want, want), items
        monkeypatch.undo()


def test_floats_and_like_native_are_the_python_ones(monkeypatch):
    """A functional step's quick checks (``tensors.floats``, ``tensors.like``): each case
    where it must say no (a shape, a device, complexness, a layout, a tensor subclass, a
    missing leaf, a length) and the cases where it says yes, alike in both passes."""
    from torch.testing._internal.two_tensor import TwoTensor
    from vega.codegen import tensors
    refs = [torch.zeros(3), torch.nn.Parameter(torch.zeros(2, 2)), torch.zeros(())]
    ok = [torch.ones(3), torch.ones(2, 2, dtype=torch.float64), torch.ones(())]
    for items, want in ((ok, True), (ok[:2] + [torch.ones(1)], False),
                        (ok[:2] + [torch.ones((), device="meta")], False),
                        ([torch.ones(3, dtype=torch.complex64)] + ok[1:], False),
                        ([torch.ones(3).to_sparse()] + ok[1:], False),
                        ([TwoTensor(torch.ones(3), torch.ones(3))] + ok[1:], False),
                        ([None] + ok[1:], False), (ok[:2], False)):
        assert _both(monkeypatch, tensors.like, refs, items) == (want, want), items
        monkeypatch.undo()
    nested = torch.nested.nested_tensor([torch.ones(3)])  # (no sizes to compare)
    assert _both(monkeypatch, tensors.like, refs, [nested] + ok[1:]) == (False, False)
    monkeypatch.undo()
    assert _both(monkeypatch, tensors.like, [nested] + refs[1:], ok) == (False, False)
    monkeypatch.undo()
    # a sparse parameter (a ref) with a dense gradient of its shape
    sparse = [torch.zeros(3).to_sparse()] + refs[1:]
    assert _both(monkeypatch, tensors.like, sparse, ok) == (False, False)
    monkeypatch.undo()
    # a parameter (a ref) on another device, its gradient on the first one's
    odd = refs[:2] + [torch.zeros((), device="meta")]
    assert _both(monkeypatch, tensors.like, odd, ok) == (False, False)
    monkeypatch.undo()
    assert _both(monkeypatch, tensors.like, [], []) == (True, True)
    monkeypatch.undo()
    for items, want in ((refs, True), (refs + [torch.zeros(1, dtype=torch.int32)], False),
                        (refs + [torch.zeros(1, dtype=torch.complex64)], False),
                        (refs + [None], False), ([], True),
                        (refs + [TwoTensor(torch.ones(3), torch.ones(3))], True)):
        assert _both(monkeypatch, tensors.floats, items) == (want, want), items
        monkeypatch.undo()


@needs_cxx
def test_fit_says_yes_only_to_states_a_kernel_takes():
    """A class step's quick check of its states (``tensors.fit``): yes to a state like its
    parameter, of one number, 8-bit codes like it, float32 scales one a block of 256; no to
    each other shape, dtype, device, layout or type, which the step's checks then name."""
    from torch.testing._internal.two_tensor import TwoTensor
    from vega.codegen import tensors
    from vega.dsl.ir import QBLOCK, SCALAR_STATE
    native.module(wait=True)
    params = [torch.zeros(300), torch.nn.Parameter(torch.zeros(2, 2))]
    cases = [  # (domain, want, states, the answer)
        ("rc", 0, [torch.ones(300), torch.ones(2, 2, dtype=torch.float64)], True),
        ("rc", 0, [torch.ones(300), torch.ones(4)], False),
        ("rc", 0, [torch.ones(300), torch.ones(2, 2, dtype=torch.int32)], False),
        ("rc", 0, [torch.ones(300), torch.ones(2, 2, dtype=torch.complex64)], False),
        ("rc", 0, [torch.ones(300), torch.ones(2, 2, dtype=torch.uint8)], False),
        ("rc", 0, [torch.ones(300), torch.ones(2, 2, device="meta")], False),
        ("rc", 0, [torch.ones(300), TwoTensor(torch.ones(2, 2), torch.ones(2, 2))], False),
        ("rc", 0, [torch.ones(300).to_sparse(), torch.ones(2, 2)], False),
        ("rc", 0, [torch.ones(300)], False),
        ("rc", 1, [torch.ones(300, dtype=torch.uint8), torch.ones(2, 2, dtype=torch.uint8)],
         True),
        ("rc", 1, [torch.ones(300, dtype=torch.uint8), torch.ones(2, 2)], False),
        (SCALAR_STATE, 0, [torch.ones(()), torch.ones((), dtype=torch.bfloat16)], True),
        (SCALAR_STATE, 0, [torch.ones(()), torch.ones(1)], False),
        (QBLOCK, 0, [torch.ones(2), torch.ones(1)], True),
        (QBLOCK, 0, [torch.ones(2), torch.ones(1, 1)], False),
        (QBLOCK, 0, [torch.ones(1), torch.ones(1)], False),
        (QBLOCK, 0, [torch.ones(2), torch.ones(1, dtype=torch.float64)], False),
        ("r", 0, [torch.ones(300), torch.ones(2)], False),  # (a matrix view's: not here)
    ]
    for dom, want, states, answer in cases:
        assert tensors.fit(params, states, dom, want) is answer, (dom, want, states)


def test_a_forked_child_waits_for_the_build_its_parent_started(fresh):
    """A child made by fork while its parent's build runs (a DataLoader's worker) cannot wait
    for that build, not its own child: it waits for it by its lock and library, as for
    another process's, rather than take it as failed and step without the operator."""
    target = fresh / "vega_native_test.so"
    native._lock(target).touch()  # (a build under way)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tempfile.TemporaryFile()
    native._state.update(pending=(target, builder, log), next_poll=0.0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            native._poll(False)
            os.write(w, repr((native._state["failed"],
                              native._state["pending"] is not None)).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        seen = os.read(r, 4096).decode()
        os.waitpid(pid, 0)
    finally:
        builder.kill()
        builder.wait()
        log.close()
        os.close(r)
    assert seen == "(None, True)", seen


HELD_AT_FORK = r"""
import json, os, sys, threading, time
from vega.codegen.c import build as cbuild
from vega.codegen.c import native
from vega.runtime import library
native._paths = lambda: None  # (no operator: module() answers at once, under its lock)
held, done = threading.Event(), threading.Event()

def builder():  # another thread, in the middle of a build, a native load and a compile
    with cbuild._loaded_lock, cbuild._lock, native._lock_, library._LOCK:
        held.set()
        done.wait()
threading.Thread(target=builder).start()
held.wait()
source = 'const char *vega_key(void) { return "@KEY@"; }\nint vega_answer(void) { return 7; }\n'
pid = os.fork()
if pid == 0:
    answer = cbuild.library(source).vega_answer()
    native.module(wait=False)
    name = library.builtin("sgd").name
    print(json.dumps([answer, name]), flush=True)
    os._exit(0)
deadline = time.monotonic() + 30
while os.waitpid(pid, os.WNOHANG) == (0, 0):
    if time.monotonic() > deadline:  # a hung child fails the run at once
        os.kill(pid, 9)
        print(json.dumps("the child hung"), flush=True)
        break
    time.sleep(0.05)
done.set()
"""


def test_a_forked_child_builds_while_another_thread_of_its_parent_held_the_locks(tmp_path):
    """A child made by fork while another thread of its parent was building a kernel, loading
    the native operator or compiling a shipped spec inherited that thread's locks, held by a
    thread the child does not have: its first build, native load or spec waited for ever.
    The child takes new locks."""
    env = {**os.environ, "VEGA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    ran = subprocess.run([sys.executable, "-c", HELD_AT_FORK], env=env, capture_output=True,
                         text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout) == [7, "sgd"], ran.stdout


def test_the_passes_use_the_operator_once_it_is_loaded(monkeypatch):
    """``native_passes`` finds the operator where it is loaded, and None where it is not or
    dynamo traces."""
    from vega.codegen import tensors
    sentinel = object()
    monkeypatch.setitem(native._state, "module", sentinel)
    assert tensors.native_passes() is sentinel
    monkeypatch.setitem(native._state, "module", None)
    assert tensors.native_passes() is None
    monkeypatch.setitem(native._state, "module", sentinel)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert tensors.native_passes() is None


@needs_cxx
def test_the_library_is_keyed_and_built_from_the_source_imported(fresh, monkeypatch, tmp_path):
    """native.cpp replaced on disk after vega was imported (vega upgraded while a process
    runs) changes neither the library this process asks for nor what its build compiles: the
    key read the file at each build and the compiler was given the file, so the running code
    keyed, built and loaded the new file's operator, whose tables and calls are another
    version's."""
    original = native.SOURCE.read_text()
    name = native._paths()[1].name
    changed = tmp_path / "native.cpp"
    changed.write_text(original + "\n#error another vega's operator\n")
    monkeypatch.setattr(native, "SOURCE", changed)
    assert native._paths()[1].name == name
    seen = {}

    def run(args, **kwargs):
        seen["text"] = Path(next(a for a in args if a.endswith(".cpp"))).read_text()
        return subprocess.CompletedProcess(args, 1, "", "stopped by the test")
    monkeypatch.setattr(native.subprocess, "run", run)
    target = tmp_path / "built" / name
    target.parent.mkdir()
    assert "stopped by the test" in native.build(target)
    assert seen["text"] == original
    assert not [p for p in target.parent.iterdir() if p.suffix in (".cpp", ".so")]


@needs_cxx
def test_the_library_is_keyed_by_the_python_it_is_built_for(monkeypatch):
    """The operator is a CPython extension: one cache (``~/.cache/vega``) shared by the
    virtual environments of two Pythons, or of one Python's two builds (3.13's free-threaded
    one shares its version), holds a library for each; neither is handed the other's, which
    it would load and crash in or refuse. Its name ends in the Python's EXT_SUFFIX (an
    interpreter loads no other) and its key reads the Python's version and ABI."""
    name = native._paths()[1].name
    assert name.endswith(native.sysconfig.get_config_var("EXT_SUFFIX"))
    monkeypatch.setattr(native.sys, "version", native.sys.version + " another build")
    assert native._paths()[1].name != name
    monkeypatch.undo()
    suffix = ".cpython-313t-x86_64-linux-gnu.so"
    real = native.sysconfig.get_config_var
    monkeypatch.setattr(native.sysconfig, "get_config_var",
                        lambda var: suffix if var == "EXT_SUFFIX" else real(var))
    other = native._paths()[1].name
    assert other.endswith(suffix) and other[:-len(suffix)] != name.split(".")[0]


@needs_cxx
def test_the_background_build_compiles_its_parents_source(tmp_path):
    """The background build (``python -m vega.codegen.c.native LOCK``) imports vega anew: a
    vega upgraded since its parent imported it, or another one on its path, has another
    native.cpp, and its library under the name the parent asked for would be loaded as the
    parent's. It compiles the source its parent wrote into the lock; a lock that holds none
    is built only where its name is this vega's key."""
    repo = os.path.abspath(os.path.join(os.path.dirname(native.__file__), *[".."] * 3))
    stand_in = tmp_path / "c++"  # (its "library" is the source it was given)
    stand_in.write_text(f"#!{sys.executable}\nimport shutil, sys\n"
                        "print('stand-in 1') if sys.argv[1:] == ['--version'] else "
                        "shutil.copy(next(a for a in sys.argv if a.endswith('.cpp')), "
                        "sys.argv[-1])\n")
    stand_in.chmod(0o700)
    env = {**os.environ, "PYTHONPATH": repo, "VEGA_CACHE_DIR": str(tmp_path),
           "CXX": str(stand_in)}
    folder = tmp_path / "native"
    folder.mkdir()
    suffix = "".join(native._paths()[1].suffixes)
    for key, text in (("1" * 32, "// the parent's operator\n"), ("0" * 32, "")):
        target = folder / f"vega_native-{key}{suffix}"
        native._lock(target).write_text(text)
        run = subprocess.run([sys.executable, "-m", "vega.codegen.c.native",
                              str(native._lock(target))], capture_output=True, text=True,
                             timeout=600, stdin=subprocess.DEVNULL, env=env)
        assert not native._lock(target).exists()
        if text:
            assert run.returncode == 0, run.stderr[-2000:]
            assert target.read_text() == text
        else:
            assert run.returncode == 1 and "its lock holds no source" in run.stderr, \
                run.stderr[-2000:]
            assert not target.exists()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


def _stale_lock(target):
    """A lock left by a build on this machine whose process has died."""
    lock = native._lock(target)
    lock.write_text(native._HOLDER + json.dumps({"pid": _dead_pid(),
                                                 "machine": native._machine()}) + "\n"
                    + native.TEXT)
    assert native._stale(lock)
    return lock


def test_processes_that_find_a_lock_stale_at_once_take_it_once(tmp_path):
    """Processes that found a stale lock at once each removed the lock there and made their
    own: a later one removed an earlier one's new lock, and each built. One takes it; the
    others find it held. (Each removes what it found after a wait of its own, so that the
    order of the removals is fixed.)"""
    target = tmp_path / "vega_native-0.so"
    _stale_lock(target)
    go_r, go_w = os.pipe()
    took_r, took_w = os.pipe()
    children = []
    for i in range(4):
        pid = os.fork()
        if pid == 0:  # a process that finds the lock stale, and takes it if it can
            code = 1
            try:
                os.close(go_w)
                remove = native.cbuild.remove

                def later(path, i=i):
                    time.sleep(0.2 * (i + 1))
                    remove(path)
                native.cbuild.remove = later
                os.read(go_r, 1)  # (all start at once)
                if native._taken(target) is not None:
                    os.write(took_w, b"x")
                    time.sleep(0.2 * 4 + 1.5)  # building, while the others look
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    os.close(go_w)  # go
    os.close(took_w)
    try:
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        taken = b""
        while chunk := os.read(took_r, 64):
            taken += chunk
    finally:
        os.close(go_r)
        os.close(took_r)
    assert statuses == [0] * 4
    assert taken == b"x", f"{len(taken)} processes took the lock"


def test_a_build_that_ends_at_once_leaves_another_processes_lock_as_it_is(fresh, monkeypatch):
    """The process that starts the background build named that build in the lock once it had
    started, by replacing the lock if it was there still: where the build had ended and
    another process had taken the lock in between, that process's lock was replaced by one
    naming the ended build, stale at once, and a third process built too."""
    target = fresh / "vega_native-0.so"
    lock = native._lock(target)
    r, w = os.pipe()
    others, ended = [], _dead_pid()

    def popen(*args, **kwargs):
        lock.unlink()  # the build ended at once, and removed its lock ...
        pid = os.fork()
        if pid == 0:  # ... which another process takes, to build
            said = b"-"
            try:
                os.close(r)
                said = b"x" if native._taken(target) is not None else b"-"
            except BaseException as e:
                said = repr(e).encode()
            finally:
                os.write(w, said)
                os.close(w)
                time.sleep(30) if said == b"x" else None
                os._exit(0)
        others.append(pid)
        os.close(w)
        assert select.select([r], [], [], 30)[0], "the other process hung"
        assert os.read(r, 4096) == b"x"

        class Ended:
            pid = ended
        return Ended()
    monkeypatch.setattr(native.subprocess, "Popen", popen)
    try:
        native._spawn(target)
        assert len(others) == 1 and not native._stale(lock)
    finally:
        for pid in others:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(r)
        if native._state["pending"] is not None:
            native._state["pending"][2].close()


def test_a_child_forked_while_the_lock_is_taken_does_not_hold_it(tmp_path, monkeypatch):
    """A lock is flocked before it is linked into place, under the directory's lock: a child
    forked by another thread then (a DataLoader's worker) kept the parent's descriptor,
    which ``_forked`` lets go only once it is in ``_held``, and so held the lock while it
    ran; were the build to die without its library, the lock read as held, and no process
    built it again before it was older than ``LOCK_LIMIT``."""
    target = tmp_path / "vega_native-0.so"
    real, children = native.cbuild.locked, []
    r, w = os.pipe()
    up_r, up_w = os.pipe()

    @contextlib.contextmanager
    def locked(directory, exclusive):
        with real(directory, exclusive):
            pid = os.fork()
            if pid == 0:  # a worker that runs on
                os.close(w)
                os.write(up_w, b"x")  # (its fork handlers have run)
                os.read(r, 1)
                os._exit(0)
            children.append(pid)
            os.read(up_r, 1)
            yield
    monkeypatch.setattr(native.cbuild, "locked", locked)
    try:
        lock = native._taken(target)
        assert lock is not None and children
        os.close(native._held.pop(lock))  # the build died, without its library
        assert native._stale(lock), "the lock is held by the forked child"
    finally:
        for fd in (w, r, up_w, up_r):
            os.close(fd)
        for pid in children:
            os.waitpid(pid, 0)


@needs_cxx
@pytest.mark.parametrize("at", ["install", "source", "temporary"])
def test_a_build_the_disk_refuses_is_said_and_not_remembered(fresh, monkeypatch, at):
    """A build whose files could not be written (a full disk, a process out of file
    descriptors): a library compiled but not installed was said to be a compiler that
    "could not run" and recorded beside the target as failed, so that no later process built
    it again; a source that could not be written raised the OSError out of a step made with
    VEGA_NATIVE=sync (the operator is only a faster path), leaving a temporary file in the
    cache. Each is said, with the file system's words, in this process alone."""
    _, target = native._paths()
    writes = [sys.executable, "-c", "import sys; open(sys.argv[-1], 'wb').write(b'built')"]
    monkeypatch.setattr(native, "_paths", lambda: (writes, target))
    full = OSError(errno.ENOSPC, "No space left on device")

    def refuse(*args, **kwargs):
        raise full
    if at == "install":
        monkeypatch.setattr(native.cbuild, "install", refuse)
    elif at == "temporary":  # (the first of its files, the library's: nothing to remove)
        real_mkstemp = tempfile.mkstemp
        monkeypatch.setattr(native.tempfile, "mkstemp", lambda *a, suffix=None, **k: refuse()
                            if suffix == ".so" else real_mkstemp(*a, suffix=suffix, **k))
    else:
        real = os.fdopen

        class Full:  # (the source's file, whose write the disk refuses)
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            write = refuse

        def fdopen(fd, mode="r", *args, **kwargs):
            f = real(fd, mode, *args, **kwargs)
            return Full(f) if "w" in mode and f.name == fd and os.readlink(
                f"/proc/self/fd/{fd}").endswith(".cpp") else f
        monkeypatch.setattr(native.os, "fdopen", fdopen)
    assert native.module(wait=True) is None
    said = native.status()
    assert "No space left on device" in said and "a later process builds it again" in said
    assert "could not run" not in said
    assert not native._failed_file(target).exists()
    assert not [f for f in os.listdir(target.parent) if f.startswith(".")]  # no temporaries


@needs_cxx
@pytest.mark.parametrize("how", ["killed", "silent"])
def test_a_background_build_that_dies_says_how(fresh, monkeypatch, how):
    """A background build killed (the out-of-memory killer, a user's kill), or that ended
    in failure without a word, was said as "the build failed": nothing of why, nor that a
    later process builds it again (nothing is recorded beside the target)."""
    real = subprocess.Popen
    code = {"killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            "silent": "import os; os._exit(3)"}[how]

    def popen(args, **kwargs):
        return real([sys.executable, "-c", code], **kwargs)
    monkeypatch.setattr(native.subprocess, "Popen", popen)
    assert native.module() is None
    assert native.module(wait=True) is None
    said = native.status()
    assert {"killed": "killed by signal 9 (SIGKILL)", "silent": "status 3"}[how] in said
    assert "a later process builds it again" in said
    _, target = native._paths()
    assert not native._failed_file(target).exists()


@needs_cxx
def test_a_library_that_does_not_load_says_why(copying, fresh, monkeypatch):
    """A library built that the loader refuses (a cache on a file system mounted noexec:
    "failed to map segment from shared object"; a symbol torch's libraries lack) was said
    as "built, but it does not have the operators", the loader's words dropped, and
    recorded so without saying where, or how to build it again."""
    def refuse(path):
        raise ImportError(f"{path}: failed to map segment from shared object")
    monkeypatch.setattr(native, "_load", refuse)
    assert native.module(wait=True) is None
    _, target = native._paths()
    for said in (native.status(), native._failed_file(target).read_text()):
        assert "failed to map segment from shared object" in said
        assert f"kept in {native._failed_file(target)}: delete it to try again" in said
    native._state.update(module=None, pending=None, failed=None)
    assert native.module() is None and native._state["pending"] is None  # remembered
    assert "failed to map segment" in native.status()


@pytest.mark.parametrize("wrong", [torch.float64, torch.float16])
def test_an_output_of_another_dtype_is_refused_by_name(wrong):
    """The operator's step out of place writes each new tensor in its input's dtype: an
    output of another dtype (the shape checked alike) is refused, naming it, before anything
    is written; not written as the input's bytes (a float16 output half a float32's size)."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip("the native operator cannot be built here")
    from vega.codegen.c import launch
    kern = launch.Kernel(vega.adamw.program())
    kern._native_call(mod, mod.step, [torch.ones(3)], [torch.ones(3)],
                      [torch.zeros(3), torch.zeros(3)], [torch.zeros((), dtype=torch.int32)],
                      [0], [torch.zeros(len(kern.program.float_hypers), dtype=torch.float64)],
                      [0], None, [], [])  # (its library built and registered)
    p, g, mu, nu = torch.ones(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
    step = torch.zeros((), dtype=torch.int32)
    hyp = torch.full((len(kern.program.float_hypers),), 0.5, dtype=torch.float64)
    outs = [torch.full((5,), 7.0), torch.full((5,), 7.0, dtype=wrong), torch.full((5,), 7.0)]
    with pytest.raises(ValueError, match=r"output 1 \(state 0 of parameter 0\) is of dtype "
                                         rf"{str(wrong).split('.')[1]}, its input's float32"):
        torch.ops.vega_c.step(kern.id, [p], [g], [mu, nu], [step], [0], [hyp], [0], None,
                              [], outs)
    assert all((o == 7).all() for o in outs) and int(step) == 0
    outs = [torch.full((5,), 7.0, dtype=wrong), torch.full((5,), 7.0), torch.full((5,), 7.0)]
    with pytest.raises(ValueError, match=r"output 0 \(parameter 0\) is of dtype"):
        torch.ops.vega_c.step(kern.id, [p], [g], [mu, nu], [step], [0], [hyp], [0], None,
                              [], outs)
    assert all((o == 7).all() for o in outs) and int(step) == 0


@needs_cxx
def test_a_compiler_that_finds_no_room_is_said_and_not_remembered(fresh, monkeypatch):
    """A compiler whose files found no room (a full disk or quota: gcc's "fatal error: error
    writing to /tmp/ccX.s: No space left on device", ld's "final link failed: No space left
    on device") made no complaint about the source, but its failure was recorded beside the
    target as the compiler's, so that no later process built the operator again, the disk
    freed or not."""
    _, target = native._paths()
    says = [sys.executable, "-c", "import sys; sys.exit('/usr/bin/ld: final link failed: "
            "No space left on device\\ncollect2: error: ld returned 1 exit status')"]
    monkeypatch.setattr(native, "_paths", lambda: (says, target))
    assert native.module(wait=True) is None
    said = native.status()
    assert "final link failed: No space left on device" in said, said
    assert "a later process builds it again" in said and "kept in" not in said
    assert not native._failed_file(target).exists()


@pytest.mark.skipif(not os.path.exists("/dev/full") or native.cbuild.compiler() is None,
                    reason="needs /dev/full and a C compiler")
def test_a_compiler_that_finds_no_room_is_read_so(tmp_path):
    """What a real compiler says writing into a full disk (/dev/full) is read as no room."""
    src = tmp_path / "x.c"
    src.write_text("int f(void) { return 1; }\n")
    cb = native.cbuild
    proc = subprocess.run([*cb.command(cb.compiler()), "-shared", "-fPIC", str(src), "-o",
                           "/dev/full"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, env=cb.compiler_env())
    assert proc.returncode != 0 and "No space left on device" in cb.no_room(proc), proc.stderr
    assert cb.no_room(subprocess.CompletedProcess([], 1, "", "x.c:1: error: expected ';'")) \
        is None


@needs_cxx
def test_a_library_whose_copy_the_disk_refuses_is_kept_and_not_loaded_now(copying, fresh,
                                                                          monkeypatch):
    """A library is loaded from a copy of the bytes checked, written beside it: where the
    disk refused that copy (full), the OSError came out of native.module() into the step
    (the operator is only a faster path). It is said, in this process alone, and the
    library is kept for a later process, not removed and built again."""
    assert native.module(wait=True) is not None  # (built into the new cache)
    _, target = native._paths()
    native._state.update(module=None, pending=None, failed=None)
    real = native.cbuild.tempfile.mkstemp

    def mkstemp(*args, prefix=None, **kwargs):
        if prefix is not None and prefix.startswith(".load-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, prefix=prefix, **kwargs)
    monkeypatch.setattr(native.cbuild.tempfile, "mkstemp", mkstemp)
    assert native.module(wait=True) is None
    said = native.status()
    assert "No space left on device" in said and "a later process loads it" in said, said
    assert target.exists() and not native._failed_file(target).exists()
    monkeypatch.setattr(native.cbuild.tempfile, "mkstemp", real)
    native._state.update(module=None, pending=None, failed=None)
    assert native.module() is not None  # (the room found again: the library kept, loaded)


@needs_cxx
def test_a_library_the_loader_cannot_map_now_is_not_remembered(copying, fresh, monkeypatch):
    """A library the loader refused for want of a file descriptor or memory (a process at
    its limit: "cannot open shared object file: Too many open files") was recorded beside
    the target as built but unusable, so that no later process loaded it."""
    def refuse(path):
        raise ImportError(f"{path}: cannot open shared object file: Too many open files")
    monkeypatch.setattr(native, "_load", refuse)
    assert native.module(wait=True) is None
    said = native.status()
    assert "Too many open files" in said and "a later process loads it" in said, said
    _, target = native._paths()
    assert target.exists() and not native._failed_file(target).exists()
    native._state.update(module=None, pending=None, failed=None)
    assert native.module() is None and "Too many open files" in native.status()
    assert target.exists()  # (kept: neither removed nor rebuilt)


@needs_cxx
def test_a_library_without_room_for_its_static_tls_is_remembered(copying, fresh, monkeypatch):
    """"cannot allocate memory in static TLS block" is the library's own want (libgomp's
    thread-local storage, loaded late), no errno of the moment: it is recorded as a library
    that does not load, not taken for a process out of memory."""
    def refuse(path):
        raise ImportError("libgomp.so.1: cannot allocate memory in static TLS block")
    monkeypatch.setattr(native, "_load", refuse)
    assert native.module(wait=True) is None
    _, target = native._paths()
    assert "static TLS block" in native._failed_file(target).read_text()


@needs_cxx
def test_a_background_build_past_the_wait_limit_is_said_stopped(fresh, monkeypatch):
    """A background build that a waiting step stops at its limit is said as stopped there
    (not as killed by SIGKILL, which this process sent), and not recorded."""
    real = subprocess.Popen

    def popen(args, **kwargs):
        return real([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
    monkeypatch.setattr(native.subprocess, "Popen", popen)
    monkeypatch.setattr(native, "WAIT_LIMIT", 0.5)
    assert native.module() is None
    assert native.module(wait=True) is None
    said = native.status()
    assert "ran past 0.5 s and was stopped; a later process builds it again" in said, said
    assert "SIGKILL" not in said
    _, target = native._paths()
    assert not native._failed_file(target).exists()


@needs_cxx
def test_a_background_build_killed_after_its_record_says_the_record(fresh, monkeypatch):
    """A background build killed after it recorded the compiler's complaint beside the
    target (between the record and its exit): the record stands, and no later process
    builds it again, as the status said ("its build process was killed by signal 9
    (SIGKILL); a later process builds it again")."""
    _, target = native._paths()
    record = native._failed_file(target)
    code = (f"import os, signal; os.makedirs({str(target.parent)!r}, exist_ok=True); "
            f"open({str(record)!r}, 'w').write('the C++ compiler failed: bad'); "
            f"os.kill(os.getpid(), signal.SIGKILL)")
    real = subprocess.Popen

    def popen(args, **kwargs):
        return real([sys.executable, "-c", code], **kwargs)
    monkeypatch.setattr(native.subprocess, "Popen", popen)
    assert native.module() is None
    assert native.module(wait=True) is None
    assert native.status() == "native operator unavailable: the C++ compiler failed: bad"


def test_a_pure_step_of_8bit_state_runs_on_the_operator(monkeypatch):
    """A step out of place of 8-bit state: the operator takes the new codes' uint8 outputs
    (each output of its input's dtype), where it refused every uint8 output ("not a
    contiguous CPU tensor of float32, float64, bfloat16 or float16") and each such step
    built its tables in Python; the values are the Python path's, bit for bit. A uint8
    output for a float32 input is still refused, naming it."""
    mod = native.module(wait=True)
    if mod is None:
        pytest.skip("the native operator cannot be built here")
    from vega.codegen.c import launch
    torch.manual_seed(0)
    params = {"w": torch.randn(4096), "v": torch.randn(300, 17)}
    grads = {k: torch.randn_like(x) for k, x in params.items()}
    state = vega.adamw.init(params, state_dtype=torch.uint8)
    monkeypatch.setattr(native, "module", lambda wait=False: None)
    want = vega.adamw.step(params, grads, state, backend="c")
    monkeypatch.setattr(native, "module", lambda wait=False: mod)

    def refused(*args, **kwargs):
        raise AssertionError("the Python path's tables")
    monkeypatch.setattr(launch.Kernel, "_tables", refused)
    got = vega.adamw.step(params, grads, state, backend="c")
    assert state["mu"]["w"].dtype == torch.uint8
    for k in params:
        assert torch.equal(got[0][k], want[0][k])
        for name, tree in want[1].items():
            if isinstance(tree, dict) and tree[k] is not None:
                assert torch.equal(got[1][name][k], tree[k]), (name, k)
    kern = launch.Kernel(vega.adamw.program())
    p, g, mu, nu = torch.ones(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
    step = torch.zeros((), dtype=torch.int32)
    hyp = torch.full((len(kern.program.float_hypers),), 0.5, dtype=torch.float64)
    kern._native_call(mod, mod.step, [p], [g], [mu, nu], [step], [0], [hyp], [0], None, [],
                      [])  # (its library built and registered)
    outs = [torch.full((5,), 7.0), torch.full((5,), 7, dtype=torch.uint8), torch.full((5,), 7.0)]
    with pytest.raises(ValueError, match=r"output 1 \(state 0 of parameter 0\) is of dtype "
                                         "uint8, its input's float32"):
        torch.ops.vega_c.step(kern.id, [p], [g], [mu, nu], [step], [0], [hyp], [0], None,
                              [], outs)
