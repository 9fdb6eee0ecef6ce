"""The loop plan the C and Triton renderers share (``vega.codegen.plan``): its index maps read
the values torch's own reductions give, and its choice of the values a loop computes."""
import itertools
import math

import pytest
import torch

import vega
from vega.codegen import plan
from vega.codegen.base import axis_geometry
from vega.codegen.c import line_lengths
from vega.dsl.check import matrix_axes

SHAPES = [(), (5,), (3, 4), (4, 3), (2, 3, 4), (5, 1, 3), (2, 5, 3, 2), (1, 1)]


def _index(expr: str, **names) -> int:
    return eval(expr, {}, names)  # noqa: S307 (the plan's own integer expressions)


def drop(i, inner, n):
    return _index(plan.DROP_EXPR, i=i, inner=inner, n=n)


def put(o, inner, n, k):
    return _index(plan.PUT_EXPR, o=o, inner=inner, n=n, k=k)


def _geometry(shape) -> dict[str, int]:
    names = [name for name, _ in plan.GEOMETRY]
    return dict(zip(names, (*axis_geometry(shape), *line_lengths(shape)), strict=True))


def _reduced(x: torch.Tensor, dom: str) -> torch.Tensor:
    """The values of ``x`` (a full tensor) summed into domain ``dom``, flat."""
    r, c = matrix_axes(tuple(x.shape))
    axes = [a for a, keep in ((r, "r" in dom), (c, "c" in dom)) if a is not None and not keep]
    return (x.sum(dim=axes) if axes else x).reshape(-1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_geometry_names_every_integer_of_a_row(shape):
    geo = _geometry(shape)  # (strict zip: as many names as integers)
    assert len(geo) == plan.NGEO
    assert [geo[plan.COUNT[d]] for d in plan.DOMS] == [
        _reduced(torch.zeros(shape), d).numel() for d in plan.DOMS]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_drops_read_the_value_of_the_smaller_domain(shape):
    """Element (or row, column) ``i`` reads, through ``drop_path``, the position of the
    smaller domain's value it broadcasts from: checked on a tensor whose values are their
    own position, summed into the smaller domain by torch (a one-hot per position)."""
    geo = _geometry(shape)
    n = math.prod(shape)
    for dom, smaller in itertools.permutations(plan.DOMS, 2):
        if not set(smaller) <= set(dom):
            continue
        for i in range(_reduced(torch.zeros(shape), dom).numel()):
            at = i
            for inner, length in plan.drop_path(dom, smaller):
                at = drop(at, geo[inner], geo[length])
            # the position i of domain dom, as a full tensor: one-hot where it broadcasts
            full = torch.zeros(n)
            for e in range(n):
                j = e
                for inner, length in plan.drop_path("rc", dom):
                    j = drop(j, geo[inner], geo[length])
                full[e] = float(j == i)
            hit = _reduced(full.reshape(shape), smaller)
            assert hit[at] > 0 and int((hit > 0).sum()) == 1, (dom, smaller, i)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_puts_walk_what_an_axis_reduction_combines(shape):
    """``put`` over ``PUT``'s axis visits, for output ``o``, exactly the source positions
    torch's sum over that axis adds into ``o``."""
    geo = _geometry(shape)
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    for (out, src), (inner, length) in plan.PUT.items():
        source = _reduced(x, src)  # a value of the source's domain
        want = _reduced(x, out)
        got = [sum(float(source[put(o, geo[inner], geo[length], k)])
                   for k in range(geo[length])) for o in range(want.numel())]
        assert got == want.tolist(), (out, src)


def test_no_map_into_a_domain_a_value_does_not_broadcast_from():
    with pytest.raises(ValueError, match="no index map from domain 'r' to 'c'"):
        plan.drop_path("r", "c")


def test_a_loop_computes_its_values_and_reads_earlier_reductions():
    """LAMB's update reads its trust ratio's two norms, computed by an earlier phase: the
    update's loop reads them and recomputes none of their arguments' own reductions."""
    program = vega.lamb.program()
    roots = [node for _, node in program.updates]
    found = plan.element_plan(roots)
    assert len(found.earlier) == 2 and all(n.op.value == "norm" for n in found.earlier)
    assert not any(n in found.lines for n in found.earlier)
    assert found.reads == {s.name for s in program.states}
    # the phase computing the norms computes them, and reads no earlier one
    phase = plan.element_plan(found.earlier, computed=found.earlier)
    assert phase.earlier == () and phase.lines


AXIS_SPECS = [
    "optimizer o() {\n r = row_mean(g * g)\n s = r * 2 + 1\n n = norm(g / s)\n"
    " p = p - 0.01 * g / s / (n + 1)\n}",
    "optimizer o() {\n state v: rows = zeros\n c = col_sum(g)\n m = row_max(abs(g))\n"
    " v = 0.9 * v + m\n q = sum(g * c)\n p = p - 0.001 * g * c / (v + 1) / (q * q + 1)\n}",
]


@pytest.mark.parametrize("text", AXIS_SPECS + ["adafactor"])
def test_the_c_and_triton_kernels_run_the_stages_of_one_plan(text):
    """A program over a matrix view has one plan of stages (``plan.axis_plan``): Triton
    launches a kernel per domain of each stage (``triton.Source.plan``), and the C kernels
    run each stage as loops, in order, each stage's axis reductions before its per-tensor
    ones; the values the writes read come after the last stage."""
    import re

    from vega.codegen import triton
    from vega.codegen.base import linearize
    spec = vega.builtin(text) if text == "adafactor" else vega.compile(text)
    shape = (256, 300)  # (Adafactor factors a matrix of sides from 128 on)
    program = spec.program(shape=shape)
    assert program.uses_axes
    found = plan.axis_plan(program)
    assert found.nstages >= 1 and triton.axis_plan is plan.axis_plan
    text = spec.source(backend="c", shape=shape)
    src = text.split("void vega_axes_stage0(")[0]  # vega_axes_step: every stage, in order
    assert [int(k) for k in re.findall(r"/\* stage (\d+) \*/", src)] == \
        list(range(1, found.nstages + 1))
    for k in range(found.nstages):  # the step over shards: an entry point a stage
        entry = text.split(f"void vega_axes_stage{k}(")[1].split("\nvoid ")[0]
        assert re.findall(r"/\* stage (\d+) \*/", entry) == [str(k + 1)]
    name = linearize(program).ref
    for k in range(found.nstages):
        part = src.split(f"/* stage {k + 1} */")[1].split("/* stage")[0]
        gathers, reds = found.stage(k)
        at = [part.index(f"{{  /* m_{name(n)} = {n.op.value}(") for n in gathers]
        assert at == sorted(at)
        assert all(part.index(f"v_{name(n)} = {n.op.value}(") > max(at, default=-1)
                   for n in reds)
    for k in range(found.nstages):  # a reduction's value is known from the next stage on
        for n in sum(found.stage(k), []):
            assert found.level[id(n)] == k + 1 and found.level[id(n.src[0])] <= k
