"""One field of a dataclass schema: its annotation classified into a :class:`FieldSpec`.

:func:`classify` maps an annotation to its kind (the table in ``cpmeta.broadcast.schema``'s module
docstring: ``tensor``, ``tensor_dict``, ``value``, ``value_dict``), its value types, container and
key type, or refuses it (``TypeError`` naming the field); :func:`field_pins` reads the dtype / ndim
a field's metadata pins and :func:`shape_fixed_dims` the dims its shape rule fixes;
:func:`check_key` is the rule a path's dict key must follow (``int``, ``ratio`` or ``name``). A
:class:`~cpmeta.broadcast.schema.Schema` is made of one :class:`FieldSpec` per field.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .value_check import MAX_INT, MIN_INT, TENSOR, TENSOR_DICT, VALUE, VALUE_DICT, LayoutError
from .wire import MAX_NDIM, WIRE_DTYPES

__all__ = ["FieldSpec", "classify", "field_pins", "shape_fixed_dims", "check_key", "MAX_KEY_DIGITS",
           "MAX_NAME_KEY", "SCALARS"]

MAX_KEY_DIGITS = 10  # ratio keys: "1" .. "9999999999"
MAX_NAME_KEY = 64  # characters of a "name" dict key / a DictSchema key (256)
SCALARS: tuple[type, ...] = (bool, int, float, str)
_NONE = type(None)
_FORBIDDEN_KEY_CHARS = frozenset(".;,")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field: ``kind`` (tensor / tensor_dict / value / value_dict), the Python type(s) of a
    value (of a value_dict entry, of a list element when ``container`` is list or tuple), its
    lower bound for ints, for tensors the pinned ``dtype`` / ``ndim`` (None: free) and
    ``fixed``: ``(axis, size)`` of every dim the field's shape rule fixes in every step kind
    (``load_segments_swa`` [num_segments, 4] -> ``((1, 4),)``), and for dict kinds the type of
    their keys (``str`` or ``int``)."""

    name: str
    kind: str
    vtype: Optional[tuple[type, ...]] = None
    low: int = MIN_INT
    container: Optional[type] = None
    dtype: Optional[torch.dtype] = None
    ndim: Optional[int] = None
    fixed: tuple[tuple[int, int], ...] = ()
    key: Optional[type] = None


def shape_fixed_dims(info: Any) -> tuple[tuple[int, int], ...]:
    """``(axis, size)`` of the int dims of a field-table shape rule that every step kind shares
    (``info.shape`` / ``info.prompt_shape``; any other record: none). Example: shape
    ``("total_q", 4)`` -> ``((1, 4),)``."""
    shapes = [s for s in (getattr(info, "shape", None), getattr(info, "prompt_shape", None))
              if isinstance(s, tuple) and s]
    if not shapes or len({len(s) for s in shapes}) != 1:
        return ()
    return tuple((ax, d) for ax, d in enumerate(shapes[0])
                 if type(d) is int and all(s[ax] == d for s in shapes))


