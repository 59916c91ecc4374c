"""Byte layout of the shared-memory ring (see ``shm_ring`` for the drawing): the constants,
:class:`RingWords` (the control words mapped at those offsets) and :class:`RingHandleFields`
(the handle fields that size and label a ring)."""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Protocol

import numpy as np

__all__ = ["MAGIC", "VERSION", "HDR", "MSG_HEADER", "cdiv", "data_offset", "EMPTY", "ATTACHED", "CLOSED",
           "ABSENT", "LIVENESS_SLICE_S", "DEFAULT_SPIN_US", "ANNOUNCE_SPIN_S", "WARM_EVERY_S", "OFF_ANNOUNCE",
           "RingWords", "RingHandleFields"]

MAGIC = b"CPMRING1"
VERSION = 2  # 2: announce word at OFF_ANNOUNCE
HDR = struct.Struct("<8sIIQQ16sII")  # magic, version, num_readers, slot_size, num_slots, nonce, pid, closed
OFF_CLOSED = struct.calcsize("<8sIIQQ16sI")
OFF_HEAD = 64  # u64: slots published (futex on its low 32 bits)
OFF_WRITER_WAITING = 128  # u32: writer blocked waiting for free slots
OFF_ANNOUNCE = 192  # u32: steps announced by the writer (``announce``): readers spin, not park
READERS_AT = 256  # first reader block
READER_STRIDE = 64  # bytes per reader block (one cache line)
R_TAIL, R_STATE, R_PID, R_WAITING = 0, 8, 12, 16  # offsets inside a reader block
PAGE = 4096
MSG_HEADER = struct.Struct("<QII")  # payload length, kind, pad slot count (kind PAD)
KIND_DATA, KIND_PAD = 0, 1
EMPTY, ATTACHED, CLOSED, ABSENT = 0, 1, 2, 3  # reader block states
LIVENESS_SLICE_S = 0.05  # longest single futex sleep; peers are checked between sleeps
#: Reader spin before blocking, only when every ring process has a core. 10 ms covers the
#: driver's scheduling gap between engine steps (a few ms), so the step's frame meets a running
#: reader instead of paying a FUTEX_WAKE + OS wake-up (issue 17: that was most of a step).
DEFAULT_SPIN_US = 10_000.0
MIN_SLOT_SIZE = 64
#: Longest a reader spins after an ``announce`` (the driver builds the step's metadata meanwhile);
#: past it the reader parks in FUTEX_WAIT again.
ANNOUNCE_SPIN_S = 0.02
#: While it spins for the next message, a reader with a ``warm`` hook calls it this often: the
#: step's own code and data, run ~100 us before the frame lands, cost ~2x their hot time where
#: after an idle gap they cost 5-8x (docs/benchmarks.md, "Warming the follower").
WARM_EVERY_S = 100e-6


def cdiv(a: int, b: int) -> int:
    """Ceiling division: ``cdiv(17, 16) == 2``."""
    return -(-a // b)


def data_offset(num_readers: int) -> int:
    """Byte offset of slot 0: after the reader blocks, page aligned (3 readers -> 4096)."""
    return cdiv(READERS_AT + READER_STRIDE * num_readers, PAGE) * PAGE


class RingHandleFields(Protocol):
    """The fields of ``ShmRingHandle`` the data path reads (read-only: the handle is frozen)."""

    @property
    def slot_size(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def writer_pid(self) -> int: ...
    @property
    def writer_rank(self) -> int: ...
    @property
    def reader_ranks(self) -> tuple[int, ...]: ...


class RingWords:
    """The ring's control words (ctypes views into the mapping). ``clear()`` drops them all, so
    the mapping has no exports left and can be closed even while the ring object lives on."""

    __slots__ = ("base", "head", "writer_waiting", "announce", "closed", "tails", "states", "pids",
                 "waiting", "m32", "m64", "m8")

    def __init__(self, mm: mmap.mmap, num_readers: int) -> None:
        blocks = [READERS_AT + READER_STRIDE * i for i in range(num_readers)]
        #: the control block as uint32 words, the whole mapping as uint64 words (its length is a
        #: multiple of 8: slot sizes are) and as bytes, for the writer's compiled calls (ring_njit)
        self.m32 = np.frombuffer(mm, np.uint32, data_offset(num_readers) // 4)
        self.m64 = np.frombuffer(mm, np.uint64)
        self.m8 = np.frombuffer(mm, np.uint8)
        u32, u64 = ctypes.c_uint32.from_buffer, ctypes.c_uint64.from_buffer
        self.base = ctypes.c_char.from_buffer(mm, 0)  # its address = the mapping's, for memmove
        self.head = u64(mm, OFF_HEAD)
        self.announce = u32(mm, OFF_ANNOUNCE)
        self.writer_waiting = u32(mm, OFF_WRITER_WAITING)
        self.closed = u32(mm, OFF_CLOSED)
        self.tails = [u64(mm, b + R_TAIL) for b in blocks]
        self.states = [u32(mm, b + R_STATE) for b in blocks]
        self.pids = [u32(mm, b + R_PID) for b in blocks]
        self.waiting = [u32(mm, b + R_WAITING) for b in blocks]

    def clear(self) -> None:
        for name in self.__slots__:
            delattr(self, name)
