"""The ring's words in compiled code: the writer's announce as ONE call, a message's claim and
publish for a compiled writer that fills its slot in between (:func:`ring_claim`,
:func:`ring_publish`), and a reader's release of the slots it read (:func:`ring_release`).

``ShmRing.announce`` (a driver's ``begin_step``) bumps the ``announce`` word, fences, and reads
every reader's ``waiting`` flag to learn whether one is parked (to wake). Through ctypes each of
those is a Python-level call; after an engine-like idle (caches cooled) the announce cost ~15 µs
on the 2-core VM where this kernel over a ``uint32`` view of the same words costs ~8.5 (hot: 1.1
against 0.5), on the step's critical path. It does exactly what ``_ring_io`` did word by word,
with the same full fence between the store and the loads (StoreLoad: the reader sets its flag,
fences, and re-reads ``announce`` before it parks). The futex wake itself stays in Python.

A compiled writer (the replicated step's frame: ``replicate/step_write_njit.send_step_frame``)
claims, writes and publishes a message inside its own call: ``ring_claim`` takes only the case
that needs no wait and no pad (no reader closed, the message fits before the ring's end, the
writer's tail floor proves the room), the Python path (``ShmRing.reserve``) every other;
``ring_publish`` -- the payload's stores, a release fence, the head, a full fence, then the
readers' waiting flags -- is every publish of the ring's (``commit``'s and a pad's too: 7.9 ->
5.6 µs after an idle on the VM against the ctypes words, 17.5 -> 9.1 with seven readers).
``ShmRing.direct`` hands the words, ``direct_published`` does what ``commit`` does after its
publish (the wake, the count, the liveness poll).

Word indexes are in uint32 units: ``m32[OFF_ANNOUNCE // 4]`` is the announce word,
``m32[(READERS_AT + READER_STRIDE * i + R_WAITING) // 4]`` reader ``i``'s flag. Worked example,
2 readers, reader 1 parked: ``ring_announce(m32, 48, 68, 16, 2)`` adds 1 to ``m32[48]`` (mod
2**32) and returns True (``m32[84] == 1``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba.core import types
from numba.core.extending import intrinsic

from ..jit import kernel, warmer
from ._ring_layout import (ABSENT, CLOSED, MSG_HEADER, OFF_HEAD, OFF_WRITER_WAITING, R_STATE, R_TAIL, R_WAITING,
                           READER_STRIDE, READERS_AT)

__all__ = ["ring_announce", "ring_claim", "ring_publish", "ring_release", "CLAIM_CLOSED", "CLAIM_SLOW"]

CLAIM_CLOSED, CLAIM_SLOW = -1, -2  # ring_claim: a reader closed its end; a wait or a pad is needed
_HDR = MSG_HEADER.size
# the head and reader 0's tail as uint64 indexes of the mapping; reader 0's state and waiting flag
# as uint32 indexes
_HEAD64, _TAIL64, _STRIDE64 = OFF_HEAD // 8, (READERS_AT + R_TAIL) // 8, READER_STRIDE // 8
_STATE32, _WAITING32, _STRIDE32 = (READERS_AT + R_STATE) // 4, (READERS_AT + R_WAITING) // 4, READER_STRIDE // 4
_WRITER_WAITING32 = OFF_WRITER_WAITING // 4


def _fence_of(order: str) -> Any:
    """An intrinsic for LLVM's ``fence <order>``: ``seq_cst`` a full barrier (x86: mfence),
    ``release`` earlier loads and stores before any later store (x86: no instruction); the
    compiler reorders nothing across either."""
    def fence(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            builder.fence(order)
            return context.get_dummy_value()
        return types.void(), codegen

    fence.__name__ = fence.__qualname__ = f"_fence_{order}"  # (one typing template each)
    return intrinsic(fence)


_fence_seq_cst, _fence_release = _fence_of("seq_cst"), _fence_of("release")


@kernel
def ring_announce(m32: np.ndarray, announce_at: int, waiting_at: int, stride: int, n: int) -> bool:
    """``m32[announce_at] += 1`` (mod 2**32), a full fence, then whether any of the ``n`` readers'
    flags (``m32[waiting_at + i * stride]``) is set."""
    m32[announce_at] = np.uint32((np.int64(m32[announce_at]) + 1) & 0xFFFFFFFF)
    _fence_seq_cst()
    return _any_set(m32, waiting_at, stride, n)


@kernel
def _any_set(m32: np.ndarray, at: int, stride: int, n: int) -> bool:
    """Whether any of the ``n`` flags ``m32[at + i * stride]`` is set (readers' waiting flags)."""
    for i in range(n):
        if m32[at + i * stride] != 0:
            return True
    return False


@kernel
def ring_claim(m32: np.ndarray, m64: np.ndarray, readers: int, num_slots: int, slot_size: int, data_at: int,
               length: int, floor: int) -> tuple[int, int]:
    """``(payload offset in the mapping, head after the message)`` of a message of ``length``
    bytes, its header (length, kind DATA, pad 0) written at its first slot -- or
    ``(CLAIM_CLOSED, 0)`` when a reader closed its end, ``(CLAIM_SLOW, 0)`` when the message
    would run past the ring's end (a pad first) or its slots are not all free (the slowest
    waited-for reader's tail, read when ``floor``, a lower bound of them, does not prove the
    room: a wait): nothing written then. ``m32``: the control block as uint32, ``m64``: the
    whole mapping as uint64, ``data_at``: the data's byte offset."""
    for i in range(readers):
        if m32[_STATE32 + i * _STRIDE32] == CLOSED:
            return CLAIM_CLOSED, 0
    head = np.int64(m64[_HEAD64])
    k = (_HDR + length + slot_size - 1) // slot_size
    first = head % num_slots
    if first + k > num_slots:
        return CLAIM_SLOW, 0
    if head + k - floor > num_slots:  # tails only grow: the slowest one now (ShmRing._slowest)
        floor = head
        for i in range(readers):
            if m32[_STATE32 + i * _STRIDE32] != ABSENT:
                floor = min(floor, np.int64(m64[_TAIL64 + i * _STRIDE64]))
        if head + k - floor > num_slots:
            return CLAIM_SLOW, 0
    at = (data_at + first * slot_size) // 8
    m64[at] = np.uint64(length)
    m64[at + 1] = np.uint64(0)  # kind DATA (0), pad 0
    return data_at + first * slot_size + _HDR, head + k


@kernel
def ring_publish(m32: np.ndarray, m64: np.ndarray, readers: int, head: int) -> bool:
    """Publish up to ``head``: the payload's stores first (release), the head, a full fence, then
    whether a reader's waiting flag is set (the caller wakes them: ``futex_wake`` on the head)."""
    _fence_release()
    m64[_HEAD64] = np.uint64(head)
    _fence_seq_cst()
    return _any_set(m32, _WAITING32, _STRIDE32, readers)


@kernel
def ring_release(m32: np.ndarray, m64: np.ndarray, reader: int, tail: int) -> bool:
    """Reader ``reader`` hands its slots back up to ``tail``: its reads of them first (release),
    its tail, a full fence, then whether the writer's waiting flag is set (the caller wakes it:
    ``futex_wake`` on the tail) -- ``RingReader._release``'s words in one call."""
    _fence_release()
    m64[_TAIL64 + reader * _STRIDE64] = np.uint64(tail)
    _fence_seq_cst()
    return m32[_WRITER_WAITING32] != 0


@warmer
def _warm() -> None:
    """The kernels once on a scratch mapping (2 readers, reader 1 parked; 4 slots of 64 bytes
    from byte 512), checked."""
    m32 = np.zeros(256, np.uint32)
    m32[48], m32[84] = 0xFFFFFFFF, 1
    assert ring_announce(m32, 48, 68, 16, 2) and m32[48] == 0
    m64 = m32.view(np.uint64)
    m64[_HEAD64] = 5  # at slot 1 a 200-byte message would run past the end: a pad first
    assert ring_claim(m32, m64, 2, 4, 64, 512, 200, 5) == (CLAIM_SLOW, 0)
    m64[_HEAD64] = 4  # at slot 0 it fits once every tail is 4: reader 1's is 3 (a wait), then 4
    m64[_TAIL64], m64[_TAIL64 + _STRIDE64] = 4, 3
    assert ring_claim(m32, m64, 2, 4, 64, 512, 200, 0) == (CLAIM_SLOW, 0)
    m64[_TAIL64 + _STRIDE64] = 4
    assert ring_claim(m32, m64, 2, 4, 64, 512, 200, 0) == (512 + 16, 8) and m64[64] == 200
    assert ring_publish(m32, m64, 2, 8) and m64[_HEAD64] == 8
    m32[_STATE32 + _STRIDE32] = CLOSED
    assert ring_claim(m32, m64, 2, 4, 64, 512, 8, 8) == (CLAIM_CLOSED, 0)
    assert not ring_release(m32, m64, 1, 7) and m64[_TAIL64 + _STRIDE64] == 7
    m32[_WRITER_WAITING32] = 1
    assert ring_release(m32, m64, 0, 9) and m64[_TAIL64] == 9
