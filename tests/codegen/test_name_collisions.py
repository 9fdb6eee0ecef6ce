"""No name in a spec meets a name the backends generate.

A sweep: every identifier found in the generated code of a probe spec (reference, C and
Triton sources, with and without the matrix view; one of each shape, v_0 for v_0, v_1,
...), the names the backends made from a spec's (``x_out``, ``hyper``, the geometry
columns) and the keywords and macros of Python and C, each used as a hyperparameter, as
a state (per element, per row, per column) and as a value, wherever the language
accepts it. A spec that uses them steps on each backend as the same spec with plain
names does (float32, within 1e-6). The names go five groups to a spec: spec ``r`` gives
the hyperparameters the names of group ``r``, the states those of group ``r + 1``, and
so on, so that five specs and one plain one hold every name in every role. The
optimizer's name is swept too (it names the Triton kernels).

The steps run in two child processes side by side (reference and C; Triton), which a
kernel reading the wrong address may crash: Triton's under its interpreter on CPU
tensors (``TRITON_INTERPRET=1``, ~1,000 elements a tensor) where there is no GPU.
"""
import ast
import io
import json
import keyword
import os
import re
import signal
import subprocess
import sys
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("hyper", "state", "rows", "cols", "value")
TIMEOUT = 600

# names the backends derive from a spec's or use for their own, whether or not they are
# identifiers of the probe's code: state p_out and x_out beside state x, state hyper, the
# geometry columns of the Triton kernels, the reference's geo
LISTED = ["N_R", "N_C", "N_M", "SR", "SC", "FR", "FC", "RR", "CC", "hyper", "geo", "p_out",
          "zz_m_out", "zz_r_out", "zz_c_out", "torch", "math", "None", "self", "lambda",
          "int", "double", "INFINITY", "sqrt", "restrict", "omp"]
# the language's own words: its keywords and constants, the builtins, some functions (a
# keyword is a name where no operator may stand: state not, hyperparameter and)
LANGUAGE = ["optimizer", "as", "state", "if", "else", "and", "or", "not", "in", "float",
            "bool", "true", "false", "inf", "nan", "pi", "p", "g", "t", "sqrt", "abs", "max",
            "sum", "row_mean", "ndim", "zeros", "rows", "cols"]
# C: the keywords, and the macros of the headers a kernel includes (a name that is not a
# macro matters only where the generated code uses it: then it is one of its identifiers)
C_WORDS = """auto break case char const continue default do double else enum extern float
    for goto if inline int long register restrict return short signed sizeof static struct
    switch typedef union unsigned void volatile while _Alignas _Alignof _Atomic _Bool _Complex
    _Generic _Imaginary _Noreturn _Static_assert _Thread_local alignas alignof bool constexpr
    false nullptr static_assert thread_local true typeof asm INFINITY NAN HUGE_VAL M_PI M_E
    FP_NAN MATH_ERRNO math_errhandling isnan isinf isfinite signbit errno NULL EOF SIZE_MAX
    INT32_MAX INT64_MAX UINT16_MAX EXIT_FAILURE RAND_MAX linux unix i386 _OPENMP""".split()
# Python: the keywords, and builtins and module names the generated code might use
PY_WORDS = [*keyword.kwlist, *keyword.softkwlist, "self", "print", "len", "range", "float",
            "int", "bool", "abs", "min", "max", "sum", "type", "object", "super", "exec",
            "globals", "locals", "__import__", "__name__", "__builtins__", "__file__",
            "__doc__", "__spec__", "np", "numpy", "torch", "math", "triton", "tl", "jit",
            "constexpr", "program_id", "num_programs", "arange", "load", "store"]

