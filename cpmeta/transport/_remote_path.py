"""The process-group (remote) path of :class:`~cpmeta.transport.object_channel.ObjectChannel`:
one frame over gloo, and the error a failure raises.

``ObjectChannel`` inherits :class:`RemotePath`; its constructor sets every attribute annotated
there. A failure on this path spends the channel (``failure``) and raises one error naming rank
and host: on ``src`` the followers that did not take the message -- stalled ones
(``TimeoutError``), dead or disconnected ones (``PeerError``; "died (pid N)" when a same-host
peer's process is gone) -- after telling the healthy ones why
(:func:`~cpmeta.transport._dist.post_reason`, :func:`~cpmeta.transport._dist.send_abort`); on a
follower ``src`` (with the reason ``src`` left, when it left one).

Worked example (src 0 on host a, remote followers 1 and 2 on host b, timeout 5 s; follower 2
stalls at message 3): ``src`` gives up ``min(SRC_MARGIN_S, SRC_MARGIN_SHARE * 5) = 0.25`` s
before the followers would (at 4.75 s) and raises ``TimeoutError("ObjectChannel rank 0 (host a):
process group: rank 2 (host b) did not take message 3 within 5 s (stalled, stopped or
unreachable)")``; rank 1, whose connection gloo then closes, raises ``PeerError("ObjectChannel
rank 1 (host b): rank 0 (src, host a) stopped the channel at message 3: <that text>")``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import envs
from ._dist import (ABORT_WAIT_S, Heartbeat, RemoteAbort, RemoteFailure, bcast_frame, fetch_reason,
                    first_line, post_reason, send_abort)
from ._segment import PeerWatch
from .errors import PeerError

__all__ = ["RemotePath", "LinkWatch", "LINK_CLOSED", "PROBE_TAG", "DEAD_PEER_GRACE_S", "SRC_MARGIN_S", "SRC_MARGIN_SHARE"]

DEAD_PEER_GRACE_S = 0.2  # after a gloo error, how long to look for the dead same-host peer
SRC_MARGIN_S = 0.25  # src gives up on a follower this much before the followers give up on src
SRC_MARGIN_SHARE = 0.1  # ... or this share of the timeout, when that is smaller
REASON_SLACK_S = 0.05  # src raises at least this long before its own timeout
REASON_MIN_WAIT_S = 0.02  # the shortest wait for the reason to be stored
LINK_CLOSED = "closed its connection (its process died, or its host reset the link)"
PROBE_TAG = 0x43504D50  # point-to-point tag of a follower's link probe ("CPMP"): never received


class LinkWatch:
    """A follower's watch on its gloo connection to ``src`` (a member on another host, whose
    process it cannot see): one 1-byte send to ``src``, on a tag ``src`` never receives, stays
    posted, its wait on a daemon thread; gloo fails it the moment the connection closes (``src``'s
    process died, or its host reset the link) and :attr:`closed` is then gloo's error, else None.
    For waits outside the channel (a replica check's verdict) that must not outlast a dead
    ``src`` when the rendezvous store lives on elsewhere (torchrun's agent). One thread, and one
    pending send ``src`` holds a tally of, for the channel's life."""

    def __init__(self, group: Any, src: int) -> None:
        self.closed: Optional[str] = None
        self._byte = torch.zeros(1, dtype=torch.uint8)
        threading.Thread(target=self._run, args=(group, src), name=f"cpmeta-link-{src}",
                         daemon=True).start()

    def _run(self, group: Any, src: int) -> None:
        try:
            work = dist.isend(self._byte, dst=src, group=group, tag=PROBE_TAG)
            if work is not None:
                work.wait(timedelta(seconds=envs.FOREVER_S))
        except RuntimeError as e:  # the connection closed (or the group failed elsewhere)
            self.closed = first_line(e)


class RemotePath:
    """The remote half of ``ObjectChannel`` (a mixin: the channel's constructor sets every
    attribute annotated here)."""

    src: int
    rank: int
    timeout: Optional[float]
    failure: Optional[str]  # why the process-group path stopped, if it did
    remote_ranks: list[int]
    hosts: dict[int, str]
    _count: int
    _me: str
    _watch: dict[int, PeerWatch]
    _remote_group: Any
    _heartbeat: Optional[Heartbeat]
    _link: Optional[LinkWatch]  # a follower's watch on src across hosts, from its first look
    _reason_key: str

    def who(self, rank: int) -> str:
        """``"rank 4 (host c)"`` (``src`` marked as such)."""
        role = "src, " if rank == self.src else ""
        return f"rank {rank} ({role}host {self.hosts.get(rank, '?')})"

    def _remote(self, frame: Optional[torch.Tensor]) -> torch.Tensor:
        """``bcast_frame`` over the gloo path, every wait bounded by ``self.timeout`` (None: not
        bounded; a follower's wait for the next head restarts at each of ``src``'s heartbeats:
        see "Timeouts and idle" in docs/transport.md). Any failure
        spends the channel (:attr:`failure`) and is raised naming rank and host: on ``src`` the
        followers that did not take the message (each one's send is its own work handle) --
        the others then get ``src``'s reason instead of waiting out their own timeout; on a
        follower ``src``."""
        self._count += 1
        wait_s = envs.wait_seconds(self.timeout)
        deadline = time.monotonic() + wait_s  # src raises by then, the reason's wait included
        try:
            return bcast_frame(frame, self.src, self._remote_group, wait_s,
                               margin_s=min(SRC_MARGIN_S, SRC_MARGIN_SHARE * wait_s),
                               followers=self.remote_ranks, heartbeat=self._heartbeat)
        except RemoteFailure as e:
            err: Exception = self._followers_failed(e, deadline)
        except RemoteAbort as e:
            err = PeerError(f"{self._me}: {self.who(self.src)} stopped the channel at message "
                            f"{self._count}: {e.reason}")
        except TimeoutError as e:
            err = TimeoutError(f"{self._me}: message {self._count}: {self._label_ranks(str(e))}")
        except RuntimeError as e:
            reason = fetch_reason(self._reason_key, self.rank) if self.rank != self.src else None
            err = (PeerError(f"{self._me}: {self.who(self.src)} stopped the channel at message "
                             f"{self._count}: {reason}") if reason else self._peer_failure(e))
        self.failure = str(err)
        self._stop_heartbeat()
        raise err

    def _src_link_closed(self) -> Optional[str]:
        """A follower of the process-group path whose ``src`` lives on another host: gloo's
        error once its connection to ``src`` closed, else None (the watch starts at the first
        call: :class:`LinkWatch`)."""
        if self.rank == self.src or self.rank not in self.remote_ranks or self.src in self._watch \
                or self.failure is not None:
            return None  # src itself, a ring reader, a same-host src (its pid is watched), spent
        if self._link is None:
            self._link = LinkWatch(self._remote_group, self.src)
        return self._link.closed

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def _followers_failed(self, e: RemoteFailure, deadline: float) -> Exception:
        """``src``: name the followers of ``e``, tell the healthy ones, return the error (by
        ``deadline``: the wait for the healthy ones to take the reason spends the margin src
        kept before the timeout, at most ``ABORT_WAIT_S``)."""
        parts = [f"{self.who(r)} did not take message {self._count} within {e.timeout_s:g} s "
                 "(stalled, stopped or unreachable)" for r in e.stalled]
        dead = self._dead_among(list(e.broken))
        for r, msg in sorted(e.broken.items()):
            how = f"died (pid {self._watch[r].pid})" if r in dead else LINK_CLOSED
            parts.append(f"{self.who(r)} {how}: {msg}")
        text = "; ".join(parts)
        # for followers that see the group close; the healthy remote ones take it before we
        # return (the store may die with this process)
        healthy = [r for r in self.remote_ranks if r not in e.broken and r not in e.stalled]
        left = min(ABORT_WAIT_S, deadline - time.monotonic() - REASON_SLACK_S)
        post_reason(self._reason_key, text, healthy if e.stalled else (), max(REASON_MIN_WAIT_S, left))
        if not e.stalled:  # no wait timed out: the group is still open, tell them over it
            send_abort(self.src, self._remote_group, healthy, text)
        cls = TimeoutError if not e.broken else PeerError
        return cls(f"{self._me}: process group: {text}")

    def _label_ranks(self, text: str) -> str:
        """``rank 0 (src)`` in a transport message -> ``rank 0 (src, host a)``."""
        return text.replace(f"rank {self.src} (src)", self.who(self.src))

    def _dead_among(self, ranks: list[int]) -> list[int]:
        """The same-host peers among ``ranks`` whose process is gone, looked for a moment (a
        peer's sockets close before the kernel reaps it)."""
        watched = [r for r in ranks if r in self._watch]
        deadline = time.monotonic() + DEAD_PEER_GRACE_S
        dead: list[int] = []
        while watched and not dead and time.monotonic() < deadline:
            dead = [r for r in watched if self._watch[r].dead()]
            if not dead:
                time.sleep(1e-3)
        return dead

    def _peer_failure(self, e: Exception) -> PeerError:
        dead = self._dead_among(list(self._watch))
        members = sorted([self.src, *self.remote_ranks])
        if dead:
            who = ", ".join(f"rank {r} (pid {self._watch[r].pid}) died" for r in dead)
        elif self.rank != self.src:
            who = f"{self.who(self.src)} closed its connection (died, or its host reset the link)"
        else:
            who = f"a peer among ranks {members} failed or is unreachable"
        return PeerError(f"{self._me} (src {self.src}): process-group broadcast failed at "
                         f"message {self._count}: {who}: {e}")
