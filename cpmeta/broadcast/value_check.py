"""The per-frame checks of a layout's values: compiled once per layout, run on every frame.

:class:`ValueCheck` holds a dataclass schema's values to their declared types and bounds
(a tensor dict's tree has its own, ``cpmeta.broadcast.dict_schema.TreeCheck``); it raises
:class:`LayoutError` naming the first bad path. Worked example: value paths
``["is_prompt", "num_seqs", "total_k_compressed.4"]`` of ``InputMetadata`` compile to types
``(bool, int, int)``, int positions ``[1, 2]`` with lows ``(0, 0)``; the values ``[True, 3, 17]``
pass with ``(bool, int, int) == (bool, int, int)`` and ``0 <= 3, 0 <= 17``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, cast

__all__ = ["LayoutError", "ValueCheck", "MAX_INT", "MIN_INT", "TENSOR", "TENSOR_DICT", "VALUE",
           "VALUE_DICT"]

TENSOR, TENSOR_DICT, VALUE, VALUE_DICT = "tensor", "tensor_dict", "value", "value_dict"
MAX_INT = (1 << 63) - 1  # every int value fits int64
MIN_INT = -(1 << 63)


class LayoutError(ValueError):
    """A layout or a value that the schema does not allow (names the path)."""


class ValueCheck:
    """The per-frame check of one layout's values block, compiled once per layout.

    ``check(values)`` costs one ``tuple(map(type, values))`` comparison, one gather of the int
    values with a bound test, and one truthiness test per empty-dict value; union-typed and list
    values are checked one by one. It raises :class:`LayoutError` naming the first bad path. See
    the module docstring for an example.
    """

    def __init__(self, schema: Any, targets: list[tuple[str, Optional[str]]]) -> None:
        self.paths = [n if k is None else f"{n}.{k}" for n, k in targets]
        self.types: tuple[type, ...]
        types_: list[type] = []
        ints: list[int] = []
        lows: list[int] = []
        self._empties: list[int] = []
        self._loose: list[tuple[int, tuple[type, ...], Optional[type], int]] = []  # unions, lists
        for i, (name, key) in enumerate(targets):
            spec = schema.specs[name]
            if spec.kind in (TENSOR_DICT, VALUE_DICT) and key is None:
                types_.append(dict)  # an empty dict (the absence of keys is information)
                self._empties.append(i)
                continue
            assert spec.vtype is not None
            if spec.container is not None:
                types_.append(spec.container)
                self._loose.append((i, spec.vtype, spec.container, spec.low))
            elif len(spec.vtype) > 1:
                types_.append(object)  # checked in _loose
                self._loose.append((i, spec.vtype, None, spec.low))
            else:
                types_.append(spec.vtype[0])
                if spec.vtype[0] is int:
                    ints.append(i)
                    lows.append(spec.low)
        self.types = tuple(types_)
        self.n = len(types_)
        self._union_at = [i for i, _, c, _ in self._loose if c is None]
        self._ints: Callable[[list], Any] = operator.itemgetter(*ints) if ints else (lambda v: ())
        self._one_int = len(ints) == 1
        self._int_idx = ints
        self._lows = tuple(lows)
        self._min_low = min(lows) if lows else 0
        self._uniform = all(x == self._min_low for x in lows)

    def __call__(self, values: Any) -> None:
        if type(values) is not list or len(values) != self.n:
            raise LayoutError(f"values block: expected a list of {self.n} values, got "
                              f"{type(values).__name__}" + (f" of {len(values)}" if isinstance(
                                  values, list) else ""))
        got = tuple(map(type, values))
        if got != self.types and not self._union_match(got):
            self._explain(values)
        if self._lows:
            ints = self._ints(values)
            if self._one_int:
                ints = (ints,)
            if self._uniform:
                ok = min(ints) >= self._min_low and max(ints) <= MAX_INT
            else:
                ok = all(map(operator.le, self._lows, ints)) and max(ints) <= MAX_INT
            if not ok:
                self._explain(values)
        for i in self._empties:
            if values[i]:
                self._explain(values)
        for i, vt, c, low in self._loose:
            v = values[i]
            if not _ok_items(v if c is not None else (v,), vt, low):
                self._explain(values)

    def _union_match(self, got: tuple[type, ...]) -> bool:
        """The type tuple matches once the union-typed positions are left to ``_loose``."""
        if not self._union_at:
            return False
        g = list(got)
        for i in self._union_at:
            g[i] = object
        return tuple(g) == self.types

    def _explain(self, values: list[Any]) -> None:
        """Raise for the first bad value (slow path, only on a refusal)."""
        lows = dict(zip(self._int_idx, self._lows))
        loose = {i: (vt, c, low) for i, vt, c, low in self._loose}
        for i, (path, want, v) in enumerate(zip(self.paths, self.types, values)):
            if i in loose:
                vt, c, low = loose[i]
                if c is not None and type(v) is not c:
                    raise LayoutError(f"{path}: expected {c.__name__}, got {type(v).__name__} {v!r:.60}")
                if not _ok_items(v if c is not None else (v,), vt, low):
                    bad = v if c is None else next(x for x in v if not _ok_items((x,), vt, low))
                    raise LayoutError(f"{path}: {'element ' if c is not None else ''}{bad!r:.60} is not "
                                      f"{' or '.join(t.__name__ for t in vt)}"
                                      + (f" >= {low}" if int in vt and low > MIN_INT else ""))
                continue
            if type(v) is not want:
                raise LayoutError(f"{path}: expected {want.__name__}, got {type(v).__name__} {v!r:.60}")
            if i in lows and not lows[i] <= cast(int, v) <= MAX_INT:
                raise LayoutError(f"{path}: {v} is out of range [{lows[i]}, 2**63)")
            if want is dict and v:
                raise LayoutError(f"{path}: expected an empty dict (entries travel as {path}.<key>)")
        raise AssertionError("ValueCheck._explain found nothing to refuse")  # pragma: no cover


def _ok_items(items: Any, vt: tuple[type, ...], low: int) -> bool:
    """Every one of ``items`` (a container's items, or ``(value,)`` of a union-typed field) has
    one of the types ``vt`` exactly, ints in ``[low, 2**63)``."""
    for x in items:
        t = type(x)
        if t not in vt or (t is int and not low <= x <= MAX_INT):
            return False
    return True
