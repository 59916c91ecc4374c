"""The frame codec: ONE frame format, one header, versioned and fingerprinted once (docs/design.md section 7).

Every message cpmeta sends between the ranks of a group -- a broadcast ``InputMetadata``, any
other dataclass (``MetadataBroadcaster(schema=...)``), a tensor dict (``broadcast_tensor_dict``),
a replicated scheduler step (``ReplicatedBatchState``), a staged decode batch -- is this frame.
Little-endian; offsets in bytes from the frame start (a ring payload or a process-group buffer)::

    0     4    6    8                  24         28     32       36       40      44       48         56      64
    +-----+----+----+------------------+----------+------+--------+--------+-------+--------+----------+-------+
    |CPMB |ver |flag| schema (16 B)    | layout id| crc32| layout | values | n_dims| meta   | tensor   | step  |
    |     |u16 |u16 | fingerprint      | u32      | u32  | len u32| len u32| u32   | crc u32| bytes u64| u64   |
    +-----+----+----+------------------+----------+------+--------+--------+-------+--------+----------+-------+
    64: layout block (only with FLAG_LAYOUT): msgpack [tensor paths, dtype codes, ndims, value paths]
        (+ the key order for a tensor-dict layout)
        values block: msgpack list, one value per value path of the layout
        shapes: n_dims int64 (8-aligned), every tensor's dims in layout order
        tensors (16-aligned, only with FLAG_PACKED): dtype runs, each run 16-aligned (the rule
        ``cpmeta.buffers.ArenaLayout`` lays a builder's outputs out by, so a persistent
        driver's arena is this region byte for byte)
        FLAG_ABORT: the driver refused step ``step`` (no layout, no dims, no tensors); the values
        block is ``[error class, its builtin base, message]`` and every follower raises that
        base class naming the step (:class:`DriverAbort`)

The step protocol: every frame carries the number of the step it delivers (1, 2, ... per
channel). The driver numbers a frame when it publishes it and counts it sent only once the
transport took it. The transport delivers every message once and in order, so a follower counts
every frame it is handed as the next step -- a frame refused for any reason (corrupted, bad
values, shapes, tensors) still consumed its step -- and accepts a frame only when the number it
carries is that step's (a replay or a gap is refused naming both numbers). A driver call that fails
before its frame is published sends an abort frame for that step instead
(``FrameChannel.abort``), so no follower's call ever returns another step's data.

The schema fingerprint (``cpmeta.broadcast.schema``) names the class the frame carries: a
follower whose class differs refuses the frame instead of misreading it. What repeats every step
(paths, dtype codes, ranks) is the LAYOUT: its id is the crc32 of its encoded block, so an id
always names one layout; the driver sends a layout once (:class:`FrameWriter`), with the first
frame that uses it, and later frames carry only its id; a follower (:class:`FrameReader`) keeps
one ``Plan`` per id (at most ``MAX_LAYOUTS``, least recently used dropped first, the driver
starting over at the same count) and refuses an id it does not hold with a clear error. A plan
is cached only once its frame passed every check.

Strict parsing (untrusted bytes). Per frame a follower proves, in order: magic, version and
fingerprint; known flags and the checksum policy (a rank running with ``CPMETA_CHECKSUM=1``
refuses a frame without FLAG_CRC); block lengths within ``MAX_LAYOUT_BYTES`` /
``MAX_VALUES_BYTES`` and the frame; the meta crc (always: header, layout, values and shapes, the
two crc words left out) and with FLAG_CRC the frame crc (every byte but its own word); a new
layout against the schema, once, in time linear in its size; the values against the check
compiled for the layout; the dims (``Plan.check_tensors``: exact payload = header tensor bytes,
region = the frame's remaining length). Neither crc is a signature: a writer that recomputes them
can send any frame, which strict parsing then holds to the schema and the exact sizes.
"""

from __future__ import annotations

import operator
import struct
import zlib
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch

from cpmeta.transport.codec import decode_body, encode_body  # cpmeta -> transport only

from ..buffers import DTYPE_CODE, PACK_ALIGN, WIRE_DTYPES, pack_up  # the one packing rule

