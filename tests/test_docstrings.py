"""The public API documents itself: every public name, method and property has a
docstring (``help(vega.X)`` says what it is), and the examples in docstrings run."""
import ast
import doctest
import inspect
import re

import pytest

import vega
import vega.optim
import vega.schedule
from vega.runtime import io, lbfgs, loss_scale, spec, transforms, tree


def _public_names():
    """(label, object) of every public name of vega, vega.optim and vega.schedule (one
    shipped spec's, the others alike; the schedules' classes), and of the public members
    of their classes."""
    out = []
    shipped = set(vega._LAZY)
    for mod, names in ((vega, [n for n in vega.__all__ if n not in shipped]
                        + ["adamw", "adamw_init", "adamw_step"]),
                       (vega.optim, ["SpecOptimizer", "AdamW", "LBFGS"]),
                       # (the schedules' classes too, which add_safe_globals names)
                       (vega.schedule, vega.schedule.__all__ + [
                           n for n, v in vars(vega.schedule).items()
                           if inspect.isclass(v) and issubclass(v, vega.schedule.Schedule)])):
        for name in names:
            obj = getattr(mod, name)
            out.append((f"{mod.__name__}.{name}", obj))
            if not inspect.isclass(obj):
                continue
            for cls in obj.__mro__:
                if not cls.__module__.startswith("vega"):
                    continue
                for member, value in vars(cls).items():
                    if member.startswith("_") or not (
                            callable(value) or isinstance(value, (property, classmethod,
                                                                  staticmethod))
                            or inspect.isdatadescriptor(value)):
                        continue
                    out.append((f"{mod.__name__}.{name}.{member}", value))
    return out


@pytest.mark.parametrize("label,obj", _public_names(), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_every_public_name_has_a_docstring(label, obj):
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    # (a slot's is its entry in a __slots__ dict, which inspect.getdoc and help() read;
    # else the object's own, not one inherited from torch's class)
    doc = obj.fget.__doc__ if isinstance(obj, property) else inspect.getdoc(obj) \
        if inspect.ismemberdescriptor(obj) else obj.__doc__
    assert doc and doc.strip(), f"{label} has no docstring"


@pytest.mark.parametrize("module", [vega, vega.optim, vega.schedule, spec, io, lbfgs,
                                    loss_scale, transforms, tree],
                         ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def _listed_defaults(text: str) -> dict:
    """``name=value`` pairs of a docstring's listing of defaults, the values evaluated."""
    found = {}
    for name, value in re.findall(r"\b(\w+)=([^`,;() ]+)", text):
        try:
            found[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            continue
    return found


@pytest.mark.parametrize("cls_name", ["SGD", "AdamW", "Muon", "LBFGS"])
def test_a_class_docstring_gives_its_signature_defaults(cls_name):
    """The defaults an optimizer class's docstring lists (its ``Also:`` line, LBFGS's
    hyperparameters) are its constructor's."""
    cls = getattr(vega.optim, cls_name)
    doc = cls.__doc__
    text = doc.split("Also:", 1)[1] if "Also:" in doc else doc
    listed = _listed_defaults(text.replace("\n", " "))
    params = inspect.signature(cls).parameters
    checked = {n: v for n, v in listed.items() if n in params}
    assert len(checked) >= 5, (cls_name, listed)
    for name, value in checked.items():
        assert params[name].default == value, (cls_name, name, value, params[name].default)
    # (the hyperparameters listed: the spec's)
    for h in getattr(getattr(cls, "spec", None), "hypers", ()):
        shown = str(h.default).lower() if h.type == "bool" else str(h.default)
        assert f"    {h.name}: {h.type} = {shown}" in doc


def test_init_takes_its_hypers_as_its_docstring_says():
    """``init``'s docstring: hyperparameters are checked as a step checks them, and decide
    which states there are and their first values."""
    import torch
    params = {"w": torch.ones(3)}
    doc = " ".join(spec.CompiledSpec.init.__doc__.split())
    assert "checked as a step checks them" in doc
    with pytest.raises(ValueError, match="lr=-1.0 is outside its range"):
        vega.adamw_init(params, lr=-1.0)
    assert "sgd's ``momentum=0`` keeps no buffer" in doc
    assert sorted(vega.sgd_init(params, momentum=0.0)) == ["step"]
    assert "``amsgrad=True`` keeps ``nu_max``" in doc
    assert "nu_max" in vega.adam_init(params, amsgrad=True)
    assert "adagrad's ``initial_accumulator_value``" in doc
    assert torch.equal(vega.adagrad_init(params, initial_accumulator_value=0.5)["acc"]["w"],
                       torch.full((3,), 0.5))


def test_step_takes_its_hypers_as_its_docstring_says():
    """``step``'s docstring: a float hyperparameter is a number, a 0-d tensor or any callable
    of the step counter (a plain number where an ``if`` reads it); a bool one True or
    False."""
    import torch
    params = {"w": torch.ones(3)}
    doc = " ".join(spec.CompiledSpec.step.__doc__.split())
    assert "any callable of the step counter" in doc and "a bool one True or False" in doc
    state = vega.adamw_init(params)
    for lr in (1e-3, torch.tensor(1e-3), vega.schedule.constant(1e-3), lambda k: k * 0 + 1e-3):
        vega.adamw_step(params, params, state, lr=lr, backend="reference")
    with pytest.raises(ValueError, match="must be True or False"):
        vega.adamw_step(params, params, state, amsgrad=1, backend="reference")
    with pytest.raises(ValueError, match="must be a plain number"):
        vega.sgd_step(params, params, vega.sgd_init(params), momentum=torch.tensor(0.9))


def test_the_package_docstring_names_every_public_name():
    """``help(vega)`` maps the API: every name of ``vega.__all__`` but the shipped specs'
    (``vega.<name>``, ``_init``, ``_step``, given by pattern) is in the package docstring."""
    names = [n for n in vega.__all__ if n not in vega._LAZY]
    missing = [n for n in names if n not in vega.__doc__]
    assert not missing


def test_compile_file_refuses_a_path_that_is_not_one():
    # (as its docstring says; None was os.fspath's TypeError, which named no argument)
    for path in (None, 3, ["a.vega"]):
        with pytest.raises(TypeError, match=r"compile_file: path=.* must be a file's path"):
            vega.compile_file(path)
