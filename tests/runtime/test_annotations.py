"""The public API's annotations as tools read them: ``typing.get_type_hints`` resolves them at
run time (pydantic, typer and jsonargparse read them so), and
what a call gives is what its annotation says, so that a type checker (vega is marked typed,
``vega/py.typed``) neither refuses the documented uses nor infers a wrong type for them."""
import functools
import inspect
import types
import typing

import pytest
import torch
from torch.utils import _pytree as pytree

import vega
import vega.optim
import vega.schedule
from vega.runtime.loss_scale import LossScale
from vega.runtime.optimizer import SpecOptimizer

# each name a user reaches: vega's, vega.optim's and vega.schedule's (vega.<name>_step and
# the vega.optim classes are CompiledSpec's methods and SpecOptimizer's subclasses)
_LAZY = {*vega._LAZY, *vega.optim._SPECS}


def _functions(obj, name: str):
    """``obj`` and, for a class, each function it defines (methods, properties)."""
    yield name, obj
    if inspect.isclass(obj):
        for key, value in vars(obj).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            elif isinstance(value, functools.cached_property):
                value = value.func
            if inspect.isfunction(value):
                yield f"{name}.{key}", value


def test_the_public_annotations_resolve_at_run_time():
    checked, failed = 0, []
    for module in (vega, vega.optim, vega.schedule):
        for name in module.__all__:
            if name in _LAZY:
                continue
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            for label, fn in _functions(obj, f"{module.__name__}.{name}"):
                try:
                    typing.get_type_hints(fn)
                except Exception as err:  # (a name only a type checker sees: NameError)
                    failed.append(f"{label}: {type(err).__name__}: {err}")
                checked += 1
    assert checked > 100 and not failed, "\n".join(failed)


