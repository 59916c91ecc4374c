"""Futex wait/wake and memory fences on shared-memory words, through ctypes.

- ``futex_wait`` goes through ``ctypes.CDLL``: a blocking call must release the GIL.
- ``futex_wake`` and ``fence`` go through ``ctypes.PyDLL``: they keep the GIL, because a call that
  releases it returns only after another busy thread of the process hands it back (up to the
  5 ms switch interval).
- ``fence`` is ``atomic_thread_fence(memory_order_seq_cst)`` from libatomic: a full barrier
  (StoreLoad included), needed for the "store my flag, then load the peer's word" handshakes.
  Without libatomic, ``HAVE_FENCE`` is False and callers must wake unconditionally.
- Off Linux (or on an unknown architecture) ``HAVE_FUTEX`` is False and ``futex_wait`` degrades
  to a short sleep (callers loop with a backoff), so the ring stays correct, only slower.
- :func:`ring_unsupported_reason` names the platforms the shared-memory ring refuses (callers
  then use the process group): a weakly ordered CPU (``NEEDS_RELEASE_FENCE``) without libatomic,
  whose ``fence`` would do nothing, and a big-endian CPU (``BIG_ENDIAN``), where the futex word
  at a 64-bit counter's address is the counter's HIGH half.

The words are 32-bit, naturally aligned, in a ``MAP_SHARED`` mapping (so the futexes are shared,
not ``FUTEX_PRIVATE_FLAG``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import sys
import time
from typing import Any, Callable, Optional

__all__ = ["HAVE_FUTEX", "HAVE_FENCE", "NEEDS_RELEASE_FENCE", "BIG_ENDIAN", "futex_wait",
           "futex_wake", "fence", "ring_unsupported_reason", "FALLBACK_SLEEP_S"]

logger = logging.getLogger(__name__)

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
              "ppc64le": 221, "s390x": 238}
FUTEX_WAIT = 0
FUTEX_WAKE = 1
WAKE_ALL = 0x7FFFFFFF
SEQ_CST = 5  # __ATOMIC_SEQ_CST
FALLBACK_SLEEP_S = 200e-6  # sleep of the portable (no futex) wait
# x86 (TSO) keeps store->store and load->load order; weaker architectures need release/acquire
# fences around the sequence words.
NEEDS_RELEASE_FENCE = platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386")
# The ring's futex words are the low 32 bits of u64 counters, addressed at the counter itself:
# right on little-endian only (on s390x the address holds the high half, which changes once per
# 2**32 slots, so a waiter would sleep through every publish until its timeout slice).
BIG_ENDIAN = sys.byteorder == "big"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_Syscall = Callable[..., Any]  # a ctypes foreign function


def _load_futex() -> tuple[int, Optional[_Syscall], Optional[_Syscall]]:
    """(syscall number, blocking CDLL syscall, GIL-holding PyDLL syscall) or (0, None, None)."""
    nr = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or nr is None:
        return 0, None, None
    try:
        wait_fn = ctypes.CDLL(None, use_errno=True).syscall
        wake_fn = ctypes.PyDLL(None, use_errno=True).syscall
    except (OSError, AttributeError) as e:  # pragma: no cover - exotic libc
        logger.warning("futex unavailable (%s); shared-memory waits fall back to sleeping", e)
        return 0, None, None
    for fn in (wait_fn, wake_fn):
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return nr, wait_fn, wake_fn


def _load_fence() -> Optional[_Syscall]:
    """libatomic's ``atomic_thread_fence`` through PyDLL, or None."""
    name = ctypes.util.find_library("atomic")
    for candidate in dict.fromkeys([name, "libatomic.so.1"]):
        if not candidate:
            continue
        try:
            fn = ctypes.PyDLL(candidate).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


_NR, _WAIT, _WAKE = _load_futex()
_FENCE = _load_fence()
HAVE_FUTEX = _WAIT is not None
HAVE_FENCE = _FENCE is not None


def ring_unsupported_reason() -> Optional[str]:
    """Why this platform cannot run the shared-memory ring correctly, or None when it can.

    Reads the module's facts at call time (tests patch them). Example: aarch64 with no
    loadable libatomic returns "aarch64 orders memory weakly and ..."; x86-64 returns None.
    """
    machine = platform.machine() or "this CPU"
    if BIG_ENDIAN:
        return (f"{machine} is big-endian: the ring's futex waits on the low half of 64-bit "
                f"counters, which is not the word at their address here (unsupported, untested)")
    if NEEDS_RELEASE_FENCE and not HAVE_FENCE:
        return (f"{machine} orders memory weakly and libatomic (atomic_thread_fence) cannot be "
                f"loaded, so the ring has no release/acquire fence (install libatomic1 to use it)")
    return None


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Block while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout_s``).

    Returns on a wake, a value change, a signal or the timeout; the caller re-checks its
    condition. Releases the GIL while blocked.
    """
    if _WAIT is None:
        time.sleep(min(timeout_s, FALLBACK_SLEEP_S))
        return
    secs = int(timeout_s)
    ts = _Timespec(secs, int((timeout_s - secs) * 1e9))
    _WAIT(_NR, addr, FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.addressof(ts), None, 0)


def futex_wake(addr: int, count: int = WAKE_ALL) -> None:
    """Wake up to ``count`` waiters blocked on the word at ``addr`` (keeps the GIL)."""
    if _WAKE is not None:
        _WAKE(_NR, addr, FUTEX_WAKE, count, None, None, 0)


def fence() -> None:
    """Full memory barrier (``atomic_thread_fence(seq_cst)``); a no-op without libatomic."""
    if _FENCE is not None:
        _FENCE(SEQ_CST)
