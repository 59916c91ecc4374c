"""The per-frame checks of a layout's values: made once per layout, run on every frame.

:class:`ValueCheck` holds a dataclass schema's values to their declared types and bounds
(a tensor dict's tree has its own, ``cpmeta.broadcast.dict_schema.TreeCheck``); it raises
:class:`LayoutError` naming the first bad path. Worked example: value paths
``["is_prompt", "num_seqs", "total_k_compressed.4"]`` of ``InputMetadata`` make the rules
"exactly bool", "an int in [0, 2**63)", "an int in [0, 2**63)"; the values ``[True, 3, 17]`` pass,
``[True, -1, 17]`` raises ``LayoutError("num_seqs: -1 is out of range [0, 2**63)")``.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["LayoutError", "ValueCheck", "MAX_INT", "MIN_INT", "TENSOR", "TENSOR_DICT", "VALUE",
           "VALUE_DICT"]

TENSOR, TENSOR_DICT, VALUE, VALUE_DICT = "tensor", "tensor_dict", "value", "value_dict"
MAX_INT = (1 << 63) - 1  # every int value fits int64
MIN_INT = -(1 << 63)


class LayoutError(ValueError):
    """A layout or a value that the schema does not allow (names the path)."""


#: How one value position is checked (``ValueCheck._rules``).
_INT, _EXACT, _EMPTY, _ITEMS, _UNION = range(5)


class ValueCheck:
    """The per-frame check of one layout's values block, made once per layout.

    ``check(values)`` walks the values once against one rule per position (an int in bounds, an
    exact type, an empty dict, a container's items, a union) and raises :class:`LayoutError`
    naming the first bad path. See the module docstring for an example.
    """

    def __init__(self, schema: Any, targets: list[tuple[str, Optional[str]]]) -> None:
        self.paths = [n if k is None else f"{n}.{k}" for n, k in targets]
        rules: list[tuple[str, int, Optional[type], tuple[type, ...], int]] = []
        for path, (name, key) in zip(self.paths, targets):
            spec = schema.specs[name]
            if spec.kind in (TENSOR_DICT, VALUE_DICT) and key is None:
                # an empty dict (the absence of keys is information)
                rules.append((path, _EMPTY, dict, (), 0))
                continue
            assert spec.vtype is not None
            if spec.container is not None:
                rules.append((path, _ITEMS, spec.container, spec.vtype, spec.low))
            elif len(spec.vtype) > 1:
                rules.append((path, _UNION, None, spec.vtype, spec.low))
            elif spec.vtype[0] is int:
                rules.append((path, _INT, int, (int,), spec.low))
            else:
                rules.append((path, _EXACT, spec.vtype[0], spec.vtype, spec.low))
        self._rules = rules
        self.n = len(rules)

    def __call__(self, values: Any) -> None:
        if type(values) is not list or len(values) != self.n:
            raise LayoutError(f"values block: expected a list of {self.n} values, got "
                              f"{type(values).__name__}" + (f" of {len(values)}" if isinstance(
                                  values, list) else ""))
        for v, (path, kind, want, vt, low) in zip(values, self._rules):
            t = type(v)
            if kind == _INT:
                if t is int and low <= v <= MAX_INT:
                    continue
            elif kind == _EXACT:
                if t is want:
                    continue
            elif kind == _EMPTY:
                if t is dict and not v:
                    continue
            elif kind == _ITEMS:
                if t is want and _ok_items(v, vt, low):
                    continue
            elif _ok_items((v,), vt, low):
                continue
            _refuse(path, kind, want, vt, low, v)


def _refuse(path: str, kind: int, want: Optional[type], vt: tuple[type, ...], low: int, v: Any) -> None:
    """Raise :class:`LayoutError` for the value ``v`` at ``path`` that broke its rule."""
    if kind in (_ITEMS, _UNION):
        if want is not None and type(v) is not want:
            raise LayoutError(f"{path}: expected {want.__name__}, got {type(v).__name__} {v!r:.60}")
        bad = v if want is None else next(x for x in v if not _ok_items((x,), vt, low))
        raise LayoutError(f"{path}: {'element ' if want is not None else ''}{bad!r:.60} is not "
                          f"{' or '.join(t.__name__ for t in vt)}"
                          + (f" >= {low}" if int in vt and low > MIN_INT else ""))
    assert want is not None
    if type(v) is not want:
        raise LayoutError(f"{path}: expected {want.__name__}, got {type(v).__name__} {v!r:.60}")
    if kind == _INT:
        raise LayoutError(f"{path}: {v} is out of range [{low}, 2**63)")
    raise LayoutError(f"{path}: expected an empty dict (entries travel as {path}.<key>)")


def _ok_items(items: Any, vt: tuple[type, ...], low: int) -> bool:
    """Every one of ``items`` (a container's items, or ``(value,)`` of a union-typed field) has
    one of the types ``vt`` exactly, ints in ``[low, 2**63)``."""
    for x in items:
        t = type(x)
        if t not in vt or (t is int and not low <= x <= MAX_INT):
            return False
    return True
