"""``vega bench``'s machinery on tiny parameter sets (its timings are not asserted)."""
import math

import numpy as np
import pytest
import torch

from vega import bench


def test_race_steps_every_row_in_turn():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench.race(fns, budget=0.0, min_rounds=3)
    assert calls[:3] == ["a", "b", "c"]  # one warm-up call each
    assert calls[3:] == ["a", "b", "c"] * 3  # then rounds, every row once a round
    assert set(times) == set("abc") and all(t >= 0 for t in times.values())


def test_rows_of_a_tiny_run():
    shapes = [(3, 4), (5,)]
    _, grads = bench._tensors(shapes)
    rows = bench.adamw_rows(shapes, grads, compile_torch=False)
    for label in ("vega AdamW", "vega AdamW + unscale, finite check, clip, skip", bench.FUNCTIONAL,
                  "torch AdamW fused", "torch AdamW foreach", "torch AdamW for-loop",
                  "torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW",
                  bench.OPTAX_DONATED, bench.OPTAX_PURE, bench.BF16_STATE):
        assert rows[label] > 0, label
    others = bench.other_rows(shapes, grads, ["sgd", "adafactor"])
    assert [r[0] for r in others] == ["sgd", "adafactor"]
    for _, ours, label, theirs, bound in others:
        assert ours > 0 and label.startswith("torch.optim.") and theirs > 0
        assert math.isnan(bound)  # (no bound raced with them)
    assert not any(math.isnan(v) for v in rows.values())


def test_bandwidth_bound_is_measured():
    rate, loop = bench.bandwidth(elements=1 << 16, repeats=2)
    if bench.cbuild.available():
        assert rate > 1e8 and loop in ("plain", "quarters")
    else:
        assert math.isnan(rate) and loop == "no C compiler"


def test_bytes_a_step_moves_per_parameter():
    """Read p, g and each state, write p and each state the rule changes (4 bytes each); a
    second read of what a per-tensor reduction reads, before the update; the fused step's
    second read of g."""
    assert bench.bytes_per_param("adamw") == 28
    assert bench.bytes_per_param("adamw", fused=True) == 32
    assert bench.bytes_per_param("sgd", {"momentum": 0.9}) == 20
    assert bench.bytes_per_param("sgd", {"momentum": 0.0}) == 12
    assert bench.bytes_per_param("adan") == 44
    assert bench.bytes_per_param("lion") == 20
    assert bench.bytes_per_param("lamb") == 44  # norms of p and of the update first
    # lars's norms read p and g (not its momentum): 20 + 8
    assert bench.bytes_per_param("lars", {"momentum": 0.9}) == 28
    # novograd's norm reads g alone: 12 + 8 + 4
    assert bench.bytes_per_param("novograd") == 24
    # prodigy reads p, g, mu, nu, s and p0, writes p, mu, nu and s (p0 never changes), and
    # its sums read g, p, p0 and s: 24 + 16 + 16
    assert bench.bytes_per_param("prodigy") == 56
    # bfloat16 state: p and g 4 bytes, each state 2, read and written
    assert bench.bytes_per_param("adamw", state_itemsize=2) == 20


def test_state_bytes_per_parameter():
    """AdamW's state: 8 bytes a parameter in float32, 4 in bfloat16, 8 + 4 with a master
    copy of bfloat16 parameters, 2.04 in 8 bits (a 768 x 768 matrix at 2 + 8/256, its bias
    at 8: docs/precision.md)."""
    found = dict(bench.state_bytes())
    q8 = found.pop("float32 parameters, 8-bit state (a matrix and a bias)")
    assert q8 == (768 * 768 * (2 + 8 / 256) + 768 * 8) / (768 * 769) and q8 <= 2.1
    assert found == {"float32 parameters and state": 8,
                     "float32 parameters, bfloat16 state": 4,
                     "float32 parameters, bfloat16 nu": 6,
                     "bfloat16 parameters, float32 state": 8,
                     "bfloat16 parameters, master weights": 12,
                     "bfloat16 parameters, master weights, bfloat16 state": 8}
    lines = []
    bench.report_state_bytes(lambda text="": lines.append(text))
    assert lines[0] == "AdamW state, bytes per parameter:"
    assert any(line.split()[-1] == "12" and "master weights" in line for line in lines)


