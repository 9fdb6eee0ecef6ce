"""The shipped specs against outside oracles: torch.optim (for-loop) and optax (JAX, float64).

The registry of cases lives in ``tests/oracles.py``. Every comparison runs 20 steps
and checks the parameters and every state tensor after each step.
"""
import jax
import pytest
import torch

import vega

try:
    import oracles
except ImportError:  # tests/ made a package
    from tests import oracles

jax.config.update("jax_enable_x64", True)

DTYPES = [torch.float64, torch.float32]


def _fields(snap: dict) -> set[str]:
    """The state fields of a snapshot (``mu`` of ``mu.w``), without ``p`` and ``step``."""
    return {name.split(".")[0] for name in snap} - {"p", "step"}


# -- the registry itself ----------------------------------------------------------

@pytest.mark.parametrize("case", oracles.CASES, ids=repr)
def test_case_spells_out_every_hyperparameter(case):
    spec = case.compiled
    assert set(case.hypers) == {h.name for h in spec.hypers}, case.id
    for h in spec.hypers:
        if h.type == "float":
            value = case.hypers[h.name]
            # a default value would hide a mix-up of names; 0 switches a term off
            assert value != h.default or value == 0, (
                f"{case.id}: {h.name}={value} is the default; pick another value")


def test_registry_covers_every_flag_setting():
    for name in sorted({c.spec for c in oracles.CASES}):
        settings = vega.builtin(name)._spec.flag_settings()
        covered = [c.flags for c in oracles.CASES if c.spec == name]
        missing = [s for s in settings if s not in covered]
        assert not missing, f"{name}: no oracle case for flag settings {missing}"


def test_gradients_exercise_the_amsgrad_running_max():
    """The seeded gradients make nu fall below its running max, else AMSGrad goes untested."""
    case = next(c for c in oracles.CASES if c.id == "adam-amsgrad")
    snaps = oracles.torch_trajectory(case, oracles.make_params(torch.float64),
                                     oracles.make_grads(torch.float64))
    assert any(not torch.equal(s[f"nu_max.{k}"], s[f"nu.{k}"])
               for s in snaps for k in oracles.SHAPES)


# -- against torch.optim -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", oracles.CASES, ids=repr)
def test_functional_matches_torch(case, dtype):
    params, grads = oracles.make_params(dtype), oracles.make_grads(dtype)
    got = oracles.functional_trajectory(case.compiled, case.hypers, params, grads)
    want = oracles.torch_trajectory(case, params, grads)
    assert _fields(got[0]) == set(case.torch_state)
    oracles.assert_trajectories_close(got, want, rtol=oracles.RTOL[dtype], check_dtype=True,
                                      who=f"{case.id} {dtype} functional vs torch")
    for k, snap in enumerate(got, start=1):
        assert snap["step"].dtype == torch.int32 and int(snap["step"]) == k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", oracles.CASES, ids=repr)
def test_optimizer_class_matches_torch(case, dtype):
    params, grads = oracles.make_params(dtype), oracles.make_grads(dtype)
    got = oracles.class_trajectory(case.optimizer_class, case.hypers, params, grads)
    want = oracles.torch_trajectory(case, params, grads)
    assert _fields(got[0]) == set(case.torch_state)
    oracles.assert_trajectories_close(got, want, rtol=oracles.RTOL[dtype], check_dtype=True,
                                      who=f"{case.id} {dtype} vega.optim vs torch")
    for k, snap in enumerate(got, start=1):
        for name in oracles.SHAPES:
            assert snap[f"step.{name}"].dtype == torch.int32 and int(snap[f"step.{name}"]) == k


# -- against optax -------------------------------------------------------------------

@pytest.mark.parametrize("case", oracles.OPTAX_CASES, ids=repr)
def test_functional_matches_optax(case):
    params, grads = oracles.make_params(torch.float64), oracles.make_grads(torch.float64)
    got = oracles.functional_trajectory(case.compiled, case.hypers, params, grads)
    want = oracles.optax_trajectory(case, params, grads)
    assert _fields(want[0]) == set(case.optax_state) and set(case.optax_state) <= _fields(got[0])
    # optax's count is the number of completed updates, like vega's step
    oracles.assert_trajectories_close(got, want, rtol=1e-10,
                                      who=f"{case.id} float64 functional vs optax")


# -- a user's spec: AdaBelief ----------------------------------------------------------

ADABELIEF = """
# AdaBelief (Zhuang et al., 2020), Algorithm 2: the second moment tracks the
# squared deviation of the gradient from its (new) running mean, plus eps.
optimizer adabelief as AdaBelief(lr = 1e-3 in [0, inf), b1 = 0.9 in [0, 1),
                                 b2 = 0.999 in [0, 1), eps = 1e-16 in [0, inf)) {
    state mu = zeros
    state s = zeros
    mu = b1 * mu + (1 - b1) * g
    s = b2 * s + (1 - b2) * (g - mu) ^ 2 + eps
    mu_hat = mu / (1 - b1 ^ t)
    s_hat = s / (1 - b2 ^ t)
    p = p - lr * mu_hat / (sqrt(s_hat) + eps)
}
"""
ADABELIEF_HYPERS = dict(lr=3e-2, b1=0.8, b2=0.95, eps=1e-6)


