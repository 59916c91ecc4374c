"""The read side of CP-interleaved paged KV: which keys a rank holds, and where (docs/design.md section 14).

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

from typing import Optional

import numpy as np
import torch

from ..config import MetadataConfig, check_config
from ..jit import error_slot
from ..metadata import InputMetadata
from . import kv_read_plan_njit as K
from .mirror_plan import host_cu

__all__ = ["KVReadPlan", "cp_kv_read_plan"]

_I64 = torch.int64


class KVReadPlan:
    """Keys one rank holds for one step, per entry (prompt: sequence; decode: query row).

    Every field is filled by :func:`cp_kv_read_plan` (one compiled call) except ``slots`` /
    ``positions``, computed on first access (one compiled call for both) and kept.

    Lifetime: the plan never changes under its holder. It owns a copy of ``md``'s block table
    (one ``[n, width]`` int32 copy), so a later step that rewrites the buffer the table came from
    (a persistent broadcast arena, ``persistent_outputs``; a reused host arena,
    ``prepare_decode(..., out=OutputArenas())``) cannot change it.
    """

    __slots__ = ("_seqlens", "_cu_seqlens", "_block_tables", "_max_total", "_total", "_host_table",
                 "_keys", "block_size", "cp_rank", "cp_world_size", "cp_interleave", "is_prompt")

    def __init__(self, seqlens: torch.Tensor, cu_seqlens: torch.Tensor, block_tables: torch.Tensor,
                 max_total: int, total: int, host_table: np.ndarray, block_size: int, cp_rank: int,
                 cp_world_size: int, cp_interleave: int, is_prompt: bool) -> None:
        self._seqlens, self._cu_seqlens, self._block_tables = seqlens, cu_seqlens, block_tables
        self._max_total, self._total, self._host_table = max_total, total, host_table
        self._keys: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.block_size = block_size  # tokens per paged block (cfg.block_size)
        self.cp_rank = cp_rank  # the rank this plan is for
        self.cp_world_size = cp_world_size  # W: ranks the KV is sharded over (1 = not sharded)
        self.cp_interleave = cp_interleave  # I: consecutive positions per rank
        self.is_prompt = is_prompt  # True: one entry per sequence; False: one per decode query row

    def __repr__(self) -> str:
        return (f"KVReadPlan(n={self._seqlens.shape[0]}, total={self._total}, max_total={self._max_total}, "
                f"block_size={self.block_size}, cp_rank={self.cp_rank}, cp_world_size={self.cp_world_size}, "
                f"cp_interleave={self.cp_interleave}, is_prompt={self.is_prompt})")

    @property
    def seqlens(self) -> torch.Tensor:
        """[n] int32: keys this rank holds per entry (0 for placeholders)."""
        return self._seqlens

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[n+1] int32: exclusive prefix sums of ``seqlens``."""
        return self._cu_seqlens

    @property
    def block_tables(self) -> torch.Tensor:
        """[n, width] int32: local offset ``j`` -> ``row[j // bs] * bs + j % bs``."""
        return self._block_tables

    @property
    def max_total(self) -> int:
        """Most keys any rank holds in this plan (rank 0's sum): the all-gather size."""
        return self._max_total

    @property
    def total(self) -> int:
        """Keys this rank holds in the plan: ``cu_seqlens[-1]``."""
        return self._total

    @property
    def slots(self) -> torch.Tensor:
        """[total] int64: slot of each local key, entry-major, local offset ascending."""
        return self._materialize()[0]

    @property
    def positions(self) -> torch.Tensor:
        """[total] int64: global key position of each local key (ascending within an entry)."""
        return self._materialize()[1]

    def _materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """ONE :func:`~cpmeta.cp.kv_read_plan_njit.plan_keys` call into one fresh int64 [2, total]
        buffer (moved to the plan's device in one copy). Example (W=2, I=2, bs=4, rank 1, one
        entry of 4 keys, table [3, 9, 5]): positions 2 3 6 7, slots 12 13 14 15."""
        if self._keys is None:
            both = np.empty((2, self._total), np.int64)
            seqlens = self._seqlens.cpu().numpy()
            K.plan_keys(seqlens, self._host_table, self.cp_world_size, self.cp_rank, self.cp_interleave,
                        self.block_size, both[0], both[1])
            t = torch.from_numpy(both).to(self._seqlens.device)
            self._keys = (t[0], t[1])
        return self._keys


def _check_args(md: InputMetadata, cfg: MetadataConfig, cp_rank: int) -> None:
    if not isinstance(md, InputMetadata):
        raise TypeError(f"md: expected InputMetadata, got {type(md).__name__}")
    check_config(cfg)
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool):
        raise TypeError(f"cp_rank: expected an int, got {type(cp_rank).__name__}")
    w = cfg.kv_cp_world_size
    if cp_rank < 0 or cp_rank >= (w if w > 1 else 1 << 31):
        bound = f"0 <= cp_rank < kv_cp_world_size ({w})" if w > 1 else "0 <= cp_rank < 2**31"
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


