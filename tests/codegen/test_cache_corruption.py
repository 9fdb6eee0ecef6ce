"""A damaged kernel cache never crashes or hangs a later run: whatever is found at a library's
place, or at its recorded hash's, or at the native operator's record of a failed build, is
checked before it is opened (a regular file, this user's, of a bounded size, hashing to its
record), and what does not pass is rebuilt with one warning. A library is loaded from a copy
of the bytes checked, under a name of its own, so a rebuilt library at the same path is
never handed the handle of the old one. An unusable ``VEGA_CACHE_DIR`` (a file, or a path
under one) is not used: kernels build into a private directory, with one warning naming it.

Where a crash (SIGBUS, SIGSEGV) or a hang is possible, the run is a child process, with a
timeout: the test asserts it ended cleanly and said what it should."""
import ctypes
import errno
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import vega
from vega.codegen.c import build as cbuild
from vega.codegen.c import native

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler here")
REPO = Path(vega.__file__).resolve().parents[1]
# a kernel library as cbuild.build takes one: it reports its key, and answers 42
SOURCE = 'const char *vega_key(void) { return "@KEY@"; }\nint vega_answer(void) { return 42; }\n'
GIB = 1 << 30

# The address space of a child capped a little above what its interpreter holds, so that
# reading a huge file whole fails at once (MemoryError) rather than filling this machine's
# memory.
CAP = r"""
import resource
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (512 << 20), resource.RLIM_INFINITY))
"""
# A later run: build the library (from the cache if it may be), and call it. cbuild alone,
# without the packages above it (vega.codegen.c's imports torch and dynamo: seconds of a
# CPU, some 20 s on a busy machine): it needs none of them.
LATER_RUN = r"""
import sys, types
for name in ("vega", "vega.codegen", "vega.codegen.c"):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [name.replace(".", "/")]
from vega.codegen.c import build as cbuild
assert "torch" not in sys.modules
""" + CAP + r"""
import ctypes, json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib, path, compiled = cbuild.build(sys.argv[1])
lib.vega_answer.restype = ctypes.c_int
print(json.dumps({"compiled": compiled, "answer": lib.vega_answer(),
                  "warned": [str(w.message) for w in caught]}))
"""


