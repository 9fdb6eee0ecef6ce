"""Launches a step makes, whatever their source: the Triton kernels it launches and the torch
operations that compute (a GPU runs one kernel or copy for each), counted on a warm step with
the kernels recorded, not run (``vega.codegen.triton_ptx.recording``)."""
import torch
from torch.profiler import ProfilerActivity, profile

import vega
from vega.codegen import triton_ptx, triton_runtime

DEVICE = "cpu" if triton_runtime.interpreting() else "cuda"
# operations that launch nothing: allocations, views, metadata, and a .to that returns its input
NO_WORK = {"aten::empty", "aten::empty_strided", "aten::view", "aten::as_strided",
           "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh",
           "aten::resolve_conj", "aten::resolve_neg", "aten::to", "aten::select", "aten::slice",
           "aten::_reshape_alias", "aten::reshape", "aten::unsqueeze", "aten::expand"}


def launches(step) -> list[str]:
    """The Triton kernels and the computing torch operations of a warm call of ``step`` (the
    first call, not counted, makes the block maps and tables)."""
    with triton_ptx.recording():
        step()
    with triton_ptx.recording() as kernels, profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = [e.name for e in prof.events()
           if _works(e) and not any(_works(c) for c in e.cpu_children)]
    return [k.kernel for k in kernels] + ops


def _works(event) -> bool:
    """A torch operation that computes, itself or through the operations it calls (an
    operation counts where none it calls computes: ``aten::where`` allocates its output,
    then computes)."""
    return event.name.startswith("aten::") and event.name not in NO_WORK


def _params():
    ws = [torch.nn.Parameter(torch.randn(s, device=DEVICE)) for s in ((1000,), (30, 40), (7,))]
    for w in ws:
        w.grad = torch.randn_like(w)
    return ws


def test_a_plain_step_is_two_launches():
    """The scalars once a step, then the update, which advances the counters too."""
    opt = vega.optim.AdamW(_params(), lr=1e-3, backend="triton")
    assert launches(opt.step) == ["vega_adamw_scalars", "vega_adamw_update"]
    params = {str(k): w.detach().clone() for k, w in enumerate(_params())}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = vega.adamw_init(params)
    assert launches(lambda: vega.adamw_step(params, grads, state, lr=1e-3, backend="triton",
                                            donate=True)) == \
        ["vega_adamw_scalars", "vega_adamw_update"]


def test_a_fused_step_launches_its_kernels_once_for_all_tensors():
    """Clipping and a skip of non-finite steps: three launches, whatever the number of
    tensors: the prelude (its last program combining the others' sums and writing the whole
    record: no finish kernel, no copy of a blank record), the scalars and the update."""
    counts = []
    for n in (3, 30):
        ws = [torch.nn.Parameter(torch.randn(5 + i, device=DEVICE)) for i in range(n)]
        for w in ws:
            w.grad = torch.randn_like(w)
        opt = vega.optim.AdamW(ws, lr=1e-3, backend="triton", max_grad_norm=1.0,
                               skip_nonfinite=True)
        counts.append(launches(opt.step))
    assert counts[0] == counts[1]
    kernels = [x for x in counts[0] if x.startswith("vega_")]
    assert kernels == ["vega_adamw_prelude", "vega_adamw_scalars", "vega_adamw_update"]
    assert [x for x in counts[0] if not x.startswith("vega_")] == []
    # the functional step in place: the same three, and no torch operation forming a finite
    # flag that nothing reads (three small kernels a step, seen on an H200)
    params = {str(k): w.detach().clone() for k, w in enumerate(_params())}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = vega.adamw_init(params)
    assert launches(lambda: vega.adamw_step(params, grads, state, lr=1e-3, backend="triton",
                                            donate=True, max_grad_norm=1.0,
                                            skip_nonfinite=True)) == \
        ["vega_adamw_prelude", "vega_adamw_scalars", "vega_adamw_update"]


def test_a_tensor_learning_rate_adds_one_operation():
    """A 0-d tensor learning rate (what a schedule or torch's LR scheduler with a tensor ``lr``
    gives) reaches the scalars kernel through the step's hyperparameter array: one
    ``torch.where`` puts it there (a mask made once), after its conversion to float64;
    before, a copy of the array, a stack and a scatter."""
    lr = torch.tensor(1e-3, device=DEVICE)
    opt = vega.optim.AdamW(_params(), lr=lr, backend="triton")
    assert launches(opt.step) == ["vega_adamw_scalars", "vega_adamw_update", "aten::copy_",
                                  "aten::where"]
    params = {str(k): w.detach().clone() for k, w in enumerate(_params())}
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    state = vega.adamw_init(params)
    assert launches(lambda: vega.adamw_step(params, grads, state, lr=lr, backend="triton",
                                            donate=True)) == \
        ["vega_adamw_scalars", "vega_adamw_update", "aten::copy_", "aten::where"]


def test_a_loss_scaled_step_is_three_launches():
    """Unscale by a dynamic loss scale, finite check, clip, update, skip, counters and the
    scale's adjustment: the prelude (which inverts the scale itself), the scalars and the
    update (whose program 0 adjusts the scale in place); no torch operation."""
    opt = vega.optim.AdamW(_params(), lr=1e-3, backend="triton", max_grad_norm=1.0,
                           loss_scale=vega.LossScale.dynamic(init=2.0**8, device=DEVICE))
    assert launches(opt.step) == ["vega_adamw_prelude", "vega_adamw_scalars",
                                  "vega_adamw_update"]


def test_a_group_of_empty_tensors_last_leaves_the_counters_to_the_update():
    """Two dtype groups, the last of empty tensors (which launches no update): the other
    group's update advances the counters, no standalone advance; and a step run advances
    each once."""
    ws = [torch.nn.Parameter(torch.randn(100, device=DEVICE)),
          torch.nn.Parameter(torch.randn(0, 3, device=DEVICE, dtype=torch.bfloat16))]
    for w in ws:
        w.grad = torch.randn_like(w)
    opt = vega.optim.AdamW(ws, lr=1e-3, backend="triton")
    assert launches(opt.step) == ["vega_adamw_scalars", "vega_adamw_scalars",
                                  "vega_adamw_update"]
    opt.step()
    assert [int(opt.state[w]["step"]) for w in ws] == [1, 1]  # (the recorded steps ran none)
