"""The one place where cpmeta reads environment variables (transport has its own envs.py).

| variable | meaning | default |
|---|---|---|
| ``CPMETA_TENSOR_PATH`` | how ``MetadataBroadcaster`` moves tensors: ``auto``, ``packed`` (inside the object message) or ``collective`` (one coalesced NCCL/gloo broadcast) | ``auto`` |
| ``CPMETA_CHECKSUM`` | ``1``: the driver stamps a crc32 of every broadcast frame; followers verify it (a mismatch is a ``RuntimeError`` naming the rank). Costs a few us per step (docs/transport.md) | ``0`` |
| ``CPMETA_PACKED_MAX_BYTES`` | with ``auto`` and a CUDA device, CPU-built payloads up to this many bytes ride inside the object message and each rank copies them to its GPU with one H2D copy (larger ones: one NCCL broadcast) | ``1048576`` |

The 1 MiB default comes from ``scripts/bench_broadcast.py --backend nccl --worlds 1`` on an H200
(2026-11-29): packed 331 us vs collective 634 us for decode-64, 512 vs 1002 us for prompt-8k
(593 KB). Multi-GPU runs were not measured; tune it there.
"""

from __future__ import annotations

import os

__all__ = ["tensor_path", "packed_max_bytes", "checksum", "TENSOR_PATHS", "CHECKSUM"]

TENSOR_PATHS = ("auto", "packed", "collective")
DEFAULT_PACKED_MAX_BYTES = 1 << 20
CHECKSUM = "CPMETA_CHECKSUM"


def tensor_path() -> str:
    v = os.environ.get("CPMETA_TENSOR_PATH", "auto").strip().lower()
    if v not in TENSOR_PATHS:
        raise ValueError(f"CPMETA_TENSOR_PATH: expected one of {TENSOR_PATHS}, got {v!r}")
    return v


def packed_max_bytes() -> int:
    v = os.environ.get("CPMETA_PACKED_MAX_BYTES", str(DEFAULT_PACKED_MAX_BYTES))
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"CPMETA_PACKED_MAX_BYTES: expected an int, got {v!r}") from None
    if n < 0:
        raise ValueError(f"CPMETA_PACKED_MAX_BYTES: expected >= 0, got {n}")
    return n


def checksum() -> bool:
    """``CPMETA_CHECKSUM``: stamp (driver) a crc32 on every broadcast frame."""
    v = os.environ.get(CHECKSUM, "0").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{CHECKSUM}: expected 0/1/true/false, got {v!r}")
