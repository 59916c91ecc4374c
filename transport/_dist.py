"""torch.distributed helpers of the transport package (CPU/gloo control traffic, no pickle)."""

from __future__ import annotations

import os
import socket
import struct
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import envs
from .codec import CodecError
from .coalesce import tensor_memoryview

__all__ = ["group_ranks", "gloo_group", "cpu_group", "peer_info", "bcast_frame", "REMOTE_INLINE_BYTES"]

HOST_KEY_BYTES = 256  # fixed width of a gathered host key
REMOTE_INLINE_BYTES = 8192  # first send of a remote message: length + this many bytes
MIN_WAIT_S = 1e-3  # shortest wait handed to a work handle
_LEN = struct.Struct("<Q")
_PID = struct.Struct("<Q")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def gloo_group(ranks: list[int], timeout_s: float) -> Any:
    """A new gloo group over global ``ranks`` whose collectives time out after ``timeout_s``.
    Only the members call it (local synchronization)."""
    return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                          use_local_synchronization=True)


def cpu_group(group: Any, timeout_s: float) -> Any:
    """``group`` itself when its backend moves CPU tensors (gloo), else a new gloo group over the
    same ranks (collective over ``group``'s members)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return group
    return gloo_group(group_ranks(group), timeout_s)


def _host_key() -> bytes:
    """Host identity: hostname + kernel boot id (two containers with one hostname still differ
    when they are different machines)."""
    try:
        with open(_BOOT_ID, "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return (socket.gethostname().encode("utf-8", "replace") + b"|" + boot)[:HOST_KEY_BYTES]


def peer_info(group: Any) -> list[tuple[bytes, int]]:
    """Collective over the gloo ``group``: every member's (host key, pid), in group-rank order.
    Sent as fixed-size byte tensors (nothing is unpickled)."""
    mine = torch.zeros(HOST_KEY_BYTES + _PID.size, dtype=torch.uint8)
    key = _host_key()
    view = tensor_memoryview(mine)
    view[:len(key)] = key
    _PID.pack_into(view, HOST_KEY_BYTES, os.getpid())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    info = []
    for t in out:
        raw = bytes(tensor_memoryview(t))
        info.append((raw[:HOST_KEY_BYTES].rstrip(b"\0"), _PID.unpack_from(raw, HOST_KEY_BYTES)[0]))
    return info


def bcast_frame(frame: Optional[torch.Tensor], src: int, group: Any,
                timeout_s: Optional[float] = None) -> torch.Tensor:
    """Broadcast a 1-D uint8 CPU tensor of any length from global rank ``src`` over the gloo
    ``group`` (every member calls; ``src`` passes ``frame``, the others None and get a fresh
    tensor). One collective for frames up to ``REMOTE_INLINE_BYTES``, two above.

    Every collective is waited for at most ``timeout_s`` (default ``CPMETA_TRANSPORT_TIMEOUT``),
    not the group's own timeout (30 min by default); a stall raises ``TimeoutError`` naming the
    ranks awaited: on a follower ``src`` (``rank 0 (src) ...``), on ``src`` its followers (gloo
    does not say which one lags). Example, group [0, 1, 2], src 0 asleep: ranks 1 and 2 raise
    ``... rank 0 (src) sent no message within 3 s`` after ``timeout_s``.
    """
    timeout_s = envs.transport_timeout() if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    if frame is not None:
        awaited = ", ".join(f"rank {r}" for r in group_ranks(group) if r != src)
        what = f"{awaited} (followers) did not take the message"
    else:
        what = f"rank {src} (src) sent no message"
    head = torch.empty(REMOTE_INLINE_BYTES + _LEN.size, dtype=torch.uint8)  # [data | length]
    if frame is not None:
        n = frame.numel()
        _LEN.pack_into(tensor_memoryview(head), REMOTE_INLINE_BYTES, n)
        head[:min(n, REMOTE_INLINE_BYTES)] = frame[:REMOTE_INLINE_BYTES]
    _bcast(head, src, group, deadline, timeout_s, what)
    if frame is not None:
        if frame.numel() > REMOTE_INLINE_BYTES:
            _bcast(frame[REMOTE_INLINE_BYTES:], src, group, deadline, timeout_s, what)
        return frame
    (n,) = _LEN.unpack_from(tensor_memoryview(head), REMOTE_INLINE_BYTES)
    if n > envs.max_message_bytes():
        raise CodecError(f"remote frame of {n} bytes exceeds CPMETA_MAX_MESSAGE_BYTES")
    if n <= REMOTE_INLINE_BYTES:
        return head[:n]  # storage offset 0: 16-byte aligned views stay aligned
    out = torch.empty(n, dtype=torch.uint8)
    out[:REMOTE_INLINE_BYTES] = head[:REMOTE_INLINE_BYTES]
    _bcast(out[REMOTE_INLINE_BYTES:], src, group, deadline, timeout_s, what)
    return out


def _bcast(t: torch.Tensor, src: int, group: Any, deadline: float, timeout_s: float,
           what: str) -> None:
    """``dist.broadcast`` waited for until ``deadline``: ``TimeoutError("process group: <what>
    within 3 s ...")`` when it does not complete; other failures (a peer's connection closed)
    propagate as the process group raised them (``RuntimeError``)."""
    work = dist.broadcast(t, src=src, group=group, async_op=True)
    try:
        work.wait(timedelta(seconds=max(MIN_WAIT_S, deadline - time.monotonic())))
    except RuntimeError as e:
        if time.monotonic() < deadline and "timed out" not in str(e).lower():
            raise  # not a timeout: a closed connection, a dead peer
        raise TimeoutError(f"process group: {what} within {timeout_s:g} s "
                           f"(CPMETA_TRANSPORT_TIMEOUT / timeout=)") from None
