"""``vega bench``'s machinery on tiny parameter sets (its timings are not asserted)."""
import math

from vega import bench


def test_race_steps_every_row_in_turn():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench.race(fns, budget=0.0, min_rounds=3)
    assert calls[:3] == ["a", "b", "c"]  # one warm-up call each
    assert calls[3:] == ["a", "b", "c"] * 3  # then rounds, every row once a round
    assert set(times) == set("abc") and all(t >= 0 for t in times.values())


def test_rows_of_a_tiny_run():
    shapes = [(3, 4), (5,)]
    _, grads = bench._tensors(shapes)
    rows = bench.adamw_rows(shapes, grads, compile_torch=False)
    for label in ("vega AdamW", "vega AdamW + unscale, finite check, clip, skip", bench.FUNCTIONAL,
                  "torch AdamW fused", "torch AdamW foreach", "torch AdamW for-loop",
                  "torch GradScaler.unscale_ + clip_grad_norm_ + fused AdamW",
                  "optax adamw under jax.jit (own process)"):
        assert rows[label] > 0, label
    others = bench.other_rows(shapes, grads, ["sgd", "adafactor"])
    assert [r[0] for r in others] == ["sgd", "adafactor"]
    for _, ours, label, theirs in others:
        assert ours > 0 and label.startswith("torch.optim.") and theirs > 0
    assert not any(math.isnan(v) for v in rows.values())