def _is(value, hint) -> bool:
    """``isinstance`` of an annotation: a class, a union or a generic's origin."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    return isinstance(value, origin or hint)


def test_the_optimizer_a_spec_makes_is_the_class_its_annotations_name():
    # spec.optimizer(...) was annotated torch.optim.Optimizer, which has none of what the
    # docs use of vega's optimizers (opt.torch_state_dict(), opt.loss_scale.scale(loss)):
    # a type checker refused them on the optimizer of one's own spec (vega.compile(...))
    spec = vega.builtin("adamw")
    made = typing.get_type_hints(vega.CompiledSpec.optimizer)["return"]
    cls = typing.get_type_hints(vega.CompiledSpec.optimizer_class.func)["return"]
    opt = spec.optimizer([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    assert _is(opt, made) and hasattr(made, "torch_state_dict"), made
    assert typing.get_origin(cls) is type and typing.get_args(cls) == (made,), cls
    assert issubclass(spec.optimizer_class, made)


def test_the_fused_step_settings_of_an_optimizer_are_declared_with_their_types():
    # opt.loss_scale, opt.max_grad_norm and opt.skip_nonfinite, which the docs read and set
    # (opt.loss_scale.scale(loss).backward(); opt.max_grad_norm = 0.5), were set in
    # __init__ from unannotated arguments: mypy said 'Cannot determine type of
    # "loss_scale" [has-type]' in a user's script that read one of a SpecOptimizer
    declared = typing.get_type_hints(SpecOptimizer)
    p = torch.nn.Parameter(torch.zeros(2))
    for settings in ({}, {"loss_scale": LossScale.dynamic(), "max_grad_norm": 1.0},
                     {"skip_nonfinite": True, "max_grad_norm": 2.0}):
        opt = vega.optim.AdamW([p], lr=1e-3, **settings)
        for name in ("loss_scale", "max_grad_norm", "skip_nonfinite"):
            assert name in declared, name
            assert _is(getattr(opt, name), declared[name]), (name, getattr(opt, name))


def test_a_schedule_is_typed_a_tensor_on_a_step_tensor_and_a_float_on_an_int():
    # Schedule.__call__ was unannotated: a checker took sched(k) as Any, where the value on
    # a step tensor is a tensor (what a step reads) and on an int a float (for logging)
    overloads = getattr(typing, "get_overloads", None)
    if overloads is None:
        pytest.skip("typing.get_overloads is Python 3.11's")
    sched = vega.schedule.warmup_cosine_decay(0.0, 1e-3, 10, 90)
    cases = [typing.get_type_hints(f) for f in overloads(vega.schedule.Schedule.__call__)]
    assert len(cases) == 2
    for hints in cases:
        step = torch.tensor(3) if hints["step"] is torch.Tensor else 3
        assert _is(step, hints["step"]) and _is(sched(step), hints["return"]), hints
    hints = typing.get_type_hints(vega.schedule.Schedule.__call__)
    assert _is(sched(3), hints["return"]) and _is(sched(torch.tensor(3)), hints["return"])


def test_an_optimizer_step_is_typed_none_without_a_closure_and_its_loss_with_one():
    # SpecOptimizer.step and LBFGS.step were unannotated: mypy --strict refused opt.step()
    # in a typed training loop ('Call to untyped function "step" ... [no-untyped-call]'), and
    # the loss that opt.step(closure) returns was Any
    overloads = getattr(typing, "get_overloads", None)
    if overloads is None:
        pytest.skip("typing.get_overloads is Python 3.11's")
    for cls in (SpecOptimizer, vega.optim.LBFGS):
        cases = [typing.get_type_hints(f) for f in overloads(cls.step)]
        assert len(cases) == 2 and cases[0]["closure"] is type(None), cls
        assert cases[0]["return"] is type(None), cls
        # (any object the closure returns, not torch's float: a TypeVar, free)
        loss_type = cases[1]["return"]
        assert isinstance(loss_type, typing.TypeVar), (cls, loss_type)
        assert loss_type.__bound__ is None and not loss_type.__constraints__, cls
        assert typing.get_args(cases[1]["closure"]) == ([], loss_type), cls
        impl = typing.get_type_hints(cls.step)["return"]
        assert set(typing.get_args(impl)) == {loss_type, type(None)}, (cls, impl)
        p = torch.nn.Parameter(torch.ones(3))
        opt = (vega.optim.SGD if cls is SpecOptimizer else cls)([p], lr=0.1)
        p.grad = torch.ones(3)
        assert opt.step() is None
        loss = torch.tensor(2.0)
        assert opt.step(lambda: loss) is loss
        assert opt.step(lambda: "a loss of one's own") == "a loss of one's own"


def test_the_gradient_transformations_are_typed_to_keep_the_structure_they_take():
    # clip_by_global_norm, clip_by_value, LossScale.unscale and LossScale.step were
    # unannotated: mypy --strict refused each call of them in a typed script
    # ('Call to untyped function "clip_by_global_norm" in typed context'), and what they
    # return, a pytree of the structure they were given, was Any
    grads = {"w": torch.ones(2, 2), "b": [torch.ones(2), torch.arange(3)]}
    ls = LossScale.static(2.0)
    state = ({"w": torch.zeros(2, 2)}, torch.zeros(()))
    calls = [(vega.clip_by_global_norm, (grads, 1.0), "grads"),
             (vega.clip_by_value, (grads, 0.5), "grads"),
             (ls.unscale, (grads,), "grads")]
    for fn, args, given in calls:
        hints = typing.get_type_hints(fn)
        assert hints["return"] is hints[given], fn
        got = fn(*args)
        assert pytree.tree_structure(got) == pytree.tree_structure(args[0]), fn
    # (a bound is a number or a 0-d tensor, docs/training.md: both are called with)
    for fn, bound in ((vega.clip_by_global_norm, "max_norm"), (vega.clip_by_value, "max")):
        hint = typing.get_type_hints(fn)[bound]
        for value in (1.0, torch.tensor(1.0)):
            assert _is(value, hint), (fn, hint)
            got = fn(grads, value)
            assert pytree.tree_structure(got) == pytree.tree_structure(grads), fn
    hints = typing.get_type_hints(LossScale.step)
    assert typing.get_args(hints["return"]) == (hints["state"], LossScale)
    assert typing.get_args(hints["step_fn"]) == ([hints["grads"]], hints["state"])
    new, scale = ls.step(grads, lambda g: state, state)
    assert pytree.tree_structure(new) == pytree.tree_structure(state)
    assert isinstance(scale, LossScale)


def test_a_class_step_gives_its_refusal_under_transforms_what_its_annotation_names():
    # SpecOptimizer.step hands engine.class_step_transforms a function that gives the name of
    # its functional step (a spec's own has none), which the check's annotation, rule: str,
    # did not allow: mypy, which reads the step's body now that step is typed, refused it
    from vega.runtime import engine
    hint = typing.get_type_hints(engine.class_step_transforms)["rule"]
    opt = vega.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    assert _is(opt._functional_step, hint) and _is("vega.lbfgs_step", hint), hint


def test_the_names_made_when_first_used_are_typed_to_admit_their_values():
    # vega.<name>, vega.<name>_init and vega.<name>_step, and vega.optim's classes, are made
    # by a module __getattr__. Unannotated, pyright inferred vega.__getattr__'s type from its
    # body, CompiledSpec, and refused the README's first call, vega.adamw_init(params)
    # ('Object of type "CompiledSpec" is not callable'); vega.optim's gave type[SpecOptimizer],
    # whose loss_scale, LossScale | None, it refused to call .scale on unchecked, as the
    # README does of a class made with a loss_scale. Each is Any: its type is its name's
    for module in (vega, vega.optim):
        hint = typing.get_type_hints(module.__getattr__)["return"]
        assert hint is typing.Any, (module, hint)
    assert isinstance(vega.adamw, vega.CompiledSpec) and callable(vega.adamw_init)
    assert issubclass(vega.optim.AdamW, SpecOptimizer)


def test_a_functional_step_is_typed_a_tuple_of_two_or_of_three():
    # CompiledSpec.step had no return annotation and an untyped decorator: pyright inferred
    # its body's, a pair or a triple, and refused the documented
    # params, state = spec.step(...) ('Tuple size mismatch; expected 2 but received 3')
    hint = typing.get_type_hints(vega.CompiledSpec.step)["return"]
    assert typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,)
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    state = vega.sgd.init(params)
    two = vega.sgd.step(params, grads, state, lr=0.1)
    three = vega.sgd.step(params, grads, state, lr=0.1, loss_scale=LossScale.static(1.0))
    assert _is(two, hint) and len(two) == 2 and _is(three, hint) and len(three) == 3
    # (the decorator keeps the step's signature and hints, which vega.sgd_step shows, and
    # is typed to: it gives back its function's own type, where untyped it made the step Any)
    from vega.runtime import engine
    deco = typing.get_type_hints(engine.outside_autocast)
    assert isinstance(deco["fn"], typing.TypeVar) and deco["return"] is deco["fn"], deco
    assert typing.get_type_hints(vega.sgd_step) == typing.get_type_hints(vega.CompiledSpec.step)
    assert "loss_scale" in inspect.signature(vega.sgd_step).parameters


def test_a_mode_is_typed_to_give_the_structure_of_the_params_it_takes():
    # CompiledSpec.mode ("params as they look in mode name") had no annotations: pyright
    # inferred its body's return, a list or tuple, and refused indexing its value by a
    # parameter's name (schedule-free's sf.mode("eval", params, state)["w"])
    hints = typing.get_type_hints(vega.CompiledSpec.mode)
    assert hints["return"] is hints["params"]
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    spec = vega.builtin("schedule_free_adamw")
    state = spec.init(params)
    params, state = spec.step(params, grads, state, lr=1e-3)
    got = spec.mode("eval", params, state)
    assert pytree.tree_structure(got) == pytree.tree_structure(params)


def test_an_lbfgs_step_is_typed_to_give_the_structure_of_the_params_it_takes():
    # lbfgs_step had no return annotation: pyright inferred its body's, whose params were a
    # list or tuple to it, and refused indexing them by a parameter's name
    # (params, state = vega.lbfgs_step(...); params["w"])
    hints = typing.get_type_hints(vega.lbfgs_step)
    assert typing.get_args(hints["return"])[0] is hints["params"]
    params, grads = {"w": torch.ones(2)}, {"w": torch.ones(2)}
    got, state = vega.lbfgs_step(params, grads, vega.lbfgs_init(params), lr=0.1)
    assert pytree.tree_structure(got) == pytree.tree_structure(params)
    assert _is(state, typing.get_args(hints["return"])[1])
