"""``TensorChannel``: broadcast a list of tensors as ONE coalesced buffer in ONE collective.

Buffer layout (uint8, on ``device``)::

    0       4       8              16                                          total
    +-------+-------+--------------+---------+---+---------+---+---------------+
    | crc32 | count | total (u64)  | tensor 0|pad| tensor 1|pad| ...           |
    | of the specs  |              | (dtype runs 16-aligned: coalesce.plan)    |
    +-------+-------+--------------+---------+---+---------+---+---------------+

The 16-byte header lets followers detect that the specs they passed differ from the source's
tensors (checked on CPU always, on CUDA only with ``verify=True`` since it needs a sync).
:meth:`TensorChannel.broadcast_buffer` moves a caller's buffer as it is, without the header (the
caller proved the layout: ``MetadataBroadcaster`` sends a frame's tensor region this way).
"""

from __future__ import annotations

import struct
import zlib
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import envs
from ._dist import group_ranks
from .coalesce import copy_into, plan, tensor_memoryview, views_of
from .codec import TensorDesc

__all__ = ["TensorChannel", "Spec"]

Spec = Union[TensorDesc, tuple]  # TensorDesc or (dtype, shape)
_HEADER = struct.Struct("<IIQ")


def _as_desc(i: int, s: Any) -> TensorDesc:
    if isinstance(s, TensorDesc):
        return s
    try:
        dtype, shape = s
        return TensorDesc(dtype, tuple(int(d) for d in shape))
    except (TypeError, ValueError) as e:
        raise TypeError(f"specs[{i}]: expected (dtype, shape) or TensorDesc, got {s!r}: {e}") from None


def _spec_crc(descs: Sequence[TensorDesc]) -> int:
    text = ";".join(f"{d.dtype}:{','.join(map(str, d.shape))}" for d in descs)
    return zlib.crc32(text.encode())


