"""House rule 22 (issue 31 item 2): a room's private state stays in the room.

A room is a directory of library code (``cpmeta/``, ``cpmeta/state/``, ``cpmeta/builders/``,
``cpmeta/cp/``, ``cpmeta/gpu/``, ``cpmeta/broadcast/``, ``cpmeta/transport/``, ``cpmeta/launch/``, and any folder
added later). Checked with ``ast`` over every module of ``cpmeta``, ``transport`` and ``launch``:

- no module reads or writes ``x._name`` (``x`` not ``self`` / ``cls``) where ``_name`` is a private
  attribute of a class defined only in other rooms -- other rooms go through a named constructor or
  a public read-only view (``SequenceBatch.vouch_for``, ``StateStore.block_table``, ...);
- no module imports a private name (``from m import _helper``) or a private module of another room.

Who owns ``_name``: every class that assigns ``self._name`` / ``cls._name`` in its methods, declares
it in its body (an annotation, an assignment, ``__slots__``) or defines a method ``_name``. The
heuristic is by attribute name, not by type: a name owned in the reader's own room is allowed
(the reader may mean its own class), and ``x`` bound by ``import`` (a module: ``np``, ``torch``)
or a name private to the reading module itself is never a violation.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("cpmeta",)


def _parse(root: Path, packages: Iterable[str]) -> dict[str, ast.Module]:
    """``{path relative to root: tree}`` of every module under ``packages``."""
    trees = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" not in f.parts:
                rel = f.relative_to(root).as_posix()
                trees[rel] = ast.parse(f.read_text(), rel)
    return trees


def _room(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _class_owns(cls: ast.ClassDef) -> set[str]:
    """Private attribute names the class owns (see the module docstring)."""
    owned: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            owned.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Name) and _private(t.id):
                owned.add(t.id)
            if isinstance(t, ast.Name) and t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                owned |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)
                          and isinstance(e.value, str) and _private(e.value)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            owned.add(node.attr)
    return owned


def _owners(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """``{private attribute: rooms of the classes that own it}``."""
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for name in _class_owns(node):
                    owners.setdefault(name, set()).add(_room(path))
    return owners


def _module_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(names bound by import statements, private names defined at module level)``."""
    imported, private = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            private.add(node.name)
        for t in (node.targets if isinstance(node, ast.Assign) else
                  [node.target] if isinstance(node, ast.AnnAssign) else []):
            if isinstance(t, ast.Name) and _private(t.id):
                private.add(t.id)
    return imported, private


def private_attribute_crossings(trees: dict[str, ast.Module]) -> list[str]:
    """``"path:line: x._name (owned by rooms ...)"`` for every read or write of another room's
    private attribute."""
    owners = _owners(trees)
    found = []
    for path, tree in trees.items():
        room = _room(path)
        imported, own_private = _module_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in owners):
                continue
            base = node.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in imported):
                continue
            if room in owners[node.attr] or node.attr in own_private:
                continue
            found.append(f"{path}:{node.lineno}: {ast.unparse(base)}.{node.attr} "
                         f"(owned by {', '.join(sorted(owners[node.attr]))})")
    return found


def _resolve(path: str, node: ast.ImportFrom) -> Optional[str]:
    """The module path (``cpmeta/state/batch``) an ``import from`` names, or None outside the tree."""
    if node.level == 0:
        return (node.module or "").replace(".", "/")
    parts = path[:-3].split("/")[:-node.level]
    return "/".join(parts + (node.module.split(".") if node.module else []))


def private_imports_across_rooms(trees: dict[str, ast.Module]) -> list[str]:
    """``"path:line: from m import _name"`` for a private name or module of another room."""
    modules = {p[:-3] for p in trees} | {p[: -len("/__init__.py")] for p in trees if p.endswith("/__init__.py")}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            mod = _resolve(path, node)
            if mod is None or mod not in modules:
                continue
            mod_room = mod if f"{mod}/__init__.py" in trees else _room(mod + ".py")
            for alias in node.names:
                target_room = mod if f"{mod}/{alias.name}.py" in trees else mod_room
                private_module = any(_private(p) for p in mod.split("/"))
                if (_private(alias.name) or private_module) and target_room != _room(path):
                    found.append(f"{path}:{node.lineno}: from {mod.replace('/', '.')} import {alias.name}")
    return found


@lru_cache(maxsize=1)
def _library() -> dict[str, ast.Module]:
    return _parse(ROOT, LIBRARY)


def test_no_private_attribute_crosses_a_room() -> None:
    found = private_attribute_crossings(_library())
    assert not found, "private attributes read or written from another room:\n  " + "\n  ".join(found)


def test_no_private_name_is_imported_across_rooms() -> None:
    found = private_imports_across_rooms(_library())
    assert not found, "private names imported from another room:\n  " + "\n  ".join(found)


def test_the_checks_catch_crossings_and_allow_the_room(tmp_path: Path) -> None:
    """On a small tree: what house_check.py reported before issue 31 (a builder reading a batch's
    private marker; a state module filling a batch of its room field by field is fine), writes,
    private methods, and the exemptions."""
    files = {
        "lib/state/batch.py": "class Batch:\n    __slots__ = ('_rows',)\n    _vouch: object = None\n"
                              "    def validate(self):\n        self._checked = 1\n        self._helper()\n"
                              "    def _helper(self):\n        return self._rows\n",
        "lib/state/fast.py": "from .batch import Batch\n\ndef make():\n    b = Batch.__new__(Batch)\n"
                             "    b._rows = ()\n    b._checked = 2\n    return b\n",
        "lib/builders/extract.py": "import numpy as np\nfrom ..state.batch import Batch\n_cache = {}\n\n"
                                   "def read(sb, mod):\n    x = sb._checked\n    sb._vouch = None\n"
                                   "    sb._helper()\n    np._NoValue\n    mod._cache\n    return x\n",
        "lib/builders/own.py": "class Own:\n    def __init__(self):\n        self._rows = 1\n\n"
                               "def peek(o):\n    return o._rows\n",
        "lib/gpu/stage.py": "from ..state.batch import _hidden\nfrom ..builders import own\n"
                            "from ..state._private import thing\nfrom ._mine import ok\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for rel in ("lib/state/_private.py", "lib/gpu/_mine.py"):
        (tmp_path / rel).write_text("thing = ok = 1\n")
    trees = _parse(tmp_path, ["lib"])
    crossings = private_attribute_crossings(trees)
    assert [c.split(" (")[0] for c in crossings] == [
        "lib/builders/extract.py:6: sb._checked", "lib/builders/extract.py:7: sb._vouch",
        "lib/builders/extract.py:8: sb._helper"], crossings  # o._rows: owned in builders/ too (Own)
    assert private_imports_across_rooms(trees) == [
        "lib/gpu/stage.py:1: from lib.state.batch import _hidden",
        "lib/gpu/stage.py:3: from lib.state._private import thing"]
