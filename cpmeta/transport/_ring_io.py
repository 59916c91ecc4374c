"""Writer half of ``ShmRing``'s data path (``write`` / ``reserve`` + ``commit`` / ``announce``,
streaming a message larger than the ring, waiting for the slowest reader, reader liveness),
and ``RingIO``: the writer half on top of the reader half (``cpmeta/transport/_ring_read.py``).

Mixins over the mapped words (layout and flag protocol drawn in ``cpmeta/transport/shm_ring.py``):
each declares the attributes it reads as class annotations, ``ShmRing.__init__`` sets them.
Annotations only: no run-time cost, and a type checker follows every access.
"""

from __future__ import annotations

import math
import operator
import select
import time
from typing import Any, Optional, Sequence, Union

import numpy as np

from ._futex import HAVE_FENCE, fence, futex_wait, futex_wake
from ._ring_layout import (ABSENT, ATTACHED, CLOSED, KIND_DATA, KIND_PAD, LIVENESS_SLICE_S, MSG_HEADER, OFF_ANNOUNCE,
                           R_WAITING, READER_STRIDE, READERS_AT, cdiv)
from ._ring_read import RingReader
from .errors import PeerError
from .ring_njit import ring_announce, ring_publish

__all__ = ["RingIO"]

Buffers = Union[bytes, bytearray, memoryview, Sequence[Any]]
_HDR_LEN = MSG_HEADER.size
_VALUE = operator.attrgetter("value")
# the announce word and reader 0's waiting flag as indexes of RingWords.m32 (ring_njit.ring_announce)
_ANNOUNCE32, _WAITING32, _STRIDE32 = OFF_ANNOUNCE // 4, (READERS_AT + R_WAITING) // 4, READER_STRIDE // 4


class _Cursor:
    """Walks a sequence of byte buffers as one stream: ``take(n)`` yields slices totalling n."""

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self.parts, self.i, self.off = parts, 0, 0

    def take(self, n: int) -> list[memoryview]:
        out = []
        while n > 0:
            p = self.parts[self.i]
            m = min(n, p.nbytes - self.off)
            out.append(p[self.off:self.off + m])
            self.off += m
            n -= m
            if self.off == p.nbytes:
                self.i, self.off = self.i + 1, 0
        return out