class TensorChannel:
    """Broadcast tensors from global rank ``src`` to every member of ``group``.

    Collective use: every member calls :meth:`broadcast` in the same order; ``src`` passes its
    tensors (any device, dtype, strides), the others the specs ``[(dtype, shape), ...]``.
    Everyone gets contiguous views of ONE fresh ``device`` buffer with the original dtypes and
    shapes. ``device`` defaults to the current CUDA device for an NCCL group, else CPU. CPU
    tensors bound for CUDA are staged through one reused pinned buffer and copied with one
    host-to-device copy. ``reuse_buffers=True`` also reuses the device buffer (the views returned
    by one call are then overwritten by the next). ``timeout`` (default
    ``CPMETA_TRANSPORT_TIMEOUT``; None: no bound; anything but a finite number > 0 or None is a
    ``ValueError`` at construction) bounds each broadcast on a non-NCCL group.

    Per-rank example (ranks 0 and 1, src 0)::

        ch = TensorChannel(group, src=0)
        out = ch.broadcast([a, b]) if rank == 0 else ch.broadcast([(a.dtype, a.shape), (b.dtype, b.shape)])
    """

    def __init__(self, group: Any = None, src: int = 0, device: Optional[Union[str, torch.device]] = None,
                 *, verify: Optional[bool] = None, reuse_buffers: bool = False,
                 timeout: envs.Timeout = envs.ENV_TIMEOUT) -> None:
        self.timeout = envs.resolve_timeout(timeout)  # first: a bad value is refused before any use
        envs.check_flags(verify=verify, reuse_buffers=reuse_buffers)
        self.group = envs.resolve_group(group)
        self.src = src
        self.rank = dist.get_rank()
        ranks = group_ranks(self.group)
        if not envs.is_int(src) or src not in ranks:
            raise ValueError(f"src: global rank {src} is not in the group {ranks}")
        self.ranks = ranks
        self.device = envs.resolve_device(device, self.group)
        self.verify = self.device.type == "cpu" if verify is None else verify
        self.reuse_buffers = reuse_buffers
        # gloo moves CUDA tensors on its own streams: sync around its broadcast
        self._sync_before_send = (self.device.type == "cuda"
                                  and "nccl" not in str(dist.get_backend(self.group)).lower())
        self._pinned: Optional[torch.Tensor] = None
        self._pinned_free: Optional[Any] = None  # CUDA event: last H2D copy out of _pinned done
        self._out: Optional[torch.Tensor] = None

    def broadcast(self, tensors_or_specs: Sequence[Any]) -> list[torch.Tensor]:
        """See the class docstring. Raises ``ValueError`` on a follower whose specs do not match
        the source's tensors (when verified)."""
        is_src = self.rank == self.src
        if is_src:
            tensors = list(tensors_or_specs)
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"tensors[{i}]: expected a tensor on the source, got {type(t).__name__}")
            descs = [TensorDesc.of(t) for t in tensors]
        else:
            descs = [_as_desc(i, s) for i, s in enumerate(tensors_or_specs)]
        if not descs:
            return []
        offsets, total = plan(descs, _HEADER.size)
        crc = _spec_crc(descs)
        buf = self._buffer(total)
        if is_src:
            self._fill(buf, tensors, offsets, _HEADER.pack(crc, len(descs), total))
        self.broadcast_buffer(buf)
        if not is_src and self.verify:
            self._check(buf, crc, len(descs), total)
        return views_of(buf, descs, offsets)

    def broadcast_buffer(self, buf: torch.Tensor) -> None:
        """Broadcast the bytes of ``buf`` in place: the source's are sent, every other rank's
        overwritten. ``buf`` is contiguous, on :attr:`device`, and the same size on every rank;
        nothing checks that here -- the caller has proven it (``MetadataBroadcaster`` sends its
        frame first, and both sides take the size from the frame's shapes). On NCCL the copy is
        ordered on the current stream; on gloo with CUDA tensors the source's stream is drained
        first and a receiver waits for the device after."""
        if self._sync_before_send and self.rank == self.src:
            torch.cuda.current_stream(self.device).synchronize()
        self._collective(buf)
        if self._sync_before_send and self.rank != self.src:
            torch.cuda.synchronize(self.device)  # gloo's CUDA receive is not stream-ordered here

    def _collective(self, buf: torch.Tensor) -> None:
        """The broadcast itself. NCCL: enqueued on the stream (its watchdog and the group's
        timeout apply). Other backends (gloo): waited for at most ``self.timeout``; a stall is a
        ``TimeoutError`` naming the ranks awaited (gloo does not say which one lags)."""
        if "nccl" in str(dist.get_backend(self.group)).lower():
            dist.broadcast(buf, src=self.src, group=self.group)
            return
        work = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
        try:
            work.wait(timedelta(seconds=envs.wait_seconds(self.timeout)))
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            awaited = ([r for r in self.ranks if r != self.src] if self.rank == self.src
                       else [self.src])
            raise TimeoutError(f"TensorChannel rank {self.rank} (src {self.src}): broadcast not "
                               f"completed within {self.timeout:g} s; awaited rank(s) {awaited} "
                               f"(CPMETA_TRANSPORT_TIMEOUT / timeout=)") from None

    def _buffer(self, total: int) -> torch.Tensor:
        if not self.reuse_buffers:
            return torch.empty(total, dtype=torch.uint8, device=self.device)
        if self._out is None or self._out.numel() < total:
            self._out = torch.empty(max(total, 2 * (0 if self._out is None else self._out.numel())),
                                    dtype=torch.uint8, device=self.device)
        return self._out[:total]

    def _fill(self, buf: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int],
              header: bytes) -> None:
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        if self.device.type == "cpu":
            buf[:len(header)] = head
            copy_into(buf, tensors, offsets)
            return
        on_host = [(t, o) for t, o in zip(tensors, offsets) if t.device.type == "cpu"]
        on_dev = [(t, o) for t, o in zip(tensors, offsets) if t.device.type != "cpu"]
        end = max([o + t.numel() * t.element_size() for t, o in on_host], default=len(header))
        staging = self._staging(end)
        staging[:len(header)] = head
        copy_into(staging, [t for t, _ in on_host], [o for _, o in on_host])
        buf[:end].copy_(staging[:end], non_blocking=True)  # ONE host-to-device copy
        self._pinned_free = torch.cuda.Event()
        self._pinned_free.record()
        copy_into(buf, [t.to(self.device) for t, _ in on_dev], [o for _, o in on_dev],
                  non_blocking=True)

    def _staging(self, n: int) -> torch.Tensor:
        """The reused pinned buffer (grown when needed), once the previous copy out of it ended."""
        if self._pinned_free is not None:
            self._pinned_free.synchronize()
        if self._pinned is None or self._pinned.numel() < n:
            size = max(n, 2 * (0 if self._pinned is None else self._pinned.numel()))
            self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._pinned[:n]

    def _check(self, buf: torch.Tensor, crc: int, count: int, total: int) -> None:
        head = buf[:_HEADER.size].cpu()  # keep the host copy alive while its bytes are read
        got = _HEADER.unpack(bytes(tensor_memoryview(head)))
        if got != (crc, count, total):
            raise ValueError(f"specs: rank {self.rank}'s specs ({count} tensors, {total} bytes) do "
                             f"not match the source rank {self.src}'s tensors ({got[1]} tensors, "
                             f"{got[2]} bytes)")