def adabelief_torch(params, grads, *, lr, b1, b2, eps):
    """The paper's rule by hand, one snapshot per step."""
    p = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in params.items()}
    s = {k: torch.zeros_like(v) for k, v in params.items()}
    snaps = []
    for t, g in enumerate(grads, start=1):
        for k in p:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            s[k] = b2 * s[k] + (1 - b2) * (g[k] - mu[k]) ** 2 + eps
            mu_hat = mu[k] / (1 - b1 ** t)
            s_hat = s[k] / (1 - b2 ** t)
            p[k] = p[k] - lr * mu_hat / (torch.sqrt(s_hat) + eps)
        snap = {f"p.{k}": v.clone() for k, v in p.items()}
        snap.update({f"mu.{k}": v.clone() for k, v in mu.items()})
        snap.update({f"s.{k}": v.clone() for k, v in s.items()})
        snaps.append(snap)
    return snaps


@pytest.mark.parametrize("api", ["functional", "class"])
def test_user_adabelief_matches_hand_written_torch(api):
    spec = vega.compile(ADABELIEF)
    params, grads = oracles.make_params(torch.float64), oracles.make_grads(torch.float64)
    state = spec.init(params)
    assert vega.state_names(state) == ["mu.w", "mu.b", "mu.s", "s.w", "s.b", "s.s", "step"]
    if api == "functional":
        got = oracles.functional_trajectory(spec, ADABELIEF_HYPERS, params, grads)
    else:
        got = oracles.class_trajectory(spec.optimizer_class, ADABELIEF_HYPERS, params, grads)
    want = adabelief_torch(params, grads, **ADABELIEF_HYPERS)
    oracles.assert_trajectories_close(got, want, rtol=1e-10, check_dtype=True,
                                      who=f"adabelief {api} vs hand-written torch")


# -- the comparison helper -----------------------------------------------------------

def test_assert_close_accepts_matching_nan_and_inf():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, nan, inf, -inf, 2.0], dtype=torch.float64)
    e = torch.tensor([1.0 + 1e-12, nan, inf, -inf, 2.0], dtype=torch.float64)
    oracles.assert_close(a, e, rtol=1e-10, what="leaf 'x'", step=3)


@pytest.mark.parametrize("actual, expected, message", [
    ([1.0, float("nan")], [1.0, 2.0], "NaN positions differ"),
    ([1.0, 2.0], [1.0, float("nan")], "NaN positions differ"),
    ([float("inf"), 2.0], [float("-inf"), 2.0], "+inf positions differ"),
    ([1.0, 2.0], [1.0, 2.001], "differ beyond rtol"),
])
def test_assert_close_names_leaf_and_step_on_failure(actual, expected, message):
    a = torch.tensor(actual, dtype=torch.float64)
    e = torch.tensor(expected, dtype=torch.float64)
    with pytest.raises(AssertionError) as err:
        oracles.assert_close(a, e, rtol=1e-6, what="leaf 'mu.w'", step=7)
    text = str(err.value)
    assert message in text and "leaf 'mu.w'" in text and "step 7" in text


def test_assert_close_judges_small_values_by_the_leaf_scale():
    e = torch.tensor([100.0, 1e-9], dtype=torch.float64)
    # 5e-9 off on a near-zero element of a leaf of scale 100: within 1e-10 * 100
    oracles.assert_close(e + torch.tensor([0.0, 5e-9], dtype=torch.float64), e, rtol=1e-10)
    with pytest.raises(AssertionError):
        oracles.assert_close(e + torch.tensor([0.0, 5e-8], dtype=torch.float64), e, rtol=1e-10)
    with pytest.raises(AssertionError):  # an explicit, smaller scale is stricter
        oracles.assert_close(e + torch.tensor([0.0, 5e-9], dtype=torch.float64), e, rtol=1e-10,
                             scale=1.0)


def test_trajectories_use_each_leafs_largest_magnitude():
    f64 = torch.float64
    want = [{"mu.s": torch.tensor(1.0, dtype=f64)}, {"mu.s": torch.tensor(1e-8, dtype=f64)}]
    near = [{"mu.s": torch.tensor(1.0, dtype=f64)}, {"mu.s": torch.tensor(1.5e-8, dtype=f64)}]
    far = [{"mu.s": torch.tensor(1.0, dtype=f64)}, {"mu.s": torch.tensor(1e-4, dtype=f64)}]
    oracles.assert_trajectories_close(near, want, rtol=1e-5, who="t")
    with pytest.raises(AssertionError, match="leaf 'mu.s' at step 2"):
        oracles.assert_trajectories_close(far, want, rtol=1e-5, who="t")
    with pytest.raises(AssertionError, match="missing"):
        oracles.assert_trajectories_close([{}, {}], want, rtol=1e-5, who="t")
