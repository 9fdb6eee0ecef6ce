"""tests/forks.py, the fork server that runs the suite's child scripts: a child's exit status,
output and timeout are a fresh ``python -c``'s. (Servers here import json alone: fast.)"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forks

ENV = {**os.environ, "VEGA_TEST_FORKS": "1"}  # (servers of their own)


def run(script, *args, **kw):
    return forks.run(script, *args, env=ENV, imports=("json",), **kw)


def test_a_script_runs_as_python_c_would():
    done = run("import sys; print(sys.argv[1:], sys.stdin.read() == '', __name__); "
               "print('to stderr', file=sys.stderr)", "a", "b")
    assert done.returncode == 0
    assert done.stdout == "['a', 'b'] True __main__\n" and done.stderr == "to stderr\n"
    assert run("import sys; sys.exit(3)").returncode == 3
    done = run("import sys; sys.exit('words')")
    assert (done.returncode, done.stderr) == (1, "words\n")
    done = run("print('before'); raise KeyError('k')")
    assert done.returncode == 1 and done.stdout == "before\n" and "KeyError: 'k'" in done.stderr
    done = run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert done.returncode == -signal.SIGSEGV and "Fatal Python error" in done.stderr
    assert run("print('on')").stdout == "on\n"  # (the crash ended its child alone)


def test_a_script_that_ends_before_its_status_is_read_is_answered(monkeypatch):
    """A child that had ended by the time the test read the server's answer (a script failing
    at once, the test's process not scheduled a while): its status is read at once, not
    after the timeout (the two lines of the pid and the status, read together into the
    pipe's buffer, left the second waited for on the pipe: TimeoutExpired at the deadline,
    then the kill of a pid the server had waited for, ProcessLookupError, or another
    process's)."""
    made = subprocess.Popen

    class Slow(made):  # (the test's process slow to read after each job it sends)
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            flush = self.stdin.flush
            self.stdin.flush = lambda: (flush(), time.sleep(1.0))[0]
    env = {**ENV, "VEGA_TEST_FORKS": "slow"}
    monkeypatch.setattr(subprocess, "Popen", Slow)
    try:
        start = time.monotonic()
        done = forks.run("raise SystemExit(4)", env=env, imports=("json",), timeout=20)
        assert done.returncode == 4 and time.monotonic() - start < 15
    finally:
        for key in [k for k in forks._servers if ("VEGA_TEST_FORKS", "slow") in k[0]]:
            forks._stop(forks._servers.pop(key))


def test_a_script_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run("import os, sys, time\n"
            "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
            "time.sleep(600)", str(pid_file), timeout=2)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # (killed, and waited for by its server)
        os.kill(pid, 0)
    assert run("print('next')").stdout == "next\n"


def test_a_server_ends_with_its_process():
    """The servers a process started end when it does (at exit, its pipe closed)."""
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from tests import forks\n"
            "forks.run('pass', imports=('json',))\n"
            "print(*(p.pid for p in forks._servers.values()))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for pid in map(int, out.split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_wait_interrupted_leaves_no_answer_for_the_next_script(tmp_path):
    """A test interrupted while its script ran (a signal's handler raising, a timeout
    plugin's): the script and its server are ended, and the next script's answer is its
    own (the first's status, answered later, was read as the next's, with the next's
    output not yet written)."""
    pid_file = tmp_path / "pid"

    def interrupt(*_):
        raise InterruptedError("interrupted")
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.alarm(2)
        with pytest.raises(InterruptedError):
            run("import os, sys, time\n"
                "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                "time.sleep(4)", str(pid_file))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    done = run("print('next')")
    assert (done.returncode, done.stdout) == (0, "next\n")
    assert ended(int(pid_file.read_text()))  # (the interrupted script, with its server)


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its new parent has yet to wait
    for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
