"""``StateStore``: the preallocated arrays of a :class:`~cpmeta.state.batch_state.BatchState`.

The state room owns these arrays; ``BatchState`` (the deltas and the step API) derives from this
class, and the compiled kernels (:mod:`cpmeta.state.state_njit`) read and write them. Other
rooms read a state only through the public names below (read-only to callers): the replica
digest (``cpmeta.replicate``) and the in-place decode staging (``cpmeta.gpu.stage_decode``, whose
compiled writer casts the ids it copies to the layout's int32).

Public, read-only to callers (every array is ``[max_seqs, ...]``, row = slot):

==================  ===========================  =================================================
name                shape / dtype                meaning
==================  ===========================  =================================================
``token_ids``       [max_seqs, max_tokens] i64   confirmed tokens (``num_tokens`` of them)
``num_tokens``      [max_seqs] int64             confirmed tokens per slot
``num_computed``    [max_seqs] int64             prompt tokens prefilled so far
``prompt_len``      [max_seqs] int64             prompt length
``block_table``     [max_seqs, max_blocks] i64   block ids (``num_blocks`` of them)
``num_blocks``      [max_seqs] int64             block ids per slot
``compressed``      [max_seqs, max_compressed]   Engram history ids (``num_compressed``)
``num_compressed``  [max_seqs] int64             Engram ids per slot
``state_id``        [max_seqs] int64             SWA / state slot
``swa_valid_start`` [max_seqs] int64             first valid SWA position
``active``          [max_seqs] bool              a live request holds the slot
``placeholder_blocks``  int                      block ids of a placeholder sequence
==================  ===========================  =================================================

The seven count arrays are rows of ONE ``[8, max_seqs]`` int64 array (``_meta``, rows ``M_*`` of
:mod:`~cpmeta.state.state_njit`; the eighth, ``M_FIRST_BAD``, is each table's first block id
outside ``[0, max_block_id]``): a kernel takes one argument for all of them.
Example: ``st.block_table[slot, :st.num_blocks[slot]]`` is the slot's table.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import numpy as np

from ..config import MetadataConfig, blocks_needed, check_config
from .batch import Vouch, window_lookback
from .checks import check_int_arg
from .state_njit import (
    E_CAPACITY, E_COUNTS, E_REPEAT, E_SLOT, M_BLOCKS, M_COMPRESSED, M_COMPUTED, M_FIRST_BAD, M_PROMPT, M_STATE,
    M_TOKENS, M_VALID_START, N_META, NO_BAD, state_params,
)

__all__ = ["StateStore", "raise_slots"]

_A = np.ndarray
KernelArrays = tuple[_A, _A, _A, _A, _A, _A, _A, _A]  # :meth:`StateStore.kernel_arrays`, eight arrays


def _check_slot_arg(slot: object) -> None:
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool):
        raise TypeError(f"slot: expected an int, got {slot!r}")


class StateStore:
    """The arrays of a ``BatchState``, its slot book-keeping and the kernels' error messages.

    Capacity: ``max_seqs`` request slots, per request ``max_tokens`` confirmed tokens (default
    ``cfg.max_model_len``), ``max_blocks`` block ids (default ``blocks_needed(max_model_len)``)
    and ``max_compressed`` Engram history ids (default ``max_tokens`` with Engram on, else 0).
    """

    def __init__(self, cfg: MetadataConfig, max_seqs: int, *, max_tokens: Optional[int] = None,
                 max_blocks: Optional[int] = None, max_compressed: Optional[int] = None) -> None:
        # by name: 1.5 and True were taken as 1 slot, -5 tokens was numpy's "negative dimensions"
        check_config(cfg)
        check_int_arg("max_seqs", max_seqs, lo=1)
        for name, v in (("max_tokens", max_tokens), ("max_blocks", max_blocks), ("max_compressed", max_compressed)):
            if v is not None:
                check_int_arg(name, v, lo=0 if name == "max_compressed" else 1)
        self.cfg = cfg
        self.max_seqs = n = int(max_seqs)
        self.max_tokens = int(max_tokens if max_tokens is not None else cfg.max_model_len)
        self.max_blocks = int(max_blocks if max_blocks is not None else blocks_needed(cfg.max_model_len, cfg))
        if max_compressed is None:
            max_compressed = self.max_tokens if cfg.max_ngram_size > 0 else 0
        self.max_compressed = int(max_compressed)
        self.lookback = window_lookback(cfg)
        try:
            self.token_ids = np.zeros((n, self.max_tokens), np.int64)
            self.block_table = np.zeros((n, self.max_blocks), np.int64)
            self.compressed = np.zeros((n, self.max_compressed), np.int64)
        except (MemoryError, ValueError) as e:  # the rows every slot holds, allocated at once
            nbytes = 8 * n * (self.max_tokens + self.max_blocks + self.max_compressed)
            raise MemoryError(f"BatchState: max_seqs={n} slots of max_tokens={self.max_tokens}, max_blocks="
                              f"{self.max_blocks} and max_compressed={self.max_compressed} int64 entries are "
                              f"{nbytes / 2**30:.3g} GiB: {e}") from None
        self._meta = np.zeros((N_META, n), np.int64)
        self.num_tokens, self.num_computed, self.prompt_len = (self._meta[M_TOKENS], self._meta[M_COMPUTED],
                                                               self._meta[M_PROMPT])
        self.num_blocks, self.num_compressed = self._meta[M_BLOCKS], self._meta[M_COMPRESSED]
        self.state_id, self.swa_valid_start = self._meta[M_STATE], self._meta[M_VALID_START]
        self._first_bad = self._meta[M_FIRST_BAD]  # each table's first id outside [0, max_block_id]
        self._first_bad[:] = NO_BAD
        self.active = np.zeros(n, bool)
        self._p = state_params(cfg, self.lookback)
        self._vouch = Vouch(cfg)  # what a batch the gather vouched for carries (immutable)
        self._seen = np.zeros(n, np.int64)  # the kernels' repeated-slot scratch
        self._err = np.zeros(4, np.int64)
        self._one, self._one_count = np.zeros(1, np.int64), np.zeros(1, np.int64)  # a single-slot call
        self._req: list[Any] = [None] * n  # request id of each slot
        self._slot: dict[Hashable, int] = {}
        self._free = list(range(n - 1, -1, -1))  # pop() gives the lowest free slot
        # a compiled replay's view of the free list (RequestBook.free_stack) and its add rows
        self._stack, self._nfree, self._add_scratch = np.zeros(n, np.int64), np.zeros(1, np.int64), np.zeros(7 * n, np.int64)
        self.placeholder_blocks = blocks_needed(1, cfg)

    def __len__(self) -> int:
        return len(self._slot)

    def kernel_arrays(self) -> KernelArrays:
        """The arrays a compiled caller in another room passes to this room's kernels, in their
        argument order: ``(meta, active, token_ids, block_table, compressed, p, mark, err)``
        (``cpmeta.replicate.replay_njit``: a step frame's appends and batch
        specs, replayed with :func:`~cpmeta.state.state_njit.append_rows` and
        :func:`~cpmeta.state.state_njit.gather_step`). Writing them other than through those
        kernels breaks the state's invariants."""
        return (self._meta, self.active, self.token_ids, self.block_table, self.compressed, self._p,
                self._seen, self._err)

    def slot_of(self, req_id: Hashable) -> int:
        """The slot of a live request (``ValueError`` for an unknown id)."""
        try:
            return self._slot[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r}: not in the batch state") from None

    def request_of(self, slot: int) -> Any:
        """The request id in ``slot`` (``None`` for a free slot; a slot outside ``[0, max_seqs)``
        is a ``ValueError``: -1 read the last slot's request)."""
        _check_slot_arg(slot)
        if not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot: expected a slot in [0, {self.max_seqs}), got {slot}")
        return self._req[slot]

    def _live(self, slot: int) -> Any:
        """The request in the live ``slot`` (an int; a numpy integer counts, a bool does not)."""
        if type(slot) is not int:
            _check_slot_arg(slot)
        if not (0 <= slot < self.max_seqs) or not self.active[slot]:
            raise ValueError(f"slot {slot}: no live request there")
        return self._req[slot]

    def _fits(self, req_id: Any, what: str, n: int, cap: int, name: str) -> None:
        if n > cap:
            raise ValueError(f"request {req_id!r}: {n} {what} exceed {name}={cap}")

    def state_holder(self, state_id: int, but: int = -1) -> Optional[int]:
        """The slot of a live request other than slot ``but`` whose state id is ``state_id``, or
        ``None`` (O(max_seqs), vectorized; requests join and move rarely)."""
        check_int_arg("state_id", state_id)
        held = np.flatnonzero(self.active & (self.state_id == state_id))
        held = held[held != but]
        return int(held[0]) if len(held) else None

    # ---- the kernels' error codes as messages (error path only) -----------------------------
    def _raise_slots(self, slots: np.ndarray) -> None:
        """:func:`raise_slots` over this state's live requests."""
        raise_slots(slots, self.active, self._req)

    def _raise_append(self, code: int, slots: np.ndarray, n_values: int, what: str, name: str) -> None:
        """The message of an :func:`~cpmeta.state.state_njit.append_rows` code other than the
        token ids' (the caller's)."""
        if code in (E_SLOT, E_REPEAT):
            self._raise_slots(slots)
        if code == E_COUNTS:
            raise ValueError(f"counts: expected {len(slots)} counts >= 0 summing to {n_values} {what}")
        assert code == E_CAPACITY, code
        _, i, new, cap = self._err.tolist()
        self._fits(self._req[int(slots[i])], what, new, cap, name)


def raise_slots(slots: np.ndarray, active: np.ndarray, req: list[Any]) -> None:
    """``ValueError("slots: ...")`` when ``slots`` (int64) holds a slot without a live request
    (``active`` [max_seqs] bool) or one slot twice (the first repeated position names its request,
    ``req[slot]``); nothing when they are fine. The state's message, and a deferred recorder's
    over its model of the live requests."""
    ok = (slots >= 0) & (slots < len(active))
    ok[ok] = active[slots[ok]]
    if not ok.all():
        raise ValueError(f"slots: expected slots of live requests, got {slots[~ok].tolist()[:4]} without one")
    _, first = np.unique(slots, return_index=True)
    rep = np.setdiff1d(np.arange(len(slots)), first)
    if rep.size:
        s = int(slots[rep[0]])
        raise ValueError(f"slots: request {req[s]!r} (slot {s}) appears twice in one step")
