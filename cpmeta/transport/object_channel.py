"""``ObjectChannel``: broadcast a Python object, or a caller's raw frame, from one rank to its group.

Same-host followers read the codec bytes from a :class:`ShmRing` (no collective per message);
followers on other hosts (or all, when forced) get them point-to-point over a gloo process group
(that path's send / receive and the error a failure on it raises: :mod:`._remote_path`). Tensors
travel inside a raw frame (:meth:`ObjectChannel.send_frame`), laid out by the frame's own rule
(``cpmeta.broadcast.wire``); the channel adds no format of its own for them.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist

from . import envs
from ._dist import (HEARTBEAT_SHARE, Heartbeat, cpu_group, fetch_reason, group_ranks, host_key, host_label,
                    store_of)
from ._remote_path import LINK_CLOSED, LinkWatch, RemotePath
from ._segment import PeerWatch
from ._setup import Member, Scalar, exchange
from .coalesce import tensor_memoryview
from .codec import decode, encode
from .errors import PeerError, RingClosedError
from .shm_ring import ShmRing, ring_from_process_group

__all__ = ["ObjectChannel"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ObjectChannel(RemotePath):
    """Broadcast objects from global rank ``src`` to every member of ``group``.

    Collective constructor: every member of ``group`` (default WORLD) calls it with the same
    ``src``. It gathers every member's host key (``CPMETA_HOST_ID``, else hostname + boot id),
    pid, ``src`` and ``agree`` settings through the rendezvous store, where every member checks
    them (:mod:`transport._setup`), then sets up a shared-memory ring for the followers on ``src``'s
    host; the others get every message point-to-point over the (gloo) control group, one send
    per follower (``transport._dist.bcast_frame``). Every setup wait ends within ``timeout``: a member
    that never constructs is a ``TimeoutError`` naming it, members that disagree on ``src`` or
    on an ``agree`` setting (``agree={"checksum": True}``) a ``ValueError`` naming the ranks on
    each side -- on every rank that took part. ``group`` may be NCCL (a gloo group over the
    same ranks is created for the control traffic) and ``src`` need not be rank 0.
    ``force_remote`` (default ``CPMETA_FORCE_REMOTE``) sends every follower's bytes over gloo.
    ``schema`` is stamped into / checked against every message header. ``timeout`` (default
    ``CPMETA_TRANSPORT_TIMEOUT``; None: no bound; anything but a finite number > 0 or None is a
    ``ValueError`` here) bounds the setup and a message in flight; a follower waits for the
    next message as long as ``src`` lives -- on the ring, ``src``'s pid; on the process group,
    ``src``'s heartbeats, sent after a quarter of the smallest follower timeout without a
    message (docs/transport.md, "Timeouts and idle").

    After a failure on the process-group path (a ``TimeoutError`` or ``PeerError`` from any
    call) the channel is spent: :attr:`failure` says why, and every later call raises
    ``PeerError`` at once -- close it and build a new one on a new process group (the old one
    may hold half-finished operations). Ring-only channels keep working after a timeout.

    Per-rank example (group [0, 1, 2] on one host, src 0)::

        ch = ObjectChannel(group, src=0)                  # ranks 0, 1, 2
        out = ch.broadcast({"a": 1} if rank == 0 else None)   # every rank gets {"a": 1}
    """

    def __init__(self, group: Any = None, src: int = 0, *, force_remote: Optional[bool] = None,
                 timeout: envs.Timeout = envs.ENV_TIMEOUT, schema: bytes = b"",
                 slot_size: Optional[int] = None, num_slots: Optional[int] = None,
                 agree: Optional[Mapping[str, Scalar]] = None) -> None:
        self.group = envs.resolve_group(group)
        self.src = src
        self.rank = dist.get_rank()
        self.ranks = group_ranks(self.group)
        if not envs.is_int(src) or src not in self.ranks or self.rank not in self.ranks:
            raise ValueError(f"src: global ranks {src} (src) and {self.rank} (caller) must both be "
                             f"in the group {self.ranks}")
        self.schema = schema
        self.timeout = envs.resolve_timeout(timeout)  # None: no bound
        wait_s = envs.wait_seconds(self.timeout)  # for the setup APIs that need a number
        self._max_bytes = envs.max_message_bytes()
        self.failure: Optional[str] = None  # why the process-group path stopped, if it did
        self._count = 0  # messages sent / received: named in errors
        key = host_key()
        self._me = f"ObjectChannel rank {self.rank} (host {host_label(key)})"
        self._watch: dict[int, PeerWatch] = {}  # same-host peers of the gloo path, for errors
        self._frame_buf: Optional[torch.Tensor] = None  # src: reused buffer of send_frame
        self._remote_group: Any = None
        self._heartbeat: Optional[Heartbeat] = None  # src of the process-group path
        self._link: Optional[LinkWatch] = None  # a far follower's watch on src (gone_peers)
        self.ring: Any = None
        self.hosts: dict[int, str] = {}  # global rank -> host label, for error messages
        self._reason_key = ""  # where src leaves why it stopped (transport._dist.post_reason)
        self.local_ranks: list[int] = []
        self.remote_ranks: list[int] = []
        envs.check_flags(force_remote=force_remote)
        settings = envs.agree_settings(agree)
        force = envs.force_remote() if force_remote is None else force_remote
        try:
            if store_of() is None:  # the exchange falls back to a gloo all_gather
                self.ctrl = cpu_group(self.group, wait_s)
                members = exchange(self.ctrl, src, settings, key, wait_s, self.timeout)
            else:  # first: it names a rank that never came, before any gloo group waits for it
                members = exchange(self.group, src, settings, key, wait_s, self.timeout)
                self.ctrl = cpu_group(self.group, wait_s)
            self._connect(members, key, force, slot_size, num_slots)
        except (TimeoutError, ValueError) as e:
            self.close()
            raise type(e)(f"{self._me}: setup: {e}") from None
        except RuntimeError as e:  # gloo: a peer's connection closed during the setup
            self.close()
            raise PeerError(f"{self._me}: setup: a peer failed: {e}") from e
        logger.debug("ObjectChannel src=%d: shm readers %s, remote %s", src, self.local_ranks,
                     self.remote_ranks)

    def _connect(self, members: list[Member], key: bytes, force: bool,
                 slot_size: Optional[int], num_slots: Optional[int]) -> None:
        """Ring for the same-host followers, point-to-point for the rest (after the exchange)."""
        src = self.src
        keys = {m.rank: m.host for m in members}
        seq = next(m.seq for m in members if m.rank == src)  # agreed by every member
        self._reason_key = f"cpmeta/reason/{getattr(self.group, 'group_name', '?')}/{seq}/{src}"
        self.hosts = {m.rank: host_label(m.host) for m in members}
        local = [] if force else [r for r in self.ranks if r != src and keys[r] == keys[src]]
        self.ring, attached = ring_from_process_group(
            self.ctrl, src, readers=local, slot_size=slot_size, num_slots=num_slots,
            timeout=self.timeout)
        self.remote_ranks = [r for r in self.ranks if r != src and r not in attached]
        self.local_ranks = attached
        if self.remote_ranks and (self.rank == src or self.rank in self.remote_ranks):
            # point-to-point over the control group: no subgroup to create (a local-sync
            # subgroup would also shift torch's names of later groups on its members only)
            self._remote_group = self.ctrl
            pids = {m.rank: m.pid for m in members}
            self._watch = {r: PeerWatch(pids[r]) for r in [src, *self.remote_ranks]
                           if r != self.rank and keys[r] == key}
            bounds = [m.timeout for m in members if m.rank in self.remote_ranks and m.timeout]
            if self.rank == src:  # followers with no bound get heartbeats only when poked (gone_peers)
                self._heartbeat = Heartbeat(self.ctrl, self.remote_ranks,
                                            HEARTBEAT_SHARE * min(bounds) if bounds else math.inf)

    @property
    def channel_key(self) -> str:
        """A store key prefix unique to this channel, the same on every member (``gather``)."""
        return self._reason_key.replace("/reason/", "/chan/", 1)

    def _check_usable(self) -> None:
        if self.failure is not None:
            raise PeerError(f"{self._me}: the channel failed earlier and is unusable ({self.failure}); "
                            "close it and build a new one on a new process group")

    # ------------------------------------------------------------------ objects

    def broadcast(self, obj: Any = None) -> Any:
        """Every member calls it; ``src`` passes ``obj`` (codec-encodable), the others None.
        Returns the object on every rank (``src`` gets ``obj`` itself)."""
        self._check_usable()
        if self.rank == self.src:
            data = encode(obj, schema=self.schema)
            if self.ring is not None:
                self.ring.write(data)
            if self._remote_group is not None:
                self._remote(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return obj
        if self.ring is not None:
            return self._read_ring(lambda view, owned: self._decode(view))
        frame = self._remote(None)
        return self._decode(tensor_memoryview(frame))

    def _read_ring(self, consumer: Callable[[memoryview, bool], T]) -> T:
        """``ring.read``; when the driver closed the ring after its process-group path failed,
        the error carries the reason it left (``transport._dist.post_reason``)."""
        try:
            return self.ring.read(consumer)
        except RingClosedError as e:
            reason = fetch_reason(self._reason_key, self.rank) if self.remote_ranks else None
            if reason is None:
                raise
            raise RingClosedError(f"{e}: it stopped the channel: {reason}") from None

    def _decode(self, view: memoryview) -> Any:
        return decode(view, schema=self.schema, max_bytes=self._max_bytes)

    # ------------------------------------------------------------------ raw frames

    @property
    def has_readers(self) -> bool:
        """Whether any other rank receives what ``src`` sends (False in a group of one: a
        caller may then skip building a frame nobody reads)."""
        return self.ring is not None or self._remote_group is not None

    @property
    def frames_out(self) -> int:
        """``src``: messages its same-host followers were handed whole (the ring's count; 0
        without a ring). A send that raises a peer's death may have published first (the ring
        polls liveness after each publish): compare this around the call to tell."""
        return self.ring.messages_out if self.ring is not None else 0

    def direct_ring(self) -> Optional[ShmRing]:
        """``src``: the ring a compiled writer fills and publishes a message in place
        (``ShmRing.direct``), when :meth:`send_frame` would write into it (only same-host
        followers); else None."""
        self._check_usable()
        return self.ring if self._remote_group is None else None

    def send_frame(self, nbytes: int, fill: Callable[[memoryview, int], None]) -> None:
        """``src`` only: one message of ``nbytes`` bytes that ``fill(view, address)`` writes.

        With only same-host followers and a message that fits the ring, ``fill`` writes straight
        into the ring slot (``reserve``/``commit``: no second copy); otherwise into a private
        buffer that goes to the ring and/or the process group. The frame is the caller's format
        (it carries its own header); the channel adds none.
        """
        self._check_usable()
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
        self._check_usable()
        if self.ring is not None:
            return self._read_ring(lambda view, owned: consumer(view))
        frame = self._remote(None)  # keep the tensor alive while its memoryview is read
        return consumer(tensor_memoryview(frame))

    def announce(self) -> None:
        """``src``: a frame follows soon; same-host followers parked in their receive call wake
        now and spin, so the frame does not pay their OS wake-up (see ``ShmRing.announce``)."""
        if self.ring is not None and self.rank == self.src:
            self.ring.announce()

    def gone_peers(self) -> dict[int, str]:
        """Members this rank can see are gone, by global rank, each named: through the ring (the
        driver its readers, a reader the driver), the same-host members of the process-group
        path (by pid), on the driver a follower on another host whose connection closed (each
        call pokes the heartbeats: a send to such a follower fails once gloo sees the link close)
        and on such a follower its driver's (:class:`~cpmeta.transport._remote_path.LinkWatch`,
        from the first call). A follower does not see another follower on another host
        (``start_gather`` passes on what another member saw)."""
        gone = {} if self.ring is None else self.ring.gone_peers()
        gone.update({r: f"{self.who(r)}, pid {w.pid}, died" for r, w in self._watch.items() if w.dead()})
        closed = self._src_link_closed()
        if closed is not None:
            gone.setdefault(self.src, f"{self.who(self.src)} {LINK_CLOSED}: {closed}")
        hb = self._heartbeat
        if hb is not None and self.failure is None:
            hb.poke()
            for r, why in sorted(hb.broken.items()):
                gone.setdefault(r, f"{self.who(r)} {LINK_CLOSED}: {why}")
        return gone

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release the shared-memory ring and stop the heartbeats (the process groups belong to
        torch.distributed)."""
        self._stop_heartbeat()
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
