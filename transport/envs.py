"""Environment variables of the transport package (the ONLY module here that reads ``os.environ``).

Every variable is read at call time (not import time), so tests can set it per process.

| variable | meaning | default |
|---|---|---|
| ``CPMETA_FORCE_REMOTE`` | ``1``: ObjectChannel sends every follower's bytes over the gloo group (no shared memory) | ``0`` |
| ``CPMETA_TRANSPORT_TIMEOUT`` | seconds any transport wait may block before ``TimeoutError`` | ``300`` |
| ``CPMETA_SHM_SLOT_SIZE`` | bytes per shared-memory ring slot | ``65536`` |
| ``CPMETA_SHM_NUM_SLOTS`` | slots per ring | ``64`` |
| ``CPMETA_SHM_SPIN_US`` | microseconds a reader spins before blocking in ``FUTEX_WAIT``; unset = automatic (spin only when every ring process can have its own core) | auto |
| ``CPMETA_MAX_MESSAGE_BYTES`` | largest message the codec decodes / a ring reader accepts | ``1073741824`` |
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = [
    "FORCE_REMOTE",
    "TRANSPORT_TIMEOUT",
    "SHM_SLOT_SIZE",
    "SHM_NUM_SLOTS",
    "SHM_SPIN_US",
    "MAX_MESSAGE_BYTES",
    "force_remote",
    "transport_timeout",
    "shm_slot_size",
    "shm_num_slots",
    "shm_spin_us",
    "max_message_bytes",
]

FORCE_REMOTE = "CPMETA_FORCE_REMOTE"
TRANSPORT_TIMEOUT = "CPMETA_TRANSPORT_TIMEOUT"
SHM_SLOT_SIZE = "CPMETA_SHM_SLOT_SIZE"
SHM_NUM_SLOTS = "CPMETA_SHM_NUM_SLOTS"
SHM_SPIN_US = "CPMETA_SHM_SPIN_US"
MAX_MESSAGE_BYTES = "CPMETA_MAX_MESSAGE_BYTES"

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SLOT_SIZE = 64 * 1024
DEFAULT_NUM_SLOTS = 64
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _get(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def _positive(name: str, default: float, kind: type = int) -> float:
    raw = _get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a positive {kind.__name__}, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: expected a positive {kind.__name__}, got {raw!r}")
    return value


def force_remote() -> bool:
    """``CPMETA_FORCE_REMOTE``: force the process-group path for every follower."""
    raw = (_get(FORCE_REMOTE) or "").lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{FORCE_REMOTE}: expected 0/1/true/false, got {raw!r}")


def transport_timeout() -> float:
    """``CPMETA_TRANSPORT_TIMEOUT`` in seconds (float > 0)."""
    return float(_positive(TRANSPORT_TIMEOUT, DEFAULT_TIMEOUT_S, float))


def shm_slot_size() -> int:
    """``CPMETA_SHM_SLOT_SIZE`` in bytes."""
    return int(_positive(SHM_SLOT_SIZE, DEFAULT_SLOT_SIZE))


def shm_num_slots() -> int:
    """``CPMETA_SHM_NUM_SLOTS``."""
    return int(_positive(SHM_NUM_SLOTS, DEFAULT_NUM_SLOTS))


def shm_spin_us() -> Optional[float]:
    """``CPMETA_SHM_SPIN_US``: None = automatic; 0 disables spinning."""
    raw = _get(SHM_SPIN_US)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{SHM_SPIN_US}: expected microseconds >= 0, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{SHM_SPIN_US}: expected microseconds >= 0, got {raw!r}")
    return value


def max_message_bytes() -> int:
    """``CPMETA_MAX_MESSAGE_BYTES``: decode / ring-read size limit."""
    return int(_positive(MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES))