def _strip_optional(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``(tp without None, the union's members)``: ``Optional[int]`` -> ``(int, (int,))``,
    ``int | str`` -> ``(Union[int, str], (int, str))``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = tuple(a for a in typing.get_args(tp) if a is not _NONE)
        if len(members) == 1:
            return members[0], members
        return tp, members
    return tp, (tp,)


def _scalar_types(tp: Any) -> Optional[tuple[type, ...]]:
    """The scalar types ``tp`` admits (``int`` -> ``(int,)``, ``int | str`` -> ``(int, str)``),
    or None when it is not a scalar type / union of scalars."""
    _, members = _strip_optional(tp)
    if members and all(m in SCALARS for m in members):
        return tuple(members)
    return None


def classify(name: str, tp: Any) -> tuple[str, Optional[tuple[type, ...]], Optional[type], Optional[type]]:
    """``(kind, value types, container, key type)`` of a field annotation; ``TypeError`` naming
    the field for an annotation that cannot travel. Examples: ``Optional[Tensor]`` ->
    ``("tensor", None, None, None)``; ``dict[str, int]`` -> ``("value_dict", (int,), None,
    str)``; ``Dict[int, Tensor]`` -> ``("tensor_dict", None, None, int)``; ``tuple[int, ...]``
    -> ``("value", (int,), tuple, None)``."""
    base, _ = _strip_optional(tp)
    if isinstance(base, type) and issubclass(base, torch.Tensor):
        return TENSOR, None, None, None
    scalars = _scalar_types(tp)
    if scalars is not None:
        return VALUE, scalars, None, None
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin is dict and len(args) == 2 and args[0] in (str, int):
        vbase, _ = _strip_optional(args[1])
        if isinstance(vbase, type) and issubclass(vbase, torch.Tensor):
            return TENSOR_DICT, None, None, args[0]
        inner = _scalar_types(args[1])
        if inner is not None:
            return VALUE_DICT, inner, None, args[0]
    if origin is list and len(args) == 1:
        inner = _scalar_types(args[0])
        if inner is not None:
            return VALUE, inner, list, None
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = _scalar_types(args[0])
        if inner is not None:
            return VALUE, inner, tuple, None
    raise TypeError(f"{name}: declared type {tp} cannot be broadcast (supported: Tensor, "
                    "dict[str, Tensor] / dict[int, Tensor], bool / int / float / str or a union of "
                    "them, list[...] / tuple[..., ...] and dict[str, ...] / dict[int, ...] of "
                    "those; each optionally Optional)")


def field_pins(name: str, info: Any, tensor: bool) -> tuple[Optional[torch.dtype], Optional[int]]:
    """The ``(dtype, ndim)`` a field's metadata pins, refused when it cannot hold: a dtype the
    frame cannot carry, an ndim outside ``0..MAX_NDIM``, or any pin on a field that is not a
    tensor. Example: ``info.dtype=torch.int32, info.ndim=1`` on a tensor -> ``(torch.int32, 1)``;
    ``info.ndim=-1`` -> ``TypeError("Meta.pos: pins ndim -1 ...")``."""
    dtype, ndim = getattr(info, "dtype", None), getattr(info, "ndim", None)
    if dtype is None and ndim is None:
        return None, None
    if not tensor:
        raise TypeError(f"{name}: pins dtype {dtype} / ndim {ndim}, but only a tensor field (Tensor, "
                        "dict[..., Tensor]) can pin them")
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise TypeError(f"{name}: pins dtype {dtype!r:.60}, expected None or one of "
                        f"{', '.join(str(d).replace('torch.', '') for d in WIRE_DTYPES)}")
    if ndim is not None and not (type(ndim) is int and 0 <= ndim <= MAX_NDIM):
        raise TypeError(f"{name}: pins ndim {ndim!r:.60}, expected None or an int in 0..{MAX_NDIM} "
                        "(the number of dimensions)")
    return dtype, ndim


def check_key(path: str, key: str, rule: str) -> Any:
    """The dict key a path's ``key`` text stands for under ``rule`` (``"int"``: the int; else the
    str itself); a key the rule does not allow is a :class:`LayoutError` naming the path (see
    ``cpmeta.broadcast.schema``'s module doc). Examples: ``("layers.3", "3", "int")`` -> ``3``;
    ``("klen.4", "4", "ratio")`` -> ``"4"``; ``("layers.03", "03", "int")`` -> refused (not
    canonical)."""
    if rule == "int":
        digits = key[1:] if key[:1] == "-" else key
        if not (0 < len(digits) <= 19 and digits.isascii() and digits.isdigit()
                and (digits[0] != "0" or key == "0") and MIN_INT <= int(key) <= MAX_INT):
            raise LayoutError(f"{path}: dict key {key!r:.40} is not an int (the canonical decimal "
                              "of an int64)")
        return int(key)
    if rule == "ratio":
        if not (0 < len(key) <= MAX_KEY_DIGITS and key.isascii() and key.isdigit() and key[0] != "0"):
            raise LayoutError(f"{path}: dict key {key!r} is not a ratio (the decimal string of a "
                              f"positive int, at most {MAX_KEY_DIGITS} digits)")
    elif not (0 < len(key) <= MAX_NAME_KEY and key.isascii() and key.isprintable()
              and not _FORBIDDEN_KEY_CHARS.intersection(key)):
        raise LayoutError(f"{path}: dict key {key!r} is not a name (1-{MAX_NAME_KEY} printable "
                          "ASCII characters without '.', ';' or ',')")
    return key
