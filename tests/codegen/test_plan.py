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
