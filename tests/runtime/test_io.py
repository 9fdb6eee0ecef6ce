"""State files and checkpoints: ``vega.save`` / ``vega.load``, ``get_leaf`` / ``set_leaf``,
and the ``vega.optim`` classes' state_dict through ``torch.save`` and
``torch.distributed.checkpoint``.

The central property: for every shipped spec, 100 uninterrupted steps equal 50
steps, a save, a load in a fresh process and 50 more steps -- bitwise.
"""
import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

import vega
from vega.codegen import c as c_backend
from vega.runtime import io as vio

SPECS = vega.builtin_names()
HALF = 50  # steps before the save; as many after it
needs_c = pytest.mark.skipif(not c_backend.available(), reason="no C compiler: no C backend")


# -- helpers (the child process imports this file and uses them too) -----------------

def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"layer1": {"weight": torch.randn(16, 8, generator=gen),
                       "bias": torch.randn(8, generator=gen)}}


def make_grads(k):
    """The gradients of step ``k`` (0-based), the same in every process."""
    gen = torch.Generator().manual_seed(1000 + k)
    return {"layer1": {"weight": torch.randn(16, 8, generator=gen),
                       "bias": torch.randn(8, generator=gen)}}


def run(spec, params, state, steps):
    for k in steps:
        params, state = spec.step(params, make_grads(k), state, backend="c")
    return params, state


def continue_run(directory):
    """In the child: load each spec's params and state, run the second half, save them."""
    for name in SPECS:
        spec = vega.builtin(name)
        like_p = make_params()
        params = vega.load(os.path.join(directory, f"{name}.params.safetensors"), like=like_p)
        state = vega.load(os.path.join(directory, f"{name}.state.safetensors"),
                          like=spec.init(like_p))
        params, state = run(spec, params, state, range(HALF, 2 * HALF))
        vega.save(os.path.join(directory, f"{name}.params.out.safetensors"), params)
        vega.save(os.path.join(directory, f"{name}.state.out.safetensors"), state)


def named(tree):
    pairs, _ = pytree.tree_flatten_with_path(tree)
    return {pytree.keystr(path): x for path, x in pairs if isinstance(x, torch.Tensor)}


def bits(t):
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(actual, expected, what=""):
    a, e = named(actual), named(expected)
    assert a.keys() == e.keys(), f"{what}: leaves {sorted(a)} against {sorted(e)}"
    for key in e:
        assert a[key].dtype == e[key].dtype and a[key].shape == e[key].shape, \
            f"{what}{key}: {a[key].dtype}{tuple(a[key].shape)} against " \
            f"{e[key].dtype}{tuple(e[key].shape)}"
        if not torch.equal(bits(a[key]), bits(e[key])):
            differ = int((a[key] != e[key]).sum())
            raise AssertionError(f"{what}{key}: {differ} of {e[key].numel()} element(s) differ")


