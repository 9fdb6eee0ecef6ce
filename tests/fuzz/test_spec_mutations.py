"""Mutations of the shipped specs through the compiler: every text either compiles or
raises a SpecError that points into it (file:line:col, the line and a caret), never any
other exception; the texts that compile render on every backend, and a sample of them
steps on the C backend as on the reference.

Deterministic (a fixed seed), so a failure reproduces; ``VEGA_FUZZ_N`` sets the number of
mutations per spec (default 40: 1,000 texts over the 25 shipped specs)."""
import os
import random
import re
from pathlib import Path

import pytest
import torch

import vega
from vega import SpecError
from vega.codegen import c as c_backend

SPECS = sorted(Path(vega.__file__).parent.parent.joinpath("specs").glob("*.vega"))
N = int(os.environ.get("VEGA_FUZZ_N", "40"))
TOKENS = ["(", ")", "{", "}", "[", "]", ",", "=", "+", "-", "*", "/", "^", "<", ">", "<=",
          "and", "or", "not", "if", "else", "state", "optimizer", "as", "in", "zeros",
          "rows", "cols", ":", "p", "g", "t", "sqrt(", "norm(", "mean(", "where(", "max(",
          "1e400", "0", "-0.0", "nan", "inf", "pi", "true", "false", "\n", "#", "@", "$",
          "\u00e9", "1e-30", "lr", "x_out", "hyper", "geo", "step", "donate"]
HEADER = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?P<col>\d+): error: .+")


def mutate(text: str, rng: random.Random) -> str:
    """One to three edits: delete, insert or replace a span, duplicate or drop a line,
    swap two words, or change a number."""
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(7)
        i = rng.randrange(len(text) + 1)
        if kind == 0:  # delete a span
            text = text[:i] + text[i + rng.randint(1, 8):]
        elif kind == 1:  # insert a token
            text = text[:i] + rng.choice(TOKENS) + text[i:]
        elif kind == 2:  # replace a span by a token
            text = text[:i] + rng.choice(TOKENS) + text[i + rng.randint(1, 6):]
        elif kind in (3, 4):  # duplicate or drop a line
            lines = text.split("\n")
            k = rng.randrange(len(lines))
            lines[k:k + 1] = [lines[k]] * 2 if kind == 3 else []
            text = "\n".join(lines)
        elif kind == 5:  # swap two words
            words = re.findall(r"[A-Za-z_]\w*", text)
            if len(words) >= 2:
                a, b = rng.sample(words, 2)
                text = re.sub(rf"\b{a}\b", "\0", text, count=1)
                text = re.sub(rf"\b{b}\b", a, text, count=1).replace("\0", b)
        else:  # change a number
            nums = list(re.finditer(r"\d+(\.\d+)?(e-?\d+)?", text))
            if nums:
                m = rng.choice(nums)
                new = rng.choice(["0", "1", "2", "1e308", "1e-320", "0.5", "3", "100000"])
                text = text[:m.start()] + new + text[m.end():]
    return text


def check_error(err: SpecError, text: str, filename: str):
    message = str(err)
    first = message.splitlines()[0]
    m = HEADER.match(first)
    assert m and m["file"] == filename, f"no file:line:col header: {message!r}"
    line, col = int(m["line"]), int(m["col"])
    lines = text.split("\n")
    assert 1 <= line <= len(lines) + 1, message
    rest = message.splitlines()[1:]
    if line <= len(lines):  # the source line and a caret under the column
        assert rest and rest[0].strip() == lines[line - 1].strip(), message
        assert len(rest) >= 2 and "^" in rest[1], message
        assert 1 <= col <= len(lines[line - 1]) + 1, message  # (the caret within the line)
        assert "internal compiler error" not in first, message


def outcomes(path: Path):
    rng = random.Random(f"vega-fuzz-{path.stem}")
    source = path.read_text()
    compiled, errors = [], 0
    for k in range(N):
        text = mutate(source, rng)
        name = f"{path.stem}-mutant-{k}.vega"
        try:
            spec = vega.compile(text, name)
        except SpecError as err:
            check_error(err, text, name)
            errors += 1
        else:
            compiled.append((k, text, spec))
    return compiled, errors


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_mutants_compile_or_raise_a_spec_error(path):
    compiled, errors = outcomes(path)
    assert errors + len(compiled) == N
    for k, text, spec in compiled:
        for backend in ("reference", "c"):
            try:
                source = spec.source(backend, shape=(3, 4))
            except SpecError as err:  # a setting the mutant cannot compile, said so
                check_error(err, text, f"{path.stem}-mutant-{k}.vega")
                continue
            assert isinstance(source, str) and source


@pytest.mark.skipif(not c_backend.available(), reason="no C compiler: no C backend")
def test_compiling_mutants_step_alike_on_c_and_reference():
    """The first compiling mutant of each spec (a step of 2 tensors, 2 updates), when its
    step is defined with the defaults: C against the reference."""
    stepped = 0
    for path in SPECS:
        compiled, _ = outcomes(path)
        for k, text, spec in compiled[:1]:
            gen = torch.Generator().manual_seed(k)
            params = {"w": torch.randn(5, 7, generator=gen, dtype=torch.float64),
                      "b": torch.randn(7, generator=gen, dtype=torch.float64)}
            grads = {n: torch.randn(v.shape, generator=gen, dtype=torch.float64)
                     for n, v in params.items()}
            try:
                state = spec.init(params)
            except (ValueError, TypeError) as err:  # e.g. a default outside its range
                assert not isinstance(err, SpecError) or "internal" not in str(err)
                continue
            ref, c = (params, state), (params, spec.init(params))
            for _ in range(2):
                ref = spec.step(*ref[:1], grads, ref[1], backend="reference")
                c = spec.step(*c[:1], grads, c[1], backend="c")
            for n in params:
                torch.testing.assert_close(c[0][n], ref[0][n], rtol=1e-10, atol=1e-12,
                                           equal_nan=True, msg=lambda m: f"{path.stem} "
                                           f"mutant {k}: {m}\n{text}")
            stepped += 1
    assert stepped >= 3
