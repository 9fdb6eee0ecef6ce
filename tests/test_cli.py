"""The command line: check, show, list, demo."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vega
from vega import cli, codegen


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "vega.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def run_bounded(*args):
    """``run``, in at most 4 GiB of address space (set by the child itself, before it
    imports vega) and 120 seconds: a command that reads a device without end, or blocks on
    a FIFO, fails the test instead of the machine."""
    child = ("import resource, runpy; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
             "runpy.run_module('vega.cli', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", child, *args], capture_output=True,
                          text=True, timeout=120)


def test_check_good_and_bad(tmp_path):
    bad = tmp_path / "bad.vega"
    bad.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * sqr(g)\n}\n")
    good = tmp_path / "good.vega"
    good.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n")
    out = run("check", str(good), str(bad))
    assert out.returncode == 1
    assert f"{good}: ok: optimizer o(lr=0.001)" in out.stdout
    assert f"{bad}:2:16: error: unknown function 'sqr' (did you mean 'sqrt' or 'rsqrt'?)" in out.stderr
    assert "^^^" in out.stderr and "Traceback" not in out.stderr
    assert run("check", str(good)).returncode == 0
    assert run("check", str(tmp_path / "nope.vega")).returncode == 1


def test_check_prints_each_files_first_error(tmp_path, capsys):
    # a file with two mistakes: the first is said (a spec stops at its first error), once,
    # as the README and vega --help say
    two = tmp_path / "two.vega"
    two.write_text("optimizer o(lr = 1e-3) {\n  x = sqr(g)\n  y = foo + 1\n  p = p - x * y\n}\n")
    assert cli.main(["check", str(two)]) == 1
    err = capsys.readouterr().err
    assert err.count(": error: ") == 1 and f"{two}:2:7: error: unknown function 'sqr'" in err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    said = "vega check FILE... compile specs; print each file's first error, exit 1 on any"
    assert said in " ".join(capsys.readouterr().out.split())
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert said in " ".join(readme.split())


def test_python_dash_m_vega_is_the_command():
    # where the environment's scripts directory is not on PATH
    out = subprocess.run([sys.executable, "-m", "vega", "list"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "adamw" in out.stdout.split()
    out = subprocess.run([sys.executable, "-m", "vega", "nope"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr


def test_show_list_and_help(capsys):
    assert cli.main(["show", "adam", "--backend", "reference", "--set", "amsgrad=true"]) == 0
    text = capsys.readouterr().out
    assert "def scalars(" in text and "nu_max" in text and "torch.where(" in text
    assert cli.main(["show", "adam", "--backend", "cuda"]) == 1
    assert "vega: backend='cuda' is not one of" in capsys.readouterr().err
    assert cli.main(["show", "adam", "--backend", ""]) == 1  # (not the default backend)
    assert "vega: backend='' is not one of" in capsys.readouterr().err
    # (said as the command's other errors are; a spec file's error keeps its file:line:col)
    assert cli.main(["show", "nonesuch"]) == 1
    assert capsys.readouterr().err.startswith("vega: no shipped optimizer 'nonesuch'; there ")
    assert cli.main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in ("sgd", "adam", "adamw"):
        assert name in listing
    assert "vega.optim.AdamW" in listing
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    helptext = capsys.readouterr().out
    for command in ("check", "show", "list", "demo"):
        assert f"vega {command}" in helptext
    assert "the kernel a step on CPU tensors runs (C where a C compiler is found, else the " \
        "reference)" in " ".join(helptext.split())
    demo = ("train a small classifier with vega's AdamW and SGD, an AdaBelief spec compiled on "
            "the spot and torch.optim.AdamW")  # the four rows vega.demo trains
    assert " ".join(helptext.split()).count(demo) == 2  # the commands' list and demo's line
    with pytest.raises(SystemExit):
        cli.main(["show", "--help"])
    assert "(default: the kernel a step on CPU tensors runs, c where a C compiler is found, " \
        "else reference)" in " ".join(capsys.readouterr().out.split())


def test_show_prints_the_kernel_a_cpu_step_runs(capsys, monkeypatch):
    """By default the C kernel, where there is a C compiler; else the reference."""
    assert cli.main(["show", "adamw"]) == 0
    want = vega.builtin("adamw").source(codegen.default_backend("cpu"))
    assert capsys.readouterr().out == want + "\n"
    if codegen.c.available():
        assert want.startswith("/* vega C kernel: adamw")
    assert cli.main(["show", "adamw", "--backend", "reference"]) == 0
    assert capsys.readouterr().out.startswith("# adamw: reference kernel")
    monkeypatch.setattr(codegen.c, "available", lambda: False)
    assert cli.main(["show", "adamw"]) == 0
    assert capsys.readouterr().out.startswith("# adamw: reference kernel")


def _into_a_closed_pipe(*args):
    """The command with its output a pipe whose reader has gone, as in ``vega show adamw |
    head`` once head has read its lines and exited (closed before the command starts,
    not after a few bytes: a small output would fit in the pipe and never fail)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "vega.cli", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [("show", "adamw"), ("list",), ("demo", "--steps", "2"),
                                  ("bench", "--quick")], ids=["show", "list", "demo", "bench"])
