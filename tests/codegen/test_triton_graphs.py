"""What a CUDA graph that captured a step needs of the Triton backend, by its mechanisms (no
GPU here): nothing it uses freed or reallocated while it lives, nothing allocated pinned while
it is captured, the loss scale and the counters updated in place, the loss scale on the
parameters' device."""
import pytest
import torch

import vega
from vega.codegen import triton_runtime as tr


def test_a_kept_object_a_capture_used_is_never_dropped():
    kept, made = tr.Kept(limit=2), []

    def make(k):
        return lambda: made.append(k) or f"map {k}"
    assert kept.get("a", make("a"), capturing=False) == "map a"
    assert kept.get("a", make("a"), capturing=True) == "map a"  # the capture uses it: held
    for k in "bcdefg":  # far past the limit
        kept.get(k, make(k), capturing=False)
    assert kept.get("a", make("a"), capturing=False) == "map a" and made.count("a") == 1
    assert list(kept.items) == ["f", "g"]  # the others: least recently used first out
    assert kept.get("b", make("b"), capturing=False) == "map b" and made.count("b") == 2
    kept.get("g", make("g"), capturing=False)  # a hit: now the most recently used
    kept.get("h", make("h"), capturing=False)
    assert list(kept.items) == ["g", "h"] and made.count("g") == 1


def test_block_maps_a_capture_used_outlive_the_cache(monkeypatch):
    monkeypatch.setattr(tr, "_MAPS", tr.Kept(limit=4))
    cpu = torch.device("cpu")
    first = tr.block_map((10, 20), 8, cpu)
    monkeypatch.setattr(tr, "_capturing", lambda device: True)
    assert tr.block_map((10, 20), 8, cpu) is first  # used by the capture
    monkeypatch.setattr(tr, "_capturing", lambda device: False)
    for n in range(1, 100):
        tr.block_map((n,), 8, cpu)
    assert tr.block_map((10, 20), 8, cpu) is first
    assert first.start.tolist() == [0, 8, 0, 8, 16] and first.tensor.tolist() == [0, 0, 1, 1, 1]


def test_a_capture_takes_tables_from_staged_pinned_memory(monkeypatch):
    """While capturing, a table is copied through memory pinned before: pin_memory is never
    called; each piece is the capture's for good; used up, a clear error."""
    staging = tr.Staging(64, pin=False)
    monkeypatch.setattr(tr, "_STAGING", [staging])

    def refuse(*args, **kwargs):
        raise AssertionError("pinned memory allocated during a capture")
    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    a = torch.arange(3, dtype=torch.int64)
    dev, pinned = tr._staged_copy(a, torch.device("cpu"), capturing=True)
    assert torch.equal(dev, a) and pinned.data_ptr() == staging.buffer.data_ptr()
    b = torch.arange(4, dtype=torch.int32)
    dev_b, pinned_b = tr._staged_copy(b, torch.device("cpu"), capturing=True)
    assert pinned_b.data_ptr() == staging.buffer.data_ptr() + 32  # 16-byte aligned, after a
    assert torch.equal(dev_b, b) and torch.equal(pinned, a)  # (a's piece is untouched)
    with pytest.raises(RuntimeError, match="run the step once eagerly"):
        tr._staged_copy(torch.zeros(8, dtype=torch.int64), torch.device("cpu"), capturing=True)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_class_adjusts_its_loss_scale_in_place(backend):
    """The same LossScale and the same tensors, step after step (a graph replays them), with
    the values a fresh adjust gives; the step counters too."""
    w = torch.nn.Parameter(torch.randn(50))
    ls = vega.LossScale.dynamic(init=2.0**4, growth_interval=2)
    tensors = [t.data_ptr() for t in ls.tensors()]
    opt = vega.optim.AdamW([w], lr=1e-3, backend=backend, loss_scale=ls)
    expect = vega.LossScale.dynamic(init=2.0**4, growth_interval=2)
    counter = None
    for bad in (False, False, True, False):
        w.grad = torch.full_like(w, float("nan") if bad else 1.0)
        opt.step()
        expect = expect.adjust(torch.tensor(not bad))
        step = opt.state[w]["step"]
        if backend == "triton" and counter is not None:
            assert step.data_ptr() == counter
        counter = step.data_ptr()
    assert opt.loss_scale is ls and [t.data_ptr() for t in ls.tensors()] == tensors
    for mine, theirs in zip(ls.tensors(), expect.tensors()):
        assert torch.equal(mine, theirs)
    assert ls.loss_scale.item() == 2.0**4 and ls.skipped_steps.item() == 1  # grew, backed off


