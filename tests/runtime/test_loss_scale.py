"""vega.runtime.loss_scale against torch's GradScaler update kernel and jmp's rule."""
import re

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

import vega
from vega.runtime.loss_scale import LossScale, grads_finite
from vega.runtime.tree import leaf_paths

STEPS = 5000


def finite_sequence(seed=0, p_overflow=0.03, burst=(2500, 2700)):
    """Mostly finite steps with random overflows, and a burst of 200 overflows in a row.

    With growth every 5 finite steps the scale climbs to float32's largest power of two
    (where growing again would overflow, so it stays), then the burst drives it far
    below 1, then it climbs again.
    """
    finite = np.random.default_rng(seed).random(STEPS) > p_overflow
    finite[burst[0]:burst[1]] = False
    return finite.tolist()


def vega_trajectory(ls, finites):
    scales, counts = [], []
    for f in finites:
        ls = ls.adjust(torch.tensor(f))
        scales.append(ls.loss_scale)
        counts.append(ls.good_steps)
    return torch.stack(scales), torch.stack(counts)


def torch_trajectory(init, finites, growth_factor, backoff_factor, interval):
    """torch.amp.GradScaler's update: torch._amp_update_scale_ (it runs on CPU tensors)."""
    scale = torch.tensor(init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    scales, counts = [], []
    for f in finites:
        found_inf = torch.tensor(0.0 if f else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor,
                                 interval)
        scales.append(scale.clone())
        counts.append(tracker.clone())
    return torch.stack(scales), torch.stack(counts)


def jmp_trajectory(init, finites, period, factor, min_loss_scale):
    """jmp's DynamicLossScale.adjust (jmp/_src/loss_scale.py), written out in float32.

    One ``factor`` grows and (divided by) backs off; growth that is not finite keeps
    the scale; the backed-off scale is floored at ``min_loss_scale`` (1.0 by default in
    jmp, a floor torch and vega do not have); the counter is
    ``((counter + 1) % period) * grads_finite``.
    """
    scale, counter = np.float32(init), 0
    factor, floor = np.float32(factor), np.float32(min_loss_scale)
    scales, counts = [], []
    with np.errstate(over="ignore"):
        for f in finites:
            if f:
                if counter == period - 1:
                    grown = scale * factor
                    scale = grown if np.isfinite(grown) else scale
                counter = (counter + 1) % period
            else:
                scale = max(floor, scale / factor)
                counter = 0
            scales.append(scale)
            counts.append(counter)
    return torch.tensor(np.array(scales, dtype=np.float32)), torch.tensor(counts, dtype=torch.int32)


def test_dynamic_follows_torch_and_jmp():
    finites = finite_sequence()
    ls = LossScale.dynamic(init=2.0**15, growth_interval=5)
    scales, counts = vega_trajectory(ls, finites)
    assert scales.dtype == torch.float32 and counts.dtype == torch.int32

    t_scales, t_counts = torch_trajectory(2.0**15, finites, 2.0, 0.5, 5)
    assert torch.equal(scales, t_scales) and torch.equal(counts, t_counts)
    # The run exercised what it is meant to: the overflow guard and scales below 1.
    assert scales.max().item() == 2.0**127 and scales.min().item() < 2.0**-60

    # jmp coincides with torch (factor 2, backoff 1/2) once its floor is out of the way.
    j_scales, j_counts = jmp_trajectory(2.0**15, finites, 5, 2.0, min_loss_scale=0.0)
    assert torch.equal(scales, j_scales) and torch.equal(counts, j_counts)
    # With jmp's default floor of 1 the two agree until vega's scale first drops below 1.
    j_scales, _ = jmp_trajectory(2.0**15, finites, 5, 2.0, min_loss_scale=1.0)
    first_below = int(torch.nonzero(scales < 1)[0])
    assert torch.equal(scales[:first_below], j_scales[:first_below])
    assert j_scales[first_below].item() == 1.0 != scales[first_below].item()


def test_dynamic_follows_torch_bitwise_with_odd_factors():
    """Factors that are not powers of two: the products are formed in double precision
    and rounded to float32 once, as torch's kernel does."""
    finites = finite_sequence(seed=1, p_overflow=0.2, burst=(4000, 4010))
    ls = LossScale.dynamic(init=3.3e4, growth_interval=4, growth_factor=3.0,
                           backoff_factor=0.7)
    scales, counts = vega_trajectory(ls, finites)
    t_scales, t_counts = torch_trajectory(3.3e4, finites, 3.0, 0.7, 4)
    assert torch.equal(scales.view(torch.int32), t_scales.view(torch.int32))
    assert torch.equal(counts, t_counts)


def test_growth_that_would_overflow_keeps_the_scale():
    ls = LossScale.dynamic(init=2.0**127, growth_interval=1)
    ls = ls.adjust(torch.tensor(True))
    assert ls.loss_scale.item() == 2.0**127 and ls.good_steps.item() == 0


def test_static_never_changes():
    ls = LossScale.static(128.0)
    assert ls.good_steps.item() == -1 and ls.loss_scale.dtype == torch.float32
    for f in [True, False, True, True, False]:
        out = ls.adjust(torch.tensor(f))
        assert out.loss_scale.item() == 128.0 and out.good_steps.item() == -1
    ls = LossScale.static(1.0)
    g = {"w": torch.randn(3)}
    assert torch.equal(ls.unscale(g)["w"], g["w"])


def test_scale_and_unscale_keep_dtypes():
    ls = LossScale.dynamic(init=2.0**16)        # not representable in float16
    half = torch.tensor([1.0, -2.0, 65504.0], dtype=torch.float16)
    grads = {"h": half, "d": torch.tensor([3.0], dtype=torch.float64),
             "c": torch.tensor([1 + 2j]), "i": torch.arange(3), "s": torch.tensor(4.0)}
    out = ls.unscale(grads)
    assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in grads.items()}
    assert torch.equal(out["h"], (half.float() / 2.0**16).half())
    assert out["d"].item() == 3.0 / 2.0**16 and out["s"].item() == 4.0 / 2.0**16
    assert out["c"].item() == (1 + 2j) / 2.0**16
    assert out["i"] is grads["i"]
    loss = torch.tensor(0.5, dtype=torch.float16)
    assert ls.scale(loss).dtype == torch.float16 and ls.scale(loss).item() == 2.0**15
    assert ls.scale(torch.tensor(0.5)).item() == 2.0**15


