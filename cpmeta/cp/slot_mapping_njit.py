"""The slot mapping's compiled CPU kernel (docs/design.md sections 11 and 17): one call fills a row of slots.

:func:`slot_fill` is the CPU path of :func:`cpmeta.compute_slot_mapping` (one call per KV-cache
group in :func:`cpmeta.compute_slot_mapping_groups`); the Triton kernels in ``cpmeta/gpu`` are the
CUDA path and give the same slots. Scalar arguments travel in one int64 array ``p`` (``P_*``,
:func:`params_array`). The kernel never raises: it returns the OR of the
:class:`~cpmeta.cp.slot_mapping_errors.SlotMappingError` bits of every failed check (what
``error_out`` records) and fills ``err = [bit, index, request, 0]`` with the check the wrapper
raises first (``query_start_loc`` layout, negative position, block index, int32 slot; the first
token of that check).

Worked example (plain, block_size 4): ``query_start_loc = [0, 2, 3]``, positions ``[5, 6, 0]``,
block table ``[[7, 3], [9, 9]]``, 5 rows -> ``[3*4+1, 3*4+2, 9*4+0, -1, -1] = [13, 14, 36, -1, -1]``.
CP (W = 2, I = 128, block = kvb = 128, rank 0): position 300 -> virtual block 1, offset 44, owned
by rank 0 at local 44 -> block index 1, offset 44.
"""

from __future__ import annotations

import numpy as np

from ..constants import INT32_MAX
from ..jit import kernel, warmer
from .slot_mapping_params import SlotMappingParams

__all__ = ["slot_fill", "params_array", "B_QUERY_START", "B_QUERY_ORDER", "B_NUM_TOKENS",
           "B_NEGATIVE_POSITION", "B_BLOCK_INDEX", "B_SLOT_OVERFLOW"]

# the SlotMappingError bits (the enum's values; a kernel reads plain ints)
B_QUERY_START, B_QUERY_ORDER, B_NUM_TOKENS, B_NEGATIVE_POSITION, B_BLOCK_INDEX, B_SLOT_OVERFLOW = \
    1, 2, 4, 8, 16, 32
INT32_MIN = -(2**31)
# entries of ``p``
P_BS, P_KVB, P_BPK, P_WORLD, P_RANK, P_INTER, P_PAD, P_CIRCULAR = range(8)


def params_array(prm: SlotMappingParams) -> np.ndarray:
    """``p`` of a :class:`SlotMappingParams`. Example: plain block 16 -> ``[16, 16, 1, 1, 0, 1,
    -1, 0]``."""
    return np.array([prm.block_size, prm.kv_block_size, prm.blocks_per_kv_block, prm.cp_world_size,
                     prm.cp_rank, prm.cp_interleave, prm.pad_id, int(prm.circular)], np.int64)


@kernel
def slot_fill(qsl: np.ndarray, pos: np.ndarray, table: np.ndarray, p: np.ndarray, out: np.ndarray,
              err: np.ndarray) -> int:
    """``out[t]`` = the slot of token ``t`` (``pad`` when this rank writes none), ``out[n_tok:]``
    = ``pad``; returns the error bits (0: all good). Token ``t`` belongs to request ``q`` with
    ``qsl[q] <= t < qsl[q+1]``; its block index / offset: circular ``0, pos % bs``; plain
    ``pos // bs, pos % bs``; CP (``vbs = kvb * W``): owned when ``((pos % vbs) // I) % W == rank``,
    local ``((pos % vbs) // (W*I)) * I + pos % I``, block ``(pos // vbs) * (kvb // bs) + local //
    bs``, offset ``local % bs``. A failed token reads nothing (no index out of bounds on bad
    input) and gets ``pad``."""
    bs, kvb, world, rank, inter, pad = p[P_BS], p[P_KVB], p[P_WORLD], p[P_RANK], p[P_INTER], p[P_PAD]
    bpk, circular = p[P_BPK], p[P_CIRCULAR] != 0
    n_tok, num_reqs = pos.shape[0], qsl.shape[0] - 1
    rows, cols = table.shape[0], table.shape[1]
    use_rows = min(num_reqs, rows)
    vbs = kvb * world
    bits = 0
    order_at = -1  # the first failing index of each check with one (token or request)
    neg_at, neg_req, blk_at, blk_req, ovf_at, ovf_req = -1, 0, -1, 0, -1, 0
    if qsl[0] != 0:
        bits |= B_QUERY_START
    for i in range(num_reqs):
        if qsl[i + 1] < qsl[i]:
            bits |= B_QUERY_ORDER
            order_at = i
            break
    if qsl[num_reqs] != n_tok:
        bits |= B_NUM_TOKENS
    q = 0
    for t in range(n_tok):
        while q < num_reqs and qsl[q + 1] <= t:
            q += 1
        x = pos[t]
        out[t] = pad
        if x < 0:
            if not circular:
                if neg_at < 0:
                    neg_at, neg_req = t, q
                bits |= B_NEGATIVE_POSITION
            continue
        if circular:
            bi, off = 0, x % bs
        elif world == 1:
            bi, off = x // bs, x % bs
        else:
            vbo = x % vbs
            if (vbo // inter) % world != rank:
                continue
            local = (vbo // (world * inter)) * inter + vbo % inter
            bi, off = (x // vbs) * bpk + local // bs, local % bs
        if q >= use_rows:
            continue
        if bi >= cols:
            if blk_at < 0:
                blk_at, blk_req = t, q
            bits |= B_BLOCK_INDEX
            continue
        slot = np.int64(table[q, bi]) * bs + off
        if slot > INT32_MAX or slot < INT32_MIN:
            if ovf_at < 0:
                ovf_at, ovf_req = t, q
            bits |= B_SLOT_OVERFLOW
            continue
        out[t] = slot
    for t in range(n_tok, out.shape[0]):
        out[t] = pad
    if bits & B_QUERY_START:  # the check raised first: in bit order
        err[0] = B_QUERY_START
    elif bits & B_QUERY_ORDER:
        err[0], err[1] = B_QUERY_ORDER, order_at
    elif bits & B_NUM_TOKENS:
        err[0] = B_NUM_TOKENS
    elif neg_at >= 0:
        err[0], err[1], err[2] = B_NEGATIVE_POSITION, neg_at, neg_req
    elif blk_at >= 0:
        err[0], err[1], err[2] = B_BLOCK_INDEX, blk_at, blk_req
    elif ovf_at >= 0:
        err[0], err[1], err[2] = B_SLOT_OVERFLOW, ovf_at, ovf_req
    return bits


@warmer
def _warm() -> None:
    """The worked example with an int32 table (the usual dtype) and an int64 one."""
    i64 = np.int64
    prm = SlotMappingParams(4, 5, 4, 1, 1, 0, 1, -1, False)
    for dt in (np.int32, np.int64):
        slot_fill(np.array([0, 2, 3], i64), np.array([5, 6, 0], i64), np.array([[7, 3], [9, 9]], dt),
                  params_array(prm), np.empty(5, np.int32), np.zeros(4, i64))
