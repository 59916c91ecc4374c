"""The broadcast message: ONE frame, one header, versioned and fingerprinted once (DESIGN 7).

Frame (little-endian; offsets in bytes from the frame start, which is a ring payload or the
process-group buffer)::

    0     4    6    8                  24         28     32       36       40      44       48         56
    +-----+----+----+------------------+----------+------+--------+--------+-------+--------+----------+
    |CPMB |ver |flag| schema (16 B)    | layout id| crc32| layout | values | n_dims| meta   | tensor   |
    |     |u16 |u16 | SCHEMA_FINGERPRINT| u32     | u32  | len u32| len u32| u32   | crc u32| bytes u64|
    +-----+----+----+------------------+----------+------+--------+--------+-------+--------+----------+
    56: layout block (only with FLAG_LAYOUT): msgpack [tensor paths, dtype codes, ndims, value paths]
        values block: msgpack list, one value per value path of the layout
        shapes: n_dims int64 (8-aligned), every tensor's dims in layout order
        tensors (16-aligned, only with FLAG_PACKED): dtype runs, each run 16-aligned
        FLAG_SPAN (always with FLAG_PACKED): the tensor region is an offsets table (one u64 per
        tensor and its crc32, padded to 16) followed by a span of the driver's arena; each
        tensor at its offset; checked by cpmeta.broadcast.span.check_span (table crc, offsets
        aligned, in bounds, non-overlapping, the span exactly as long as its tensors, header
        tbytes = exact payload)

What repeats every step (paths, dtype codes, ranks, which fields hold values) is the LAYOUT: its
id is the crc32 of its encoded block, so an id always names one layout and a frame that defines
an id with other content is refused. The driver sends a layout once, with the first frame that
uses it; later frames carry only its id. A follower keeps one :class:`Plan` per id (split runs,
field targets; at most ``MAX_LAYOUTS``, oldest dropped first, the driver starting over at the
same count); a frame naming an id the follower does not hold (it joined late, or lost that frame)
is refused with a clear error, never misread. A plan is cached only once its frame passed every
check.

Worked example (decode, 2 tensors): ``positions`` int32 [3] and ``block_table`` int32 [3, 2]
form ONE run (same dtype), dims ``[3, 3, 2]``: run start 0, numels ``[3, 6]``, 36 bytes exact
(the header's tensor bytes), region 48 (rounded up to 16, the frame's length past the shapes);
the follower does ``buf[0:36].view(int32).split([3, 6])`` and views the second chunk as [3, 2].

Strict parsing (untrusted bytes; ``cpmeta.broadcast.integrity`` checks the frame, the plan the
rest). Header tensor bytes = the EXACT payload, ``sum(numel_i * element_size_i)``; the region
(runs 16-aligned, end rounded up to 16) is computed from the shapes and the frame must be exactly
``data_at + region`` long, so a shape word changed by one is a refusal even when the alignment
padding would absorb it. Every dim is in ``[0, MAX_DIM]``. The meta crc (always on) covers the
frame up to the tensors (header, layout, values, shapes) without the two crc words; ``crc32``
(``FLAG_CRC``, opt-in ``CPMETA_CHECKSUM=1``) covers every byte but its own word, and a follower
running with the checksum refuses a frame without it. A new layout is checked ONCE against
``InputMetadata``'s schema (``cpmeta.broadcast.schema``) when its plan is built, in time linear
in its size (at most ``schema.MAX_LAYOUT_PATHS`` paths, ``MAX_LAYOUT_BYTES`` of block); a values
block is at most ``MAX_VALUES_BYTES`` (refused before it is decoded).

A repeated layout is checked cheaply: the plan is found by id (one dict lookup, the block
compared only when resent); ``plan.check_values(values)`` is one comparison of the values' type
tuple with the tuple compiled for the layout plus one min/max over its ints; ``plan.check_tensors``
compares the dims with the last frame's dims (one tuple compare) and then only two integers
(exact payload vs header, region vs bytes left).
"""

from __future__ import annotations

import ctypes
import hashlib
import operator
import struct
import zlib
from itertools import accumulate
from math import prod
from dataclasses import fields
from typing import Any, Optional

