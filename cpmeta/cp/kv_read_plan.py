"""The read side of CP-interleaved paged KV: which keys a rank holds, and where (DESIGN 14).

:func:`cpmeta.compute_slot_mapping` (section 11) writes key position ``p`` on rank
``(p // I) % W`` (``W = cfg.kv_cp_world_size``, ``I = cfg.kv_cp_interleave``), packed in position
order: the rank's ``j``-th key (local offset ``j``) has position ``(j // I) * W * I + r * I + j % I``
and lives at slot ``block_table[j // block_size] * block_size + j % block_size``.
:func:`cp_kv_read_plan` states that for a whole step, as a paged-attention kernel takes it
(block table + cache lengths), plus the flat slots / positions a gathering consumer needs.

Worked example (``W=2, I=2, block_size=4``, one sequence of ``seqlen_k=10`` keys, table
``[3, 9, 5]``; the table is per rank, here the same ids for the picture)::

    position      0  1  2  3  4  5  6  7  8  9
    owner rank    0  0  1  1  0  0  1  1  0  0        (p // 2) % 2
    rank 0: seqlens [6], local 0..5 = positions 0 1 4 5 8 9, slots 12 13 14 15 36 37
    rank 1: seqlens [4], local 0..3 = positions 2 3 6 7,     slots 12 13 14 15
    max_total = 6 (rank 0's), on both ranks

A query row at position ``p`` may see, on rank ``r``, the first ``cp_local_seqlens(p + 1, W, r, I)``
local keys of its sequence (those with position ``<= p``): at ``p = 6`` rank 0 sees 4 (positions
0 1 4 5) and rank 1 sees 3 (positions 2 3 6); 4 + 3 = 7 = p + 1. The ranks' partial results are
combined by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import MetadataConfig
from ..constants import INT32_MAX, PLACEHOLDER_QUERY_INDEX
from ..lifetime import Generation, check, stamp
from ..metadata import InputMetadata
from .kv_shard import local_lengths

__all__ = ["KVReadPlan", "cp_kv_read_plan"]

_I64 = torch.int64
_I32 = torch.int32


@dataclass(slots=True, eq=False)
class KVReadPlan:
    """Keys one rank holds for one step, per entry (prompt: sequence; decode: query row).

    ``slots`` and ``positions`` are computed on first access (one device pass for both) and
    cached together; every other field is filled by :func:`cp_kv_read_plan`. ``block_tables`` is
    the metadata's own table: when that lives in a persistent broadcast arena
    (``persistent_outputs``), the plan is valid only while the metadata is, and ``slots`` /
    ``positions`` raise ``cpmeta.lifetime.StaleResultError`` once a later broadcast rewrote the
    table (instead of mixing the new tables with this plan's seqlens).
    """

    seqlens: torch.Tensor  # [n] int32, keys this rank holds per entry (0 for placeholders)
    cu_seqlens: torch.Tensor  # [n+1] int32, exclusive prefix sums of seqlens
    block_tables: torch.Tensor  # [n, width] int32, local offset j -> row[j // bs] * bs + j % bs
    max_total: int  # most keys any rank holds in this plan (rank 0's sum): all-gather size
    block_size: int  # tokens per paged block (cfg.block_size)
    cp_rank: int  # the rank this plan is for
    cp_world_size: int  # W: ranks the KV is sharded over (cfg.kv_cp_world_size; 1 = not sharded)
    cp_interleave: int  # I: consecutive positions per rank (cfg.kv_cp_interleave)
    is_prompt: bool  # True: one entry per sequence; False: one entry per decode query row
    _keys: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None, repr=False)  # (slots, positions)
    _stamp: Optional[tuple[Generation, int]] = field(default=None, repr=False)  # block_tables' arena

    @property
    def total(self) -> int:
        """Keys this rank holds in the plan: ``cu_seqlens[-1]`` (reads one value to the host)."""
        return int(self.cu_seqlens[-1])

    @property
    def slots(self) -> torch.Tensor:
        """[total] int64: slot of each local key, entry-major, local offset ascending."""
        check(self._stamp, "KVReadPlan.slots")
        if self._keys is None:
            self._keys = self._materialize()
        return self._keys[0]

    @property
    def positions(self) -> torch.Tensor:
        """[total] int64: global key position of each local key (ascending within an entry)."""
        check(self._stamp, "KVReadPlan.positions")
        if self._keys is None:
            self._keys = self._materialize()
        return self._keys[1]

    def _materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block by block (no per-key division): block ``b`` of entry ``i`` holds local offsets
        ``b*bs .. b*bs+bs-1`` at slots ``table[i, b]*bs + t`` and positions ``b*bs*W + r*I +
        pattern[t]`` with ``pattern[t] = (t // I) * W * I + t % I`` (``I`` divides ``bs``, so
        every block starts a fresh group of I); the last block of an entry is cut to its keys.
        Returns ``(slots, positions)``. Example (W=2, I=2, bs=4, rank 1): pattern [0, 1, 4, 5];
        block 1 -> positions 10 11 14 15."""
        dev, n, (w, i, bs) = self.seqlens.device, self.seqlens.shape[0], \
            (self.cp_world_size, self.cp_interleave, self.block_size)
        lens = self.seqlens.to(_I64)
        nblk = (lens + bs - 1) // bs  # [n] blocks per entry (n divisions, not one per key)
        cu_blk = torch.zeros(n + 1, dtype=_I64, device=dev)
        cu_blk[1:] = nblk.cumsum(0)
        n_blk = int(cu_blk[-1])
        entry = torch.repeat_interleave(torch.arange(n, device=dev, dtype=_I64), nblk, output_size=n_blk)
        b = torch.arange(n_blk, device=dev, dtype=_I64) - cu_blk[entry]  # block index in its entry
        width = self.block_tables.shape[1]
        ids = self.block_tables.reshape(-1).index_select(0, entry * width + b)
        # per-key work in int32 where the slots fit (int64 multiplies are not vectorized on x86
        # CPUs: several times slower); positions are < seqlen_k, so they always fit
        dt = _I32 if n_blk == 0 or int(ids.max()) <= (INT32_MAX - bs + 1) // bs else _I64
        t = torch.arange(bs, device=dev, dtype=dt)
        keep = t[None, :] < (lens[entry] - b * bs).to(dt)[:, None]  # cut the last blocks
        rank = self.cp_rank if w > 1 else 0
        pattern = (t // i) * (w * i) + t % i
        both = torch.stack([ids.to(dt)[:, None] * bs + t[None, :],
                            (b.to(dt) * (bs * w) + rank * i)[:, None] + pattern[None, :]])
        slots, positions = both.view(2, -1)[:, keep.view(-1)].to(_I64)  # (masked_select: 2x slower)
        return slots, positions


def _check_args(md: InputMetadata, cfg: MetadataConfig, cp_rank: int) -> None:
    if not isinstance(md, InputMetadata):
        raise TypeError(f"md: expected InputMetadata, got {type(md).__name__}")
    if not isinstance(cfg, MetadataConfig):
        raise TypeError(f"cfg: expected MetadataConfig, got {type(cfg).__name__}")
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool):
        raise TypeError(f"cp_rank: expected an int, got {type(cp_rank).__name__}")
    w = cfg.kv_cp_world_size
    if cp_rank < 0 or (w > 1 and cp_rank >= w):
        bound = f"0 <= cp_rank < kv_cp_world_size ({w})" if w > 1 else "cp_rank >= 0"
        raise ValueError(f"cp_rank: expected {bound}, got {cp_rank}")
    if md.is_prompt is None:
        raise ValueError("md.is_prompt: expected prompt or decode metadata, got None")
    need = ("cu_seqlens_q", "cu_seqlens_k", "query_indices", "seq_block_tables") if md.is_prompt \
        else ("context_lens", "query_indices", "block_tables")
    for name in need:
        if getattr(md, name) is None:
            path = "prompt" if md.is_prompt else "decode"
            raise ValueError(f"md.{name}: expected a tensor on {path} metadata, got None")
    if md.yoco_consumer_query_indices is not None and md.query_indices is md.yoco_consumer_query_indices:
        raise ValueError("md: a YoCo consumer view (query_indices are rows there); pass the metadata "
                         "it was taken from (the keys are the same)")


def _entries(md: InputMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(key count per entry [n] int64, placeholders 0; the entries' block table [n, width])."""
    assert md.query_indices is not None
    if md.is_prompt:
        assert md.cu_seqlens_k is not None and md.cu_seqlens_q is not None
        cu_k = md.cu_seqlens_k.to(_I64)
        keys = cu_k[1:] - cu_k[:-1]
        first_row = md.cu_seqlens_q.to(device=md.query_indices.device, dtype=_I64)[:-1]
        ph = md.query_indices[first_row] == PLACEHOLDER_QUERY_INDEX
        table = md.seq_block_tables
    else:
        assert md.context_lens is not None
        keys = md.context_lens.to(_I64)
        ph = md.query_indices == PLACEHOLDER_QUERY_INDEX
        table = md.block_tables
    assert table is not None
    return keys.masked_fill(ph.to(keys.device), 0), table


def _check_tables(md: InputMetadata, table: torch.Tensor, mine: torch.Tensor, rank0: torch.Tensor,
                  bs: int, cp_rank: int) -> int:
    """Refuse a table too narrow for, or with a -1 block among, the blocks an entry reads (one
    host sync for every check, shared with the answer). Returns ``max_total`` (rank 0's sum)."""
    n, width = table.shape
    nblocks = (mine + bs - 1) // bs  # blocks this rank reads per entry
    if n and width:
        col = (nblocks - 1).clamp(0, width - 1).to(table.device)
        last = table[torch.arange(n, device=table.device), col].to(mine.device)
    else:
        last = torch.zeros_like(mine)
    bad = (nblocks > 0) & (last < 0)
    stats = torch.stack([rank0.sum(), torch.cat([nblocks, nblocks.new_zeros(1)]).max(), bad.sum()])
    max_total, max_blocks, n_bad = (int(v) for v in stats.tolist())
    name = "seq_block_tables" if md.is_prompt else "block_tables"
    if max_blocks > width:
        raise ValueError(f"md.{name}: expected at least {max_blocks} columns for the keys rank "
                         f"{cp_rank} holds (block_size={bs}), got {width}")
    if n_bad:
        i = int(bad.nonzero()[0, 0])
        what = "sequence" if md.is_prompt else "row"
        raise ValueError(f"md.{name}[{i}]: {what} {i} holds {int(mine[i])} keys on rank {cp_rank}, "
                         f"which need {int(nblocks[i])} blocks, but column {int(nblocks[i]) - 1} is -1")
    return max_total


def cp_kv_read_plan(md: InputMetadata, cfg: MetadataConfig, *, cp_rank: int) -> KVReadPlan:
    """Which keys rank ``cp_rank`` holds for this step, and where (block size and sharding from ``cfg``).

    Prompt metadata (as built, or mirrored by ``prepare_for_mirror_cp``: same plan, only
    full-layout fields are read): one entry per sequence ``s`` with keys ``0 .. seqlen_k[s] - 1``
    (history + this chunk) read through ``md.seq_block_tables[s]``. Decode metadata: one entry
    per query row ``i`` with keys ``0 .. context_lens[i] - 1`` read through ``md.block_tables[i]``.
    Placeholder sequences / rows (``query_indices == PLACEHOLDER_QUERY_INDEX``) hold 0 keys.
    With ``cfg.kv_cp_world_size == 1`` every rank holds every key (any ``cp_rank >= 0``, same plan).

    Returns a :class:`KVReadPlan` on ``md``'s device: ``seqlens`` int32 [n]
    (``cp_local_seqlens(len, W, cp_rank, I)``), ``cu_seqlens`` int32 [n+1], ``block_tables`` int32
    [n, width] (``md``'s table tensor itself, not a copy), ``max_total`` (rank 0's total) and the
    lazy ``slots`` / ``positions`` int64 [sum(seqlens)]. A query row at position ``p`` sees the
    first ``cp_local_seqlens(p + 1, W, cp_rank, I)`` keys of its entry.

    Example (module docstring in full): ``W=2, I=2, block_size=4``, decode rows at positions
    6 and 9 of one sequence with table ``[3, 9, 5]`` (``context_lens = [7, 10]``): rank 1 gets
    ``seqlens = [3, 4]``, ``cu_seqlens = [0, 3, 7]``, ``positions = [2, 3, 6, 2, 3, 6, 7]``,
    ``slots = [12, 13, 14, 12, 13, 14, 15]``, ``max_total = 4 + 6 = 10``.

    Raises ``ValueError`` naming the field when a table is too narrow or an entry would read a
    ``-1`` block id (e.g. seed-config decode tables defined only for compressed KV).
    """
    _check_args(md, cfg, cp_rank)
    keys, table = _entries(md)
    w, inter, bs = cfg.kv_cp_world_size, cfg.kv_cp_interleave, cfg.block_size
    mine = local_lengths(keys, w, cp_rank if w > 1 else 0, inter)
    rank0 = local_lengths(keys, w, 0, inter) if w > 1 and cp_rank != 0 else mine
    max_total = _check_tables(md, table, mine, rank0, bs, cp_rank)
    cu = torch.zeros(keys.shape[0] + 1, dtype=torch.int32, device=keys.device)
    cu[1:] = mine.cumsum(0)
    return KVReadPlan(
        seqlens=mine.to(torch.int32), cu_seqlens=cu, block_tables=table, max_total=max_total,
        block_size=bs, cp_rank=cp_rank, cp_world_size=w, cp_interleave=inter, is_prompt=bool(md.is_prompt),
        _stamp=stamp(table),
    )
