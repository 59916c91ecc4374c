"""The compiled halves of ``BatchState.add_requests_batch`` and ``finish_batch`` (:mod:`.requests`):
a step's new requests into free slots, or its finished ones out, in ONE call each, every check
before any write.

Same conventions as :mod:`.state_njit` (the state's ``meta`` rows, its constants ``p``, an error
code and ``err = [code, index, value, limit]`` instead of a raise); ``err[1]`` is the failing
request's position in the call.
"""

from __future__ import annotations

import numpy as np

from ..base_njit import copy_from0, fail
from ..jit import OK, kernel, warmer
from .state_njit import (
    E_CAPACITY, E_COUNTS, E_NEGATIVE_ID, M_BLOCKS, M_COMPRESSED, M_COMPUTED, M_FIRST_BAD, M_PROMPT, M_STATE,
    M_TOKENS, M_VALID_START, N_META, NO_BAD, P_MAX_BLOCK_ID, P_SWA, check_slots, state_params,
)

__all__ = ["add_rows", "finish_rows", "E_FULL", "E_EMPTY", "E_COMPUTED", "E_STATE_HELD"]

# add_rows: err[1] is the request's position in the call
E_FULL = 11  #: no free slot is left for request ``err[1]``
E_EMPTY = 12  #: request ``err[1]``'s prompt is empty
E_COMPUTED = 13  #: request ``err[1]``'s num_computed ``err[2]`` is outside ``[0, err[3]]`` (its prompt)
E_STATE_HELD = 14  #: request ``err[1]``'s state id ``err[2]`` is held by slot ``err[3]`` (live, or
#: ``-1 - j`` for the call's earlier request ``j``)