def _fake_run():
    rows = {label: 0.01 for label in (
        "vega AdamW", "vega AdamW + unscale, finite check, clip, skip", "torch AdamW fused",
        "torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW", bench.FUNCTIONAL,
        bench.FUNCTIONAL_FUSED)}
    rows["vega AdamW"] = 0.007
    return {"tiny": {"nparams": 10**6, "rows": rows,
                     "others": [("sgd", 0.005, "torch.optim.SGD foreach", 0.01,
                                 float("nan"))]}}


def test_every_row_prints_its_bytes_and_bound():
    lines = []
    bench.report(_fake_run(), 4e9, lambda text="": lines.append(text))
    text = "\n".join(lines)
    # 28 B a parameter of 1M at 4 GB/s: 7 ms, so vega's 7 ms plain step is 1.00x the bound
    assert any(line.startswith("vega AdamW ") and "28 B/param" in line and "1.00x bound" in line
               for line in lines), text
    assert any("32 B/param" in line and "1.25x bound" in line for line in lines), text
    assert any(line.startswith("sgd ") and "20 B/param" in line and "1.00x bound" in line
               for line in lines), text
    found = bench.ratios(_fake_run(), 4e9)
    assert abs(found[("tiny", "vega AdamW / bound")] - 1.0) < 1e-12
    assert abs(found[("tiny", "sgd: speed-up")] - 2.0) < 1e-12


def test_a_library_that_is_not_installed_prints_a_dash():
    """A counterpart that is not installed has no time: its row prints a dash, not nan, and
    the ratios of a repeated run leave it out."""
    run = _fake_run()
    run["tiny"]["rows"]["optax adamw under jax.jit (not installed)"] = float("nan")
    run["tiny"]["others"].append(("lamb", 0.005, "pytorch_optimizer (not installed)",
                                  float("nan"), float("nan")))
    lines = []
    bench.report(run, 4e9, lambda text="": lines.append(text))
    text = "\n".join(lines)
    assert "nan" not in text, text
    assert any(line.startswith("lamb ") and "pytorch_optimizer (not installed)" in line
               and line.split()[5:7] == ["-", "-"] for line in lines), text
    assert any(line.startswith("optax adamw under jax.jit (not installed)")
               and line.split()[-2:] == ["-", "-"] for line in lines), text
    found = bench.ratios(run, 4e9)
    assert ("tiny", "lamb: speed-up") not in found
    assert not any(math.isnan(v) for v in found.values()), found


def test_the_header_names_the_cpu_caches_and_threads():
    text = bench._machine()
    assert "threads" in text and "torch" in text
    assert "L2" in text or "caches unknown" in text


def test_repeat_must_be_positive():
    import pytest
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="repeat="):
            bench.main(repeat=bad, out=open("/dev/null", "w"))


def test_the_cost_around_the_kernels_is_reported_a_tensor():
    costs = bench.host_costs()
    assert list(costs) == ["vega AdamW", "vega AdamW + unscale, finite check, clip, skip",
                           "torch AdamW fused"]
    assert all(secs > 0 for secs in costs.values())
    lines = []
    bench.report_host({"vega AdamW": 0.5e-6}, lambda text="": lines.append(text))
    assert lines[0].startswith("== the cost of a step around its kernels (1,000 one-element")
    assert lines[1].split()[-4:] == ["0.50", "us", "a", "tensor"]


