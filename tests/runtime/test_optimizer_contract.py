"""The classes against torch.optim's Optimizer contract: what a caller does to ``state`` and
``param_groups`` between steps, and what ``state_dict`` then saves."""
import pytest
import torch

import vega.optim as vo


def _stepped(cls, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = cls(ps, lr=0.1, **kw)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    return ps, opt


@pytest.mark.parametrize("name", ["AdamW", "SGD", "LBFGS"])
def test_state_dict_after_reading_the_state_of_a_tensor_not_in_the_optimizer(name):
    # opt.state is a defaultdict: reading a tensor that is in no group makes it an empty
    # entry, which torch's state_dict() then fails on (KeyError: the tensor's id)
    ps, opt = _stepped(getattr(vo, name))
    other = torch.nn.Parameter(torch.randn(2))
    assert not opt.state[other]
    sd = opt.state_dict()
    assert len(sd["state"]) == 2 and other not in opt.state
    fresh = getattr(vo, name)([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.1)
    fresh.load_state_dict(sd)
    opt.step()


@pytest.mark.parametrize("name", ["AdamW", "SGD", "LBFGS"])
def test_state_dict_names_the_state_of_a_parameter_removed_from_its_group(name):
    ps, opt = _stepped(getattr(vo, name))
    opt.param_groups[0]["params"].pop(1)
    with pytest.raises(ValueError, match=r"shape \(5,\).* in no parameter group.*del "):
        opt.state_dict()
    del opt.state[ps[1]]
    sd = opt.state_dict()
    assert len(sd["param_groups"][0]["params"]) == 1
    opt.step()


def test_a_deleted_step_count_is_named_as_deleted_too():
    # the message guessed only a state written in before the first step
    ps, opt = _stepped(vo.AdamW)
    del opt.state[ps[0]]["step"]
    with pytest.raises(ValueError, match=r"no step count: .*where it had stepped and its "
                                         r"'step' was deleted, put back its step count"):
        opt.step()
    opt.state[ps[0]]["step"] = torch.tensor(1, dtype=torch.int32)
    opt.step()
    assert int(opt.state[ps[0]]["step"]) == 2
