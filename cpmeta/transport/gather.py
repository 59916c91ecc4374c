"""``start_gather``: every member's int, bounded by a timeout, a missing member named by rank.

For checks that run now and then between the members of an ``ObjectChannel`` (e.g. a replicated
state's digests, ``cpmeta.ReplicatedBatchState``): a gloo ``all_gather`` with a dead or stalled
member would end in gloo's own error after the process group's timeout, naming a socket. Here
every member sets its value under ``<channel key>/<tag>/<rank>`` in torch.distributed's default
store and waits for the others' within ``timeout`` on the channel's helper thread
(:func:`background`, which runs other jobs of the channel too), then marks it read and
waits until every member has read (so the member hosting the store cannot leave early); a member
whose key never came is named (``TimeoutError``: "rank 2 (host b) did not report ..."). Each
member deletes its keys of the channel's previous gather once every member's value of this one
is in (every member has then left the previous one), so the store holds one gather's keys per
channel however long the run. A member that sees another gone (``ObjectChannel.gone_peers``)
raises ``PeerError`` naming it and, first, writes that text into the gone member's keys (a value
``gone:<text>``, through a store connection of its own): every other member's wait ends with the
same named error, a member on a third host included. Without a default store it falls back to a
gloo all_gather bounded by the same timeout (which cannot say who is missing).

Example: ranks [0, 1, 2] of a channel, tag "check-64": every rank calls ``wait =
start_gather(ch, "check-64", lambda: digest)``, goes on, and later ``wait()`` -> ``{0: d0, 1: d1,
2: d2}`` (or the error; the exchange runs meanwhile).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from . import envs
from ._dist import bounded, store_of, wait_work
from .errors import PeerError

__all__ = ["start_gather", "background"]

_GRACE_S = 1.0  # a store op that outlives the wait by this much is abandoned (cut-off host)
_SLICE_S = 0.25  # a waiting member looks for gone peers (ObjectChannel.gone_peers) this often
_GONE = b"gone:"  # a gather value that says a member is gone (written by one that saw it)
_MINE: dict[str, list[str]] = {}  # channel key -> this member's keys of its last gather
_JOBS: "weakref.WeakKeyDictionary[Any, queue.SimpleQueue]" = weakref.WeakKeyDictionary()  # channel -> its helper's
#: ``[n]``: background jobs handed over and not yet done in this process. A ring reader spinning
#: for its next message (Python, holding the GIL) lets the GIL go each turn while n > 0: a helper
#: waiting for it would otherwise wait out the interpreter's switch interval (5 ms) at every step
#: of its job -- and a replica check's exchange, with every follower spinning, for the driver.
PENDING = [0]
_COUNT = threading.Lock()  # PENDING's updates (from callers and helpers)


def background(ch: Any, fn: Callable[[], Any]) -> Callable[[Optional[float]], Any]:
    """``fn()`` on channel ``ch``'s helper thread (one daemon thread per channel, started by its
    first job and ended with the channel; its jobs run one after another, in order). Returns
    ``wait(timeout=None)``: ``fn``'s result, or its error raised, or ``TimeoutError`` when it has
    not finished within ``timeout`` s. Handing a job over costs microseconds where starting a
    thread costs ~0.1-0.2 ms."""
    jobs = _JOBS.get(ch)
    if jobs is None:
        jobs = _JOBS[ch] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(jobs,), name="cpmeta-background", daemon=True).start()
        weakref.finalize(ch, jobs.put, None)
    done, box = threading.Event(), []

    def job() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            box.append((False, e))
        with _COUNT:
            PENDING[0] -= 1
        done.set()

    with _COUNT:
        PENDING[0] += 1
    jobs.put(job)

    def wait(timeout: Optional[float] = None) -> Any:
        if not done.wait(timeout):
            raise TimeoutError(f"a background job on channel {ch.channel_key} did not finish within {timeout:g} s")
        ok, got = box[0]
        if not ok:
            raise got
        return got

    return wait


def _told(values: list[bytes], box: dict[str, Any]) -> bool:
    """Whether a gather's values hold a member's word that another one is gone (:func:`_tell`):
    ``box["told"]`` is then its text."""
    told = [v[len(_GONE):].decode(errors="replace") for v in values if v.startswith(_GONE)]
    if told:
        box["told"] = told[0]
    return bool(told)


def _tell(store: Any, keys: list[str], text: str) -> None:
    """End every member's wait of a gather: the gone members' keys (and their read marks) set
    to ``text`` through a connection of its own (the helper thread's wait holds the store's),
    bounded: the store's host may be the one gone."""
    def post() -> None:
        try:
            own = store.clone()
            for k in keys:
                own.multi_set([k, f"{k}/read"], [_GONE + text.encode()] * 2)
        except Exception:  # noqa: BLE001 - best effort: the others then meet the timeout
            pass

    bounded(post, _GRACE_S)


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:  # the channel is gone
            return
        job()
        del job  # no reference to the channel while idle (its end ends this thread)