# -- 100 steps = 50, save, load in a fresh process, 50 -------------------------------

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """For each spec: (100 uninterrupted steps, 50 + save + load in a child + 50)."""
    if not c_backend.available():
        pytest.skip("no C compiler: no C backend")
    directory = tmp_path_factory.mktemp("resume")
    straight = {}
    for name in SPECS:
        spec = vega.builtin(name)
        params = make_params()
        half_p, half_s = run(spec, params, spec.init(params), range(HALF))
        vega.save(directory / f"{name}.params.safetensors", half_p)
        vega.save(directory / f"{name}.state.safetensors", half_s)
        straight[name] = run(spec, half_p, half_s, range(HALF, 2 * HALF))
    child = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('vega_test_io_child', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.continue_run(sys.argv[2])\n")
    # (forked from a server that has imported torch and vega, as this module does first:
    # tests/forks.py, imported here, where the child that imports this module need not)
    from tests import forks
    done = forks.run(child, __file__, str(directory), timeout=600, cwd=directory)
    assert done.returncode == 0, f"the child process failed:\n{done.stderr[-4000:]}"
    out = {}
    for name in SPECS:
        spec = vega.builtin(name)
        like_p = make_params()
        params = vega.load(directory / f"{name}.params.out.safetensors", like=like_p)
        state = vega.load(directory / f"{name}.state.out.safetensors", like=spec.init(like_p))
        out[name] = straight[name], (params, state)
    return out


@needs_c
@pytest.mark.parametrize("name", SPECS)
def test_resume_in_a_fresh_process_is_bitwise(resumed, name):
    (p100, s100), (p_res, s_res) = resumed[name]
    assert s100["step"].dtype == torch.int32 and int(s100["step"]) == 2 * HALF
    assert all(torch.isfinite(x).all() for x in named(p100).values())
    assert_same_bits(p_res, p100, f"{name} params")
    assert_same_bits(s_res, s100, f"{name} state")
    assert vega.state_names(s_res) == vega.state_names(s100)


def test_file_is_keyed_by_the_state_names(tmp_path):
    from safetensors import safe_open
    params = make_params()
    state = vega.adamw_init(params)
    vega.save(tmp_path / "s.safetensors", state)
    with safe_open(tmp_path / "s.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == sorted(vega.state_names(state)) == sorted(
            ["mu.layer1.weight", "mu.layer1.bias", "nu.layer1.weight", "nu.layer1.bias",
             "step"])
        assert f.metadata()["vega"] == vio.FORMAT
        assert f.get_tensor("step").dtype == torch.int32
    assert os.listdir(tmp_path) == ["s.safetensors"]  # no temporary file left behind


def test_save_with_torch_saves_order_says_which_comes_first(tmp_path):
    """vega.save(state, path), torch.save's order, is refused saying the path comes first
    (not as a state that is "a str"), and writes nothing."""
    state = vega.adamw_init(make_params())
    for path in (tmp_path / "s", str(tmp_path / "s")):
        with pytest.raises(ValueError, match=r"^vega\.save: the path comes first, then the "
                           r"state: vega\.save\('.*s', state\)"):
            vega.save(state, path)
    assert os.listdir(tmp_path) == []


def test_load_returns_fresh_tensors_with_like_structure(tmp_path):
    params = {"a": torch.randn(3), "k": torch.arange(4), "b": [torch.randn(2, 2)]}
    state = vega.sgd_init(params, momentum=0.9)
    state = vega.set_leaf(state, "v.a", torch.randn(3))
    vega.save(tmp_path / "s", state)
    loaded = vega.load(tmp_path / "s", like=state)
    assert pytree.tree_structure(loaded) == pytree.tree_structure(state)
    assert loaded["v"]["k"] is None  # the int leaf has no state
    assert_same_bits(loaded, state)
    again = vega.load(tmp_path / "s", like=state)
    for x, y in zip(named(loaded).values(), named(again).values(), strict=True):
        assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    # loaded tensors are writable in place: a donated step on them works
    _, loaded2 = vega.sgd_step(params, {"a": torch.ones(3), "k": None,
                                              "b": [torch.ones(2, 2)]}, loaded, momentum=0.9,
                                     donate=True)
    assert loaded2["step"] is loaded["step"] and int(loaded["step"]) == 1


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_complex_state_round_trips(tmp_path, dtype):
    params = {"z": torch.randn(5, 3, dtype=dtype), "x": torch.randn(4, dtype=torch.float64)}
    state = vega.adam_init(params)
    grads = {"z": torch.randn(5, 3, dtype=dtype), "x": torch.randn(4, dtype=torch.float64)}
    params, state = vega.adam_step(params, grads, state)
    vega.save(tmp_path / "s", state)
    loaded = vega.load(tmp_path / "s", like=state)
    assert loaded["mu"]["z"].dtype == dtype
    assert_same_bits(loaded, state)
    # the loaded complex state steps like the original (it is properly aligned memory)
    assert_same_bits(vega.adam_step(params, grads, loaded), vega.adam_step(params, grads, state))


def test_load_puts_tensors_on_like_devices(tmp_path):
    state = vega.adamw_init(make_params())
    vega.save(tmp_path / "s", state)
    like = pytree.tree_map(lambda t: t.to("meta"), state)
    loaded = vega.load(tmp_path / "s", like=like)
    assert all(t.device.type == "meta" for t in named(loaded).values())
    assert loaded["step"].dtype == torch.int32


# -- errors -----------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    params = make_params()
    state = vega.adamw_init(params)
    path = tmp_path / "opt.safetensors"
    vega.save(path, state)
    return path, params, state


def test_missing_leaf_is_named(saved):
    path, params, _ = saved
    bigger = {"layer1": {**params["layer1"], "scale": torch.ones(8)}}
    with pytest.raises(ValueError, match=r"has no leaf 'mu\.layer1\.scale'.*2 leaves missing"):
        vega.load(path, like=vega.adamw_init(bigger))


def test_extra_leaf_is_named(saved):
    path, params, _ = saved
    smaller = {"layer1": {"weight": params["layer1"]["weight"]}}
    with pytest.raises(ValueError, match=r"has leaf 'mu\.layer1\.bias', which the state given "
                                         r"as like= does not have \(2 such leaves\)"):
        vega.load(path, like=vega.adamw_init(smaller))


def test_other_optimizer_state_is_refused_naming_a_leaf(saved):
    path, params, _ = saved
    with pytest.raises(ValueError, match=r"has no leaf 'v\.layer1\.weight'"):
        vega.load(path, like=vega.sgd_init(params, momentum=0.9))


def test_misshaped_leaf_is_named(saved):
    path, params, _ = saved
    other = {"layer1": {**params["layer1"], "weight": torch.randn(8, 16)}}
    with pytest.raises(ValueError, match=r"leaf 'mu\.layer1\.weight' in .* has shape \(16, 8\), "
                                         r"but the state given as like= has \(8, 16\)"):
        vega.load(path, like=vega.adamw_init(other))


def test_wrong_dtype_leaf_is_named(saved, tmp_path):
    path, params, state = saved
    with pytest.raises(ValueError, match=r"leaf 'mu\.layer1\.weight' in .* has dtype "
                                         r"torch\.float32, but .* has torch\.float64"):
        vega.load(path, like=vega.adamw_init(params, state_dtype=torch.float64))
    bad_step = {**state, "step": torch.zeros((), dtype=torch.int64)}
    vega.save(tmp_path / "int64-step", bad_step)
    with pytest.raises(ValueError, match=r"leaf 'step' in .* has dtype torch\.int64, but .* "
                                         r"has torch\.int32"):
        vega.load(tmp_path / "int64-step", like=state)


def test_a_file_that_is_not_a_state_is_named(tmp_path, saved):
    _, _, state = saved
    text = tmp_path / "notes.txt"
    text.write_text("not a safetensors file at all")
    with pytest.raises(ValueError, match=r"'.*notes\.txt' is not a vega state file"):
        vega.load(text, like=state)
    from safetensors.torch import save_file
    plain = tmp_path / "weights.safetensors"
    save_file({"step": torch.zeros((), dtype=torch.int32)}, str(plain))
    with pytest.raises(ValueError, match=r"'.*weights\.safetensors' is a safetensors file but "
                                         r"not a vega state"):
        vega.load(plain, like=state)
    truncated = tmp_path / "truncated.safetensors"
    vega.save(truncated, state)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) - 40])
    with pytest.raises(ValueError, match=r"'.*truncated\.safetensors' is not a vega state file"):
        vega.load(truncated, like=state)
    with pytest.raises(FileNotFoundError, match=r"no such file '.*absent\.safetensors'"):
        vega.load(tmp_path / "absent.safetensors", like=state)


