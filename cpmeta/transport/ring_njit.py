"""The ring writer's announce as ONE compiled call over the control block's words.

``ShmRing.announce`` (a driver's ``begin_step``) bumps the ``announce`` word, fences, and reads
every reader's ``waiting`` flag to learn whether one is parked (to wake). Through ctypes each of
those is a Python-level call; after an engine-like idle (caches cooled) the announce cost ~15 µs
on the 2-core VM where this kernel over a ``uint32`` view of the same words costs ~8.5 (hot: 1.1
against 0.5), on the step's critical path. It does exactly what ``_ring_io`` did word by word,
with the same full fence between the store and the loads (StoreLoad: the reader sets its flag,
fences, and re-reads ``announce`` before it parks). The futex wake itself stays in Python.

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

__all__ = ["ring_announce"]


@intrinsic
def _fence_seq_cst(typingctx: Any) -> Any:
    """``fence seq_cst``: a full barrier (x86: mfence), and no compiler reordering across it."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@kernel
def ring_announce(m32: np.ndarray, announce_at: int, waiting_at: int, stride: int, n: int) -> bool:
    """``m32[announce_at] += 1`` (mod 2**32), a full fence, then whether any of the ``n`` readers'
    flags (``m32[waiting_at + i * stride]``) is set."""
    m32[announce_at] = np.uint32((np.int64(m32[announce_at]) + 1) & 0xFFFFFFFF)
    _fence_seq_cst()  # type: ignore[call-arg]  # (numba supplies the typing context)
    for i in range(n):
        if m32[waiting_at + i * stride] != 0:
            return True
    return False


@warmer
def _warm() -> None:
    """The kernel once on a scratch block (2 readers, reader 1 parked), checked."""
    m32 = np.zeros(128, np.uint32)
    m32[48], m32[84] = 0xFFFFFFFF, 1
    assert ring_announce(m32, 48, 68, 16, 2) and m32[48] == 0
