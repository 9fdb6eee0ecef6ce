"""Fresh processes for scripts that begin by importing torch and vega, without paying for
those imports (about 3 s of a CPU) each time: a server process imports them once (and runs
nothing of vega's), then forks a child for each script. The child runs the script as
``python -X faulthandler -c script args...`` would: in a ``__main__`` of its own, with its
``sys.argv``, stdin from /dev/null, its stdout and stderr captured, and the atexit functions
run at the end; its exit status is the script's (minus the signal's number where one ended
it). A crash of the script (a segmentation fault) ends its child alone.

The state a child starts from is the server's just after its imports, as a fresh process's
is after the script's own: use it only for scripts whose first lines import those modules
(and set nothing that the imports read)."""
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile

SERVER = r"""
import json, os, signal, sys, time
for name in sys.argv[1:]:
    __import__(name)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import atexit, faulthandler, traceback, types
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
            if job["cwd"] is not None:
                os.chdir(job["cwd"])
            faulthandler.enable()
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            sys.argv = ["-c", *job["argv"]]
            try:
                exec(compile(job["script"], "<string>", "exec"), main.__dict__)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if not isinstance(e.code, int) and e.code is not None:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    # (the server waits for its child, and kills it at its deadline before it has waited
    # for it: the pid is still that child's; one line a job, read once it has ended)
    late, deadline = False, None if job["timeout"] is None else time.monotonic() + job["timeout"]
    if deadline is None:
        _, status = os.waitpid(pid, 0)
    else:
        nap = 0.001
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                late = True
                break
            time.sleep(nap)
            nap = min(2 * nap, 0.05)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "late": late}), flush=True)
"""

# (environment, imports) -> its server, the most recently used last; at most KEEP of them
# (an idle server holds some 160 MB of its own)
_servers: dict = {}
KEEP = 2


def _server(env: dict, imports: tuple[str, ...]) -> subprocess.Popen:
    key = (tuple(sorted(env.items())), imports)
    proc = _servers.pop(key, None)
    if proc is None or proc.poll() is not None:
        while len(_servers) >= KEEP:
            _stop(_servers.pop(next(iter(_servers))))
        # (a session of its own: a group of the server and its children, ended together)
        proc = subprocess.Popen([sys.executable, "-c", SERVER, *imports], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    _servers[key] = proc
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the fork server ended with {proc.wait()}")
    return json.loads(line)


def run(script: str, *args: str, env: dict | None = None, timeout: float | None = None,
        imports: tuple[str, ...] = ("torch", "vega"), cwd=None) -> subprocess.CompletedProcess:
    """``script`` run with ``args`` in a child forked from a server that has imported
    ``imports`` under ``env`` (default: this process's environment), in the directory
    ``cwd`` (default: the server's, this process's when it started it): a
    CompletedProcess with its exit status and its stdout and stderr as text. Raises
    TimeoutExpired (the child killed) where it runs past ``timeout`` seconds."""
    env = dict(os.environ if env is None else env)
    env.pop("PYTEST_CURRENT_TEST", None)  # (pytest's name of the test: one server for all)
    proc = _server(env, tuple(imports))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out, err):
            open(path, "w").close()
        proc.stdin.write(json.dumps({"script": script, "argv": list(args), "stdout": out,
                                     "stderr": err, "timeout": timeout,
                                     "cwd": None if cwd is None else str(cwd)}) + "\n")
        try:
            proc.stdin.flush()
            done = _read(proc)
        except BaseException:
            # interrupted (a signal's handler raised): the server would answer for this
            # script later, and that answer be read as the next's; it and its child end
            # (the server not yet waited for: its group is still theirs)
            _servers.pop(next(k for k, v in _servers.items() if v is proc), None)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            _stop(proc)
            raise
        with open(out) as f, open(err) as g:
            stdout, stderr = f.read(), g.read()
    cmd = [sys.executable, "-c", script, *args]
    if done["late"]:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, done["status"], stdout, stderr)


@atexit.register
def _close() -> None:
    while _servers:
        _stop(_servers.popitem()[1])


def fork_each(jobs: list, work, outputs, kill_on_failure: bool = False) -> None:
    """``work(job)`` for each of ``jobs``, side by side, each in a child forked from this
    process (which shares what this one has imported and made), its stdout and stderr
    written to the two paths ``outputs(k, job)`` gives. Prints a JSON line [k, exit status]
    as each child ends: 0 where ``work`` returned, 1 and its traceback where it raised
    (``SystemExit``: its code). The children end by ``os._exit``, with no interpreter
    teardown. With ``kill_on_failure``, the others are killed where one fails (ranks that
    would wait for it in a collective). Fork only where this process runs no threads of
    torch's or OpenMP's: a child's first parallel operation would wait for ever."""
    pids = {}
    for k, job in enumerate(jobs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                opened = {}  # (one open file where both go to one path: one offset)
                for fd, path in zip((1, 2), outputs(k, job)):
                    if path not in opened:
                        opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(opened[path], fd)
                for out in opened.values():
                    os.close(out)
                work(job)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = k
    while pids:
        pid, status = os.waitpid(-1, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps([pids.pop(pid), code]), flush=True)
        if code != 0 and kill_on_failure:
            for other in pids:
                os.kill(other, signal.SIGKILL)