def test_a_reader_that_goes_away_ends_the_command_quietly(args):
    """Each command stops at its first line out (demo and bench print as they go)."""
    out = _into_a_closed_pipe(*args)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"


def test_check_into_a_closed_pipe_still_checks_every_file(tmp_path):
    good = tmp_path / "good.vega"
    good.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n")
    bad = tmp_path / "bad.vega"
    bad.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * sqr(g)\n}\n")
    out = _into_a_closed_pipe("check", str(good), str(good), str(bad))
    assert out.returncode == 1 and "unknown function 'sqr'" in out.stderr
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr
    assert _into_a_closed_pipe("check", str(good)).returncode == 0


def test_demo_runs_and_learns(capsys):
    assert cli.main(["demo", "--steps", "60"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("vega.optim", "torch.optim",
                                                                   "adabelief"))]
    assert len(rows) == 4
    losses = [float(r.split()[-4]) for r in rows]
    assert all(loss < 1.0 for loss in losses)  # ln(3) = 1.0986 at the start


def test_demo_waits_for_the_native_operator_being_built(monkeypatch):
    """On a fresh install the native operator builds in the background: the demo says so
    and waits for it, so that no step it times runs beside the compiler."""
    import io

    from vega import demo
    from vega.codegen.c import native
    waits = []
    monkeypatch.setattr(native, "module", lambda wait=None: waits.append(wait))
    monkeypatch.setattr(native, "status", lambda: "native operator still building")
    out = io.StringIO()
    demo._native_ready(out)
    assert "building vega's native operator once" in out.getvalue() and waits == [None, True]
    monkeypatch.setattr(native, "status", lambda: "native operator unavailable: no compiler")
    out = io.StringIO()
    demo._native_ready(out)
    assert out.getvalue() == ""


def test_show_takes_a_shape(capsys):
    from vega.cli import main
    assert main(["show", "adafactor", "--backend", "reference", "--shape", "256,128"]) == 0
    shaped = capsys.readouterr().out
    assert "def init_s_v_row" in shaped and "_reduce(" in shaped
    assert main(["show", "adafactor", "--backend", "reference"]) == 0
    assert "def init_s_v(" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--shape"):
        main(["show", "adafactor", "--shape", "a,b"])
    capsys.readouterr()
    for shape in ("256,128,", " 256 , 128 "):  # (a trailing comma, as in a Python tuple)
        assert main(["show", "adafactor", "--backend", "reference", "--shape", shape]) == 0
        assert capsys.readouterr().out == shaped


def test_show_sets_a_float_hyperparameter(capsys):
    from vega.cli import main
    assert main(["show", "sgd", "--backend", "reference", "--set", "momentum=0.9", "--set",
                 "nesterov=true"]) == 0
    out = capsys.readouterr().out
    assert "def init_s_v(" in out and "nesterov=true" in out
    assert main(["show", "sgd", "--backend", "reference"]) == 0
    assert "def init_s_v(" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="momentum is a number: write momentum=0.9"):
        main(["show", "sgd", "--set", "momentum=lots"])
    with pytest.raises(SystemExit, match="nesterov is a bool: write nesterov=true or"):
        main(["show", "sgd", "--set", "nesterov=1"])