def child(code: str, *args: str, timeout: float = 120, native_scanner: str = "0") -> dict:
    """Run ``code`` in a new interpreter (this checkout's vega, the cache of ``cache``, and
    ``VEGA_NATIVE=native_scanner``); its JSON answer, once it has ended cleanly within
    ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VEGA_NATIVE": native_scanner}
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run hung (no end within {timeout} s)")
    assert proc.returncode == 0, \
        f"the run ended with status {proc.returncode} (a negative one: killed by that " \
        f"signal)\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


def library(cache) -> Path:
    """The library of SOURCE, built into ``cache`` by this process; its path."""
    _, path, compiled = cbuild.build(SOURCE)
    assert compiled and path.parent == cache / "c" and cbuild.untrusted(path) is None
    return path


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def zero_a_page(path):
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(bytes(4096))


def random_bytes(path):
    size = path.stat().st_size
    path.unlink()
    path.write_bytes(os.urandom(size))
    os.chmod(path, 0o700)


def fifo(path):
    path.unlink()
    os.mkfifo(path, 0o600)


def directory(path):
    path.unlink()
    path.mkdir(mode=0o700)
    (path / "inside").write_text("x")


def huge(path):
    """A sparse file of 2 GiB: reading it whole would take 2 GiB of memory."""
    with open(path, "r+b") as f:
        f.truncate(2 * GIB)


def key_not_answered(path):
    """Another library in its place, hash recorded: it loads, but reports no key."""
    src = path.with_name("other.c")
    src.write_text("int vega_answer(void) { return 7; }\n")
    subprocess.run([*cbuild.command(cbuild.compiler()), "-shared", "-fPIC", str(src), "-o",
                    str(path)],
                   check=True, capture_output=True)
    src.unlink()
    os.chmod(path, 0o700)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cbuild.hash_file(path).write_text(f"{digest}  {path.name}\n")


@pytest.mark.parametrize("what, spoil, expected", [
    ("library", truncate, "SHA-256 differs"),
    ("library", zero_a_page, "SHA-256 differs"),
    ("library", random_bytes, "SHA-256 differs"),
    ("library", fifo, "not a regular file but a FIFO"),
    ("library", directory, "not a regular file but a directory"),
    ("library", huge, "more than the 67108864 it may be"),
    ("library", key_not_answered, ": it reports no key; rebuilding it"),
    ("hash", random_bytes, "SHA-256 differs"),
    ("hash", fifo, "not a regular file but a FIFO"),
    ("hash", directory, "not a regular file but a directory"),
    ("hash", huge, "more than the 4096 it may be"),
], ids=lambda x: getattr(x, "__name__", None) if callable(x) else None)
def test_a_damaged_cache_entry_is_rebuilt_by_a_later_run(cache, what, spoil, expected):
    path = library(cache)
    spoil(path if what == "library" else cbuild.hash_file(path))
    ran = child(LATER_RUN, SOURCE)
    assert ran["compiled"] and ran["answer"] == 42
    warned = [w for w in ran["warned"] if w.startswith("vega: not ")]
    assert len(warned) == 1 and str(path) in warned[0] and expected in warned[0], warned
    assert cbuild.untrusted(path) is None  # the rebuilt one, trusted by the next run


def test_a_rebuilt_library_is_loaded_anew_not_as_the_old_handle(cache):
    """In one process: a cached library that loads but does not answer its key is rebuilt at
    the same path, and the rebuilt one is what is loaded (the dynamic loader hands back the
    library it already has for a path, and ctypes never unloads one)."""
    path = library(cache)
    key_not_answered(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib, again, compiled = cbuild.build(SOURCE)
    assert again == path and compiled
    assert lib.vega_key().decode() == cbuild.key_of(SOURCE)
    assert any(": it reports no key; rebuilding" in str(w.message) for w in caught)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".load-")]  # copies gone


def test_the_cache_file_is_not_what_is_loaded(cache):
    """What is loaded is a copy of the bytes that were checked: changing the cached file
    afterwards (truncating it under a mapping would be SIGBUS) does not reach the library."""
    path = library(cache)
    lib, problem = cbuild.load_verified(path, lambda p: (p, cbuild._load(p, cbuild.key_of(
        SOURCE))))
    assert problem is None and lib[0] != path and lib[0].parent == path.parent
    assert lib[1] is not None and not lib[0].exists()
    truncate(path)
    lib[1].vega_answer.restype = ctypes.c_int
    assert lib[1].vega_answer() == 42


def test_reads_are_capped_and_open_no_fifo(tmp_path):
    fifo_path = tmp_path / "fifo"
    os.mkfifo(fifo_path, 0o600)
    assert cbuild.read_capped(fifo_path, 10) == (None, "it is not a regular file but a FIFO")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 11)
    os.chmod(big, 0o600)
    assert cbuild.read_capped(big, 10)[1] == "it is 11 bytes, more than the 10 it may be"
    assert cbuild.read_capped(big, 11) == (b"x" * 11, None)


# -- the native operator's record of a failed build ---------------------------------

NATIVE_RUN = "from vega.codegen.c import native\n" + CAP + r"""
import json, sys, warnings
from pathlib import Path
target = Path(sys.argv[1])
native._paths = lambda: (["false"], target)  # a build that fails at once
spawned = []
native._spawn = lambda t: spawned.append(str(t))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if sys.argv[2] == "scan":
        answer = native.module(wait=False)
    else:
        answer = native.build(target)
print(json.dumps({"answer": None if answer is None else str(answer), "spawned": spawned,
                  "failed": native._state["failed"],
                  "warned": [str(w.message) for w in caught]}))