def test_a_file_whose_bytes_changed_is_refused(tmp_path):
    """A byte of a leaf's values changed on disk (the header intact, so safetensors reads
    it) is refused by the CRC-32 recorded for each leaf, not loaded as other moments or
    another step count; a file without the record (older) loads as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    params = make_params()
    state = vega.adamw_init(params)
    params, state = vega.adamw_step(params, {"layer1": {k: torch.ones_like(v) for k, v in
                                                        params["layer1"].items()}}, state)
    path = tmp_path / "opt.safetensors"
    vega.save(path, state)
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    for name in ("mu.layer1.weight", "step"):
        start = 8 + size + header[name]["data_offsets"][0]
        for byte in (0, header[name]["data_offsets"][1] - header[name]["data_offsets"][0] - 1):
            bad = bytearray(data)
            bad[start + byte] ^= 0x40
            (tmp_path / "bad.safetensors").write_bytes(bytes(bad))
            with pytest.raises(ValueError, match=rf"leaf '{re.escape(name)}' in .*bad\."
                                                 r"safetensors' does not hold the bytes vega\."
                                                 r"save wrote .*the file is corrupt"):
                vega.load(tmp_path / "bad.safetensors", like=state)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = {k: v for k, v in f.metadata().items() if k != "vega.crc32"}
    save_file(tensors, str(tmp_path / "older.safetensors"), metadata=metadata)
    loaded = vega.load(tmp_path / "older.safetensors", like=state)
    assert all(torch.equal(a, b) for a, b in zip(named(loaded).values(), named(state).values()))
    save_file(tensors, str(tmp_path / "garbled.safetensors"),
              metadata={**metadata, "vega.crc32": "{not json"})
    with pytest.raises(ValueError, match=r"garbled\.safetensors' has corrupt 'vega\.crc32'"):
        vega.load(tmp_path / "garbled.safetensors", like=state)


@pytest.mark.parametrize("key", ["vega.crc32", "vega.complex"])
@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '"mu.layer1.weight"', "7",
                                  '{"mu.layer1.weight": 1}', "[1]"])
def test_a_file_of_crafted_metadata_is_refused_by_name(tmp_path, key, text):
    """A file from elsewhere whose record of its CRC-32s or of its complex leaves is not
    the JSON object or list vega.save writes -- arrays nested past Python's stack (json
    raised RecursionError from inside the load), a string (read as a set of its letters),
    a number -- is refused as corrupt metadata, naming the file and the key."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    state = vega.adamw_init(make_params())
    path = tmp_path / "opt.safetensors"
    vega.save(path, state)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    if key == "vega.crc32" and text.startswith("{"):
        text = '{"mu.layer1.weight": 1.5}'  # (an object, but of other than ints)
    save_file(tensors, str(tmp_path / "crafted.safetensors"), metadata={**metadata, key: text})
    with pytest.raises(ValueError, match=rf"crafted\.safetensors' has corrupt "
                                         rf"'{re.escape(key)}' metadata"):
        vega.load(tmp_path / "crafted.safetensors", like=state)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_load_of_a_fifo_or_a_directory_is_refused_without_reading(tmp_path, saved):
    """A FIFO (whose open blocks until a writer comes: vega.load waited for ever) or a
    directory is named as not a regular file. A writer in a process of its own opens the
    FIFO, for 5 seconds at most, so that a load that does read it fails this test instead of
    hanging it (a thread could not: the read holds the GIL)."""
    _, _, state = saved
    fifo = tmp_path / "state.safetensors"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", "import os, signal, sys; signal.alarm(5); "
                               "os.close(os.open(sys.argv[1], os.O_WRONLY))", str(fifo)])
    try:
        with pytest.raises(ValueError, match=r"^vega\.load: '.*state\.safetensors' is a FIFO, "
                                             r"not a regular file"):
            vega.load(fifo, like=state)
    finally:
        writer.kill()
        writer.wait()
    with pytest.raises(ValueError, match=r"^vega\.load: '.*' is a directory, not a regular"):
        vega.load(tmp_path, like=state)


