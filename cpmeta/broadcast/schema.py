"""What a broadcast layout and its values may hold: ``InputMetadata``'s fields as a schema.

Every field of :class:`~cpmeta.metadata.InputMetadata` gets one :class:`FieldSpec`, derived from
its declared type (an unknown declared type is an error at import, so a new field must be
classified here before it can be broadcast):

==============================  ==============  ===============================================
declared type                   kind            wire form
==============================  ==============  ===============================================
``Optional[Tensor]``            ``tensor``      one tensor path ``name``
``TDict`` (dict[str, Tensor])   ``tensor_dict`` tensor paths ``name.<key>``; ``{}`` = value ``name``
``Optional[bool]``              ``value``       value ``name``: exactly a bool
``Optional[int]``               ``value``       value ``name``: an int (not a bool), ``low <= v < 2**63``
``Optional[float]`` / ``str``   ``value``       value ``name``: exactly that type
``Optional[list[int]]``         ``value``       value ``name``: a list of ints ``>= low``
``Optional[dict[str, int]]``    ``value_dict``  values ``name.<key>``: ints ``>= low``; ``{}`` = value ``name``
==============================  ==============  ===============================================

Keys of dict fields are ratio strings (DESIGN 3): the canonical decimal of a positive int, at
most :data:`MAX_KEY_DIGITS` digits (``"4"``, ``"128"``; not ``"04"``, ``"4.5"``, ``"x"``). ``None`` is
never sent (a ``None`` field or entry is left out of the layout), so a ``None`` value is refused.

A layout (tensor paths with their aliases, value paths) is checked ONCE, when its plan is built
(:func:`check_layout`); its values are then checked every frame by the :class:`ValueCheck`
compiled for it: one comparison of the values' type tuple, one pass over the ints for bounds.
Worked example: value paths ``["is_prompt", "num_seqs", "total_k_compressed.4"]`` compile to
types ``(bool, int, int)``, int positions ``[1, 2]`` with lows ``(0, 0)``; the values
``[True, 3, 17]`` pass with ``(bool, int, int) == (bool, int, int)`` and ``0 <= 3, 0 <= 17``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, cast

from ..metadata import InputMetadata

__all__ = ["FieldSpec", "SCHEMA", "LayoutError", "ValueCheck", "check_layout", "check_key", "MAX_LAYOUT_PATHS",
           "MAX_KEY_DIGITS", "MAX_INT", "TENSOR", "TENSOR_DICT", "VALUE", "VALUE_DICT"]

TENSOR, TENSOR_DICT, VALUE, VALUE_DICT = "tensor", "tensor_dict", "value", "value_dict"
MAX_LAYOUT_PATHS = 1024  # tensor paths (aliases counted) + value paths of one layout
MAX_KEY_DIGITS = 10  # ratio keys: "1" .. "9999999999"
MAX_INT = (1 << 63) - 1  # every int value fits int64
#: lower bounds of int values other than 0 (counts, sizes and ranks are >= 0)
_LOW: dict[str, int] = {"cp_size": 1}


class LayoutError(ValueError):
    """A layout or a value that ``InputMetadata``'s schema does not allow (names the path)."""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field: ``kind`` (tensor / tensor_dict / value / value_dict), the Python type of a value
    (or of a value_dict entry, or of a list element when ``is_list``) and its lower bound."""

    name: str
    kind: str
    vtype: Optional[type] = None
    low: Optional[int] = None
    is_list: bool = False


_DECLARED: dict[str, tuple[str, Optional[type], bool]] = {  # declared type -> (kind, vtype, list)
    "Optional[Tensor]": (TENSOR, None, False),
    "TDict": (TENSOR_DICT, None, False),
    "Optional[bool]": (VALUE, bool, False),
    "Optional[int]": (VALUE, int, False),
    "Optional[float]": (VALUE, float, False),
    "Optional[str]": (VALUE, str, False),
    "Optional[list[int]]": (VALUE, int, True),
    "Optional[dict[str, int]]": (VALUE_DICT, int, False),
}


def _build() -> dict[str, FieldSpec]:
    out = {}
    for f in fields(InputMetadata):
        hit = _DECLARED.get(str(f.type))
        if hit is None:
            raise TypeError(f"InputMetadata.{f.name}: declared type {f.type} has no broadcast schema "
                            "(add it to cpmeta/broadcast/schema.py)")
        kind, vtype, is_list = hit
        low = _LOW.get(f.name, 0) if vtype is int else None
        out[f.name] = FieldSpec(f.name, kind, vtype, low, is_list)
    return out


#: field name -> spec, in InputMetadata's field order
SCHEMA: dict[str, FieldSpec] = _build()


def check_key(path: str, key: str) -> None:
    """Refuse a dict key that is not a ratio string (``"4"``, ``"128"``), naming the path."""
    if not (0 < len(key) <= MAX_KEY_DIGITS and key.isascii() and key.isdigit() and key[0] != "0"):
        raise LayoutError(f"{path}: dict key {key!r} is not a ratio (the decimal string of a "
                          f"positive int, at most {MAX_KEY_DIGITS} digits)")


def check_layout(tensor_paths: list[list[str]], value_paths: list[str]
                 ) -> tuple[list[list[tuple[str, Optional[str]]]], list[tuple[str, Optional[str]]]]:
    """Check a layout against :data:`SCHEMA` in one linear pass; return the parsed targets.

    ``tensor_paths[i]`` are the paths of tensor i (several when aliased), ``value_paths`` one path
    per value. Returns ``(tensor targets, value targets)`` as ``(field, key or None)``. Raises
    :class:`LayoutError` naming the path: more than :data:`MAX_LAYOUT_PATHS` paths, an unknown
    field, a tensor at a value field (or the reverse), a bad key, a path twice, a field that holds
    both a whole value (``{}``) and entries. Example: ``[["positions", "positions_cp"],
    ["klen.4"]], ["is_prompt", "ks"]`` gives ``[[("positions", None), ("positions_cp", None)],
    [("klen", "4")]], [("is_prompt", None), ("ks", None)]`` (``ks`` = an empty dict).
    """
    n = sum(map(len, tensor_paths)) + len(value_paths)
    if n > MAX_LAYOUT_PATHS:
        raise LayoutError(f"layout has {n} paths, more than MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
    seen: set[str] = set()
    whole: set[str] = set()  # fields used without a key
    keyed: set[str] = set()  # fields used with a key
    tt = [[_parse(p, True, seen, whole, keyed) for p in ps] for ps in tensor_paths]
    vt = [_parse(p, False, seen, whole, keyed) for p in value_paths]
    both = whole & keyed
    if both:
        name = min(both)
        raise LayoutError(f"{name}: holds both a whole value and dict entries")
    return tt, vt


def _parse(path: str, tensor: bool, seen: set[str], whole: set[str], keyed: set[str]
           ) -> tuple[str, Optional[str]]:
    if path in seen:
        raise LayoutError(f"{path}: path appears twice in the layout")
    seen.add(path)
    name, dot, key = path.partition(".")
    spec = SCHEMA.get(name)
    if spec is None:
        raise LayoutError(f"{path!r}: InputMetadata has no field {name!r}")
    if dot:
        check_key(path, key)  # also refuses a second dot: one level of nesting only
        keyed.add(name)
        want = TENSOR_DICT if tensor else VALUE_DICT
        if spec.kind != want:
            raise LayoutError(f"{path}: a {'tensor' if tensor else 'value'} entry in field {name!r} "
                              f"of kind {spec.kind}")
        return name, key
    whole.add(name)
    ok = spec.kind == TENSOR if tensor else spec.kind != TENSOR
    if not ok:
        raise LayoutError(f"{path}: a {'tensor' if tensor else 'value'} sent to field {name!r} "
                          f"of kind {spec.kind}")
    return name, None


class ValueCheck:
    """The per-frame check of one layout's values block, compiled once per layout.

    ``check(values)`` costs one ``tuple(map(type, values))`` comparison, one gather of the int
    values with a bound test, and one truthiness test per empty-dict value; it raises
    :class:`LayoutError` naming the first bad path. See the module docstring for an example.
    """

    def __init__(self, targets: list[tuple[str, Optional[str]]]) -> None:
        self.paths = [n if k is None else f"{n}.{k}" for n, k in targets]
        types: list[type] = []
        ints: list[int] = []
        lows: list[int] = []
        empties: list[int] = []
        lists: list[int] = []
        for i, (name, key) in enumerate(targets):
            spec = SCHEMA[name]
            if spec.kind in (TENSOR_DICT, VALUE_DICT) and key is None:
                types.append(dict)  # an empty dict (the absence of keys is information)
                empties.append(i)
            elif spec.is_list:
                types.append(list)
                lists.append(i)
            else:
                assert spec.vtype is not None
                types.append(spec.vtype)
                if spec.vtype is int:
                    ints.append(i)
                    lows.append(spec.low or 0)
        self.types = tuple(types)
        self.n = len(types)
        self._ints: Callable[[list], Any] = operator.itemgetter(*ints) if ints else (lambda v: ())
        self._one_int = len(ints) == 1
        self._int_idx = ints
        self._lows = tuple(lows)
        self._min_low = min(lows) if lows else 0
        self._uniform = all(x == self._min_low for x in lows)
        self._empties = empties
        self._lists = [(i, SCHEMA[targets[i][0]].low or 0) for i in lists]

    def __call__(self, values: Any) -> None:
        if type(values) is not list or len(values) != self.n:
            raise LayoutError(f"values block: expected a list of {self.n} values, got "
                              f"{type(values).__name__}" + (f" of {len(values)}" if isinstance(
                                  values, list) else ""))
        if tuple(map(type, values)) != self.types:
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
        for i, low in self._lists:
            if not all(type(x) is int and low <= x <= MAX_INT for x in values[i]):
                self._explain(values)

    def _explain(self, values: list[Any]) -> None:
        """Raise for the first bad value (slow path, only on a refusal)."""
        lows = dict(zip(self._int_idx, self._lows))
        for i, (path, want, v) in enumerate(zip(self.paths, self.types, values)):
            if type(v) is not want:
                raise LayoutError(f"{path}: expected {want.__name__}, got {type(v).__name__} {v!r:.60}")
            if i in lows and not lows[i] <= cast(int, v) <= MAX_INT:
                raise LayoutError(f"{path}: {v} is out of range [{lows[i]}, 2**63)")
            if want is dict and v:
                raise LayoutError(f"{path}: expected an empty dict (entries travel as {path}.<key>)")
        for i, low in self._lists:
            bad = next(x for x in values[i] if not (type(x) is int and low <= x <= MAX_INT))
            raise LayoutError(f"{self.paths[i]}: list element {bad!r:.60} is not an int >= {low}")
        raise AssertionError("ValueCheck._explain found nothing to refuse")  # pragma: no cover