def test_bfloat16_is_scaled_in_float32_and_kept():
    """bfloat16, as float16, meets the scale in float32 and is rounded back once: a 0-d
    loss keeps its dtype (a 0-d bfloat16 times the 0-d float32 scale would be float32), and
    a gradient is divided by the float32 scale, not by the scale rounded to bfloat16."""
    ls = LossScale.static(257.0)  # (256 in bfloat16)
    loss = torch.tensor(0.75, dtype=torch.bfloat16)
    assert ls.scale(loss).dtype == torch.bfloat16
    assert torch.equal(ls.scale(loss), (loss.float() * ls.loss_scale).bfloat16())
    g = torch.linspace(-3.0, 5.0, 65, dtype=torch.bfloat16)
    assert torch.equal(ls.unscale(g), (g.float() / ls.loss_scale).bfloat16())


def test_grads_finite():
    ok = {"a": torch.ones(3), "b": [torch.zeros(2, dtype=torch.float16)], "i": torch.arange(2)}
    got = grads_finite(ok)
    assert got.dtype == torch.bool and got.dim() == 0 and bool(got)
    for bad in (float("inf"), float("-inf"), float("nan")):
        tree = {"a": torch.ones(3), "b": [torch.tensor([1.0, bad], dtype=torch.float16)]}
        assert not bool(grads_finite(tree))
    assert not bool(grads_finite(torch.tensor([complex(1, float("nan"))])))
    assert bool(grads_finite({})) and bool(grads_finite({"i": torch.arange(3)}))


def sgd(params, state):
    """A step_fn factory: plain momentum SGD over dicts."""
    def step_fn(grads):
        mom = {k: 0.9 * state["mom"][k] + grads[k] for k in grads}
        new_p = {k: params[k] - 0.1 * mom[k] for k in params}
        return new_p, {"mom": mom, "step": state["step"] + 1}
    return step_fn


def bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("make", [lambda: LossScale.dynamic(init=1024.0, growth_interval=3),
                                  lambda: LossScale.static(1024.0)], ids=["dynamic", "static"])
def test_step_applies_or_skips_exactly(make):
    ls = make()
    params = {"w": torch.tensor([1.0, -0.0, float("nan")]), "b": torch.tensor(2.0)}
    state = {"mom": {"w": torch.tensor([0.5, -0.0, 1.0]), "b": torch.tensor(0.25)},
             "step": torch.tensor(7, dtype=torch.int32)}
    grads = {"w": torch.tensor([1024.0, 2048.0, -512.0]), "b": torch.tensor(4096.0)}

    (new_p, new_s), ls2 = ls.step(grads, sgd(params, state), (params, state))
    want_p, want_s = sgd(params, state)(ls.unscale(grads))
    for a, b in zip(pytree.tree_leaves((new_p, new_s)), pytree.tree_leaves((want_p, want_s))):
        assert torch.equal(bits(a), bits(b))
    assert ls2.good_steps.item() == (1 if ls.is_dynamic else -1)

    bad = {"w": torch.tensor([1.0, float("inf"), 0.0]), "b": torch.tensor(1.0)}
    (kept_p, kept_s), ls3 = ls2.step(bad, sgd(new_p, new_s), (new_p, new_s))
    for a, b in zip(pytree.tree_leaves((kept_p, kept_s)), pytree.tree_leaves((new_p, new_s))):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    if ls.is_dynamic:
        assert ls3.loss_scale.item() == 512.0 and ls3.good_steps.item() == 0
    else:
        assert ls3.loss_scale.item() == 1024.0 and ls3.good_steps.item() == -1
    # the unbound form, as the OCaml library Vega writes it
    (p4, _), _ = LossScale.step(ls2, bad, sgd(new_p, new_s), (new_p, new_s))
    assert torch.equal(bits(p4["b"]), bits(new_p["b"]))


