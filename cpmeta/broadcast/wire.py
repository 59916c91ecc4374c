"""The broadcast message: ONE frame, one header, versioned and fingerprinted once (DESIGN 7).

Frame (little-endian; offsets in bytes from the frame start, which is a ring payload or the
process-group buffer)::

    0     4    6    8                  24         28     32       36       40      44    48         56
    +-----+----+----+------------------+----------+------+--------+--------+-------+-----+----------+
    |CPMB |ver |flag| schema (16 B)    | layout id| crc32| layout | values | n_dims| 0   | tensor   |
    |     |u16 |u16 | SCHEMA_FINGERPRINT| u32     | u32  | len u32| len u32| u32   |     | bytes u64|
    +-----+----+----+------------------+----------+------+--------+--------+-------+-----+----------+
    56: layout block (only with FLAG_LAYOUT): msgpack [tensor paths, dtype codes, ndims, value paths]
        values block: msgpack list, one value per value path of the layout
        shapes: n_dims int64 (8-aligned), every tensor's dims in layout order
        tensors (16-aligned, only with FLAG_PACKED): dtype runs, each run 16-aligned

What repeats every step (paths, dtype codes, ranks, which fields hold values) is the LAYOUT: its
id is the crc32 of its encoded block, so an id always names one layout and a frame that defines
an id with other content is refused. The driver sends a layout once, with the first frame that
uses it; later frames carry only its id. A follower keeps one :class:`Plan` per id (split runs,
field targets; at most ``MAX_LAYOUTS``, oldest dropped first, the driver starting over at the
same count); a frame naming an id the follower does not hold (it joined late, or lost that frame)
is refused with a clear error, never misread. A plan is cached only once its frame passed every
check.

Worked example (decode, 2 tensors): ``positions`` int32 [3] and ``block_table`` int32 [3, 2]
form ONE run (same dtype), dims ``[3, 3, 2]``: run start 0, numels ``[3, 6]``, 36 bytes, total
48 (rounded up to 16); the follower does ``buf[0:36].view(int32).split([3, 6])`` and views the
second chunk as [3, 2].

``crc32`` (``FLAG_CRC``, opt-in ``CPMETA_CHECKSUM=1``) covers every byte of the frame except the
crc word itself; a follower verifies it whenever the flag is set.
"""

from __future__ import annotations

import ctypes
import hashlib
import operator
import struct
import zlib
from dataclasses import fields
from typing import Any, Optional

import torch

from ..metadata import InputMetadata

__all__ = ["MESSAGE_VERSION", "SCHEMA_FINGERPRINT", "FRAME_MAGIC", "HEADER", "WIRE_DTYPES",
           "FLAG_LAYOUT", "FLAG_CRC", "FLAG_PACKED", "KNOWN_FLAGS", "Plan", "WireError", "layout_id",
           "collect", "frame_crc", "MAX_LAYOUTS"]

#: Version of the broadcast frame (4: one frame with a cached layout; 3 was the three-layer one).
MESSAGE_VERSION = 4
FRAME_MAGIC = b"CPMB"
HEADER = struct.Struct("<4sHH16sIIIIIIQ")
CRC_AT = 28  # byte offset of the crc32 word in HEADER
FLAG_LAYOUT, FLAG_CRC, FLAG_PACKED = 1, 2, 4
KNOWN_FLAGS = FLAG_LAYOUT | FLAG_CRC | FLAG_PACKED
PACK_ALIGN = 16  # every dtype run starts at a multiple of this many bytes
MAX_LAYOUTS = 256  # layouts a follower keeps (and the driver assumes it keeps)
MAX_DIM = 1 << 48
_SHAPE = struct.Struct("<q")

#: Wire code of a dtype = its index here (append only: the codes are part of the frame).
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(WIRE_DTYPES)}
_ELEMENT_SIZE: tuple[int, ...] = tuple(torch.empty(0, dtype=d).element_size() for d in WIRE_DTYPES)
_SEP, _ALIAS = ";", ","  # "positions,positions_cp;klen.4": no field or ratio key holds them


