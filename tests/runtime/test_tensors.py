"""The tensors a step accepts (``vega.codegen.tensors``): tensor subclasses with operations of
their own (DTensor, TwoTensor) step on the reference backend, or are refused by name on a
compiled one, never read at address 0; tensors with a negative or conjugate bit step as
their values; a step in place checks every tensor it writes before writing any (an
expanded tensor, two that share memory, an inference tensor) and advances each
parameter's version counter, as an in-place torch operation does. A check where a crash
is possible runs in a child process."""
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import vega
from vega import codegen
from vega.codegen import c as c_backend

from tests import forks

pytestmark = pytest.mark.skipif(not c_backend.available(), reason="needs a C compiler")

ROOT = Path(__file__).resolve().parents[2]
# the backends that read memory at addresses (Triton's interpreter where there is no GPU),
# and the reference, which steps through torch's operations
BACKENDS = ["c", "reference", *(["triton"] if "triton" in codegen.BACKENDS else [])]


def _child(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (this checkout's vega, the scanner waited for), with
    ``args`` as its ``sys.argv[1:]``. (A child of a server that has imported torch and vega,
    as every such script does first: tests/forks.py.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "VEGA_NATIVE": "sync"}
    done = forks.run(textwrap.dedent(code), *args, cwd=ROOT, env=env, timeout=timeout)
    assert done.returncode == 0, f"rc={done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


# a child's start as the one rank of a gloo process group (a DTensor on a mesh of one)
ONE_RANK = """\
import os, socket, torch, torch.distributed as dist, vega
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
"""


def _one_rank(code: str, *args: str) -> subprocess.CompletedProcess:
    """``_child`` of ``code`` run as the one rank of a gloo process group (``ONE_RANK``)."""
    return _child(ONE_RANK + textwrap.dedent(code), *args)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- tensor subclasses with operations of their own --------------------------------------

def test_wrapper_subclass_matrices_of_one_shape_step_each_as_its_own():
    """Matrices of one shape take their products together (``reference._products``), whose
    stacked operands are found again by address; a TwoTensor's address is 0, so each
    steps alone, its first tensor as the plain one would (all three took the first's
    values when they were batched)."""
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(6, 9, generator=gen) for _ in range(3)]
    ga = [torch.randn(6, 9, generator=gen) for _ in range(3)]
    twos = [torch.nn.Parameter(TwoTensor(x.clone(), 2 * x)) for x in a]
    plain = [torch.nn.Parameter(x.clone()) for x in a]
    for two, p, g in zip(twos, plain, ga):
        two.grad, p.grad = TwoTensor(g.clone(), 2 * g), g.clone()
    vega.optim.Muon(twos).step()
    vega.optim.Muon(plain).step()
    for two, p in zip(twos, plain):
        assert type(two) is TwoTensor  # (a Parameter of a subclass keeps its type)
        assert torch.equal(two.a, p.data)


def test_wrapper_subclasses_step_on_the_reference_backend_or_are_refused_by_name():
    """TwoTensor's data_ptr() is 0: a C kernel given it read address 0 (a segfault). Unless a
    backend is named it steps on the reference backend, each of its two tensors as a plain
    tensor would; backend='c' refuses it, naming the leaf and the type."""
    out = _child("""
        import torch, vega
        from torch.testing._internal.two_tensor import TwoTensor
        gen = torch.Generator().manual_seed(0)
        a, b, ga, gb = (torch.randn(5, generator=gen) for _ in range(4))

        def plain(x, g):
            return vega.adamw.step({"w": x}, {"w": g}, vega.adamw.init({"w": x}),
                                   backend="reference")[0]["w"]
        for donate in (False, True):
            w, g = TwoTensor(a.clone(), b.clone()), TwoTensor(ga, gb)
            state = vega.adamw.init({"w": w})
            new, st = vega.adamw.step({"w": w}, {"w": g}, state, donate=donate)
            assert type(new["w"]) is TwoTensor and int(st["step"]) == 1
            assert torch.equal(new["w"].a, plain(a, ga)) and torch.equal(new["w"].b, plain(b, gb))
            assert (new["w"] is w) == donate
        # named backends that read memory refuse it, whichever leaf it is
        cases = [({"w": TwoTensor(a, b)}, {"w": TwoTensor(ga, gb)}, "params leaf 'w'"),
                 ({"w": a.clone()}, {"w": TwoTensor(ga, gb)}, "grads leaf 'w'")]
        for params, grads, label in cases:
            state = vega.adamw.init({"w": a})
            for donate in (False, True):
                try:
                    vega.adamw.step(params, grads, state, backend="c", donate=donate)
                except ValueError as e:
                    assert f"adamw_step: {label} is a TwoTensor, a tensor subclass" in str(e), e
                    assert "backend='reference'" in str(e)
                else:
                    raise AssertionError("not refused")
        state = vega.adamw.init({"w": a})
        state["mu"]["w"] = TwoTensor(torch.zeros(5), torch.zeros(5))
        try:
            vega.adamw.step({"w": a.clone()}, {"w": ga}, state, backend="c")
        except ValueError as e:
            assert "state leaf 'mu.w' is a TwoTensor" in str(e), e
        else:
            raise AssertionError("not refused")
        # the kernel itself refuses what has no address, called directly
        from vega.runtime import engine
        program = vega.adamw.program()
        state = vega.adamw.init({"w": a})
        try:
            engine.run(program, "c", [TwoTensor(a, b)], [ga], [[state["mu"]["w"]],
                       [state["nu"]["w"]]], [state["step"]], [vega.adamw.defaults], True)
        except ValueError as e:
            assert "backend 'c': parameter 0 is a TwoTensor" in str(e), e
        else:
            raise AssertionError("not refused")
        # a fused step sums the gradients as plain tensors: refused, not guessed, naming the
        # gradient (a functional step's leaf, a class's parameter)
        try:
            vega.adamw.step({"w": TwoTensor(a, b)}, {"w": TwoTensor(ga, gb)},
                            vega.adamw.init({"w": TwoTensor(a, b)}), max_grad_norm=1.0)
        except ValueError as e:
            assert "adamw_step: grads leaf 'w' is a TwoTensor" in str(e), e
            assert "clip_grad_norm_" in str(e), e
        else:
            raise AssertionError("not refused")
        plain = torch.nn.Parameter(a.clone())
        two = torch.nn.Parameter(TwoTensor(a.clone(), b.clone()))
        plain.grad, two.grad = ga.clone(), TwoTensor(ga.clone(), gb.clone())
        opt = vega.optim.AdamW([{"params": [plain]}, {"params": [two]}], max_grad_norm=1.0)
        try:
            opt.step()
        except ValueError as e:
            assert "AdamW: the gradient of parameter 0 of group 1 is a TwoTensor" in str(e), e
        else:
            raise AssertionError("not refused")
        assert not opt.state
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


def test_the_class_routes_wrapper_subclasses_even_after_plain_steps():
    out = _child("""
        import torch, vega
        from torch.testing._internal.two_tensor import TwoTensor
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
        grads = [(torch.randn(6, generator=gen), torch.randn(6, generator=gen))
                 for _ in range(3)]
        w = torch.nn.Parameter(TwoTensor(a.clone(), b.clone()))
        x, y = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
        opt = vega.adamw.optimizer([w])
        ox, oy = vega.adamw.optimizer([x], backend="reference"), \\
            vega.adamw.optimizer([y], backend="reference")
        for ga, gb in grads:
            w.grad, x.grad, y.grad = TwoTensor(ga, gb), ga, gb
            opt.step(); ox.step(); oy.step()
        assert type(w) is TwoTensor and torch.equal(w.a, x) and torch.equal(w.b, y)
        try:
            vega.adamw.optimizer([w], backend="c").step()
        except ValueError as e:
            assert "AdamW: parameter 0 of group 0 is a TwoTensor" in str(e), e
        else:
            raise AssertionError("not refused")

        # plain steps whose gradient then becomes a TwoTensor: stepped on the reference
        # backend
        p, q = torch.nn.Parameter(a.clone()), torch.nn.Parameter(a.clone())
        opt, twin = vega.adamw.optimizer([p]), vega.adamw.optimizer([q])
        for ga, _ in grads:
            p.grad, q.grad = ga.clone(), ga.clone()
            opt.step(); twin.step()
        g = grads[0][1]
        p.grad, q.grad = TwoTensor(g.clone(), g.clone()), g.clone()
        opt.step(); twin.step()
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
        # and its state becoming one, with backend='c' named: refused by name
        opt = vega.adamw.optimizer([p], backend="c")
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
        before = p.detach().clone()
        opt.state[p]["nu"] = TwoTensor(torch.ones(6), torch.ones(6))
        try:
            opt.step()
        except ValueError as e:
            assert "parameter 0 of group 0 (its state 'nu') is a TwoTensor" in str(e), e
        else:
            raise AssertionError("not refused")
        assert torch.equal(p, before) and int(opt.state[p]["step"]) == 3
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


def test_dtensor_steps_its_local_shard():
    """DTensor (one process, one rank): stepped on its local shard by every backend, with
    clipping, as the plain tensor it holds; a gradient whose local values are partial sums,
    and a complex parameter, are refused by name; never its address 0 given to a kernel.
    (Several ranks: ``test_distributed.py``.)"""
    out = _one_rank("""
        from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        gen = torch.Generator().manual_seed(0)
        a, g = torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)
        for backend in ("c", "reference"):
            want = vega.adamw.step({"w": a}, {"w": g}, vega.adamw.init({"w": a}),
                                   backend=backend, max_grad_norm=1.0)[0]["w"]
            w = distribute_tensor(a, mesh, [Shard(0)])
            dg = distribute_tensor(g, mesh, [Shard(0)])
            state = vega.adamw.init({"w": w})
            assert isinstance(state["mu"]["w"], DTensor)
            new, _ = vega.adamw.step({"w": w}, {"w": dg}, state, backend=backend,
                                     max_grad_norm=1.0)
            assert isinstance(new["w"], DTensor)
            assert torch.equal(new["w"].full_tensor(), want), backend
            p = torch.nn.Parameter(distribute_tensor(a, mesh, [Shard(0)]))
            p.grad = dg
            vega.adamw.optimizer([p], backend=backend, max_grad_norm=1.0).step()
            assert torch.equal(p.full_tensor(), want), backend
        p.grad = DTensor.from_local(g, mesh, [Partial()])
        try:
            vega.adamw.optimizer([p]).step()
        except ValueError as e:
            assert "Partial" in str(e) and "gradient" in str(e), e
        else:
            raise AssertionError("not refused")
        # a complex DTensor: refused by name, by the class and the functional init alike
        c = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4, dtype=torch.complex64),
                                                 mesh, [Shard(0)]))
        c.grad = distribute_tensor(torch.randn(4, 4, dtype=torch.complex64), mesh, [Shard(0)])
        for make, name in ((lambda: vega.optim.AdamW([p, c]).step(),
                            "AdamW: parameter 1 of group 0 is a complex DTensor"),
                           (lambda: vega.adamw.init({"w": c}), "leaf 'w' is a complex DTensor")):
            try:
                make()
            except ValueError as e:
                assert name in str(e), e
            else:
                raise AssertionError("not refused")
        dist.destroy_process_group()
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


# -- negative and conjugate bits ----------------------------------------------------------

def test_a_state_of_dtensors_is_refused_by_vega_save_and_load_by_name(tmp_path):
    """A state file holds one process's whole tensors; a DTensor's storage is its rank's
    shard. vega.save of a sharded state failed with torch's "Attempted to access the data
    pointer on an invalid python storage", and vega.load with like= a sharded state gave
    plain tensors back; both name the leaf and send to torch.distributed.checkpoint, and
    no file is written."""
    out = _one_rank("""
        import sys
        from pathlib import Path
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1,))
        a = torch.randn(8, 4)
        sharded = vega.adamw.init({"w": distribute_tensor(a, mesh, [Shard(0)])})
        path = Path(sys.argv[1]) / "s"
        for call in (lambda: vega.save(path, sharded),
                     lambda: vega.load(path, like=sharded)):
            try:
                call()
            except ValueError as err:
                print(err)
            else:
                raise AssertionError("not refused")
            if not path.exists():  # (save refused: nothing written, no temporary file)
                assert not list(path.parent.iterdir())
                vega.save(path, vega.adamw.init({"w": a}))  # (a whole state, for load)
        dist.destroy_process_group()
    """, str(tmp_path))
    said = out.stdout.splitlines()
    assert said == [f"vega.{f}: {w} leaf 'mu.w' is a DTensor, sharded over ranks; a state "
                    "file holds one process's whole tensors: save and load a sharded state "
                    "with torch.distributed.checkpoint (dcp.save and dcp.load, "
                    "docs/distributed.md)" for f, w in (("save", "state"), ("load", "like="))]


def _neg(x: torch.Tensor) -> torch.Tensor:
    """A tensor whose values are ``x``'s, stored negated (its negative bit set)."""
    out = torch._neg_view(-x)
    assert out.is_neg() and torch.equal(out, x)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("which", ["params", "grads", "state"])
def test_a_negative_bit_is_read_and_written_as_the_values(backend, donate, which):
    p, g = _rand(7, seed=1), _rand(7, seed=2)
    state = vega.adamw.init({"w": p})
    state["mu"]["w"] = _rand(7, seed=3) * 0.1
    plain = {"w": p.clone()}, {"w": g.clone()}, {
        "mu": {"w": state["mu"]["w"].clone()}, "nu": {"w": state["nu"]["w"].clone()},
        "step": state["step"].clone()}
    params, grads = {"w": p.clone()}, {"w": g.clone()}
    if which == "params":
        params = {"w": _neg(p)}
    elif which == "grads":
        grads = {"w": _neg(g)}
    else:
        state["mu"]["w"] = _neg(state["mu"]["w"])
    want_p, want_s = vega.adamw.step(*plain, backend=backend, donate=donate)
    got_p, got_s = vega.adamw.step(params, grads, state, backend=backend, donate=donate)
    assert torch.equal(got_p["w"], want_p["w"])
    assert torch.equal(got_s["mu"]["w"], want_s["mu"]["w"])
    if donate and which == "params":  # written in place into the negated view
        assert got_p["w"] is params["w"] and params["w"].is_neg()


def test_the_imaginary_part_of_a_conjugate_steps_as_its_values():
    """``z.conj().imag`` holds -3 (its negative bit set), which the C kernel read as +3."""
    z = torch.tensor([2 + 3j])
    w = z.conj().imag
    assert w.is_neg() and w.is_contiguous()
    g = torch.tensor([0.5])
    for donate in (False, True):
        want, _ = vega.sgd.step({"w": torch.tensor([-3.0])}, {"w": g},
                                vega.sgd.init({"w": w}), lr=0.1, donate=donate)
        got, _ = vega.sgd.step({"w": w}, {"w": g}, vega.sgd.init({"w": w}), lr=0.1,
                               donate=donate)
        assert torch.equal(got["w"], want["w"]) and torch.equal(want["w"], torch.tensor([-3.05]))
    assert torch.equal(z, torch.tensor([2 + 3.05j]))  # (stored negated, through the view)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("donate", [False, True])
def test_conjugate_complex_tensors_step_as_their_values(backend, donate):
    z = torch.complex(_rand(5, seed=4), _rand(5, seed=5))
    g = torch.complex(_rand(5, seed=6), _rand(5, seed=7))
    plain = vega.adamw.step({"w": z.conj().resolve_conj()}, {"w": g.conj().resolve_conj()},
                            vega.adamw.init({"w": z}), backend=backend)
    params = {"w": z.clone().conj()}
    got = vega.adamw.step(params, {"w": g.conj()}, vega.adamw.init({"w": z.conj()}),
                          backend=backend, donate=donate)
    assert torch.equal(got[0]["w"], plain[0]["w"])
    assert torch.equal(got[1]["mu"]["w"], plain[1]["mu"]["w"])
    if donate:
        assert got[0]["w"] is params["w"] and params["w"].is_conj()


def test_the_class_steps_negated_gradients_and_states_directly_as_their_values():
    ps = [torch.nn.Parameter(_rand(40, seed=k)) for k in range(3)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, twin = vega.adamw.optimizer(ps), vega.adamw.optimizer(qs)
    for step in range(6):
        for k, (p, q) in enumerate(zip(ps, qs)):
            g = _rand(40, seed=100 * step + k)
            p.grad, q.grad = (_neg(g) if k != 1 else g.clone()), g
        if step == 3:  # a state with its negative bit, the plan made already
            opt.state[ps[2]]["mu"] = _neg(opt.state[ps[2]]["mu"].clone())
        opt.step()
        twin.step()
        for p, q in zip(ps, qs):
            assert torch.equal(p, q)


# -- what a step in place writes -----------------------------------------------------------

def _snapshot(params, state):
    return [t.clone() for t in [*params.values(), *state["mu"].values(), *state["nu"].values(),
                                state["step"]]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["params", "state"])
def test_an_expanded_tensor_is_refused_before_anything_is_written(backend, which):
    """A stride-0 tensor: the C backend stepped contiguous copies, advanced the counter, then
    failed to copy back (a half-made step)."""
    params = {"a": _rand(4, seed=1), "w": _rand(5, seed=2)}
    grads = {"a": _rand(4, seed=3), "w": _rand(5, seed=4)}
    state = vega.adamw.init(params)
    if which == "params":
        params["w"] = torch.zeros(1).expand(5)
        label = "params leaf 'w'"
    else:
        state["nu"]["w"] = torch.zeros(1).expand(5)
        label = "state leaf 'nu.w'"
    before = _snapshot(params, state)
    with pytest.raises(ValueError, match=f"adamw_step: {label} has elements at one memory "
                                         f"location"):
        vega.adamw.step(params, grads, state, backend=backend, donate=True)
    for x, y in zip(before, _snapshot(params, state)):
        assert torch.equal(x, y)
    vega.adamw.step(params, grads, state, backend=backend, donate=False)  # pure: fine


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_kernels_refuse_an_expanded_tensor_themselves(backend):
    from vega.runtime import engine
    program = vega.sgd.program(momentum=0.0)
    w, step = torch.zeros(1).expand(5), torch.zeros((), dtype=torch.int32)
    with pytest.raises(ValueError, match=f"backend '{backend}': parameter 0 has elements at "
                                         f"one memory location"):
        engine.run(program, backend, [w], [torch.ones(5)], [], [step],
                   [{"lr": 0.1, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}], True)
    assert int(step) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_that_share_memory_are_refused_in_place_and_fine_when_pure(backend):
    w = _rand(6, seed=1)
    ga, gb = _rand(6, seed=2), _rand(6, seed=3)
    # one tensor as two parameters
    params = {"a": w, "b": w}
    state = vega.adamw.init(params)
    before = _snapshot({"w": w}, state)
    with pytest.raises(ValueError, match="params leaf 'b' shares memory with params leaf 'a'"):
        vega.adamw.step(params, {"a": ga, "b": gb}, state, backend=backend, donate=True)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot({"w": w}, state)))
    new, _ = vega.adamw.step(params, {"a": ga, "b": gb}, state, backend=backend)
    for k, g in (("a", ga), ("b", gb)):
        alone, _ = vega.adamw.step({"w": w}, {"w": g}, vega.adamw.init({"w": w}), backend=backend)
        assert torch.equal(new[k], alone["w"])
    # a state that is a view of its parameter, and two halves of one tensor (which do not)
    base = _rand(12, seed=4)
    params = {"w": base[:6]}
    state = vega.adamw.init(params)
    state["mu"]["w"] = base[:6].view(2, 3).view(6)
    with pytest.raises(ValueError, match="state leaf 'mu.w' shares memory with params leaf 'w'"):
        vega.adamw.step(params, {"w": ga}, state, backend=backend, donate=True)
    halves = {"a": base[:6], "b": base[6:]}
    vega.adamw.step(halves, {"a": ga, "b": gb}, vega.adamw.init(halves), backend=backend,
                    donate=True)
    # interleaved columns of one matrix share no element either
    m = _rand(4, 3, seed=5)
    cols = {str(k): m[:, k] for k in range(3)}
    vega.adamw.step(cols, {k: torch.ones(4) for k in cols}, vega.adamw.init(cols),
                    backend=backend, donate=True)
    cols["3"] = m[:, 1]
    with pytest.raises(ValueError, match="params leaf '3' shares memory with params leaf '1'"):
        vega.adamw.step(cols, {k: torch.ones(4) for k in cols}, vega.adamw.init(cols),
                        backend=backend, donate=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_check_for_shared_memory_steps_under_a_meta_default_device(backend):
    """The check in place of leaves whose spans of memory meet (interleaved columns: each
    element's offset listed) makes its offsets on the CPU whatever the default device:
    under ``torch.device("meta")`` they were meta tensors, and the step crashed inside
    (``torch.nonzero`` of meta). The columns step as outside; a column given twice is
    refused by name."""
    m = _rand(4, 3, seed=5)
    cols = {str(k): m[:, k] for k in range(3)}
    grads = {k: _rand(4, seed=6 + int(k)) for k in cols}
    want, _ = vega.adamw.step(cols, grads, vega.adamw.init(cols), backend="reference")
    state = vega.adamw.init(cols)
    with torch.device("meta"):
        vega.adamw.step(cols, grads, state, backend=backend, donate=True)
    for k in cols:
        torch.testing.assert_close(m[:, int(k)], want[k], msg=k)
    cols["3"], grads["3"] = m[:, 1], grads["1"]
    state = vega.adamw.init(cols)
    with torch.device("meta"), pytest.raises(
            ValueError, match="params leaf '3' shares memory with params leaf '1'"):
        vega.adamw.step(cols, grads, state, backend=backend, donate=True)


def test_the_class_refuses_what_it_cannot_write_before_writing_any_group():
    a = torch.nn.Parameter(_rand(5, seed=1))
    w = torch.nn.Parameter(torch.zeros(1).expand(5))
    opt = vega.adamw.optimizer([{"params": [a]}, {"params": [w]}])
    a.grad, w.grad = torch.ones(5), torch.ones(5)
    before = a.detach().clone()
    with pytest.raises(ValueError, match="AdamW: parameter 0 of group 1 has elements at one "
                                         "memory location"):
        opt.step()
    assert torch.equal(a, before) and a not in opt.state  # (nor the states it made)
    # a state replaced by a view of its parameter, after some steps
    p, q = torch.nn.Parameter(_rand(8, seed=2)), torch.nn.Parameter(_rand(8, seed=3))
    opt = vega.adamw.optimizer([p, q])
    for _ in range(4):
        p.grad, q.grad = torch.ones(8), torch.ones(8)
        opt.step()
    opt.state[q]["mu"] = q.detach()
    before = [p.detach().clone(), q.detach().clone(), opt.state[p]["step"].clone()]
    with pytest.raises(ValueError, match="AdamW: state 'mu' of parameter 1 of group 0 shares "
                                         "memory with parameter 1 of group 0"):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, [p, q, opt.state[p]["step"]]))


