"""The KV read plan's compiled kernels (docs/design.md sections 14 and 17): count, then fill.

- :func:`plan_seqlens` -- the keys rank ``r`` holds per entry (prompt: sequence, decode: query
  row; placeholders 0), their prefix sums, rank 0's total and the table checks;
- :func:`plan_keys` -- the slot and the global position of every local key (sized by the first).

Worked example (``W = 2, I = 2, block_size = 4``, decode rows with ``context_lens = [7, 10]``,
table ``[3, 9, 5]`` for both, rank 1): positions owned ``(p // 2) % 2 == 1`` -> ``seqlens = [3,
4]``, ``cu = [0, 3, 7]``, rank 0 holds ``4 + 6 = 10`` (``max_total``); keys: positions ``[2, 3, 6,
2, 3, 6, 7]``, slots ``[12, 13, 14, 12, 13, 14, 15]`` (local ``j`` -> ``table[j // 4] * 4 + j % 4``).
"""

from __future__ import annotations

import numpy as np

from ..constants import PLACEHOLDER_QUERY_INDEX
from ..jit import OK, kernel, warmer

__all__ = ["plan_seqlens", "plan_keys", "local_seqlens", "E_WIDTH", "E_MISSING_BLOCK", "E_NEGATIVE", "E_ROW"]

E_WIDTH = 1  #: the table has fewer columns than the ``err[2]`` blocks an entry needs
E_MISSING_BLOCK = 2  #: entry ``err[1]`` reads block column ``err[2]``, which is -1
E_NEGATIVE = 3  #: length ``err[1]`` is negative (``err[2]``)
E_ROW = 4  #: prompt entry ``err[1]``'s first query row ``err[2]`` (``cu_seqlens_q``) is outside ``query_indices``


@kernel
def _local(length: int, world: int, rank: int, inter: int) -> int:
    cycle = world * inter
    return (length // cycle) * inter + min(max(length % cycle - rank * inter, 0), inter)


@kernel
def local_seqlens(lengths: np.ndarray, world: int, rank: int, inter: int, out: np.ndarray,
                  err: np.ndarray) -> int:
    """``out[i]`` = positions ``0 .. lengths[i] - 1`` rank ``rank`` owns (see :func:`_local`);
    a negative length is :data:`E_NEGATIVE` (nothing written). Example: W=2, I=128, L=300 ->
    rank 0: 172, rank 1: 128."""
    for i in range(lengths.shape[0]):
        if lengths[i] < 0:
            err[0], err[1], err[2] = E_NEGATIVE, i, lengths[i]
            return E_NEGATIVE
    for i in range(lengths.shape[0]):
        out[i] = _local(lengths[i], world, rank, inter)
    return OK


@kernel
def plan_seqlens(is_prompt: bool, lens: np.ndarray, cu_q: np.ndarray, qidx: np.ndarray, table: np.ndarray,
                 world: int, rank: int, inter: int, bs: int, seqlens: np.ndarray, cu: np.ndarray,
                 meta: np.ndarray, err: np.ndarray) -> int:
    """Fill ``seqlens`` [n] / ``cu`` [n+1] (int32) and ``meta = [max_total, total]``.

    Entry ``i``'s keys: prompt ``lens[i+1] - lens[i]`` (``lens`` = ``cu_seqlens_k``), 0 when its
    first query row ``qidx[cu_q[i]]`` is a placeholder; decode ``lens[i]`` (``context_lens``), 0
    when ``qidx[i]`` is. Rank ``r`` holds ``(L // (W*I)) * I + clamp(L % (W*I) - r*I, 0, I)``
    (``r = 0`` when ``W == 1``). Checks: no entry has a negative length or (prompt) a first
    query row outside ``qidx``; after the counts, the table has ``cdiv(max seqlen, bs)``
    columns, and no entry reads a -1 block id (its last read column)."""
    n = seqlens.shape[0]
    r = rank if world > 1 else 0
    max_total = 0
    total = 0
    max_blocks = 0
    cu[0] = 0
    for i in range(n):
        if is_prompt:
            keys = lens[i + 1] - lens[i]
            row = cu_q[i]
            if row < 0 or row > qidx.shape[0]:  # (the caller sized lens, cu_q and qidx: n + 1, n + 1, any)
                err[0], err[1], err[2] = E_ROW, i, row
                return E_ROW
            ph = row < qidx.shape[0] and qidx[row] == PLACEHOLDER_QUERY_INDEX
        else:
            keys = lens[i]
            ph = qidx[i] == PLACEHOLDER_QUERY_INDEX  # (the caller sized qidx: n)
        if keys < 0:
            err[0], err[1], err[2] = E_NEGATIVE, i, keys
            return E_NEGATIVE
        if ph:
            keys = 0
        mine = _local(keys, world, r, inter)
        max_total += _local(keys, world, 0, inter)
        seqlens[i] = mine
        total += mine
        cu[i + 1] = total
        max_blocks = max(max_blocks, (mine + bs - 1) // bs)
    meta[0], meta[1] = max_total, total
    if max_blocks > table.shape[1]:
        err[0], err[2] = E_WIDTH, max_blocks
        return E_WIDTH
    for i in range(n):
        nb = (seqlens[i] + bs - 1) // bs
        if nb > 0 and table[i, nb - 1] < 0:
            err[0], err[1], err[2] = E_MISSING_BLOCK, i, nb
            return E_MISSING_BLOCK
    return OK


@kernel
def plan_keys(seqlens: np.ndarray, table: np.ndarray, world: int, rank: int, inter: int, bs: int,
              slots: np.ndarray, positions: np.ndarray) -> int:
    """Entry-major, local offset ascending: local ``j`` of entry ``i`` sits at ``table[i, j //
    bs] * bs + j % bs`` and has position ``(j // I) * W * I + r * I + j % I`` (walked run by run:
    no division per key)."""
    r = rank if world > 1 else 0
    skip = (world - 1) * inter
    k = 0
    for i in range(seqlens.shape[0]):
        length = seqlens[i]
        p = r * inter
        run = 0
        j = 0
        b = 0
        while j < length:
            base = np.int64(table[i, b]) * bs
            stop = min(length - j, bs)
            for t in range(stop):
                slots[k] = base + t
                positions[k] = p
                k += 1
                p += 1
                run += 1
                if run == inter:
                    run = 0
                    p += skip
            j += stop
            b += 1
    return OK


@warmer
def _warm() -> None:
    """Both kernels on the worked example (decode) and a one-sequence prompt."""
    i64 = np.int64
    table = np.array([[3, 9, 5], [3, 9, 5]], np.int32)
    seqlens, cu, meta, err = np.empty(2, np.int32), np.empty(3, np.int32), np.zeros(2, i64), np.zeros(4, i64)
    plan_seqlens(False, np.array([7, 10], i64), np.zeros(1, i64), np.zeros(2, i64), table, 2, 1, 2, 4,
                 seqlens, cu, meta, err)
    plan_keys(seqlens, table, 2, 1, 2, 4, np.empty(7, i64), np.empty(7, i64))
    local_seqlens(np.array([300], i64), 2, 0, 128, seqlens[:1], err)
    plan_seqlens(True, np.array([0, 10], i64), np.array([0, 4], i64), np.zeros(4, i64), table[:1], 1, 0, 1, 4,
                 seqlens[:1], cu[:2], meta, err)
