"""The CUDA path of :func:`cpmeta.compute_slot_mapping_groups`: ONE launch for every KV group.

Grid ``(num_reqs + 1, n_groups)``: program ``(q, g)`` maps request ``q``'s rows through group
``g``'s block table into row ``g`` of the ``[n_groups, max_num_tokens]`` output; program
``(num_reqs, g)`` pads that row's tail (group 0's also checks ``query_start_loc``), as in
:mod:`cpmeta.gpu.slot_mapping_triton` (tiles, bounded block-table window, masked reads, error
bits: see there).

Per-group geometry is a small int64 parameter table ``[n_groups, 8]`` on the device, uploaded
once per distinct set of tables and kept in a small cache (so replays and CUDA-graph captures
issue no host-to-device copy)::

    col: 0 table offset | 1 row stride | 2 col stride | 3 cols | 4 block_size | 5 kvb * W
         6 kvb // block_size | 7 circular

Block tables of different groups are separate tensors; the kernel reaches group ``g``'s table
as ``base + offset[g]`` elements from group 0's pointer (same dtype; a table of another dtype
is converted first). Block sizes are runtime values here (they differ per group), so the
divisions are real divisions; the CP world size and interleave, shared by all groups, stay
compile-time constants. The window is sized for the smallest block size of the call.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..cp.slot_mapping_errors import SlotMappingError
from .slot_mapping_triton import choose_tile, window_size

if TYPE_CHECKING:  # pragma: no cover
    from ..cp.slot_mapping import SlotMappingParams

__all__ = ["launch_slot_mapping_groups_kernel", "group_param_table", "NUM_GROUP_PARAMS"]

#: Columns of the per-group parameter table (see the module docstring).
NUM_GROUP_PARAMS: int = 8
_INT32_MAX: int = 2**31 - 1
_INT32_MIN: int = -(2**31)
#: Parameter tables kept on the device, keyed by the tables' addresses/strides and the params.
_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE: int = 64


@functools.cache
def _kernel() -> Callable[..., Any]:
    """Build (once) the jitted kernel; importing triton here keeps CPU-only imports light."""
    import triton
    import triton.language as tl

    @triton.jit
    def _slot_mapping_groups_kernel(
        qsl_ptr, pos_ptr, bt_ptr, prm_ptr, out_ptr, err_ptr,
        num_positions, max_num_tokens, cp_rank, pad_id,
        CP_WORLD_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr, USE_CP: tl.constexpr,
        TILE: tl.constexpr, WINDOW: tl.constexpr, NPRM: tl.constexpr,
        SLOT_MIN: tl.constexpr, SLOT_MAX: tl.constexpr,
        ERR_QUERY_START: tl.constexpr, ERR_QUERY_ORDER: tl.constexpr, ERR_NUM_TOKENS: tl.constexpr,
        ERR_NEGATIVE: tl.constexpr, ERR_BLOCK_INDEX: tl.constexpr, ERR_OVERFLOW: tl.constexpr,
    ):
        req = tl.program_id(0)
        grp = tl.program_id(1)
        num_reqs = tl.num_programs(0) - 1
        lanes = tl.arange(0, TILE)
        prm = prm_ptr + grp * NPRM
        out_row = out_ptr + grp.to(tl.int64) * max_num_tokens
        if req == num_reqs:
            num_tokens = tl.load(qsl_ptr + num_reqs)
            if grp == 0:  # the query_start_loc checks once, not once per group
                bad_first = tl.load(qsl_ptr) != 0
                tl.atomic_or(err_ptr, tl.where(bad_first, ERR_QUERY_START, 0), mask=bad_first)
                bad_total = num_tokens != num_positions
                tl.atomic_or(err_ptr, tl.where(bad_total, ERR_NUM_TOKENS, 0), mask=bad_total)
            pad_start = tl.minimum(tl.maximum(num_tokens, 0), max_num_tokens)
            pad_vals = tl.zeros([TILE], dtype=tl.int32) + pad_id
            for t0 in range(pad_start, max_num_tokens, TILE):
                idx = t0 + lanes
                tl.store(out_row + idx, pad_vals, mask=idx < max_num_tokens)
        else:
            bt_off = tl.load(prm)
            row_stride = tl.load(prm + 1)
            col_stride = tl.load(prm + 2)
            bt_cols = tl.load(prm + 3)
            bs = tl.load(prm + 4)
            vbs = tl.load(prm + 5)
            bpk = tl.load(prm + 6)
            circ = tl.load(prm + 7)
            start = tl.load(qsl_ptr + req)
            end = tl.load(qsl_ptr + req + 1)
            bad_order = (end < start) & (grp == 0)
            tl.atomic_or(err_ptr, tl.where(bad_order, ERR_QUERY_ORDER, 0), mask=bad_order)
            lo = tl.maximum(start, 0)
            hi = tl.minimum(tl.minimum(end, num_positions), max_num_tokens)
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
                err = err | tl.where(want & (bi >= bt_cols), ERR_BLOCK_INDEX, 0)
                read = want & (bi < bt_cols)
                base = tl.min(tl.where(read, bi, bt_cols), axis=0)
                wcols = base + tl.arange(0, WINDOW)
                win = tl.load(row_ptr + wcols * col_stride, mask=wcols < bt_cols, other=0)
                rel = bi - base
                near = read & (rel < WINDOW)
                bn_near = tl.gather(win, tl.where(near, rel, 0).to(tl.int32), 0)
                far = read & (rel >= WINDOW)
                bn_far = tl.load(row_ptr + bi * col_stride, mask=far, other=0)
                slot = tl.where(near, bn_near, bn_far).to(tl.int64) * bs + off
                err = err | tl.where(read & ((slot > SLOT_MAX) | (slot < SLOT_MIN)), ERR_OVERFLOW, 0)
                tl.store(out_row + idx, tl.where(read, slot, pad_id).to(tl.int32), mask=m)
                tl.atomic_or(err_ptr + lanes * 0, err, mask=err != 0)

    return _slot_mapping_groups_kernel


def group_param_table(
    tables: Sequence[torch.Tensor], params: Sequence["SlotMappingParams"],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(group 0's table, the ``[n_groups, 8]`` int64 parameter table on its device).

    Every table has group 0's dtype (the launcher converts). Example: two int32 tables
    whose storages start 4096 bytes apart -> offsets ``[0, 1024]`` elements.
    """
    base = tables[0]
    rows = []
    for t, prm in zip(tables, params):
        delta = t.data_ptr() - base.data_ptr()
        assert delta % base.element_size() == 0, "tables of one dtype are element-aligned"
        rows.append((delta // base.element_size(), t.stride(0), t.stride(1), t.shape[1],
                     prm.block_size, prm.kv_block_size * prm.cp_world_size, prm.blocks_per_kv_block,
                     int(prm.circular)))
    key = (base.device, base.data_ptr(), tuple(rows))
    table = _TABLE_CACHE.get(key)
    if table is None:
        table = torch.tensor(rows, dtype=torch.int64).to(base.device)
        _TABLE_CACHE[key] = table
        while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    else:
        _TABLE_CACHE.move_to_end(key)
    return base, table


