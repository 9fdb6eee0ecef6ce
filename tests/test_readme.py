"""The README's examples run as written, and its test command is what CI runs; README and
docs speak of the project only and link only to files in the repository."""
import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci and ci[-1] in (ROOT / "README.md").read_text()


def _pins() -> list[tuple[str, str, str]]:
    """constraints.txt's pins: (name, version, environment marker or "")."""
    pins = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0]  # (a comment, of its own line or after a pin)
        if "==" in line:
            pin, _, marker = line.partition(";")
            name, version = pin.split("==")
            pins.append((name.strip(), version.strip(), marker.strip()))
    return pins


def _readme_python() -> tuple[int, int]:
    return tuple(map(int, re.search(r"with Python (\d+)\.(\d+)\+",
                                    (ROOT / "README.md").read_text()).groups()))


def test_the_readme_python_is_the_one_pyproject_asks_for():
    # the README's commands are the set-up for every Python vega supports
    asked = re.search(r'requires-python = ">=(\d+)\.(\d+)"',
                      (ROOT / "pyproject.toml").read_text()).groups()
    assert _readme_python() == tuple(map(int, asked))


def _supported() -> list[tuple[int, int]]:
    """The Pythons the README's set-up is for: from the README's to 3.13, or to the one
    running the tests where that is newer."""
    named = _readme_python()
    return [(3, minor) for minor in range(named[1], max(13, sys.version_info[1]) + 1)]


def _shown(python: tuple[int, int]) -> str:
    return f"{python[0]}.{python[1]}"


def _pythons(marker: str) -> list[tuple[int, int]]:
    """The Pythons of ``_supported`` on which a pin with ``marker`` applies."""
    from packaging.markers import Marker  # (pytest's dependency)
    return [v for v in _supported() if not marker or Marker(marker).evaluate(
        {"python_version": _shown(v), "python_full_version": f"{_shown(v)}.0"})]


def test_each_pin_names_one_version_for_each_python():
    # a package pinned on one Python and not another would install unpinned there; two of
    # its pins on one Python, a conflict pip reports in other words than the Python's
    pins: dict[str, list] = {}
    for name, version, marker in _pins():
        pins.setdefault(name, []).extend(_pythons(marker))
    every = _supported()
    assert {name: sorted(found) for name, found in pins.items() if sorted(found) != every} == {}


def test_the_readme_python_is_one_every_pinned_version_installs_on():
    # the README's commands install constraints.txt's pins: each pin installed here must
    # accept the oldest Python it is pinned for (numpy 2.4.6 and jax 0.10.2 need 3.11, and
    # are pinned from 3.11 on)
    from importlib import metadata
    too_new = []
    for name, version, marker in _pins():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version.split("+")[0] != version:  # not the pin's metadata
            continue
        pythons = _pythons(marker)
        if not pythons:  # (a pin for none of them)
            continue
        needs = dist.metadata.get("Requires-Python") or ""
        too_new += [f"{name}=={version}: Requires-Python {needs}, pinned from "
                    f"{_shown(pythons[0])}"
                    for m in re.finditer(r">=\s*(\d+)\.(\d+)", needs)
                    if (int(m[1]), int(m[2])) > pythons[0]]
    assert not too_new, f"README says Python {_shown(_readme_python())}+, but {too_new}"


def _pages():
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# Pages that are not in the repository (named in capitals: docs/design.md is the
# project's own), and sentences about how the work went rather than about the project.
OUTSIDE = ("SEMANTICS.md", "DESIGN.md")
FORBIDDEN = ("the seeds", "this session", "so far", "the run before this one", "the issue's")


def test_pages_speak_of_the_project_only():
    found = [f"{page.relative_to(ROOT)}:{n}: {phrase!r}"
             for page in _pages()
             for n, line in enumerate(page.read_text().splitlines(), 1)
             for phrase in (*FORBIDDEN, *OUTSIDE)
             if (phrase in line if phrase in OUTSIDE else phrase.lower() in line.lower())]
    assert not found, "\n".join(found)


