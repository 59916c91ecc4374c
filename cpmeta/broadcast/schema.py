"""What a frame may carry: a dataclass's fields as a schema.

A :class:`Schema` is derived once from a dataclass's annotations (``Schema.of(cls)``) and is
what every layout of that class is checked against. Each field gets one :class:`FieldSpec`:

====================================  ==============  ==========================================
annotation (``Optional[...]`` ok)      kind            wire form
====================================  ==============  ==========================================
``Tensor``                            ``tensor``      one tensor path ``name``
``dict[str, Tensor]`` /               ``tensor_dict`` tensor paths ``name.<key>``; ``{}`` =
``dict[int, Tensor]``                                 value ``name``
``bool`` / ``int`` / ``float`` /      ``value``       value ``name``: exactly that type (an
``str`` (or a union of them)                          ``int`` is never a bool; ``low <= v <
                                                      2**63``)
``list[T]`` / ``tuple[T, ...]``       ``value``       value ``name``: a list (tuple) of ``T``,
(``T`` a scalar type or union)                        ``T`` a scalar type or a union of them
``dict[str, T]`` / ``dict[int, T]``   ``value_dict``  values ``name.<key>``; ``{}`` = value
(``T`` scalar)                                        ``name``
====================================  ==============  ==========================================

Any other annotation is refused when the schema is made (``TypeError`` naming the field), so a
field that cannot travel is found at construction, not at the first step. ``None`` is never
sent: a ``None`` field or dict entry is left out of the layout (the receiver's field is then
``None``), so a ``None`` value is refused. A tensor field may pin its dtype and ndim (number of
dimensions) through its dataclass field metadata ``{"cpmeta": info}`` with ``info.dtype`` /
``info.ndim`` (``None`` = not fixed; ``InputMetadata``'s field table does this): a layout that
declares another dtype or ndim is refused once, when its plan is built, on the driver as on every
follower. A pin that cannot hold (a dtype the frame cannot carry, an ndim outside 0..16, a pin on
a field that is not a tensor), a class without fields, or a field with ``init=False`` is refused
by ``Schema.of`` itself, naming the field.

Dict keys: ``dict[int, ...]`` keys are ints (int64; the path carries the canonical decimal,
``layers.3``, ``layers.-1``; they arrive as ints, and a driver whose dict holds a key of another
type is refused before anything is sent). ``dict[str, ...]`` keys follow ``dict_keys="ratio"``
(``InputMetadata``: the canonical decimal of a positive int, ``"4"``, ``"128"``) or ``"name"``
(any other dataclass: 1-64 printable ASCII characters without ``.``, ``;`` or ``,``). One
annotation's classification (:class:`FieldSpec`, :func:`classify`, the pins) and the key rules
(:func:`check_key`) are ``cpmeta.broadcast.field_spec``.

``cpmeta.broadcast.dict_schema.DictSchema`` is the schema of a plain tensor dict
(``cpmeta.broadcast_tensor_dict``). A layout is checked ONCE, when its plan is built
(:meth:`Schema.check_layout`); its values are then checked every frame by the
``cpmeta.broadcast.value_check.ValueCheck`` compiled for it (worked example there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import operator
import typing
from typing import Any, Callable, Optional

import torch

from ..cache import BoundedCache
from .field_spec import (MAX_KEY_DIGITS, MAX_NAME_KEY, FieldSpec, check_key, classify, field_pins,
                         shape_fixed_dims)
from .value_check import MIN_INT, TENSOR, TENSOR_DICT, VALUE, VALUE_DICT, LayoutError, ValueCheck

__all__ = ["FieldSpec", "Schema", "check_key", "classify", "MAX_LAYOUT_PATHS", "MAX_KEY_DIGITS",
           "MAX_NAME_KEY", "TENSOR", "TENSOR_DICT", "VALUE", "VALUE_DICT", "INPUT_METADATA",
           "SCHEMA_FINGERPRINT", "describe", "explain_mismatch"]

MAX_LAYOUT_PATHS = 1024  # tensor paths (aliases counted) + value paths of one layout
MAX_LAYOUTS_CACHED = 256  # field-type walks a schema keeps (wire.MAX_LAYOUTS)


class Schema:
    """The wire schema of one dataclass (see the module docstring); made once per class.

    ``fingerprint`` (16 hex digits) hashes the class's qualified name, every field's name, kind,
    value types, key type and pinned dtype / ndim: two ranks whose classes differ in any of
    those refuse each other's frames. ``Schema.of(cls)`` caches the schema per class and arguments.
    """

    _CACHE: dict[tuple, "Schema"] = {}

    def __init__(self, cls: type, *, dict_keys: str = "name", int_low: int = MIN_INT,
                 lows: Optional[dict[str, int]] = None, version: int = 0) -> None:
        if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
            raise TypeError(f"schema: expected a dataclass type, got {cls!r}")
        if dict_keys not in ("ratio", "name"):
            raise ValueError(f"dict_keys: expected 'ratio' or 'name', got {dict_keys!r}")
        self.cls = cls
        self.name = cls.__qualname__
        self.dict_keys = dict_keys
        self.version = version
        hints = typing.get_type_hints(cls)
        fs = dataclasses.fields(cls)
        if not fs:
            raise TypeError(f"{self.name}: a dataclass without fields has nothing to broadcast")
        specs: dict[str, FieldSpec] = {}
        for f in fs:
            if not f.init:
                raise TypeError(f"{self.name}.{f.name}: a field with init=False cannot be rebuilt "
                                "on the receiver")
            kind, vtype, container, key = classify(f"{self.name}.{f.name}", hints[f.name])
            info = f.metadata.get("cpmeta") if f.metadata else None
            low = (lows or {}).get(f.name, int_low)
            tensor = kind in (TENSOR, TENSOR_DICT)
            dtype, ndim = field_pins(f"{self.name}.{f.name}", info, tensor)
            specs[f.name] = FieldSpec(f.name, kind, vtype, low, container, dtype, ndim,
                                      shape_fixed_dims(info) if tensor else (), key)
        self.specs = specs
        self.field_names: tuple[str, ...] = tuple(f.name for f in fs)
        self.positions = {n: i for i, n in enumerate(self.field_names)}
        int_keyed = tuple(i for i, s in enumerate(specs.values()) if s.key is int)
        self.get_all: Callable[[Any], tuple] = _fields_getter(self.field_names, int_keyed, self.name)
        # a positional row rebuilds the object when every field defaults to None
        self.positional = all(f.default is None for f in fs)
        desc = ";".join(f"{s.name}:{s.kind}:{_tname(s.vtype)}:{s.container and s.container.__name__}"
                        f":{s.dtype}:{s.ndim}:{s.low}:{s.fixed}" + (":int" if s.key is int else "")
                        for s in specs.values())
        self.fingerprint = hashlib.sha256(
            f"v{version}|{cls.__module__}.{self.name}|{dict_keys}|{desc}".encode()).hexdigest()[:16]
        # collect's per-field-types walks (cpmeta.broadcast.collect)
        self.walks: BoundedCache[tuple, Any] = BoundedCache(MAX_LAYOUTS_CACHED)

    @classmethod
    def of(cls, dc: type, **kw: Any) -> "Schema":
        """The schema of dataclass ``dc`` (made once per class and arguments)."""
        key = (dc, tuple(sorted(kw.items(), key=lambda kv: kv[0])).__repr__())
        hit = cls._CACHE.get(key)
        if hit is None:
            hit = cls._CACHE[key] = Schema(dc, **kw)
        return hit

    # ---- layouts ----------------------------------------------------------------------------
    def check_layout(self, tensor_paths: list[list[str]], value_paths: list[str]
                     ) -> tuple[list[list[tuple[str, Optional[str]]]], list[tuple[str, Optional[str]]]]:
        """Check a layout in one linear pass; return the parsed targets.

        ``tensor_paths[i]`` are the paths of tensor i (several when aliased), ``value_paths`` one
        path per value. Returns ``(tensor targets, value targets)`` as ``(field, key or None)``.
        Raises :class:`LayoutError` naming the path: more than :data:`MAX_LAYOUT_PATHS` paths, an
        unknown field, a tensor at a value field (or the reverse), a bad key, a path twice, a
        field that holds both a whole value (``{}``) and entries. Example (InputMetadata):
        ``[["positions", "positions_cp"], ["klen.4"]], ["is_prompt", "ks"]`` gives
        ``[[("positions", None), ("positions_cp", None)], [("klen", "4")]], [("is_prompt",
        None), ("ks", None)]`` (``ks`` = an empty dict).
        """
        n = sum(map(len, tensor_paths)) + len(value_paths)
        if n > MAX_LAYOUT_PATHS:
            raise LayoutError(f"layout has {n} paths, more than MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
        seen: set[str] = set()
        whole: set[str] = set()  # fields used without a key
        keyed: set[str] = set()  # fields used with a key
        tt = [[self._parse(p, True, seen, whole, keyed) for p in ps] for ps in tensor_paths]
        vt = [self._parse(p, False, seen, whole, keyed) for p in value_paths]
        both = whole & keyed
        if both:
            raise LayoutError(f"{min(both)}: holds both a whole value and dict entries")
        return tt, vt

    def _parse(self, path: str, tensor: bool, seen: set[str], whole: set[str], keyed: set[str]
               ) -> tuple[str, Optional[str]]:
        if path in seen:
            raise LayoutError(f"{path}: path appears twice in the layout")
        seen.add(path)
        name, dot, key = path.partition(".")
        spec = self.specs.get(name)
        if spec is None:
            raise LayoutError(f"{path!r}: {self.name} has no field {name!r}")
        if dot:
            want = TENSOR_DICT if tensor else VALUE_DICT
            if spec.kind != want:
                raise LayoutError(f"{path}: a {'tensor' if tensor else 'value'} entry in field "
                                  f"{name!r} of kind {spec.kind}")
            keyed.add(name)
            # the key as the receiver's dict holds it (a second dot is refused: one level only)
            return name, check_key(path, key, "int" if spec.key is int else self.dict_keys)
        whole.add(name)
        if not (spec.kind == TENSOR if tensor else spec.kind != TENSOR):
            raise LayoutError(f"{path}: a {'tensor' if tensor else 'value'} sent to field {name!r} "
                              f"of kind {spec.kind}")
        return name, None

    def check_tensors(self, targets: list[list[tuple[str, Optional[str]]]], dtypes: list[torch.dtype],
                      ndims: list[int]) -> None:
        """Refuse a layout whose tensor at a pinned field has another dtype or ndim (once per
        layout), naming the path: ``positions: float64 ndim 1, InputMetadata pins int32 ndim 1``."""
        for ts, dt, nd in zip(targets, dtypes, ndims):
            for name, key in ts:
                spec = self.specs[name]
                if (spec.dtype is not None and dt != spec.dtype) or (spec.ndim is not None and nd != spec.ndim):
                    path = name if key is None else f"{name}.{key}"
                    raise LayoutError(
                        f"{path}: {str(dt).replace('torch.', '')} ndim {nd}, {self.name} pins "
                        f"{str(spec.dtype or 'any dtype').replace('torch.', '')} ndim "
                        f"{spec.ndim if spec.ndim is not None else 'any'}")

    def fixed_dims(self, targets: list[list[tuple[str, Optional[str]]]], ndims: list[int]
                   ) -> list[tuple[int, int, str]]:
        """``(flat dims index, size, path)`` of every dim the layout's fields fix (once per
        layout). Example: ``load_segments_swa`` (ndim 2) as the second tensor after a 1-D one ->
        ``[(2, 4, "load_segments_swa")]``."""
        out, at = [], 0
        for ts, nd in zip(targets, ndims):
            name, key = ts[0]
            for ax, size in self.specs[name].fixed:
                if ax < nd:
                    out.append((at + ax, size, name if key is None else f"{name}.{key}"))
            at += nd
        return out

    def value_check(self, targets: list[tuple[str, Optional[str]]]) -> "ValueCheck":
        return ValueCheck(self, targets)

    # ---- rebuilding -------------------------------------------------------------------------
    def build(self, row: list[Any]) -> Any:
        """The object from a row of field values in field order (``None`` = unset)."""
        if self.positional:
            return self.cls(*row)
        return self.cls(**dict(zip(self.field_names, row)))


def _fields_getter(names: tuple[str, ...], int_keyed: tuple[int, ...] = (), cls: str = ""
                   ) -> Callable[[Any], tuple]:
    """``f(obj) -> tuple`` of every field in one C call (a 1-tuple for one field). With
    ``int_keyed`` (positions of ``dict[int, ...]`` fields) it also refuses, on the driver, a dict
    there holding a key that is not exactly an int: its path (``layers.3``) would reach the
    followers as the int 3 while the driver holds ``"3"``. Example: ``{3: t, "4": u}`` at
    ``layers`` -> ``TypeError("Meta.layers: dict key '4' is str, the field's keys are int")``."""
    get = operator.attrgetter(*names)
    one = len(names) == 1
    if not int_keyed:
        return (lambda obj: (get(obj),)) if one else get
    at = [(i, names[i]) for i in int_keyed]

    def get_checked(obj: Any) -> tuple:
        vals = (get(obj),) if one else get(obj)
        for i, name in at:
            d = vals[i]
            if type(d) is dict:
                for k in d:
                    if type(k) is not int:
                        raise TypeError(f"{cls}.{name}: dict key {k!r:.40} is "
                                        f"{type(k).__name__}, the field's keys are int")
        return vals
    return get_checked


def _tname(vt: Optional[tuple[type, ...]]) -> str:
    return "|".join(t.__name__ for t in vt) if vt else "-"


def _input_metadata_schema() -> Schema:
    from ..metadata import InputMetadata
    from .wire import MESSAGE_VERSION

    return Schema.of(InputMetadata, dict_keys="ratio", int_low=0, lows={"cp_size": 1},
                     version=MESSAGE_VERSION)


def _field_text(s: FieldSpec) -> str:
    """A field as its annotation reads, with its pins: ``positions: Tensor int32 ndim 1``,
    ``window: int | str``, ``layers: dict[int, Tensor]``, ``lens: tuple[int, ...] >= 0``."""
    vt = " | ".join(t.__name__ for t in s.vtype or ())
    key = s.key.__name__ if s.key is not None else "str"
    text = {TENSOR: "Tensor", TENSOR_DICT: f"dict[{key}, Tensor]", VALUE_DICT: f"dict[{key}, {vt}]"}.get(
        s.kind, f"list[{vt}]" if s.container is list else f"tuple[{vt}, ...]" if s.container is tuple else vt)
    pins = "".join(f" {w}" for w in (str(s.dtype).replace("torch.", "") if s.dtype else "",
                                     f"ndim {s.ndim}" if s.ndim is not None else "",
                                     f"dims {list(s.fixed)}" if s.fixed else "",
                                     f">= {s.low}" if s.low > MIN_INT and s.kind in (VALUE, VALUE_DICT)
                                     else "") if w)
    return f"{s.name}: {text}{pins}"


def describe(schema: Any) -> list[Any]:
    """What a rank's schema is, as plain values to compare across ranks: ``[class, settings,
    [field text, ...]]`` (``cpmeta.broadcast.dict_schema.DictSchema``: its name and fingerprint,
    no fields). Example: ``["m.FlashAttnMetadata", "name|v0", ["num_actual_tokens: int", ...]]``."""
    specs = getattr(schema, "specs", None)
    if specs is None:
        return [schema.name, schema.fingerprint, []]
    return [f"{schema.cls.__module__}.{schema.name}", f"{schema.dict_keys}|v{schema.version}",
            [_field_text(sp) for sp in specs.values()]]


_WHY_SEQ: dict[str, int] = {}  # group name -> explanations exchanged on it by this process


def explain_mismatch(group: Any, schema: Any, what: str, wait_s: float) -> Optional[str]:
    """Collective, after the set-up refused the schema setting on every member (so every member
    calls it): each member's :func:`describe` through torch.distributed's default store (every
    wait bounded by ``wait_s``), and the message every member then raises: the class and its
    first differing field with the ranks holding each version. None when there is no store, a
    member does not answer, or the descriptions are equal (the fingerprint differs for another
    reason: another cpmeta version). Example: ``MetadataBroadcaster schema differs across the
    group: class tests.EngineMeta, first difference at field 2: 'window: int | str' at ranks
    [0], 'window: int' at ranks [1] (every rank must broadcast the same class definition)``."""
    from datetime import timedelta

    import torch.distributed as dist

    from cpmeta.transport.codec import decode_body, encode_body

    try:
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        name = str(getattr(group, "group_name", "") or "_".join(map(str, ranks)))
        seq = _WHY_SEQ[name] = _WHY_SEQ.get(name, -1) + 1
        keys = [f"cpmeta/schema-why/{name}/{seq}/{r}" for r in ranks]
        store.set(keys[ranks.index(dist.get_rank())], encode_body(describe(schema)))  # type: ignore[arg-type]  # Store.set takes bytes too
        store.wait(keys, timedelta(seconds=wait_s))
        got = {r: decode_body(bytes(store.get(k))) for r, k in zip(ranks, keys)}
    except Exception:  # noqa: BLE001 - no explanation: the set-up's own message stands
        return None
    by: dict[str, list[int]] = {}
    for r, d in got.items():
        by.setdefault(repr(d), []).append(r)
    if len(by) < 2:
        return None
    (ref, ref_ranks), *others = [(got[rs[0]], rs) for rs in by.values()]
    parts = []
    for other, rs in others:
        if ref[0] != other[0]:
            parts.append(f"class {ref[0]} at ranks {ref_ranks}, {other[0]} at ranks {rs}")
            continue
        for i, (a, b) in enumerate(itertools.zip_longest(ref[2], other[2], fillvalue=None)):
            if a != b:
                parts.append(f"class {ref[0]}, first difference at field {i}: "
                             f"{a or 'no field'!r} at ranks {ref_ranks}, {b or 'no field'!r} at ranks {rs}")
                break
        else:
            parts.append(f"class {ref[0]}, the same fields; settings {ref[1]!r} at ranks {ref_ranks}, "
                         f"{other[1]!r} at ranks {rs}")
    return (f"{what} schema differs across the group: {'; '.join(parts)} (every rank must "
            "broadcast the same class definition)")


#: ``InputMetadata``'s schema: ratio keys, ints >= 0 (``cp_size`` >= 1), dtypes and ndims pinned
#: by its field table
INPUT_METADATA: Schema = _input_metadata_schema()
#: the fingerprint every InputMetadata frame carries
SCHEMA_FINGERPRINT: str = INPUT_METADATA.fingerprint
