"""Distributed training with gloo on CPU processes (``vega.runtime.sharded``): FSDP2
(``fully_shard``: DTensor parameters) against the same optimizer unsharded, in float64, five
steps with ``max_grad_norm``, for a rule of each kind of reduction (AdamW: the global norm
only; LAMB: per-tensor norms; Adafactor, factored: row and column means along an axis a
shard splits; SGD with momentum; a rule with every other reduction, max included; one with
per-tensor reductions alone, in two stages, which the C kernels' phases step); the
collectives of each step counted (one per stage of
reductions, for all tensors at once); a NaN in one rank's shard skips the step on every rank;
``torch.distributed.checkpoint`` resumes bitwise under FSDP2 and DDP, and so do full state
dicts (``full_state_dict=True``) of rules with states of one number; the example of
docs/distributed.md trains; ``ZeroRedundancyOptimizer`` with
``reduce_group`` matches DDP, for the spec classes and for LBFGS; the gradient functions
(``global_norm``, ``clip_by_global_norm``, ``grads_finite``, ``LossScale.step``) span a
``reduce_group`` and DTensor leaves; 8-bit state under FSDP2 and HSDP (each shard's step
bitwise the plain 8-bit step of the shard; DCP; loads that convert; a move to another mesh
through float state; a load where as many shards are cut otherwise refused); on four ranks,
HSDP with a loss scale against the reference backend, parameters placed four ways on one
2 x 2 mesh, a reduce_group beside a tensor-parallel mesh, and DCP checkpoints moved between
2 and 4 ranks. Each launch runs its ranks as processes, with a hard timeout, and many
checks in one process group (``distributed_script.py``)."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vega.codegen import c as c_backend
from vega.codegen import triton as triton_backend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("distributed_script.py")

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="needs a C compiler")


def launch(world: int, checks: list[str], tmp_path: Path, timeout: float = 240) -> list[dict]:
    """Run ``distributed_script.py`` on ``world`` ranks; each rank's JSON line. A rank that
    fails, or any still running after ``timeout`` seconds (a hung collective), fails the
    test at once, with what it printed. The ranks are forked from one process that has made
    their imports (``distributed_script.py all``: which kills the others where one fails),
    in a session of its own, killed whole at the timeout. The ranks meet through a file in
    ``tmp_path`` (``init_method="file://..."``), not a TCP port: tests of two xdist workers
    that chose their ports at once could be handed the same one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(tmp_path / "ranks.log", "w+") as said:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "all", str(world),
                                 str(tmp_path), *checks], stdout=said,
                                stderr=subprocess.STDOUT, env=env, cwd=str(tmp_path),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
            late = False
        except subprocess.TimeoutExpired:
            late = True
        finally:
            # (the forked ranks with it; a parent that failed may have left ranks running,
            # waiting for one it never forked: they are still its group's)
            if proc.poll() is None or proc.returncode != 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        said.seek(0)
        lines = said.read().splitlines()
    codes = dict(json.loads(x) for x in lines if x.startswith("["))
    if proc.returncode != 0 and not late and not codes:  # (before it forked a rank)
        pytest.fail(f"the ranks' parent failed ({proc.returncode}):\n" + "\n".join(lines)[-3000:])
    texts = []
    for r in range(world):
        path = tmp_path / f"rank{r}.log"
        texts.append(path.read_text() if path.exists() else "")
    bad = [r for r in range(world) if codes.get(r) != 0]
    if bad:
        why = "still running after the timeout" if late else "failed"
        pytest.fail(f"ranks {bad} {why}:\n" + "\n".join(
            f"--- rank {r} ({codes.get(r, 'killed')}):\n{texts[r][-3000:]}" for r in bad))
    return [json.loads(t.strip().splitlines()[-1]) for t in texts]