__all__ = ["MESSAGE_VERSION", "FRAME_MAGIC", "HEADER", "WIRE_DTYPES", "DTYPE_CODE", "FLAG_LAYOUT",
           "FLAG_CRC", "FLAG_PACKED", "FLAG_ABORT", "KNOWN_FLAGS", "WireError",
           "ChecksumError", "FrameMismatch", "DriverAbort", "abort_values", "layout_id", "frame_crc", "meta_crc", "getter", "PATH_SEP",
           "ALIAS_SEP", "CRC_AT", "META_CRC_AT", "MAX_LAYOUTS", "MAX_DIM", "MAX_NDIM",
           "MAX_LAYOUT_BYTES", "MAX_VALUES_BYTES", "MAX_COLLECTIVE_BYTES", "ELEMENT_SIZE",
           "PACK_ALIGN", "pack_up", "Head", "Frame", "blocks_at", "seal", "read_head", "FrameWriter",
           "FrameReader"]

#: Version of the frame (8: no span frames, a persistent driver's arena is the region; 7: the step number; 6: any schema, fingerprinted by class; 5: exact tensor bytes + meta
#: crc; 4: one frame with a cached layout; 3 was the three-layer one).
MESSAGE_VERSION = 8
FRAME_MAGIC = b"CPMB"
HEADER = struct.Struct("<4sHH16sIIIIIIQQ")
CRC_AT = 28  # byte offset of the crc32 word in HEADER
META_CRC_AT = 44  # byte offset of the meta crc32 word (header + layout + values + shapes)
FLAG_LAYOUT, FLAG_CRC, FLAG_PACKED, FLAG_ABORT = 1, 2, 4, 16  # (8 was version 7's span frames)
KNOWN_FLAGS = FLAG_LAYOUT | FLAG_CRC | FLAG_PACKED | FLAG_ABORT
MAX_ABORT_TEXT = 2000  # characters of an abort frame's message the driver sends
#: the builtin classes an abort frame may name (a follower raises the named one, else RuntimeError)
ABORT_BASES: dict[str, type] = {c.__name__: c for c in (
    TypeError, ValueError, RuntimeError, MemoryError, OverflowError, NotImplementedError,
    TimeoutError, KeyError, IndexError, AttributeError, OSError)}
MAX_LAYOUTS = 256  # layouts a follower keeps (and the driver assumes it keeps)
MAX_DIM = 1 << 48  # largest single dim a follower accepts
MAX_NDIM = 16  # largest tensor rank a layout may declare
MAX_LAYOUT_BYTES = 1 << 16  # largest layout block a follower decodes (1024 paths fit easily)
MAX_VALUES_BYTES = 1 << 20  # largest values block a follower decodes (1024 scalars need ~10 KiB)
MAX_COLLECTIVE_BYTES = 1 << 32  # the largest tensor region a frame may announce for the collective path
MAX_FRAME_DIMS = 1024 * MAX_NDIM  # most shape words a frame may declare (MAX_LAYOUT_PATHS ranks)

#: Element size in bytes per wire code (int32 -> 4).
ELEMENT_SIZE: tuple[int, ...] = tuple(torch.empty(0, dtype=d).element_size() for d in WIRE_DTYPES)
PATH_SEP, ALIAS_SEP = ";", ","  # "positions,positions_cp;klen.4": no field or key holds them
_U32 = struct.Struct("<I")


class WireError(ValueError):
    """A frame this rank cannot accept (the receiver adds the rank and the source)."""


class ChecksumError(WireError):
    """A frame whose crc32 does not match, or that lacks one this rank requires."""


class FrameMismatch(RuntimeError):
    """A well-formed frame from a peer that speaks another version or schema (not corruption)."""


class DriverAbort(Exception):
    """A well-formed abort frame: the driver refused step ``step`` with ``base`` (a builtin
    class of :data:`ABORT_BASES`) and ``text`` (its error class and message)."""

    def __init__(self, step: int, base: type, text: str) -> None:
        super().__init__(text)
        self.step, self.base, self.text = step, base, text


