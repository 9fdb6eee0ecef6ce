"""Fixtures the kernel-cache tests share."""
import sys

import pytest

from vega.codegen.c import build as cbuild
from vega.codegen.c import native


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A new cache directory (not yet made), and no cache warning or private directory yet."""
    root = tmp_path / "cache"
    monkeypatch.setenv("VEGA_CACHE_DIR", str(root))
    monkeypatch.setattr(cbuild, "_cache_warned", False)
    monkeypatch.setattr(cbuild, "_fallback", None)
    return root


@pytest.fixture
def copying(monkeypatch):
    """A stand-in for the C++ compiler that copies the session's library (a real build takes
    a minute): what is tested is how a build is placed, trusted and remembered. Asked for
    before ``fresh`` or ``cache``, which move the cache."""
    built = native.module(wait=True)
    assert built is not None, native.status()
    session = native._placed(native._paths()[1])
    assert session.exists()
    real = native._paths

    def paths():
        _, target = real()
        return [sys.executable, "-c", f"import shutil, sys; shutil.copy({str(session)!r}, "
                                      f"sys.argv[-1])"], target
    monkeypatch.setattr(native, "_paths", paths)
    return session
