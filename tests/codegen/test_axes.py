"""The matrix view's index maps (``axis_geometry``, used by the C and Triton kernels)
agree with the reference backend's torch reshapes, on every kind of shape."""
import pytest
import torch

from vega.codegen.base import axis_geometry
from vega.codegen.reference import _broadcast, _reduce, geometry


def drop(i, inner, n):
    return (i // (inner * n)) * inner + i % inner


def put(o, inner, n, k):
    return (o // inner) * inner * n + k * inner + o % inner


def vec(values):
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def gathered(flat, n_out, inner, length):
    """For each output o, the sum over k < length of flat[put(o, inner, length, k)]."""
    return vec(sum(float(flat[put(o, inner, length, k)]) for k in range(length))
               for o in range(n_out))


SHAPES = [(), (4,), (3, 5), (5, 3), (4, 4), (2, 6, 5), (3, 2, 4, 7), (1, 3), (7, 1, 2), (0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_index_maps_match_the_reference(shape):
    x = torch.randn(shape, dtype=torch.float64)
    n_rc, n_r, n_c, n_, sr, sc, fr, fc, rr, cc = axis_geometry(shape)
    geo = geometry(shape)
    flat = x.reshape(-1)
    # reductions of a per-element value: over the column axis (rows), the row axis (columns)
    rows = _reduce(x, geo, "rc", "c", "sum").reshape(-1)
    cols = _reduce(x, geo, "rc", "r", "sum").reshape(-1)
    assert rows.numel() == n_r and cols.numel() == n_c
    assert torch.allclose(rows, gathered(flat, n_r, fc, sc))
    assert torch.allclose(cols, gathered(flat, n_c, fr, sr))
    # broadcasts into per-element values
    R = torch.randn(geo.shape("r"), dtype=torch.float64)
    C = torch.randn(geo.shape("c"), dtype=torch.float64)
    M = torch.randn(geo.shape(""), dtype=torch.float64)
    full = (_broadcast(R, geo, "r", "rc") + _broadcast(C, geo, "c", "rc")
            + _broadcast(M, geo, "", "rc")).expand(shape).reshape(-1)
    Rf, Cf, Mf = R.reshape(-1), C.reshape(-1), M.reshape(-1)
    mine = vec(Rf[drop(i, fc, sc)] + Cf[drop(i, fr, sr)] + Mf[drop(drop(i, fc, sc), rr, sr)]
               for i in range(n_rc))
    assert torch.allclose(full, mine)
    # per-row and per-column values reduced to one per matrix, and broadcast back
    assert torch.allclose(_reduce(R, geo, "r", "r", "sum").reshape(-1), gathered(Rf, n_, rr, sr))
    assert torch.allclose(_reduce(C, geo, "c", "c", "sum").reshape(-1), gathered(Cf, n_, cc, sc))
    rb = _broadcast(M, geo, "", "r").expand(geo.shape("r")).reshape(-1)
    assert torch.allclose(rb, vec(Mf[drop(j, rr, sr)] for j in range(n_r)))
    cb = _broadcast(M, geo, "", "c").expand(geo.shape("c")).reshape(-1)
    assert torch.allclose(cb, vec(Mf[drop(j, cc, sc)] for j in range(n_c)))