def abort_values(e: BaseException) -> list[str]:
    """The values block of an abort frame for the driver's error ``e``: ``[class, builtin base,
    message]``. Example: a ``WireError`` -> ``["WireError", "ValueError", "values block of ..."]``.
    A message with what UTF-8 cannot carry (a lone surrogate of a refused key) is escaped: the
    abort itself must encode, or every follower waits for a frame that never comes."""
    base = next((c.__name__ for c in type(e).__mro__ if c.__name__ in ABORT_BASES
                 and ABORT_BASES[c.__name__] is c), "RuntimeError")
    text = str(e)[:MAX_ABORT_TEXT].encode("utf-8", "backslashreplace").decode("utf-8")
    return [type(e).__name__, base, text]


def getter(idx: list[int]) -> Any:
    """``f(seq) -> list`` of ``seq``'s items at ``idx`` (one C call; ``[]`` for no index)."""
    if not idx:
        return lambda seq: []
    g = operator.itemgetter(*idx)
    if len(idx) == 1:
        return lambda seq: [g(seq)]
    return lambda seq: list(g(seq))


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


def blocks_at(llen: int, vlen: int, n_dims: int) -> tuple[int, int]:
    """``(shapes_at, data_at)``: where the shapes (8-aligned) and the tensors (16-aligned) start.

    Example: layout 0 B, values 21 B, 3 dims: shapes at ``align(56 + 21, 8) = 80``, tensors at
    ``align(80 + 24, 16) = 112``.
    """
    shapes_at = -(-(HEADER.size + llen + vlen) // 8) * 8
    return shapes_at, -(-(shapes_at + 8 * n_dims) // 16) * 16


def seal(view: memoryview, data_at: int, full: bool) -> None:
    """Driver, last step of writing a frame: stamp the meta crc and, with ``full`` (the frame
    carries ``FLAG_CRC``), the frame crc over everything else (the meta crc word included)."""
    _U32.pack_into(view, META_CRC_AT, meta_crc(view, data_at))
    if full:
        _U32.pack_into(view, CRC_AT, frame_crc(view))


class Head(NamedTuple):
    """A frame's header words once :func:`read_head` proved them, and its block offsets."""

    flags: int
    lid: int
    llen: int
    vlen: int
    n_dims: int
    tbytes: int
    shapes_at: int
    data_at: int
    step: int


def read_head(view: memoryview, fingerprint: bytes, schema_name: str, require_crc: bool) -> Head:
    """Check a frame's header against its length, the limits, this rank's version, schema and
    checksum policy, and both crcs. Raises :class:`WireError` / :class:`ChecksumError` for a
    malformed frame, :class:`FrameMismatch` for a peer of another version or schema."""
    n = view.nbytes
    if n < HEADER.size:
        raise WireError(f"truncated frame: {n} bytes")
    (magic, version, flags, schema, lid, crc, llen, vlen, n_dims, meta, tbytes, step
     ) = HEADER.unpack_from(view, 0)
    if magic != FRAME_MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (not a cpmeta frame)")
    if version != MESSAGE_VERSION:
        raise FrameMismatch(f"frame version mismatch: driver sent {version}, this rank speaks "
                            f"{MESSAGE_VERSION}")
    if schema != fingerprint:
        raise FrameMismatch(f"{schema_name} schema fingerprint mismatch: driver "
                            f"{bytes(schema).decode('ascii', 'replace')!r}, this rank "
                            f"{fingerprint.decode()!r} (driver and follower run different cpmeta "
                            "versions or different classes)")
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"unknown flags {flags:#x}")
    if require_crc and not flags & FLAG_CRC:
        raise ChecksumError("frame carries no crc32 (FLAG_CRC clear) but this rank runs with the "
                            "checksum on (CPMETA_CHECKSUM=1 / checksum=True): refused unverified")
    if llen > MAX_LAYOUT_BYTES or (llen and not flags & FLAG_LAYOUT):
        raise WireError(f"layout block of {llen} bytes (flags {flags:#x}; at most "
                        f"MAX_LAYOUT_BYTES={MAX_LAYOUT_BYTES})")
    if vlen > MAX_VALUES_BYTES:
        raise WireError(f"values block of {vlen} bytes, at most MAX_VALUES_BYTES={MAX_VALUES_BYTES}")
    if n_dims > MAX_FRAME_DIMS:
        raise WireError(f"{n_dims} shape words declared, at most {MAX_FRAME_DIMS}")
    shapes_at, data_at = blocks_at(llen, vlen, n_dims)
    if data_at > n:
        raise WireError(f"frame of {n} bytes is shorter than its blocks declare ({data_at})")
    if meta_crc(view, data_at) != meta:
        raise ChecksumError("frame header, layout, values or shapes fail their crc32 check "
                            "(corrupted in transit)")
    if flags & FLAG_CRC and frame_crc(view) != crc:
        raise ChecksumError("frame fails its crc32 check (corrupted in transit)")
    return Head(flags, lid, llen, vlen, n_dims, tbytes, shapes_at, data_at, step)


class Frame(NamedTuple):
    """A parsed frame: its plan, values and dims proven; the tensor region still in ``view``
    at ``head.data_at`` (``head.tbytes`` exact bytes), to be checked by the caller's path."""

    head: Head
    plan: Any  # cpmeta.broadcast.plan.Plan
    values: list[Any]
    dims: tuple[int, ...]
    block: bytes  # the layout block (b"" when only the id came)


class FrameWriter:
    """The driver's side of the codec for one schema: layouts by key, frames written in place.

    ``layout(key)`` gives ``(id, plan, block)`` -- the block until a frame carrying it was sent
    (:meth:`sent`: a layout becomes known to followers only with a frame that delivered it);
    ``write(view, ...)`` writes header, layout, values and shapes; the caller writes the tensor
    region at ``data_at`` and then calls :func:`seal`. ``step``: the last step sent.
    """

    def __init__(self, schema: Any, make_plan: Callable[..., Any]) -> None:
        self.schema = schema
        self.fingerprint = schema.fingerprint.encode()
        self._make_plan = make_plan
        # key -> (id, plan, block); the id is -1 until a frame carrying the block was sent
        self._layouts: dict[tuple, tuple[int, Any, bytes]] = {}
        self._ids: set[int] = set()  # ids the followers hold
        self.step = 0

    def layout(self, key: tuple) -> tuple[int, Any, bytes]:
        """``(id, plan, layout block to send or b"")`` of a layout key (the block until sent)."""
        hit = self._layouts.get(key)
        if hit is not None:
            return (hit[0], hit[1], b"") if hit[0] >= 0 else (layout_id(hit[2]), hit[1], hit[2])
        if len(self._layouts) >= MAX_LAYOUTS:
            self._layouts.clear()  # followers drop theirs oldest first: resend from now on
            self._ids.clear()
        block = encode_body([key[0], list(key[1]), list(key[2]), *key[3:4], *map(list, key[4:])])
        if len(block) > MAX_LAYOUT_BYTES:
            raise WireError(f"layout block of {len(block)} bytes, at most MAX_LAYOUT_BYTES="
                            f"{MAX_LAYOUT_BYTES}")
        plan = self._make_plan(self.schema, key[0], list(key[1]), list(key[2]), key[3],
                               *(list(k) for k in key[4:]))
        self._layouts[key] = (-1, plan, block)
        return layout_id(block), plan, block

    def sent(self, key: tuple, lid: int) -> None:
        """The frame of ``key``'s layout block ``lid`` reached the transport: later frames carry
        its id only (a crc32 collision with a held id keeps sending the block)."""
        hit = self._layouts.get(key)
        if hit is not None and hit[0] < 0 and lid not in self._ids:
            self._layouts[key] = (lid, hit[1], hit[2])
            self._ids.add(lid)

    def write(self, view: memoryview, flags: int, lid: int, lblock: bytes, vblock: bytes,
              plan: Any, dims: tuple[int, ...], tbytes: int, shapes_at: int, step: int) -> None:
        """Header (crc words zero), layout block, values block and shapes into ``view``."""
        HEADER.pack_into(view, 0, FRAME_MAGIC, MESSAGE_VERSION, flags, self.fingerprint, lid, 0,
                         len(lblock), len(vblock), plan.n_dims if plan is not None else 0, 0,
                         tbytes, step)
        at = HEADER.size
        view[at:at + len(lblock)] = lblock
        at += len(lblock)
        view[at:at + len(vblock)] = vblock
        if plan is not None:
            plan.shapes.pack_into(view, shapes_at, *dims)


class FrameReader:
    """A follower's side of the codec for one schema: :meth:`parse` proves a frame up to its
    tensor region; :meth:`keep` caches the frame's plan once the caller proved the rest."""

    def __init__(self, schema: Any, make_plan: Callable[..., Any], require_crc: bool) -> None:
        self.schema = schema
        self.fingerprint = schema.fingerprint.encode()
        self.require_crc = require_crc
        self._make_plan = make_plan
        self._plans: "OrderedDict[int, tuple[bytes, Any]]" = OrderedDict()  # id -> (block, plan)
        self.step = 0  # the last step this rank holds (its frame handed over, accepted or refused)

    def parse(self, view: memoryview, src: int) -> Frame:
        """Header, layout, values and dims of one frame (see the module docstring). The frame
        is this rank's next step whatever follows; its step number is proven first (a replay or
        a gap is refused); an abort frame raises :class:`DriverAbort`."""
        want = self.step = self.step + 1
        h = read_head(view, self.fingerprint, self.schema.name, self.require_crc)
        if h.step != want:
            raise WireError(f"frame of step {h.step} where this rank expects step {want} "
                            f"({'a replayed or stale frame' if h.step < want else 'steps were lost'})")
        if h.flags & FLAG_ABORT:
            raise self._abort(view, h)
        cached = self._plans.get(h.lid)
        if h.flags & FLAG_LAYOUT:
            block = bytes(view[HEADER.size:HEADER.size + h.llen])
            plan = cached[1] if cached is not None and cached[0] == block else self._plan(block, h.lid)
        else:
            block, plan = cached if cached is not None else (b"", None)
        if plan is None:
            raise FrameMismatch(
                f"frame from src={src} refers to layout id {h.lid}, which this rank "
                "never received (it joined late or missed a frame); every rank must construct "
                "the channel together and receive every step")
        at = HEADER.size + h.llen
        values = decode_body(view[at:at + h.vlen], max_bytes=view.nbytes)
        plan.check_values(values)
        if h.n_dims != plan.n_dims:
            raise WireError(f"{h.n_dims} dims declared, the layout has {plan.n_dims}")
        return Frame(h, plan, values, plan.shapes.unpack_from(view, h.shapes_at), block)

    def _abort(self, view: memoryview, h: Head) -> DriverAbort:
        if h.flags & ~(FLAG_ABORT | FLAG_CRC) or h.llen or h.n_dims or h.tbytes or h.lid \
                or view.nbytes != h.data_at:
            raise WireError(f"abort frame with flags {h.flags:#x}, layout id {h.lid}, {h.llen} "
                            f"layout bytes, {h.n_dims} dims, {h.tbytes} tensor bytes, "
                            f"{view.nbytes - h.data_at} bytes after its blocks (expected none)")
        at = HEADER.size
        v = decode_body(view[at:at + h.vlen], max_bytes=h.vlen)
        if (type(v) is not list or len(v) != 3 or any(type(x) is not str for x in v)
                or v[1] not in ABORT_BASES or len(v[0]) > 200 or len(v[2]) > MAX_ABORT_TEXT):
            raise WireError("abort frame: expected [error class, builtin base, message]")
        return DriverAbort(h.step, ABORT_BASES[v[1]], f"{v[0]}: {v[2]}")

    def _plan(self, block: bytes, lid: int) -> Any:
        """The plan of a layout block received with id ``lid`` (checked against the id, the size
        limit and the schema; linear in the block's size)."""
        if layout_id(block) != lid:
            raise WireError(f"layout block does not match its id {lid}")
        lay = decode_body(block, max_bytes=MAX_LAYOUT_BYTES)
        n = 5 if self.schema.dict_keys == "dict" else 4
        if (type(lay) is not list or len(lay) != n or type(lay[0]) is not str
                or type(lay[1]) is not list or type(lay[2]) is not list or type(lay[3]) is not str
                or (n == 5 and type(lay[4]) is not list)):
            raise WireError("layout block: expected [paths, codes, ndims, value paths"
                            + (", key order]" if n == 5 else "]"))
        return self._make_plan(self.schema, *lay)

    def keep(self, frame: Frame) -> None:
        """Cache a frame's plan once the frame passed every check (LRU past MAX_LAYOUTS)."""
        lid = frame.head.lid
        if self._plans.pop(lid, None) is None and len(self._plans) >= MAX_LAYOUTS:
            self._plans.popitem(last=False)
        self._plans[lid] = (frame.block, frame.plan)

