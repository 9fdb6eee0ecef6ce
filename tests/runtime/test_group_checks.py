"""A class step checks each group's hyperparameters at every step, as the constructor does;
numbers and bools checked at the group's last step are not checked again while the group
holds the same objects (``SpecOptimizer._group_values``), so a change of any of them, of a
bool as of a float, is checked at the next step, and a tensor (which may change in place)
at every step."""
import pytest
import torch

import vega.optim


def made(n=3):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(8, generator=g, requires_grad=True) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(8, generator=g)
    opt = vega.optim.AdamW([{"params": [p], "lr": 1e-3 * (k + 1)} for k, p in enumerate(ps)])
    opt.step()
    opt.step()
    return ps, opt


@pytest.mark.parametrize("key, bad, words", [
    ("lr", -1.0, "lr=-1.0"), ("weight_decay", float("nan"), "weight_decay=nan"),
    ("b1", 1.5, "b1=1.5"), ("eps", 1, None), ("amsgrad", 1, "amsgrad=1"),
    ("amsgrad", "yes", "amsgrad='yes'")])
@pytest.mark.parametrize("k", [0, 2])
def test_a_setting_changed_after_steps_is_checked_at_the_next(key, bad, words, k):
    ps, opt = made()
    before = [p.detach().clone() for p in ps]
    opt.param_groups[k][key] = bad
    if words is None:  # (a valid value of another type: taken)
        opt.step()
        return
    with pytest.raises(ValueError, match=words):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("key", ["lr", "b1", "maximize", "amsgrad"])
def test_a_setting_deleted_from_a_group_is_named_with_its_group(key):
    """A group without a setting (deleted, or a group appended to param_groups by hand,
    which add_param_group would have filled from the defaults) failed with a bare KeyError
    of the key, from deep in the step; the step names the group and its missing keys."""
    ps, opt = made()
    before = [p.detach().clone() for p in ps]
    del opt.param_groups[1][key]
    with pytest.raises(ValueError, match=f"group 1 has no '{key}'.*add_param_group"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    q = torch.randn(3, requires_grad=True)
    q.grad = torch.ones(3)
    opt.param_groups[1][key] = opt.defaults[key]
    opt.param_groups.append({"params": [q]})
    with pytest.raises(ValueError, match=r"group 3 has no 'amsgrad', 'b1', .*'lr'"):
        opt.step()


def test_a_tensor_changed_in_place_is_checked_at_the_next_step():
    ps, opt = made()
    lr = torch.tensor(1e-3)
    opt.param_groups[1]["lr"] = lr
    opt.step()
    opt.step()
    lr.set_(torch.tensor([1e-3, 2e-3]))  # (the same object, now of shape (2,))
    with pytest.raises(ValueError, match="lr must be a 0-d float tensor"):
        opt.step()


def test_a_group_moved_to_another_position_is_checked():
    ps, opt = made()
    opt.param_groups[0]["lr"] = -1.0
    groups = opt.param_groups
    groups[0], groups[2] = groups[2], groups[0]
    with pytest.raises(ValueError, match="lr=-1.0"):
        opt.step()


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_a_real_number_of_another_type_set_in_a_group_steps_as_its_float(name, backend):
    """A number the checks take as a real one (a fractions.Fraction, any numbers.Real) set
    in a group after the constructor steps as its float, as the constructor's and the
    functional step's do: the step passed the group's own object on, and the reference's
    torch.full raised a TypeError (every rule on the reference backend; Muon's matrices on
    every backend), where the C and Triton kernels took it."""
    from fractions import Fraction
    cls = getattr(vega.optim, name)
    start = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    ps = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    opts = [cls([ps[0]], backend=backend), cls([ps[1]], backend=backend)]
    for k in range(3):
        if k == 1:
            opts[0].param_groups[0]["lr"] = Fraction(1, 50)
            opts[1].param_groups[0]["lr"] = 0.02
        for p in ps:
            p.grad = torch.full((4, 3), float(k + 1))
        for opt in opts:
            opt.step()
    assert torch.equal(ps[0].detach(), ps[1].detach())