class RingIO(RingReader):
    """Mixin: the whole message protocol; the writer's side here, the reader's inherited.

    The writer state below is set by the concrete ring's ``__init__`` (``ShmRing``).
    """

    _base_addr: int  # address of the mapping, for memmove
    _pending: Optional[int]  # writer: head after the reserved message
    _tail_floor: int  # writer: a lower bound of every waited-for reader's tail (_wait_space)
    _stuck: Optional[tuple[int, int]]  # writer: (reader, tail) of the last wait that timed out
    _alive: Optional[tuple[tuple[int, ...], Any, list[int]]]  # writer: _alive_poll's last result
    #: writer: messages published whole. :meth:`commit` polls the readers' liveness AFTER its
    #: publish, so a ``PeerError`` may follow a message the live readers already have; a caller
    #: that numbers its messages compares this count around the call to know which happened.
    messages_out: int

    def write(self, data: Buffers, *, timeout: Optional[float] = None) -> None:
        """Writer: publish one message (bytes-like, or a sequence of bytes-like parts gathered in
        order). Blocks while the slowest reader holds the needed slots; ``TimeoutError`` names
        the lagging reader(s), ``PeerError`` a dead or closed one."""
        if self.reader_index is not None:
            raise RuntimeError("ShmRing.write: this end is a reader")
        raw = data if isinstance(data, (list, tuple)) else (data,)
        parts = [memoryview(p).cast("B") for p in raw]
        length = sum(p.nbytes for p in parts)
        if cdiv(_HDR_LEN + length, self.handle.slot_size) > self.handle.num_slots:
            deadline = self._deadline(timeout)
            self._check_open_readers()
            self._check_alive_readers()
            self._stream_out(parts, length, cdiv(_HDR_LEN + length, self.handle.slot_size),
                             self._w.head.value, deadline)
            self.messages_out += 1
            return
        view, _ = self.reserve(length, timeout=timeout)
        pos = 0
        for p in parts:
            view[pos:pos + p.nbytes] = p
            pos += p.nbytes
        view.release()
        self.commit()

    def fits(self, length: int) -> bool:
        """Whether a message of ``length`` bytes fits the ring in one piece (``reserve`` works)."""
        return cdiv(_HDR_LEN + length, self.handle.slot_size) <= self.handle.num_slots

    def reserve(self, length: int, *, timeout: Optional[float] = None) -> tuple[memoryview, int]:
        """Writer: wait for room and return ``(view, address)`` of the next message's ``length``
        payload bytes, in the ring itself, for the caller to fill in place; then :meth:`commit`.

        The caller releases ``view`` (or drops it) before :meth:`close`. Only for messages that
        :meth:`fits`; larger ones go through :meth:`write` (streamed). Example::

            view, addr = ring.reserve(len(data)); view[:] = data; view.release(); ring.commit()
        """
        if self.reader_index is not None:
            raise RuntimeError("ShmRing.reserve: this end is a reader")
        if self._pending is not None:
            raise RuntimeError("ShmRing.reserve: the previous reserve() was not committed")
        size, n = self.handle.slot_size, self.handle.num_slots
        k = -(-(_HDR_LEN + length) // size)  # slots of the message (cdiv, inlined)
        if k > n:
            raise ValueError(f"ShmRing.reserve: {length} bytes do not fit the ring; use write()")
        self._check_open_readers()
        head = self._w.head.value
        first = head % n
        if first + k > n:  # keep the message contiguous: pad to the end of the ring
            wait = self._deadline(timeout)  # one deadline for both waits
            self._wait_space(head, n - first, wait)
            MSG_HEADER.pack_into(self._buf, self._data_at + first * size, 0, KIND_PAD, n - first)
            head += n - first
            self._publish(head)
            first = 0
            self._wait_space(head, k, wait)
        elif head + k - self._tail_floor > n:  # tails only grow: the floor proves room
            self._wait_space(head, k, self._deadline(timeout))
        pos = self._data_at + first * size
        MSG_HEADER.pack_into(self._buf, pos, length, KIND_DATA, 0)
        pos += _HDR_LEN
        self._pending = head + k
        return self._buf[pos:pos + length], self._base_addr + pos

    def commit(self) -> None:
        """Writer: publish the message filled since :meth:`reserve`, wake parked readers, then
        poll the readers' liveness (after the publish: off the readers' critical path)."""
        head, self._pending = self._pending, None
        if head is None:
            raise RuntimeError("ShmRing.commit: nothing reserved")
        self._publish(head)
        self._published()

    def direct(self) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, int, int, int, int, int]]:
        """Writer: what a compiled writer claims, fills and publishes the next message with
        (``ring_njit.ring_claim`` / ``ring_publish``; then :meth:`direct_published`): ``(m32,
        m64, m8, readers, slots, slot size, data offset, tail floor)``; None while a
        :meth:`reserve` is pending. A claim it refuses goes through :meth:`reserve`."""
        if self.reader_index is not None or self._pending is not None:
            return None
        w = self._w
        return (w.m32, w.m64, w.m8, len(w.states), self.handle.num_slots, self.handle.slot_size, self._data_at,
                self._tail_floor)

    def direct_published(self, wake: bool) -> None:
        """Writer: a compiled writer published one message (``ring_publish`` returned ``wake``):
        what :meth:`commit` does after its publish -- wake parked readers, count the message,
        poll the readers' liveness."""
        if wake or not HAVE_FENCE:
            futex_wake(self._head_addr)
        self._published()

    def _published(self) -> None:
        """A message published whole: count it, then poll the readers' liveness (off their
        critical path: they hold the message already)."""
        self.messages_out += 1
        self._check_alive_readers()

    def cancel(self) -> None:
        """Writer: drop the message reserved by :meth:`reserve` (nothing is published)."""
        self._pending = None

    def announce(self) -> None:
        """Writer: a message is coming soon. Parked readers wake now and spin (for at most
        ``ANNOUNCE_SPIN_S``) so that the message meets a running reader; cheap when none waits."""
        if self.reader_index is not None:
            raise RuntimeError("ShmRing.announce: this end is a reader")
        # one compiled call: the word, the fence, the flags (~8 us after an idle, not ~15); readers
        # without libatomic fences cannot be trusted to have set their flag first: wake them always
        if ring_announce(self._w.m32, _ANNOUNCE32, _WAITING32, _STRIDE32, len(self._w.waiting)) or not HAVE_FENCE:
            futex_wake(self._head_addr)

    def _stream_out(self, parts: list[memoryview], length: int, k: int, head: int,
                    deadline: float) -> None:
        """Message larger than the ring: publish batches of slots as readers free them."""
        size = self.handle.slot_size
        cur = _Cursor([memoryview(MSG_HEADER.pack(length, KIND_DATA, 0)), *parts])
        start, total, done = head, _HDR_LEN + length, 0
        while done < total:
            free = self._wait_space(head, 1, deadline)
            n = min(free, k - (head - start))
            end = min(total, (head - start + n) * size)
            pos = self._ring_pos(start, done)
            for chunk in cur.take(end - done):
                pos = self._copy_in(pos, chunk)
            done, head = end, head + n
            self._publish(head)


    def _copy_in(self, pos: int, chunk: memoryview) -> int:
        first = min(chunk.nbytes, self._ring_bytes - pos)
        at = self._data_at + pos
        self._buf[at:at + first] = chunk[:first]
        if first < chunk.nbytes:
            self._buf[self._data_at:self._data_at + chunk.nbytes - first] = chunk[first:]
        return (pos + chunk.nbytes) % self._ring_bytes

    def _publish(self, head: int) -> None:
        # payload stores, the head store, a full fence (StoreLoad), the readers' waiting flags:
        # the compiled writer's publish (ring_njit.ring_publish), one call
        w = self._w
        if ring_publish(w.m32, w.m64, len(w.waiting), head) or not HAVE_FENCE:
            futex_wake(self._head_addr)

    def _wait_space(self, head: int, k: int, deadline: float) -> int:
        """Block until ``k`` slots after ``head`` are free; return the number of free slots.
        A reader that let a wait time out and has released no slot since is not waited for
        again: the next wait that needs it raises the same ``TimeoutError`` at once (so the
        frame a caller sends after a timed-out one -- the broadcaster's abort of that step --
        does not hold it a second timeout). Example: timeout 3 s, reader 1 asleep 5 s: the
        write raises at 3.0 s, a write right after it at once, a write after reader 1 read
        one slot waits again."""
        n = self.handle.num_slots
        while True:
            lag, tail = self._slowest()
            if lag is None or head + k - tail <= n:
                # every waited-for tail is >= this from now on (tails never decrease; a reader
                # only leaves the waited-for set), so reserve skips the scan while it proves room
                self._tail_floor = head if lag is None else tail
                return n if lag is None else n - (head - tail)
            if self._stuck == (lag, tail):  # it let a whole timeout pass and has not moved since
                self._check_readers(head, k, -math.inf)  # named at once, not a second timeout later
            # no local references to ctypes words: a traceback would pin the mapping
            self._w.writer_waiting.value = 1
            fence()  # flag store before re-reading the tail (pairs with the reader's fence)
            if self._w.tails[lag].value == tail:
                futex_wait(self._tail_addrs[lag], tail, min(LIVENESS_SLICE_S, self._left(deadline)))
            self._w.writer_waiting.value = 0
            if self._w.tails[lag].value == tail:
                try:
                    self._check_readers(head, k, deadline)
                except TimeoutError:
                    self._stuck = (lag, tail)
                    raise

    def backlog(self) -> int:
        """Writer, read-only: slots published that the slowest attached reader has not released
        yet (0: every reader caught up, or none attached); one pass over the readers' tail words,
        no wait, no write."""
        lag, tail = self._slowest()
        return 0 if lag is None else self._w.head.value - tail

    def _slowest(self) -> tuple[Optional[int], int]:
        best, best_tail = None, 0
        for i, (st, tw) in enumerate(zip(self._w.states, self._w.tails)):
            if st.value != ABSENT:
                t = tw.value
                if best is None or t < best_tail:
                    best, best_tail = i, t
        return best, best_tail

    def _check_open_readers(self) -> None:
        """Raise ``PeerError`` if a reader closed its end (its process may live on): checked
        before each message is written, so the message after the close is refused whole --
        no reader sees it -- instead of once the ring has filled ``num_slots`` messages later.
        One load per reader (``states``), no syscall."""
        states = list(map(_VALUE, self._w.states))
        if CLOSED in states:
            i = states.index(CLOSED)
            behind = self._w.head.value - self._w.tails[i].value
            raise PeerError(f"ShmRing writer: {self._label(i)} closed the ring "
                            f"{behind} slot(s) behind")

    def _check_alive_readers(self) -> None:
        """Raise ``PeerError`` if an attached reader's process has died.

        Checked after every publish, so a follower killed between steps is named at the driver's
        next broadcast instead of once the ring has filled up ``num_slots`` messages later. The
        readers' pidfds sit in ONE ``select.poll`` (rebuilt when the set of attached readers
        changes), so a step costs one syscall whatever the number of readers; a reader without
        a pidfd is checked on its own, and any hit is confirmed reader by reader.
        """
        states = tuple(map(_VALUE, self._w.states))
        alive = self._alive
        if alive is None or alive[0] != states:
            alive = self._alive = self._alive_poll(states)
        poll, rest = alive[1], alive[2]
        if (poll is not None and poll.poll(0)) or (
                rest and any(self._watch[i].dead() for i in rest)):
            for i in [i for i, st in enumerate(states) if st == ATTACHED]:
                watch = self._watch[i]
                if watch.dead():
                    behind = self._w.head.value - self._w.tails[i].value
                    raise PeerError(f"ShmRing writer: {self._label(i)}, pid {watch.pid}, died "
                                    f"{behind} slot(s) behind")

    def _alive_poll(self, states: tuple[int, ...]
                    ) -> tuple[tuple[int, ...], Optional[Any], list[int]]:
        """``(states, one poll object over the attached readers' pidfds or None, attached
        readers without one)``."""
        poll, rest = None, []
        for i in [i for i, st in enumerate(states) if st == ATTACHED]:
            watch = self._reader_watch(i)
            fd = watch.pollable
            if fd is None:
                rest.append(i)
                continue
            if poll is None:
                poll = select.poll()
            poll.register(fd, select.POLLIN)
        return states, poll, rest

    def _check_readers(self, head: int, k: int, deadline: float) -> None:
        n = self.handle.num_slots
        lagging = [i for i, (st, tw) in enumerate(zip(self._w.states, self._w.tails))
                   if st.value != ABSENT and head + k - tw.value > n]
        for i in lagging:
            behind = head - self._w.tails[i].value
            if self._w.states[i].value == CLOSED:
                raise PeerError(f"ShmRing writer: {self._label(i)} closed the ring "
                                f"{behind} slot(s) behind")
            if self._w.states[i].value == ATTACHED:
                watch = self._reader_watch(i)
                if watch.dead():
                    raise PeerError(f"ShmRing writer: {self._label(i)}, pid {watch.pid}, died "
                                    f"{behind} slot(s) behind")
        if time.monotonic() >= deadline:
            detail = "; ".join(
                f"{self._label(i)} is {head - self._w.tails[i].value} slot(s) behind"
                + (" (never attached)" if self._w.states[i].value not in (ATTACHED, CLOSED) else "")
                for i in lagging)
            raise TimeoutError(f"ShmRing writer: timed out waiting for {k} free slot(s) of "
                               f"{n}; lagging reader(s): {detail}")