def launch_slot_mapping_groups_kernel(
    qsl: torch.Tensor, positions: torch.Tensor, tables: Sequence[torch.Tensor], out: torch.Tensor,
    err: torch.Tensor, params: Sequence["SlotMappingParams"], *, tile: Optional[int] = None,
    num_warps: Optional[int] = None,
) -> None:
    """Launch on validated arguments (no host sync; errors OR into ``err``).

    ``out`` [n_groups, max_num_tokens] int32 contiguous; ``params[g]`` from ``make_params``
    (same CP arguments in every group). ``tile``/``num_warps`` default to :func:`choose_tile`.
    """
    converted = [t if t.dtype == tables[0].dtype else t.to(tables[0].dtype) for t in tables]
    base, table = group_param_table(converted, params)
    auto_tile, auto_warps = choose_tile(positions.shape[0], qsl.shape[0] - 1)
    tile = auto_tile if tile is None else tile
    num_warps = auto_warps if num_warps is None else num_warps
    p0, E = params[0], SlotMappingError
    _kernel()[(qsl.shape[0], len(params))](
        qsl, positions, base, table, out, err,
        positions.shape[0], p0.max_num_tokens, p0.cp_rank, p0.pad_id,
        CP_WORLD_SIZE=p0.cp_world_size, CP_INTERLEAVE=p0.cp_interleave, USE_CP=p0.use_cp, TILE=tile,
        WINDOW=window_size(tile, min(p.block_size for p in params)), NPRM=NUM_GROUP_PARAMS,
        SLOT_MIN=_INT32_MIN, SLOT_MAX=_INT32_MAX,
        ERR_QUERY_START=int(E.QUERY_START), ERR_QUERY_ORDER=int(E.QUERY_ORDER),
        ERR_NUM_TOKENS=int(E.NUM_TOKENS), ERR_NEGATIVE=int(E.NEGATIVE_POSITION),
        ERR_BLOCK_INDEX=int(E.BLOCK_INDEX), ERR_OVERFLOW=int(E.SLOT_OVERFLOW),
        num_warps=num_warps,
    )
