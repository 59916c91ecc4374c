"""Slot mapping of an ``InputMetadata``'s rows (docs/design.md sections 11, 14): what every rank computes from the
broadcast alone.

:func:`compute_slot_mapping_from_metadata` feeds :func:`cpmeta.cp.slot_mapping.compute_slot_mapping`
with the metadata's own ``cu_seqlens_q``, full-layout positions and block tables (prompt
``seq_block_tables``, decode each sequence's first ``block_tables`` row), the block size and KV
sharding from the ``MetadataConfig``, and pads the rows of placeholder sequences;
:func:`stack_block_tables` builds such a table from per-sequence lists. Example: after
``md = bc.broadcast(...)`` every rank runs ``compute_slot_mapping_from_metadata(md, cfg, cp_rank=r)``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..config import MetadataConfig
from ..constants import INT32_MAX, PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from .slot_mapping import compute_slot_mapping, int_arg

__all__ = ["compute_slot_mapping_from_metadata", "stack_block_tables", "BLOCK_TABLE_PAD"]

#: Fill value of :func:`stack_block_tables` past a sequence's own blocks (never a real block id).
BLOCK_TABLE_PAD: int = -1


def stack_block_tables(
    tables: Sequence[Sequence[int]], *, width: Optional[int] = None, device: Any = None,
) -> torch.Tensor:
    """Per-sequence block tables as one [n_seq, width] int32 tensor, padded with -1.

    ``width`` defaults to the longest table. Example: ``[[4, 7], [2]]`` -> ``[[4, 7], [2, -1]]``.
    """
    lengths = torch.tensor([len(t) for t in tables], dtype=torch.int64)
    longest = int(lengths.max()) if len(tables) else 0
    width = longest if width is None else int_arg("width", width, longest)
    flat = torch.tensor([b for t in tables for b in t], dtype=torch.int64)
    if flat.numel() and (flat.min() < 0 or flat.max() > INT32_MAX):
        raise ValueError("tables: expected block ids in [0, 2**31 - 1]")
    result = torch.full((len(tables), width), BLOCK_TABLE_PAD, dtype=torch.int32)
    result[torch.arange(width) < lengths[:, None]] = flat.to(torch.int32)
    return result if device is None else result.to(device)


def compute_slot_mapping_from_metadata(
    md: Any, block_size: Any, *, block_table: Optional[torch.Tensor] = None,
    max_num_tokens: Optional[int] = None, **kwargs: Any,
) -> torch.Tensor:
    """Slot mapping of an ``InputMetadata``'s rows (e.g. on every rank after the broadcast):
    int32 [max_num_tokens], one slot per FULL-layout query row (``PAD_SLOT_ID`` = -1 for rows
    this rank does not store).

    ``block_size`` is an int, or the ``MetadataConfig`` the metadata was built with: then the
    block size and the KV sharding come from it (``cfg.kv_cp_world_size``,
    ``cfg.kv_cp_interleave``), the same source :func:`cpmeta.cp_kv_read_plan` reads, and
    ``cp_rank`` is this rank in the CP group (with ``kv_cp_world_size == 1`` every rank stores
    every key, whatever its ``cp_rank``). Example: ``compute_slot_mapping_from_metadata(md, cfg,
    cp_rank=r)`` on every rank after ``bc.broadcast``.

    Uses ``md.cu_seqlens_q`` as ``query_start_loc`` and the FULL-layout positions
    (``md.positions_cp`` after the CP mirror, else ``md.positions``), so the result has one row
    per full-layout query row. ``block_table`` is [n_seq, max_blocks] (see
    :func:`stack_block_tables`); it defaults to the broadcast metadata's own tables, so every
    rank needs nothing but ``md``: prompt ``md.seq_block_tables`` (whole tables, docs/design.md section 4),
    decode each sequence's first row of ``md.block_tables``. Rows of placeholder sequences (``query_indices == 998244353``) get
    ``pad_id``; a YoCo consumer view's ``query_indices`` holds row numbers, so there nothing is
    masked. ``max_num_tokens`` defaults to the row count; other keywords go to
    :func:`compute_slot_mapping` (``kv_cache_block_size``, ``cp_world_size``, ``cp_rank``,
    ``cp_interleave``, ``pad_id``, ``circular``, ``backend``).
    """
    if not all(hasattr(md, f) for f in ("cu_seqlens_q", "positions", "positions_cp")):
        raise TypeError(f"md: expected InputMetadata (or a view of it), got {type(md).__name__}")
    if not isinstance(block_size, (int, MetadataConfig)) or isinstance(block_size, bool):
        raise TypeError(f"block_size: expected an int or the MetadataConfig the metadata was built with, got "
                        f"{type(block_size).__name__}")
    qsl = md.cu_seqlens_q
    positions = md.positions_cp if md.positions_cp is not None else md.positions
    if qsl is None or positions is None:
        raise ValueError("md: expected cu_seqlens_q and positions to be set")
    if block_table is None:
        if md.seq_block_tables is not None:
            block_table = md.seq_block_tables
        elif md.block_tables is not None:
            block_table = md.block_tables.index_select(0, qsl[:-1].to(torch.int64))
        else:
            raise ValueError("block_table: required when md has neither seq_block_tables (prompt) "
                             "nor block_tables (decode)")
    if not isinstance(block_size, int):  # a MetadataConfig: the write side of its KV sharding
        kwargs = _sharding_kwargs(block_size, kwargs)
        block_size = block_size.block_size
    rows = positions.shape[0]
    slots = compute_slot_mapping(qsl, positions, block_table, block_size,
                                 max_num_tokens=rows if max_num_tokens is None else max_num_tokens,
                                 **kwargs)
    qi = md.query_indices
    if qi is not None and qi.shape == positions.shape:
        pad = kwargs.get("pad_id", PAD_SLOT_ID)
        slots[:rows].masked_fill_(qi.to(slots.device) == PLACEHOLDER_QUERY_INDEX, pad)
    return slots


def _sharding_kwargs(cfg: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compute_slot_mapping``'s CP keywords from ``cfg``'s KV sharding (``cp_rank`` from the
    caller; replicated KV -> rank 0 of a group of one). Giving them too is a ``ValueError``."""
    given = {"cp_world_size", "cp_interleave"} & set(kwargs)
    if given:
        raise ValueError(f"{sorted(given)}: given with a MetadataConfig, which already says the KV sharding "
                         f"(kv_cp_world_size={cfg.kv_cp_world_size}, kv_cp_interleave={cfg.kv_cp_interleave})")
    out = dict(kwargs)
    world = cfg.kv_cp_world_size
    out["cp_rank"] = int(out.get("cp_rank", 0)) if world > 1 else 0
    out["cp_world_size"], out["cp_interleave"] = world, cfg.kv_cp_interleave
    return out