import torch

from ..metadata import InputMetadata
from .schema import MAX_LAYOUT_PATHS, ValueCheck, check_layout

__all__ = ["MESSAGE_VERSION", "SCHEMA_FINGERPRINT", "FRAME_MAGIC", "HEADER", "WIRE_DTYPES",
           "DTYPE_CODE", "FLAG_LAYOUT", "FLAG_CRC", "FLAG_PACKED", "FLAG_SPAN", "KNOWN_FLAGS",
           "Plan", "WireError", "layout_id", "frame_crc", "meta_crc", "pack_tensors", "getter",
           "PATH_SEP", "ALIAS_SEP", "CRC_AT", "META_CRC_AT", "MAX_LAYOUTS", "MAX_DIM", "MAX_NDIM",
           "MAX_LAYOUT_BYTES", "MAX_VALUES_BYTES", "MAX_COLLECTIVE_BYTES", "ELEMENT_SIZE"]

#: Version of the broadcast frame (5: exact tensor bytes + meta crc; 4: one frame with a cached
#: layout; 3 was the three-layer one).
MESSAGE_VERSION = 5
FRAME_MAGIC = b"CPMB"
HEADER = struct.Struct("<4sHH16sIIIIIIQ")
CRC_AT = 28  # byte offset of the crc32 word in HEADER
META_CRC_AT = 44  # byte offset of the meta crc32 word (header + layout + values + shapes)
FLAG_LAYOUT, FLAG_CRC, FLAG_PACKED, FLAG_SPAN = 1, 2, 4, 8
KNOWN_FLAGS = FLAG_LAYOUT | FLAG_CRC | FLAG_PACKED | FLAG_SPAN
PACK_ALIGN = 16  # every dtype run starts at a multiple of this many bytes
MAX_LAYOUTS = 256  # layouts a follower keeps (and the driver assumes it keeps)
MAX_DIM = 1 << 48  # largest single dim a follower accepts
MAX_NDIM = 16  # largest tensor rank a layout may declare
MAX_LAYOUT_BYTES = 1 << 16  # largest layout block a follower decodes (1024 paths fit easily)
MAX_VALUES_BYTES = 1 << 20  # largest values block a follower decodes (1024 scalars need ~10 KiB)
MAX_COLLECTIVE_BYTES = 1 << 32  # most tensor bytes a frame may announce for the collective path

#: Wire code of a dtype = its index here (append only: the codes are part of the frame).
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(WIRE_DTYPES)}
#: Element size in bytes per wire code (int32 -> 4).
ELEMENT_SIZE: tuple[int, ...] = tuple(torch.empty(0, dtype=d).element_size() for d in WIRE_DTYPES)
PATH_SEP, ALIAS_SEP = ";", ","  # "positions,positions_cp;klen.4": no field or ratio key holds them


def _schema_fingerprint() -> str:
    """sha256 over InputMetadata's field names and declared types (16 hex digits)."""
    desc = ";".join(f"{f.name}:{f.type}" for f in fields(InputMetadata))
    return hashlib.sha256(f"v{MESSAGE_VERSION}|{desc}".encode()).hexdigest()[:16]


SCHEMA_FINGERPRINT: str = _schema_fingerprint()


class WireError(ValueError):
    """A frame this rank cannot accept (the broadcaster adds the rank and the source)."""


def getter(idx: list[int]) -> Any:
    """``f(seq) -> list`` of ``seq``'s items at ``idx`` (one C call; ``[]`` for no index)."""
    if not idx:
        return lambda seq: []
    g = operator.itemgetter(*idx)
    if len(idx) == 1:
        return lambda seq: [g(seq)]
    return lambda seq: list(g(seq))


