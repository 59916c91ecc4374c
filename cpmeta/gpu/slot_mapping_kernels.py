"""The two slot-mapping Triton kernels and the device functions they share.

Imported only when a kernel is first launched (:mod:`cpmeta.gpu.slot_mapping_triton`,
:mod:`cpmeta.gpu.slot_mapping_groups_triton`): it imports triton at the top. The kernels differ in
where a request's block table and geometry come from -- the single-group kernel takes them as
arguments (block size, CP sizes compile-time constants), the groups kernel reads group ``g``'s
from a small parameter table -- and share the rest:

- :func:`check_query_bounds` / :func:`request_rows`: the ``query_start_loc`` checks of the tail
  program, and a request's clamped row range with the order check;
- :func:`pad_tail`: the tail program's rows ``[num_tokens, max_num_tokens)`` = ``pad_id``;
- :func:`map_tile`: one tile of rows once each row's ``(block index, offset, wanted)`` is known --
  the bounded block-table window (``WINDOW`` entries from the smallest block index the tile reads,
  gathered in registers; entries past the window loaded directly), the block-index and int32
  overflow checks, the store and the error bits (``atomic_or`` only on failing lanes).

The window, tiles, masks and error word are described in :mod:`cpmeta.gpu.slot_mapping_triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["check_query_bounds", "request_rows", "pad_tail", "map_tile", "slot_mapping_kernel",
           "slot_mapping_groups_kernel"]


@triton.jit
def pad_tail(out_row, num_tokens, max_num_tokens, pad_id, TILE: tl.constexpr):
    """Rows ``[clamp(num_tokens), max_num_tokens)`` of ``out_row`` = ``pad_id``."""
    lanes = tl.arange(0, TILE)
    pad_start = tl.minimum(tl.maximum(num_tokens, 0), max_num_tokens)
    pad_vals = tl.zeros([TILE], dtype=tl.int32) + pad_id
    for t0 in range(pad_start, max_num_tokens, TILE):
        idx = t0 + lanes
        tl.store(out_row + idx, pad_vals, mask=idx < max_num_tokens)


@triton.jit
def check_query_bounds(qsl_ptr, num_tokens, num_positions, err_ptr,
                       ERR_QUERY_START: tl.constexpr, ERR_NUM_TOKENS: tl.constexpr):
    """``query_start_loc[0] == 0`` and ``query_start_loc[-1] == len(positions)``, else the bits."""
    bad_first = tl.load(qsl_ptr) != 0
    tl.atomic_or(err_ptr, tl.where(bad_first, ERR_QUERY_START, 0), mask=bad_first)
    bad_total = num_tokens != num_positions
    tl.atomic_or(err_ptr, tl.where(bad_total, ERR_NUM_TOKENS, 0), mask=bad_total)


@triton.jit
def request_rows(qsl_ptr, req, num_positions, max_num_tokens, err_ptr, check, ERR_QUERY_ORDER: tl.constexpr):
    """Request ``req``'s rows ``[lo, hi)``, clamped to the positions and the output; a decreasing
    ``query_start_loc`` sets the order bit where ``check`` holds."""
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    bad_order = (end < start) & check
    tl.atomic_or(err_ptr, tl.where(bad_order, ERR_QUERY_ORDER, 0), mask=bad_order)
    return tl.maximum(start, 0), tl.minimum(tl.minimum(end, num_positions), max_num_tokens)


@triton.jit
def map_tile(row_ptr, col_stride, bt_cols, bi, off, want, m, idx, block_size, pad_id, out_row, err_ptr, err,
             TILE: tl.constexpr, WINDOW: tl.constexpr, SLOT_MIN: tl.constexpr, SLOT_MAX: tl.constexpr,
             ERR_BLOCK_INDEX: tl.constexpr, ERR_OVERFLOW: tl.constexpr):
    """Store ``table[bi] * block_size + off`` for the ``want`` rows of a tile (``pad_id`` for the
    others, ``m`` the rows that exist) and OR ``err`` plus the block-index / overflow bits into
    ``err_ptr``."""
    err = err | tl.where(want & (bi >= bt_cols), ERR_BLOCK_INDEX, 0)
    read = want & (bi < bt_cols)
    # ---- bounded window of the block-table row, gathered in registers
    base = tl.min(tl.where(read, bi, bt_cols), axis=0)
    wcols = base + tl.arange(0, WINDOW)
    win = tl.load(row_ptr + wcols * col_stride, mask=wcols < bt_cols, other=0)
    rel = bi - base
    near = read & (rel < WINDOW)
    bn_near = tl.gather(win, tl.where(near, rel, 0).to(tl.int32), 0)
    far = read & (rel >= WINDOW)
    bn_far = tl.load(row_ptr + bi * col_stride, mask=far, other=0)
    slot = tl.where(near, bn_near, bn_far).to(tl.int64) * block_size + off
    err = err | tl.where(read & ((slot > SLOT_MAX) | (slot < SLOT_MIN)), ERR_OVERFLOW, 0)
    tl.store(out_row + idx, tl.where(read, slot, pad_id).to(tl.int32), mask=m)
    tl.atomic_or(err_ptr + tl.arange(0, TILE) * 0, err, mask=err != 0)


@triton.jit
def slot_mapping_kernel(
    qsl_ptr, pos_ptr, bt_ptr, out_ptr, err_ptr,
    num_positions, max_num_tokens, bt_row_stride, bt_col_stride, bt_cols, cp_rank, pad_id,
    BLOCK_SIZE: tl.constexpr, VIRTUAL_BLOCK_SIZE: tl.constexpr, BLOCKS_PER_KV_BLOCK: tl.constexpr,
    CP_WORLD_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr, USE_CP: tl.constexpr, IS_CIRCULAR: tl.constexpr,
    TILE: tl.constexpr, WINDOW: tl.constexpr, SLOT_MIN: tl.constexpr, SLOT_MAX: tl.constexpr,
    ERR_QUERY_START: tl.constexpr, ERR_QUERY_ORDER: tl.constexpr, ERR_NUM_TOKENS: tl.constexpr,
    ERR_NEGATIVE: tl.constexpr, ERR_BLOCK_INDEX: tl.constexpr, ERR_OVERFLOW: tl.constexpr,
):
    """Grid ``(num_reqs + 1,)``: program q < num_reqs maps request q's rows, the last one checks
    ``query_start_loc`` and pads the tail (:func:`cpmeta.gpu.slot_mapping_triton.launch_slot_mapping_kernel`)."""
    req = tl.program_id(0)
    num_reqs = tl.num_programs(0) - 1
    lanes = tl.arange(0, TILE)
    if req == num_reqs:
        # ---- tail program: checks on query_start_loc, then rows [num_tokens, max) = pad.
        num_tokens = tl.load(qsl_ptr + num_reqs)
        check_query_bounds(qsl_ptr, num_tokens, num_positions, err_ptr, ERR_QUERY_START, ERR_NUM_TOKENS)
        pad_tail(out_ptr, num_tokens, max_num_tokens, pad_id, TILE)
    else:
        lo, hi = request_rows(qsl_ptr, req, num_positions, max_num_tokens, err_ptr, True, ERR_QUERY_ORDER)
        row_ptr = bt_ptr + req.to(tl.int64) * bt_row_stride
        for t0 in range(lo, hi, TILE):
            idx = t0 + lanes
            m = idx < hi
            pos = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
            # ---- logical position -> (block index, offset, owned by this rank)
            if IS_CIRCULAR:  # negative positions are padding, not errors
                bi = tl.zeros([TILE], dtype=tl.int64)
                off = pos % BLOCK_SIZE
                want = m & (pos >= 0)
                err = tl.zeros([TILE], dtype=tl.int32)
            elif USE_CP:
                vbi = pos // VIRTUAL_BLOCK_SIZE
                vbo = pos % VIRTUAL_BLOCK_SIZE
                is_local = (vbo // CP_INTERLEAVE) % CP_WORLD_SIZE == cp_rank
                local = (vbo // (CP_WORLD_SIZE * CP_INTERLEAVE)) * CP_INTERLEAVE + vbo % CP_INTERLEAVE
                bi = vbi * BLOCKS_PER_KV_BLOCK + local // BLOCK_SIZE
                off = local % BLOCK_SIZE
                want = m & (pos >= 0) & is_local
                err = tl.where(m & (pos < 0), ERR_NEGATIVE, 0)
            else:
                bi = pos // BLOCK_SIZE
                off = pos % BLOCK_SIZE
                want = m & (pos >= 0)
                err = tl.where(m & (pos < 0), ERR_NEGATIVE, 0)
            map_tile(row_ptr, bt_col_stride, bt_cols, bi, off, want, m, idx, BLOCK_SIZE, pad_id, out_ptr, err_ptr,
                     err, TILE, WINDOW, SLOT_MIN, SLOT_MAX, ERR_BLOCK_INDEX, ERR_OVERFLOW)


@triton.jit
def slot_mapping_groups_kernel(
    qsl_ptr, pos_ptr, bt_ptr, prm_ptr, out_ptr, err_ptr,
    num_positions, max_num_tokens, cp_rank, pad_id,
    CP_WORLD_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr, USE_CP: tl.constexpr,
    TILE: tl.constexpr, WINDOW: tl.constexpr, NPRM: tl.constexpr,
    SLOT_MIN: tl.constexpr, SLOT_MAX: tl.constexpr,
    ERR_QUERY_START: tl.constexpr, ERR_QUERY_ORDER: tl.constexpr, ERR_NUM_TOKENS: tl.constexpr,
    ERR_NEGATIVE: tl.constexpr, ERR_BLOCK_INDEX: tl.constexpr, ERR_OVERFLOW: tl.constexpr,
):
    """Grid ``(num_reqs + 1, n_groups)``: program ``(q, g)`` maps request q's rows through group g's
    table into row g of the output; ``(num_reqs, g)`` pads that row's tail, group 0's also checks
    ``query_start_loc`` (:mod:`cpmeta.gpu.slot_mapping_groups_triton`)."""
    req = tl.program_id(0)
    grp = tl.program_id(1)
    num_reqs = tl.num_programs(0) - 1
    lanes = tl.arange(0, TILE)
    prm = prm_ptr + grp * NPRM
    out_row = out_ptr + grp.to(tl.int64) * max_num_tokens
    if req == num_reqs:
        num_tokens = tl.load(qsl_ptr + num_reqs)
        if grp == 0:  # the query_start_loc checks once, not once per group
            check_query_bounds(qsl_ptr, num_tokens, num_positions, err_ptr, ERR_QUERY_START, ERR_NUM_TOKENS)
        pad_tail(out_row, num_tokens, max_num_tokens, pad_id, TILE)
    else:
        bt_off = tl.load(prm)
        row_stride = tl.load(prm + 1)
        col_stride = tl.load(prm + 2)
        bt_cols = tl.load(prm + 3)
        bs = tl.load(prm + 4)
        vbs = tl.load(prm + 5)
        bpk = tl.load(prm + 6)
        circ = tl.load(prm + 7)
        lo, hi = request_rows(qsl_ptr, req, num_positions, max_num_tokens, err_ptr, grp == 0, ERR_QUERY_ORDER)
        row_ptr = bt_ptr + bt_off + req.to(tl.int64) * row_stride
        for t0 in range(lo, hi, TILE):
            idx = t0 + lanes
            m = idx < hi
            pos = tl.load(pos_ptr + idx, mask=m, other=0).to(tl.int64)
            if USE_CP:  # circular + CP was rejected on the host
                vbo = pos % vbs
                is_local = (vbo // CP_INTERLEAVE) % CP_WORLD_SIZE == cp_rank
                local = (vbo // (CP_WORLD_SIZE * CP_INTERLEAVE)) * CP_INTERLEAVE + vbo % CP_INTERLEAVE
                bi = (pos // vbs) * bpk + local // bs
                off = local % bs
                want = m & (pos >= 0) & is_local
            else:
                bi = tl.where(circ != 0, 0, pos // bs)
                off = pos % bs
                want = m & (pos >= 0)
            err = tl.where(m & (pos < 0) & (circ == 0), ERR_NEGATIVE, 0)
            map_tile(row_ptr, col_stride, bt_cols, bi, off, want, m, idx, bs, pad_id, out_row, err_ptr,
                     err, TILE, WINDOW, SLOT_MIN, SLOT_MAX, ERR_BLOCK_INDEX, ERR_OVERFLOW)
