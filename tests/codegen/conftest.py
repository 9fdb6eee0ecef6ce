"""Fixtures the kernel-cache tests share."""
import pytest

from vega.codegen.c import build as cbuild


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A new cache directory (not yet made), and no cache warning or private directory yet."""
    root = tmp_path / "cache"
    monkeypatch.setenv("VEGA_CACHE_DIR", str(root))
    monkeypatch.setattr(cbuild, "_cache_warned", False)
    monkeypatch.setattr(cbuild, "_fallback", None)
    return root
