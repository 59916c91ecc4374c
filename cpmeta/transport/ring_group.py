"""Set up a shared-memory ring collectively over a gloo process group (handle travels as bytes).

The ring type stays torch-free (:mod:`transport.shm_ring`) and this module knows nothing of it:
:func:`exchange_ring` takes two callbacks, one that creates the writer end and one that attaches
a reader end from the handle bytes. ``ShmRing.from_process_group`` / ``ring_from_process_group``
(in ``shm_ring``) pass them.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from . import _futex, envs
from ._dist import group_ranks, wait_work
from ._segment import REAP_GRACE_S, reap_dead_segments
from .coalesce import tensor_memoryview

__all__ = ["exchange_ring", "HANDLE_BYTES", "RingEnd"]

logger = logging.getLogger(__name__)
HANDLE_BYTES = 1024  # fixed size of the broadcast handle buffer
_LEN = struct.Struct("<I")
_warned_platform: set[str] = set()  # reasons already logged: one warning per process each


class RingEnd(Protocol):
    """What :func:`exchange_ring` needs of the writer end it creates."""

    def handle_bytes(self) -> bytes: ...
    def mark_absent(self, reader_index: int) -> None: ...
    def wait_attached(self) -> None: ...
    def close(self) -> None: ...


def exchange_ring(group: Any, src: int, readers: Optional[Sequence[int]],
                  create: Callable[[list[int]], RingEnd],
                  attach: Callable[[bytes, int], Any],
                  timeout: Optional[float] = None) -> tuple[Optional[Any], list[int]]:
    """Collective over the gloo ``group`` (EVERY member calls it with the same arguments).

    ``src`` (a global rank) creates the ring with ``create(readers)``; ``readers`` (global ranks, default: every other
    member) attach in that order with ``attach(handle_bytes, reader_index)``. Returns ``(this rank's end or None, attached reader ranks)``:
    a reader that cannot open the segment (another container, no /proc access) is left out
    and marked absent, so the writer never waits for it; every member learns the same list.
    Two collectives: a broadcast of the handle and an all_reduce of the attach flags, each
    waited for at most ``timeout`` seconds (default ``CPMETA_TRANSPORT_TIMEOUT``) in all:
    ``TimeoutError`` naming the step (the writer end is closed first: nothing leaks; a reader
    whose writer died first reaps the name it may have left, ``_segment.reap_dead_segments``).
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
    timeout_s = envs.transport_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout_s
    buf = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    ring: Optional[Any] = None
    unsupported = _futex.ring_unsupported_reason() if me == src else None
    if unsupported is not None and unsupported not in _warned_platform:
        _warned_platform.add(unsupported)
        logger.warning("ShmRing refused: %s; every follower uses the process group", unsupported)
    if me == src and unsupported is None:
        try:
            ring = create(readers)
            blob = ring.handle_bytes()
            view = tensor_memoryview(buf)
            _LEN.pack_into(view, 0, len(blob))
            view[_LEN.size:_LEN.size + len(blob)] = blob
        except OSError as e:
            logger.warning("ShmRing: cannot create a shared-memory segment (%s); using the "
                           "process group for every follower", e)
    try:
        _wait(dist.broadcast(buf, src=src, group=group, async_op=True), buf, deadline,
              f"rank {src} (writer) sent no ring handle within {timeout_s:g} s")
        flags = torch.zeros(len(ranks), dtype=torch.int32)
        if me in readers:
            ring = _try_attach(buf, readers.index(me), attach)
            flags[ranks.index(me)] = int(ring is not None)
        _wait(dist.all_reduce(flags, group=group, async_op=True), flags, deadline,
              f"the attach flags of ranks {ranks} were not all in within {timeout_s:g} s")
    except BaseException:
        if ring is not None:
            ring.close()
        if me in readers:  # a writer killed before it could unlink its segment's name leaks it
            reap_dead_segments(REAP_GRACE_S)
        raise
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


def _wait(work: Any, buf: torch.Tensor, deadline: float, what: str) -> None:
    if not wait_work(work, deadline, buf):
        raise TimeoutError(f"ShmRing setup: {what}")


def _try_attach(buf: torch.Tensor, index: int, attach: Callable[[bytes, int], Any]) -> Optional[Any]:
    view = tensor_memoryview(buf)
    (n,) = _LEN.unpack_from(view, 0)
    if n == 0 or n > HANDLE_BYTES - _LEN.size:
        return None
    try:
        return attach(bytes(view[_LEN.size:_LEN.size + n]), index)
    except (OSError, ValueError) as e:
        logger.warning("ShmRing: reader %d cannot attach (%s); it will use the process group",
                       index, e)
        return None