def _host(md: InputMetadata, name: str, n: int = -1) -> np.ndarray:
    """int64 host copy of ``md.<name>`` (:func:`~cpmeta.cp.mirror_plan.host_cu`: a 1-D integer
    tensor, else ``TypeError``) of ``n`` entries when ``n >= 0``, else ``ValueError`` (a float,
    2-D or short one would reach the kernel: a compile of another signature, or a read past its end)."""
    h = host_cu(f"md.{name}", getattr(md, name))
    if n >= 0 and h.shape[0] != n:
        raise ValueError(f"md.{name}: expected {n} entries, got {h.shape[0]}")
    return h


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
    [n, width] (a copy of ``md``'s table), ``max_total`` (rank 0's total) and the lazy ``slots``
    / ``positions`` int64 [sum(seqlens)]. One compiled call
    (:func:`cpmeta.cp.kv_read_plan_njit.plan_seqlens`) counts and checks; one more fills the
    keys. A query row at position ``p`` sees the first ``cp_local_seqlens(p + 1, W, cp_rank, I)``
    keys of its entry.

    Example (module docstring in full): ``W=2, I=2, block_size=4``, decode rows at positions
    6 and 9 of one sequence with table ``[3, 9, 5]`` (``context_lens = [7, 10]``): rank 1 gets
    ``seqlens = [3, 4]``, ``cu_seqlens = [0, 3, 7]``, ``positions = [2, 3, 6, 2, 3, 6, 7]``,
    ``slots = [12, 13, 14, 12, 13, 14, 15]``, ``max_total = 4 + 6 = 10``.

    Raises ``ValueError`` naming the field when a table is too narrow or an entry would read a
    ``-1`` block id (e.g. seed-config decode tables defined only for compressed KV), and when an
    index field it reads is not of its length, a key count is negative or a prompt's first query
    row is outside ``query_indices``; ``TypeError`` when an index field is not a 1-D integer tensor.
    """
    _check_args(md, cfg, cp_rank)
    assert md.query_indices is not None
    w, inter, bs = cfg.kv_cp_world_size, cfg.kv_cp_interleave, cfg.block_size
    if md.is_prompt:
        assert md.seq_block_tables is not None
        lens = _host(md, "cu_seqlens_k")
        n = max(lens.shape[0] - 1, 0)
        cu_q, qidx, table, name = _host(md, "cu_seqlens_q", n + 1), _host(md, "query_indices"), \
            md.seq_block_tables, "seq_block_tables"
    else:
        assert md.block_tables is not None
        lens = _host(md, "context_lens")
        n = lens.shape[0]
        cu_q, qidx, table, name = np.zeros(1, np.int64), _host(md, "query_indices", n), md.block_tables, \
            "block_tables"
    if table.dim() != 2 or table.shape[0] != n or table.dtype.is_floating_point or table.dtype == torch.bool:
        raise ValueError(f"md.{name}: expected an integer table of {n} rows (one per entry), got {table.dtype} "
                         f"of shape {tuple(table.shape)}")
    table = table.to(torch.int32, copy=True)  # the plan's own: a later step cannot rewrite it
    host_table = np.ascontiguousarray(table.detach().cpu().numpy(), np.int32)
    seqlens, cu = np.empty(n, np.int32), np.empty(n + 1, np.int32)
    meta, err = np.zeros(2, np.int64), error_slot()
    code = K.plan_seqlens(bool(md.is_prompt), lens, cu_q, qidx, host_table, w, cp_rank, inter, bs, seqlens, cu,
                          meta, err)
    if code == K.E_NEGATIVE:
        what = f"cu_seqlens_k[{int(err[1]) + 1}] - cu_seqlens_k[{int(err[1])}]" if md.is_prompt \
            else f"context_lens[{int(err[1])}]"
        raise ValueError(f"md.{what}: expected a key count >= 0, got {int(err[2])}")
    if code == K.E_ROW:
        raise ValueError(f"md.cu_seqlens_q[{int(err[1])}]: expected a query row in [0, {qidx.shape[0]}] "
                         f"(query_indices), got {int(err[2])}")
    if code == K.E_WIDTH:
        raise ValueError(f"md.{name}: expected at least {int(err[2])} columns for the keys rank "
                         f"{cp_rank} holds (block_size={bs}), got {table.shape[1]}")
    if code == K.E_MISSING_BLOCK:
        i, nb = int(err[1]), int(err[2])
        what = "sequence" if md.is_prompt else "row"
        raise ValueError(f"md.{name}[{i}]: {what} {i} holds {int(seqlens[i])} keys on rank {cp_rank}, "
                         f"which need {nb} blocks, but column {nb - 1} is -1")
    dev = table.device
    return KVReadPlan(
        torch.from_numpy(seqlens).to(dev), torch.from_numpy(cu).to(dev), table, int(meta[0]), int(meta[1]),
        host_table, bs, cp_rank, w, inter, bool(md.is_prompt),
    )
