"""Names the API already uses cannot name a hyperparameter or a state: a hyperparameter
`donate` would be taken for the step's keyword (a pure step then mutated its input), and
a state `step` would overwrite the step counter."""
import pytest

import vega
from vega import SpecError
from vega.dsl.check import API_NAMES


@pytest.mark.parametrize("name", API_NAMES)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_a_keyword_of_the_api_cannot_name_a_hyperparameter(name, kind):
    default = "0.5" if kind == "float" else "false"
    text = f"optimizer a(lr = 1e-3, {name} = {default}) {{\n    p = p - lr * g\n}}"
    col = text.index(name) + 1
    with pytest.raises(SpecError, match=rf"<spec>:1:{col}: error: '{name}' cannot name a "
                                        r"hyperparameter: it is a keyword of vega's steps or optimizer classes"):
        vega.compile(text)


def test_step_cannot_name_a_state():
    text = "optimizer a(lr = 1e-3) {\n    state step = zeros\n    step = step + g\n" \
           "    p = p - lr * step\n}"
    with pytest.raises(SpecError, match=r"<spec>:2:11: error: cannot declare state 'step': "
                                        r"it is the step counter"):
        vega.compile(text)


def test_names_that_only_begin_like_one_are_free():
    spec = vega.compile("optimizer a(lr = 1e-3, donated = 0.5, steps = 1.0) {\n"
                        "    state stepped = zeros\n    stepped = stepped + g\n"
                        "    p = p - lr * donated * steps * stepped\n}")
    assert [h.name for h in spec.hypers] == ["lr", "donated", "steps"]


def test_the_language_page_lists_every_reserved_keyword():
    import pathlib
    page = (pathlib.Path(__file__).parents[2] / "docs" / "language.md").read_text()
    reserved = page[page.index("Reserved names:"):page.index("## Expressions")]
    assert [n for n in API_NAMES if f"`{n}`" not in reserved] == []