def test_leaf_names_must_be_unique(tmp_path):
    state = {"mu": {"a.b": torch.zeros(2), "a": {"b": torch.zeros(2)}},
             "step": torch.zeros((), dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"both named 'mu\.a\.b'"):
        vega.save(tmp_path / "s", state)
    assert not os.listdir(tmp_path)


def test_save_refuses_a_non_state(tmp_path):
    with pytest.raises(ValueError, match="a state is the dict"):
        vega.save(tmp_path / "s", [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"leaf 'lr' is a float"):
        vega.save(tmp_path / "s", {"lr": 0.1})


# -- atomic writes ----------------------------------------------------------------------

def _failing_writer(path, tensors, metadata):
    with open(path, "wb") as f:
        f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\"")  # the start of a file
    raise KeyboardInterrupt("killed in the middle of the write")


def test_interrupted_save_leaves_no_file(tmp_path, monkeypatch):
    state = vega.adamw_init(make_params())
    monkeypatch.setattr(vio, "_write", _failing_writer)
    with pytest.raises(KeyboardInterrupt):
        vega.save(tmp_path / "opt.safetensors", state)
    assert os.listdir(tmp_path) == []  # neither the target nor a temporary file


def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch):
    params = make_params()
    old = vega.adamw_init(params)
    path = tmp_path / "opt.safetensors"
    vega.save(path, old)
    before = path.read_bytes()
    _, new = vega.adamw_step(params, make_grads(0), old)
    monkeypatch.setattr(vio, "_write", _failing_writer)
    with pytest.raises(KeyboardInterrupt):
        vega.save(path, new)
    assert os.listdir(tmp_path) == ["opt.safetensors"]
    assert path.read_bytes() == before
    monkeypatch.undo()
    assert_same_bits(vega.load(path, like=old), old)
    vega.save(path, new)  # and a save that completes replaces it
    assert int(vega.load(path, like=old)["step"]) == 1


def test_save_fsyncs_before_renaming(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(vio.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd)))
    monkeypatch.setattr(vio.os, "replace",
                        lambda a, b: (events.append("replace"), real_replace(a, b)))
    vega.save(tmp_path / "s", vega.adamw_init(make_params()))
    assert events[:2] == ["fsync", "replace"]


def test_saved_file_has_ordinary_permissions(tmp_path):
    path = tmp_path / "s"
    vega.save(path, vega.adamw_init(make_params()))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_saving_over_a_file_keeps_its_permissions(tmp_path):
    """A file saved over keeps the permissions it had (the rename puts a new file in its
    place, made with the umask's)."""
    path = tmp_path / "s"
    path.write_bytes(b"")
    os.chmod(path, 0o640)
    vega.save(path, vega.adamw_init(make_params()))
    assert path.stat().st_mode & 0o777 == 0o640


# -- get_leaf / set_leaf ----------------------------------------------------------------

def test_get_leaf_and_suggestions():
    state = vega.adamw_init(make_params())
    assert vega.get_leaf(state, "mu.layer1.weight") is state["mu"]["layer1"]["weight"]
    assert vega.get_leaf(state, "step") is state["step"]
    with pytest.raises(ValueError, match=r"no leaf 'mu\.layer1\.weigth'; did you mean "
                                         r"'mu\.layer1\.weight'\?"):
        vega.get_leaf(state, "mu.layer1.weigth")
    with pytest.raises(ValueError, match=r"no leaf 'momentum'.*leaves are 'mu\.layer1\.weight'"):
        vega.get_leaf(state, "momentum")


