"""The one place where cpmeta reads environment variables (transport has its own envs.py).

| variable | meaning | default |
|---|---|---|
| ``CPMETA_TENSOR_PATH`` | how ``MetadataBroadcaster`` moves tensors: ``auto``, ``packed`` (inside the object message) or ``collective`` (one coalesced NCCL/gloo broadcast) | ``auto`` |
| ``CPMETA_PACKED_MAX_BYTES`` | with ``auto`` and a CUDA device, payloads up to this many bytes ride inside the object message and are copied to the GPU on each rank | ``0`` |
"""

from __future__ import annotations

import os

__all__ = ["tensor_path", "packed_max_bytes", "TENSOR_PATHS"]

TENSOR_PATHS = ("auto", "packed", "collective")


def tensor_path() -> str:
    v = os.environ.get("CPMETA_TENSOR_PATH", "auto").strip().lower()
    if v not in TENSOR_PATHS:
        raise ValueError(f"CPMETA_TENSOR_PATH: expected one of {TENSOR_PATHS}, got {v!r}")
    return v


def packed_max_bytes() -> int:
    v = os.environ.get("CPMETA_PACKED_MAX_BYTES", "0")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"CPMETA_PACKED_MAX_BYTES: expected an int, got {v!r}") from None
    if n < 0:
        raise ValueError(f"CPMETA_PACKED_MAX_BYTES: expected >= 0, got {n}")
    return n
