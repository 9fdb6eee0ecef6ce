"""vega's own warnings: each names the caller's line (not a line inside vega or torch), so
that a filter on the caller's module holds it and the default filter shows it once there."""
import copy
import warnings

import pytest
import torch

import vega
from vega import LossScale

U8 = torch.uint8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


def _stepped(opt, model):
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return opt


def _quantized_load():
    model = _model()
    theirs = _stepped(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), model)
    ours = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    return lambda: ours.load_state_dict(theirs.state_dict())


def _dequantized_load():
    model = _model()
    ours = _stepped(vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8), model)
    floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    return lambda: floats.load_state_dict(ours.state_dict())


def _scale_not_loaded():
    model = _model()
    scaled = vega.optim.AdamW(model.parameters(), lr=1e-2,
                              loss_scale=LossScale.dynamic(init=64.0))
    other = vega.optim.AdamW(model.parameters(), lr=1e-2)
    return lambda: other.load_state_dict(copy.deepcopy(scaled.state_dict()))


def _scale_of_another_kind():
    model = _model()
    scaled = vega.optim.AdamW(model.parameters(), lr=1e-2,
                              loss_scale=LossScale.dynamic(init=64.0))
    other = vega.optim.AdamW(model.parameters(), lr=1e-2, loss_scale=LossScale.static(8.0))
    return lambda: other.load_state_dict(copy.deepcopy(scaled.state_dict()))


def _betas_disagree():
    opt = vega.optim.AdamW(_model().parameters(), lr=1e-2)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["b1"] = 0.5
    return lambda: opt.load_state_dict(saved)


def _torch_state_dict_8bit():
    model = _model()
    opt = _stepped(vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8), model)
    return opt.torch_state_dict


def _torch_state_dict_masters():
    p = torch.nn.Parameter(torch.randn(6, 4).to(torch.bfloat16))
    opt = vega.optim.AdamW([p], lr=1e-2, master_weights=True)
    p.grad = torch.randn(6, 4).to(torch.bfloat16)
    opt.step()
    return opt.torch_state_dict


def _group_holds_the_scale():
    """The group's warning comes from add_param_group, which torch's Optimizer.__init__
    calls: the frames between it and the caller are vega's and torch's."""
    scale = LossScale.static(8.0)
    params = list(_model().parameters())
    return lambda: vega.optim.AdamW([{"params": params, "loss_scale": scale}], lr=1e-2,
                                    loss_scale=scale)


CASES = {"quantized load": _quantized_load, "dequantized load": _dequantized_load,
         "scale not loaded": _scale_not_loaded, "scale of another kind": _scale_of_another_kind,
         "betas disagree": _betas_disagree, "torch_state_dict 8-bit": _torch_state_dict_8bit,
         "torch_state_dict masters": _torch_state_dict_masters,
         "group holds the scale": _group_holds_the_scale}


@pytest.mark.parametrize("case", CASES)
def test_a_warning_names_the_callers_line(case):
    """The loading's warnings named torch_names.py (the load_state_dict hooks' wrapper that
    calls vega's loading), not the caller: a fixed stacklevel counted frames that a later
    wrapper added to."""
    call = CASES[case]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert caught, case
    assert {(w.filename, w.category) for w in caught} == {(__file__, UserWarning)}, \
        [(w.filename, w.lineno, str(w.message)) for w in caught]


def test_a_filter_on_the_callers_module_holds_a_warning():
    """``-W error::UserWarning:<the training script's module>`` turns vega's warning into an
    error there (a filter's module is matched against the module the warning names)."""
    call = _scale_not_loaded()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=UserWarning, module=__name__)
        with pytest.raises(UserWarning, match="the saved scale is not loaded"):
            call()


@pytest.mark.parametrize("case", ["quantized load", "dequantized load"])
def test_a_load_converting_many_states_warns_once(case):
    """A load that quantizes (or dequantizes) the states of many parameters says so in one
    warning naming how many, not one a state: 24 for this model of 12 matrices, hundreds
    for a large model's checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    floats = _stepped(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), model)
    eight = vega.optim.AdamW(model.parameters(), lr=1e-2, state_dtype=U8)
    if case == "dequantized load":
        eight = _stepped(eight, model)
        floats = vega.optim.AdamW(model.parameters(), lr=1e-2)
    into, saved = (eight, floats) if case == "quantized load" else (floats, eight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        into.load_state_dict(saved.state_dict())
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "24 state(s)" in str(caught[0].message) and "(24 in all)" in str(caught[0].message)


@pytest.mark.parametrize("backend", ["c", "reference"])
def test_training_says_nothing(backend, tmp_path):
    """Compiling a spec, stepping it (class and functional), saving and loading its state:
    no warning, so that a run under ``python -W error`` is not stopped by vega."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = vega.compile("""
        optimizer quiet(lr = 1e-2 in [0, inf)) {
            state m = zeros
            m = 0.9 * m + g
            p = p - lr * m
        }""")
        model = _model()
        opt = spec.optimizer_class(model.parameters(), backend=backend)
        for _ in range(2):
            model.zero_grad()
            _stepped(opt, model)
        opt.load_state_dict(opt.state_dict())
        params = {"w": torch.randn(8, 6)}
        state = vega.adamw_init(params)
        params, state = vega.adamw_step(params, {"w": torch.randn(8, 6)}, state, lr=1e-3,
                                        backend=backend)
        vega.save(tmp_path / "state.safetensors", state)
        vega.load(tmp_path / "state.safetensors", like=state)
