"""Reader half of ``ShmRing``'s data path: wait for the next message, hand it to a consumer
(a zero-copy view of the slots, or a private buffer for a message larger than the ring), give
the slots back and wake a waiting writer; plus the helpers both halves use.

``RingReader`` is a mixin over the mapped words (the layout and the flag protocol are drawn in
``cpmeta/transport/shm_ring.py``); it declares the attributes it reads as class annotations and
``ShmRing.__init__`` sets them. The writer half (``cpmeta/transport/_ring_io.py``, ``RingIO``) builds on it.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Optional, TypeVar

from ._futex import HAVE_FENCE, NEEDS_RELEASE_FENCE, fence, futex_wait, futex_wake
from ._ring_layout import (ANNOUNCE_SPIN_S, ATTACHED, CLOSED, KIND_DATA, KIND_PAD, LIVENESS_SLICE_S,
                           MSG_HEADER, WARM_EVERY_S, RingHandleFields, RingWords, cdiv)
from ._segment import PeerWatch
from .errors import PeerError, RingClosedError
from .gather import PENDING
from .ring_njit import ring_release

__all__ = ["RingReader"]

T = TypeVar("T")
_HDR_LEN = MSG_HEADER.size


class RingReader:
    """Mixin: the reader's side of the message protocol, and what both sides share.

    The state below is set by the concrete ring's ``__init__`` (``ShmRing``).
    """

    handle: RingHandleFields
    reader_index: Optional[int]  # None: the writer end
    timeout: Optional[float]  # seconds a message in flight may take (None: no bound)
    _w: RingWords  # the control words (head, announce, per reader tails, states, ...)
    _buf: memoryview  # the whole mapping
    _head_addr: int  # futex addresses as plain ints
    _tail_addrs: list[int]
    _data_at: int  # byte offset of slot 0 in the mapping
    _ring_bytes: int  # slot_size * num_slots
    _spin_s: float  # reader: seconds to spin before parking (0: park at once)
    _yield_spin: bool  # reader: yield the core while spinning (fewer cores than ring processes)
    _watch: dict[int, PeerWatch]  # per reader index, -1 = the writer
    _max_bytes: int  # reader: largest message accepted
    _announce_seen: int  # reader: announce count already acted on
    warm: Optional[Callable[[], Any]]  # reader: called while it spins for the next message

    def _label(self, i: Optional[int]) -> str:
        """``i`` as an error message names it: "rank 2 (reader 1)" or "rank 0 (writer)"."""
        return f"rank {self.handle.reader_ranks[i]} (reader {i})" if i is not None else \
            f"rank {self.handle.writer_rank} (writer)"

    def _reader_watch(self, i: int) -> PeerWatch:
        """Reader ``i``'s process watch (made at first use from the pid it wrote when attaching)."""
        watch = self._watch.get(i)
        if watch is None:
            watch = self._watch[i] = PeerWatch(self._w.pids[i].value)
        return watch

    def _readers_gone(self) -> dict[int, str]:
        """The other readers that closed their end or whose process died, by rank, each named:
        ``{2: "rank 2 (reader 1), pid 812, died"}``."""
        gone = {}
        for i, st in enumerate(s.value for s in self._w.states):
            if i == self.reader_index:
                continue
            if st == CLOSED:
                gone[self.handle.reader_ranks[i]] = f"{self._label(i)} closed the ring"
            elif st == ATTACHED and self._reader_watch(i).dead():
                gone[self.handle.reader_ranks[i]] = f"{self._label(i)}, pid {self._watch[i].pid}, died"
        return gone

    def _ring_pos(self, start_slot: int, msg_offset: int) -> int:
        """Ring byte offset of byte ``msg_offset`` of the message starting at slot ``start_slot``.

        Example: 4 slots of 64 B (ring 256 B), start slot 6 (index 2 = byte 128), offset 200:
        (128 + 200) % 256 = 72.
        """
        return ((start_slot % self.handle.num_slots) * self.handle.slot_size + msg_offset) % self._ring_bytes

    @staticmethod
    def _left(deadline: Optional[float]) -> float:
        """Seconds to the deadline (at least 0.1 ms); one liveness slice when there is none."""
        if deadline is None:
            return LIVENESS_SLICE_S
        return max(1e-4, deadline - time.monotonic())

    def _deadline(self, timeout: Optional[float]) -> float:
        """CLOCK_MONOTONIC deadline of a wait bounded by ``timeout`` (None: the ring's own; the
        ring's None: ``inf``, never reached)."""
        t = self.timeout if timeout is None else timeout
        return math.inf if t is None else time.monotonic() + t


    def read(self, consumer: Callable[[memoryview, bool], T], *, timeout: Optional[float] = None) -> T:
        """Reader: wait for the next message and return ``consumer(view, owned)``.

        The wait for the message to START has no deadline: it lasts as long as the writer lives
        (an idle driver is not a dead one); a dead writer is ``PeerError``, a closed ring
        ``RingClosedError``, both within ``LIVENESS_SLICE_S``. Once the message's first slot is
        published, the rest must arrive within ``timeout`` (default: the ring's; None on the
        ring: no bound), else ``TimeoutError`` naming the writer.

        ``owned`` False: ``view`` points into shared memory, valid only during the call (it is
        released afterwards: copy what you keep). ``owned`` True: ``view`` is a private buffer
        (a message larger than the ring) that the consumer may keep."""
        i = self.reader_index
        if i is None:
            raise RuntimeError("ShmRing.read: this end is the writer")
        size, n = self.handle.slot_size, self.handle.num_slots
        tail = self._w.tails[i].value
        while True:
            head = self._wait_data(tail + 1, None)  # idle: bounded by the writer's life, not a clock
            pos = self._data_at + (tail % n) * size
            length, kind, pad = MSG_HEADER.unpack_from(self._buf, pos)
            if kind == KIND_PAD and 1 <= pad <= n:
                tail += pad
                self._release(tail)
                continue
            if kind != KIND_DATA:
                raise RuntimeError(f"ShmRing reader: corrupt message header at slot {tail}")
            break
        limit = self._max_bytes
        if length > limit:
            raise ValueError(f"ShmRing reader: message of {length} bytes exceeds "
                             f"CPMETA_MAX_MESSAGE_BYTES={limit}")
        k = cdiv(_HDR_LEN + length, size)
        if k > n:  # the message is in flight from here on: bounded by the timeout
            return consumer(self._stream_in(tail, length, k, self._deadline(timeout)), True)
        if head < tail + k:  # (a message of one slot is in whole already)
            self._wait_data(tail + k, self._deadline(timeout))
        view = self._buf[pos + _HDR_LEN:pos + _HDR_LEN + length]
        try:
            return consumer(view, False)
        finally:
            try:
                view.release()
            except BufferError:
                raise BufferError("ShmRing.read: the consumer kept a view of the shared slot "
                                  "(copy the data instead)") from None
            finally:
                self._release(tail + k)

    def read_bytes(self, *, timeout: Optional[float] = None) -> bytes:
        """Reader: the next message as ``bytes`` (a private copy)."""
        return self.read(lambda view, owned: bytes(view), timeout=timeout)

    def _stream_in(self, start: int, length: int, k: int, deadline: float) -> memoryview:
        size = self.handle.slot_size
        out = memoryview(bytearray(length))
        tail, done, total = start, _HDR_LEN, _HDR_LEN + length
        while done < total:
            head = self._wait_data(tail + 1, deadline)
            n = min(head - tail, k - (tail - start))
            end = min(total, (tail - start + n) * size)
            pos = self._ring_pos(start, done)
            first = min(end - done, self._ring_bytes - pos)
            at = self._data_at + pos
            out[done - _HDR_LEN:done - _HDR_LEN + first] = self._buf[at:at + first]
            rest = end - done - first
            if rest:
                out[done - _HDR_LEN + first:end - _HDR_LEN] = self._buf[self._data_at:self._data_at + rest]
            done, tail = end, tail + n
            self._release(tail)
        return out

    def _release(self, tail: int) -> None:
        i = self.reader_index
        assert i is not None  # only the read path (a reader end) gets here
        # the slots' reads, the tail store, a full fence (StoreLoad), the writer's flag: one call
        if ring_release(self._w.m32, self._w.m64, i, tail) or not HAVE_FENCE:
            futex_wake(self._tail_addrs[i])

    def _wait_data(self, target: int, deadline: Optional[float]) -> int:
        """Block until ``head >= target``; return head. ``deadline`` None: the wait for the next
        message, which only the writer's death or close ends (futex sleeps of
        ``LIVENESS_SLICE_S``: ~0 CPU while idle). After an ``announce`` the reader spins
        (yielding its core on an oversubscribed host) instead of parking, for a while. While it
        spins for the next message (after the last one, or an announce) it calls ``warm``, if
        set, every ``WARM_EVERY_S``."""
        w = self._w  # (no local ctypes words: a traceback would pin the mapping)
        h = w.head.value
        if h >= target:
            return self._acquired(h)
        if self._spin_s:
            h = self._spin(target, self._spin_s, deadline is None, False)
            if h >= target:
                return self._acquired(h)
        me = self.reader_index
        assert me is not None  # only the read path (a reader end) gets here
        while True:
            if w.announce.value != self._announce_seen:
                self._announce_seen = w.announce.value
                h = self._spin(target, ANNOUNCE_SPIN_S, deadline is None, True)
                if h >= target:
                    return self._acquired(h)
            w.waiting[me].value = 1
            fence()  # flag store before re-reading head (pairs with the writer's fence)
            h = w.head.value
            if h < target and not w.closed.value and w.announce.value == self._announce_seen:
                futex_wait(self._head_addr, h, min(LIVENESS_SLICE_S, self._left(deadline)))
                h = w.head.value
            w.waiting[me].value = 0
            if h >= target:
                return self._acquired(h)
            if w.announce.value == self._announce_seen:
                self._check_writer(target, deadline)

    def _spin(self, target: int, seconds: float, between: bool, announced: bool) -> int:
        """Spin on ``head`` for up to ``seconds``, or until the ring closes; return head. The
        spin after a message also ends at an ``announce`` (the caller then spins for it); an
        announced one yields the core on an oversubscribed host. With a ``warm`` hook, a core of
        its own and no message begun (``between``), the reader calls it every ``WARM_EVERY_S``
        (at once after an announce); a hook that returns an iterator is run piece by piece, and
        left as soon as the message is in; a hook that raises is dropped."""
        w, yield_core, seen = self._w, announced and self._yield_spin, self._announce_seen
        warm = self.warm if between and not self._yield_spin else None
        now = time.perf_counter()
        end, next_warm = now + seconds, now if announced else now + WARM_EVERY_S
        h = w.head.value
        while h < target and now < end and not w.closed.value and (announced or w.announce.value == seen):
            if yield_core or PENDING[0]:  # the core to another rank, or the GIL to a helper thread
                os.sched_yield()
            if warm is not None and now >= next_warm:  # (none while yielding the core)
                warm = self._run_warm(warm, target)
                next_warm = time.perf_counter() + WARM_EVERY_S
            h = w.head.value
            now = time.perf_counter()
        return h

    def _run_warm(self, warm: Callable[[], Any], target: int) -> Optional[Callable[[], Any]]:
        """Call the ``warm`` hook; when it returns an iterator, take its pieces one by one until
        it ends or the message ``target`` is in (a message that lands mid-warm waits one piece,
        not the whole hook: at world 8 the slowest of the followers' warms set the step's pace).
        A hook that raises is dropped (returns None)."""
        try:
            pieces = warm()
            if pieces is not None:
                for _ in pieces:
                    if self._w.head.value >= target:
                        break
            return warm
        except Exception:  # noqa: BLE001 - warming is never worth a failed read
            self.warm = None
            return None

    @staticmethod
    def _acquired(h: int) -> int:
        if NEEDS_RELEASE_FENCE:
            fence()  # head load before the payload loads
        return h

    def _check_writer(self, target: int, deadline: Optional[float]) -> None:
        who = f"writer rank {self.handle.writer_rank}"
        me = self._label(self.reader_index)
        if self._w.closed.value:
            if self._w.head.value >= target:  # published, then closed: read it first (the caller re-reads head)
                return
            gone = "; ".join(self._readers_gone().values())  # what the writer may have closed for
            raise RingClosedError(f"ShmRing reader {me}: {who} closed the ring"
                                  + (f" (gone before it: {gone})" if gone else ""))
        if self._watch[-1].dead():
            raise PeerError(f"ShmRing reader {me}: {who}, pid {self.handle.writer_pid}, died")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"ShmRing reader {me}: timed out waiting for {who} in the middle "
                               f"of a message (slot {target - 1} not yet published)")