# what the language accepts: a name as a value, where a statement follows one (a name of
# the language's own, p or sqrt, is refused, and where an operator may follow an
# expression, a keyword such as and); a hyperparameter may not take a name of the API's
# either, a state not the step counter's
VALUE = """optimizer zz_tiny(zz_lr = 0.01) {{
    zz_a = g * 0.5
    {x} = zz_a * 2 + t
    zz_b = {x} * {x} + {x}
    p = p - zz_lr * zz_b
}}"""
NAME = "optimizer {x}(zz_lr = 0.1) {{ p = p - zz_lr * g }}"
OPTIMIZER_NAMES = ["lambda", "None", "triton", "vega"]
SHAPES = {"matrix": (24, 40), "vector": (1000,)}  # the first steps over its matrix view
# the names spec_text gives its own values, and the plain and filler names: not swept
TEMPLATE = re.compile(r"zz_(lr|m|r|c|u|d|n|probe|tiny)|zq[a-z]\d+|zf\d+_\d+")


def _weight(role: str, i: int) -> str:
    """A weight in [0.5, 1.5), by role and position: the same in every spec."""
    return f"{0.5 + ((i * 7919 + ROLES.index(role) * 104729) % 1000) / 1000:.3f}"


def spec_text(name: str, names: dict[str, list[str]]) -> str:
    """A spec that uses ``names[role]`` in each role, the same computation for any names
    (of the same counts): the i-th state (per element, row, column) reads the i-th
    hyperparameter or value, and is compared. Its own names begin with zz_."""
    hyp, states, rows, cols, values = (names[r] for r in ROLES)
    kinds = ["zz_lr * {w} + t * 0.001", "g * {w} + p * 0.1", "mean(g) * {w}",  # outside
             "row_mean(g * g) * {w}", "col_mean(g) * {w}"]  # inside the if, per row, column
    value = {i: (v, i % len(kinds), kinds[i % len(kinds)].format(w=_weight("value", i)))
             for i, v in enumerate(values)}

    def read(i, kind, default):  # the i-th value where it is of kind, or default
        return value[i][0] if i in value and value[i][1] == kind else default

    header = ", ".join(["zz_lr = 0.01"] + [f"{h} = {_weight('hyper', i)}"
                                         for i, h in enumerate(hyp)])
    body = ["state zz_m = p * 0.5", "zz_m = 0.9 * zz_m + g"]
    body += [f"{v} = {e}" for v, kind, e in value.values() if kind < 3]
    for i, s in enumerate(states):
        mix = hyp[i] if i < len(hyp) else "0.8"
        new = value[i][0] if i in value and value[i][1] < 3 else f"g * {_weight('state', i)}"
        body += [f"state {s} = p * {_weight('state', i)}", f"{s} = {mix} * {s} + {new}"]
    body += ["if ndim(p) >= 2 {", "state zz_r: rows = zeros", "state zz_c: cols = zeros",
             "zz_r = 0.5 * zz_r + row_mean(g * g)", "zz_c = 0.5 * zz_c + col_mean(g * g)"]
    body += [f"{v} = {e}" for v, kind, e in value.values() if kind >= 3]
    for i, r in enumerate(rows):
        w = _weight("rows", i)
        body += [f"state {r}: rows = row_mean(p) * {w}",
                 f"{r} = 0.5 * {r} + {read(i, 3, f'row_mean(g * g) * {w}')}"]
    for i, c in enumerate(cols):
        w = _weight("cols", i)
        body += [f"state {c}: cols = col_mean(p) * {w}",
                 f"{c} = 0.5 * {c} + {read(i, 4, f'col_mean(g) * {w}')}"]
    body += ["zz_u = g * rsqrt(zz_r / col_mean(zz_r) + 1) * rsqrt(zz_c + 1)",
             "} else {", "zz_u = g", "}", "zz_d = zz_u + 0.1 * zz_m", "zz_n = norm(zz_d)",
             "p = p - zz_lr * zz_d / max(1, zz_n)"]
    return f"optimizer {name}({header}) {{\n    " + "\n    ".join(body) + "\n}\n"


def plain_names(m: int) -> dict[str, list[str]]:
    return {role: [f"zq{role[0]}{i}" for i in range(m)] for role in ROLES}


