"""The setup exchange of ``ObjectChannel``: who is in the group, where, and do they agree.

Collective over a gloo group; every wait ends within the caller's timeout (the process group's
own timeout, 30 min by default for gloo, never decides). Point-to-point with the group's
LEADER (its first rank), so that whoever is missing is named::

    member r != leader:  isend(record_r) ----------> leader: irecv from every member
                                                     (waits until 0.8 x timeout), checks
                         irecv(table)   <----------  isend(table) to every member that came
    table = every record, or the error: "rank 3 did not join ...", "src differs: ..."

A record is strict codec bytes (no pickle) in a fixed 2 KiB buffer: host key, pid, the ``src``
this rank passed, how many channels it set up on this group before (``seq``: a rank that skipped
or repeated a construction would pair the wrong channels) and the settings the caller asks to
cross-check (``agree``, e.g. ``{"checksum": True}``). Every rank that gets the table raises the
same error: ``ValueError`` for a disagreement, ``TimeoutError`` for a rank that did not come.

Example, group [0, 1, 2], rank 2 passes ``src=1``: all three raise ``ValueError("src differs
across the group: src=0 at ranks [0, 1], src=1 at ranks [2] ...")``; rank 2 never constructs:
ranks 0 and 1 raise ``TimeoutError("rank 2 did not join the setup within 4 s ...")``.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ._dist import MIN_WAIT_S, group_ranks, wait_work
from .codec import CodecError, decode_body, encode_body
from .coalesce import tensor_memoryview

__all__ = ["Member", "exchange", "Scalar"]

SETUP_TAG = 0x43504D53  # point-to-point tag of the setup exchange ("CPMS")
RECORD_BYTES = 2048  # one member's record buffer
TABLE_EXTRA_BYTES = 8192  # the table's room for an error text
LEADER_SHARE = 0.8  # the leader collects for this share of the timeout, then answers
_LEN = struct.Struct("<I")
Scalar = Union[None, bool, int, float, str]
_seq: dict[str, int] = {}  # group name -> channels set up on it by this process


@dataclass(frozen=True)
class Member:
    """One rank as the setup exchange saw it."""

    rank: int  # global rank
    host: bytes  # host key (``_dist.host_key``)
    pid: int
    src: int  # the src this rank passed
    seq: int  # channels this rank set up on the group before this one
    agree: dict[str, Scalar] = field(default_factory=dict)

    def body(self) -> bytes:
        return encode_body([self.rank, self.host, self.pid, self.src, self.seq, dict(self.agree)])

    @classmethod
    def parse(cls, data: Any) -> "Member":
        f = decode_body(data, max_bytes=RECORD_BYTES)
        if (type(f) is not list or len(f) != 6 or type(f[1]) is not bytes
                or not all(type(x) is int for x in (f[0], f[2], f[3], f[4])) or type(f[5]) is not dict):
            raise CodecError("setup record: expected [rank, host, pid, src, seq, agree]")
        return cls(f[0], f[1], f[2], f[3], f[4], f[5])


def _pack(body: bytes, size: int) -> torch.Tensor:
    if _LEN.size + len(body) > size:
        raise ValueError(f"setup: a record of {len(body)} bytes exceeds {size - _LEN.size} "
                         "(shorten the agree= settings)")
    buf = torch.zeros(size, dtype=torch.uint8)
    view = tensor_memoryview(buf)
    _LEN.pack_into(view, 0, len(body))
    view[_LEN.size:_LEN.size + len(body)] = body
    return buf


def _unpack(buf: torch.Tensor) -> memoryview:
    view = tensor_memoryview(buf)
    (n,) = _LEN.unpack_from(view, 0)
    if _LEN.size + n > view.nbytes:
        raise CodecError(f"setup: a block declares {n} bytes, the buffer holds {view.nbytes}")
    return view[_LEN.size:_LEN.size + n]


def _spread(values: dict[int, Any], name: str, fmt: Any = repr) -> Optional[str]:
    """``"<name> differs ...: A at ranks [..], B at ranks [..]"`` when the values differ."""
    by: dict[Any, list[int]] = {}
    for r, v in values.items():
        by.setdefault((type(v).__name__, v), []).append(r)
    if len(by) < 2:
        return None
    parts = ", ".join(f"{fmt(v)} at ranks {rs}" for (_, v), rs in sorted(by.items(), key=lambda kv: kv[1]))
    return f"{name} differs across the group: {parts}"


def _onoff(v: Any) -> str:
    return {True: "on", False: "off"}.get(v, repr(v)) if type(v) is bool else repr(v)


def _verdict(members: list[Member]) -> Optional[str]:
    """The first disagreement among ``members``, as a message every rank raises."""
    problem = _spread({m.rank: m.src for m in members}, "src", lambda v: f"src={v}")
    if problem:
        return (f"{problem} (every rank must name the same driver: the same global src, or "
                "group_src)")
    problem = _spread({m.rank: m.seq for m in members}, "the count of channels set up on this "
                      "group before", str)
    if problem:
        return f"{problem} (a rank skipped or repeated a construction: they would pair wrongly)"
    for key in sorted({k for m in members for k in m.agree}):
        problem = _spread({m.rank: m.agree.get(key) for m in members}, key, _onoff)
        if problem:
            return f"{problem}; pass the same {key} on every rank"
    return None


def _table(members: list[Member], error: Optional[list[str]], n: int) -> torch.Tensor:
    body = encode_body({"error": error, "members": [m.body() for m in members]})
    return _pack(body, RECORD_BYTES * n + TABLE_EXTRA_BYTES)


def exchange(group: Any, src: int, agree: dict[str, Scalar], host: bytes,
             timeout_s: float) -> list[Member]:
    """Collective over the gloo ``group`` (every member calls it, once per channel it sets up):
    every member's :class:`Member`, in group-rank order. Raises on EVERY rank that gets the
    leader's table: ``ValueError`` when members disagree (``src``, ``seq``, ``agree``),
    ``TimeoutError`` naming the members that did not come within ``timeout_s``; a member whose
    leader does not answer raises ``TimeoutError`` naming the leader."""
    ranks = group_ranks(group)
    me, leader, n = dist.get_rank(), ranks[0], len(ranks)
    name = str(getattr(group, "group_name", ranks))
    mine = Member(me, host, os.getpid(), src, _seq.get(name, 0), dict(agree))
    start = time.monotonic()
    if me == leader:
        members = _collect(group, mine, ranks, start + LEADER_SHARE * timeout_s, timeout_s)
    else:
        members = _ask(group, mine, leader, n, start + timeout_s, timeout_s)
    _seq[name] = mine.seq + 1
    return members


def _collect(group: Any, mine: Member, ranks: list[int], deadline: float,
             timeout_s: float) -> list[Member]:
    bufs = {r: torch.empty(RECORD_BYTES, dtype=torch.uint8) for r in ranks if r != mine.rank}
    works = {r: dist.irecv(b, src=r, group=group, tag=SETUP_TAG) for r, b in bufs.items()}
    got, absent = {mine.rank: mine}, []
    for r, work in works.items():
        try:
            if wait_work(work, deadline, bufs[r]):
                got[r] = Member.parse(_unpack(bufs[r]))
                continue
        except (RuntimeError, CodecError):
            pass
        absent.append(r)
    members = [got[r] for r in ranks if r in got]
    error: Optional[list[str]] = None
    if absent:
        error = ["absent", f"rank(s) {', '.join(map(str, absent))} did not join the setup within "
                 f"{LEADER_SHARE * timeout_s:g} s (never constructed the channel / broadcaster "
                 "on this group, constructed it on another group, or died)"]
    else:
        problem = _verdict(members)
        error = ["disagree", problem] if problem else None
    table = _table(members, error, len(ranks))
    end = time.monotonic() + max(MIN_WAIT_S, (1 - LEADER_SHARE) * timeout_s)
    sends = [dist.isend(table, dst=m.rank, group=group, tag=SETUP_TAG) for m in members
             if m.rank != mine.rank]
    for work in sends:
        try:
            wait_work(work, end, table)
        except RuntimeError:
            pass  # that member died after sending its record: its own wait says so
    _raise(error)
    return members


def _ask(group: Any, mine: Member, leader: int, n: int, deadline: float,
         timeout_s: float) -> list[Member]:
    record = _pack(mine.body(), RECORD_BYTES)
    table = torch.empty(RECORD_BYTES * n + TABLE_EXTRA_BYTES, dtype=torch.uint8)
    sent = dist.isend(record, dst=leader, group=group, tag=SETUP_TAG)
    answer = dist.irecv(table, src=leader, group=group, tag=SETUP_TAG)
    for work, buf, what in ((sent, record, "did not take this rank's record"),
                            (answer, table, "sent no answer")):
        try:
            done = wait_work(work, deadline, buf)
        except RuntimeError as e:
            raise TimeoutError(f"setup leader rank {leader} {what}: its connection failed "
                               f"({e})") from None
        if not done:
            raise TimeoutError(f"setup leader rank {leader} {what} within {timeout_s:g} s (it "
                               "has not constructed the channel / broadcaster on this group, "
                               "or gave up waiting for this rank)")
    msg = decode_body(_unpack(table), max_bytes=table.numel())
    if type(msg) is not dict or type(msg.get("members")) is not list:
        raise CodecError("setup: malformed answer from the leader")
    _raise(msg.get("error"))
    return [Member.parse(b) for b in msg["members"]]


def _raise(error: Optional[list[str]]) -> None:
    if error is None:
        return
    kind, text = error
    raise (TimeoutError if kind == "absent" else ValueError)(text)
