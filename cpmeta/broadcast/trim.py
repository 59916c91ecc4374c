"""Trimmed tables on the frame: which tensors of a layout are trimmed, with what widths.

A field declared with ``trim`` (``cpmeta.fields``; ``block_tables``: -1 past each row's defined
columns) is framed as its used columns only; the layout carries each trimmed table's full width
(``cpmeta.broadcast.plan``'s module docstring has the rule and a worked example). This module
finds those tables in a layout (:func:`trim_slots`), proves a received layout's widths
(:func:`trims_of`) and copies a narrowed table into a frame (:func:`copy_rows`);
``trim_njit.used_columns`` finds the columns to send.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from ..fields import trimmed_fields
from .dict_schema import DictSchema
from .schema import Schema
from .wire import ALIAS_SEP, MAX_DIM, PATH_SEP, WIRE_DTYPES, WireError

__all__ = ["trim_slots", "trim_widths", "trims_of", "copy_rows"]

AnySchema = Schema | DictSchema


def copy_rows(at: int, t: torch.Tensor) -> None:
    """Copy the CPU int32 2-D view ``t`` (rows of a wider table) to address ``at``, packed."""
    if t.numel():
        ptr = ctypes.cast(at, ctypes.POINTER(ctypes.c_int32))
        np.ctypeslib.as_array(ptr, shape=tuple(t.shape))[...] = t.numpy()


def trim_slots(schema: AnySchema, paths: str, codes: tuple[int, ...] | list[int],
               ndims: tuple[int, ...] | list[int]) -> list[tuple[int, int, int]]:
    """``(tensor index, column dim index into the flat dims, pad)`` of every trimmed table of a
    layout: a 2-D int32 tensor whose paths' fields all declare the same ``trim``
    (``cpmeta.fields.trimmed_fields``); none for a tensor dict. Example: a decode layout whose
    5th tensor is ``block_tables`` [192, 512] after four 1-D ones -> ``[(4, 5, -1)]``."""
    pads = trimmed_fields(schema.cls) if isinstance(schema, Schema) else {}
    if not pads or not paths:
        return []
    out, at = [], 0
    for i, (group, code, nd) in enumerate(zip(paths.split(PATH_SEP), codes, ndims)):
        names = {p.split(".", 1)[0] for p in group.split(ALIAS_SEP)}
        found = {pads.get(n) for n in names}
        pad = found.pop() if len(found) == 1 else None
        if nd == 2 and WIRE_DTYPES[code] == torch.int32 and pad is not None:
            out.append((i, at + 1, int(pad)))
        at += nd
    return out


def trim_widths(slots: list[tuple[int, int, int]], tensors: list[torch.Tensor]) -> list[int]:
    """The full width of each trimmed table among ``tensors`` (layout order): the layout's tail."""
    return [int(tensors[i].shape[1]) for i, _, _ in slots]


def trims_of(schema: AnySchema, paths: str, codes: list[int], ndims: list[int], tail: Optional[list]
           ) -> list[tuple[int, int, int, int]]:
    """The layout's trimmed tables with their full widths (``tail``), proven: one non-negative
    int per table of :func:`trim_slots`, and a tail only for a class with trimmed fields."""
    if isinstance(schema, DictSchema):
        return []
    slots = trim_slots(schema, paths, codes, ndims)
    has = bool(trimmed_fields(schema.cls)) if isinstance(schema, Schema) else False
    if (tail is None) == has or (tail is not None and (
            type(tail) is not list or len(tail) != len(slots)
            or any(type(w) is not int or not 0 <= w <= MAX_DIM for w in tail))):
        raise WireError(f"layout of {schema.name}: trimmed-table widths {tail!r:.80} where it has "
                        f"{len(slots)} trimmed table(s)")
    return [(i, at, pad, w) for (i, at, pad), w in zip(slots, tail or [])]