def test_step_refuses_a_step_fn_that_writes_the_state_in_place():
    """A step with donate=True leaves no old state to keep on an overflow: it was stepped
    with inf in it, the counter advanced, and the scale backed off as if the step had been
    skipped. Now that is said; a pure step through the same call keeps the state."""
    import vega
    params = {"w": torch.ones(3)}
    grads = {"w": torch.tensor([1.0, float("inf"), 1.0])}
    ls = LossScale.dynamic(init=2.0)
    state = vega.adam_init(params)
    with pytest.raises(ValueError, match=r"^LossScale\.step: step_fn wrote state leaf '0\.w' "
                                         r"in place \(a step with donate=True\?\)"):
        ls.step(grads, lambda g: vega.adam_step(params, g, state, lr=0.1, donate=True),
                (params, state))
    params, state = {"w": torch.ones(3)}, vega.adam_init({"w": torch.ones(3)})
    (new_p, new_s), ls2 = ls.step(grads, lambda g: vega.adam_step(params, g, state, lr=0.1),
                                  (params, state))
    assert torch.equal(new_p["w"], torch.ones(3)) and int(new_s["step"]) == 0
    assert ls2.skipped_steps.item() == 1


@pytest.mark.parametrize("leaf,value,message", [
    ("loss_scale", -4.0, "'loss_scale' is -4.0; it must be positive and finite"),
    ("loss_scale", float("nan"), "'loss_scale' is nan"),
    ("skipped_steps", -1, "'skipped_steps' is -1; it must be at least 0"),
    ("min_scale", 1e9, "'min_scale' is 1000000000.0, above the scale"),
])
def test_a_scale_kept_in_a_state_is_checked_where_its_values_come_in(tmp_path, leaf, value,
                                                                       message):
    """set_leaf, vega.load and the constructor take a scale's values as load_state_dict does:
    a negative scale set by hand stepped uphill."""
    state = {"m": torch.zeros(2), "ls": LossScale.dynamic(init=4.0)}
    with pytest.raises(ValueError, match=rf"^vega\.set_leaf: leaf 'ls\.{leaf}': the loss "
                                         rf"scale's {re.escape(message)}"):
        vega.set_leaf(state, f"ls.{leaf}", value)
    bad = state["ls"].tensors()
    bad = [torch.tensor(value, dtype=t.dtype) if name == leaf else t
           for name, t in zip(("loss_scale", "good_steps", "skipped_steps", "min_scale"), bad)]
    saved = {"m": torch.zeros(2), "ls": LossScale._from(bad, state["ls"]._config())}
    vega.save(tmp_path / "s.safetensors", saved)
    with pytest.raises(ValueError, match=r"^vega\.load: .*: the loss scale's " +
                       re.escape(message)):
        vega.load(tmp_path / "s.safetensors", like=state)
    with pytest.raises(ValueError, match=r"^LossScale: " + re.escape(message)):
        LossScale(*bad)


def test_a_scale_loaded_into_one_of_the_other_kind_is_refused(tmp_path):
    """vega.load takes a scale's settings from like= and its tensors from the file: a dynamic
    scale loaded with a static like= kept its count and stopped adjusting, silently (and a
    static one loaded as dynamic started to). Either is refused, naming the count; of the
    same kind it loads bitwise, the file's count and scale with like='s settings."""
    def state(ls):
        return {"m": torch.zeros(2), "ls": ls}
    dynamic = LossScale.dynamic(init=8.0, growth_interval=3).adjust(torch.tensor(True))
    vega.save(tmp_path / "d.safetensors", state(dynamic))
    vega.save(tmp_path / "s.safetensors", state(LossScale.static(4.0)))
    with pytest.raises(ValueError, match=r"^vega\.load: .*d\.safetensors': leaf "
                                         r"'ls\.good_steps' is 1, the count of a dynamic loss "
                                         r"scale, but like= has a static one there"):
        vega.load(tmp_path / "d.safetensors", like=state(LossScale.static(1.0)))
    with pytest.raises(ValueError, match=r"leaf 'ls\.good_steps' is -1, the count of a "
                                         r"static loss scale, but like= has a dynamic one"):
        vega.load(tmp_path / "s.safetensors", like=state(LossScale.dynamic()))
    loaded = vega.load(tmp_path / "d.safetensors",
                       like=state(LossScale.dynamic(growth_interval=3)))["ls"]
    assert all(torch.equal(a, b) for a, b in zip(loaded.tensors(), dynamic.tensors()))
    assert loaded._config() == dynamic._config()
    static = vega.load(tmp_path / "s.safetensors", like=state(LossScale.static(1.0)))["ls"]
    assert static.loss_scale.item() == 4.0 and not static.is_dynamic


def test_step_and_constructor_take_what_they_took():
    """A state of inference tensors (which keep no version counter) steps through
    LossScale.step, and the constructor checks values, not dtypes (an int64 counter)."""
    with torch.inference_mode():
        params = {"w": torch.ones(3)}
        state = vega.adam_init(params)
    (new_p, _), _ = LossScale.dynamic(init=2.0).step(
        {"w": torch.ones(3)}, lambda g: vega.adam_step(params, g, state, lr=0.1),
        (params, state))
    assert torch.allclose(new_p["w"], torch.full((3,), 0.9))
    ls = LossScale(torch.tensor(8.0), torch.tensor(0), growth_interval=2)
    assert ls.adjust(torch.tensor(True)).loss_scale.item() == 8.0


