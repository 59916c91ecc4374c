"""The CUDA path of :func:`cpmeta.compute_slot_mapping_groups`: ONE launch for every KV group.

Grid ``(num_reqs + 1, n_groups)``: program ``(q, g)`` maps request ``q``'s rows through group
``g``'s block table into row ``g`` of the ``[n_groups, max_num_tokens]`` output; program
``(num_reqs, g)`` pads that row's tail (group 0's also checks ``query_start_loc``), as in
:mod:`cpmeta.gpu.slot_mapping_triton` (tiles, bounded block-table window, masked reads, error
bits: see there). The kernel is :func:`cpmeta.gpu.slot_mapping_kernels.slot_mapping_groups_kernel`;
the tail padding and the per-tile window read are device functions it shares with the
single-group kernel.

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

from collections import OrderedDict
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..cp.slot_mapping_errors import SlotMappingError
from .slot_mapping_triton import choose_tile, window_size

if TYPE_CHECKING:  # pragma: no cover
    from ..cp.slot_mapping_params import SlotMappingParams

__all__ = ["launch_slot_mapping_groups_kernel", "group_param_table", "NUM_GROUP_PARAMS"]

#: Columns of the per-group parameter table (see the module docstring).
NUM_GROUP_PARAMS: int = 8
_INT32_MAX: int = 2**31 - 1
_INT32_MIN: int = -(2**31)
#: Parameter tables kept on the device, keyed by the tables' addresses/strides and the params.
_TABLE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_TABLE_CACHE_SIZE: int = 64


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
    from .slot_mapping_kernels import slot_mapping_groups_kernel  # imports triton: first launch only

    slot_mapping_groups_kernel[(qsl.shape[0], len(params))](
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
