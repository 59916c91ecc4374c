"""The top-level API: one rule for what is exported, every name documented, typed for checkers.

Rule (``cpmeta/__init__.py``): every name an engine calls or constructs in its step loop is
top-level, whatever room defines it; the rooms hold the same names plus their internals.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import cpmeta

ROOT = Path(__file__).resolve().parents[1]

#: The in-place decode API an engine drives (DESIGN 12): top-level, not only in cpmeta.gpu.
IN_PLACE_DECODE = ("prepare_decode_inplace", "launch_decode_inplace", "capture_decode_graph",
                   "DecodeStaging", "staging_capacity", "stage_decode", "StagedDecodeBroadcaster")


def test_every_exported_name_resolves_and_is_documented() -> None:
    for name in cpmeta.__all__:
        obj = getattr(cpmeta, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            assert len(doc) >= 60, f"cpmeta.{name}: expected a docstring, got {doc!r}"
    assert sorted(cpmeta.__all__) == dir(cpmeta)


def test_internals_are_not_exported() -> None:
    assert "INT32_MAX" not in cpmeta.__all__
    assert not [n for n in cpmeta.__all__ if n.startswith("_")]


def test_in_place_decode_api_is_top_level_and_same_objects_as_the_gpu_room() -> None:
    import cpmeta.gpu as gpu

    for name in IN_PLACE_DECODE:
        assert name in cpmeta.__all__, name
        assert getattr(cpmeta, name) is getattr(gpu, name), name


def test_type_checkers_see_every_lazy_name() -> None:
    """A lazily imported name is also imported under ``TYPE_CHECKING`` (STYLE 20: a module
    ``__getattr__`` alone hides it behind ``Any``)."""
    tree = ast.parse((ROOT / "cpmeta" / "__init__.py").read_text())
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in ast.walk(node):
                if isinstance(imp, ast.ImportFrom):
                    typed.update(a.asname or a.name for a in imp.names)
    lazy = set(cpmeta._LAZY)  # type: ignore[attr-defined]  # the private table of lazy names
    assert lazy <= typed, sorted(lazy - typed)
