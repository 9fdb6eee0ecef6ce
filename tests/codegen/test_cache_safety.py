"""The kernel cache is safe to share and to trust: keyed by the CPU ``-march=native`` builds
for, kept owner-only, and a library is loaded only if it is this user's, not writable by
others and hashes to the SHA-256 its build recorded; anything else is rebuilt, with one
warning a process.

The untrusted libraries here are *planted*: a library at a kernel's place in the cache that
answers the kernel's key (so the loader's own check would take it) and leaves a marker file
when it is loaded (its constructor runs at load). A control test shows a planted library with
nothing wrong with it is loaded; each other test spoils one thing and checks the marker never
appears and the kernel is built anew."""
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import vega
from vega.codegen import c
from vega.codegen.c import build as cbuild
from vega.codegen.c import native

pytestmark = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler here")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
OTHER_UID = 12345


def source(n: int) -> str:
    spec = vega.compile(f"optimizer safe{n}(lr = 0.5) {{ p = p - lr * g * {n} }}")
    return c.Source(spec.program(), "float32", "float32", "float32").text()


def record_hash(path: Path) -> None:
    """Record ``path``'s SHA-256 beside it, as a build does."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cbuild.hash_file(path).write_text(f"{digest}  {path.name}\n")
    os.chmod(cbuild.hash_file(path), 0o600)


def planted(at: Path, key: str, marker: Path) -> Path:
    """Compile, at ``at``, a library whose ``vega_key`` answers ``key`` and whose constructor
    creates ``marker``; owner-only, its hash recorded: nothing wrong with it but its origin."""
    at.parent.mkdir(parents=True, exist_ok=True)
    src = at.with_name(at.name + ".planted.c")
    src.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        f"__attribute__((constructor)) static void planted(void) {{\n"
        f"    close(open(\"{marker}\", O_CREAT | O_WRONLY, 0600));\n}}\n"
        f"const char *vega_key(void) {{ return \"{key}\"; }}\n")
    subprocess.run([*cbuild.command(cbuild.compiler()), "-shared", "-fPIC", str(src), "-o",
                    str(at)],
                   check=True, capture_output=True)
    src.unlink()
    os.chmod(at, 0o700)
    record_hash(at)
    return at


def plant(cache: Path, n: int, marker: Path) -> Path:
    """A planted library at the place of kernel ``source(n)`` in the cache."""
    key = cbuild.key_of(source(n))
    directory = cache / "c"
    if not directory.exists():
        directory.mkdir(parents=True, mode=0o700)
    return planted(directory / f"{key}.so", key, marker)


def building(*sources):
    """``cbuild.build`` of each source: [(path, whether compiled now)], and the messages of
    the cache warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = [cbuild.build(s)[1:] for s in sources]
    return built, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                   and str(w.message).startswith("vega: not ")]


# -- the key ----------------------------------------------------------------------

def test_the_key_holds_the_target_cpu(monkeypatch):
    text = source(1)
    monkeypatch.setattr(cbuild, "target_cpu", lambda: "-march=skylake-avx512 -mavx512f")
    skylake = cbuild.key_of(text)
    assert cbuild.key_of(text) == skylake
    monkeypatch.setattr(cbuild, "target_cpu", lambda: "-march=haswell -mno-avx512f")
    assert cbuild.key_of(text) != skylake


def test_the_target_cpu_is_what_march_native_resolves_to():
    cpu = cbuild.target_cpu()
    assert "native" not in cpu
    assert cpu.startswith("cpuinfo ") or "-march=" in cpu or "-target-cpu" in cpu
    gcc = (" /usr/lib/gcc/x86_64-linux-gnu/12/cc1 -E -quiet -v -imultiarch x86_64-linux-gnu - "
           "-march=haswell -mmmx -mno-avx512f --param l1-cache-size=32 -mtune=haswell "
           "-dumpbase -")
    assert cbuild._native_target("COLLECT_GCC_OPTIONS='-march=native' '-E'\n" + gcc) == \
        "-march=haswell -mmmx -mno-avx512f --param l1-cache-size=32 -mtune=haswell"
    clang = ('"/usr/bin/clang" "-cc1" "-triple" "x86_64-pc-linux-gnu" "-E" "-target-cpu" '
             '"znver3" "-target-feature" "+avx2" "-target-feature" "-avx512f" '
             '"-fdebug-compilation-dir=/home/someone"')
    assert cbuild._native_target(clang) == \
        "-triple x86_64-pc-linux-gnu -target-cpu znver3 -target-feature +avx2 " \
        "-target-feature -avx512f"
    assert cbuild._native_target("cc1 -march=native -E") is None  # not resolved: not used