def start_gather(ch: Any, tag: str, value: Callable[[], int]) -> Callable[[], dict[int, int]]:
    """Collective over the members of ObjectChannel ``ch`` (every member calls it with the same
    ``tag``, once per tag), begun: the exchange runs on the channel's helper thread (without a
    store, as an asynchronous gloo all_gather) while the caller goes on; calling what it returns
    waits for it, within the timeout counted from the start, and returns ``{global rank: value}``
    of every member or raises (see the module doc). ``value`` makes this member's int, on the
    helper thread first (e.g. a digest of a state the caller leaves alone until it waits)."""
    ranks, me, timeout_s = ch.ranks, ch.rank, envs.wait_seconds(ch.timeout)
    store = store_of()
    if store is None:
        mine = torch.tensor([value()], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        work = dist.all_gather(out, mine, group=ch.ctrl, async_op=True)
        deadline = time.monotonic() + timeout_s

        def collected() -> dict[int, int]:
            if not wait_work(work, deadline, out):
                raise TimeoutError(f"rank {me}: {tag}: the ranks {ranks} did not all report within "
                                   f"{timeout_s:g} s")
            return {r: int(t.item()) for r, t in zip(ranks, out)}

        return collected
    keys = {r: f"{ch.channel_key}/{tag}/{r}" for r in ranks}
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            store.set(keys[me], str(value()))
            try:
                store.wait(list(keys.values()), timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError
                box["absent"] = [r for r, k in keys.items() if not store.check([k])]
                return
            raw = [bytes(v) for v in store.multi_get(list(keys.values()))]
            if _told(raw, box):
                return
            got = {r: int(v) for r, v in zip(keys, raw)}
            for k in _MINE.pop(ch.channel_key, ()):  # every member has left the previous gather
                try:
                    store.delete_key(k)
                except (RuntimeError, NotImplementedError):  # a store that cannot delete keeps them
                    pass
            # every member has read every value before any returns: the member hosting the store
            # may exit right after (a check on a run's last step) and take the values with it
            store.set(f"{keys[me]}/read", "1")
            reads = [f"{k}/read" for k in keys.values()]
            try:
                store.wait(reads, timedelta(seconds=timeout_s))
            except Exception:  # noqa: BLE001 - as above
                box["absent"] = [r for r, k in keys.items() if not store.check([f"{k}/read"])]
                return
            if _told([bytes(v) for v in store.multi_get(reads)], box):
                return
            _MINE[ch.channel_key] = [keys[me], f"{keys[me]}/read"]
            box["got"] = got
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    ran = background(ch, run)
    deadline = time.monotonic() + timeout_s + _GRACE_S

    def joined() -> dict[int, int]:
        while True:  # in slices: a member seen gone ends the wait, not the whole timeout
            left = deadline - time.monotonic()
            try:
                ran(max(0.0, min(left, _SLICE_S)))
                break
            except TimeoutError:
                if left <= _SLICE_S:
                    break  # the timeout: named below from what the exchange saw
            gone = ch.gone_peers()
            if gone:
                try:
                    ran(_GRACE_S)  # it may have ended with that member's last read
                    break
                except TimeoutError:
                    text = "; ".join(gone.values())
                    _tell(store, [k for r, k in keys.items() if r in gone], f"rank {me} saw {text}")
                    raise PeerError(f"rank {me}: {tag}: {text} before the exchange ended") from None
        if "got" in box:
            return box["got"]
        if "told" in box:  # another member saw one gone and ended every member's wait with it
            raise PeerError(f"rank {me}: {tag}: {box['told']} before the exchange ended")
        if box.get("absent"):
            who = ", ".join(ch.who(r) for r in box["absent"])
            raise TimeoutError(f"rank {me}: {tag}: {who} did not report within {timeout_s:g} s (died, "
                               "stalled or cut off)")
        if "error" in box:  # the store failed: its host (the driver, as a rule) may be gone
            gone = ch.gone_peers()
            why = "; ".join(gone.values()) + "; the rendezvous store" if gone else \
                "the rendezvous store failed (its host may be gone)"
            raise PeerError(f"rank {me}: {tag}: {why}: {box['error']}")
        raise TimeoutError(f"rank {me}: {tag}: the rendezvous store did not answer within {timeout_s:g} s")

    return joined