def test_set_leaf_is_pure_and_checked():
    state = vega.adamw_init(make_params())
    before = pytree.tree_map(torch.clone, state)
    value = torch.full((16, 8), 0.5)
    new = vega.set_leaf(state, "nu.layer1.weight", value)
    assert new is not state and new["nu"] is not state["nu"]
    assert new["nu"]["layer1"]["weight"] is value
    assert new["mu"]["layer1"]["weight"] is state["mu"]["layer1"]["weight"]
    assert_same_bits(state, before)  # the given state is untouched
    assert int(vega.set_leaf(state, "step", 7)["step"]) == 7
    assert vega.set_leaf(state, "step", 7)["step"].dtype == torch.int32
    with pytest.raises(ValueError, match=r"leaf 'nu\.layer1\.weight' is torch\.float32 of shape "
                                         r"\(16, 8\); the value given is torch\.float32 of shape "
                                         r"\(8, 16\)"):
        vega.set_leaf(state, "nu.layer1.weight", torch.zeros(8, 16))
    with pytest.raises(ValueError, match=r"leaf 'step' is torch\.int32 of shape \(\); the value "
                                         r"given is torch\.int64"):
        vega.set_leaf(state, "step", torch.tensor(3))
    with pytest.raises(ValueError, match=r"leaf 'step' is torch\.int32; 2\.5 does not fit"):
        vega.set_leaf(state, "step", 2.5)
    with pytest.raises(ValueError, match=r"leaf 'step' is torch\.int32; 4294967296 does not fit"):
        vega.set_leaf(state, "step", 2**32)
    with pytest.raises(ValueError, match=r"no leaf 'nu\.layer1\.bais'; did you mean "
                                         r"'nu\.layer1\.bias'"):
        vega.set_leaf(state, "nu.layer1.bais", torch.zeros(8))
    with pytest.raises(ValueError, match=r"value for leaf 'nu\.layer1\.bias' must be a tensor"):
        vega.set_leaf(state, "nu.layer1.bias", [0.0] * 8)
    with pytest.raises(ValueError, match=r"value for leaf 'nu\.layer1\.bias' is sparse "
                                         r"\(torch\.sparse_coo\); a state holds dense"):
        vega.set_leaf(state, "nu.layer1.bias", torch.zeros(8).to_sparse())
    import warnings
    with warnings.catch_warnings():  # (torch's prototype note on nested tensors)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(8)])
    with pytest.raises(ValueError, match=r"value for leaf 'nu\.layer1\.bias' is a nested "
                                         r"tensor"):
        vega.set_leaf(state, "nu.layer1.bias", nested)
    assert_same_bits(state, before)


def test_set_leaf_then_step_uses_the_new_value():
    params = make_params()
    state = vega.sgd_init(params, momentum=0.9)
    velocity = torch.ones(16, 8)
    moved = vega.set_leaf(state, "v.layer1.weight", velocity)
    p_new, _ = vega.sgd_step(params, make_grads(0), moved, lr=0.1, momentum=0.9)
    grad = make_grads(0)["layer1"]["weight"]
    expected = params["layer1"]["weight"] - 0.1 * (0.9 * velocity + grad)
    torch.testing.assert_close(p_new["layer1"]["weight"], expected)


# -- torch.optim-style state_dict checkpoints ------------------------------------------

CLASSES = [vega.builtin(n).optimizer_class for n in SPECS]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _assert_same_optimizer_state(opt_a, model_a, opt_b, model_b):
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(bits(p), bits(q)), f"param {name}"
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys(), name
        assert sb["step"].dtype == torch.int32 and sb["step"].dim() == 0
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, f"{name} {key}"
            assert torch.equal(bits(sa[key]), bits(sb[key])), f"{name}: state {key!r}"