def test_the_bound_is_raced_with_the_rows():
    """A bandwidth loop raced with a table's rows bounds them by its median there: here it
    moves 8 MB in 2 ms (4 GB/s), where the rate measured at the start says 8 GB/s."""
    run = _fake_run()
    run["tiny"]["rows"][bench.BOUND] = 0.002
    run["tiny"]["bound_bytes"] = 8 * 10**6
    run["tiny"]["others"] = [("sgd", 0.005, "torch.optim.SGD foreach", 0.01, 0.004)]
    lines = []
    bench.report(run, 8e9, lambda text="": lines.append(text))
    text = "\n".join(lines)
    assert "bandwidth bound raced with the AdamW rows: 4.0 GB/s" in text
    assert not any(line.startswith(bench.BOUND) for line in lines), text  # not a step's row
    assert any(line.startswith("vega AdamW ") and "1.00x bound" in line for line in lines), text
    # sgd's own race: 8 MB in 4 ms, 2 GB/s: its 5 ms for 20 MB is 0.50x that bound
    assert any(line.startswith("sgd ") and "0.50x bound" in line for line in lines), text
    found = bench.ratios(run, 8e9)
    assert abs(found[("tiny", "vega AdamW / bound")] - 1.0) < 1e-12
    assert abs(found[("tiny", "sgd / bound")] - 0.5) < 1e-12
    # a read-only pass raced too: 4 MB in 2 ms (2 GB/s); the fused step's 10 ms against
    # 28 B a parameter at 4 GB/s (7 ms) and its gradient pass, 4 B, at 2 GB/s (2 ms)
    run["tiny"]["rows"][bench.READ_BOUND] = 0.002
    run["tiny"]["read_bytes"] = 4 * 10**6
    lines.clear()
    bench.report(run, 8e9, lambda text="": lines.append(text))
    text = "\n".join(lines)
    assert "a read-only pass raced with them: 2.0 GB/s" in text
    assert any(line.startswith("vega AdamW + unscale") and "1.11x with its gradient pass at "
               "the read rate" in line for line in lines), text
    key = ("tiny", "vega AdamW + unscale, finite check, clip, skip / bound, gradient pass at "
           "the read rate")
    assert abs(bench.ratios(run, 8e9)[key] - 10 / 9) < 1e-12


def test_a_stream_row_moves_its_bytes():
    stream = bench.Stream("plain", elements=1 << 12)
    assert stream.nbytes == bench.STREAM_BYTES << 12
    stream()
    stream.read()
    assert stream.read_bytes == 16 << 12  # four float32 arrays, read once
    if bench.cbuild.available():
        assert stream.fn is not None and stream.arrays[2].abs().sum() > 0  # m was written
        shapes = [(3, 4), (5,)]
        _, grads = bench._tensors(shapes)
        (row,) = bench.other_rows(shapes, grads, ["sgd"], stream)
        assert row[4] > 0  # raced with sgd and its counterpart


def test_the_read_only_pass_reads_every_element():
    """The read-only loop (each thread's share as four quarters, and what is left over)
    sums the squares of every element, whatever the length."""
    if not bench.cbuild.available():
        pytest.skip("no C compiler")
    stream = bench.Stream("plain", elements=1 << 12)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 7, 4097, 1000003):
        a = torch.rand(n, generator=gen)
        want = float((a.double() ** 2).sum())
        assert abs(stream.read_fn(a.data_ptr(), n) - want) <= 1e-5 * want


def test_muon_row_races_the_matrices_with_torch():
    shapes = [(3, 4), (5,), (6, 2)]
    _, grads = bench._tensors(shapes)
    checks = {}
    ours, theirs, count, nparams = bench.muon_rows(shapes, grads, checks)
    assert ours > 0 and theirs > 0 and count == 2 and nparams == 24
    assert checks["muon"] <= bench.apart_tol("muon")  # Newton-Schulz in bfloat16 both


def test_the_8bit_table_prints_each_row_against_vegas_8bit_step():
    """The 8-bit table (GPT-2-like set, not --quick): each row's time and its ratio to vega's
    8-bit step, a missing library's row a dash, the first steps in seconds; the 8-bit row of
    the AdamW table its 16 bytes a parameter."""
    run = _fake_run()
    run["tiny"]["rows"][bench.Q8_STATE] = 0.014
    run["tiny"]["eight_bit"] = {"vega AdamW, float32 state": 0.01, bench.Q8_STATE: 0.02,
                                "torchao AdamW8bit": 0.3,
                                "bitsandbytes AdamW8bit (not installed)": float("nan"),
                                "(torchao AdamW8bit: first step, compiling included)": 40.0}
    lines = []
    bench.report(run, 4e9, lambda text="": lines.append(text))
    text = "\n".join(lines)
    assert any(line.startswith(bench.Q8_STATE) and "16 B/param" in line and "3.50x bound" in line
               for line in lines), text
    assert any(line.startswith("torchao AdamW8bit ") and line.endswith("15.00x")
               for line in lines), text
    assert any(line.startswith("bitsandbytes AdamW8bit (not installed)") and
               line.split()[-1] == "-" for line in lines), text
    assert any(line.startswith("(torchao AdamW8bit: first step") and line.endswith("40.0 s")
               for line in lines), text
    found = bench.ratios(run, 4e9)
    assert found[("tiny", "8-bit: torchao AdamW8bit / vega 8-bit")] == 15.0
    assert ("tiny", "8-bit: bitsandbytes AdamW8bit (not installed) / vega 8-bit") not in found


