"""Requests joining and leaving a ``BatchState``: ``add_request``, ``add_requests_batch`` (a
step's new requests in one compiled call, :mod:`.requests_njit`), ``finish``, ``finish_batch``.

:class:`RequestBook` is the part of :class:`~cpmeta.state.batch_state.BatchState` that hands out
and takes back slots; the per-step deltas and gathers are in ``batch_state``. Every check runs
before anything changes, and a refusal names the request and the field or limit.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np

from .checks import as_int_array, check_int_arg
from .requests_njit import E_COMPUTED, E_EMPTY, E_FULL, E_STATE_HELD, add_rows, finish_rows
from .state_njit import E_CAPACITY, E_COUNTS, E_NEGATIVE_ID
from .store import StateStore

__all__ = ["RequestBook", "add_arguments", "next_free", "id_list", "check_new_ids"]

_EMPTY = np.zeros(0, np.int64)


class RequestBook(StateStore):
    """Adding and finishing requests (see the module docstring)."""

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray,
                    block_table: Sequence[int] | np.ndarray, state_id: int, *,
                    compressed_token_ids: Sequence[int] | np.ndarray = (), swa_valid_start: int = 0,
                    num_computed: int = 0) -> int:
        """Add a request (once); returns its slot. ``num_computed``: prompt tokens already in the
        KV cache (e.g. a prefix-cache hit). Ints may be numpy integers (never bools); token ids
        must be ``>= 0``; with the sliding-window state cache (``cfg.has_swa``) no other live
        request may hold ``state_id`` (both would write the same ``slot_mapping_store_swa``
        slots; without the cache state ids are read by no field and may repeat). Nothing
        changes when a check fails or a limit is exceeded."""
        check_new_ids([req_id], self._slot)
        if not self._free:
            raise ValueError(f"request {req_id!r}: all max_seqs={self.max_seqs} slots are in use")
        check_int_arg("state_id", state_id, req_id)
        check_int_arg("swa_valid_start", swa_valid_start, req_id)
        check_int_arg("num_computed", num_computed, req_id)
        arrays = [as_int_array(name, v, req_id) for name, v in (
            ("prompt_token_ids", prompt_token_ids), ("block_table", block_table),
            ("compressed_token_ids", compressed_token_ids))]
        counts = [np.array([len(a)], np.int64) for a in arrays]
        return int(self._add([req_id], arrays[0], counts[0], arrays[1], counts[1], arrays[2], counts[2],
                             np.array([[state_id], [swa_valid_start], [num_computed]], np.int64))[0])

    def add_requests_batch(self, req_ids: Sequence[Hashable], token_ids: np.ndarray, token_counts: np.ndarray,
                           block_ids: np.ndarray, block_counts: np.ndarray, state_ids: np.ndarray, *,
                           compressed_ids: Optional[np.ndarray] = None,
                           compressed_counts: Optional[np.ndarray] = None,
                           swa_valid_starts: Optional[np.ndarray] = None,
                           num_computed: Optional[np.ndarray] = None) -> np.ndarray:
        """``add_request`` for each of ``req_ids`` in ONE compiled call; returns their slots
        (int64, the slots those calls would have returned, in order). Request ``i``'s prompt is
        the next ``token_counts[i]`` ids of the flat ``token_ids``, its table the next
        ``block_counts[i]`` of ``block_ids`` (Engram ids likewise, default none); ``state_ids``,
        ``swa_valid_starts`` and ``num_computed`` (default 0) one value per request.

        The same checks and messages as ``add_request``, request by request in order (ids
        already in the state or given twice are checked first); a failing check adds NONE of
        the requests. Example: ``st.add_requests_batch(["a", "b"], [5, 6, 7], [2, 1], [3, 9],
        [1, 1], [0, 1])`` -> slots ``[0, 1]``: "a" holds prompt ``[5, 6]`` and table ``[3]``."""
        ids = id_list(req_ids)
        check_new_ids(ids, self._slot)
        flat, scalars = add_arguments(len(ids), token_ids, token_counts, block_ids, block_counts, state_ids,
                                      compressed_ids, compressed_counts, swa_valid_starts, num_computed)
        toks, tc, blocks, bc, comp, cc = flat
        return self._add(ids, toks, tc, blocks, bc, comp, cc, scalars)

    def add_converted(self, ids: list[Any], toks: np.ndarray, tc: np.ndarray, blocks: np.ndarray, bc: np.ndarray,
                      comp: np.ndarray, cc: np.ndarray, scalars: np.ndarray) -> np.ndarray:
        """``add_requests_batch`` of arguments already as :func:`add_arguments` makes them
        (contiguous int64: the flat ids and counts, ``[3, n]`` scalars): a replica applying a
        step frame's columns (``cpmeta.replicate.apply``). The same checks and messages."""
        check_new_ids(ids, self._slot)
        return self._add(ids, toks, tc, blocks, bc, comp, cc, scalars)

    def _add(self, ids: list[Any], toks: np.ndarray, tc: np.ndarray, blocks: np.ndarray, bc: np.ndarray,
             comp: np.ndarray, cc: np.ndarray, scalars: np.ndarray) -> np.ndarray:
        """The one compiled add of ``add_request`` and ``add_requests_batch`` (their arguments
        converted; ids checked against the state), then the slot book-keeping."""
        free = self._free
        n = len(ids)
        slots = np.array(next_free(free, n), np.int64)
        code = add_rows(slots, toks, tc, blocks, bc, comp, cc, scalars, self._meta, self.active, self.token_ids,
                        self.block_table, self.compressed, self._p, self._err)
        if code:
            self._raise_add(code, ids, [toks, tc, blocks, bc, comp, cc], scalars)
        del free[len(free) - n:]
        for r, s in zip(ids, slots.tolist()):
            self._slot[r], self._req[s] = s, r
        return slots

    def _raise_add(self, code: int, ids: list[Any], flat: list[np.ndarray], scalars: np.ndarray) -> None:
        """The ``ValueError`` of an :func:`~cpmeta.state.requests_njit.add_rows` code."""
        _, i, v, lim = self._err.tolist()
        names = ("token", "block", "compressed")
        if code == E_COUNTS:
            what = names[lim]
            raise ValueError(f"{what}_counts: expected {len(ids)} counts >= 0 summing to "
                             f"{len(flat[2 * lim])} {what}_ids")
        r = ids[i]
        if code == E_FULL:
            raise ValueError(f"request {r!r}: all max_seqs={self.max_seqs} slots are in use")
        if code == E_CAPACITY:
            what, cap, name = (("tokens", self.max_tokens, "max_tokens"), ("block ids", self.max_blocks, "max_blocks"),
                               ("compressed ids", self.max_compressed, "max_compressed"))[lim]
            self._fits(r, what, v, cap, name)
        if code == E_EMPTY:
            raise ValueError(f"request {r!r}: expected a non-empty prompt")
        if code == E_COMPUTED:
            raise ValueError(f"request {r!r}: num_computed {v} outside [0, {lim}]")
        if code == E_NEGATIVE_ID:
            raise ValueError(f"request {r!r}: prompt_token_ids: expected ids >= 0, got {v} at index {lim}")
        assert code == E_STATE_HELD, code
        j = -1 - lim  # lim < 0: the call's earlier request j, in the slot it would have taken
        other, slot = (self._req[lim], lim) if lim >= 0 else (ids[j], self._free[-1 - j])
        raise ValueError(f"request {r!r}: state_id {v} is held by request {other!r} (slot {slot}); two live "
                         "requests would write the same slot_mapping_store_swa slots")

    def _check_state_free(self, req_id: Hashable, state_id: int, slot: int) -> None:
        """With the sliding-window state cache, ``ValueError`` when a live request other than the
        one in ``slot`` holds ``state_id`` (move it to a free id first to swap two)."""
        if not self.cfg.has_swa:
            return
        other = self.state_holder(state_id, slot)
        if other is not None:
            raise ValueError(
                f"request {req_id!r}: state_id {state_id} is held by request {self._req[other]!r} (slot "
                f"{other}); two live requests would write the same slot_mapping_store_swa slots")

    def free_stack(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The free list for a compiled caller that finishes and adds requests with this room's
        kernels (``cpmeta.replicate.replay_njit``): ``(stack, nfree, scratch)``, ``stack[:nfree[0]]``
        the free slots in :meth:`free_slots`' order (refilled by this call), ``scratch`` room for
        an add's rows. The caller hands the outcome back with :meth:`book_replayed`."""
        k = len(self._free)
        self._stack[:k] = self._free
        self._nfree[0] = k
        return self._stack, self._nfree, self._add_scratch

    def book_replayed(self, done: list[tuple[list[int], Optional[list[Any]]]]) -> None:
        """The request maps and free list after a compiled caller finished or added requests
        through :meth:`free_stack` (its arrays already written): ``done`` in call order, ``(slots,
        None)`` for finished slots, ``(slots, ids)`` for added ones; the free list is the stack's."""
        req, book = self._req, self._slot
        for slots, ids in done:
            if ids is None:
                self._unbook(slots)
            else:
                for x, r in zip(slots, ids):
                    book[r], req[x] = x, r
        self._free = self._stack[:self._nfree[0]].tolist()

    def all_new(self, ids: list[Any]) -> bool:
        """No id of ``ids`` is in the state or given twice (what a compiled add of them needs)."""
        return len(set(ids)) == len(ids) and not any(r in self._slot for r in ids)

    def free_slots(self) -> list[int]:
        """The free slots in the order ``add_request`` hands them out, LAST first (a copy):
        ``add_request`` takes ``free_slots()[-1]``, ``finish`` puts its slot at the end.
        Example: a new state of 3 -> ``[2, 1, 0]``; after one add and ``finish(0)`` -> ``[2, 1, 0]``."""
        return list(self._free)

    def finish(self, slot: int) -> None:
        """Remove the request in ``slot``; the slot is reused by a later ``add_request``."""
        self._live(slot)  # its own message for a slot without a request
        self._one[0] = slot
        self._finish_rows(self._one)

    def finish_batch(self, slots: Sequence[int] | np.ndarray) -> None:
        """``finish`` each of ``slots`` in order, in one call (an engine's finished requests of a
        step): every slot must hold a live request and appear once, else ``ValueError`` naming
        them and none is finished; the slots join the free list in that order. Example: after
        ``finish_batch([4, 1])`` the next ``add_request`` gets slot 1, the one after it slot 4."""
        self._finish_rows(as_int_array("slots", slots))

    def _finish_rows(self, slots: np.ndarray) -> None:
        """The one finish: the compiled checks and reset, then the request maps and free list."""
        if finish_rows(slots, self._meta, self.active, self._seen, self._err):
            self._raise_slots(slots)
        sl = slots.tolist()
        self._unbook(sl)
        self._free += sl

    def _unbook(self, slots: list[int]) -> None:
        """The request maps without the (finished) requests of ``slots``."""
        req, book = self._req, self._slot
        for x in slots:
            del book[req[x]]
            req[x] = None


def next_free(free: list[int], n: int) -> list[int]:
    """The slots the next ``n`` adds take from the free list ``free`` (``free_slots()``'s order:
    the last first); fewer when fewer are free. Example: ``next_free([7, 6, 5], 2)`` -> ``[5, 6]``."""
    return free[::-1][:n]


def check_new_ids(ids: list[Any], live: Mapping[Hashable, int]) -> None:
    """``ValueError`` for an id already live (``live``: id -> slot) or given twice in one call,
    ``TypeError`` for one that is not hashable. Shared by the state and the replicated
    recorder's model of it (``defer_apply``), so both refuse with the same message."""
    taken: dict[Hashable, int] = {}
    for i, r in enumerate(ids):
        if getattr(r, "__hash__", None) is None:  # (a list, a dict, a numpy array)
            raise TypeError(f"request {r!r}: a request id is hashable (an int, a str, ...), got "
                            f"{type(r).__name__}")
        if r in live:
            raise ValueError(f"request {r!r}: already in the batch state (slot {live[r]})")
        if taken.setdefault(r, i) != i:
            raise ValueError(f"request {r!r}: given twice in one add_requests_batch call (positions "
                             f"{taken[r]} and {i})")


def id_list(req_ids: Any) -> list[Any]:
    """``add_requests_batch``'s request ids as a list: a sequence of ids (not a str or bytes,
    which would be taken a character each), else ``TypeError`` naming ``req_ids``."""
    if isinstance(req_ids, (str, bytes)) or not hasattr(req_ids, "__len__") or not hasattr(req_ids, "__iter__"):
        raise TypeError(f"req_ids: expected a sequence of request ids, got {req_ids!r}")
    return list(req_ids)


def add_arguments(n: int, token_ids: Any, token_counts: Any, block_ids: Any, block_counts: Any, state_ids: Any,
                  compressed_ids: Any = None, compressed_counts: Any = None, swa_valid_starts: Any = None,
                  num_computed: Any = None) -> tuple[list[np.ndarray], np.ndarray]:
    """``add_requests_batch``'s arguments for ``n`` requests as the kernel takes them: the six
    flat / count arrays (int64; no Engram ids: empty, zero counts) and ``[3, n]`` scalars (state
    id, valid start, num computed; 0 where not given), each named in its ``TypeError`` /
    ``ValueError``. The counts are checked by the kernel (the replicated recorder checks them
    itself when it only records)."""
    flat = [as_int_array(name, v) for name, v in (
        ("token_ids", token_ids), ("token_counts", token_counts), ("block_ids", block_ids),
        ("block_counts", block_counts), ("compressed_ids", _EMPTY if compressed_ids is None else compressed_ids),
        ("compressed_counts", np.zeros(n, np.int64) if compressed_counts is None else compressed_counts))]
    scalars = np.zeros((3, n), np.int64)
    for row, name, v in ((0, "state_ids", state_ids), (1, "swa_valid_starts", swa_valid_starts),
                         (2, "num_computed", num_computed)):
        if v is not None:
            a = as_int_array(name, v)
            if len(a) != n:
                raise ValueError(f"{name}: expected {n} values (one per request), got {len(a)}")
            scalars[row] = a
    return flat, scalars