def test_check_reports_each_file_it_cannot_read_and_goes_on(tmp_path):
    """A device read without end (/dev/zero), a FIFO that would block, a directory, a file
    that is not UTF-8, one over 1 MiB, a missing one: each its own line, no traceback, the
    files after them checked, exit 1."""
    good = tmp_path / "good.vega"
    good.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n")
    binary = tmp_path / "bin.vega"
    binary.write_bytes(b"\xff\xfe optimizer")
    big = tmp_path / "big.vega"
    big.write_bytes(b" " * ((1 << 20) + 1))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    files = ["/dev/zero", str(binary), str(tmp_path), str(fifo), str(tmp_path / "nope.vega"),
             str(big), str(good)]
    out = run_bounded("check", *files)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "/dev/zero: error: a character device, not a regular file; a spec is read from a "
        ".vega file",
        f"{binary}: error: not UTF-8 text (byte 0xff at offset 0); a spec file is UTF-8 text",
        f"{tmp_path}: error: a directory, not a regular file; a spec is read from a .vega file",
        f"{fifo}: error: a FIFO, not a regular file; a spec is read from a .vega file",
        f"{tmp_path / 'nope.vega'}: error: cannot read spec file: No such file or directory",
        f"{big}: error: larger than 1048576 bytes (1 MiB), the most a spec file may have; is "
        "it a spec?"]
    assert out.stdout == f"{good}: ok: optimizer o(lr=0.001)\n"


def test_show_reports_a_file_it_cannot_read(tmp_path, capsys):
    from vega.cli import main
    binary = tmp_path / "bin.vega"
    binary.write_bytes(b"\xff\xfe optimizer")
    for target, message in [("/dev/null", "a character device, not a regular file"),
                            (str(binary), "not UTF-8 text"),
                            (str(tmp_path), "a directory, not a regular file")]:
        assert main(["show", target]) == 1
        assert f"{target}: error: {message}" in capsys.readouterr().err
    out = run_bounded("show", "/dev/zero")
    assert out.returncode == 1 and out.stderr == (
        "/dev/zero: error: a character device, not a regular file; a spec is read from a "
        ".vega file\n")


def test_show_of_a_shipped_name_is_the_shipped_spec_whatever_the_directory_holds(
        tmp_path, capsys, monkeypatch):
    """A file or directory named as a shipped spec in the working directory (``adamw``,
    ``sgd/``) does not stand in for the spec ``vega show adamw`` names (it was read in its
    place: an error for any file that was not that spec); a note on stderr says how to name
    the path, and ``./adamw`` (or ``adamw.vega``, any name not shipped) is the file."""
    from vega.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adamw").write_text("hello\n")
    (tmp_path / "sgd").mkdir()
    (tmp_path / "mine").write_text("optimizer mine(lr = 0.1) {\n  p = p - lr * g\n}\n")
    for name in ("adamw", "sgd"):
        assert main(["show", name, "--backend", "reference"]) == 0
        out = capsys.readouterr()
        assert out.out.startswith(f"# {name}: reference kernel"), out
        assert out.err == (f"vega: {name} is the shipped spec's name (for the {name} in this "
                           f"directory, write ./{name})\n")
    assert main(["show", "./adamw", "--backend", "reference"]) == 1
    assert "adamw:1:1: error: unexpected 'hello'" in capsys.readouterr().err
    assert main(["show", "mine", "--backend", "reference"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("# mine: reference kernel") and out.err == ""
    assert main(["show", "lion", "--backend", "reference"]) == 0  # (no file of that name)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("shape,message", [
    ("-1,2", "a size is a whole number >= 0, got -1"),
    ("1000000000000000000000000000000", "too large: a tensor has at most 2**63 - 1 elements"),
    ("4294967296,4294967296", "too large"),
    ("0,100000000000000000000000", "too large"),
    ("3,,4", "an empty size"),
    (",5", "an empty size"),
    ("5,,", "an empty size"),
])
def test_show_refuses_a_shape_no_tensor_has(shape, message):
    from vega.cli import main
    with pytest.raises(SystemExit, match=re.escape(f"vega: --shape {shape!r}: {message}")):
        main(["show", "adafactor", f"--shape={shape}"])
    if shape == "-1,2":  # (one run of the command itself: each takes seconds)
        out = run("show", "adafactor", f"--shape={shape}")
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr == f"vega: --shape {shape!r}: {message}\n"