def test_the_constructors_kind_agrees_with_its_good_steps():
    """A static scale counts -1 good steps and a dynamic one counts from 0: the mark by which
    a loaded state dict (an optimizer's, ``vega.load``'s) tells the two apart. A static scale
    made with the constructor at good_steps 0 was saved as a dynamic one, and an optimizer
    of the same static scale refused to load it; each mismatch is refused where it is made."""
    i32 = torch.int32
    with pytest.raises(ValueError, match=r"^LossScale: good_steps=0 with dynamic=False: a "
                                         r"static scale's good_steps is -1"):
        LossScale(torch.tensor(8.0), torch.tensor(0, dtype=i32), dynamic=False)
    with pytest.raises(ValueError, match=r"^LossScale: good_steps=-1 with dynamic=True"):
        LossScale(torch.tensor(8.0), torch.tensor(-1, dtype=i32))
    ls = LossScale(torch.tensor(8.0), torch.tensor(-1, dtype=i32), dynamic=False)
    p = torch.nn.Parameter(torch.ones(3))
    opt = vega.optim.SGD([p], lr=0.1, loss_scale=ls)
    p.grad = torch.ones(3)
    opt.step()
    again = LossScale(torch.tensor(2.0), torch.tensor(-1, dtype=i32), dynamic=False)
    vega.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1,
                   loss_scale=again).load_state_dict(opt.state_dict())
    assert again.loss_scale.item() == 8.0


def test_the_constructor_checks_each_0d_leaf_past_one_it_takes_unchecked():
    """The constructor checks the values of its 0-d leaves (it takes others as they are):
    a leaf it takes unchecked (a counter of one element and one dimension) no longer stops
    the check of those after it, which took a negative floor."""
    with pytest.raises(ValueError, match=r"^LossScale: 'min_scale' is -5\.0; it must be at "
                                         r"least 0"):
        LossScale(torch.tensor(8.0), torch.tensor([0], dtype=torch.int32),
                  min_scale=torch.tensor(-5.0))
    with pytest.raises(ValueError, match=r"^LossScale: 'min_scale' is 16\.0, above the "
                                         r"scale, 8\.0"):
        LossScale(torch.tensor(8.0), torch.tensor([0], dtype=torch.int32),
                  min_scale=torch.tensor(16.0))


def test_pytree_leaves_and_names():
    ls = LossScale.dynamic(init=8.0, growth_interval=7, growth_factor=3.0, backoff_factor=0.25)
    leaves, spec = pytree.tree_flatten(ls)
    assert len(leaves) == 4 and leaves[0] is ls.loss_scale and leaves[1] is ls.good_steps
    back = pytree.tree_unflatten([x * 2 for x in leaves], spec)
    assert isinstance(back, LossScale) and back.loss_scale.item() == 16.0
    assert (back.growth_interval, back.growth_factor, back.backoff_factor, back.is_dynamic) == \
        (7, 3.0, 0.25, True)
    assert leaf_paths({"ls": ls}) == ["ls.loss_scale", "ls.good_steps", "ls.skipped_steps",
                                      "ls.min_scale"]
    assert "loss_scale=8.0" in repr(ls) and "growth_interval=7" in repr(ls)
    # Static and dynamic scales have different structures.
    assert pytree.tree_structure(LossScale.static(8.0)) != spec


def test_adjust_compiles_without_graph_break():
    """A loss-scaled step as one dynamo frame (the eager backend: tracing is the point)."""
    def train(ls, grads, params):
        (params,), ls = ls.step(grads, lambda g: (params - 0.1 * g,), (params,))
        return params, ls

    compiled = torch.compile(train, backend="eager", fullgraph=True)
    ls = LossScale.dynamic(init=4.0, growth_interval=2)
    p = torch.ones(3)
    for g in [torch.ones(3), torch.full((3,), float("inf")), torch.ones(3)]:
        p2, ls2 = compiled(ls, g * 4.0, p)
        p_e, ls_e = train(ls, g * 4.0, p)
        assert torch.equal(p2, p_e) and torch.equal(ls2.loss_scale, ls_e.loss_scale)
        assert torch.equal(ls2.good_steps, ls_e.good_steps)
        p, ls = p2, ls2


def test_min_scale_and_skipped_count():
    ls = LossScale.dynamic(init=8.0, min_scale=2.0)
    for _ in range(4):
        ls = ls.adjust(torch.tensor(False))
    assert ls.loss_scale.item() == 2.0 and ls.skipped_steps.item() == 4
    ls = ls.adjust(torch.tensor(True))
    assert ls.skipped_steps.item() == 4 and ls.good_steps.item() == 1
    assert LossScale.dynamic(init=8.0).adjust(False).adjust(False).loss_scale.item() == 2.0
    assert LossScale.dynamic(init=1.0).adjust(False).loss_scale.item() == 0.5  # no floor


def test_traversals():
    ls = LossScale.dynamic(init=8.0)
    seen = []
    ls.iter(seen.append)
    assert len(seen) == 4 and seen[0] is ls.loss_scale
    doubled = ls.map(lambda t: t * 2)
    assert doubled.loss_scale.item() == 16.0 and doubled.growth_interval == ls.growth_interval
    summed = ls.map2(torch.add, doubled)
    assert summed.loss_scale.item() == 24.0
    with pytest.raises(ValueError, match="configured alike"):
        ls.map2(torch.add, LossScale.static(2.0))