def _continue_both(model_a, opt_a, model_b, opt_b):
    _train(model_a, opt_a, 3, seed=7)
    _train(model_b, opt_b, 3, seed=7)
    _assert_same_optimizer_state(opt_a, model_a, opt_b, model_b)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_state_dict_through_torch_save(tmp_path, cls):
    model = _model()
    opt = cls(model.parameters(), lr=1e-2)
    _train(model, opt, 4, seed=1)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = cls(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", map_location="cpu"))
    _assert_same_optimizer_state(opt, model, opt2, model2)
    assert all(int(opt2.state[p]["step"]) == 4 for p in model2.parameters())
    _continue_both(model, opt, model2, opt2)


def test_state_dict_keeps_per_group_settings_through_torch_save(tmp_path):
    model = _model()
    params = list(model.parameters())
    opt = vega.optim.AdamW([{"params": params[:2], "lr": 1e-2, "state_dtype": torch.float64},
                            {"params": params[2:], "lr": 3e-3, "weight_decay": 0.1}])
    _train(model, opt, 2, seed=1)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    params2 = list(model2.parameters())
    opt2 = vega.optim.AdamW([{"params": params2[:2], "state_dtype": torch.float64},
                             {"params": params2[2:]}])
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", map_location="cpu"))
    assert [g["lr"] for g in opt2.param_groups] == [1e-2, 3e-3]
    assert opt2.param_groups[1]["weight_decay"] == 0.1
    assert opt2.state[params2[0]]["mu"].dtype == torch.float64
    _assert_same_optimizer_state(opt, model, opt2, model2)
    _continue_both(model, opt, model2, opt2)


@pytest.mark.parametrize("name,state", [("sgd", "v"), ("adamw", "nu"), ("adafactor", "v_row"),
                                        ("adamw", "step")])
def test_load_state_dict_refuses_a_misshaped_state_and_changes_nothing(name, state):
    """torch's load_state_dict takes any tensor; a kernel would read and write past a
    smaller one. The optimizer keeps its state, settings and tensors."""
    import copy
    model = _model()
    extra = {"sgd": {"momentum": 0.9}, "adafactor": {"min_dim_size_to_factor": 4.0}}
    opt = vega.builtin(name).optimizer(model.parameters(), lr=1e-2, **extra.get(name, {}))
    _train(model, opt, 2, seed=1)
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    sd["state"][0][state] = torch.zeros(3)
    sd["param_groups"][0]["lr"] = 5.0
    with pytest.raises(ValueError, match=rf"load_state_dict: state '{state}' of parameter 0 of "
                                         r"group 0 has shape \(3,\), but (a step counter is 0-d"
                                         r"|the parameter, of shape \(16, 8\), needs "
                                         r"\(\d+(, \d+)?,?\))$"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][k][key], value), (k, key)
    _train(model, opt, 1, seed=2)  # and it still steps


@needs_c
@pytest.mark.parametrize("backend", ["reference", "c"])
def test_step_refuses_a_state_replaced_by_a_misshaped_one(backend):
    p = torch.nn.Parameter(torch.randn(1000))
    opt = vega.optim.SGD([p], lr=0.1, momentum=0.9, backend=backend)
    p.grad = torch.randn(1000)
    opt.step()
    opt.state[p]["v"] = torch.zeros(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=rf"SGD: parameter 0 of group 0: backend '{backend}': "
                                         r"state 'v' has shape \(3,\), but its parameter, of "
                                         r"shape \(1000,\), needs \(1000,\)"):
        opt.step()
    assert torch.equal(p.detach(), before)


SINGLE_PROCESS = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")