@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("spoil, words", [
    ("resized", r"AdamW: parameter 0 of group 1: backend '\w+': state 'mu' has shape \(6, 4\)"),
    ("gradient", r"AdamW: the gradient of parameter 0 of group 1 has shape \(3,\)"),
    ("schedule", r"hyperparameter 'lr': its schedule returned a tensor of shape \(2,\)"),
    ("backend", r"backend='cpu' is not one of"),
])
def test_a_step_refused_for_one_group_steps_no_other(backend, spoil, words):
    """What a later group's kernel refuses (its states' shapes against a resized parameter,
    its gradient's shape, its schedule's value, its backend) is found before the first
    group is written: the step changes no parameter, state or step counter of any group."""
    a, b = torch.nn.Parameter(_rand(8, seed=1)), torch.nn.Parameter(_rand(6, 4, seed=2))
    opt = vega.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2, backend=backend)
    a.grad, b.grad = torch.ones(8), torch.ones(6, 4)
    opt.step()
    if spoil == "resized":
        b.data, b.grad = _rand(7, 4, seed=3), torch.ones(7, 4)
    elif spoil == "gradient":
        b.grad.data = torch.ones(3)
    elif spoil == "schedule":
        opt.param_groups[1]["lr"] = lambda step: torch.full((2,), 1e-3)
    else:
        opt.param_groups[1]["backend"] = "cpu"
    before = [a.detach().clone(), *(x.clone() for x in opt.state[a].values())]
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert all(torch.equal(x, y) for x, y in zip(before, [a, *opt.state[a].values()]))