def _bench_cpu_py(*args):
    """``python bench/cpu.py ARGS``, with this checkout's vega; 60 seconds at most (a run
    that ignored its options would start the whole benchmark)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(root / "bench" / "cpu.py"), *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_bench_cpu_py_takes_the_options_of_vega_bench():
    out = _bench_cpu_py("--help")
    assert out.returncode == 0, out.stderr
    assert "usage: python bench/cpu.py" in out.stdout
    for option in ("--quick", "--no-compile", "--repeat N"):
        assert option in out.stdout
    out = _bench_cpu_py("--repeat", "0")  # read, and refused as vega bench refuses it
    assert out.returncode == 2 and "argument --repeat: '0' is not a positive integer" in out.stderr


def test_the_timings_in_processes_of_their_own_import_this_checkouts_vega(monkeypatch):
    """The functional rows and the compile times are timed in new Python processes, which
    import vega: where this checkout is on the path of this process only (a script beside
    it, a sys.path entry added by hand), they found no vega, or timed another one."""
    import os
    import subprocess
    import types
    seen = []

    def run(args, **kwargs):
        seen.append(kwargs.get("env"))
        return types.SimpleNamespace(returncode=0, stdout="[0.5]" if "-c" in args and
                                     "json.loads(sys.argv[1])" in args[2] else "0.5\n")
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    assert bench._in_own_process("functional_seconds", [(1,)], 1) == [0.5]
    assert bench.compile_times() == (0.5, 0.5)
    tree = os.path.dirname(os.path.dirname(os.path.abspath(bench.__file__)))
    assert os.path.isfile(os.path.join(tree, "pyproject.toml"))  # (the tests' checkout)
    assert len(seen) == 3
    assert all(env["PYTHONPATH"].split(os.pathsep) == [tree, "elsewhere"] for env in seen)


def test_each_counterpart_steps_by_torchs_fastest_cpu_path():
    """torch.optim's SGD, Adam and Adagrad have a fused CPU step, faster than their foreach
    one: a speed-up over foreach, where fused runs, overstates vega's. The others have
    foreach at best."""
    shapes = [(3, 4), (5,)]
    _, grads = bench._tensors(shapes)
    labels = {r[0]: r[2] for r in bench.other_rows(shapes, grads, ["sgd", "adam", "adagrad",
                                                                   "rmsprop", "nadam"])}
    assert labels == {"sgd": "torch.optim.SGD fused", "adam": "torch.optim.Adam fused",
                      "adagrad": "torch.optim.Adagrad fused",
                      "rmsprop": "torch.optim.RMSprop foreach",
                      "nadam": "torch.optim.NAdam foreach"}


def test_a_read_only_pass_leaves_the_next_tables_bound_alone():
    """A table without a raced bound has its rows bounded by the rate measured at the start
    of the run, even after a table whose read-only pass was printed (that pass's rate, in
    GB/s, was taken for the run's rate: the next table's bounds 1e9 times too large)."""
    first = _fake_run()["tiny"]
    first["rows"][bench.BOUND] = first["rows"][bench.READ_BOUND] = 0.002
    first["bound_bytes"] = first["read_bytes"] = 8 * 10**6
    run = {"first": first, "second": _fake_run()["tiny"]}
    lines = []
    bench.report(run, 4e9, lambda text="": lines.append(text))
    second = lines[next(k for k, line in enumerate(lines) if line.startswith("== second")):]
    # 28 B a parameter of 1M at 4 GB/s: 7 ms, vega's 7 ms step 1.00x; sgd's 5 ms for 20 MB
    assert any(line.startswith("vega AdamW ") and "1.00x bound" in line for line in second), \
        "\n".join(second)
    assert any(line.startswith("sgd ") and "1.00x bound" in line for line in second), \
        "\n".join(second)


@pytest.mark.parametrize("donate", [True, False])
def test_optax_steps_adamw_as_torch_does_and_donates_where_asked(donate):
    """optax's row steps torch's AdamW (its weight decay 0.01, not optax's default 1e-4),
    and its donated row gives XLA the old parameters and state to write over (optax's
    fastest path; the pure row makes new ones, as vega's pure functional step)."""
    pytest.importorskip("optax")
    shapes = [(3, 4), (5,)]
    _, grads = bench._tensors(shapes)
    ref = torch.optim.AdamW(bench._leaves(shapes, grads), lr=1e-3)
    step, box = bench.optax_stepper(shapes, donate=donate)
    first = box[0][0]
    for _ in range(3):
        step()
        ref.step()
    assert first.is_deleted() == donate
    for ours, theirs in zip(box[0], ref.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(torch.from_numpy(np.asarray(ours).copy()), theirs.detach(),
                                   rtol=0, atol=1e-6)


def test_the_rows_results_are_compared_so_a_wrong_step_cannot_win(monkeypatch):
    """After a race every row has stepped as often: vega's parameters and the counterpart's
    must agree, and a row that computes something else (here vega's sgd at ten times the
    counterpart's rate) is called out, where its time would have been read as a speed-up."""
    shapes = [(3, 4), (5,)]
    _, grads = bench._tensors(shapes)
    checks = {}
    bench.adamw_rows(shapes, grads, compile_torch=False, checks=checks)
    bench.other_rows(shapes, grads, ["sgd", "adam", "adafactor"], checks=checks)
    assert set(checks) == {"vega AdamW", "torch AdamW foreach", "torch AdamW for-loop",
                           "vega AdamW + unscale, finite check, clip, skip", "sgd", "adam"}
    assert all(value <= bench.APART_TOL for value in checks.values()), checks
    wrong = dict(bench.OTHERS)
    wrong["sgd"] = ({"lr": 1e-1, "momentum": 0.9}, *bench.OTHERS["sgd"][1:])
    monkeypatch.setattr(bench, "OTHERS", wrong)
    bench.other_rows(shapes, grads, ["sgd"], checks=checks)
    assert checks["sgd"] > 10 * bench.APART_TOL
    lines = []
    bench.report_apart(checks, lambda text="": lines.append(text))
    assert [line.split(":")[0] for line in lines if line.startswith("!!")] == ["!! sgd"]


def test_apart_is_over_the_change_and_nan_where_a_parameter_is():
    start = [torch.tensor([1.0, 1.0])]
    a = [torch.tensor([1.0, float("nan")])]
    assert math.isnan(bench.apart(a, [torch.tensor([1.0, 2.0])], start))
    assert bench.apart([torch.tensor([1.0, 2.25])], [torch.tensor([1.0, 2.0])], start) == 0.25


def test_bench_fused_py_races_each_rule_against_torchs_fused_and_foreach_steps(monkeypatch,
                                                                               capsys):
    """``bench/fused.py`` (docs/performance.md's race of sgd, adam and adagrad against
    torch's fused steps), on small sets: a row for each set and rule, vega's parameters
    within rounding of torch's fused step's after the race."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "fused.py"
    spec = importlib.util.spec_from_file_location("bench_fused", path)
    fused = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused)
    monkeypatch.setattr(fused.B, "gpt2_like", lambda: [(64, 32), (32,)])
    monkeypatch.setattr(fused.B, "many_small", lambda n: [(7,), (5, 3)] * 3)
    fused.main(["--budget", "0.05"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [(s, n) for s in ("GPT-2-like", "many-small")
                                            for n in fused.RULES]
    assert all(float(r[-1]) < 1e-3 for r in rows), rows
    with pytest.raises(SystemExit):
        fused.main(["--budget", "0"])
