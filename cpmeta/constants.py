"""Named constants shared by the builders, the mirror and the slot-mapping code."""

from __future__ import annotations

__all__ = [
    "PAD_SLOT_ID",
    "PLACEHOLDER_QUERY_INDEX",
    "INT32_MAX",
    "ATTN_INDEX_ALIGN",
    "TABLE_WIDTH_ALIGN",
    "NO_SOURCE_BLOCK",
]

#: Slot id meaning "write nothing" in every slot mapping.
PAD_SLOT_ID: int = -1

#: ``query_indices`` value of a placeholder sequence's rows. A prime far above any batch size:
#: indexing a per-sequence table with it faults loudly instead of silently reading row -1.
PLACEHOLDER_QUERY_INDEX: int = 998244353

#: Largest value an int32 index tensor can hold.
INT32_MAX: int = 2**31 - 1

#: Width of the expanded ``kv_ca_index[n]`` rows is rounded up to a multiple of this.
ATTN_INDEX_ALIGN: int = 128

#: Decode ``block_tables``' width (the batch's widest row) is rounded up to a multiple of this
#: (at most ``max_num_blocks``): the layout, and every arena and frame plan keyed by it, changes
#: once per 16 blocks of growth of the longest table instead of every block (measured 2026-12-04 on
#: the bench's decode-64 trace: a new width every ~7 steps, a build at a new width ~200 us against
#: ~19 us).
TABLE_WIDTH_ALIGN: int = 16

#: ``src_block`` of a load-plan segment that zero-fills instead of copying.
NO_SOURCE_BLOCK: int = -1
