"""What a program that makes and drops many optimizers and steps keeps: nothing of theirs
once they are gone, and no cache that grows with the values it has seen."""
import gc

import torch

import vega


def live_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def test_a_search_over_max_grad_norm_keeps_no_record_per_value():
    """Each step without a loss scale copies a prelude record made once per setting; a
    search that tries many values of ``max_grad_norm`` keeps a bounded number of them."""
    params = {"w": torch.ones(4)}
    grads = {"w": torch.ones(4)}
    state = vega.sgd_init(params)

    def trial(n: int) -> None:
        vega.sgd_step(params, grads, state, lr=0.5, max_grad_norm=1.0 + n, backend="reference")

    trial(0)
    before = live_tensors()
    for n in range(1, 201):
        trial(n)
    assert live_tensors() - before < 50
