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


SHAPES = [(), (4,), (3, 5), (5, 3), (4, 4), (2, 6, 5), (3, 2, 4, 7), (1, 3), (7, 1, 2), (0, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_index_maps_match_the_reference(shape):
    x = torch.randn(shape, dtype=torch.float64)
    n_rc, n_r, n_c, n_, sr, sc, fr, fc, rr, cc = axis_geometry(shape)
    geo = geometry(shape)
    flat = x.reshape(-1)
    rowm = _reduce(x, geo, "rc", "c", "sum").reshape(-1)
    colm = _reduce(x, geo, "rc", "r", "sum").reshape(-1)
    assert rowm.numel() == n_r and colm.numel() == n_c
    mine_r = torch.tensor([sum(flat[put(o, fc, sc, k)] for k in range(sc)) for o in range(n_r)], dtype=torch.float64)
    mine_c = torch.tensor([sum(flat[put(o, fr, sr, k)] for k in range(sr)) for o in range(n_c)], dtype=torch.float64)
    assert torch.allclose(rowm, mine_r), shape
    assert torch.allclose(colm, mine_c), shape
    # broadcasts
    R = torch.randn(geo.shape("r"), dtype=torch.float64); C = torch.randn(geo.shape("c"), dtype=torch.float64)
    M = torch.randn(geo.shape(""), dtype=torch.float64)
    full = (_broadcast(R, geo, "r", "rc") + _broadcast(C, geo, "c", "rc") + _broadcast(M, geo, "", "rc")).expand(shape).reshape(-1)
    Rf, Cf, Mf = R.reshape(-1), C.reshape(-1), M.reshape(-1)
    mine = torch.stack([Rf[drop(i, fc, sc)] + Cf[drop(i, fr, sr)] + Mf[drop(drop(i, fc, sc), rr, sr)] for i in range(n_rc)]) if n_rc else full
    assert torch.allclose(full, mine), shape
    # row-domain to matrix, col_* of a row value
    rm = _reduce(R, geo, "r", "r", "sum").reshape(-1)
    mine = torch.tensor([sum(Rf[put(o, rr, sr, k)] for k in range(sr)) for o in range(n_)], dtype=torch.float64)
    assert torch.allclose(rm, mine), shape
    cm = _reduce(C, geo, "c", "c", "sum").reshape(-1)
    mine = torch.tensor([sum(Cf[put(o, cc, sc, k)] for k in range(sc)) for o in range(n_)], dtype=torch.float64)
    assert torch.allclose(cm, mine), shape
    rb = _broadcast(M, geo, "", "r").expand(geo.shape("r")).reshape(-1)
    assert torch.allclose(rb, torch.tensor([float(Mf[drop(j, rr, sr)]) for j in range(n_r)], dtype=torch.float64)), shape
    cb = _broadcast(M, geo, "", "c").expand(geo.shape("c")).reshape(-1)
    assert torch.allclose(cb, torch.tensor([float(Mf[drop(j, cc, sc)]) for j in range(n_c)], dtype=torch.float64)), shape