@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**64 - 1), "x"])
def test_demo_refuses_a_seed_torch_cannot_take(seed, capsys):
    """A --seed past what torch's generators take (the demo seeds one with seed + 1) is an
    argument error, before anything trains: it was a traceback from torch.manual_seed
    (ValueError: Overflow when unpacking long long)."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--seed", seed, "--steps", "1"])
    assert exc.value.code == 2
    assert f"argument --seed: {seed!r} is not a whole number in" in capsys.readouterr().err


@pytest.mark.parametrize("args,status", [(("list",), 0), (("check", "nope.vega"), 1)],
                         ids=["list", "check"])
def test_a_closed_stdout_is_no_traceback(args, status):
    """``vega list >&-``: Python starts with sys.stdout None where its descriptor is closed;
    the command's output goes nowhere and it exits with its status, as for a reader that has
    gone (it was an AttributeError from ``sys.stdout.flush()``, exit 1)."""
    out = subprocess.run(["sh", "-c", 'exec "$0" -m vega.cli "$@" >&-', sys.executable, *args],
                         stderr=subprocess.PIPE, text=True, timeout=120)
    assert "Traceback" not in out.stderr and out.returncode == status, out.stderr


def test_a_file_name_the_output_encoding_cannot_spell_is_no_traceback(tmp_path):
    """``vega check gé.vega`` under an ASCII output encoding (PYTHONIOENCODING=ascii, or a
    locale whose encoding lacks the name's letters): the name is printed with escapes, as
    stderr prints it, where it was a UnicodeEncodeError traceback."""
    good = tmp_path / "gé.vega"
    good.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * g\n}\n")
    out = subprocess.run([sys.executable, "-m", "vega.cli", "check", str(good)],
                         capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert out.returncode == 0 and out.stderr == b""
    assert out.stdout.endswith(b"g\\xe9.vega: ok: optimizer o(lr=0.001)\n")


def test_list_gives_each_shipped_optimizer_a_whole_summary(capsys):
    """``vega list`` shows a spec's first comment line (docs/language.md): for each shipped
    spec, a sentence, not the start of one cut at the line's end (dadapt_adamw's read
    "... estimates the distance to the solution")."""
    assert cli.main(["list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows] == vega.builtin_names()
    for row in rows:
        assert row.endswith("."), row


def test_show_names_a_misspelt_hyperparameter_whatever_its_value(capsys):
    """``--set momentun=abc`` is a misspelling of momentum: the spec names it and its near
    name, as for ``--set momentun=0.9``, where it was told to write NAME=NUMBER."""
    for value in ("abc", "0.9", "true"):
        assert cli.main(["show", "lars", "--set", f"momentun={value}"]) == 1
        assert "unexpected hyperparameter 'momentun' (did you mean 'momentum'?)" in \
            capsys.readouterr().err


def test_show_of_a_path_that_is_not_there_says_so(tmp_path, capsys, monkeypatch):
    """A target with a directory in it (``./adamw``, as the note for a file named as a
    shipped spec says to write) is a path whatever is there: a missing one is a file that
    cannot be read, not an unknown shipped optimizer."""
    monkeypatch.chdir(tmp_path)
    for target in ("./adamw", "specs/mine", str(tmp_path / "absent")):
        assert cli.main(["show", target]) == 1
        err = capsys.readouterr().err
        assert f"{os.path.normpath(target)}: error: cannot read spec file: No such file" \
            in err, err
        assert "no shipped optimizer" not in err, err


def test_show_of_a_spec_without_hyperparameters_names_any_set_as_not_its_own(
        tmp_path, capsys):
    """A spec that takes no hyperparameters: ``--set lr=abc`` is refused as a name it does
    not take, as ``--set lr=0.1`` is, not as a value to write as NAME=NUMBER."""
    path = tmp_path / "plain.vega"
    path.write_text("optimizer plain() {\n    p = p - 0.1 * g\n}\n")
    for value in ("abc", "0.1", "true"):
        assert cli.main(["show", str(path), "--set", f"lr={value}"]) == 1
        err = capsys.readouterr().err
        assert "plain got an unexpected hyperparameter 'lr'; it takes none" in err, err


def test_help_gives_the_exit_statuses_the_commands_return(capsys, tmp_path):
    """``vega --help`` says what each exit status means, and each is the one returned: 0,
    1 for a command that failed (a spec with an error), 2 for a usage error."""
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 on success, 1 where a command fails" in text
    assert "2 for a usage error" in text
    bad = tmp_path / "bad.vega"
    bad.write_text("optimizer bad\nupdate { p = p - }\n")
    assert cli.main(["check", str(bad)]) == 1
    with pytest.raises(SystemExit) as done:
        cli.main(["check"])  # (a missing argument)
    assert done.value.code == 2
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--repeat", "0"])
    assert done.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "(default: 1)" in capsys.readouterr().out
