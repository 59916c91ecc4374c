"""torch.distributed helpers of the transport package (CPU/gloo control traffic, no pickle).

Remote frames (:func:`bcast_frame`) travel point-to-point, from the source to each follower: the
head (the first ``REMOTE_INLINE_BYTES`` and a length word), then, for a larger frame, the rest::

    head (uint8, REMOTE_INLINE_BYTES + 8):  | frame[:8192] (or an abort reason) | length u64 |
    length == ABORT_LENGTH: the source gave up on the channel; the data is its reason (UTF-8)
    length == HEARTBEAT_LENGTH: no message, the source is alive and idle (:class:`Heartbeat`)

Why point-to-point: gloo completes a send only once the receiver has posted the matching receive
(its "ready" notice is the follower's acknowledgement word), so the source waits for each
follower on its own work handle and a stall is pinned on exactly the followers whose send did
not complete -- a broadcast can only say "one of them". Its cost, measured against the
broadcast it replaced, is in docs/reliability.md ("Process-group path").

After a stall the group is spent: gloo closes every connection of a group whose wait timed out
("Application timeout caused pair closure"), so the healthy followers see ``src`` close. ``src``
leaves its reason in torch.distributed's default store (:func:`post_reason`) and a follower
whose connection closed reads it (:func:`fetch_reason`); when no wait timed out (a follower
died) the group still works and ``src`` tells the others over it (:func:`send_abort`).

Idle is not death: a follower's wait for the next head is bounded by the timeout (a gloo wait
can be neither polled nor resumed after it times out, and across hosts only the clock tells an
idle source from a partitioned one), so an idle ``src`` keeps it alive with heartbeat heads
(:class:`Heartbeat`: one per follower after a quarter of its timeout without a message).
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from . import envs
from .codec import CodecError
from .coalesce import tensor_memoryview

__all__ = ["group_ranks", "gloo_group", "cpu_group", "host_key", "host_label", "wait_work", "bounded",
           "bcast_frame", "send_abort", "post_reason", "fetch_reason", "store_of", "RemoteFailure",
           "RemoteAbort", "Heartbeat", "REMOTE_INLINE_BYTES", "HOST_KEY_BYTES", "HEARTBEAT_SHARE",
           "first_line"]

HOST_KEY_BYTES = 256  # most bytes of a host key (the setup exchange carries it)
REMOTE_INLINE_BYTES = 8192  # head of a remote message: this many bytes + the length word
MIN_WAIT_S = 1e-3  # shortest wait handed to a work handle
HEAD_TAG = 0x43504D48  # point-to-point tag of remote heads ("CPMH")
ABORT_LENGTH = (1 << 64) - 1  # length word of an abort head
HEARTBEAT_LENGTH = (1 << 64) - 2  # length word of a heartbeat head (no message; src lives)
HEARTBEAT_SHARE = 0.25  # src idle this share of a follower's timeout: a heartbeat goes to it
ABORT_WAIT_S = 0.5  # how long the source waits for its abort notices to go out
_LEN = struct.Struct("<Q")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_ABANDONED: list[Any] = []  # (work, tensor) of waits given up: gloo may still write into them
_POST = threading.Lock()  # src posts a message's parts, an abort, a heartbeat: never interleaved


class RemoteFailure(Exception):
    """Source side of :func:`bcast_frame`: ``stalled`` (followers whose send did not complete
    by the deadline) and ``broken`` (follower -> the process group's error) name them exactly."""

    def __init__(self, stalled: list[int], broken: dict[int, str], timeout_s: float) -> None:
        self.stalled, self.broken, self.timeout_s = stalled, broken, timeout_s
        super().__init__(f"stalled {stalled}, broken {sorted(broken)}")


class RemoteAbort(Exception):
    """Follower side: the source sent an abort head; ``reason`` is its text."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    return list(dist.get_process_group_ranks(group))


def gloo_group(ranks: list[int], timeout_s: float) -> Any:
    """A new gloo group over global ``ranks`` whose collectives time out after ``timeout_s``.
    Only the members call it (local synchronization); creating it waits at most ``timeout_s``
    for the others (``TimeoutError`` naming the ranks otherwise)."""
    try:
        return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                              use_local_synchronization=True)
    except (RuntimeError, ValueError) as e:  # torch's DistStoreError is a RuntimeError
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise TimeoutError(f"creating a gloo group over ranks {ranks} did not complete within "
                           f"{timeout_s:g} s (a member did not take part): {e}") from None


def cpu_group(group: Any, timeout_s: float) -> Any:
    """``group`` itself when its backend moves CPU tensors (gloo), else a new gloo group over the
    same ranks (collective over ``group``'s members, bounded by ``timeout_s``)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return group
    return gloo_group(group_ranks(group), timeout_s)


def host_key() -> bytes:
    """This process's host identity: ``id:<CPMETA_HOST_ID>`` when set, else hostname + kernel
    boot id (two containers with one hostname still differ when they are different machines).
    Ranks with equal keys try the shared-memory ring."""
    explicit = envs.host_id()
    if explicit is not None:
        return b"id:" + explicit.encode("utf-8", "surrogateescape")
    try:
        with open(_BOOT_ID, "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return (socket.gethostname().encode("utf-8", "replace") + b"|" + boot)[:HOST_KEY_BYTES]


def host_label(key: bytes) -> str:
    """How error messages name the host of ``key``: the explicit id, else the hostname."""
    text = key.decode("utf-8", "replace")
    return text[3:] if text.startswith("id:") else text.split("|", 1)[0]


def _timed_out(e: BaseException, deadline: float) -> bool:
    return time.monotonic() >= deadline or "timed out" in str(e).lower()


def wait_work(work: Any, deadline: float, keep: Any = None) -> bool:
    """Wait for ``work`` until ``deadline`` (CLOCK_MONOTONIC): True when it completed, False when
    it timed out (``work`` and ``keep``, the tensor it reads or writes, are then kept alive for
    good: gloo may still touch it). Other failures (a closed connection) raise ``RuntimeError``."""
    try:
        work.wait(timedelta(seconds=max(MIN_WAIT_S, deadline - time.monotonic())))
        return True
    except RuntimeError as e:
        if not _timed_out(e, deadline):
            raise
        _ABANDONED.append((work, keep))
        return False


def _head(n: int, data: Optional[torch.Tensor] = None, text: bytes = b"") -> torch.Tensor:
    head = torch.empty(REMOTE_INLINE_BYTES + _LEN.size, dtype=torch.uint8)
    view = tensor_memoryview(head)
    _LEN.pack_into(view, REMOTE_INLINE_BYTES, n)
    if data is not None:
        head[:min(n, REMOTE_INLINE_BYTES)] = data[:REMOTE_INLINE_BYTES]
    if text:
        view[:len(text)] = text
    return head


def store_of() -> Any:
    """torch.distributed's default store (the rendezvous TCPStore every rank holds), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def bounded(fn: Any, wait_s: float) -> None:
    """Run ``fn()`` on a daemon thread for at most ``wait_s``: a store op on a cut-off host
    blocks for the store's own timeout, which must not hold up the caller."""
    t = threading.Thread(target=fn, name="cpmeta-store", daemon=True)
    t.start()
    t.join(wait_s)


def post_reason(key: str, reason: str, readers: Sequence[int] = (),
                wait_s: float = ABORT_WAIT_S) -> None:
    """``src``, after a failure that closed the process group (gloo closes every connection of
    a group whose wait timed out): leave ``reason`` under ``key`` in the default store, where
    :func:`fetch_reason` finds it, then wait until each of ``readers`` (global ranks) took it:
    the store usually lives in ``src``'s process, and a caller that exits right after the
    raise would take the reason with it before a follower on a loaded host asked. Best effort,
    at most ``wait_s`` in all; never raises."""
    store = store_of()
    if store is None:
        return
    deadline = time.monotonic() + wait_s

    def put() -> None:
        try:
            store.set(key, reason.encode("utf-8", "replace"))
            if readers:
                left = max(MIN_WAIT_S, deadline - time.monotonic())
                store.wait([_seen_key(key, r) for r in readers], timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - best effort: a reader that never asks costs wait_s
            pass

    bounded(put, wait_s)


def _seen_key(key: str, rank: int) -> str:
    return f"{key}/seen/{rank}"


def fetch_reason(key: str, rank: int, wait_s: float = ABORT_WAIT_S) -> Optional[str]:
    """A follower (global ``rank``) whose connection to ``src`` closed: ``src``'s reason under
    ``key`` if it arrives within ``wait_s`` (None otherwise: ``src`` died, or cannot reach the
    store); tells ``src`` it took it (:func:`post_reason` waits for that)."""
    store = store_of()
    if store is None:
        return None
    box: list[str] = []

    def get() -> None:
        try:
            store.wait([key], timedelta(seconds=wait_s))
            box.append(bytes(store.get(key)).decode("utf-8", "replace"))
            store.set(_seen_key(key, rank), b"1")
        except Exception:  # noqa: BLE001 - no reason: the caller says what it saw
            pass

    bounded(get, wait_s + 0.1)
    return box[0] if box else None


class Heartbeat:
    """``src`` of the process-group path: keeps idle followers' waits for the next head alive.

    One daemon thread per follower: when no message went out for ``period_s`` (``last``,
    which :func:`bcast_frame` sets when it posts one) and none since its own last heartbeat,
    it posts a heartbeat head (8 KiB + the length word ``HEARTBEAT_LENGTH``) and waits for the
    follower to take it -- at most one outstanding per follower, waited for with no deadline,
    so a follower busy elsewhere for an hour costs nothing and a wait never times out (a timed
    out gloo wait would close the group). A follower skips heartbeat heads, restarting its
    deadline. Per message: one clock read; idle: one 8 KiB send per follower per period.
    Example: followers' timeout 3 s, ``period_s`` 0.75: a driver with no requests for an hour
    sends each follower a heartbeat every 0.75 s; a driver SIGSTOPped or cut off sends none,
    and its followers raise ``TimeoutError`` 3 s after the last one they took.

    :meth:`poke` sends one now (to each follower that took its last; ``period_s`` inf: only
    then): a wait outside the channel (a replica check's verdict) asks who is gone; a follower
    whose connection gloo closed (its process died, its host reset the link) shows in :attr:`broken`.
    """

    def __init__(self, group: Any, followers: list[int], period_s: float) -> None:
        self.group, self.period_s = group, period_s
        self.last = time.monotonic()  # when the last message was posted to every follower
        self.broken: dict[int, str] = {}  #: follower -> gloo's error of a heartbeat to it
        self._stop = threading.Event()
        self._poked = -math.inf  # when poke() last asked for a heartbeat now
        self._wake = {r: threading.Event() for r in followers}
        self._head = _head(HEARTBEAT_LENGTH)
        for r in followers:
            threading.Thread(target=self._run, args=(r,), name=f"cpmeta-heartbeat-{r}",
                             daemon=True).start()

    def stop(self) -> None:
        """No more heartbeats (one a follower has not taken yet stays posted: it skips it)."""
        self._stop.set()
        for e in self._wake.values():
            e.set()

    def poke(self) -> None:
        """A heartbeat to every follower now, except one whose last is still untaken (its send
        fails by itself when the connection closes)."""
        self._poked = time.monotonic()
        for e in self._wake.values():
            e.set()

    def _run(self, dst: int) -> None:
        sent, wake = self.last, self._wake[dst]
        while True:
            due = max(self.last, sent) + self.period_s  # inf: only when poked
            wake.wait(None if due == math.inf else max(0.0, due - time.monotonic()))
            wake.clear()
            with _POST:
                now = time.monotonic()
                if self._stop.is_set():
                    return
                if self._poked <= sent and max(self.last, sent) + self.period_s > now:
                    continue  # a message went out meanwhile, and no poke since the last heartbeat
                try:
                    work = dist.isend(self._head, dst=dst, group=self.group, tag=HEAD_TAG)
                except RuntimeError as e:
                    self.broken[dst] = str(e)  # its connection is gone: the next message names it too
                    return
                sent = now
            try:
                if work is not None:  # None only for a rank outside the group: never here
                    work.wait(timedelta(seconds=envs.FOREVER_S))
            except RuntimeError as e:  # closed connection, or the group closed after a timeout elsewhere
                if not self._stop.is_set():
                    self.broken[dst] = str(e)
                return


def _send_all(parts: list[torch.Tensor], followers: list[int], group: Any, deadline: float,
              timeout_s: float, heartbeat: Optional[Heartbeat]) -> None:
    """Point-to-point sends of ``parts`` (in order) to every follower, each waited for until
    ``deadline``; :class:`RemoteFailure` naming every follower that did not take them all."""
    stalled: list[int] = []
    broken: dict[int, str] = {}
    works = []
    with _POST:
        for r in followers:  # a peer whose connection gloo already saw close fails at the isend
            try:
                works.append((r, [dist.isend(t, dst=r, group=group, tag=HEAD_TAG) for t in parts]))
            except RuntimeError as e:
                broken[r] = first_line(e)
        if heartbeat is not None:
            heartbeat.last = time.monotonic()
    for r, mine in works:
        try:
            if not all([wait_work(w, deadline, t) for w, t in zip(mine, parts)]):
                stalled.append(r)
        except RuntimeError as e:
            if stalled:  # gloo closed the group at the first timeout: this one was not done
                stalled.append(r)
            else:
                broken[r] = first_line(e)
    if stalled or broken:
        raise RemoteFailure(stalled, broken, timeout_s)


def first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _recv(t: torch.Tensor, src: int, group: Any, deadline: float, timeout_s: float,
          what: str) -> None:
    if not wait_work(dist.irecv(t, src=src, group=group, tag=HEAD_TAG), deadline, t):
        raise TimeoutError(f"process group: rank {src} (src) {what} within {timeout_s:g} s "
                           f"(CPMETA_TRANSPORT_TIMEOUT / timeout=)")


def bcast_frame(frame: Optional[torch.Tensor], src: int, group: Any,
                timeout_s: Optional[float] = None, *, margin_s: float = 0.0,
                followers: Optional[list[int]] = None,
                heartbeat: Optional[Heartbeat] = None) -> torch.Tensor:
    """Send a 1-D uint8 CPU tensor of any length from global rank ``src`` to ``followers``
    (global ranks of the gloo ``group``; default every member but ``src``), who call it too:
    ``src`` passes ``frame``, the followers None and get a fresh tensor. Point-to-point to each
    follower: the head (the first ``REMOTE_INLINE_BYTES`` and the length) then, for a larger
    frame, the rest; members of ``group`` that are not followers take no part.

    Every wait ends by ``timeout_s`` (default ``CPMETA_TRANSPORT_TIMEOUT``; ``src`` stops
    ``margin_s`` earlier, so that it names a stalled follower before the healthy ones give up
    on ``src``), never the group's own timeout (30 min by default). ``src`` raises
    :class:`RemoteFailure` naming the followers that did not take the frame; a follower raises
    ``TimeoutError("process group: rank 0 (src) sent no message or heartbeat within 3 s ...")``,
    or :class:`RemoteAbort` when ``src`` sent :func:`send_abort`'s notice instead; a heartbeat
    head restarts its wait (``src``'s :class:`Heartbeat`, whose ``last`` a send sets). Example,
    group [0, 1, 2], rank 2 frozen: rank 0 raises ``RemoteFailure(stalled=[2])`` after 3 s - margin.
    """
    timeout_s = envs.transport_timeout() if timeout_s is None else timeout_s
    start = time.monotonic()
    deadline = start + timeout_s
    if frame is not None:
        n = frame.numel()
        parts = [_head(n, frame)] + ([frame[REMOTE_INLINE_BYTES:]] if n > REMOTE_INLINE_BYTES else [])
        if followers is None:
            followers = [r for r in group_ranks(group) if r != src]
        _send_all(parts, followers, group, start + max(MIN_WAIT_S, timeout_s - margin_s), timeout_s,
                  heartbeat)
        return frame
    head = torch.empty(REMOTE_INLINE_BYTES + _LEN.size, dtype=torch.uint8)
    while True:
        _recv(head, src, group, deadline, timeout_s, "sent no message or heartbeat")
        (n,) = _LEN.unpack_from(tensor_memoryview(head), REMOTE_INLINE_BYTES)
        deadline = time.monotonic() + timeout_s  # the rest of a message, or the next head
        if n != HEARTBEAT_LENGTH:
            break
    if n == ABORT_LENGTH:
        raise RemoteAbort(bytes(tensor_memoryview(head)[:REMOTE_INLINE_BYTES]).rstrip(b"\0")
                          .decode("utf-8", "replace"))
    if n > envs.max_message_bytes():
        raise CodecError(f"remote frame of {n} bytes exceeds CPMETA_MAX_MESSAGE_BYTES")
    if n <= REMOTE_INLINE_BYTES:
        return head[:n]  # storage offset 0: 16-byte aligned views stay aligned
    out = torch.empty(n, dtype=torch.uint8)
    out[:REMOTE_INLINE_BYTES] = head[:REMOTE_INLINE_BYTES]
    _recv(out[REMOTE_INLINE_BYTES:], src, group, deadline, timeout_s,
          "did not send the rest of the message")
    return out


def send_abort(src: int, group: Any, ranks: list[int], reason: str,
               wait_s: float = ABORT_WAIT_S) -> None:
    """``src``, after a failure: tell ``ranks`` (followers waiting for a head) why the channel
    stopped; they raise :class:`RemoteAbort` with ``reason``. Best effort: waits at most
    ``wait_s`` in all and never raises (a follower that does not take it times out by itself)."""
    text = reason.encode("utf-8", "replace")[:REMOTE_INLINE_BYTES]
    head = _head(ABORT_LENGTH, text=text)
    deadline = time.monotonic() + wait_s
    for r in ranks:
        try:
            with _POST:
                work = dist.isend(head, dst=r, group=group, tag=HEAD_TAG)
            wait_work(work, deadline, head)
        except RuntimeError:
            pass  # that follower's connection is gone too: nothing to tell it