def test_launch_leaves_no_rank_running_where_the_ranks_parent_fails(tmp_path, monkeypatch):
    """A parent that fails after forking a rank (a fork refused for the next): the rank,
    which would wait in its rendezvous for the others, is killed with the parent's group,
    not left running once the test has failed."""
    script = tmp_path / "fails.py"
    script.write_text("import os, sys, time\npid = os.fork()\nif pid == 0:\n"
                      "    time.sleep(120)\n    os._exit(0)\n"
                      "open(os.path.join(sys.argv[3], 'rank0'), 'w').write(str(pid))\n"
                      "raise OSError('fork refused')\n")
    monkeypatch.setattr(sys.modules[__name__], "SCRIPT", script)
    with pytest.raises(pytest.fail.Exception, match=r"the ranks' parent failed \(1\)"):
        launch(2, [], tmp_path, timeout=60)
    pid = int((tmp_path / "rank0").read_text())
    try:
        for _ in range(100):  # (killed: ended, or a zombie until init reaps it)
            stat = Path(f"/proc/{pid}/stat")
            if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank 0 (pid {pid}) is still running")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_fsdp2_zero_and_checkpoints_on_two_ranks(tmp_path):
    found = launch(2, ["AdamW", "LAMB", "Adafactor", "SGD", "reductions", "per_tensor", "nan",
                       "dcp",
                       "dcp-ddp", "zero", "docs", "functions", "Prodigy", "zero-prodigy",
                       "muon-fsdp", "uneven", "q8", "q8-load", "dcp-q8", "full-AdamW",
                       "full-Prodigy", "full-DAdaptAdamW", "full-ScheduleFreeAdamW",
                       "full-AdamW-q8", "without-prelude", "mixed-placements",
                       "zero-save-AdamW", "zero-save-LBFGS", "meta-Adafactor", "meta-LAMB"],
                   tmp_path)
    assert found[0] == found[1]  # every rank saw the same
    for name, collectives, staged in (("AdamW", 1, []), ("LAMB", 2, ["c"]),
                                      ("Adafactor", 4, ["c"]), ("SGD", 1, []),
                                      ("reductions", 3, ["c"]),
                                      ("per_tensor", 3, ["c"]),
                                      # global_sum: each tensor's part (the C kernels'
                                      # phases), summed over the group, then over the mesh
                                      ("Prodigy", 2, ["c"])):
        assert found[0][name]["diff"] <= 1e-9, name
        assert found[0][name]["collectives"] == collectives, name
        # reductions split by a shard: in the C kernels' phases (their partial results
        # combined across ranks), those along an axis too (Adafactor's factored matrices:
        # the C kernels' stages of a program over a matrix view)
        assert found[0][name]["staged"] == staged, name
    # under torch.device("meta") the steps' reductions split by shards make their tables on
    # the host (they were meta tensors, which indexed the CPU partial results)
    for name in ("Adafactor", "LAMB"):
        assert found[0][f"meta-{name}"] == found[0][name], name
    assert found[0]["nan"] == "skipped"
    # no max_grad_norm, loss scale or skip_nonfinite: no prelude (docs/distributed.md)
    assert found[0]["without-prelude"] == {"AdamW": 0, "LAMB": 1}
    # a sharded and a replicated DTensor in one step: the norm of each kind of placement,
    # weighted by its replicas, summed
    assert found[0]["mixed-placements"] <= 1e-9
    assert found[0]["dcp-fsdp"] == found[0]["dcp-ddp"] == "bitwise"
    assert found[0]["docs"] == "learns"  # docs/distributed.md's example
    assert found[0]["zero"]["diff"] <= 1e-9
    assert found[0]["zero-prodigy"]["diff"] <= 1e-9
    assert found[0]["muon-fsdp"] == found[0]["lbfgs-fsdp"] == "refused"
    assert found[0]["uneven"] == "refused"  # (on every rank: found[0] == found[1])
    # 8-bit state: each step of each shard is the plain 8-bit step of the shard (16 of
    # them, checked bitwise); shards on block boundaries match the unsharded tensor
    assert found[0]["q8"]["steps"] == 16 and found[0]["q8"]["aligned"] <= 1e-9
    assert found[0]["q8-load"] == "converted"
    assert found[0]["dcp-fsdp-q8"] == "bitwise"
    # ZeRO's checkpoints (reduce_group through functools.partial)
    assert found[0]["zero-save"] == {"AdamW": "bitwise", "LBFGS": "bitwise"}
    # full (unsharded) state dicts, whose 0-d values torch loads as plain tensors
    assert found[0]["full-state-dict"] == dict.fromkeys(
        ("AdamW", "Prodigy", "DAdaptAdamW", "ScheduleFreeAdamW", "AdamW-q8"), "bitwise")
    # global_norm, clip_by_global_norm, lbfgs_step and LBFGS under ZeRO, over reduce_group
    # and over DTensor leaves (the script checks the skips and counts the collectives)
    assert set(found[0]["functions"]) == {"norm", "clip", "lbfgs", "lbfgs-zero",
                                          "dtensor-norm", "dtensor-clip",
                                          "dtensor-replicated-norm"}
    assert all(d <= 1e-9 for d in found[0]["functions"].values())
    # ranks of float32 and float64 leaves, and a rank without any, reduce alike (to
    # float32's precision: the script checks each rank's answer)
    assert found[0]["mixed-dtypes"] == "agree"


