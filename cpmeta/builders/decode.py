"""``prepare_decode``: decode-step ``InputMetadata`` on the CPU, vectorized (DESIGN sections 3, 4).

Every field is one row per query row (``total_q = sum(seqlen_q)``; ``seqlen_q = 1 + drafts``).
Worked example (block_size 128, ratio 4, W = S = 128, one sequence ``seqlen_q = 2``,
``seqlen_k = 8``, state 3, table ``[5]``): positions ``[6, 7]``, context_lens ``[7, 8]``,
``klen["4"] = [1, 2]``, row 1 closes compressed token c = 1 -> ``positions_c["4"] = [0, 4]``,
``slot_mapping_store_ca["4"] = [-1, 5 * 32 + 1 = 161]``, SWA window of row 1: ``w = 8``, start
slot ``3 * 128 + 0`` -> ``kv_swa_index_offset_len[1] = (384, 8)``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from ..config import MetadataConfig
from ..constants import INT32_MAX, PAD_SLOT_ID
from ..cache import BoundedCache, IdentityCache
from ..fields import DECODE, FieldTable, stacked_fields, step_outputs
from ..metadata import FIELDS, InputMetadata
from ..buffers import AllocOut, ArenaLayout, HostArena, OutputBuffers, alloc, alloc_stacked
from .batch_arrays import BatchArrays
from .common_fields import check_common_int32, fill_common
from .int_ops import check_int32, fmod
from .extract import BatchInput, extract_batch

__all__ = ["prepare_decode", "DECODE_STACKED_FIELDS", "check_decode_out", "check_decode_int32"]

#: The decode ``out=`` schema, shared by ``prepare_decode`` and ``prepare_decode_inplace``: the
#: per-ratio decode fields of the field table live in ONE stacked buffer each, ``out["klen"]`` =
#: ``[n_ratio, total_q]`` (``kv_ca_index_offset_len``: ``[n_ratio, total_q, 2]``), rows in config
#: ratio order of the field's ratio set (``sparse_compress_ratios`` for ``klen``, ``ca_ratios`` for
#: ``positions_c`` and ``slot_mapping_store_ca``, ``dense_compress_ratios`` for
#: ``kv_ca_index_offset_len``); the metadata's dict values are row views of it (``md.klen["4"]``
#: is ``out["klen"][0]``). Every other field is stored under its own name.
DECODE_STACKED_FIELDS: tuple[str, ...] = stacked_fields(FIELDS, DECODE)

logger = logging.getLogger(__name__)

Out = Optional[dict[str, torch.Tensor]]


def check_decode_int32(b: BatchArrays, cfg: MetadataConfig) -> None:
    """Overflow checks before allocation; the decode offset bound is DESIGN section 3's."""
    check_common_int32(b, cfg)
    if cfg.dense_compress_ratios:
        mnb, md = cfg.max_num_blocks, min(cfg.dense_compress_ratios)
        v = b.total_q * mnb * (cfg.block_size // md)
        if v <= INT32_MAX:  # the message is only formatted for a failing bound
            return
        check_int32(
            "kv_ca_index_offset_len",
            v,
            f"total_q ({b.total_q}) * max_num_blocks ({mnb}, from max_model_len="
            f"{cfg.max_model_len}) * (block_size // min(dense_compress_ratios)) "
            f"({cfg.block_size}//{md})",
        )


def _fill_block_tables(b: BatchArrays, cfg: MetadataConfig, out: AllocOut) -> tuple[torch.Tensor, np.ndarray]:
    """``block_tables`` [total_q, max_num_blocks] int32: each row holds its sequence's table.

    The whole table is written (its first ``max_num_blocks`` ids), -1 after it; only the first
    ``blocks_needed(seqlen_k)`` columns are guaranteed (DESIGN 4: the in-place path writes -1
    past them). Blocks past the compressed need are what a full-attention KV cache reads through
    the slot mapping (``compute_slot_mapping_from_metadata``). Example: tables ``[[7, 8], [4]]``,
    seqlen_q ``[1, 2]``, 3 columns -> rows ``[7, 8, -1]``, ``[4, -1, -1]``, ``[4, -1, -1]``.
    """
    T, n, mnb = b.total_q, b.n_seq, cfg.max_num_blocks
    t, a = alloc(out, "block_tables", (T, mnb), torch.int32)
    if b.bt2d is not None:  # BatchState's padded 2-D table: one copy / row gather
        # (np.take(..., out=a) is ~10x slower than a take and a copy: it buffers row by row)
        np.copyto(a, b.bt2d if T == n else np.take(b.bt2d, b.row_seq, axis=0))
        return t, a
    per_seq = a if T == n else np.empty((n, mnb), np.int32)
    per_seq.fill(-1)
    off, need, bt_flat, bt_whole = b.bt_whole_off, b.bt_need, b.bt_flat, b.bt_whole
    # no bt2d: extract_batch filled the flat tables (it leaves them None only together with bt2d)
    assert off is not None and need is not None and bt_flat is not None and bt_whole is not None
    lens = np.minimum(np.diff(off), mnb)
    if np.array_equal(lens, need):  # tables hold exactly the compressed need: one copy
        per_seq[np.arange(mnb)[None, :] < need[:, None]] = bt_flat[:-1]
    else:
        keep = np.arange(mnb)[None, :] < lens[:, None]
        whole = bt_whole if int(off[-1]) == int(lens.sum()) else \
            bt_whole[(off[:-1][:, None] + np.arange(mnb)[None, :])[keep]]  # rows cut to max_num_blocks
        per_seq[keep] = whole
    if T != n:
        np.copyto(a, np.take(per_seq, b.row_seq, axis=0))
    return t, a


def _fill_decode_rows(b: BatchArrays, cfg: MetadataConfig, out: AllocOut, f: dict[str, Any]) -> np.ndarray:
    """``context_lens`` (= pos + 1) and, with the sliding-window state cache (``window_size >
    0``), ``state_block_idx`` and ``kv_swa_index_offset_len`` (start ``state * S + (pos1 - w) %
    S``, length ``w = min(pos1, W)``), all in int32 (positions are below max_model_len,
    ``state * S + S - 1`` is checked by ``check_common_int32``). Returns the filled
    ``context_lens`` array: the int32 ``pos1`` the per-ratio fields read. Example (W = S = 8,
    state 2, pos 9): ``context_lens = 10``, ``w = 8``, start ``16 + 2 % 8 = 18`` -> ``(18, 8)``."""
    T, W, S = b.total_q, cfg.window_size, cfg.swa_block_size
    f["context_lens"], pos1 = alloc(out, "context_lens", (T,), torch.int32)
    np.add(b.row_pos, 1, out=pos1, casting="unsafe")
    if not W:  # no sliding-window state cache: no state slot, no ring window
        return pos1
    f["state_block_idx"], st = alloc(out, "state_block_idx", (T,), torch.int32)
    np.copyto(st, b.per_row(b.state_id), casting="unsafe")
    f["kv_swa_index_offset_len"], a = alloc(out, "kv_swa_index_offset_len", (T, 2), torch.int32)
    w, o = a[:, 1], a[:, 0]
    np.minimum(pos1, W, out=w)
    np.subtract(pos1, w, out=o)
    fmod(o, S, out=o)
    o += st * S
    return pos1


#: Per-config constants (ratio columns, arena layouts, row bases), keyed by the config's identity:
#: hashing a frozen config costs a tuple of all its fields on every call.
_CONSTS: IdentityCache[MetadataConfig, BoundedCache[Any, Any]] = IdentityCache(64)


def _consts(cfg: MetadataConfig) -> BoundedCache[Any, Any]:
    """The cache of ``cfg`` (ratio columns, arena layouts, row bases; at most 256 entries)."""
    c = _CONSTS.get(cfg)
    return c if c is not None else _CONSTS.put(cfg, BoundedCache(256))


def _ratio_columns(cfg: MetadataConfig) -> tuple[np.ndarray, ...]:
    """Per-ratio constants as ``[n_ratio, 1]`` int32 columns (read-only, cached per config), so
    every per-ratio field is ONE broadcast numpy call whatever the number of ratios:
    sparse ratios, ca ratios, ``block_size // ca``, dense ratios, ``block_size // dense``."""
    c = _consts(cfg)
    cols = c.get("cols")
    if cols is None:
        cols = []
        for rs in (cfg.sparse_compress_ratios, cfg.ca_ratios, tuple(cfg.block_size // n for n in cfg.ca_ratios),
                   cfg.dense_compress_ratios, tuple(cfg.block_size // n for n in cfg.dense_compress_ratios)):
            col = np.array(rs, np.int32).reshape(-1, 1)  # int32: every operand is a bounded position
            col.flags.writeable = False
            cols.append(col)
        cols = c.put("cols", tuple(cols))
    return cols


def _row_bases(cfg: MetadataConfig, T: int) -> tuple[np.ndarray, np.ndarray]:
    """``arange(T) * max_num_blocks`` (int64: row i's first element in the flattened
    ``block_tables``) and the ``[n_dense, T]`` int32 offsets ``rows * (block_size // dense)`` of
    ``kv_ca_index_offset_len`` (bounded by ``check_decode_int32``); read-only, cached."""
    c = _consts(cfg)
    r = c.get(("rows", T))
    if r is None:
        rows = np.arange(T, dtype=np.int64) * cfg.max_num_blocks
        ol0 = (rows * np.array([cfg.block_size // n for n in cfg.dense_compress_ratios], np.int64)
               .reshape(-1, 1)).astype(np.int32)
        rows.flags.writeable = False
        ol0.flags.writeable = False
        r = c.put(("rows", T), (rows, ol0))
    return r


def _fill_ratio_fields(
    b: BatchArrays, cfg: MetadataConfig, out: AllocOut, f: dict[str, Any], bt: np.ndarray, pos1: np.ndarray
) -> None:
    """``klen``, ``positions_c``, ``slot_mapping_store_ca``, ``kv_ca_index_offset_len``.

    A row writes compressed token ``c = pos // n`` only when ``(pos + 1) % n == 0`` (it closes
    the group of n tokens); otherwise ``positions_c = 0`` and slot -1. The slot reads the row's
    ``block_tables`` row ``bt`` (already filled: its first ``blocks_needed`` columns are the
    sequence's table): ``bt[i, c // b_c] * b_c + c % b_c``. Offsets of row i:
    ``i * max_num_blocks * (block_size // n)`` (its row of ``block_tables``, flattened). All
    ratios of a field are computed at once (``[n_ratio, total_q]`` broadcasts into the stacked
    buffers). Example: n = 4, b_c = 32, pos 39 closes c = 9 -> ``positions_c = 36``, slot
    ``bt[i, 0] * 32 + 9``; pos 40 -> ``(0, -1)``.
    """
    T = b.total_q
    sparse, ca, ca_bc, dense, dense_bc = _ratio_columns(cfg)
    # pos1 = row_pos + 1 as int32 (the filled context_lens): every value below is bounded by
    # max_model_len, so the int32 arithmetic equals the int64 one and writes need no cast
    rows, ol0 = _row_bases(cfg, T)
    f["klen"], k_all = alloc_stacked(out, "klen", cfg.sparse_compress_ratios, (T,))
    np.floor_divide(pos1, sparse, out=k_all)
    f["positions_c"], pc_all = alloc_stacked(out, "positions_c", cfg.ca_ratios, (T,))
    f["slot_mapping_store_ca"], sl_all = alloc_stacked(out, "slot_mapping_store_ca", cfg.ca_ratios, (T,))
    q, r = np.divmod(pos1, ca)  # closing rows: r == 0 and c = pos // n = q - 1
    skip = r != 0
    np.subtract(pos1, ca, out=pc_all)  # c * n = pos1 - n on closing rows
    np.copyto(pc_all, 0, where=skip)
    q -= 1
    blk, off = np.divmod(q, ca_bc)
    # rows that do not write may index past their table (or below 0): clipped, then overwritten;
    # no table columns at all (max_model_len < every ratio): no row closes a group
    flat_bt = bt.reshape(-1) if bt.size else np.zeros(1, np.int32)
    np.multiply(np.take(flat_bt, np.add(blk, rows), mode="clip"), ca_bc, out=sl_all)
    np.add(sl_all, off, out=sl_all)
    if b.any_placeholder:
        skip |= b.per_row(b.is_placeholder)
    np.copyto(sl_all, PAD_SLOT_ID, where=skip)
    f["kv_ca_index_offset_len"], ol_all = alloc_stacked(
        out, "kv_ca_index_offset_len", cfg.dense_compress_ratios, (T, 2))
    np.copyto(ol_all[:, :, 0], ol0)
    np.floor_divide(pos1, dense, out=ol_all[:, :, 1])


def _decode_layout(cfg: MetadataConfig, T: int, n: int) -> ArenaLayout:
    """:func:`_make_decode_layout`, cached per (config, batch shape)."""
    c = _consts(cfg)
    lay = c.get((T, n))
    return lay if lay is not None else c.put((T, n), _make_decode_layout(cfg, T, n))


def _make_decode_layout(cfg: MetadataConfig, T: int, n: int, table: FieldTable = FIELDS) -> ArenaLayout:
    """Every decode output (name, shape, dtype), generated from the field table (``table``; a test
    passes one with an extra field): ONE :class:`HostArena` holds them all when the caller passes
    no ``out`` (cached per batch shape); per-ratio fields are stacked ``[n_ratio, ...]``. Example:
    256 rows, 256 sequences, default config -> 16 fields, ~86 KiB (block_tables [256, 64] int32 is
    64 KiB of it)."""
    specs = step_outputs(table, cfg, DECODE)
    sizes = {"total_q": T, "n_seq": n}
    return ArenaLayout([(s.name, s.resolve(sizes), s.dtype) for s in specs],
                       stacked=[s.name for s in specs if s.keys is not None])


def check_decode_out(out: Out) -> None:
    """Refuse the per-ratio key form (``"klen.4"``) in a decode ``out`` dict (see the module doc)."""
    if not out:
        return
    for key in out:
        name, dot, ratio = key.partition(".")
        if dot and name in DECODE_STACKED_FIELDS:
            raise ValueError(
                f"out[{key!r}]: decode out buffers hold per-ratio fields stacked under {name!r} "
                f"(one [n_ratio, total_q, ...] tensor, ratios in config order), not per-ratio keys"
            )


def _out_kind(out: "Out | OutputBuffers") -> Optional[OutputBuffers]:
    """The one dispatch on ``out``: an :class:`~cpmeta.buffers.OutputBuffers` is returned, a dict
    is checked (:func:`check_decode_out`) and ``None`` returned, anything else is a ``TypeError``."""
    if out is None or isinstance(out, dict):
        check_decode_out(out)
        return None
    if isinstance(out, OutputBuffers):
        return out
    raise TypeError(f"out: expected None, a dict of tensors or an OutputBuffers (e.g. cpmeta.OutputArenas), "
                    f"got {type(out).__name__}")


def prepare_decode(
    seqs: BatchInput, cfg: MetadataConfig, *, out: "Out | OutputBuffers" = None
) -> InputMetadata:
    """Build decode ``InputMetadata`` (CPU tensors; pinned when CUDA is available).

    Args:
        seqs: one ``SequenceMetadata`` per sequence; ``token_ids`` holds exactly
            ``seqlen_k - seqlen_q + 1`` confirmed tokens and ``draft_tokens`` the ``seqlen_q - 1``
            MTP drafts; or the same as a decode ``SequenceBatch`` (bit-identical result). Bad
            input raises ``ValueError`` naming ``seqs[i].field``.
        cfg: the engine's ``MetadataConfig``.
        out: optional dict of preallocated tensors keyed by field name (``"positions"``, ...;
            per-ratio fields stacked, see :data:`DECODE_STACKED_FIELDS`); matching tensors are
            filled in place, missing ones are allocated and stored in it, a shape/dtype mismatch
            (or a per-ratio key such as ``"klen.4"``) is a ``ValueError``. Or an
            :class:`~cpmeta.buffers.OutputBuffers` (caller-owned memory), e.g. a
            :class:`cpmeta.OutputArenas`: one arena per batch shape, refilled every step (the
            cheapest steady state: no tensor is made per call).

    Returns every decode field of DESIGN section 4 (int32 indices, bool masks, [total_q] rows):
    common fields, ``state_block_idx`` / ``context_lens`` [total_q], ``klen[r]``,
    ``kv_swa_index_offset_len`` [total_q, 2], ``block_tables`` [total_q, max_num_blocks],
    ``kv_ca_index_offset_len[n]`` [total_q, 2]. Prompt-only fields are ``None``, and so are the
    fields of a feature the config switches off (DESIGN 14): without compressed KV every
    per-ratio field; with ``window_size == 0`` ``slot_mapping_store_swa``, ``state_block_idx`` and
    ``kv_swa_index_offset_len``. A plain config's ``block_tables`` has ``max_num_blocks =
    blocks_needed(max_model_len)`` columns (``cdiv(max_model_len, block_size)`` unsharded).
    Raises ``ValueError`` before allocating when ``total_q * max_num_blocks *
    (block_size // min(dense ratios))`` (or a slot value) exceeds int32.
    """
    arenas = _out_kind(out)
    b = extract_batch(seqs, cfg, is_prompt=False, flat_tables=False)
    check_decode_int32(b, cfg)
    dst: AllocOut
    if arenas is not None:  # caller-owned memory: the arena it hands out for this batch shape
        dst = arenas.arena(_decode_layout(cfg, b.total_q, b.n_seq))
    elif isinstance(out, dict):  # the caller's dict
        dst = out
    else:  # one host allocation for every field (all shapes are known now)
        dst = HostArena(_decode_layout(cfg, b.total_q, b.n_seq))
    f = fill_common(b, cfg, dst)
    pos1 = _fill_decode_rows(b, cfg, dst, f)
    f["block_tables"], bt = _fill_block_tables(b, cfg, dst)
    if cfg.has_compressed_kv:
        _fill_ratio_fields(b, cfg, dst, f, bt, pos1)
    return InputMetadata(**f)