def _schema_fingerprint() -> str:
    """sha256 over InputMetadata's field names and declared types (16 hex digits)."""
    desc = ";".join(f"{f.name}:{f.type}" for f in fields(InputMetadata))
    return hashlib.sha256(f"v{MESSAGE_VERSION}|{desc}".encode()).hexdigest()[:16]


SCHEMA_FINGERPRINT: str = _schema_fingerprint()


class WireError(ValueError):
    """A frame this rank cannot accept (the broadcaster adds the rank and the source)."""


def _align(n: int, a: int = PACK_ALIGN) -> int:
    return -(-n // a) * a


def collect(md: InputMetadata) -> tuple[tuple, list[torch.Tensor], list[Any]]:
    """Split ``md`` by path: ``(key, tensors, values)``.

    ``key`` = (tensor paths, dtype codes, ndims, value paths) identifies the layout; ``tensors``
    are deduplicated by object and ordered by dtype code (so each dtype is one run);
    ``values[i]`` belongs to value path ``key[3][i]`` (``None`` fields are left out, an empty
    dict is a value). Example: with ``positions_cp is positions`` one tensor has the paths
    ``("positions", "positions_cp")``.
    """
    vpaths: list[str] = []
    values: list[Any] = []
    found: list[list] = []  # [code, tensor, [paths]]
    index: dict[int, list] = {}
    for name, v in zip(_FIELD_NAMES, _GET_ALL(md)):
        if v is None:
            continue
        if type(v) is dict:
            if not v:
                vpaths.append(name)
                values.append({})
            for k, x in v.items():
                p = f"{name}.{k}"
                if isinstance(x, torch.Tensor):
                    e = index.get(id(x))
                    if e is None:
                        index[id(x)] = e = [DTYPE_CODE.get(x.dtype, -1), x, []]
                        found.append(e)
                    e[2].append(p)
                elif type(x) is dict:
                    raise TypeError(f"{p}: nested dicts are not supported (one level only)")
                elif x is not None:
                    vpaths.append(p)
                    values.append(x)
        elif isinstance(v, torch.Tensor):
            e = index.get(id(v))
            if e is None:
                index[id(v)] = e = [DTYPE_CODE.get(v.dtype, -1), v, []]
                found.append(e)
            e[2].append(name)
        else:
            vpaths.append(name)
            values.append(v)
    found.sort(key=lambda e: e[0])
    for e in found:
        if e[0] < 0:
            raise TypeError(f"{e[2][0]}: dtype {e[1].dtype} cannot be broadcast "
                            f"(supported: {WIRE_DTYPES})")
    tensors = [e[1] for e in found]
    key = (_SEP.join(_ALIAS.join(e[2]) for e in found), tuple(e[0] for e in found),
           tuple(t.dim() for t in tensors), _SEP.join(vpaths))
    return key, tensors, values


class Plan:
    """Everything derived from one layout, computed once per layout id on every rank.

    ``runs``: ``(code, first, last + 1)`` per dtype run; ``targets``: per tensor, the
    ``(field, dict key or None)`` paths it fills; ``value_targets`` likewise per value.
    """

    def __init__(self, paths: str, codes: list[int], ndims: list[int], vpaths: str) -> None:
        tpaths = [p.split(_ALIAS) for p in paths.split(_SEP)] if paths else []
        vlist = vpaths.split(_SEP) if vpaths else []
        if not (len(tpaths) == len(codes) == len(ndims)):
            raise WireError("layout lists disagree in length")
        if any(type(c) is not int or not 0 <= c < len(WIRE_DTYPES) for c in codes):
            raise WireError(f"unknown dtype code in {codes}")
        if any(type(d) is not int or not 0 <= d <= 16 for d in ndims):
            raise WireError(f"bad tensor rank in {ndims}")
        self.codes, self.ndims, self.n_dims = codes, ndims, sum(ndims)
        self.key = (paths, tuple(codes), tuple(ndims), vpaths)
        self.shapes = struct.Struct(f"<{self.n_dims}q")
        self.all_1d = all(d == 1 for d in ndims)
        starts = [sum(ndims[:i]) for i in range(len(ndims))]
        self.reshape = [(i, at, nd) for i, (at, nd) in enumerate(zip(starts, ndims)) if nd != 1]
        self.runs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(codes):
            j = i
            while j + 1 < len(codes) and codes[j + 1] == codes[i]:
                j += 1
            self.runs.append((codes[i], i, j + 1))
            i = j + 1
        self.targets = [[_target(p) for p in ps] for ps in tpaths]
        self.value_targets = [_target(p) for p in vlist]
        self.layout_block: Optional[bytes] = None  # driver: encoded once

    # ---- per step, both sides --------------------------------------------------------------
    def split(self, dims: tuple[int, ...] | list[int]) -> tuple[list[int], list[int], int]:
        """``(numels, run starts, total bytes)`` of the tensors with these flat ``dims``."""
        if self.all_1d:
            numels = list(dims)
        else:
            numels, at = [], 0
            for nd in self.ndims:
                n = 1
                for d in dims[at:at + nd]:
                    n *= d
                numels.append(n)
                at += nd
        starts, pos = [], 0
        for code, a, b in self.runs:
            pos = _align(pos)
            starts.append(pos)
            pos += sum(numels[a:b]) * _ELEMENT_SIZE[code]
        return numels, starts, _align(pos)

    def views(self, buf: torch.Tensor, dims: Any, numels: list[int], starts: list[int]
              ) -> list[torch.Tensor]:
        """Views of the uint8 ``buf`` with every tensor's dtype and shape (one split per run)."""
        out: list[torch.Tensor] = []
        for (code, a, b), s in zip(self.runs, starts):
            n = sum(numels[a:b]) * _ELEMENT_SIZE[code]
            out.extend(buf[s:s + n].view(WIRE_DTYPES[code]).split_with_sizes(numels[a:b]))
        for i, at, nd in self.reshape:
            out[i] = out[i].view(*dims[at:at + nd])
        return out

    def assemble(self, tensors: list[torch.Tensor], values: list[Any],
                 per_path: Optional[list[list[torch.Tensor]]] = None) -> InputMetadata:
        """The InputMetadata holding ``tensors`` and ``values`` at the layout's paths
        (``per_path[i][j]``, when given, is tensor i's object at its j-th path)."""
        kw: dict[str, Any] = {}
        for (name, sub), v in zip(self.value_targets, values):
            if sub is None:
                kw[name] = v
            else:
                kw.setdefault(name, {})[sub] = v
        for i, (ts, t) in enumerate(zip(self.targets, tensors)):
            for j, (name, sub) in enumerate(ts):
                x = t if per_path is None else per_path[i][j]
                if sub is None:
                    kw[name] = x
                else:
                    kw.setdefault(name, {})[sub] = x
        return InputMetadata(**kw)


def _target(path: str) -> tuple[str, Optional[str]]:
    name, dot, sub = path.partition(".")
    if name not in _FIELDS:
        raise WireError(f"layout names an unknown field {path!r}")
    return name, (sub if dot else None)


_FIELDS = frozenset(InputMetadata.field_names())
_FIELD_NAMES = InputMetadata.field_names()
_GET_ALL = operator.attrgetter(*_FIELD_NAMES)  # every field in one C call


def pack_tensors(base: int, tensors: list[torch.Tensor], plan: Plan, numels: list[int],
                 starts: list[int]) -> None:
    """Copy CPU ``tensors`` to address ``base`` in the run layout of :meth:`Plan.split`."""
    for (code, a, b), s in zip(plan.runs, starts):
        at = base + s
        esz = _ELEMENT_SIZE[code]
        for t, n in zip(tensors[a:b], numels[a:b]):
            if n:
                if not t.is_contiguous():
                    t = t.contiguous()
                ctypes.memmove(at, t.data_ptr(), n * esz)
                at += n * esz


def layout_id(block: bytes | memoryview) -> int:
    """The id of a layout: crc32 of its encoded block."""
    return zlib.crc32(block)


def frame_crc(view: memoryview) -> int:
    """crc32 of the frame without its crc word."""
    return zlib.crc32(view[CRC_AT + 4:], zlib.crc32(view[:CRC_AT]))