def test_without_the_compilers_word_the_cpu_is_cpuinfos(monkeypatch):
    monkeypatch.setattr(cbuild, "compiler", lambda: (sys.executable, "not a C compiler"))
    cbuild.target_cpu.cache_clear()
    try:
        cpu = cbuild.target_cpu()
    finally:
        cbuild.target_cpu.cache_clear()
    assert cpu.startswith("cpuinfo ")
    if os.path.exists("/proc/cpuinfo") and "flags" in Path("/proc/cpuinfo").read_text():
        assert "flags: " in cpu


def test_the_compiler_is_asked_once_per_process_and_not_at_import(cache, monkeypatch):
    code = ("import vega, vega.optim; from vega.codegen import c; "
            "from vega.codegen.c import build as cbuild, native; "
            "print(cbuild.target_cpu.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["0"]
    asked = []
    real = subprocess.run

    def spying(args, *rest, **kwargs):
        if "-march=native" in args and "-E" in args:
            asked.append(args)
        return real(args, *rest, **kwargs)
    monkeypatch.setattr(cbuild.subprocess, "run", spying)
    cbuild.target_cpu.cache_clear()
    try:
        building(source(2), source(3), source(2))
    finally:
        cbuild.target_cpu.cache_clear()
    assert len(asked) == 1


# -- the directory ----------------------------------------------------------------

def test_the_cache_is_created_owner_only_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        built, warned = building(source(4))
        again, warned_again = building(source(4))
    finally:
        os.umask(old)
    (path, compiled), = built
    assert compiled and path.parent == cache / "c"
    assert (os.stat(cache).st_mode & 0o777, os.stat(cache / "c").st_mode & 0o777) == \
        (0o700, 0o700)
    assert os.stat(path).st_mode & 0o077 == 0 and cbuild.hash_file(path).exists()
    assert os.stat(cbuild.hash_file(path)).st_mode & 0o077 == 0
    assert again == [(path, False)] and warned == warned_again == []  # and trusted later


@needs_root
@pytest.mark.parametrize("spoil", ["root not ours", "root group-writable",
                                   "root world-writable", "c not ours", "c group-writable"])
def test_a_directory_that_is_not_safe_is_not_used(cache, tmp_path, spoil):
    marker = tmp_path / "loaded"
    plant(cache, 5, marker)
    where, how = spoil.split(" ", 1)
    directory = cache if where == "root" else cache / "c"
    if how == "not ours":
        os.chown(directory, OTHER_UID, -1)
    else:
        os.chmod(directory, 0o770 if how == "group-writable" else 0o707)
    before = sorted(os.listdir(cache / "c"))
    built, warned = building(source(5), source(6))
    assert not marker.exists()  # the planted library in it was not loaded
    assert all(compiled for _, compiled in built)
    private = built[0][0].parent
    assert built[1][0].parent == private and not private.is_relative_to(cache)
    assert os.stat(private).st_uid == os.geteuid() and os.stat(private).st_mode & 0o077 == 0
    assert os.stat(private.parent).st_mode & 0o077 == 0
    assert sorted(os.listdir(cache / "c")) == before  # nothing written into it
    assert len(warned) == 1 and str(directory) in warned[0] and str(private.parent) in warned[0]
    assert ("owned by uid 12345" if how == "not ours" else "writable by") in warned[0]


# -- the library ------------------------------------------------------------------

def test_a_planted_library_with_nothing_wrong_is_loaded(cache, tmp_path):
    """The control: what the tests below spoil is all that keeps a planted library out."""
    marker = tmp_path / "loaded"
    path = plant(cache, 7, marker)
    built, warned = building(source(7))
    assert built == [(path, False)] and marker.exists() and warned == []


def _rebuilt_with_one_warning(cache, tmp_path, spoil, expected):
    markers = [tmp_path / "loaded-8", tmp_path / "loaded-9"]
    paths = [plant(cache, 8, markers[0]), plant(cache, 9, markers[1])]
    for path in paths:
        spoil(path)
    built, warned = building(source(8), source(9))
    assert built == [(paths[0], True), (paths[1], True)]
    assert not any(m.exists() for m in markers)
    assert len(warned) == 1 and str(paths[0]) in warned[0] and expected in warned[0], warned
    for path in paths:  # replaced by a build of its own, trusted from now on
        assert cbuild.untrusted(path) is None


@needs_root
def test_a_library_owned_by_another_user_is_rebuilt_with_one_warning(cache, tmp_path):
    _rebuilt_with_one_warning(cache, tmp_path, lambda p: os.chown(p, OTHER_UID, -1),
                              f"owned by uid {OTHER_UID}, not by this user")


@pytest.mark.parametrize("mode", [0o770, 0o702], ids=["group", "others"])
def test_a_library_writable_by_group_or_others_is_rebuilt_with_one_warning(cache, tmp_path,
                                                                          mode):
    _rebuilt_with_one_warning(cache, tmp_path, lambda p: os.chmod(p, mode),
                              f"writable by {'group' if mode & 0o020 else 'others'}")


@needs_root
def test_a_hash_owned_by_another_user_is_not_trusted(cache, tmp_path):
    _rebuilt_with_one_warning(
        cache, tmp_path, lambda p: os.chown(cbuild.hash_file(p), OTHER_UID, -1),
        f"owned by uid {OTHER_UID}")


def _append_a_byte(path):
    with open(path, "ab") as f:
        f.write(b"\0")


def _another_library(path):
    """Another valid library in its place (also answering the key), the hash left as was."""
    other = planted(path.with_name("other.so"), path.stem, path.with_name("other-loaded"))
    os.replace(other, path)


def _link_elsewhere(path):
    """A link to the library, moved out of the cache (its bytes, so its hash, as recorded)."""
    moved = path.parent.parent / path.name
    os.replace(path, moved)
    path.symlink_to(moved)


@pytest.mark.parametrize("change, expected", [
    (_append_a_byte, "SHA-256 differs"),
    (_another_library, "SHA-256 differs"),
    (lambda p: cbuild.hash_file(p).unlink(), "no SHA-256 was recorded"),
    (_link_elsewhere, "a link is not followed")], ids=["appended", "replaced", "no hash", "link"])
def test_a_changed_library_is_rebuilt_with_one_warning(cache, tmp_path, change, expected):
    _rebuilt_with_one_warning(cache, tmp_path, change, expected)
    assert not list(cache.glob("c/other-loaded"))


# -- the native operator -----------------------------------------------------------

@needs_root
def test_an_untrusted_native_scanner_is_not_loaded_but_rebuilt(request, tmp_path, monkeypatch):
    if native._paths() is None:
        pytest.skip("no C++ compiler or Python headers here")
    request.getfixturevalue("copying")  # (its rebuild a copy of the session's: the checks
    request.getfixturevalue("cache")    # are what is tested; a compile takes half a minute)
    saved = dict(native._state)
    monkeypatch.delenv("VEGA_NATIVE", raising=False)
    _, target = native._paths()
    target = cbuild.safe_dir(target.parent) / target.name
    planted(target, "", tmp_path / "loaded")
    os.chown(target, OTHER_UID, -1)
    module, problem = native._opened(target)
    assert module is None and f"owned by uid {OTHER_UID}" in problem
    native._state.update(module=None, pending=None, failed=None, next_poll=0.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scanner = native.module(wait=True)
    finally:
        native._state.clear()
        native._state.update(saved)
    assert scanner is not None and not (tmp_path / "loaded").exists()
    warned = [str(w.message) for w in caught if str(w.message).startswith("vega: not ")]
    assert len(warned) == 1 and str(target) in warned[0]
    assert os.stat(target).st_uid == os.geteuid() and cbuild.untrusted(target) is None