BAD = [
    (lambda: LossScale.static(0.0), "s=0.0"),
    (lambda: LossScale.static(-2.0), "s=-2.0"),
    (lambda: LossScale.static(float("nan")), "s=nan"),
    (lambda: LossScale.static(float("inf")), "s=inf"),
    (lambda: LossScale.static(1e39), "s=1e+39"),
    (lambda: LossScale.static(True), "s=True"),
    (lambda: LossScale.dynamic(init=0.0), "init=0.0"),
    (lambda: LossScale.dynamic(init=-1.0), "init=-1.0"),
    (lambda: LossScale.dynamic(growth_interval=0), "growth_interval=0"),
    (lambda: LossScale.dynamic(growth_interval=-5), "growth_interval=-5"),
    (lambda: LossScale.dynamic(growth_interval=2.5), "growth_interval=2.5"),
    (lambda: LossScale.dynamic(growth_interval=2000.0), "growth_interval=2000.0"),
    # (compared with the int32 count of good steps: a larger one grew the scale every step)
    (lambda: LossScale.dynamic(growth_interval=2**31), "growth_interval=2147483648 must be at "
     "most 2**31 - 1"),
    (lambda: LossScale.dynamic().adjust(torch.tensor(True), growth_interval=2**40),
     "growth_interval=1099511627776 must be at most 2**31 - 1"),
    (lambda: LossScale.dynamic(growth_factor=0.0), "growth_factor=0.0"),
    (lambda: LossScale.dynamic(growth_factor=-2.0), "growth_factor=-2.0"),
    (lambda: LossScale.dynamic(backoff_factor=0.0), "backoff_factor=0.0"),
    (lambda: LossScale.dynamic(backoff_factor=-0.5), "backoff_factor=-0.5"),
    (lambda: LossScale.dynamic(min_scale=0.0), "min_scale=0.0"),
    (lambda: LossScale.dynamic(init=2.0, min_scale=4.0), "min_scale=4.0 is above"),
    (lambda: LossScale.dynamic().adjust("yes"), "finite='yes'"),
    (lambda: LossScale.dynamic().adjust(torch.ones(3, dtype=torch.bool)), "0-d bool"),
    (lambda: LossScale.dynamic().adjust(torch.tensor(1.0)), "0-d bool"),
    (lambda: LossScale.static(2.0).adjust(None), "finite=None"),
]


@pytest.mark.parametrize("make,fragment", BAD, ids=[b[1] for b in BAD])
def test_bad_arguments_raise(make, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        make()


def test_the_edges_of_the_settings_are_taken():
    """The largest interval the int32 counter holds (which the refusal of a larger one
    offers), and a floor equal to the initial scale, are taken."""
    ls = LossScale.dynamic(init=4.0, growth_interval=2**31 - 1)
    assert ls.growth_interval == 2**31 - 1
    assert ls.adjust(True, growth_interval=2**31 - 1).good_steps.item() == 1
    floored = LossScale.dynamic(init=4.0, min_scale=4.0)
    backed = floored.adjust(False)
    assert backed.loss_scale.item() == 4.0 and backed.skipped_steps.item() == 1


def test_adjust_takes_an_integer_flag_as_python_truth():
    """A 0-d integer tensor is finite where it is not 0 (any nonzero count, not 1 only)."""
    ls = LossScale.dynamic(init=8.0, growth_interval=1)
    for flag in (torch.tensor(2), torch.tensor(-1, dtype=torch.int8),
                 torch.tensor(1, dtype=torch.uint8)):
        assert ls.adjust(flag).loss_scale.item() == 16.0, flag
    assert ls.adjust(torch.tensor(0)).loss_scale.item() == 4.0


def test_step_refuses_a_step_fn_that_returns_another_structure():
    ls = LossScale.dynamic(init=2.0)
    state = {"w": torch.ones(2), "b": torch.zeros(1)}
    grads = {"w": torch.ones(2), "b": torch.ones(1)}
    with pytest.raises(ValueError, match="different from the state's"):
        ls.step(grads, lambda g: {"w": state["w"] - g["w"]}, state)
    with pytest.raises(ValueError, match="different from the state's"):
        ls.step(grads, lambda g: (state["w"], state["b"]), state)


def test_dynamic_follows_jmp_itself():
    """jmp's DynamicLossScale, the package itself: with the same floor (jmp's default
    min_loss_scale 1) the 5,000-step trajectories of scale and counter are identical."""
    import jax.numpy as jnp
    import jmp

    finites = finite_sequence()
    ours = LossScale.dynamic(init=2.0**15, growth_interval=5, min_scale=1.0)
    theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), period=5,
                                  min_loss_scale=jnp.float32(1.0))
    for k, f in enumerate(finites):
        ours = ours.adjust(torch.tensor(bool(f)))
        theirs = theirs.adjust(jnp.bool_(bool(f)))
        assert ours.loss_scale.item() == float(theirs.loss_scale), k
        assert ours.good_steps.item() == int(theirs.counter), k
    assert ours.skipped_steps.item() == sum(1 for f in finites if not f)


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_backing_off_never_reaches_zero(backend):
    """Backing off is floored at the smallest normal float32 where no min_scale is higher
    (a backoff of 1e-50 from 1.0, or many backoffs from a tiny scale, reached 0.0, after
    which every step was skipped and the optimizer's own state_dict was refused on
    load), in LossScale.adjust and in the Triton kernel that adjusts it in place."""
    tiny = torch.finfo(torch.float32).tiny
    assert LossScale.dynamic(init=1.0, backoff_factor=1e-50).adjust(False).loss_scale.item() \
        == tiny
    ls = LossScale.dynamic(init=2.0**-120)
    for _ in range(30):
        ls = ls.adjust(torch.tensor(False))
    assert ls.loss_scale.item() == tiny and ls.skipped_steps.item() == 30
    # a scale already below the floor (a subnormal init) is kept, never raised
    low = LossScale.dynamic(init=1e-40).adjust(torch.tensor(False)).loss_scale
    assert low.item() == torch.tensor(1e-40).item()
    w = torch.nn.Parameter(torch.zeros(3))
    opt = vega.optim.SGD([w], lr=0.1, backend=backend,
                         loss_scale=LossScale.dynamic(init=1.0, backoff_factor=1e-50))
    w.grad = torch.full((3,), float("inf"))
    opt.step()
    assert opt.loss_scale.loss_scale.item() == tiny and torch.equal(w, torch.zeros(3))
    opt.load_state_dict(opt.state_dict())
    w.grad = torch.ones(3)
    opt.step()
    assert torch.all(w < 0)
    sub = vega.optim.SGD([w], lr=0.1, backend=backend,
                         loss_scale=LossScale.dynamic(init=1e-40))
    w.grad = torch.full((3,), float("inf"))
    sub.step()
    assert sub.loss_scale.loss_scale.item() == torch.tensor(1e-40).item()


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_a_class_step_without_gradients_leaves_the_scale(backend):
    """A class step in which no parameter has a gradient steps nothing and checks nothing: its
    scale stays as it was, as the states do (it counted a finite step, so steps called
    before any backward pass, or after zero_grad(), grew the scale unchecked); the steps with
    gradients count as before."""
    ws = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = vega.optim.AdamW([{"params": ws[:1]}, {"params": ws[1:]}], backend=backend,
                           loss_scale=LossScale.dynamic(init=4.0, growth_interval=2))
    before = [t.clone() for t in opt.loss_scale.tensors()]
    for _ in range(3):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.loss_scale.tensors(), before))
    assert not opt.state
    ws[1].grad = torch.ones(2)  # (one group's parameter: a step)
    opt.step()
    opt.zero_grad()
    opt.step()
    assert opt.loss_scale.good_steps.item() == 1 and opt.loss_scale.loss_scale.item() == 4.0


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_scale_made_without_a_device_outlives_parameters_made_on_meta(backend):
    """An optimizer made over a model made on the meta device, then ``to_empty`` (swapping
    the parameters' tensors in place, as torch does where
    ``set_swap_module_params_on_conversion(True)``: the optimizer's parameters are the
    model's), keeps its loss scale's values: a scale made without a device went to meta with
    the parameters, and its values were lost (scaling the loss raised). It goes where the
    parameters are at the first step, and steps as over a model made in place."""
    def made(device):
        with torch.device(device):
            model = torch.nn.Linear(4, 3)
        scale = LossScale.dynamic(init=8.0, growth_interval=1)
        opt = vega.optim.AdamW(model.parameters(), loss_scale=scale, backend=backend)
        if device == "meta":
            prior = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                model.to_empty(device="cpu")
            finally:
                torch.__future__.set_swap_module_params_on_conversion(prior)
        assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
        with torch.no_grad():
            model.weight.copy_(torch.linspace(-1, 1, 12).view(3, 4))
            model.bias.fill_(0.5)
        return model, scale, opt
    (ours, ours_scale, ours_opt), (theirs, theirs_scale, theirs_opt) = made("meta"), made("cpu")
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, scale, opt in ((ours, ours_scale, ours_opt),
                                  (theirs, theirs_scale, theirs_opt)):
            opt.zero_grad()
            (model(x).square().sum() * scale.loss_scale).backward()
            opt.step()
    assert ours_scale.loss_scale.device.type == "cpu" and float(ours_scale.loss_scale) == 64.0
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p.detach(), q.detach())



