"""Per-key plain-Python reference of ``cpmeta.cp_kv_read_plan`` (docs/design.md section 14).

Walks every key position of every entry (prompt: sequence, decode: query row), keeps the ones
rank ``r`` owns (``(p // I) % W == r``; every key when ``W == 1``), numbers them 0, 1, ... in
position order (the local offset ``j``) and reads the slot through the entry's table:
``table[j // block_size] * block_size + j % block_size``. Placeholders hold no key.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpmeta import InputMetadata, MetadataConfig
from cpmeta.constants import PLACEHOLDER_QUERY_INDEX

__all__ = ["RefPlan", "ref_read_plan", "ref_entries"]


@dataclass
class RefPlan:
    seqlens: list[int]
    cu_seqlens: list[int]
    positions: list[int]
    slots: list[int]
    max_total: int


def ref_entries(md: InputMetadata) -> list[tuple[int, bool, list[int]]]:
    """(keys, is_placeholder, table row) per entry, read one by one from ``md``."""
    qi = md.query_indices.tolist()
    if md.is_prompt:
        cu_k, cu_q = md.cu_seqlens_k.tolist(), md.cu_seqlens_q.tolist()
        tables = md.seq_block_tables.tolist()
        return [(cu_k[s + 1] - cu_k[s], qi[cu_q[s]] == PLACEHOLDER_QUERY_INDEX, tables[s])
                for s in range(len(cu_k) - 1)]
    ctx, tables = md.context_lens.tolist(), md.block_tables.tolist()
    return [(ctx[i], qi[i] == PLACEHOLDER_QUERY_INDEX, tables[i]) for i in range(len(ctx))]


def _owned(keys: int, world: int, rank: int, interleave: int) -> list[int]:
    return [p for p in range(keys) if world == 1 or (p // interleave) % world == rank]


def ref_read_plan(md: InputMetadata, cfg: MetadataConfig, cp_rank: int) -> RefPlan:
    """The plan of rank ``cp_rank``, key by key."""
    w, i, bs = cfg.kv_cp_world_size, cfg.kv_cp_interleave, cfg.block_size
    seqlens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    max_total = 0
    for keys, placeholder, table in ref_entries(md):
        if placeholder:
            keys = 0
        mine = _owned(keys, w, cp_rank, i)
        max_total += len(_owned(keys, w, 0, i))
        seqlens.append(len(mine))
        for j, p in enumerate(mine):
            positions.append(p)
            slots.append(table[j // bs] * bs + j % bs)
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    return RefPlan(seqlens, cu, positions, slots, max_total)