def state_order(names: dict[str, list[str]]) -> list[str]:
    """The states of ``spec_text``, in an order the same for any names."""
    return ["zz_m", "zz_r", "zz_c", *names["state"], *names["rows"], *names["cols"]]


# -- the candidates ------------------------------------------------------------------

def _python_names(text: str) -> set[str]:
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return {t.string for t in toks if t.type == tokenize.NAME}


def _c_names(text: str) -> set[str]:
    text = re.sub(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"", " ", text, flags=re.S)
    return set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", text))


def _template_names() -> set[str]:
    """The identifiers of the code in the backends' templates (less the template's own
    tags, comments and docstrings): helpers a probe may not call (vpow, to_bf16)."""
    out = set()
    for path in (ROOT / "vega" / "codegen" / "templates").glob("*.j2"):
        text = re.sub(r"\{#.*?#\}|\{%.*?%\}|\{\{.*?\}\}|\"\"\".*?\"\"\"|#[^\n]*", " ",
                      path.read_text(), flags=re.S)
        out |= set(re.findall(r"(?<![\w.])[A-Za-z_]\w*", text))
    return out


def _literal_names() -> set[str]:
    """The identifiers in the string literals of the backends' Python (the pieces of code
    they generate, and what else they spell), those that read like code rather than
    prose: with an underscore inside."""
    out = set()
    for path in (ROOT / "vega" / "codegen").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = re.sub(r"/\*.*?\*/", " ", node.value, flags=re.S)
                out |= {x for x in re.findall(r"(?<![\w.])[A-Za-z_]\w*", text)
                        if "_" in x.strip("_")}
    return out


def _backends() -> list[str]:
    from vega import codegen
    return [b for b in ("reference", "c", "triton") if b in codegen.BACKENDS]


@cache
def _sources(text: str) -> dict[str, list[str]]:
    import vega
    spec = vega.compile(text)
    return {b: [spec.source(b, shape=s) for s in SHAPES.values()] for b in _backends()}


@cache
def _loads(text: str) -> bool:
    """Whether the language accepts ``text`` (``dsl.load``: no SpecError). (Cached: the
    small spec where a name is a value is the same for each role it is asked in.)"""
    from vega import SpecError, dsl
    try:
        dsl.load(text)
        return True
    except SpecError:
        return False


@cache
def _legal(name: str, role: str) -> bool:
    """Whether the language accepts ``name`` in ``role`` (or as the optimizer's: "name"):
    in a small spec where it is a value, or else in ``spec_text`` with it in that role
    (the header and the places a name takes there: a keyword such as and is a name where
    no operator may stand)."""
    from vega.dsl.check import API_NAMES, BUILTINS, STEP_COUNTER
    if name in BUILTINS:  # (p may be assigned: as a value it is the update)
        return False
    if role == "hyper" and name in API_NAMES or role in ROLES[1:4] and name == STEP_COUNTER:
        return False
    if _loads((NAME if role == "name" else VALUE).format(x=name)):
        return True
    if role == "name":
        return False
    return _loads(spec_text("zz_probe", {**plain_names(1), role: [name]}))


def _anywhere(name: str) -> bool:
    return any(_legal(name, role) for role in ROLES)


def _shape(name: str) -> str:
    """What ``name`` has in common with others like it, which the sweep need not all have:
    v_0 and v_12; s_zz_m and s_zz_r; ptr_p and ptr_g; L_r and L_c."""
    if "zz_probe" in name:  # a kernel's name
        return "zz_probe"
    name = re.sub(r"zz_[mrc](?![a-z])", "zz_x", re.sub(r"\d+", "0", name))
    return "_".join("X" if part in ("p", "g", "t", "s", "r", "c", "m", "rc", "P", "G", "S",
                                    "R", "C", "M") else part for part in name.split("_"))