@pytest.mark.skipif(not triton_backend.available(), reason="needs triton")
def test_fsdp2_on_the_triton_kernels(tmp_path):
    """The Triton kernels (under the interpreter, on CPU tensors) step FSDP2's shards as the
    C kernels do: per-tensor reductions a shard splits, and sums over the group, in their
    own phases, whose raw partial results are combined across ranks, and Adafactor's
    factored matrices in their stages. A NaN in one rank's shard skips the step there too."""
    found = launch(2, ["triton-AdamW", "triton-LAMB", "triton-Adafactor", "triton-per_tensor",
                       "triton-Prodigy", "triton-nan"], tmp_path)
    assert found[0] == found[1]
    for name, collectives, staged in (("AdamW", 1, []), ("LAMB", 2, ["triton"]),
                                      ("Adafactor", 4, ["triton"]),
                                      ("per_tensor", 3, ["triton"]),
                                      ("Prodigy", 2, ["triton"])):
        got = found[0][f"triton-{name}"]
        assert got["diff"] <= 1e-9 and got["collectives"] == collectives, (name, got)
        assert got["staged"] == staged, (name, got)
    assert found[0]["triton-nan"] == "skipped"


def test_fsdp2_on_four_ranks(tmp_path):
    """Four ranks: the 5-row weight's shards hold 2, 2, 1 and 0 rows. And HSDP, a 2 x 2
    mesh (each shard held by two ranks): a replicated value's partial sums count once, and
    each collective runs over both mesh dimensions. 8-bit state on both. A matrix sharded
    along both of its axes is refused where a factored reduction's result would be split.
    8-bit state saved from a 1-D mesh's four row shards is refused where four shards are
    cut otherwise (rows and columns of a 2 x 2 mesh), whose scales have the same shape.
    HSDP with a loss scale and max_grad_norm against the reference backend; parameters
    placed in three ways and more on one 2 x 2 mesh; DTensors on a tp submesh with the dp
    group as reduce_group."""
    found = launch(4, ["Adafactor", "hsdp-AdamW", "hsdp-LAMB", "hsdp-Adafactor",
                       "hsdp-per_tensor", "q8", "q8-hsdp", "split", "q8-layout",
                       "scaled-hsdp-AdamW", "scaled-hsdp-q8", "three-placements",
                       "dtensor-reduce-group"], tmp_path)
    assert all(f == found[0] for f in found)
    # HSDP with max_grad_norm and a loss scale (a step skipped) against the reference
    # backend in one process, with 8-bit state too
    assert found[0]["scaled-hsdp-AdamW"] <= 1e-9 and found[0]["scaled-hsdp-q8"] <= 1e-9
    # parameters placed four ways on one 2 x 2 mesh: the norm counts each value once
    assert set(found[0]["three-placements"]) == {
        "norm", "clip", "AdamW", "LAMB", "SGD", "per_tensor", "Adafactor", "reductions",
        "Prodigy"}
    assert all(d <= 1e-9 for d in found[0]["three-placements"].values())
    # each dp rank its own parameters, sharded over tp: the norm over both, reduce_group
    assert all(d <= 1e-9 for d in found[0]["dtensor-reduce-group"].values())
    assert found[0]["q8-layout"] == "refused"  # (by DCP's set_state_dict and a full one)
    # a matrix sharded along both axes: factored Adafactor refuses it, naming the parameter
    assert found[0]["split"] == "refused"
    assert found[0]["Adafactor"]["diff"] <= 1e-9
    for name, staged in (("AdamW", []), ("LAMB", ["c"]), ("Adafactor", ["c"]),
                         ("per_tensor", ["c"])):
        assert found[0][f"hsdp-{name}"]["diff"] <= 1e-9, name
        assert found[0][f"hsdp-{name}"]["staged"] == staged, name
    for name in ("q8", "q8-hsdp"):  # (shards of 33 rows of 32 values: 4.125 blocks)
        assert found[0][name]["steps"] == 16 and found[0][name]["aligned"] <= 1e-9, name


