"""Every example mistake gives a SpecError at the right place, in the user's terms."""
import random

import pytest

import vega
from vega.dsl.examples import ERROR_TABLE, PARSE_ERROR_EXAMPLES
from vega.errors import SpecError


@pytest.mark.parametrize("source,fragment,line,column", ERROR_TABLE,
                         ids=[f"{i}:{e[1][:30]}" for i, e in enumerate(ERROR_TABLE)])
def test_error_table(source, fragment, line, column):
    with pytest.raises(SpecError) as info:
        vega.compile(source, "mistake.vega")
    err = info.value
    assert fragment in err.message, str(err)
    assert (err.line, err.column) == (line, column), str(err)
    text = str(err)
    assert text.startswith(f"mistake.vega:{line}:{column}: error: ")
    # the source line is quoted and the caret sits under the reported column
    src_line, caret = text.splitlines()[1:3]
    assert src_line.strip() == source.splitlines()[line - 1].strip()
    assert caret.index("^") - 4 == column - 1
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("label", list(PARSE_ERROR_EXAMPLES))
def test_parse_examples_are_labelled(label):
    """Each example of the parse-error table is itself explained by its own label."""
    for example in PARSE_ERROR_EXAMPLES[label]:
        with pytest.raises(SpecError) as info:
            vega.compile(example)
        assert label in info.value.message, (example, info.value.message)


def test_compile_file_names_the_file(tmp_path):
    path = tmp_path / "bad.vega"
    path.write_text("optimizer o(lr = 1e-3) {\n  p = p - lr * gg\n}\n")
    with pytest.raises(SpecError, match=r"bad\.vega:2:16: error: undefined name 'gg' \(did you "
                                        r"mean 'g'\?\)"):
        vega.compile_file(path)
    with pytest.raises(FileNotFoundError, match="missing.vega"):
        vega.compile_file(tmp_path / "missing.vega")


def test_compile_rejects_non_text():
    with pytest.raises(TypeError, match="a spec is text"):
        vega.compile(b"optimizer o() { p = p }")


GOOD = vega.adam.source_text


def _mutations(text, rng, n):
    alphabet = list("(){}[],=+-*/^<>#;:.0123456789 \n") + ["state", "if", "else", "optimizer",
                                                          "where(", "sqrt(", "true", "and", "p",
                                                          "g", "t", "mu", "lr"]
    for _ in range(n):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                del chars[i]
            elif op < 0.8:
                chars.insert(i, rng.choice(alphabet))
            else:
                chars[i] = rng.choice(alphabet)
        yield "".join(chars)


def test_no_input_escapes_as_a_traceback():
    """Random edits of a real spec either compile or raise SpecError with a location."""
    rng = random.Random(1234)
    compiled = 0
    for text in _mutations(GOOD, rng, 400):
        try:
            spec = vega.compile(text, "fuzz.vega")
        except SpecError as err:
            assert str(err).startswith("fuzz.vega")
            assert "internal compiler error" not in err.message, (text, str(err))
        else:
            compiled += 1
            for flags in spec._spec.flag_settings():
                spec._spec.program(flags)
    assert compiled < 400  # the mutations do break specs


def test_deep_nesting_is_a_spec_error():
    text = "optimizer o() { p = " + "(" * 3000 + "p" + ")" * 3000 + " }"
    try:
        vega.compile(text)
    except SpecError as err:
        assert "nests too deeply" in err.message