@cache
def candidates() -> tuple[list[str], list[str]]:
    """The names to sweep as hyperparameters, states and values; and as optimizer names.
    Of the identifiers of the probe's code, one of each shape (v_0 for v_0, v_1, ...), and
    none made from the names that only the plain spec has (zq...)."""
    probe = spec_text("zz_probe", plain_names(2))
    found: set[str] = set()
    defs: set[str] = set()  # the functions of the Triton modules
    for backend, texts in _sources(probe).items():
        for text in texts:
            found |= _c_names(text) if backend == "c" else _python_names(text)
            if backend == "triton":
                defs |= set(re.findall(r"^def (\w+)\(", text, flags=re.M))
    shapes = {}
    for x in sorted(found):
        if "zq" not in x:  # (of the plain names, which no spec of the sweep has)
            shapes.setdefault(_shape(x), x)
    for x in sorted(_template_names() | _literal_names()):
        shapes.setdefault(_shape(x), x)
    names = sorted(set(shapes.values()) | set(LISTED) | set(LANGUAGE) | set(C_WORDS)
                   | set(PY_WORDS))
    names = [x for x in names if not TEMPLATE.fullmatch(x) and _anywhere(x)]
    # optimizer names: a name less what follows the optimizer's in a kernel's (read, of
    # read_prelude), the Triton modules' own functions, and a few words
    kernels = {d for d in defs if "zz_probe" in d}
    tails = {d[d.index("zz_probe") + len("zz_probe"):] for d in kernels}
    heads = {x[:-len(tail)] for x in found for tail in tails if x.endswith(tail) and
             len(x) > len(tail)}
    own = defs - kernels
    opt = sorted({x for x in heads | own | set(OPTIMIZER_NAMES)
                  if "zz_" not in x and "zq" not in x and _legal(x, "name")})
    return names, opt


@cache
def batches() -> tuple[dict[str, str], list[tuple[str, dict[str, str]]], dict]:
    """The specs to step (by label), the pairs to compare (label, its states' plain names)
    and the names of each role of each. Five specs whose every role holds names of the
    sweep, and the plain one."""
    names, _ = candidates()
    m = -(-len(names) // len(ROLES))
    groups = [names[k * m:(k + 1) * m] for k in range(len(ROLES))]
    plain = plain_names(m)
    specs = {"plain": spec_text("zz_probe", plain)}
    pairs, roles = [], {}
    for r in range(len(ROLES)):
        chosen = {}
        for j, role in enumerate(ROLES):
            group = groups[(j + r) % len(ROLES)]
            chosen[role] = [x if _legal(x, role) else f"zf{r}{j}_{i}"
                            for i, x in enumerate(group)]
            chosen[role] += [f"zf{r}{j}_{i}" for i in range(len(group), m)]
        label = f"sweep{r}"
        specs[label] = spec_text("zz_probe", chosen)
        pairs.append((label, dict(zip(state_order(chosen), state_order(plain)))))
        roles[label] = chosen
    return specs, pairs, roles


def optimizer_specs() -> dict[str, str]:
    """A small spec, and the same under each optimizer name of the sweep."""
    _, opt = candidates()
    return {"small": spec_text("zz_probe", plain_names(1)),
            **{f"name:{x}": spec_text(x, plain_names(1)) for x in opt}}


# -- the child: steps each spec on each backend ---------------------------------------

def _step_all(spec, backend: str):
    """One step of the spec on ``backend`` from a fixed start (its states start from p:
    none is zero), on the CPU; Triton's on CUDA unless interpreted."""
    import torch
    cuda = backend == "triton" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
    if cuda:
        params, grads = ({k: x.cuda() for k, x in d.items()} for d in (params, grads))
    state = spec.init(params)
    return spec.step(params, grads, state, backend=backend)


def _compare(got, want, names: dict[str, str] | None) -> str | None:
    """None if ``got`` (a spec's params and state) matches ``want`` (the plain spec's),
    with ``names`` its states' plain names (None: the same names); else what differs."""
    import torch
    (gp, gs), (wp, ws) = got, want
    names = names or {s: s for s in ws if s != "step"}
    pairs = [(f"p.{k}", gp[k], wp[k]) for k in wp]
    if set(gs) - {"step"} != set(names):
        return f"states {sorted(gs)}, expected {sorted(names)}"
    for s, tree in gs.items():
        if s != "step":
            pairs += [(f"{s}.{k}", x, ws[names[s]][k]) for k, x in tree.items()]
    for what, a, b in pairs:
        if a is None or b is None:  # (a state per row of a vector: none)
            if (a is None) != (b is None):
                return f"{what} is {a!r}, expected {b!r}"
            continue
        scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-6, atol=1e-6 * scale):
            return f"{what} differs by {(a - b).abs().max().item():g}"
    return None