@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("how", ["context", "default"])
def test_a_scale_made_under_a_meta_default_device_keeps_its_values(backend, how):
    """A scale made without a device where the default device is meta (made with the model
    inside ``with torch.device("meta")``, or after ``torch.set_default_device("meta")``) is
    made on the CPU, its values kept, and goes where the parameters are at the first step:
    its check of ``init`` read a meta tensor (torch's "Tensor.item() cannot be called on meta
    tensors"), and a scale made there held no values to step with."""
    def made():
        if how == "context":
            with torch.device("meta"):
                return LossScale.dynamic(init=8.0, growth_interval=1), LossScale.static(4.0)
        torch.set_default_device("meta")
        try:
            return LossScale.dynamic(init=8.0, growth_interval=1), LossScale.static(4.0)
        finally:
            torch.set_default_device(None)
    ours = made()
    theirs = LossScale.dynamic(init=8.0, growth_interval=1), LossScale.static(4.0)
    for mine, other in zip(ours, theirs):
        assert not mine.device_given
        assert all(a.device.type == "cpu" and torch.equal(a, b)
                   for a, b in zip(mine.tensors(), other.tensors()))
    got = []
    for scale in (ours[0], theirs[0]):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        opt = vega.optim.AdamW([p], lr=0.1, loss_scale=scale, backend=backend)
        for _ in range(3):
            p.grad = torch.linspace(0.5, 2, 6) * scale.loss_scale
            opt.step()
        got.append((p.detach(), scale.loss_scale))
    assert float(got[0][1]) == 64.0
    assert all(map(torch.equal, *got))


