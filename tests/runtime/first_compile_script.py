"""Run by test_first_compile.py in a fresh process with an empty kernel cache: a step
that torch.compile traces before any eager step, with vega choosing its backend."""
import json
import sys

import torch

import vega

out = {}
sched = vega.schedule.warmup_cosine_decay(init_value=0.0, peak_value=1e-2, warmup_steps=2,
                                          decay_steps=8)


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=gen), torch.randn(5, 1, generator=gen))
            for _ in range(3)]
    return model, data


def breaks(fn, *args):
    """Graph breaks and graphs that dynamo finds in ``fn(*args)``."""
    torch._dynamo.reset()
    found = torch._dynamo.explain(fn)(*args)
    return [found.graph_break_count, found.graph_count,
            [str(r.reason).splitlines()[0] for r in found.break_reasons]]


def functional(state_by_hand: bool):
    model, data = model_and_data()

    def loss_fn(params, x, y):
        return (torch.func.functional_call(model, params, (x,)) - y).square().mean()

    def train_step(params, state, ls, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        params, state, ls = vega.adamw_step(params, grads, state, lr=sched,
                                            weight_decay=0.01, max_grad_norm=1.0,
                                            loss_scale=ls)
        return params, state, ls, loss

    def fresh():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        if state_by_hand:  # no init: no kernel built before the trace
            state = {"mu": {k: torch.zeros_like(v) for k, v in params.items()},
                     "nu": {k: torch.zeros_like(v) for k, v in params.items()},
                     "step": torch.zeros((), dtype=torch.int32)}
        else:
            state = vega.adamw_init(params)
        return params, state, vega.LossScale.dynamic(2.0**10)

    params, state, ls = fresh()
    x, y = data[0]
    found = breaks(train_step, params, state, ls, x, y)
    compiled = torch.compile(train_step, fullgraph=True)
    params, state, ls = fresh()
    eager = fresh()
    for x, y in data:
        params, state, ls, _ = compiled(params, state, ls, x, y)
        eager = train_step(*eager, x, y)[:3]
    diff = max((params[k] - eager[0][k]).abs().max().item() for k in params)
    return found + [diff, int(state["step"])]


def optimizer_class():
    model, data = model_and_data()
    twin, _ = model_and_data()

    def make(m):
        return vega.optim.AdamW(m.parameters(), lr=sched, weight_decay=0.01,
                                max_grad_norm=1.0, loss_scale=vega.LossScale.dynamic(2.0**10))
    opt, eager = make(model), make(twin)
    x, y = data[0]
    (model(x) - y).square().mean().backward()
    found = breaks(opt.step)
    model = model_and_data()[0]  # explain ran a step: start again from the same values
    opt = make(model)
    step = torch.compile(opt.step, fullgraph=True)
    for x, y in data:
        for m, run in ((model, step), (twin, eager.step)):
            (m(x) - y).square().mean().backward()
            run()
            m.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                          twin.parameters()))
    return found + [diff, int(opt.state[next(model.parameters())]["step"])]


cases = {"hand": lambda: functional(True), "init": lambda: functional(False),
         "class": optimizer_class}
print(json.dumps({name: cases[name]() for name in sys.argv[1:]}))