@kernel
def add_rows(slots: np.ndarray, toks: np.ndarray, tok_cnt: np.ndarray, blocks: np.ndarray, blk_cnt: np.ndarray,
             comp: np.ndarray, comp_cnt: np.ndarray, scalars: np.ndarray, meta: np.ndarray, active: np.ndarray,
             token_ids: np.ndarray, block_table: np.ndarray, compressed: np.ndarray, p: np.ndarray,
             err: np.ndarray) -> int:
    """Add ``n = scalars.shape[1]`` requests: request ``i`` takes ``slots[i]`` (the free slots in
    hand-out order; fewer than ``n``: :data:`E_FULL`) with prompt ``toks`` [its ``tok_cnt[i]``
    ids], table ``blocks`` [``blk_cnt[i]``], Engram ids ``comp`` [``comp_cnt[i]``] and
    ``scalars[:, i] = (state_id, swa_valid_start, num_computed)``.

    Checks first, nothing written when one fails; the counts (:data:`E_COUNTS`, ``err[3]``:
    0 tokens, 1 blocks, 2 Engram ids), then request by request in ``add_request``'s order: a free
    slot, capacities (:data:`E_CAPACITY`, ``err[2]`` the count, ``err[3]`` the array as above),
    a non-empty prompt, ``0 <= num_computed <= prompt length``, prompt ids >= 0
    (:data:`E_NEGATIVE_ID`), and with the state cache (``p[P_SWA]``) a state id no live request
    and no earlier request of the call holds. Example: slots ``[5, 4]``, tok_cnt ``[2, 1]``, toks
    ``[7, 8, 9]`` -> slot 5 holds tokens ``[7, 8]``, slot 4 ``[9]``.
    """
    n = scalars.shape[1]
    for which, cnt, flat in ((0, tok_cnt, toks.shape[0]), (1, blk_cnt, blocks.shape[0]), (2, comp_cnt, comp.shape[0])):
        if cnt.shape[0] != n:
            return fail(err, E_COUNTS, -1, cnt.shape[0], which)
        tot = 0
        for i in range(n):
            if cnt[i] < 0:
                return fail(err, E_COUNTS, i, cnt[i], which)
            tot += cnt[i]
        if tot != flat:
            return fail(err, E_COUNTS, -1, tot, which)
    caps = (token_ids.shape[1], block_table.shape[1], compressed.shape[1])
    t = 0
    for i in range(n):
        if i >= slots.shape[0]:
            return fail(err, E_FULL, i, 0, 0)
        for which, cnt in ((0, tok_cnt), (1, blk_cnt), (2, comp_cnt)):
            if cnt[i] > caps[which]:
                return fail(err, E_CAPACITY, i, cnt[i], which)
        nt, nc = tok_cnt[i], scalars[2, i]
        if nt == 0:
            return fail(err, E_EMPTY, i, 0, 0)
        if nc < 0 or nc > nt:
            return fail(err, E_COMPUTED, i, nc, nt)
        src = toks[t:t + nt]
        lo = 0
        for j in range(nt):  # no exit inside, indices from 0: the loop vectorizes (1000s of ids)
            lo = min(lo, src[j])
        if lo < 0:
            for j in range(nt):
                if src[j] < 0:
                    return fail(err, E_NEGATIVE_ID, i, src[j], j)
        t += nt
        if p[P_SWA]:
            sid = scalars[0, i]
            for s in range(active.shape[0]):
                if active[s] and meta[M_STATE, s] == sid:
                    return fail(err, E_STATE_HELD, i, sid, s)
            for j in range(i):
                if scalars[0, j] == sid:
                    return fail(err, E_STATE_HELD, i, sid, -1 - j)
    t = b = c = 0
    max_id = p[P_MAX_BLOCK_ID]
    for i in range(n):
        s = slots[i]
        nt, nb, ncmp = tok_cnt[i], blk_cnt[i], comp_cnt[i]
        copy_from0(token_ids[s], toks[t:t + nt])
        copy_from0(block_table[s], blocks[b:b + nb])
        copy_from0(compressed[s], comp[c:c + ncmp])
        bad = NO_BAD
        for j in range(nb):
            if blocks[b + j] < 0 or blocks[b + j] > max_id:
                bad = j
                break
        meta[M_TOKENS, s] = meta[M_PROMPT, s] = nt
        meta[M_COMPUTED, s] = scalars[2, i]
        meta[M_BLOCKS, s], meta[M_COMPRESSED, s], meta[M_FIRST_BAD, s] = nb, ncmp, bad
        meta[M_STATE, s], meta[M_VALID_START, s] = scalars[0, i], scalars[1, i]
        active[s] = True
        t, b, c = t + nt, b + nb, c + ncmp
    return OK


@kernel
def finish_rows(slots: np.ndarray, meta: np.ndarray, active: np.ndarray, mark: np.ndarray, err: np.ndarray) -> int:
    """Finish the requests in ``slots``: each slot live and given once (``E_SLOT`` / ``E_REPEAT``
    of ``state_njit``, nothing written), then inactive with no tokens, blocks or Engram ids
    (the rest of its row stays until an add rewrites it)."""
    code = check_slots(slots, active, mark, err)
    if code:
        return code
    for s in slots:
        active[s] = False
        meta[M_TOKENS, s] = meta[M_BLOCKS, s] = meta[M_COMPRESSED, s] = 0
    return OK


@warmer
def _warm() -> None:
    """The kernels once: an add refused (no free slot) and a finish of nothing, on a 2-slot state."""
    from ..config import MetadataConfig

    cfg = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                         max_model_len=64)
    one = np.ones(1, np.int64)
    add_rows(np.zeros(0, np.int64), one, one, one, one, np.zeros(0, np.int64), np.zeros(1, np.int64),
             np.zeros((3, 1), np.int64), np.zeros((N_META, 2), np.int64), np.zeros(2, np.bool_),
             np.zeros((2, 64), np.int64), np.zeros((2, 4), np.int64), np.zeros((2, 0), np.int64),
             state_params(cfg, 0), np.zeros(4, np.int64))
    finish_rows(np.zeros(0, np.int64), np.zeros((N_META, 2), np.int64), np.zeros(2, np.bool_), np.zeros(2, np.int64),
                np.zeros(4, np.int64))