@SINGLE_PROCESS
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_state_dict_through_distributed_checkpoint(tmp_path, cls):
    """torch.distributed.checkpoint, the FSDP2 way (get/set_state_dict), without a process
    group: on one process dcp.save and dcp.load run without initializing one."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    model = _model()
    opt = cls(model.parameters(), lr=1e-2)
    _train(model, opt, 4, seed=1)
    dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "ckpt"))
    assert not dist.is_initialized()

    model2 = _model(seed=3)  # other weights: the checkpoint brings them
    opt2 = cls(model2.parameters(), lr=1e-2)
    # get_optimizer_state_dict initializes opt2's state (a step at lr 0 on zero gradients)
    target = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    model2.load_state_dict(target["model"])
    set_optimizer_state_dict(model2, opt2, target["optim"])
    assert not dist.is_initialized()
    _assert_same_optimizer_state(opt, model, opt2, model2)
    assert all(int(opt2.state[p]["step"]) == 4 for p in model2.parameters())
    _continue_both(model, opt, model2, opt2)


@SINGLE_PROCESS
def test_distributed_checkpoint_of_the_plain_state_dict(tmp_path):
    """dcp on opt.state_dict() itself (integer parameter ids), loaded in place into a
    state_dict of the same shape."""
    import torch.distributed.checkpoint as dcp
    model = _model()
    opt = vega.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = vega.optim.Adam(model2.parameters(), lr=1e-2)
    _train(model2, opt2, 1, seed=99)  # any state of the right shapes to load into
    model2.load_state_dict(model.state_dict())
    target = {"optim": opt2.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    opt2.load_state_dict(target["optim"])
    _assert_same_optimizer_state(opt, model, opt2, model2)
    assert all(opt2.state[p]["step"].dtype == torch.int32 and int(opt2.state[p]["step"]) == 3
               for p in model2.parameters())
    _continue_both(model, opt, model2, opt2)



def test_save_into_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no directory '.*nowhere'"):
        vega.save(tmp_path / "nowhere" / "s.safetensors", vega.adamw_init(make_params()))


def test_save_to_a_directory_names_it_and_leaves_it_as_it_was(tmp_path):
    """``vega.save`` of a path that is a directory says so, and leaves no temporary file
    there (the rename over the directory failed, naming the temporary file)."""
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match=r"^vega.save: '.*d' is a directory; vega.save "
                                                r"writes one file"):
        vega.save(tmp_path / "d", vega.adamw_init(make_params()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert list((tmp_path / "d").iterdir()) == []


def test_like_is_a_keyword(saved):
    path, _, state = saved
    with pytest.raises(TypeError):
        vega.load(path, state)


def test_a_field_of_a_key_that_is_no_string_is_named_as_its_leaves_are(tmp_path):
    """A field whose key is not a string and whose value is one tensor is named by the key's
    text, as the leaves under such keys are: state_names gave the int itself, and save
    stopped on an internal check ('leaf names disagree')."""
    state = {1: torch.ones(2), "a": {2: torch.zeros(3)}, "step": torch.zeros((), dtype=torch.int32)}
    assert vega.state_names(state) == ["1", "a.2", "step"]
    vega.save(tmp_path / "s.safetensors", state)
    back = vega.load(tmp_path / "s.safetensors", like=state)
    assert torch.equal(back[1], state[1]) and torch.equal(back["a"][2], state["a"][2])
    assert torch.equal(vega.get_leaf(state, "1"), state[1])


@pytest.mark.parametrize("stored", [torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.int32)],
                         ids=["last dim 3", "int32 pairs"])
def test_a_leaf_marked_complex_that_is_no_real_view_is_refused(tmp_path, stored):
    """A leaf the metadata marks complex is a real view (a trailing dimension of 2, a float
    dtype): one that is not is named, not viewed as complex deep inside the load."""
    from safetensors.torch import save_file
    like = {"mu": {"z": torch.zeros(4, dtype=torch.complex64)}}
    path = tmp_path / "marked.safetensors"
    save_file({"mu.z": stored}, str(path),
              metadata={"vega": vio.FORMAT, "vega.version": vio.FORMAT_VERSION,
                        "vega.complex": json.dumps(["mu.z"])})
    with pytest.raises(ValueError, match=r"leaf 'mu\.z' in .*marked\.safetensors' is marked "
                                         r"complex but is torch\."):
        vega.load(path, like=like)


def test_a_conjugate_view_leaf_is_saved_as_its_values(tmp_path):
    """A complex leaf that is a conjugate view (``z.conj()``, which ``view_as_real``
    refuses) is saved as the values it shows, and loads as them."""
    z = torch.tensor([1 + 2j, -3 - 0.5j], dtype=torch.complex64)
    state = {"mu": {"z": z.conj()}, "step": torch.tensor(2, dtype=torch.int32)}
    vega.save(tmp_path / "c.safetensors", state)
    back = vega.load(tmp_path / "c.safetensors", like=state)
    assert not back["mu"]["z"].is_conj()
    assert torch.equal(back["mu"]["z"], z.conj().resolve_conj())


def test_set_leaf_refuses_a_value_on_another_device():
    state = vega.adamw_init(make_params())
    with pytest.raises(ValueError, match=r"leaf 'mu\.layer1\.weight' is on cpu; the value "
                                         r"given is on meta"):
        vega.set_leaf(state, "mu.layer1.weight",
                      torch.zeros_like(state["mu"]["layer1"]["weight"], device="meta"))


def test_set_leaf_refuses_a_bool_for_an_integer_counter():
    """True is an int to Python, but no step count: ``set_leaf(state, "step", True)`` is
    refused as for a float leaf."""
    state = vega.adamw_init(make_params())
    with pytest.raises(ValueError, match=r"leaf 'step' is torch.int32; True does not fit it"):
        vega.set_leaf(state, "step", True)


def test_load_refuses_a_state_of_another_format_version(tmp_path):
    from safetensors.torch import save_file
    like = {"step": torch.zeros((), dtype=torch.int32)}
    path = tmp_path / "v2.safetensors"
    save_file({"step": torch.ones((), dtype=torch.int32)}, str(path),
              metadata={"vega": vio.FORMAT, "vega.version": "2", "vega.complex": "[]"})
    with pytest.raises(ValueError, match=r"v2\.safetensors' is a vega state of format version "
                                         r"'2'; this vega reads version '1'"):
        vega.load(path, like=like)


def _rewritten(src, dst, **changes) -> None:
    """The state file ``src`` written again at ``dst`` with its metadata changed (a value
    of None removes the key), as a vega that wrote other metadata would have written it."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata())
    for k, v in changes.items():
        metadata.pop(k, None) if v is None else metadata.__setitem__(k, v)
    save_file(tensors, str(dst), metadata=metadata)


