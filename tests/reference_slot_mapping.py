"""Literal per-token reference of ``cpmeta.compute_slot_mapping`` (docs/design.md section 11).

Plain Python loops over requests and tokens, written straight from the formulas; the test oracle.
Inputs are Python lists; the caller guarantees they are valid (this function does not validate).
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["reference_slot_mapping", "owner_rank", "rank_local_index"]


def owner_rank(pos: int, cp_world_size: int, cp_interleave: int) -> int:
    """Rank holding the KV of ``pos``: ``(pos // interleave) % world`` (independent of kvb)."""
    return (pos // cp_interleave) % cp_world_size


def rank_local_index(pos: int, cp_world_size: int, cp_interleave: int) -> int:
    """How many positions before ``pos`` its owner rank holds (the owner's dense KV index).

    Counted by walking the positions one by one -- deliberately not the closed formula.
    """
    owner = owner_rank(pos, cp_world_size, cp_interleave)
    return sum(1 for p in range(pos) if owner_rank(p, cp_world_size, cp_interleave) == owner)


def reference_slot_mapping(
    query_start_loc: Sequence[int],
    positions: Sequence[int],
    block_table: Sequence[Sequence[int]],
    block_size: int,
    *,
    max_num_tokens: int,
    kv_cache_block_size: Optional[int] = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    pad_id: int = -1,
    circular: bool = False,
) -> list[int]:
    """Slot of every row, ``pad_id`` for non-local / padded rows, length ``max_num_tokens``."""
    kvb = kv_cache_block_size or block_size
    out = [pad_id] * max_num_tokens
    for q in range(len(query_start_loc) - 1):
        for t in range(query_start_loc[q], query_start_loc[q + 1]):
            pos = positions[t]
            if circular:
                if pos >= 0:
                    out[t] = block_table[q][0] * block_size + pos % block_size
                continue
            if cp_world_size == 1:
                out[t] = block_table[q][pos // block_size] * block_size + pos % block_size
                continue
            vbs = kvb * cp_world_size
            vbi, vbo = pos // vbs, pos % vbs
            if (vbo // cp_interleave) % cp_world_size != cp_rank:
                continue
            local = (vbo // (cp_world_size * cp_interleave)) * cp_interleave + vbo % cp_interleave
            bi = vbi * (kvb // block_size) + local // block_size
            out[t] = block_table[q][bi] * block_size + local % block_size
    return out