@pytest.mark.parametrize("backend", ["reference", "c"])
@pytest.mark.parametrize("how", ["context", "default"])
def test_a_loss_scaled_class_step_under_a_meta_default_device_steps_as_outside(backend, how):
    """A class step with a loss scale under ``torch.device("meta")`` (or a default device set
    so) of CPU parameters is the step outside it: the prelude's record took the inverse
    scale through ``torch.as_tensor``, which moved it to the meta device ("Cannot copy out
    of meta tensor; no data!"); later steps outside match the steps of one never there."""
    def trained(meta_step):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
        scale = LossScale.dynamic(init=4.0, growth_interval=2)
        opt = vega.optim.AdamW([p], lr=0.1, loss_scale=scale, max_grad_norm=1.0,
                               backend=backend)
        for k in range(3):
            p.grad = torch.linspace(0.5, 2, 6) * scale.loss_scale
            if k == 1 and meta_step and how == "context":
                with torch.device("meta"):
                    opt.step()
            elif k == 1 and meta_step:
                torch.set_default_device("meta")
                try:
                    opt.step()
                finally:
                    torch.set_default_device(None)
            else:
                opt.step()
        return [p.detach(), *scale.tensors(), *opt.state[p].values()]
    assert all(map(torch.equal, trained(True), trained(False)))



@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_scale_on_meta_or_over_meta_parameters_is_refused_by_name(backend):
    """A loss scale on the meta device (``device="meta"``), which holds no values, is refused
    when the optimizer is made (a step raised torch's "Tensor.item() cannot be called on meta
    tensors" looking it up); a scale of values over parameters on the meta device is refused
    at the step, before a state is made (the reference backend's step adjusted the scale in
    place by meta values: "Cannot copy out of meta tensor", the C backend's named its record)."""
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="AdamW: loss_scale is on the meta device"):
        vega.optim.AdamW([p], loss_scale=LossScale.dynamic(device="meta"), backend=backend)
    q = torch.nn.Parameter(torch.empty(3, device="meta"))
    q.grad = torch.empty(3, device="meta")
    scale = LossScale.dynamic(init=8.0)
    opt = vega.optim.AdamW([q], loss_scale=scale, backend=backend)
    with pytest.raises(ValueError, match="AdamW: the gradients are on the meta device"):
        opt.step()
    assert not opt.state and scale.loss_scale.device.type == "cpu"
    assert float(scale.loss_scale) == 8.0 and int(scale.good_steps) == 0



@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_scale_made_under_inference_mode_is_refused_before_the_step_writes(backend):
    """A loss scale made under ``torch.inference_mode()`` holds inference tensors, which a
    class step outside inference mode cannot adjust in place: refused by name before
    anything is written (the step wrote the parameters and states, then raised torch's
    "Inplace update to inference tensor outside InferenceMode", the scale not adjusted);
    inside inference mode it steps."""
    with torch.inference_mode():
        scale = LossScale.dynamic(init=4.0)
    p = torch.nn.Parameter(torch.linspace(-1, 1, 3))
    opt = vega.optim.AdamW([p], lr=0.1, loss_scale=scale, max_grad_norm=1.0, backend=backend)
    p.grad = torch.full((3,), 4.0)
    with pytest.raises(ValueError, match="AdamW: loss_scale holds inference tensors"):
        opt.step()
    assert torch.equal(p.detach(), torch.linspace(-1, 1, 3)) and not opt.state
    assert int(scale.good_steps) == 0
    with torch.inference_mode():
        opt.step()
    assert int(scale.good_steps) == 1 and int(opt.state[p]["step"]) == 1


def test_a_scale_is_one_optimizers_while_it_lives():
    """Each step adjusts the optimizer's scale in place: one scale given to two optimizers
    is refused (the second would unscale by a scale the loss was not scaled by, and the
    counter would advance twice a step), and taken once the first is gone."""
    import gc
    ls = LossScale.dynamic(init=8.0)
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    first = vega.optim.AdamW([p], lr=1e-2, loss_scale=ls)
    p.grad = q.grad = torch.ones(3)
    first.step()
    with pytest.raises(ValueError, match=r"loss_scale is the loss scale of another optimizer "
                                         r"\(AdamW\)"):
        vega.optim.AdamW([q], lr=1e-2, loss_scale=ls).step()
    assert ls.good_steps.item() == 1
    del first
    gc.collect()
    third = vega.optim.AdamW([q], lr=1e-2, loss_scale=ls)
    third.step()
    assert ls.good_steps.item() == 2


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_the_counts_at_the_int32_limit_neither_wrap_nor_stop_growth(backend):
    """A scale whose counts hold 2**31 - 1 (made so, or loaded): a finite step grows it and
    its good steps go back to 0 (in int32, 2**31 - 1 + 1 wrapped to -2**31: the scale did
    not grow, and its count went negative), and an overflow leaves its skipped steps at
    2**31 - 1 (they wrapped to -2**31); the optimizer's state_dict then loads, in
    LossScale.adjust and in the Triton kernel that adjusts it in place."""
    last = 2**31 - 1

    def at_limit():
        return LossScale(torch.tensor(1024.0), torch.tensor(last, dtype=torch.int32),
                         torch.tensor(last, dtype=torch.int32), growth_interval=2000)
    grown = at_limit().adjust(True)
    assert (grown.loss_scale.item(), grown.good_steps.item()) == (2048.0, 0)
    backed = at_limit().adjust(False)
    assert (backed.loss_scale.item(), backed.skipped_steps.item()) == (512.0, last)
    w = torch.nn.Parameter(torch.zeros(300))
    opt = vega.optim.SGD([w], lr=0.1, backend=backend, loss_scale=at_limit())
    w.grad = torch.ones(300)
    opt.step()
    w.grad = torch.full((300,), float("inf"))
    opt.step()
    assert [t.item() for t in opt.loss_scale.tensors()] == [1024.0, 0, last, 0.0]
    opt.load_state_dict(opt.state_dict())
    assert [t.item() for t in opt.loss_scale.tensors()] == [1024.0, 0, last, 0.0]