def test_checkpoints_move_between_two_and_four_ranks(tmp_path):
    """DCP checkpoints moved between 2 and 4 ranks. Float state saved on 4 reshards on 2,
    and two more steps equal those of the optimizer unsharded (factored Adafactor, whose
    per-column factor is replicated; Prodigy's states of one number). 8-bit state saved on 2
    (FSDP2) loads on HSDP's 2 x 2, whose shards are cut alike. Saved on 2 ranks, loaded on
    4, an 8-bit checkpoint is refused (its scales have a row per shard), the one of float
    state loads and quantizes (docs/distributed.md)."""
    for world in ("two", "four", "back"):
        (tmp_path / world).mkdir()
    found = launch(2, ["q8-move-save", "reshard-save-AdamWq8"], tmp_path / "two")
    assert found[0]["q8-move"] == "saved"
    found = launch(4, ["q8-move-load", "reshard-load-AdamWq8-hsdp", "reshard-save-Adafactor",
                       "reshard-save-Prodigy"], tmp_path / "four")
    assert all(f == found[0] for f in found)
    assert found[0]["q8-move"] == "moved" and found[0]["reshard-AdamWq8"] <= 1e-9
    found = launch(2, ["reshard-load-Adafactor", "reshard-load-Prodigy"], tmp_path / "back")
    assert all(found[0][f"reshard-{name}"] <= 1e-9 for name in ("Adafactor", "Prodigy"))


def test_reduce_group_is_checked():
    """``reduce_group`` is None or a process group of an initialized torch.distributed; any
    other value is refused by name, by the classes and the functional steps alike."""
    import torch

    import vega
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"AdamW: reduce_group=3 "):
        vega.optim.AdamW([p], reduce_group=3)
    with pytest.raises(ValueError, match=r"lamb_step: reduce_group='world' "):
        vega.lamb_step({"w": p.detach()}, {"w": p.detach()}, vega.lamb_init({"w": p.detach()}),
                       reduce_group="world")
    for call in (lambda: vega.global_norm([p], reduce_group=1),
                 lambda: vega.clip_by_global_norm([p], 1.0, reduce_group=1),
                 lambda: vega.grads_finite([p], reduce_group=1),
                 lambda: vega.LossScale.static(1.0).step([p], lambda g: 0, 0, reduce_group=1),
                 lambda: vega.lbfgs_step([p], [p], vega.lbfgs_init([p]), reduce_group=1),
                 lambda: vega.optim.LBFGS([p], reduce_group=1)):
        with pytest.raises(ValueError, match=r"reduce_group=1 "):
            call()

