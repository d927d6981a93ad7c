"""Registry: lazy lookup by module pattern, a clear error for unknown names, and a module that
exists but lacks a dependency says so instead of looking like an unknown name."""
from __future__ import annotations

import sys

import pytest

from rackserve.registry import Registry


def test_lookup_imports_the_module_that_registers(tmp_path, monkeypatch):
    (tmp_path / "regpkg").mkdir()
    (tmp_path / "regpkg" / "__init__.py").write_text("from rackserve.registry import Registry\nR = Registry('thing', 'regpkg.{}_thing')\n")
    (tmp_path / "regpkg" / "fast_thing.py").write_text("from regpkg import R\n@R.register('fast')\nclass Fast: pass\n")
    (tmp_path / "regpkg" / "broken_thing.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        from regpkg import R
        assert "fast" not in R and R.get("fast").__name__ == "Fast" and R.names() == ["fast"]
        with pytest.raises(ValueError, match=r"unknown thing 'slow'; known: \['fast'\]"):
            R.get("slow")
        with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
            R.get("broken")
    finally:
        for name in [m for m in sys.modules if m.startswith("regpkg")]:
            del sys.modules[name]


def test_second_pattern_and_missing_package():
    registry = Registry("executor", "rackserve.no_such_package.{}", "rackserve.{}.executor")
    with pytest.raises(ValueError, match="unknown executor 'nothing'"):
        registry.get("nothing")
