"""What a follower proves about a frame before it reads it, and the group's checksum agreement.

Threat model (docs/reliability.md, "Threat model"): frames come from the driver through the
shared-memory ring (writable by processes of the same user) or the process group (TCP). The meta
crc (always) makes any corruption of the header, layout, values or shapes a refusal; the frame
crc (``FLAG_CRC``, ``CPMETA_CHECKSUM=1``) extends that to the tensor bytes. Neither is a
signature: a writer that recomputes them can send any frame, which strict parsing then holds to
the schema and the exact sizes (no crash, no allocation beyond the frame, no misread layout).

Per frame a follower calls, in order::

    shapes_at, data_at = check_frame(view, flags, crc, meta, llen, vlen, n_dims, require_crc)
    plan = plan_from_block(block, lid)          # only for a layout block it does not hold yet
    plan.check_values(values)                   # compiled per layout (cpmeta.broadcast.schema)
    numels, starts, region = plan.check_tensors(dims, packed, tbytes, n - data_at)
    # a span frame (FLAG_SPAN, persistent outputs): cpmeta.broadcast.span.check_span instead
"""

from __future__ import annotations

import struct
from typing import Any

import torch
import torch.distributed as dist

from transport.codec import decode_body  # cpmeta -> transport only

from .schema import MAX_LAYOUT_PATHS
from .wire import (CRC_AT, FLAG_CRC, FLAG_LAYOUT, HEADER, KNOWN_FLAGS, MAX_LAYOUT_BYTES, MAX_NDIM,
                   MAX_VALUES_BYTES, META_CRC_AT, Plan, WireError, frame_crc, layout_id, meta_crc)

__all__ = ["ChecksumError", "seal", "check_frame", "plan_from_block", "agree_checksum", "blocks_at"]

MAX_FRAME_DIMS = MAX_LAYOUT_PATHS * MAX_NDIM  # most shape words a frame may declare
_U32 = struct.Struct("<I")


class ChecksumError(WireError):
    """A frame whose crc32 does not match, or that lacks one this rank requires."""


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


def check_frame(view: memoryview, flags: int, crc: int, meta: int, llen: int, vlen: int,
                n_dims: int, require_crc: bool) -> tuple[int, int]:
    """Check a frame's header words against its length, the limits, the checksum policy and both
    crcs; return ``(shapes_at, data_at)``. Raises :class:`WireError` / :class:`ChecksumError`.

    ``require_crc`` (this rank's checksum setting): a frame without ``FLAG_CRC`` is refused, so
    clearing one header bit cannot switch the check off.
    """
    n = view.nbytes
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
        raise ChecksumError("metadata frame fails its crc32 check (corrupted in transit)")
    return shapes_at, data_at


def plan_from_block(block: bytes, lid: int) -> Plan:
    """The :class:`Plan` of a layout block received with id ``lid`` (checked against the id, the
    size limit and ``InputMetadata``'s schema; linear in the block's size)."""
    if len(block) > MAX_LAYOUT_BYTES:
        raise WireError(f"layout block of {len(block)} bytes, at most {MAX_LAYOUT_BYTES}")
    if layout_id(block) != lid:
        raise WireError(f"layout block does not match its id {lid}")
    lay = decode_body(block, max_bytes=MAX_LAYOUT_BYTES)
    if (type(lay) is not list or len(lay) != 4 or type(lay[0]) is not str
            or type(lay[1]) is not list or type(lay[2]) is not list or type(lay[3]) is not str):
        raise WireError("layout block: expected [paths, codes, ndims, value paths]")
    return Plan(*lay)


def agree_checksum(group: Any, mine: bool) -> None:
    """Collective over the gloo ``group`` (every member calls it once, at construction): raise
    ``ValueError`` on EVERY rank unless all members use the same checksum setting.

    Per-rank example, ranks [0, 1], ``CPMETA_CHECKSUM=1`` on rank 0 only: both raise
    ``checksum setting differs across the broadcast group: on at ranks [0], off at ranks [1]``.
    """
    ranks = dist.get_process_group_ranks(group)
    out = [torch.zeros(1, dtype=torch.uint8) for _ in ranks]
    dist.all_gather(out, torch.tensor([int(bool(mine))], dtype=torch.uint8), group=group)
    on = [r for r, t in zip(ranks, out) if int(t.item())]
    if on and len(on) != len(ranks):
        off = [r for r in ranks if r not in on]
        raise ValueError(f"checksum setting differs across the broadcast group: on at ranks {on}, "
                         f"off at ranks {off}; set CPMETA_CHECKSUM (or checksum=) the same on "
                         "every rank (a follower refuses frames without a crc when it is on)")
