"""``ObjectChannel``: broadcast a Python object (plus CPU tensors) from one rank to its group.

Same-host followers read the codec bytes from a :class:`ShmRing` (no collective per message);
followers on other hosts (or all, when forced) get them through a gloo process group.

Packed frame of :meth:`ObjectChannel.broadcast_packed` (one ring message)::

    0        8              8+H     align16                                     total
    +--------+--------------+-------+---------+---+---------+---+-----------------+
    | H (u64)| codec header | zeros | tensor 0|pad| tensor 1|pad| ...             |
    |        | [obj, descs] |       | (16-aligned offsets from coalesce.plan)      |
    +--------+--------------+-------+---------+---+---------+---+-----------------+
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from . import envs
from ._dist import bcast_frame, cpu_group, gloo_group, group_ranks, peer_info
from ._segment import PeerWatch
from .coalesce import copy_into, plan, tensor_memoryview, views_of
from .codec import CodecError, TensorDesc, decode, encode
from .errors import PeerError
from .shm_ring import ring_from_process_group

__all__ = ["ObjectChannel"]

T = TypeVar("T")

logger = logging.getLogger(__name__)
_LEN = struct.Struct("<Q")
_ZEROS = bytes(16)
DEAD_PEER_GRACE_S = 0.2  # after a gloo error, how long to look for the dead same-host peer


class ObjectChannel:
    """Broadcast objects from global rank ``src`` to every member of ``group``.

    Collective constructor: every member of ``group`` (default WORLD) calls it with the same
    ``src``. It gathers host keys (hostname + boot id, as byte tensors), sets up a shared-memory
    ring for the followers on ``src``'s host and a gloo group for the others. ``group`` may be
    NCCL (a gloo group over the same ranks is created for the control traffic) and ``src`` need
    not be rank 0. ``force_remote`` (default ``CPMETA_FORCE_REMOTE``) sends every follower's
    bytes over gloo. ``schema`` is stamped into / checked against every message header.

    Per-rank example (group [0, 1, 2] on one host, src 0)::

        ch = ObjectChannel(group, src=0)                  # ranks 0, 1, 2
        out = ch.broadcast({"a": 1} if rank == 0 else None)   # every rank gets {"a": 1}
    """

    def __init__(self, group: Any = None, src: int = 0, *, force_remote: Optional[bool] = None,
                 timeout: Optional[float] = None, schema: bytes = b"",
                 slot_size: Optional[int] = None, num_slots: Optional[int] = None) -> None:
        self.group = dist.group.WORLD if group is None else group
        self.src = src
        self.rank = dist.get_rank()
        self.ranks = group_ranks(self.group)
        if src not in self.ranks or self.rank not in self.ranks:
            raise ValueError(f"src: global ranks {src} (src) and {self.rank} (caller) must both be "
                             f"in the group {self.ranks}")
        self.schema = schema
        self.timeout = envs.transport_timeout() if timeout is None else float(timeout)
        self._max_bytes = envs.max_message_bytes()
        self.ctrl = cpu_group(self.group, self.timeout)
        force = envs.force_remote() if force_remote is None else bool(force_remote)
        info = peer_info(self.ctrl)
        keys = [k for k, _ in info]
        src_key = keys[self.ranks.index(src)]
        local = [] if force else [r for r, k in zip(self.ranks, keys) if r != src and k == src_key]
        self.ring, attached = ring_from_process_group(
            self.ctrl, src, readers=local, slot_size=slot_size, num_slots=num_slots,
            timeout=self.timeout)
        self.remote_ranks = [r for r in self.ranks if r != src and r not in attached]
        self.local_ranks = attached
        self._remote_group = None
        self._watch: dict[int, PeerWatch] = {}  # same-host peers of the gloo path, for errors
        self._frame_buf: Optional[torch.Tensor] = None  # src: reused buffer of send_frame
        if self.remote_ranks and (self.rank == src or self.rank in self.remote_ranks):
            members = sorted([src, *self.remote_ranks])
            self._remote_group = (self.ctrl if len(members) == len(self.ranks)
                                  else gloo_group(members, self.timeout))
            me = keys[self.ranks.index(self.rank)]
            self._watch = {r: PeerWatch(info[self.ranks.index(r)][1]) for r in members
                           if r != self.rank and keys[self.ranks.index(r)] == me}
        logger.debug("ObjectChannel src=%d: shm readers %s, remote %s", src, attached, self.remote_ranks)

    # ------------------------------------------------------------------ objects

    def broadcast(self, obj: Any = None) -> Any:
        """Every member calls it; ``src`` passes ``obj`` (codec-encodable), the others None.
        Returns the object on every rank (``src`` gets ``obj`` itself)."""
        if self.rank == self.src:
            data = encode(obj, schema=self.schema)
            if self.ring is not None:
                self.ring.write(data)
            if self._remote_group is not None:
                self._remote(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return obj
        if self.ring is not None:
            return self.ring.read(lambda view, owned: self._decode(view))
        frame = self._remote(None)
        return self._decode(tensor_memoryview(frame))

    def _remote(self, frame: Optional[torch.Tensor]) -> torch.Tensor:
        """``bcast_frame`` over the gloo path, every wait bounded by ``self.timeout``; a failure
        becomes a PeerError naming the rank (gloo itself only names a socket address), a stall
        a TimeoutError naming the rank(s) awaited."""
        try:
            return bcast_frame(frame, self.src, self._remote_group, self.timeout)
        except TimeoutError as e:
            raise TimeoutError(f"ObjectChannel rank {self.rank} (src {self.src}): {e}") from None
        except RuntimeError as e:
            raise self._peer_failure(e) from e

    def _peer_failure(self, e: Exception) -> PeerError:
        deadline = time.monotonic() + DEAD_PEER_GRACE_S  # a peer's sockets close before it is reaped
        dead: list[int] = []
        while not dead and time.monotonic() < deadline:
            dead = [r for r, w in self._watch.items() if w.dead()]
            if not dead:
                time.sleep(1e-3)
        members = sorted([self.src, *self.remote_ranks])
        who = (", ".join(f"rank {r} (pid {self._watch[r].pid}) died" for r in dead) if dead else
               f"a peer among ranks {members} failed or is unreachable")
        return PeerError(f"ObjectChannel rank {self.rank} (src {self.src}): process-group "
                         f"broadcast failed: {who}: {e}")

    def _decode(self, view: memoryview) -> Any:
        return decode(view, schema=self.schema, max_bytes=self._max_bytes)

    # ------------------------------------------------------------------ object + tensors

    def broadcast_packed(self, obj: Any = None, tensors: Optional[Sequence[torch.Tensor]] = None
                         ) -> tuple[Any, list[torch.Tensor]]:
        """Like :meth:`broadcast`, with CPU ``tensors`` riding in the same message.

        ``src`` passes ``(obj, tensors)``; the others pass nothing. Followers get tensors with
        the original dtypes and shapes (contiguous), all views of ONE private uint8 buffer
        (never of shared memory); ``src`` gets its own ``obj`` and ``tensors`` back.
        Same-host followers: one ring message, no collective.
        """
        if self.rank == self.src:
            tensors = list(tensors or [])
            self._send_packed(obj, tensors)
            return obj, tensors
        if self.ring is not None:
            return self.ring.read(self._unpack)
        frame = self._remote(None)
        return self._unpack(tensor_memoryview(frame), True, frame)

    def _send_packed(self, obj: Any, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise TypeError(f"tensors[{i}]: expected a CPU tensor, got "
                                f"{getattr(t, 'device', type(t).__name__)}")
        descs = [TensorDesc.of(t) for t in tensors]
        header = encode([obj, descs], schema=self.schema)
        offsets, total = plan(descs, _LEN.size + len(header))
        dense = [t.contiguous() for t in tensors]
        if self.ring is not None:
            parts: list[Any] = [_LEN.pack(len(header)), header]
            pos = _LEN.size + len(header)
            for t, off in zip(dense, offsets):
                parts += [_ZEROS[:off - pos], tensor_memoryview(t)]
                pos = off + t.numel() * t.element_size()
            parts.append(_ZEROS[:total - pos])
            self.ring.write(parts)
        if self._remote_group is not None:
            frame = torch.zeros(total, dtype=torch.uint8)
            head = _LEN.pack(len(header)) + header
            frame[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
            copy_into(frame, dense, offsets)
            self._remote(frame)

    def _unpack(self, view: memoryview, owned: bool, base: Optional[torch.Tensor] = None
                ) -> tuple[Any, list[torch.Tensor]]:
        if view.nbytes < _LEN.size:
            raise CodecError("packed frame: truncated length prefix")
        (hlen,) = _LEN.unpack_from(view, 0)
        if _LEN.size + hlen > view.nbytes:
            raise CodecError("packed frame: header runs past the frame")
        msg = self._decode(view[_LEN.size:_LEN.size + hlen])
        if (type(msg) is not list or len(msg) != 2 or type(msg[1]) is not list
                or not all(type(d) is TensorDesc for d in msg[1])):
            raise CodecError("packed frame: expected [obj, [TensorDesc, ...]]")
        obj, descs = msg
        offsets, total = plan(descs, _LEN.size + hlen)
        if total > view.nbytes:
            raise CodecError(f"packed frame: tensors need {total} bytes, frame has {view.nbytes}")
        start = offsets[0] if descs else total
        if base is None and owned and total > start:
            base = torch.frombuffer(view, dtype=torch.uint8)  # private buffer: keep, no copy
        if base is None:
            data = torch.empty(total - start, dtype=torch.uint8)
            if total > start:
                shm = torch.frombuffer(view[start:total], dtype=torch.uint8)
                data.copy_(shm)
                del shm  # drop the export of the shared slot before the ring releases it
            return obj, views_of(data, descs, [o - start for o in offsets])
        return obj, views_of(base, descs, offsets)

    # ------------------------------------------------------------------ raw frames

    @property
    def has_readers(self) -> bool:
        """Whether any other rank receives what ``src`` sends (False in a group of one: a
        caller may then skip building a frame nobody reads)."""
        return self.ring is not None or self._remote_group is not None

    def send_frame(self, nbytes: int, fill: Callable[[memoryview, int], None]) -> None:
        """``src`` only: one message of ``nbytes`` bytes that ``fill(view, address)`` writes.

        With only same-host followers and a message that fits the ring, ``fill`` writes straight
        into the ring slot (``reserve``/``commit``: no second copy); otherwise into a private
        buffer that goes to the ring and/or the process group. The frame is the caller's format
        (it carries its own header); the channel adds none.
        """
        ring = self.ring
        if ring is not None and self._remote_group is None and ring.fits(nbytes):
            view, addr = ring.reserve(nbytes)
            try:
                fill(view, addr)
            except BaseException:
                view.release()
                ring.cancel()
                raise
            view.release()
            ring.commit()
            return
        buf = self._frame_buf
        if buf is None or buf.numel() < nbytes:
            buf = self._frame_buf = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
        frame = buf[:nbytes]
        fill(tensor_memoryview(frame), frame.data_ptr())
        if ring is not None:
            ring.write(tensor_memoryview(frame))
        if self._remote_group is not None:
            self._remote(frame)

    def recv_frame(self, consumer: Callable[[memoryview], T]) -> T:
        """Followers: ``consumer(view)`` of the next frame; ``view`` is valid only during the
        call (shared memory or a transient buffer: copy what you keep)."""
        if self.ring is not None:
            return self.ring.read(lambda view, owned: consumer(view))
        frame = self._remote(None)  # keep the tensor alive while its memoryview is read
        return consumer(tensor_memoryview(frame))

    def announce(self) -> None:
        """``src``: a frame follows soon; same-host followers parked in their receive call wake
        now and spin, so the frame does not pay their OS wake-up (see ``ShmRing.announce``)."""
        if self.ring is not None and self.rank == self.src:
            self.ring.announce()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release the shared-memory ring (the process groups belong to torch.distributed)."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for w in self._watch.values():
            w.close()
        self._watch = {}

    def __enter__(self) -> "ObjectChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
