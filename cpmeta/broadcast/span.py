"""Span frames (``FLAG_SPAN``): a persistent step's tensors as ONE span of the driver's allocation.

A builder called with ``out=OutputArenas()`` leaves every tensor of a step in one host allocation
(builder order, 64-byte aligned), not in the frame's dtype-run order. Copying that allocation's
span whole is one ``memmove`` where packing costs one per tensor, so a persistent driver whose
tensors qualify sends the span, with every tensor's offset in it::

    tensor region (after the shapes, 16-aligned; always with FLAG_PACKED)
    +---------------------------------------+-----------------------------------------------+
    | offsets: one u64 per tensor, layout   | span: bytes [lo, hi) of the driver's          |
    | order; crc32 of them (u32); zero pad  | allocation; tensor i at span[offsets[i]:...]  |
    | to a multiple of 16 B                 |                                               |
    +---------------------------------------+-----------------------------------------------+

The header's tensor bytes stay the EXACT payload ``sum(numel_i * element_size_i)``; the frame's
length is ``data_at + table + span``. The table carries its own crc32 (the frame's meta crc ends
where the tensor region starts), so a corrupted offset is refused like a corrupted shape. A
follower proves, once per (layout, dims, offsets), that every offset is a multiple of its element
size and every tensor lies inside the span without overlapping another (:func:`check_span`);
later frames with the same table bytes hit that cache.

Worked example: ``positions`` int32 [3] at allocation byte 512 and ``block_table`` int32 [3, 2]
at byte 0 (builder order), layout order (positions, block_table): lo 0, hi 524, table
(2 u64 + crc32, padded), offsets ``[512, 0]``, table 32 B, span 524 B, region 556 B; exact payload
12 + 24 = 36.
"""

from __future__ import annotations

import struct
import zlib
from math import prod
from typing import Optional

import torch

from .plan import Plan
from .wire import ELEMENT_SIZE, FLAG_SPAN, WireError

__all__ = ["FLAG_SPAN", "SPAN_SLACK", "table_bytes", "span_of", "check_span"]

#: a span may hold at most this many bytes more than the exact payload per tensor (gaps between
#: 64-byte aligned fields) before the driver packs instead
SPAN_SLACK = 64
_CRC = struct.Struct("<I")


def table_bytes(n_tensors: int) -> int:
    """Bytes of the offsets table: ``8 * n + 4`` (the crc32) rounded up to 16 (3 tensors -> 32)."""
    return -(-(8 * n_tensors + 4) // 16) * 16


def span_of(tensors: list[torch.Tensor], exact: int) -> Optional[tuple[bytes, list[int], int]]:
    """Driver: ``(table, offsets, span bytes)`` when the (layout-ordered) ``tensors`` all lie,
    contiguous, element-aligned and without sharing bytes, in ONE CPU allocation within
    ``exact + SPAN_SLACK * n`` bytes; else ``None`` (the step is packed)."""
    if not tensors or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return None
    s0 = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != s0.data_ptr() for t in tensors):
        return None
    ext = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    live = [(p, n) for p, n in ext if n]
    if not live:
        return None
    lo = min(p for p, _ in live)
    hi = max(p + n for p, n in live)
    base = s0.data_ptr()
    if hi - lo > exact + SPAN_SLACK * len(tensors) or lo < base or hi > base + s0.nbytes():
        return None
    offsets = [p - lo if n else 0 for p, n in ext]
    if any(o % t.element_size() for o, t in zip(offsets, tensors)):
        return None
    live.sort()
    if any(p2 < p1 + n1 for (p1, n1), (p2, _) in zip(live, live[1:])):
        return None  # two tensors share bytes (views of one another): packed copies them apart
    n = len(tensors)
    body = struct.pack(f"<{n}Q", *offsets)
    table = body + _CRC.pack(zlib.crc32(body)) + bytes(table_bytes(n) - 8 * n - 4)
    return table, offsets, hi - lo


def check_span(plan: Plan, dims: tuple[int, ...], tbytes: int, table: bytes, avail: int
               ) -> tuple[list[int], list[int], int]:
    """Follower: prove a span frame's geometry; return ``(numels, offsets, exact)``.

    ``table`` is the frame's offsets table (``table_bytes(n)`` bytes), ``avail`` the frame's
    bytes after its shapes. Checks: dims in ``[0, MAX_DIM]`` and the fixed dims
    (``Plan.sizes``); exact payload == header ``tbytes``; the table's crc32; every offset a multiple of its element size, every tensor inside the span
    (``avail - len(table)`` bytes), no two non-empty tensors overlapping; padding zero; and the
    span EXACT: it starts at the first non-empty tensor (offset 0) and ends at the last one's
    end, empty tensors at offset 0 (what :func:`span_of` sends), so no byte rides unaccounted.
    Raises ``WireError`` naming the tensor path.
    """
    n = len(plan.codes)
    if len(table) != table_bytes(n) or avail < len(table):
        raise WireError(f"span frame: {avail} bytes after the shapes, the offsets table needs "
                        f"{table_bytes(n)}")
    plan.sizes(dims)  # the dims' range and the schema's fixed dims, as on every path
    offsets = list(struct.unpack_from(f"<{n}Q", table))
    if _CRC.unpack_from(table, 8 * n)[0] != zlib.crc32(table[:8 * n]):
        raise WireError("span frame: the offsets table fails its crc32 check")
    if any(table[8 * n + 4:]):
        raise WireError("span frame: nonzero padding after the offsets table")
    numels, at = [], 0
    for nd in plan.ndims:
        numels.append(prod(dims[at:at + nd]))
        at += nd
    sizes = [m * ELEMENT_SIZE[c] for m, c in zip(numels, plan.codes)]
    exact = sum(sizes)
    if exact != tbytes:
        raise WireError(f"span frame: shapes declare {exact} tensor bytes, the header {tbytes}")
    span = avail - len(table)
    end, first = 0, None
    for o, s, i in sorted((o, s, i) for i, (o, s) in enumerate(zip(offsets, sizes))):
        path = plan.tensor_paths[i]
        if o % ELEMENT_SIZE[plan.codes[i]] or o + s > span or (not s and o):
            raise WireError(f"span frame: {path} at offset {o} ({s} bytes) is misaligned, past "
                            f"the span of {span} bytes, or an empty tensor off offset 0")
        if s and o < end:
            raise WireError(f"span frame: {path} at offset {o} overlaps the previous tensor")
        if s:
            first = o if first is None else first
            end = o + s
    if (first or 0) != 0 or span != end:
        raise WireError(f"span frame: a span of {span} bytes, its tensors cover [{first or 0}, "
                        f"{end}) (must be exactly the span)")
    return numels, offsets, exact
