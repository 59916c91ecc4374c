"""Set up a ``ShmRing`` collectively over a gloo process group (handle travels as bytes)."""

from __future__ import annotations

import logging
import struct
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from . import _futex
from ._dist import group_ranks
from .coalesce import tensor_memoryview
from .shm_ring import ShmRing, ShmRingHandle

__all__ = ["ring_from_process_group", "HANDLE_BYTES"]

logger = logging.getLogger(__name__)
HANDLE_BYTES = 1024  # fixed size of the broadcast handle buffer
_LEN = struct.Struct("<I")
_warned_platform: set[str] = set()  # reasons already logged: one warning per process each


def ring_from_process_group(group: Any, src: int, *, readers: Optional[Sequence[int]] = None,
                            slot_size: Optional[int] = None, num_slots: Optional[int] = None,
                            timeout: Optional[float] = None,
                            use_memfd: bool = True) -> tuple[Optional[ShmRing], list[int]]:
    """Collective over the gloo ``group`` (EVERY member calls it with the same arguments).

    ``src`` (a global rank) creates the ring; ``readers`` (global ranks, default: every other
    member) attach in that order. Returns ``(this rank's end or None, attached reader ranks)``:
    a reader that cannot open the segment (another container, no /proc access) is left out
    and marked absent, so the writer never waits for it; every member learns the same list.
    Two collectives: a broadcast of the handle and an all_reduce of the attach flags.
    On a platform the ring refuses (``_futex.ring_unsupported_reason``) ``src`` sends an empty
    handle, so every reader is left out, and logs ONE warning per process.

    Example, group of global ranks [0, 1, 2], src=0: rank 0 gets the writer end, ranks 1 and 2
    reader ends 0 and 1, and all three get ``[1, 2]``.
    """
    ranks = group_ranks(group)
    me = dist.get_rank()
    readers = [r for r in ranks if r != src] if readers is None else list(readers)
    if src not in ranks or any(r not in ranks or r == src for r in readers):
        raise ValueError(f"readers: expected members of {ranks} other than src={src}, got {readers}")
    if not readers:
        return None, []
    buf = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    ring: Optional[ShmRing] = None
    unsupported = _futex.ring_unsupported_reason() if me == src else None
    if unsupported is not None and unsupported not in _warned_platform:
        _warned_platform.add(unsupported)
        logger.warning("ShmRing refused: %s; every follower uses the process group", unsupported)
    if me == src and unsupported is None:
        try:
            ring = ShmRing.create(len(readers), slot_size=slot_size, num_slots=num_slots,
                                  timeout=timeout, writer_rank=src, reader_ranks=readers,
                                  use_memfd=use_memfd)
            blob = ring.handle.to_bytes()
            view = tensor_memoryview(buf)
            _LEN.pack_into(view, 0, len(blob))
            view[_LEN.size:_LEN.size + len(blob)] = blob
        except OSError as e:
            logger.warning("ShmRing: cannot create a shared-memory segment (%s); using the "
                           "process group for every follower", e)
    dist.broadcast(buf, src=src, group=group)
    flags = torch.zeros(len(ranks), dtype=torch.int32)
    if me in readers:
        ring = _try_attach(buf, readers.index(me), timeout)
        flags[ranks.index(me)] = int(ring is not None)
    dist.all_reduce(flags, group=group)
    attached = [r for r in readers if flags[ranks.index(r)].item()]
    if me == src and ring is not None:
        for i, r in enumerate(readers):
            if r not in attached:
                ring.mark_absent(i)
        ring.wait_attached()  # everyone is ATTACHED or ABSENT now: drops the fd / name at once
        if not attached:
            ring.close()
            ring = None
    return ring, attached


def _try_attach(buf: torch.Tensor, index: int, timeout: Optional[float]) -> Optional[ShmRing]:
    view = tensor_memoryview(buf)
    (n,) = _LEN.unpack_from(view, 0)
    if n == 0 or n > HANDLE_BYTES - _LEN.size:
        return None
    try:
        handle = ShmRingHandle.from_bytes(bytes(view[_LEN.size:_LEN.size + n]))
        return ShmRing.attach(handle, index, timeout=timeout)
    except (OSError, ValueError) as e:
        logger.warning("ShmRing: reader %d cannot attach (%s); it will use the process group",
                       index, e)
        return None
