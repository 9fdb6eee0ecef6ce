"""A class step over several parameter groups of one program (layer-wise rates, a decay
group) runs them as one call of the kernels, with each group's values; it steps each
parameter as an optimizer of that group alone does."""
import pytest
import torch

import vega.optim
from vega import schedule
from vega.runtime import engine


def _groups(seed: int, dtype=torch.float32):
    """Five groups of parameters with gradients (one without, in the third group), each
    group with its own rate and decay: a float, a 0-d tensor, a schedule."""
    g = torch.Generator().manual_seed(seed)
    shapes = [[(7, 5), (5,)], [(33,)], [(4, 4), (3,), (9,)], [(2, 3, 4)], [(11,), (6, 2)]]
    lrs = [1e-2, torch.tensor(3e-3, dtype=torch.float64), schedule.linear(1e-2, 1e-3, 5),
           5e-3, 2e-3]
    groups = []
    for k, (shape_list, lr) in enumerate(zip(shapes, lrs)):
        ps = [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in shape_list]
        groups.append({"params": ps, "lr": lr, "weight_decay": 0.1 * k})
    return groups


def _grads(groups, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for k, group in enumerate(groups):
        for j, p in enumerate(group["params"]):
            p.grad = None if (k, j) == (2, 1) else \
                torch.randn(p.shape, generator=g, dtype=p.dtype)


@pytest.mark.parametrize("name, extra", [("AdamW", {}), ("AdamW", {"amsgrad": True}),
                                         ("SGD", {"momentum": 0.9, "nesterov": True}),
                                         ("LAMB", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_groups_of_one_program_step_as_each_alone(name, extra, dtype, monkeypatch):
    cls = getattr(vega.optim, name)
    joined = _groups(0, dtype)
    alone = _groups(0, dtype)
    opt = cls([{**group, **extra} for group in joined], backend="c")
    each = [cls([{**group, **extra}], backend="c") for group in alone]
    calls = []
    run = engine.run
    monkeypatch.setattr(engine, "run", lambda *a, **k: calls.append(len(a[2])) or run(*a, **k))
    for t in range(4):
        _grads(joined, t)
        _grads(alone, t)
        calls.clear()
        opt.step()
        assert calls == [sum(len(gr["params"]) for gr in joined) - 1]  # (one call)
        for o in each:
            o.step()
        for gj, ga, o in zip(joined, alone, each):
            for p, q in zip(gj["params"], ga["params"]):
                assert torch.equal(p, q)
                assert opt.state[p].keys() == o.state[q].keys()
                for key, value in opt.state[p].items():
                    assert torch.equal(value, o.state[q][key]), key


def test_groups_of_two_programs_are_two_calls(monkeypatch):
    """Groups whose settings pick another program (amsgrad in one) are calls of their own,
    each a run of neighbouring groups of one program."""
    groups = _groups(1)
    opt = vega.optim.AdamW([{**gr, "amsgrad": k == 2} for k, gr in enumerate(groups)],
                           backend="c")
    _grads(groups, 0)
    calls = []
    run = engine.run
    monkeypatch.setattr(engine, "run", lambda *a, **k: calls.append(len(a[2])) or run(*a, **k))
    opt.step()
    assert calls == [3, 2, 3]



def test_scheduled_groups_evaluate_their_own_counters(monkeypatch):
    """Each group's schedule is evaluated at its own parameters' step counters only: a table
    of a row a parameter for groups of a schedule each, not every group's row at every
    counter of the step (which grew as groups times parameters: 3,000 groups, 1.9 GB), and
    each parameter steps as its group alone does, a group added later (counters behind the
    others') included."""
    def groups(seed, n):
        g = torch.Generator().manual_seed(seed)
        return [{"params": [torch.nn.Parameter(torch.randn(3, generator=g)) for _ in range(2)],
                 "lr": schedule.cosine_decay(1e-2 * (1 + k % 5), 20), "weight_decay": 0.01 * k}
                for k in range(n)]
    joined, alone = groups(0, 40), groups(0, 40)
    late, late_alone = groups(1, 3), groups(1, 3)
    opt = vega.optim.AdamW(joined, backend="c")
    each = [vega.optim.AdamW([gr], backend="c") for gr in alone]
    rows = []
    made = engine.hyper_rows
    monkeypatch.setattr(engine, "hyper_rows",
                        lambda *a: (lambda r: rows.append(r.table.shape[0]) or r)(made(*a)))
    for t in range(4):
        if t == 2:
            for gr, ga in zip(late, late_alone):
                opt.add_param_group(gr)
                each.append(vega.optim.AdamW([ga], backend="c"))
        every = [gr for o in (opt,) for gr in o.param_groups]
        mine = [gr for o in each for gr in o.param_groups]
        for gj, ga in zip(every, mine):
            g = torch.Generator().manual_seed(t)
            for p, q in zip(gj["params"], ga["params"]):
                p.grad = torch.randn(3, generator=g)
                q.grad = p.grad.clone()
        rows.clear()
        opt.step()
        for o in each:
            o.step()
        assert rows[0] == sum(len(gr["params"]) for gr in every)
        for gj, ga in zip(every, mine):
            for p, q in zip(gj["params"], ga["params"]):
                assert torch.equal(p, q)
