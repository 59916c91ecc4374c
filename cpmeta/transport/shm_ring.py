"""``ShmRing``: one writer, N readers, fixed-size slots in one shared-memory segment.

Memory layout (byte offsets; every control word sits on its own 64-byte cache line)::

    0                          64               128              192        256        256+64*R  data_at
    +--------------------------+----------------+----------------+----------+----------+------...
    | magic "CPMRING1"         | head (u64)     | writer_waiting | announce | reader 0 | ...
    | version u32, readers u32 | = slots        | (u32)          | (u32):   | reader 1 |
    | slot_size u64, slots u64 |   published    |                | steps    |  ...     |
    | nonce[16], writer_pid u32|   (futex: low  |                | announced|          |
    | closed u32               |    32 bits)    |                |          |          |
    +--------------------------+----------------+----------------+----------+----------+------...
    reader block (64 B): tail u64 (slots consumed; the writer's futex word), state u32
                         (EMPTY/ATTACHED/CLOSED/ABSENT), pid u32, waiting u32
    data (page aligned): num_slots * slot_size bytes, used as ONE circular byte stream

    data:  | slot 0 | slot 1 | slot 2 | ... | slot N-1 |
    message = 16-byte header (length u64, kind u32, pad u32) + payload, starting on a slot
    boundary and running on through the next slots: k = cdiv(16 + length, slot_size) slots.

Protocol (``head`` and every ``tail`` count slots since creation, they never wrap in practice):

- writer, ``announce()`` (optional, before it prepares a message): ``announce += 1``, full fence,
  wake the parked readers; a reader that sees ``announce`` move spins (yielding its core when the
  host has fewer cores than ring processes) for up to ``ANNOUNCE_SPIN_S`` instead of parking, so
  the message that follows meets a running reader instead of paying an OS wake-up.
- writer, zero-copy: ``reserve(n)`` waits for the slots and returns a writable view of the
  payload (plus its address); the caller fills it in place; ``commit()`` publishes it.
- writer, message of k slots: if it fits the ring (k <= N) but would run past the last slot,
  first publish a PAD message over the remaining slots, so the reader can hand the consumer ONE
  contiguous view. Wait until ``head + k - min(tail) <= N`` (never overwrite unread data), copy,
  [release fence], ``head += k``, full fence, wake readers whose ``waiting`` flag is set.
  A message larger than the ring is streamed: publish slots as readers free them.
- reader: wait until ``head > tail`` (spin briefly, then: ``waiting = 1``, full fence, re-check,
  ``FUTEX_WAIT(head, seen)``), [acquire fence], read the header, wait for the message's k slots,
  call the consumer on a view of the slots, then ``tail += k`` (release), full fence, wake the
  writer if ``writer_waiting``.
- every wait is sliced (``LIVENESS_SLICE_S``); between slices the waiter checks the deadline and
  the peers: a writer checks the lagging readers' pids, a reader the writer's pid, so a dead peer
  is reported by rank well before the timeout. A reader's wait for the NEXT message has no
  deadline (an idle writer is not a dead one); the timeout starts once a message's first slot is
  published. The writer refuses to write while a reader is CLOSED (named at the next message).

Flag state machine of a reader block: EMPTY --attach--> ATTACHED --close--> CLOSED; the writer
may set EMPTY --mark_absent--> ABSENT (a reader that could not attach; never waited for).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import secrets
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from . import envs
from ._futex import fence, futex_wake, ring_unsupported_reason
from ._ring_io import RingIO
from ._ring_layout import (ABSENT, ATTACHED, CLOSED, DEFAULT_SPIN_US, EMPTY, HDR, MAGIC,
                           MIN_SLOT_SIZE, VERSION, RingWords, data_offset)
from ._segment import PeerWatch, create_segment, open_segment
from .codec import decode, encode
from .errors import PeerError, RingClosedError  # noqa: F401 (re-exported)

__all__ = ["ShmRing", "ShmRingHandle", "ring_from_process_group", "PeerError", "RingClosedError", "DEFAULT_SPIN_US",
           "EMPTY", "ATTACHED", "CLOSED", "ABSENT"]

logger = logging.getLogger(__name__)
#: Python 3.13+: the mapping keeps no descriptor of its own (CPython's mmap dups the fd it maps
#: otherwise), so once the fd below is closed nothing but the mapping reaches the segment
_MMAP_KW: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def _check_count(name: str, v: object) -> None:
    """An int argument within int32 (a numpy integer counts, a bool does not), else named."""
    if not envs.is_int(v):
        raise TypeError(f"{name}: expected an int, got {v!r}")
    if not -(1 << 31) <= int(v) < 1 << 31:  # type: ignore[call-overload]  # (is_int: an Integral)
        raise ValueError(f"{name}: expected an int within int32, got {v}")


@dataclass(frozen=True)
class ShmRingHandle:
    """Everything a reader needs to attach; travels as codec bytes (never pickled).

    ``reader_ranks[i]`` / ``writer_rank`` label processes in error messages (e.g. global ranks).
    """

    path: str  # /proc/<pid>/fd/<n> (memfd) or /dev/shm/cpmeta-<ns>-<pid>-<32 hex>
    nonce: bytes  # 16 random bytes, also in the segment header: guards against stale paths
    num_readers: int
    slot_size: int
    num_slots: int
    writer_pid: int
    writer_rank: int
    reader_ranks: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return encode([self.path, self.nonce, self.num_readers, self.slot_size, self.num_slots,
                       self.writer_pid, self.writer_rank, list(self.reader_ranks)])

    @classmethod
    def from_bytes(cls, data: Any) -> "ShmRingHandle":
        f = decode(data)
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], tuple(f[7]))


@dataclass
class _Resources:
    """What the ring must release, shared with its finalizer (the safety net)."""

    mm: mmap.mmap
    buf: memoryview
    words: RingWords
    fd: Optional[int]
    unlink_path: Optional[str]
    watch: dict[int, PeerWatch] = field(default_factory=dict)

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def unlink(self) -> None:
        if self.unlink_path:
            try:
                os.unlink(self.unlink_path)
            except FileNotFoundError:
                pass
            self.unlink_path = None

    def release(self) -> None:
        self.words.clear()  # drop every from_buffer export before closing the mmap
        self.buf.release()
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view: leave the mapping to the GC
            logger.warning("ShmRing: a view of the mapping is still alive; not unmapping now")
        self.close_fd()
        self.unlink()
        for w in self.watch.values():
            w.close()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _auto_spin_us(num_readers: int) -> float:
    """Spin only when writer + readers can each own a core (else spinning steals the writer's)."""
    configured = envs.shm_spin_us()
    if configured is not None:
        return configured
    return DEFAULT_SPIN_US if _cores() > num_readers + 1 else 0.0


class ShmRing(RingIO):
    """Single-writer / multi-reader message ring in shared memory (see the module docstring).

    Writer: ``ring = ShmRing.create(num_readers=2)``; send ``ring.handle.to_bytes()`` to the
    readers; ``ring.write(b"...")``. Reader i: ``ShmRing.attach(handle, i).read_bytes()``. Or,
    collectively, :meth:`from_process_group`. Close with :meth:`close` or a ``with`` block.
    """

    handle: ShmRingHandle  # the full handle (RingIO reads only RingHandleFields of it)

    def __init__(self, handle: ShmRingHandle, fd: int, *, reader_index: Optional[int],
                 unlink_path: Optional[str], timeout: Optional[float]) -> None:
        self.handle = handle
        self.reader_index = reader_index
        self.timeout = timeout  # resolved by create / attach
        self._data_at = data_offset(handle.num_readers)
        self._ring_bytes = handle.slot_size * handle.num_slots
        try:
            mm = mmap.mmap(fd, self._data_at + self._ring_bytes, **_MMAP_KW)
        except (OSError, ValueError):
            os.close(fd)  # a short or foreign file: do not leak the descriptor
            raise
        self._w = RingWords(mm, handle.num_readers)
        self._base_addr = ctypes.addressof(self._w.base)
        self._head_addr = ctypes.addressof(self._w.head)  # futex addresses as plain ints
        self._tail_addrs = [ctypes.addressof(t) for t in self._w.tails]
        self._res = _Resources(mm, memoryview(mm), self._w, fd, unlink_path)
        self._finalizer = weakref.finalize(self, self._res.release)
        self._buf = self._res.buf
        self._watch = self._res.watch
        self._spin_s = _auto_spin_us(handle.num_readers) * 1e-6
        self._yield_spin = _cores() <= handle.num_readers  # fewer cores than ring processes
        self._announce_seen = 0  # reader: announce count already acted on
        # reader: run while spinning for the next message (None, or an iterator of pieces)
        self.warm: Optional[Callable[[], Any]] = None
        self._alive = None  # writer: one poll over the readers' pidfds (RingIO)
        self._tail_floor = 0  # writer: lower bound of the readers' tails (RingIO)
        self._stuck: Optional[tuple[int, int]] = None  # writer: (reader, tail) that timed out
        self._pending: Optional[int] = None  # writer: head after the reserved message
        self.messages_out = 0  # writer: messages published whole (RingIO; counted before the liveness poll)
        self._max_bytes = envs.max_message_bytes()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, num_readers: int, *, slot_size: Optional[int] = None,
               num_slots: Optional[int] = None, timeout: envs.Timeout = envs.ENV_TIMEOUT,
               writer_rank: int = 0, reader_ranks: Optional[Sequence[int]] = None,
               use_memfd: bool = True) -> "ShmRing":
        """Create a ring as its writer. ``slot_size``/``num_slots`` default to the env values;
        ``reader_ranks`` (default 1..num_readers) label the readers in error messages.
        ``timeout`` (default ``CPMETA_TRANSPORT_TIMEOUT``; None: no bound) bounds a message in
        flight and the wait for room, never a reader's wait for the next message; anything
        but a finite number > 0 or None is a ``ValueError`` here.
        ``OSError(ENOTSUP)`` on a platform the ring refuses (``_futex.ring_unsupported_reason``)."""
        timeout_s = envs.resolve_timeout(timeout)
        slot_size = envs.shm_slot_size() if slot_size is None else slot_size
        num_slots = envs.shm_num_slots() if num_slots is None else num_slots
        for name, v in (("num_readers", num_readers), ("slot_size", slot_size), ("num_slots", num_slots)):
            _check_count(name, v)
        ranks = tuple(range(1, num_readers + 1)) if reader_ranks is None else tuple(reader_ranks)
        if num_readers < 1 or len(ranks) != num_readers:
            raise ValueError(f"num_readers: expected >= 1 and one rank each, got {num_readers}, {ranks}")
        if slot_size < MIN_SLOT_SIZE or slot_size % 8:
            raise ValueError(f"slot_size: expected a multiple of 8 >= {MIN_SLOT_SIZE}, got {slot_size}")
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        unsupported = ring_unsupported_reason()
        if unsupported is not None:
            raise OSError(errno.ENOTSUP, f"ShmRing: {unsupported}")
        seg = create_segment(data_offset(num_readers) + slot_size * num_slots, use_memfd=use_memfd)
        handle = ShmRingHandle(seg.path, secrets.token_bytes(16), num_readers, slot_size, num_slots,
                               os.getpid(), writer_rank, ranks)
        ring = cls(handle, seg.fd, reader_index=None, unlink_path=seg.unlink_path, timeout=timeout_s)
        HDR.pack_into(ring._res.mm, 0, MAGIC, VERSION, num_readers, slot_size, num_slots,
                      handle.nonce, handle.writer_pid, 0)
        return ring

    @classmethod
    def attach(cls, handle: ShmRingHandle, reader_index: int, *,
               timeout: envs.Timeout = envs.ENV_TIMEOUT) -> "ShmRing":
        """Attach as reader ``reader_index`` (0-based) of the ring described by ``handle``
        (``timeout`` as for :meth:`create`)."""
        timeout_s = envs.resolve_timeout(timeout)
        if not isinstance(handle, ShmRingHandle):
            raise TypeError(f"handle: expected a ShmRingHandle (the writer's ring.handle), got {type(handle).__name__}")
        _check_count("reader_index", reader_index)
        if not 0 <= reader_index < handle.num_readers:
            raise ValueError(f"reader_index: expected 0..{handle.num_readers - 1}, got {reader_index}")
        ring = cls(handle, open_segment(handle.path), reader_index=reader_index, unlink_path=None,
                   timeout=timeout_s)
        found = HDR.unpack_from(ring._res.mm, 0)[:7]
        want = (MAGIC, VERSION, handle.num_readers, handle.slot_size, handle.num_slots,
                handle.nonce, handle.writer_pid)
        if found != want:
            ring._finalizer()  # unmap only: this end never attached, leave the block alone
            raise ValueError(f"handle: segment {handle.path} does not match the handle (stale or foreign)")
        if ring._w.states[reader_index].value != EMPTY:
            ring._finalizer()
            raise ValueError(f"reader_index: reader {reader_index} is already attached or absent")
        ring._watch[-1] = PeerWatch(handle.writer_pid)
        ring._w.pids[reader_index].value = os.getpid()
        ring._w.states[reader_index].value = ATTACHED
        ring._res.close_fd()
        return ring

    @classmethod
    def from_process_group(cls, group: Any, src: int, **kwargs: Any) -> "ShmRing":
        """Collective over the gloo ``group``: ``src`` (a global rank) creates the ring and every
        other rank attaches as a reader (in group-rank order). Returns this rank's end. See
        :func:`ring_from_process_group` for the keyword arguments."""
        ring, _ = ring_from_process_group(group, src, **kwargs)
        if ring is None:
            raise PeerError("ShmRing.from_process_group: this rank could not attach to the ring")
        return ring

    def handle_bytes(self) -> bytes:
        """The handle readers attach with, as bytes (writer end)."""
        return self.handle.to_bytes()

    # ------------------------------------------------------------------ lifecycle

    def states(self) -> list[int]:
        """Per reader: EMPTY=0, ATTACHED=1, CLOSED=2 or ABSENT=3."""
        return [s.value for s in self._w.states]

    def gone_peers(self) -> dict[int, str]:
        """The peers this end can see are gone, by rank, each named (the writer sees its
        readers, a reader the writer): closed their end, or their process died. For a wait
        outside the ring (e.g. a rendezvous) that should not outlast a dead peer by the whole
        timeout. Example: ``{2: "rank 2 (reader 1) closed the ring"}``."""
        if self.closed:  # this end is released: nothing to look at
            return {}
        if self.reader_index is not None:
            who, w = self._label(None), self.handle.writer_rank
            return ({w: f"{who} closed the ring"} if self._w.closed.value else
                    {w: f"{who}, pid {self.handle.writer_pid}, died"} if self._watch[-1].dead() else {})
        return self._readers_gone()

    def mark_absent(self, reader_index: int) -> None:
        """Writer: reader ``reader_index`` will never attach; do not wait for it."""
        if self._w.states[reader_index].value == EMPTY:
            self._w.states[reader_index].value = ABSENT
        self._drop_name()

    def wait_attached(self, timeout: Optional[float] = None) -> None:
        """Writer: block until every reader attached (or is absent), then drop the segment's
        name / fd so that nothing can outlive the processes."""
        deadline = self._deadline(timeout)
        while EMPTY in self.states():
            if time.monotonic() > deadline:
                missing = [self._label(i) for i, s in enumerate(self.states()) if s == EMPTY]
                raise TimeoutError(f"ShmRing: reader(s) {', '.join(missing)} never attached")
            time.sleep(1e-3)
        self._drop_name()

    def _drop_name(self) -> None:
        if EMPTY not in self.states():
            self._res.unlink()
            self._res.close_fd()

    def close(self) -> None:
        """Release the mapping (writer: mark the ring closed and wake the readers). Idempotent."""
        if not self._finalizer.alive:
            return
        me = self.reader_index
        if me is None:  # the writer
            self._w.closed.value = 1
            fence()
            futex_wake(self._head_addr)
        else:
            self._w.states[me].value = CLOSED
            fence()
            futex_wake(self._tail_addrs[me])
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "ShmRing":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ring_from_process_group(group: Any, src: int, *, readers: Optional[Sequence[int]] = None,
                            slot_size: Optional[int] = None, num_slots: Optional[int] = None,
                            timeout: envs.Timeout = envs.ENV_TIMEOUT,
                            use_memfd: bool = True) -> tuple[Optional[ShmRing], list[int]]:
    """Collective over the gloo ``group`` (EVERY member calls it with the same arguments).

    ``src`` (a global rank) creates the ring; ``readers`` (global ranks, default: every other
    member) attach in that order. Returns ``(this rank's end or None, attached reader ranks)``;
    a reader that cannot open the segment is left out and marked absent (see
    :func:`transport.ring_group.exchange_ring`). Example, group of global ranks [0, 1, 2],
    src=0: rank 0 gets the writer end, ranks 1 and 2 reader ends 0 and 1, and all three get
    ``[1, 2]``.
    """
    from .ring_group import exchange_ring  # torch.distributed: imported only by this collective

    timeout = envs.resolve_timeout(timeout)

    def create(reader_ranks: list[int]) -> ShmRing:
        return ShmRing.create(len(reader_ranks), slot_size=slot_size, num_slots=num_slots,
                              timeout=timeout, writer_rank=src, reader_ranks=reader_ranks,
                              use_memfd=use_memfd)

    def attach(blob: bytes, index: int) -> ShmRing:
        return ShmRing.attach(ShmRingHandle.from_bytes(blob), index, timeout=timeout)

    return exchange_ring(group, src, readers, create, attach, timeout=envs.wait_seconds(timeout))