"""


@pytest.mark.parametrize("spoil", [fifo, directory, huge], ids=["fifo", "directory", "huge"])
def test_an_unreadable_native_failure_record_is_removed_and_the_build_tried_again(
        cache, tmp_path, spoil):
    target = tmp_path / "native" / "vega_native-test.so"
    target.parent.mkdir(mode=0o700)
    record = native._failed_file(target)
    record.write_text("x")
    os.chmod(record, 0o600)
    spoil(record)
    ran = child(NATIVE_RUN, str(target), "scan", native_scanner="")
    assert ran["answer"] is None and ran["spawned"] == [str(target)] and ran["failed"] is None
    assert len(ran["warned"]) == 1 and str(record) in ran["warned"][0]
    assert not os.path.lexists(record)


def test_a_native_failure_record_of_random_bytes_is_read_as_a_failure(cache, tmp_path):
    target = tmp_path / "native" / "vega_native-test.so"
    target.parent.mkdir(mode=0o700)
    native._failed_file(target).write_bytes(b"\xff\xfe compiler said \x80\n")
    ran = child(NATIVE_RUN, str(target), "scan", native_scanner="")
    assert ran["answer"] is None and ran["spawned"] == [] and ran["warned"] == []
    assert "compiler said" in ran["failed"]


@pytest.mark.parametrize("spoil", [fifo, directory], ids=["fifo", "directory"])
def test_a_failed_native_build_replaces_whatever_is_at_its_record(cache, tmp_path, spoil):
    target = tmp_path / "native" / "vega_native-test.so"
    target.parent.mkdir(mode=0o700)
    record = native._failed_file(target)
    record.write_text("x")
    spoil(record)
    ran = child(NATIVE_RUN, str(target), "build", native_scanner="")
    assert "the C++ compiler failed" in ran["answer"]
    assert record.is_file() and "the C++ compiler failed" in record.read_text()


# -- an unusable VEGA_CACHE_DIR ---------------------------------------------------

@pytest.mark.parametrize("where, expected", [
    ("a file", "it is a file, not a directory"),
    ("under a file", "it cannot be created ({file} is not a directory)"),
    ("not writable", "it is not writable")])
def test_an_unusable_cache_dir_is_not_used_with_one_warning_naming_it(
        cache, tmp_path, monkeypatch, where, expected):
    file = tmp_path / "a-file"
    file.write_text("not a directory")
    root = {"a file": file, "under a file": file / "sub", "not writable": cache}[where]
    monkeypatch.setenv("VEGA_CACHE_DIR", str(root))
    if where == "not writable":  # (root writes anywhere: the check is os.access's)
        cache.mkdir(mode=0o700)
        monkeypatch.setattr(cbuild.os, "access", lambda path, mode: Path(path) != cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = [cbuild.build(SOURCE + f"// {n}\n") for n in range(2)]
    assert all(compiled for _, _, compiled in built)
    private = built[0][1].parent
    assert built[1][1].parent == private and not private.is_relative_to(tmp_path)
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1, warned
    assert f"VEGA_CACHE_DIR={root}" in warned[0] and expected.format(file=file) in warned[0]
    assert str(private.parent) in warned[0]
    assert file.read_text() == "not a directory"


def test_an_optimizer_steps_with_an_unusable_cache_dir(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("")
    code = r"""
import json, warnings, torch, vega
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = vega.optim.Adam([p], lr=0.5, backend="c")
    opt.step()
    opt.step()