def _split_layout(paths: str, codes: list[int], ndims: list[int], vpaths: str
                  ) -> tuple[list[list[str]], list[str]]:
    """The layout's tensor paths (with aliases) and value paths, once its lists are proven
    consistent: at most ``MAX_LAYOUT_PATHS`` paths (counted before anything is split), one code
    and one rank per tensor, known codes in run order, ranks ``0..MAX_NDIM``. Example:
    ``("positions,positions_cp;klen.4", [4, 4], [1, 1], "is_prompt")`` gives
    ``([["positions", "positions_cp"], ["klen.4"]], ["is_prompt"])``."""
    n_paths = (paths.count(PATH_SEP) + paths.count(ALIAS_SEP) + 1 if paths else 0) + (
        vpaths.count(PATH_SEP) + 1 if vpaths else 0)
    if n_paths > MAX_LAYOUT_PATHS or len(codes) > MAX_LAYOUT_PATHS:
        raise WireError(f"layout has {max(n_paths, len(codes))} paths, more than "
                        f"MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
    tpaths = [p.split(ALIAS_SEP) for p in paths.split(PATH_SEP)] if paths else []
    vlist = vpaths.split(PATH_SEP) if vpaths else []
    if not (len(tpaths) == len(codes) == len(ndims)):
        raise WireError("layout lists disagree in length")
    if any(type(c) is not int or not 0 <= c < len(WIRE_DTYPES) for c in codes):
        raise WireError(f"unknown dtype code in {codes[:16]}")
    if any(type(d) is not int or not 0 <= d <= MAX_NDIM for d in ndims):
        raise WireError(f"bad tensor rank (0..{MAX_NDIM}) in {ndims[:16]}")
    if any(a > b for a, b in zip(codes, codes[1:])):
        raise WireError("layout tensors are not ordered by dtype code (one run per dtype)")
    return tpaths, vlist


class Plan:
    """Everything derived from one layout, computed once per layout id on every rank.

    ``runs``: ``(code, first, last + 1)`` per dtype run; ``targets``: per tensor, the
    ``(field, dict key or None)`` paths it fills; ``value_targets`` likewise per value.
    """

    def __init__(self, paths: str, codes: list[int], ndims: list[int], vpaths: str) -> None:
        """Build (and check, once) the plan of one layout; linear in the layout's size.

        Raises ``WireError``/``schema.LayoutError`` (ValueErrors naming the path) for a layout
        that ``InputMetadata``'s schema does not allow, or larger than ``MAX_LAYOUT_PATHS``
        (counted before anything is split).
        """
        tpaths, vlist = _split_layout(paths, codes, ndims, vpaths)
        targets, value_targets = check_layout(tpaths, vlist)
        self.codes, self.ndims, self.n_dims = codes, ndims, sum(ndims)
        self.key = (paths, tuple(codes), tuple(ndims), vpaths)
        self.shapes = struct.Struct(f"<{self.n_dims}q")
        self.all_1d = all(d == 1 for d in ndims)
        starts = [0, *accumulate(ndims)][:len(ndims)]  # dims index of each tensor's first dim
        self.reshape = [(i, at, nd) for i, (at, nd) in enumerate(zip(starts, ndims)) if nd != 1]
        self.runs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(codes):
            j = i
            while j + 1 < len(codes) and codes[j + 1] == codes[i]:
                j += 1
            self.runs.append((codes[i], i, j + 1))
            i = j + 1
        self.targets = targets
        self.value_targets = value_targets
        self.check_values = ValueCheck(value_targets)
        self.tensor_paths = [ps[0] for ps in tpaths]  # for error messages
        self._last: tuple[tuple, tuple] = ((-1,), ())  # dims of the last sizes() -> its result
        self.layout_block: Optional[bytes] = None  # driver: encoded once
        # split: dims index of each tensor's first dim (1-D tensors: that dim is the numel)
        # (0-d tensors: a placeholder, set to 1 by the reshape list)
        self.first_dim = (getter([at if nd else 0 for at, nd in zip(starts, ndims)])
                          if self.n_dims else (lambda d: [1] * len(ndims)))
        self.run_slices = [(slice(a, b), ELEMENT_SIZE[code], WIRE_DTYPES[code])
                           for code, a, b in self.runs]
        # assemble: positional InputMetadata row; fields filled per step, dicts created per step
        pos = {n: i for i, n in enumerate(_FIELD_NAMES)}
        self.dict_fields = sorted({pos[n] for n, sub in self.value_targets if sub is not None}
                                  | {pos[n] for ts in self.targets for n, sub in ts if sub is not None})
        self.value_slots = [(pos[n], sub) for n, sub in self.value_targets]
        self.tensor_slots = [[(pos[n], sub) for n, sub in ts] for ts in self.targets]
        self.flat_values = all(sub is None for _, sub in self.value_slots)
        self.value_pos = [i for i, _ in self.value_slots]
        self.flat_tensors = all(len(ts) == 1 and ts[0][1] is None for ts in self.tensor_slots)
        self.tensor_pos = [ts[0][0] for ts in self.tensor_slots] if self.flat_tensors else []

    # ---- per step, both sides --------------------------------------------------------------
    def sizes(self, dims: tuple[int, ...] | list[int]) -> tuple[list[int], list[int], int, int]:
        """``(numels, run starts, region bytes, exact payload bytes)`` for these flat ``dims``.

        Runs start 16-aligned and the region is rounded up to 16; the exact payload is
        ``sum(numel_i * element_size_i)`` (what the header declares). Worked example: bool [406]
        and bool [406] then int32 [406]: bool run 812 B at 0, int32 run at 816 (812 rounded up),
        region 816 + 1624 = 2440 -> 2448, exact 812 + 1624 = 2436. The last call's dims and
        result are kept: the same dims again (a repeated layout with fixed shapes) cost one
        tuple comparison. The returned lists are shared: do not modify them.
        """
        dims = tuple(dims)
        last = self._last
        if last[0] == dims:
            return last[1]
        if self.all_1d:
            numels = list(dims)
        else:
            numels = self.first_dim(dims)
            for i, at, nd in self.reshape:
                numels[i] = prod(dims[at:at + nd])
        starts, pos, exact = [], 0, 0
        for sl, esz, _ in self.run_slices:
            pos = -(-pos // PACK_ALIGN) * PACK_ALIGN
            starts.append(pos)
            n = sum(numels[sl]) * esz
            pos += n
            exact += n
        res = (numels, starts, -(-pos // PACK_ALIGN) * PACK_ALIGN, exact)
        self._last = (dims, res)
        return res

    def check_tensors(self, dims: tuple[int, ...], packed: bool, tbytes: int, avail: int
                      ) -> tuple[list[int], list[int], int]:
        """Follower: ``(numels, run starts, region)`` of a frame's ``dims`` once they are proven.

        Every dim in ``[0, MAX_DIM]``; ``packed``: the exact payload equals the header's
        ``tbytes`` and the region equals ``avail`` (the frame's bytes after its shapes), so no
        product can exceed the frame; not packed (tensors follow in a collective): ``tbytes`` and
        ``avail`` are 0 and the payload is at most ``MAX_COLLECTIVE_BYTES``. A mismatch is a
        ``WireError`` listing the declared shapes by path, first those that differ from the
        previous frame of this layout (``gate_force_random [407] bool (was [406])``).
        """
        prev = self._last[0]
        if prev != dims and dims and (min(dims) < 0 or max(dims) > MAX_DIM):
            raise WireError(f"tensor dims out of range [0, 2**48]: {self._shapes_text(dims, prev)}")
        numels, starts, region, exact = self.sizes(dims)
        if packed:
            if exact != tbytes or region != avail:
                raise WireError(f"tensor shapes declare {exact} bytes (region {region}), the frame "
                                f"declares {tbytes} (region {avail}): {self._shapes_text(dims, prev)}")
        elif tbytes or avail or exact > MAX_COLLECTIVE_BYTES:
            raise WireError(f"frame without FLAG_PACKED: {tbytes} tensor bytes and {avail} bytes "
                            f"after the shapes (expected 0), {exact} bytes to receive")
        return numels, starts, region

    def _shapes_text(self, dims: tuple[int, ...], prev: tuple = (), most: int = 8) -> str:
        """``"klen.4 [5] int32 (was [4]), positions [3] int32, ..."`` for error messages: the
        tensors whose shape differs from ``prev`` (the last frame's dims, when as long) first."""
        changed, same, at = [], [], 0
        for path, code, nd in zip(self.tensor_paths, self.codes, self.ndims):
            now = list(dims[at:at + nd])
            text = f"{path} {now} {WIRE_DTYPES[code]}".replace("torch.", "")
            if len(prev) == len(dims) and list(prev[at:at + nd]) != now:
                changed.append(f"{text} (was {list(prev[at:at + nd])})")
            else:
                same.append(text)
            at += nd
        out = changed + same
        return ", ".join(out[:most]) + (f", ... ({len(out)} tensors)" if len(out) > most else "")

    def views(self, buf: torch.Tensor, dims: Any, numels: list[int], starts: list[int]
              ) -> list[torch.Tensor]:
        """Views of the uint8 ``buf`` with every tensor's dtype and shape (one split per run)."""
        out: list[torch.Tensor] = []
        for (sl, esz, dtype), s in zip(self.run_slices, starts):
            ns = numels[sl]
            out += buf[s:s + sum(ns) * esz].view(dtype).split_with_sizes(ns)
        for i, at, nd in self.reshape:
            out[i] = out[i].view(*dims[at:at + nd]) if nd else out[i].view(())
        return out

    def assemble(self, tensors: list[torch.Tensor], values: list[Any],
                 per_path: Optional[list[list[torch.Tensor]]] = None) -> InputMetadata:
        """The InputMetadata holding ``tensors`` and ``values`` at the layout's paths
        (``per_path[i][j]``, when given, is tensor i's object at its j-th path)."""
        row: list[Any] = [None] * _N_FIELDS
        for f in self.dict_fields:
            row[f] = {}
        if self.flat_values:
            for f, v in zip(self.value_pos, values):
                row[f] = v
        else:
            for (f, sub), v in zip(self.value_slots, values):
                if sub is None:
                    row[f] = v
                else:
                    row[f][sub] = v
        if per_path is None and self.flat_tensors:
            for f, t in zip(self.tensor_pos, tensors):
                row[f] = t
        else:
            for i, (ts, t) in enumerate(zip(self.tensor_slots, tensors)):
                for j, (f, sub) in enumerate(ts):
                    x = t if per_path is None else per_path[i][j]
                    if sub is None:
                        row[f] = x
                    else:
                        row[f][sub] = x
        if _POSITIONAL:
            return InputMetadata(*row)
        return InputMetadata(**{n: v for n, v in zip(_FIELD_NAMES, row) if v is not None})


_FIELD_NAMES = InputMetadata.field_names()
_N_FIELDS = len(_FIELD_NAMES)
# Plan.assemble passes a positional row when every field is an init field defaulting to None
_POSITIONAL = all(f.init and f.default is None for f in fields(InputMetadata)) and tuple(
    f.name for f in fields(InputMetadata)) == _FIELD_NAMES


def pack_tensors(base: int, tensors: list[torch.Tensor], plan: Plan, numels: list[int],
                 starts: list[int]) -> None:
    """Copy CPU ``tensors`` to address ``base`` in the run layout of :meth:`Plan.sizes`
    (one ``memmove`` per tensor; non-contiguous ones are made contiguous first)."""
    if not all(map(_IS_CONTIGUOUS, tensors)):
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    memmove, ptrs = ctypes.memmove, list(map(_DATA_PTR, tensors))
    for (sl, esz, _), s in zip(plan.run_slices, starts):
        at = base + s
        for p, n in zip(ptrs[sl], numels[sl]):
            if n:
                memmove(at, p, n * esz)
                at += n * esz


_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr


def layout_id(block: bytes | memoryview) -> int:
    """The id of a layout: crc32 of its encoded block."""
    return zlib.crc32(block)


def frame_crc(view: memoryview) -> int:
    """crc32 of the frame without its crc word (the meta crc word included)."""
    return zlib.crc32(view[CRC_AT + 4:], zlib.crc32(view[:CRC_AT]))


def meta_crc(view: memoryview, data_at: int) -> int:
    """crc32 of ``view[:data_at]`` (header, layout, values, shapes) without the two crc words.

    Example: ``data_at = 128`` hashes bytes 0-27, 32-43 and 48-127 (120 bytes).
    """
    c = zlib.crc32(view[:CRC_AT])
    c = zlib.crc32(view[CRC_AT + 4:META_CRC_AT], c)
    return zlib.crc32(view[META_CRC_AT + 4:data_at], c)