def test_adjust_in_place_writes_what_adjust_returns():
    """``adjust_`` writes into the scale's own tensors the values ``adjust`` returns, at the
    edges too: the counts at 2**31 - 1, a growth past float32's range, a subnormal scale
    below its floor, a flag of another dtype."""
    edges = [(8.0, 0, 0), (8.0, 2**31 - 1, 2**31 - 1), (3e38, 2, 5), (1e-40, 0, 0),
             (2.0**-126, 1, 2**31 - 2)]
    for (s, n, k) in edges:
        for flag in (True, False, torch.tensor(True), torch.tensor(0, dtype=torch.uint8)):
            ls = LossScale.dynamic(init=s, growth_interval=3)
            ls.good_steps.fill_(n)
            ls.skipped_steps.fill_(k)
            want = ls.adjust(flag)
            mine = ls.tensors()
            assert ls.adjust_(flag) is ls
            assert all(a is b for a, b in zip(ls.tensors(), mine))
            for a, b in zip(ls.tensors(), want.tensors()):
                assert a.dtype == b.dtype and torch.equal(a, b), (s, n, k, flag, a, b)


def test_a_scale_of_meta_tensors_is_made_and_shown_without_its_values():
    """Meta tensors hold no values: the constructor takes them without reading one (a model
    and its optimizer made on the meta device) and repr shows the tensors, not values."""
    meta = torch.device("meta")
    ls = LossScale(torch.tensor(2.0, device=meta), torch.tensor(0, dtype=torch.int32,
                                                                device=meta))
    assert ls.loss_scale.device == meta and ls.is_dynamic
    shown = repr(ls)
    assert shown.startswith("LossScale(dynamic, loss_scale=tensor(..., device='meta'")
    assert "min_scale=tensor(..., device='meta'" in shown
    assert repr(LossScale.static(4.0, device=meta)).startswith(
        "LossScale(static, loss_scale=tensor(..., device='meta'")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_adjust_in_place_keeps_a_scale_of_another_dtype(dtype):
    """The constructor takes a scale tensor of another float dtype; ``adjust_`` writes
    ``adjust``'s values into it at its own dtype (torch.where's out= takes only the dtype
    it computes: a float16 scale was 'Expected out type to be Float but got Half')."""
    for flag, n in ((True, 0), (True, 2), (False, 1)):
        ls = LossScale(torch.tensor(1024.0, dtype=dtype), torch.tensor(n, dtype=torch.int32),
                       growth_interval=3)
        want = ls.adjust(flag)
        mine = ls.tensors()
        assert ls.adjust_(flag) is ls
        assert all(a is b for a, b in zip(ls.tensors(), mine))
        assert ls.loss_scale.dtype == dtype
        assert [float(t) for t in ls.tensors()] == [float(t) for t in want.tensors()]


def test_adjust_in_place_of_a_meta_scale_takes_a_flag_on_the_cpu():
    """A scale on the meta device (a model and its optimizer made there) adjusted with a
    flag made on the CPU (``grads_finite`` of no float leaf, or ``torch.tensor(True)``):
    ``adjust`` takes it, and ``adjust_`` does too (torch.where's out= on meta refused the
    CPU flag: 'Attempting to copy from device cpu to device meta')."""
    ls = LossScale.dynamic(device="meta")
    mine = ls.tensors()
    assert ls.adjust(torch.tensor(True)).loss_scale.device.type == "meta"
    for flag in (torch.tensor(True), torch.tensor(False), vega.grads_finite([])):
        assert ls.adjust_(flag) is ls
    assert all(a is b for a, b in zip(ls.tensors(), mine))
    assert all(t.device.type == "meta" for t in ls.tensors())


@pytest.mark.parametrize("interval", [1, 2, 2**31 - 2, 2**31 - 1])
def test_adjust_in_place_at_the_intervals_bounds_is_torchs_update(interval):
    """``adjust_`` (and ``adjust``) at growth_interval's bounds, 1 and 2**31 - 1, with the
    good steps just below, at and past the interval, against torch._amp_update_scale_ where
    torch's int32 count does not wrap; at 2**31 - 1 a finite step grows the scale and
    restarts the count, and the count never goes negative."""
    last = 2**31 - 1
    for n in sorted({0, max(interval - 2, 0), interval - 1, last}):
        for finite in (True, False):
            ls = LossScale(torch.tensor(1024.0), torch.tensor(n, dtype=torch.int32),
                           growth_interval=interval)
            want = ls.adjust(finite)
            ls.adjust_(finite)
            assert [t.item() for t in ls.tensors()] == [t.item() for t in want.tensors()]
            grows = finite and n >= interval - 1
            assert ls.loss_scale.item() == (2048.0 if grows else 1024.0 if finite else 512.0)
            assert ls.good_steps.item() == (n + 1 if finite and not grows else 0)
            if n < last:
                scale = torch.tensor(1024.0)
                tracker = torch.tensor(n, dtype=torch.int32)
                torch._amp_update_scale_(scale, tracker, torch.tensor(0.0 if finite else 1.0),
                                         2.0, 0.5, interval)
                assert (scale.item(), tracker.item()) == (ls.loss_scale.item(),
                                                          ls.good_steps.item())