def test_8bit_codes_written_under_other_maps_are_refused(tmp_path):
    """A state file records the version of the maps its 8-bit codes are read with
    (quant.MAPS): codes of a file written under other maps, or by a vega that did not
    record them, are refused, where they were read with this vega's map, as other values
    (AdamW's nu, written in the square-root map before the fourth-root map came, read as
    values that made the next steps hundreds of times too long). A file of float state
    without the record loads: its values mean what they meant."""
    params = {"w": torch.randn(64, 128), "b": torch.randn(16)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    state = vega.adamw_init(params, state_dtype=torch.uint8)
    _, state = vega.adamw_step(params, grads, state, lr=1e-2)
    vega.save(tmp_path / "q8.safetensors", state)
    loaded = vega.load(tmp_path / "q8.safetensors", like=state)
    assert torch.equal(loaded["nu"]["w"], state["nu"]["w"])
    for value, written in ((None, "did not record which maps"), ("2", "maps version '2'")):
        _rewritten(tmp_path / "q8.safetensors", tmp_path / "old.safetensors",
                   **{"vega.q8_maps": value})
        with pytest.raises(ValueError, match=rf"old\.safetensors' holds 8-bit codes \(leaf "
                                             rf"'mu\.w'\) written under .*{written}"):
            vega.load(tmp_path / "old.safetensors", like=state)
    floats = vega.adamw_init(params)
    vega.save(tmp_path / "f.safetensors", floats)
    _rewritten(tmp_path / "f.safetensors", tmp_path / "old.safetensors",
               **{"vega.q8_maps": None})
    assert torch.equal(vega.load(tmp_path / "old.safetensors", like=floats)["step"],
                       floats["step"])


def test_leaves_that_share_memory_are_saved_as_their_own_values(tmp_path):
    """Two leaves that are one tensor, and views of part of a larger one (safetensors refuses
    tensors that share memory, and would store a view's whole storage): each saved as its own
    values and loaded as a tensor of its own."""
    big, one = torch.arange(10.0), torch.arange(4.0)
    state = {"a": {"x": big[2:5], "y": big[2:5]}, "b": big, "c": {"x": one, "y": one},
             "step": torch.tensor(3, dtype=torch.int32)}
    path = tmp_path / "s.safetensors"
    vega.save(path, state)
    like = {"a": {"x": torch.zeros(3), "y": torch.zeros(3)}, "b": torch.zeros(10),
            "c": {"x": torch.zeros(4), "y": torch.zeros(4)},
            "step": torch.zeros((), dtype=torch.int32)}
    out = vega.load(path, like=like)
    assert out["a"]["x"].tolist() == out["a"]["y"].tolist() == [2.0, 3.0, 4.0]
    assert torch.equal(out["b"], big) and int(out["step"]) == 3
    assert torch.equal(out["c"]["x"], one) and torch.equal(out["c"]["y"], one)
    assert out["a"]["x"].data_ptr() != out["a"]["y"].data_ptr()
    assert out["c"]["x"].data_ptr() != out["c"]["y"].data_ptr()


def test_a_like_leaf_that_is_no_tensor_and_a_name_that_is_no_string_are_named(saved):
    path, _, state = saved
    with pytest.raises(ValueError, match=r"^vega.load: like= leaf 'step' is a int, not a "
                                         r"tensor$"):
        vega.load(path, like={**state, "step": 3})
    with pytest.raises(ValueError, match=r"^vega.get_leaf: a leaf name is a string such as "
                                         r"'step', got 3$"):
        vega.get_leaf(state, 3)
    with pytest.raises(TypeError, match=r"^vega.state_names: a state is the dict of fields "
                                        r"that <name>_init returns, got list$"):
        vega.state_names([state])


@pytest.mark.parametrize("make,count,kinds", [
    (lambda: vega.LossScale.dynamic(8.0), -1, "static loss scale, but the scale there is "
                                              "dynamic"),
    (lambda: vega.LossScale.static(8.0), 5, "dynamic loss scale, but the scale there is "
                                            "static")])
def test_set_leaf_refuses_a_good_step_count_of_the_other_kind_of_scale(tmp_path, make, count,
                                                                        kinds):
    """A static scale's good_steps is -1 and a dynamic one's counts from 0: set to the other
    kind's, the state was taken, saved, and then refused by vega.load (which read the file's
    count as a scale of the other kind), as the constructor refuses it."""
    state = {"w": torch.ones(2), "ls": make()}
    with pytest.raises(ValueError, match=rf"^vega.set_leaf: leaf 'ls.good_steps' would be "
                                         rf"{count}, the count of a {kinds}"):
        vega.set_leaf(state, "ls.good_steps", count)
    good = vega.set_leaf(state, "ls.good_steps", 3 if count == -1 else -1)
    path = tmp_path / "s.safetensors"
    vega.save(path, good)
    assert int(vega.load(path, like=good)["ls"].good_steps) == (3 if count == -1 else -1)
