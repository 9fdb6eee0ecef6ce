"""The offline PTX compile (``vega.codegen.triton_ptx``) where Triton's wheel has no ptxas: a
file of its own, as test_triton_ptx is skipped where there is none."""
import pytest

from vega.codegen import triton_ptx


def test_an_offline_compile_without_ptxas_says_so(monkeypatch):
    """Where Triton's wheel has no ptxas (a build without its NVIDIA backend), the offline
    compile started its process anyway, whose first kernel failed inside subprocess.run with
    "expected str, bytes or os.PathLike object, not NoneType" in a traceback; a compile of no
    kernels answered as if it had compiled them. It says what is missing, before it starts."""
    monkeypatch.setattr(triton_ptx, "ptxas", lambda: None)
    with pytest.raises(RuntimeError, match="no ptxas"):
        triton_ptx.compile_launches([])
