"""The setup exchange of ``ObjectChannel``: who is in the group, where, and do they agree.

Every member leaves one record in torch.distributed's default store (the rendezvous store every
rank already holds) and waits for the others' records, every wait bounded by the caller's
timeout -- never by the process group's own (gloo's default: 30 min) -- and never on a gloo
operation, whose timeout would close the group's connections::

    rank r:  store.set("cpmeta/setup/<group>/<n>/<r>", record_r)
             store.wait(every member's key, timeout)   -> missing keys name the absent ranks
             records = store.get(every key)            -> every rank checks them the same way

``<n>`` counts the channels this process set up on the group before, so consecutive channels on
one group never read each other's records (a rank that skipped or repeated a construction looks
absent). A record is strict codec bytes (no pickle): host key, pid, the ``src`` this rank passed,
its timeout (None: no bound; the driver's heartbeat period follows the smallest) and the settings
the caller asks to cross-check (``agree``, e.g. ``{"checksum": True}``). Every
member runs the same check on the same records and so raises the same error: ``ValueError`` for
a disagreement, ``TimeoutError`` naming the members that did not come.

Example, group [0, 1, 2], rank 2 passes ``src=1``: all three raise ``ValueError("src differs
across the group: src=0 at ranks [0, 1], src=1 at ranks [2] ...")``; rank 2 never constructs:
ranks 0 and 1 raise ``TimeoutError("rank(s) 2 did not join the setup within 5 s ...")``.

Without a default store (a process group built by hand on its own store) the records travel in
one gloo ``all_gather`` instead, bounded by the timeout but unable to say who is missing.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ._dist import group_ranks, store_of, wait_work
from .codec import CodecError, decode_body, encode_body
from .coalesce import tensor_memoryview

__all__ = ["Member", "exchange", "Scalar"]

RECORD_BYTES = 2048  # most bytes of one member's record
STORE_GRACE_S = 1.0  # a store that does not answer at all: given up this long after the timeout
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
    timeout: Optional[float] = None  # this rank's channel timeout (None: no bound)
    agree: dict[str, Scalar] = field(default_factory=dict)

    def body(self) -> bytes:
        body = encode_body([self.rank, self.host, self.pid, self.src, self.seq, self.timeout,
                            dict(self.agree)])
        if len(body) > RECORD_BYTES - _LEN.size:
            raise ValueError(f"setup: a record of {len(body)} bytes exceeds "
                             f"{RECORD_BYTES - _LEN.size} (shorten the agree= settings)")
        return body

    @classmethod
    def parse(cls, data: Any) -> "Member":
        f = decode_body(data, max_bytes=RECORD_BYTES)
        if (type(f) is not list or len(f) != 7 or type(f[1]) is not bytes
                or not all(type(x) is int for x in (f[0], f[2], f[3], f[4]))
                or not (f[5] is None or type(f[5]) is float) or type(f[6]) is not dict):
            raise CodecError("setup record: expected [rank, host, pid, src, seq, timeout, agree]")
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6])


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
    return ("on" if v else "off") if type(v) is bool else repr(v)


def _verdict(members: list[Member]) -> Optional[str]:
    """The first disagreement among ``members``, as a message every rank raises."""
    problem = _spread({m.rank: m.src for m in members}, "src", lambda v: f"src={v}")
    if problem:
        return (f"{problem} (every rank must name the same driver: the same global src, or "
                "group_src)")
    for key in sorted({k for m in members for k in m.agree}):
        problem = _spread({m.rank: m.agree.get(key) for m in members}, key, _onoff)
        if problem:
            return f"{problem}; pass the same {key} on every rank"
    return None


def exchange(group: Any, src: int, agree: dict[str, Scalar], host: bytes,
             timeout_s: float, timeout: Optional[float] = None) -> list[Member]:
    """Collective over ``group`` (every member calls it, once per channel it sets up; any
    backend): every member's :class:`Member` (``timeout``: this rank's channel timeout, None
    for no bound), in group-rank order. Raises on every member:
    ``ValueError`` when members disagree (``src``, ``agree``), ``TimeoutError`` naming the
    members that did not come within ``timeout_s``."""
    ranks = group_ranks(group)
    name = str(getattr(group, "group_name", "_".join(map(str, ranks))))
    mine = Member(dist.get_rank(), host, os.getpid(), src, _seq.get(name, 0),
                  None if timeout is None else float(timeout), dict(agree))
    body = mine.body()
    store = store_of()
    if store is None:
        members = _gather(group, ranks, body, timeout_s)
    else:
        members = _via_store(store, f"cpmeta/setup/{name}/{mine.seq}", ranks, mine.rank, body,
                             timeout_s)
    problem = _verdict(members)
    if problem:
        raise ValueError(problem)
    _seq[name] = mine.seq + 1
    return members


def _via_store(store: Any, prefix: str, ranks: list[int], me: int, body: bytes,
               timeout_s: float) -> list[Member]:
    """Set this rank's record, wait for every member's, read them (on a helper thread, so that
    a store on an unreachable host cannot hold the caller past the timeout)."""
    keys = [f"{prefix}/{r}" for r in ranks]
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            store.set(keys[ranks.index(me)], body)
            try:
                store.wait(keys, timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError
                box["absent"] = [r for r, k in zip(ranks, keys) if not store.check([k])]
                return
            box["members"] = [Member.parse(bytes(store.get(k))) for k in keys]
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="cpmeta-setup", daemon=True)
    t.start()
    t.join(timeout_s + STORE_GRACE_S)
    if "members" in box:
        return box["members"]
    if box.get("absent"):
        who = ", ".join(map(str, box["absent"]))
        raise TimeoutError(f"rank(s) {who} did not join the setup within {timeout_s:g} s (never "
                           "constructed the channel / broadcaster on this group, did so another "
                           "number of times, or died)")
    if "error" in box:
        raise box["error"]
    raise TimeoutError(f"the rendezvous store did not answer within {timeout_s:g} s (its host "
                       "is unreachable?)")


def _gather(group: Any, ranks: list[int], body: bytes, timeout_s: float) -> list[Member]:
    """No default store: one bounded gloo all_gather of fixed-size records (``group`` gloo)."""
    mine = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    view = tensor_memoryview(mine)
    _LEN.pack_into(view, 0, len(body))
    view[_LEN.size:_LEN.size + len(body)] = body
    out = [torch.empty_like(mine) for _ in ranks]
    work = dist.all_gather(out, mine, group=group, async_op=True)
    if not wait_work(work, time.monotonic() + timeout_s, out):
        raise TimeoutError(f"the setup exchange of ranks {ranks} did not complete within "
                           f"{timeout_s:g} s (a member did not construct the channel)")
    members = []
    for t in out:
        v = tensor_memoryview(t)
        (n,) = _LEN.unpack_from(v, 0)
        members.append(Member.parse(v[_LEN.size:_LEN.size + min(n, RECORD_BYTES - _LEN.size)]))
    return members