class _Elsewhere(torch.nn.Parameter):
    """A parameter that says it is on a GPU (this machine has none to put one on)."""
    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_loss_scale_made_without_a_device_lives_with_the_parameters(monkeypatch):
    moved = []
    monkeypatch.setattr(vega.LossScale, "to_", lambda self, device: moved.append(device))
    ls = vega.LossScale.dynamic()
    assert not ls.device_given and ls.loss_scale.device.type == "cpu"
    vega.optim.AdamW([_Elsewhere(torch.empty(3))], loss_scale=ls)
    assert moved == [torch.device("cuda", 0)]  # made so: moved where the parameters are
    told = vega.LossScale.static(8.0, device="cpu")
    vega.optim.AdamW([_Elsewhere(torch.empty(3))], loss_scale=told)
    assert moved == [torch.device("cuda", 0)]  # told otherwise: kept there
    # (parameters on the meta device, a model to be made by to_empty: the scale stays with
    # its values, to go where the parameters are at the first step)
    vega.optim.AdamW([torch.nn.Parameter(torch.empty(3, device="meta"))],
                     loss_scale=vega.LossScale.dynamic())
    assert moved == [torch.device("cuda", 0)]


def test_each_captured_prelude_counts_its_programs_on_a_counter_of_its_own(monkeypatch):
    """The prelude's last program is the one whose count of finished programs reaches their
    number. Eager steps on one stream share its counter (their launches run one after
    another); every graph captured on one stream shared one too, where torch.cuda.graph's
    default capture stream serves every capture: two such graphs replayed at once on two
    streams would count each other's programs, one combining partial sums not yet written,
    the other never finding its last program (its record left unwritten, the counter left
    past 0 for every later launch). A captured prelude takes a counter of its own, held with
    its graph and zeroed by it."""
    counters = []

    def record(fn, grid, *args, **meta):  # (the kernels not run: their counters noted)
        if getattr(fn, "fn", fn).__name__.endswith("_prelude"):
            counters.append(args[6])
    monkeypatch.setattr(tr, "launch", record)
    params = {"w": torch.randn(100), "b": torch.randn(7)}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = vega.adamw_init(params)

    def step():
        vega.adamw_step(params, grads, state, lr=1e-3, backend="triton", donate=True,
                        max_grad_norm=1.0, skip_nonfinite=True)
    step()
    step()
    monkeypatch.setattr(tr, "_capturing", lambda device: True)
    step()  # two captures on one stream
    step()
    monkeypatch.setattr(tr, "_capturing", lambda device: False)
    step()
    eager, again, first, second, later = counters
    assert eager is again is later
    assert len({id(eager), id(first), id(second)}) == 3
    assert all(c.dtype == torch.int32 and c.tolist() == [0] for c in counters)


def test_a_kept_object_dropped_by_another_thread_meanwhile_is_given():
    """A hit that another thread drops between the lookup and the move to the most recently
    used end (its own object made past the limit: forced here by the lookup itself) gives the
    object found, where it raised KeyError out of the step."""
    from collections import OrderedDict

    class Dropping(OrderedDict):
        def get(self, key, default=None):
            found = super().get(key, default)
            self.pop(key, None)  # (the other thread, at this moment)
            return found
    kept = tr.Kept(limit=2)
    kept.items = Dropping(a="map a")
    assert kept.get("a", lambda: "made", capturing=False) == "map a"
