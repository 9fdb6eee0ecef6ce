"""Whole objects copied (copy.copy, copy.deepcopy) and pickled: compiled specs, and the
optimizers of specs compiled by the caller."""
import copy
import io
import pickle
import re

import pytest
import torch

import vega
from vega.runtime.library import builtin


def _mine():
    """The shipped sgd's text under another rule name (its class keeps the name SGD)."""
    return builtin("sgd").source_text.replace("optimizer sgd as", "optimizer mysgd as", 1)


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def _torch_saved(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_used_spec_copies_as_itself_and_pickles_by_its_text(backend):
    """A spec that has stepped holds its kernels (loaded libraries, ctypes pointers): a copy
    of it, or of anything that holds it, is the spec itself, where copy.deepcopy failed
    ("ctypes objects containing pointers cannot be pickled"); pickled, it is compiled again
    from its text (a shipped one is the process's own), where pickle failed on a function of
    its kernels."""
    spec = vega.compile(_mine(), "mine.vega")
    params = [torch.ones(3)]
    state = spec.init(params)
    spec.step(params, [torch.ones(3)], state, backend=backend, lr=0.1, momentum=0.9)
    assert copy.copy(spec) is spec and copy.deepcopy(spec) is spec
    held = copy.deepcopy({"rule": spec, "lr": 0.1})
    assert held["rule"] is spec
    for back in (_pickled(spec), _torch_saved(spec)):
        assert back.name == "mysgd" and back.source_text == spec.source_text
        assert back._spec.filename == "mine.vega"
        ours = spec.step(params, [torch.ones(3)], state, backend=backend, lr=0.1,
                         momentum=0.9)
        theirs = back.step(params, [torch.ones(3)], state, backend=backend, lr=0.1,
                           momentum=0.9)
        assert torch.equal(ours[0][0], theirs[0][0]) and torch.equal(ours[1]["v"][0],
                                                                    theirs[1]["v"][0])
    shipped = builtin("sgd")
    shipped.step(params, [torch.ones(3)], shipped.init(params), backend=backend)
    assert _pickled(shipped) is shipped and copy.deepcopy(shipped) is shipped


@pytest.mark.parametrize("how", [_pickled, _torch_saved, copy.deepcopy])
def test_an_optimizer_of_a_compiled_spec_pickles(how):
    """Its class, made for the caller's spec, has the name of a shipped class (SGD) in
    vega.optim, or of none: pickled by that name it failed ("not the same object as
    vega.optim.SGD", or "attribute lookup ... failed"); it is pickled by its spec, and the
    unpickled optimizer steps as the original, on parameters of its own."""
    spec = vega.compile(_mine())
    w = torch.nn.Parameter(torch.ones(4))
    opt = spec.optimizer([w], lr=0.1, momentum=0.9)
    w.grad = torch.full((4,), 0.5)
    opt.step()
    twin = how(opt)
    assert type(twin).spec.name == "mysgd"
    assert type(twin).__name__ == "SGD" and type(twin) is not vega.optim.SGD
    w2 = twin.param_groups[0]["params"][0]
    assert w2 is not w and torch.equal(w2, w)
    for o, p in ((opt, w), (twin, w2)):
        p.grad = torch.full((4,), 0.25)
        o.step()
    assert torch.equal(w2, w)
    assert torch.equal(twin.state[w2]["v"], opt.state[w]["v"])
    assert twin.state[w2]["v"].data_ptr() != opt.state[w]["v"].data_ptr()


def test_a_spec_of_its_own_under_a_shipped_name_pickles_as_itself():
    """A caller's spec named as a shipped one (sgd) is not the shipped one: pickled, it is
    compiled again from its own text (taken for the shipped spec, it came back as vega's
    sgd, another rule)."""
    mine = vega.compile("optimizer sgd(lr = 0.5) {\n  p = p - 2 * lr * g\n}\n", "own.vega")
    back = _pickled(mine)
    assert back is not builtin("sgd") and back.source_text == mine.source_text
    assert back.defaults == {"lr": 0.5} and back._spec.filename == "own.vega"


def test_a_spec_pickled_by_its_attributes_is_compiled_again_from_its_text(monkeypatch):
    """A compiled spec pickled by its attributes, as a vega before specs pickled by their
    text wrote it (its parse without the attributes this vega's has: no ``flag_states``),
    unpickles compiled again from its text: it kept the old parse, and its class's first
    step failed on the missing attribute."""
    from vega.runtime.spec import CompiledSpec
    spec = vega.compile(_mine())
    old = copy.copy(spec._spec)
    del old.__dict__["flag_states"]
    made = CompiledSpec.__new__(CompiledSpec)
    made.__dict__.update({**spec.__dict__, "_spec": old})
    with monkeypatch.context() as m:
        m.setattr(CompiledSpec, "__reduce__", object.__reduce__)
        data = pickle.dumps(made)
    back = pickle.loads(data)
    assert back._spec.flag_states == spec._spec.flag_states and back.name == spec.name
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    for p, opt in zip(ps, (back.optimizer([ps[0]], lr=0.1), spec.optimizer([ps[1]], lr=0.1))):
        p.grad = torch.full((3,), 2.0)
        opt.step()
    assert torch.equal(ps[0], ps[1])


def test_an_optimizer_pickled_before_later_settings_steps_as_the_original(monkeypatch):
    """An optimizer pickled by a vega whose groups held no maximize nor precision settings,
    with a loss scale pickled without device_given, unpickles taking their defaults (as
    load_state_dict takes a group's) and steps as the original; its step failed on the
    missing keys and attribute. A group without a hyperparameter the rule reads (SGD's
    dampening, which an older SGD had not) is refused naming it."""
    from vega.runtime import torch_names
    from vega.runtime.loss_scale import LossScale
    from vega.runtime.optimizer import SpecOptimizer
    mine = SpecOptimizer.__getstate__
    later = {"maximize", *torch_names.PRECISION_DEFAULTS}

    def old(self, drop=()):
        state = mine(self)
        return {**state, "param_groups": [{k: v for k, v in g.items()
                                           if k not in later and k not in drop}
                                          for g in state["param_groups"]]}
    for cls, kwargs, drop in ((vega.optim.AdamW, {"loss_scale": LossScale.dynamic()}, ()),
                              (vega.optim.SGD, {"momentum": 0.9}, ("dampening",))):
        p = torch.nn.Parameter(torch.ones(5))
        opt = cls([p], lr=0.1, **kwargs)
        p.grad = torch.full((5,), 2.0)
        opt.step()
        with monkeypatch.context() as m:
            m.setattr(SpecOptimizer, "__getstate__", lambda self, drop=drop: old(self, drop))
            m.setattr(LossScale, "__getstate__", lambda self: (None, {
                k: getattr(self, k) for k in LossScale.__slots__ if k != "device_given"}),
                raising=False)
            data = pickle.dumps((p, opt))
        if drop:
            with pytest.raises(ValueError, match=r"^SGD: group 0 of the pickled optimizer has "
                                                 r"no 'dampening': it was pickled by a vega"):
                pickle.loads(data)
            continue
        q, twin = pickle.loads(data)
        assert twin.loss_scale.device_given and twin.param_groups[0]["maximize"] is False
        for o, x in ((opt, p), (twin, q)):
            x.grad = torch.full((5,), 3.0) * o.loss_scale.loss_scale
            o.step()
        assert torch.equal(p, q)


def test_a_pickled_loss_scale_is_checked_as_the_constructor_checks_it():
    """A LossScale read back from a pickle (a file from elsewhere; torch.load with the class
    among its safe globals) holds values a scale can take, as the constructor and the state
    loads check: one of scale -4 stepped every parameter uphill (the unscaled gradient's
    sign flipped), one without its settings failed on a missing attribute in the step."""
    from vega.runtime.loss_scale import LossScale
    good = LossScale.dynamic()
    back = _pickled(good)
    assert back.is_dynamic and float(back.loss_scale) == float(good.loss_scale)
    for slot, value, words in (("loss_scale", torch.tensor(-4.0), "'loss_scale' is -4.0"),
                               ("loss_scale", torch.tensor(float("nan")), "'loss_scale' is nan"),
                               ("min_scale", torch.tensor(2.0**20), "'min_scale' is 1048576.0"),
                               ("growth_factor", 0.5, "growth_factor=0.5 must be above 1")):
        bad = copy.copy(good)
        object.__setattr__(bad, slot, value)
        with pytest.raises(ValueError, match=re.escape(words)):
            _pickled(bad)
    state = good.__getstate__()
    del state[1]["growth_interval"]
    made = LossScale.__new__(LossScale)
    with pytest.raises(ValueError, match="a pickled LossScale has no growth_interval"):
        made.__setstate__(state)