print(json.dumps({"p": p.tolist(), "warned": [str(w.message) for w in caught]}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "VEGA_NATIVE": "0",
           "VEGA_CACHE_DIR": str(file / "sub")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.splitlines()[-1])
    assert ran["p"] == pytest.approx([0.0] * 3, abs=1e-6)
    assert len(ran["warned"]) == 1 and "VEGA_CACHE_DIR=" in ran["warned"][0]


def test_a_tilde_in_vega_cache_dir_is_the_home_directory(cache, tmp_path, monkeypatch):
    # set where no shell expands it (a container's ENV, a .env file): the kernels went into a
    # directory named "~" under the working directory, a new one wherever a run started
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VEGA_CACHE_DIR", "~/kernels")
    monkeypatch.chdir(tmp_path)
    _, path, compiled = cbuild.build(SOURCE)
    assert compiled and path.parent == tmp_path / "home" / "kernels" / "c"
    assert not (tmp_path / "~").exists()


def test_the_default_cache_follows_xdg_cache_home(cache, tmp_path, monkeypatch):
    # the XDG base directory rule, as torch's extension builder follows it: the kernels went
    # to ~/.cache/vega whatever XDG_CACHE_HOME said; a relative XDG_CACHE_HOME is ignored
    monkeypatch.delenv("VEGA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _, path, compiled = cbuild.build(SOURCE)
    assert compiled and path.parent == tmp_path / "xdg" / "vega" / "c"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.chdir(tmp_path)
    _, path, _ = cbuild.build(SOURCE)
    assert path.parent == tmp_path / "home" / ".cache" / "vega" / "c"
    assert not (tmp_path / "relative").exists()


def test_no_home_directory_builds_into_a_private_one_with_one_warning(cache, monkeypatch):
    # a container run under a uid of its own: no HOME, no entry in the password database,
    # so no ~/.cache to hold the default (pathlib raised "Could not determine home directory"
    # from inside the first step)
    import pwd

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")
    monkeypatch.delenv("VEGA_CACHE_DIR")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = [cbuild.build(SOURCE + f"// {n}\n") for n in range(2)]
        found = native._paths()
    assert all(compiled for _, _, compiled in built)
    private = built[0][1].parent
    assert private.name == "c" and built[1][1].parent == private
    assert private.parent == cbuild._fallback and private.parent.is_dir()
    if found is not None:  # (the native operator's library goes beside the kernels)
        assert found[1].parent == private.parent / "native"
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1, warned
    assert "home directory cannot be determined" in warned[0] and "HOME" in warned[0]
    assert "set VEGA_CACHE_DIR" in warned[0] and str(private.parent) in warned[0]


def test_a_home_directory_of_no_user_is_said_as_such(cache, tmp_path, monkeypatch):
    # VEGA_CACHE_DIR=~name/... of a user the password database does not hold, HOME set: the
    # warning said that HOME was not set and this uid had no entry
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VEGA_CACHE_DIR", "~no-such-user-of-vega/kernels")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = cbuild.cache_dir()
    assert path.parent == cbuild._fallback
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(warned) == 1, warned
    assert "the home directory ~no-such-user-of-vega cannot be determined (no user " \
        "'no-such-user-of-vega' in the password database)" in warned[0]
    assert "HOME" not in warned[0] and "uid" not in warned[0]


def test_no_private_directory_either_is_a_clear_error(cache, tmp_path, monkeypatch):
    file = tmp_path / "a-file"
    file.write_text("")
    monkeypatch.setenv("VEGA_CACHE_DIR", str(file))

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cbuild.tempfile, "mkdtemp", no_room)
    with pytest.raises(cbuild.CacheError, match="VEGA_CACHE_DIR=.*a-file.*nor can a private"):
        cbuild.build(SOURCE)


FORKED_RUN = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
from vega.codegen.c import build as cbuild
source = 'const char *vega_key(void) { return "@KEY@"; }\nint vega_answer(void) { return %d; }\n'
mine = cbuild.build(source % 1)[1].parent.parent

def waited(pid):  # a child that hangs fails the run at once
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            sys.exit("the child hung")
        time.sleep(0.05)

pid = os.fork()
if pid == 0:  # a child that builds, then ends as a script does: its exit handlers run
    print(json.dumps({"child": str(cbuild.build(source % 2)[1].parent.parent)}), flush=True)
    sys.exit(0)
waited(pid)
kept = mine.is_dir()
_, path, compiled = cbuild.build(source % 3)
print(json.dumps({"mine": str(mine), "kept": kept, "built": compiled,
                  "answer": cbuild.library(source % 3).vega_answer()}), flush=True)
if os.fork() == 0:  # a child that outlives its parent, then builds
    try:
        deadline = time.monotonic() + 60
        while mine.is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        at = cbuild.build(source % 4)[1].parent.parent
        said = {"orphan": str(at), "answer": cbuild.library(source % 4).vega_answer()}
    except BaseException as e:
        said = {"orphan": repr(e)}
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump(said, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    sys.exit(0)  # (its own directory removed at its exit)
"""


def test_a_forked_child_leaves_its_parents_private_directory(tmp_path):
    """A child made by ``os.fork`` that ends as a script does (``sys.exit``, not
    ``os._exit``) runs the exit handlers it inherited: the one that removes its parent's
    private directory (kept where ``VEGA_CACHE_DIR`` cannot be used) took it from under the
    parent, whose next build then failed with a bare FileNotFoundError. A child builds into
    its parent's directory and leaves it; one that outlives its parent makes its own."""
    file = tmp_path / "a-file"
    file.write_text("")
    said = tmp_path / "orphan.json"
    env = {**os.environ, "VEGA_CACHE_DIR": str(file), "VEGA_NATIVE": "0",
           "PYTHONPATH": str(REPO)}
    ran = subprocess.run([sys.executable, "-c", FORKED_RUN, str(said)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-2000:]
    child, parent = (json.loads(line) for line in ran.stdout.splitlines())
    assert parent["kept"] and parent["built"] and parent["answer"] == 3
    assert child["child"] == parent["mine"]
    deadline = time.monotonic() + 90
    while not said.exists() and time.monotonic() < deadline:  # (the orphan, still running)
        time.sleep(0.1)
    assert not os.path.exists(parent["mine"])  # removed when the parent ended
    orphan = json.loads(said.read_text())
    assert orphan.get("answer") == 4 and orphan["orphan"] != parent["mine"], orphan
    while os.path.exists(orphan["orphan"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(orphan["orphan"])


@pytest.mark.skipif(cbuild.fcntl is None, reason="no flock here")
def test_a_child_forked_while_the_directory_lock_is_held_does_not_keep_it(tmp_path):
    """A flock belongs to the open file, which a child made by ``os.fork`` shares: the
    directory's lock, let go by closing its descriptor, stayed held by a child forked while
    it was held (a DataLoader's worker forked while another thread installed a kernel) for
    as long as that child ran, and every later install or load, in the parent or any other
    process, waited for it. It is let go itself, whatever copies of it a child has."""
    r, w = os.pipe()
    with cbuild.locked(tmp_path, exclusive=True):
        pid = os.fork()
        if pid == 0:  # a worker that runs on
            os.close(w)
            os.read(r, 1)
            os._exit(0)
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        cbuild.fcntl.flock(fd, cbuild.fcntl.LOCK_EX | cbuild.fcntl.LOCK_NB)
    except BlockingIOError:
        pytest.fail("the directory's lock is held by the forked child")
    finally:
        os.close(fd)
        os.close(w)
        os.close(r)
        os.waitpid(pid, 0)


def test_a_kernel_the_loader_refuses_says_why(cache, monkeypatch):
    """A kernel compiled that the dynamic loader refuses (a cache on a file system mounted
    noexec: "failed to map segment from shared object") raised "the compiled kernel ...
    does not load", the loader's words dropped: nothing said what to change."""
    real = ctypes.CDLL

    def refuse(name, *args, **kwargs):
        if str(name).startswith(str(cache)):
            raise OSError(f"{name}: failed to map segment from shared object")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(cbuild.ctypes, "CDLL", refuse)
    with pytest.raises(cbuild.CompilerError, match=r"does not load: the loader refuses it: .*"
                                                   r"failed to map segment from shared object"):
        cbuild.build(SOURCE)