def test_sources_name_no_page_outside_the_repository():
    sources = [f for d in ("vega", "specs", "bench") for f in sorted((ROOT / d).rglob("*"))
               if f.suffix in (".py", ".vega", ".lark")]
    found = [f"{f.relative_to(ROOT)}:{n}: {phrase!r}"
             for f in sources
             for n, line in enumerate(f.read_text().splitlines(), 1)
             for phrase in ("SEMANTICS.md", "DESIGN.md", "the seeds'", "after the seeds")
             if phrase.lower() in line.lower()]
    assert not found, "\n".join(found)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.*)$", _prose(page), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_point_into_the_repository():
    broken = []
    for page in _pages():
        text = re.sub(r"`[^`\n]*`", "", _prose(page))  # code spans are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not dest.is_relative_to(ROOT) or not dest.exists():
                broken.append(f"{where} (no such file in the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_muon_tutorial_runs_in_order():
    """docs/tutorial_muon.md builds Muon step by step: its blocks run in order, in one
    namespace, each asserting what it shows."""
    text = (ROOT / "docs" / "tutorial_muon.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 6
    namespace: dict = {}
    for k, block in enumerate(blocks):
        exec(compile(block, f"tutorial_muon.md block {k + 1}", "exec"), namespace)


def test_the_language_pages_python_examples_run():
    # docs/language.md shows a new spec compiled from a file and used as a class and as
    # functions: it runs as written
    text = (ROOT / "docs" / "language.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "language.md", "exec"), {})


def _table_rows(page: Path, heading: str) -> list[list[str]]:
    """The rows of the first table under a heading: each row's cells, stripped."""
    text = page.read_text().split(f"\n{heading}\n", 1)[1]
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows[1:]  # (the header's row aside)


def _quoted(cell: str) -> list[str]:
    """The messages a cell quotes: each code span, ``...`` standing for what varies."""
    return [q for q in re.findall(r"`([^`]+)`", cell) if " " in q]


def _says(message: str, quote: str) -> bool:
    """Whether the message says the quote, its ``...``'s standing for anything."""
    pattern = ".*".join(re.escape(part) for part in re.split(r"\.\.\.", quote))
    return re.search(pattern, message) is not None


def test_robustness_quotes_what_a_functional_step_says():
    # docs/robustness.md's tables of a functional step's state and gradients quote the
    # errors; each input of a row, given, raises the messages that row quotes
    import torch

    import vega

    def error(params, grads, state, **kw):
        try:
            vega.adamw_step(params, grads, state, **kw)
        except ValueError as e:
            return str(e)
        raise AssertionError("no error")

    one = [torch.zeros(4, 3)]
    s1 = vega.adamw_init(one)
    p = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    g = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    s = vega.adamw_init(p)
    ints = {**s, "mu": {**s["mu"], "w": torch.zeros(4, 3, dtype=torch.int32)}}
    states = [
        [error(p, g, []), error(p, g, {k: v for k, v in s.items() if k != "nu"})],
        [error(p, g, {**s, "step": torch.tensor(0)})],
        [error(one, one, {**s1, "mu": [[1.0]]})],
        [error(one, one, {**s1, "mu": [1.0]}), error(one, one, {**s1, "mu": [None]})],
        [error(p, g, {**s, "mu": {**s["mu"], "w": torch.zeros(3)}})],
        [error(p, g, ints, backend=b) for b in ("reference", "c")],
    ]
    meta = {"w": torch.zeros(4, 3), "b": torch.zeros(3, device="meta")}
    grads = [
        [error({**p, "c": torch.zeros(1)}, g, vega.adamw_init({**p, "c": torch.zeros(1)}))],
        [error(p, {**g, "w": 1.0}, s)],
        [error(p, {**g, "w": torch.zeros(3)}, s),
         error(meta, {**g, "b": torch.zeros(3)}, vega.adamw_init(meta))],
        [error(p, {**g, "b": torch.zeros(1, 3).to_sparse_csr()}, s),
         error(p, {**g, "b": torch.nested.nested_tensor([torch.zeros(3)])}, s)],
        [error(p, {**g, "w": torch.zeros(4, 3, dtype=torch.complex64)}, s)],
        [error(p, {**g, "b": torch.zeros(3, dtype=torch.int64)}, s)],
    ]
    page = ROOT / "docs" / "robustness.md"
    wrong = []
    for heading, said in (("### States of the functional API", states),
                          ("### Gradients of the functional API", grads)):
        rows = _table_rows(page, heading)
        assert len(rows) == len(said), heading
        for (what, cell), messages in zip(rows, said):
            wrong += [f"{heading}, '{what}': {quote!r} is not said: {messages}"
                      for quote in _quoted(cell)
                      if not any(_says(m, quote) for m in messages)]
    assert not wrong, "\n".join(wrong)