def child(job: dict, compiled: dict) -> None:
    """Step every spec of ``job`` on every backend; print a JSON line for each spec (and
    one before it starts, so that a crash names the spec that crashed). A spec labelled
    name:x is compared with the one labelled small, the others with the one labelled
    plain. ``compiled``: the specs compiled so far, by label (``children``)."""
    import vega
    specs, pairs = job["specs"], {label: names for label, names in job["pairs"]}
    for backend in job["backends"]:
        want = {}
        for label, text in specs.items():
            print(json.dumps({"start": [backend, label]}), flush=True)
            try:
                if label not in compiled:
                    compiled[label] = vega.compile(text)
                spec = compiled[label]
                base = "small" if label.startswith("name:") else "plain"
                if backend == "c" and label.startswith("name:"):
                    # the name is in a comment of the C source only: the source past it is
                    # the small spec's (not built again: a build takes a second)
                    error = None
                    for shape in SHAPES.values():
                        mine, theirs = (x.source("c", shape=shape).split("\n", 1)[1]
                                        for x in (spec, compiled[base]))
                        if mine != theirs:
                            error = f"its C source differs from the small spec's ({shape})"
                else:
                    out = _step_all(spec, backend)
                    if label in ("plain", "small"):
                        want[label], error = out, None
                    else:
                        error = _compare(out, want[base], pairs.get(label))
            except Exception as err:  # noqa: BLE001  (reported to the parent)
                error = f"{type(err).__name__}: {str(err)[:500]}"
            print(json.dumps({"backend": backend, "label": label, "error": error}), flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """(backend, spec label) -> None or what went wrong, and ("crash", backend) -> how the
    child stepping on backend died. Two children, side by side: the reference and C
    backends, and Triton's (forked from one process: ``children``)."""
    specs, pairs, _ = batches()
    job = {"specs": {**specs, **optimizer_specs()}, "pairs": pairs}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]))
    import torch
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    tmp = tmp_path_factory.mktemp("names")
    jobs = []
    for k, backends in enumerate([["reference", "c"], ["triton"]]):
        backends = [b for b in backends if b in _backends()]
        if backends:
            path = tmp / f"job{k}.json"
            path.write_text(json.dumps({**job, "backends": backends,
                                        "stdout": str(tmp / f"job{k}.out"),
                                        "stderr": str(tmp / f"job{k}.err")}))
            jobs.append((tuple(backends), path))
    with open(tmp / "children.log", "w+") as said:
        proc = subprocess.Popen([sys.executable, __file__, *(str(p) for _, p in jobs)],
                                env=env, cwd=ROOT, stdout=said, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # (the children with it; a parent that failed may have left one running)
            if proc.poll() is None or proc.returncode != 0:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        said.seek(0)
        lines = said.read().splitlines()
    codes = dict(json.loads(x) for x in lines if x.startswith("["))
    out: dict = {}
    for k, (backends, path) in enumerate(jobs):
        stdout, stderr = ("" if not p.exists() else p.read_text()
                          for p in (path.with_suffix(".out"), path.with_suffix(".err")))
        started = None
        for line in stdout.splitlines():
            if line.startswith("{"):
                msg = json.loads(line)
                if "start" in msg:
                    started = tuple(msg["start"])
                else:
                    out[msg["backend"], msg["label"]] = msg["error"]
        if codes.get(k) != 0:
            code = codes.get(k, f"killed (its parent: {proc.returncode})")
            for backend in backends:
                out["crash", backend] = (f"the child exited with {code} while "
                                         f"stepping {started}: {stderr[-2000:]}"
                                         + ("\n".join(lines)[-2000:] if k not in codes else ""))
    return out, job


def _failures(results, backend: str) -> list[str]:
    out, job = results
    bad = [f"crash: {out['crash', backend]}"] if ("crash", backend) in out else []
    for label in job["specs"]:
        key = (backend, label)
        if key not in out:
            bad.append(f"{label}: not run")
        elif out[key] is not None:
            bad.append(f"{label}: {out[key]}")
    return bad


def test_the_sweep_has_every_name_in_every_role_the_language_allows():
    names, opt = candidates()
    _, _, roles = batches()
    for role in ROLES:
        held = {x for chosen in roles.values() for x in chosen[role]}
        missing = [x for x in names if _legal(x, role) and x not in held]
        assert not missing, (role, missing)
        for x in LISTED + LANGUAGE + C_WORDS + keyword.kwlist:
            assert x in held or not _legal(x, role), (role, x)
    assert len(names) > 300 and "read" in opt


def test_a_name_the_sweep_leaves_out_is_a_word_of_the_language_and_a_spec_error():
    """Where the sweep does not use a name, the language refuses it there (a SpecError,
    never a backend's error), and it is a word of the language's own or of the API."""
    import vega
    from vega import SpecError
    from vega.dsl.check import (API_NAMES, FUNCTIONS, GLOBAL_FUNCTIONS, INIT_NAMES,
                                SHAPE_QUERIES, STEP_COUNTER)
    own = {*LANGUAGE, *FUNCTIONS, *GLOBAL_FUNCTIONS, *SHAPE_QUERIES, *INIT_NAMES}
    pool = (set(LISTED) | set(LANGUAGE) | set(C_WORDS) | set(PY_WORDS) | _template_names()
            | _literal_names())
    refused = [(x, role) for x in sorted(pool) if not TEMPLATE.fullmatch(x) for role in ROLES
               if not _legal(x, role)]
    for x, role in refused:
        assert x in own or (role == "hyper" and x in API_NAMES) or x == STEP_COUNTER, (x, role)
        if (x, role) == ("p", "value"):  # (a value named p is the update)
            continue
        with pytest.raises(SpecError):
            vega.compile(spec_text("zz_probe", {**plain_names(1), role: [x]}))
    for x in ("inf", "nan", "pi", "true", "false", "g", "t", "sqrt"):
        assert all((x, role) in refused for role in ROLES), x


@pytest.mark.parametrize("backend", ["reference", "c", "triton"])
def test_spec_names_never_meet_generated_names(results, backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} is not available here")
    bad = _failures(results, backend)
    assert not bad, f"{backend}: {len(bad)} specs fail:\n" + "\n".join(bad[:20])


def children(paths: list[str]) -> None:
    """A child for each job of ``paths`` (its stdout and stderr in the files the job names),
    side by side, forked from this process once it has imported vega and compiled the specs
    (which the children share: about 6 s of a CPU each would spend on them). Prints a JSON
    line [job, exit status] as each ends. The C kernels are built without optimization: the
    names are the same at -O3, and a build of a spec of the sweep takes ten times as long
    there."""
    import vega
    from vega.codegen.c import build as cbuild
    cbuild.FLAGS = (*(f for f in cbuild.FLAGS if not f.startswith("-O")), "-O0")
    jobs = [json.loads(Path(path).read_text()) for path in paths]
    compiled = {}
    for label, text in jobs[0]["specs"].items():
        try:
            compiled[label] = vega.compile(text)
        except Exception:  # noqa: BLE001  (the child compiles it again, and says why)
            pass
    from tests import forks
    forks.fork_each(jobs, lambda job: child(job, compiled),
                    lambda k, job: (job["stdout"], job["stderr"]))


if __name__ == "__main__":
    children(sys.argv[1:])