# -- versions and inference tensors ----------------------------------------------------------

@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_a_step_in_place_advances_the_parameters_versions(backend):
    """As torch.optim: a graph that saved a parameter refuses backward after the step (the C
    and Triton kernels are called directly, not through their operators' dispatch, which
    would advance the versions itself)."""
    w = torch.nn.Parameter(_rand(10, seed=1))
    opt = vega.adamw.optimizer([w], backend=backend)
    for step in range(5):
        w.grad = torch.ones(10)
        loss = (w * w).sum()
        version = w._version
        opt.step()
        assert w._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    if backend is not None:
        return
    # the functional step in place
    w = _rand(10, seed=2).requires_grad_(True)
    state = vega.adamw.init({"w": w})
    loss = (w * w).sum()
    with torch.no_grad():
        vega.adamw.step({"w": w}, {"w": torch.ones(10)}, state, donate=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_are_written_only_inside_inference_mode():
    with torch.inference_mode():
        w = _rand(6, seed=1)
    w.grad = torch.ones(6)
    opt = vega.adamw.optimizer([w])
    with pytest.raises(ValueError, match="AdamW: parameter 0 of group 0 is an inference tensor"):
        opt.step()
    assert torch.equal(w, _rand(6, seed=1))
    with torch.inference_mode():  # there it may (as torch.optim)
        for _ in range(4):
            opt.step()
    before = w.clone()
    with pytest.raises(ValueError, match="is an inference tensor"):
        opt.step()  # out of it again
    assert torch.equal(w, before) and int(opt.state[w]["step"]) == 4
    # functional: in place refused (naming the leaf), pure fine
    state = vega.adamw.init({"w": w})
    with pytest.raises(ValueError, match="adamw_step: params leaf 'w' is an inference tensor"):
        vega.adamw.step({"w": w}, {"w": torch.ones(6)}, state, donate=True)
    assert torch.equal(w, before) and int(state["step"]) == 0
    vega.adamw.step({"w": w}, {"w": torch.ones(6)}, state)



@pytest.mark.parametrize("backend", ["c", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_step_left_inside_autocast_steps_as_outside_it(backend, dtype):
    """A step inside ``torch.autocast`` (left around ``optimizer.step()``, a common slip) is
    the step outside it, the closure's forward pass still in autocast: Muon's Newton-Schulz
    products ran in the autocast dtype (bfloat16 products of bf16=False, float16 of either),
    another update, in the class's step and the functional one."""
    w, g = _rand(24, 40, seed=1), _rand(24, 40, seed=2)

    def stepped(cast):
        p = torch.nn.Parameter(w.clone())
        opt = vega.optim.Muon([p], lr=1e-2, bf16=False, backend=backend)
        seen = []

        def closure():
            seen.append(torch.is_autocast_enabled("cpu"))
            p.grad = g.clone()
        with torch.autocast("cpu", dtype=dtype, enabled=cast):
            opt.step(closure)
            new, _ = vega.muon_step({"w": w}, {"w": g}, vega.muon_init({"w": w}), lr=1e-2,
                                    bf16=False, backend=backend)
            assert torch.is_autocast_enabled("cpu") == cast
        assert seen == [cast]
        return p.detach(), new["w"], *opt.state[p].values()
    assert all(map(torch.equal, stepped(True), stepped(False)))



@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_step_in_place_of_real_tensors_under_fake_tensor_mode_is_refused(backend):
    """Under ``FakeTensorMode(allow_non_fake_inputs=True)`` a step in place of real
    parameters (a class's, LBFGS's, a functional one with donate=True) is refused by name
    and changes nothing: the mode's operations gave fake tensors, so the reference backend
    wrote no parameter, kept fake states in the class (later steps outside it read them:
    another update) and returned the unwritten inputs from donate=True; steps outside match
    those of an optimizer never there. Fake parameters step there, as tracing steps them."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    w, g = _rand(4, 5, seed=1), _rand(4, 5, seed=2)

    def stepped(fake):
        p = torch.nn.Parameter(w.clone())
        q = torch.nn.Parameter(w.clone())
        opts = [vega.optim.AdamW([p], lr=0.1, backend=backend), vega.optim.LBFGS([q])]
        for opt in opts:
            opt.param_groups[0]["params"][0].grad = g.clone()
            if fake:
                with FakeTensorMode(allow_non_fake_inputs=True):
                    with pytest.raises(ValueError, match=rf"{type(opt).__name__}\.step: "
                                       "called under a FakeTensorMode with parameter 0"):
                        opt.step()
                assert not opt.state
            opt.step()
            opt.step()
        state = vega.adamw_init({"w": w})
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=True):
                with pytest.raises(ValueError, match="adamw_step: params leaf 'w' is a real "
                                   "tensor, and a FakeTensorMode is active"):
                    vega.adamw_step({"w": w}, {"w": g}, state, backend=backend, donate=True)
        assert int(state["step"]) == 0
        return p.detach(), q.detach(), *opts[0].state[p].values(), *opts[1].state[q].values()
    assert all(map(torch.equal, stepped(True), stepped(False)))
    if backend == "reference":
        with FakeTensorMode() as mode:
            p = torch.nn.Parameter(mode.from_tensor(w))
            p.grad = mode.from_tensor(g)
            opt = vega.optim.AdamW([p], lr=0.1, backend=backend)
            opt.step()
        assert all(isinstance(t, FakeTensor) for t in opt.state[p].values())


def test_a_step_in_place_under_functional_tensor_mode_names_that_mode():
    """Non-strict export's ``FunctionalTensorMode`` makes FunctionalTensors of real ones as
    a FakeTensorMode makes fake ones: a class step and a functional one with donate=True
    are refused alike, naming the mode that is active, and change nothing."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    w, g = _rand(4, 5, seed=1), _rand(4, 5, seed=2)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    opt = vega.optim.AdamW([p], lr=0.1)
    state = vega.adamw_init({"w": p.detach()})
    with FunctionalTensorMode():
        with pytest.raises(ValueError, match=r"AdamW\.step: called under a FunctionalTensorMode "
                           r"with parameter 0 of group 0 a real tensor: the mode's operations "
                           r"make FunctionalTensors of real ones"):
            opt.step()
        with pytest.raises(ValueError, match="adamw_step: params leaf 'w' is a real tensor, "
                           "and a FunctionalTensorMode is active"):
            vega.adamw_step({"w": p.detach()}, {"w": g}, state, donate=True)
    assert not opt.state and int(state["step"]) == 0 and torch.equal(p.detach(), w)
    # a mode of the user's is named as a dispatch mode, not after its tensors' class
    from vega.codegen.tensors import mode_words
    made = type("Boxed", (torch.Tensor,), {})
    assert mode_words(made) == {"made": "Boxed", "mode": "dispatch mode"}


def test_a_first_step_refused_in_a_later_group_leaves_no_state():
    """A sparse gradient in group 1 is refused while the step gathers its groups: the
    states group 0's first step made are dropped, and the next step makes them again."""
    a, b = torch.nn.Parameter(_rand(5, seed=1)), torch.nn.Parameter(_rand(5, seed=2))
    opt = vega.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    a.grad, b.grad = torch.ones(5), torch.ones(5).to_sparse()
    with pytest.raises(ValueError, match="the gradient of parameter 0 of group 1 is "
                                         "torch.sparse_coo"):
        opt.step()
    assert not opt.state
    b.grad = torch.ones(5)
    opt.step()
    assert int(opt.state[a]["step"]) == int(opt.state[b]["step"]) == 1


def test_inplace_problem_names_an_item_that_is_not_a_tensor():
    """``inplace_problem`` names an item that is not a tensor (None, a number) by its position
    and ``MISSING_WORDS``, where the native module is loaded too (its pass raised a TypeError
    of its own, "vega_native: tensor 1 is a float", before)."""
    from vega.codegen.tensors import MISSING_WORDS, inplace_problem
    for x in (None, 3.0):
        assert inplace_problem([torch.ones(2), x]) == (1, None, MISSING_WORDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gradient_in_memory_a_step_in_place_writes_is_refused(backend):
    """A gradient that shares memory with a tensor a step in place writes (its parameter
    shifted by one element, another parameter) was read after that memory was written on
    some backends: wrong values, which differed between C and Triton. Refused on every
    backend, in the class and the functional step, naming both, before anything is written;
    the pure step takes it. A gradient given to two parameters, or a copy, steps."""
    n = 1000
    base = torch.arange(n + 1, dtype=torch.float32) / n
    w = torch.nn.Parameter(base[1:])
    w.grad = base[:-1]
    before = base.clone()
    with pytest.raises(ValueError, match=r"the gradient of parameter 0 of group 0 shares memory "
                                         r"with parameter 0 of group 0, which the step writes"):
        vega.optim.SGD([w], lr=0.5, backend=backend).step()
    assert torch.equal(base, before)
    a, b = torch.ones(4), torch.full((4,), 2.0)
    params = {"a": a, "b": b}
    grads = {"a": torch.ones(4), "b": a}
    with pytest.raises(ValueError, match=r"sgd_step: grads leaf 'b' shares memory with params "
                                         r"leaf 'a', which the step writes"):
        vega.sgd_step(params, grads, vega.sgd_init(params), lr=0.1, backend=backend,
                      donate=True)
    assert torch.equal(a, torch.ones(4)) and torch.equal(b, torch.full((4,), 2.0))
    new, _ = vega.sgd_step(params, grads, vega.sgd_init(params), lr=0.1, backend=backend)
    assert torch.equal(new["b"], torch.full((4,), 1.9))
    x, y = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    x.grad = y.grad = torch.ones(4)
    opt = vega.optim.Adam([x, y], backend=backend)
    opt.step()
    w.grad = base[:-1].clone()
    vega.optim.SGD([w], lr=0.5, backend=backend).step()
    assert torch.allclose(w.detach(), before[1:] - 0.5 * before[:-1])


def test_a_donated_step_over_a_reduce_group_writes_nothing_it_refuses():
    """A functional step in place over a ``reduce_group`` checks its plain tensors before
    its first call writes, as one without: a tensor it cannot write in a later call (an
    expanded vector beside a factored matrix: two programs) is refused by its leaf's name,
    with the matrix and the counter as they were (the first call wrote the matrix, and the
    second refused the vector by its position alone)."""
    _one_rank("""
        m, v = torch.ones(256, 256), torch.ones(1).expand(8)
        state = vega.adafactor_init({"m": torch.ones(256, 256), "v": torch.ones(8)})
        try:
            vega.adafactor_step({"m": m, "v": v}, {"m": torch.ones(256, 256),
                                                   "v": torch.ones(8)}, state, donate=True,
                                reduce_group=dist.group.WORLD)
        except ValueError as e:
            assert str(e).startswith("adafactor_step: params leaf 'v' has elements at one "
                                     "memory location"), e
        else:
            raise AssertionError("not refused")
        assert torch.equal(m, torch.ones(256, 256)) and int(state["step"]) == 0
        dist.destroy_process_group()
    """)


def test_the_fake_tensor_mode_messages_that_optimizers_md_quotes_are_raised():
    """docs/optimizers.md quotes the refusals of a step of real tensors under FakeTensorMode:
    each quoted start (up to its '...') begins a message a step raises there (the Triton
    backend's was quoted as 'a step under FakeTensorMode:', which it no longer says)."""
    import pathlib
    import re
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vega.codegen import triton_runtime
    page = (pathlib.Path(__file__).parents[2] / "docs" / "optimizers.md").read_text()
    bullet = page[page.index("- `FakeTensorMode`"):]
    bullet = " ".join(bullet[:bullet.index("\n\n")].split())
    quoted = [q[:-len("...")].rstrip(" ,:") for q in re.findall(r"`([^`]*\.\.\.)`", bullet)]
    assert len(quoted) == 3
    w = torch.nn.Parameter(_rand(4, 5, seed=1))
    w.grad = _rand(4, 5, seed=2)
    opt = vega.optim.AdamW([w], lr=0.1)
    params, grads = {"w": w.detach().clone()}, {"w": w.grad.clone()}
    state = vega.adamw_init(params)
    said = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for call in (opt.step, triton_runtime.check_mode,
                     lambda: vega.adamw_step(params, grads, state, donate=True)):
            with pytest.raises(ValueError) as err:
                call()
            said.append(str(err.value))
    for start in quoted:
        assert any(s.startswith(start) for s in said), (start, said)


@pytest.mark.parametrize("name", ["Prodigy", "DAdaptAdamW"])
def test_a_class_of_sums_over_a_group_routes_wrapper_subclasses_too(name):
    """Prodigy's and D-Adaptation's classes (sums over a parameter group: a step in stages)
    step a TwoTensor parameter on the reference backend where no backend is named, as the
    other classes and their own functional steps do: each half steps as a plain tensor of
    its own would. They refused it (``backend 'c': parameter 0 is a TwoTensor``, naming
    neither the class nor the group), and with a backend named still do, in the class's
    words, before any state is made."""
    cls = getattr(vega.optim, name)
    a, b, c = _rand(6, seed=1), _rand(6, seed=2), _rand(4, 3, seed=3)
    grads = [(_rand(6, seed=10 + k), _rand(6, seed=20 + k)) for k in range(3)]
    w = torch.nn.Parameter(TwoTensor(a.clone(), b.clone()))
    plain = torch.nn.Parameter(c.clone())
    x, y = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
    opt = cls([{"params": [plain]}, {"params": [w]}], lr=0.5)
    ox, oy = cls([x], lr=0.5, backend="reference"), cls([y], lr=0.5, backend="reference")
    for k, (ga, gb) in enumerate(grads):
        plain.grad = _rand(4, 3, seed=30 + k)
        w.grad, x.grad, y.grad = TwoTensor(ga.clone(), gb.clone()), ga.clone(), gb.clone()
        opt.step()
        ox.step()
        oy.step()
    assert type(w) is TwoTensor
    assert torch.equal(w.a, x) and torch.equal(w.b, y)
    assert not torch.equal(x, a)
    for backend in [b for b in BACKENDS if b != "reference"]:
        p = torch.nn.Parameter(c.clone())
        two = torch.nn.Parameter(TwoTensor(a.clone(), b.clone()))
        p.grad, two.grad = _rand(4, 3, seed=5), TwoTensor(a.clone(), b.clone())
        opt = cls([{"params": [p]}, {"params": [two]}], lr=0.5, backend=backend)
        with pytest.raises(ValueError, match=rf"{name}: parameter 0 of group 1 is a TwoTensor, "
                                             rf"a tensor subclass with operations of its own"):
            opt.step()
        assert not opt.state and torch.equal(p, c)


def test_a_fused_step_of_sums_over_a_group_names_the_wrapper_gradient_it_refuses():
    """A fused step (max_grad_norm, skip_nonfinite) refuses a TwoTensor gradient, whose
    norm is its own: for Prodigy, whose step runs in stages over its group, the message said
    ``one is a TwoTensor``, naming neither the step nor the gradient, where AdamW's names
    both; it names them now, and nothing is written."""
    a, c = _rand(6, seed=1), _rand(4, 3, seed=3)
    for kw in ({"max_grad_norm": 1.0}, {"skip_nonfinite": True}):
        p = torch.nn.Parameter(c.clone())
        two = torch.nn.Parameter(TwoTensor(a.clone(), a.clone()))
        p.grad, two.grad = _rand(4, 3, seed=5), TwoTensor(a.clone(), a.clone())
        opt = vega.optim.Prodigy([{"params": [p]}, {"params": [two]}], **kw)
        with pytest.raises(ValueError, match=r"^Prodigy: the gradient of parameter 0 of group 1 "
                                             r"is a TwoTensor, a tensor subclass"):
            opt.step()
        assert not opt.state and torch.equal(p, c)
        params = {"w": c.clone(), "b": TwoTensor(a.clone(), a.clone())}
        state = vega.prodigy_init(params)
        grads = {"w": _rand(4, 3, seed=5), "b": TwoTensor(a.clone(), a.clone())}
        with pytest.raises(ValueError, match=r"^prodigy_step: grads leaf 'b' is a TwoTensor, "
                                             r"a tensor subclass"):
            vega.prodigy_step(params, grads, state, donate=True, **kw)
        assert torch.equal(params["w"], c) and int(state["step"]) == 0


@pytest.mark.parametrize("name", ["Prodigy", "DAdaptAdamW"])
def test_a_sum_over_a_group_of_parameters_on_meta_beside_others_is_refused(name):
    """Prodigy's and D-Adaptation's sums over a parameter group add every tensor's part: a
    parameter on meta (no values) beside one on the CPU, stepped on the reference backend,
    failed inside the sum (``Tensor on device meta is not on the expected device cpu!``), or
    for D-Adaptation wrote the CPU parameter and then failed on the meta one's write
    (``Cannot copy out of meta tensor; no data!``), the class keeping the states it had
    made. It is a ValueError now, naming the parameter, before anything is written; a group
    all on meta steps there, as before."""
    cls = getattr(vega.optim, name)
    a = _rand(5, seed=1)
    p, q = torch.nn.Parameter(a.clone()), torch.nn.Parameter(torch.empty(5, device="meta"))
    p.grad, q.grad = _rand(5, seed=2), torch.empty(5, device="meta")
    opt = cls([p, q], backend="reference")
    with pytest.raises(ValueError, match=rf"^{name}: parameter 1 of group 0 is on meta, which "
                                         rf"holds no values, and parameter 0 of group 0 on cpu"):
        opt.step()
    assert not opt.state and torch.equal(p, a)
    params = {"a": a.clone(), "b": torch.empty(5, device="meta")}
    state = cls.spec.init(params)
    grads = {"a": _rand(5, seed=2), "b": torch.empty(5, device="meta")}
    for donate in (False, True):
        with pytest.raises(ValueError, match=r"params leaf 'b' is on meta, which holds no "
                                             r"values, and params leaf 'a' on cpu"):
            cls.spec.step(params, grads, state, backend="reference", donate=donate)
        assert torch.equal(params["a"], a) and int(state["step"]) == 0
    metas = [torch.nn.Parameter(torch.empty(5, device="meta")) for _ in range(2)]
    for m in metas:
        m.grad = torch.empty(5, device="meta")
    opt = cls(metas, backend="reference")
    opt.step()
    assert opt.state[metas[0]]["step"].is_meta


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_functional_step_names_the_leaf_its_backend_cannot_run_on(backend):
    """A functional step of one call whose compiled backend cannot run on a leaf's device (a
    parameter on meta beside ones on the CPU) said only ``backend 'c' runs on CPU tensors,
    got parameters on meta``, naming neither the step nor the leaf, where the class names
    both (``AdamW: parameter 1 of group 0: backend 'c' ...``) and a step of several calls
    checked in place names the leaf: it names them now, pure or in place, and writes
    nothing."""
    a = _rand(5, seed=1)
    params = {"a": a.clone(), "b": torch.empty(5, device="meta")}
    state = vega.adamw_init(params)
    grads = {"a": _rand(5, seed=2), "b": torch.empty(5, device="meta")}
    for donate in (False, True):
        with pytest.raises(ValueError, match=r"^adamw_step: params leaf 'b': .*meta"):
            vega.adamw_step(params, grads, state, backend=backend, donate=donate)
        assert torch.equal(params["a"], a) and int(state["step"]) == 0


class _RootTwice(torch.Tensor):
    """A subclass with ``__torch_function__`` alone, whose ``sqrt`` is twice torch's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func in (torch.sqrt, torch.Tensor.sqrt) else out


def test_a_torch_function_subclass_steps_through_its_operations_on_the_reference_alone():
    """docs/robustness.md: a parameter of a subclass that overrides ``__torch_function__``
    alone keeps its storage; the compiled kernels read and write it as a plain tensor (its
    overrides change nothing), while the reference backend steps it through torch's
    operations, which call them, as torch.optim's step does (AdamW whose ``sqrt`` is doubled
    takes half a step there); its states are of its type, as torch.optim's are."""
    w = _rand(64, seed=1)
    grads = [_rand(64, seed=2 + k) for k in range(3)]
    moved = {}
    for lib, backend in [(torch.optim, None), *((vega.optim, b) for b in BACKENDS)]:
        p = torch.nn.Parameter(w.clone().as_subclass(_RootTwice))
        opt = lib.AdamW([p], lr=0.01, **({} if lib is torch.optim else {"backend": backend}))
        for g in grads:
            p.grad = g.clone()
            opt.step()
        assert type(p) is _RootTwice and type(opt.state[p]["exp_avg_sq" if backend is None
                                                         else "nu"]) is _RootTwice
        moved[backend] = p.detach().as_subclass(torch.Tensor) - w
    q = torch.nn.Parameter(w.clone())
    opt = vega.optim.AdamW([q], lr=0.01, backend="reference")
    for g in grads:
        q.grad = g.clone()
        opt.step()
    plain = q.detach() - w
    torch.testing.assert_close(moved["reference"], moved[None], rtol=1e-5, atol=1e-6)
    assert (moved["reference"] / plain).median() < 0.6
    for backend in BACKENDS:
        if backend != "reference":
            torch.testing.assert_close(moved[backend], plain, rtol=1e-5, atol=1e-6)


def test_a_fused_step_names_a_gradient_on_another_device():
    """A fused step's gradients on two devices (one on meta beside ones on the CPU) were
    refused with ``a fused step with clipping or loss scaling needs all gradients on one
    device, got ['cpu', 'meta']``, naming neither the step nor a gradient: it names both,
    as its other refusals of a gradient do, and writes nothing."""
    a = _rand(5, seed=1)
    p, q = torch.nn.Parameter(a.clone()), torch.nn.Parameter(torch.empty(5, device="meta"))
    p.grad, q.grad = _rand(5, seed=2), torch.empty(5, device="meta")
    for kw in ({"max_grad_norm": 1.0}, {"skip_nonfinite": True}):
        opt = vega.optim.AdamW([p, q], backend="reference", **kw)
        with pytest.raises(ValueError, match=r"^AdamW: the gradient of parameter 1 of group 0 "
                                             r"is on meta, and the first gradient on cpu: a "
                                             r"fused step"):
            opt.step()
        assert not opt.state and torch.equal(p, a)
    params = {"a": a.clone(), "b": torch.empty(5, device="meta")}
    state = vega.adamw_init(params)
    with pytest.raises(ValueError, match=r"^adamw_step: grads leaf 'b' is on meta, and the "
                                         r"first gradient on cpu: a fused step"):
        vega.adamw_step(params, {"a": _rand(5, seed=2), "b": torch.empty(5, device="meta")},
                        state, backend="reference", max_grad_norm=1.0, donate=True)
    assert torch.equal(params["a"], a) and int(state["step"]) == 0
