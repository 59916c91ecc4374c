"""The fields both host builders share (DESIGN section 4, "Common") and their int32 checks."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..config import MetadataConfig
from ..constants import INT32_MAX, PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from ..buffers import AllocOut, alloc
from .batch_arrays import BatchArrays
from .int_ops import check_int32, fdiv, fmod
from .ngram import fill_ngram_token_ids

__all__ = ["fill_common", "check_common_int32", "compressed_slots"]


def fill_common(
    b: BatchArrays, cfg: MetadataConfig, out: AllocOut, *, ngram: bool = True
) -> dict[str, Any]:
    """Fields shared by prompt and decode (DESIGN section 4, "Common"), as InputMetadata kwargs.

    ``positions``, ``input_ids``, ``gate_force_random``, ``ngram_token_ids`` (None when
    ``max_ngram_size == 0``), ``cu_seqlens_q``/``cu_seqlens_k`` [n_seq+1], ``valid_token_mask``,
    ``query_indices`` (998244353 on placeholder rows), ``slot_mapping_store_swa`` (None without
    the sliding-window state cache, ``window_size == 0``) and the scalars.
    Example (S = 4, one sequence, state 2, seqlen_q = 6, seqlen_k = 9): positions 3..8; rows with
    ``seqlen_q - j <= 4`` are j = 2..5 (positions 5..8) -> SWA slots ``[-1, -1, 9, 10, 11, 8]``.
    """
    T, n = b.total_q, b.n_seq
    any_ph = b.any_placeholder
    ph_row = b.per_row(b.is_placeholder) if any_ph else None
    f: dict[str, Any] = {
        "is_prompt": b.is_prompt, "num_seqs": n, "total_q": T,
        # one row per sequence (decode without drafts): every seqlen_q is 1, no reduction
        "max_seqlen_q": 1 if T == n else int(b.seqlen_q.max()), "max_seqlen_k": int(b.seqlen_k.max()),
    }
    f["positions"], pos = alloc(out, "positions", (T,), torch.int32)
    np.copyto(pos, b.row_pos, casting="unsafe")
    f["input_ids"], a = alloc(out, "input_ids", (T,), torch.int32)
    np.copyto(a, b.input_ids, casting="unsafe")
    f["gate_force_random"], a = alloc(out, "gate_force_random", (T,), torch.bool)
    a.fill(cfg.force_load_balance)
    f["cu_seqlens_q"], a = alloc(out, "cu_seqlens_q", (n + 1,), torch.int32)
    np.copyto(a, b.cu_q, casting="unsafe")
    f["cu_seqlens_k"], a = alloc(out, "cu_seqlens_k", (n + 1,), torch.int32)
    np.copyto(a, b.cu_k, casting="unsafe")
    f["valid_token_mask"], a = alloc(out, "valid_token_mask", (T,), torch.bool)
    if ph_row is not None:  # i.e. any_ph
        np.logical_not(ph_row, out=a)
    else:
        a.fill(True)
    f["query_indices"], a = alloc(out, "query_indices", (T,), torch.int32)
    np.copyto(a, b.row_seq, casting="unsafe")
    if ph_row is not None:
        a[ph_row] = PLACEHOLDER_QUERY_INDEX
    f["slot_mapping_store_swa"] = _swa_slots(b, cfg, out, pos, ph_row, f["max_seqlen_q"]) if cfg.has_swa else None
    f["ngram_token_ids"] = None
    if cfg.max_ngram_size > 0 and ngram:  # (ngram False: a CP rank builds its own rows later)
        f["ngram_token_ids"] = fill_ngram_token_ids(b, cfg, out)
    return f


def _swa_slots(
    b: BatchArrays, cfg: MetadataConfig, out: AllocOut, pos: np.ndarray,
    ph_row: Optional[np.ndarray], max_sq: int,
) -> torch.Tensor:
    """``slot_mapping_store_swa`` [total_q] int32: ``state * S + pos % S`` on the last ``S`` rows
    of each sequence's chunk, -1 before them and on placeholder rows (the sliding-window state
    cache only). ``pos`` is the filled int32 ``positions``, ``max_sq`` = ``max(seqlen_q)``."""
    T, n, S = b.total_q, b.n_seq, cfg.swa_block_size
    t, a = alloc(out, "slot_mapping_store_swa", (T,), torch.int32)
    # state * S + pos % S, in int32 (its bound is checked by check_common_int32)
    fmod(pos, S, out=a)  # from the int32 positions: no casting loop
    a += b.per_row(b.state_id * S)
    if T != n and max_sq > S:  # only the last S rows of a chunk stay in the ring
        np.copyto(a, PAD_SLOT_ID, where=b.row_j < np.repeat(b.seqlen_q - S, b.seqlen_q))
    if ph_row is not None:
        a[ph_row] = PAD_SLOT_ID
    return t


def check_common_int32(b: BatchArrays, cfg: MetadataConfig) -> None:
    """Overflow checks shared by both paths (run before any allocation).

    Bounds: ``sum(seqlen_k)`` (``cu_seqlens_k``), ``max(state_id) * S + S - 1`` (SWA slots, only
    with ``window_size > 0``), ``max(block id) * b_c + b_c - 1`` with ``b_c = block_size //
    min_ratio`` (compressed slots; plain configs: ``min_ratio = 1``, the paged-KV slot the slot
    mapping writes), and every token id.
    """
    # the messages are only formatted for a bound that fails (check_int32 raises then)
    if int(b.cu_k[-1]) > INT32_MAX:
        check_int32("cu_seqlens_k", int(b.cu_k[-1]), "sum(seqlen_k)")
    # with BatchState's 2-D rows (bt2d) the state vouches for both bounds below: it sets them only
    # when every state id is in [0, (2**31 - S) // S] and every block id in [0, (2**31 - b_c) // b_c]
    if b.bt2d is None:
        S = cfg.swa_block_size
        if cfg.has_swa and int(b.state_id.max()) * S + S - 1 > INT32_MAX:
            check_int32("slot_mapping_store_swa", int(b.state_id.max()) * S + S - 1,
                        f"max(state_id) * swa_block_size + swa_block_size - 1 (swa_block_size={S})")
        # compressed KV: its write slots; plain: the paged-KV slot compute_slot_mapping writes
        # (min_ratio 1, so b_c = block_size)
        bc = cfg.block_size // cfg.min_ratio
        bt_flat = b.bt_flat
        assert bt_flat is not None  # extract_batch leaves it None only for a batch carrying bt2d
        v = int(bt_flat.max()) * bc + bc - 1
        if v > INT32_MAX:
            what = "slot_mapping_store_ca" if cfg.has_compressed_kv else "block_table (paged KV slot)"
            check_int32(what, v,
                        f"max(block id) * (block_size // min_ratio) + block_size // min_ratio - 1 (b_c={bc})")
    if b.total_q and not b.ids_ok and (b.input_ids.max() > INT32_MAX or b.input_ids.min() < -INT32_MAX - 1):
        raise ValueError("input_ids: token id does not fit in int32")


def compressed_slots(
    b: BatchArrays, seq: Optional[np.ndarray], c: np.ndarray, write: np.ndarray, n: int, cfg: MetadataConfig
) -> np.ndarray:
    """Compressed-KV slot of compressed index ``c`` of sequence ``seq``, or -1 where not ``write``.

    ``seq=None`` means ``c`` has one entry per sequence, in order.
    ``slot = block_table[c // b_c] * b_c + c % b_c`` with ``b_c = block_size // n``. Rows that do
    not write read the trailing 0 of ``bt_flat`` instead of a possibly out-of-table block.
    Example: block_size 128, n = 4 (b_c = 32), table ``[7, 3]``, c = 40 -> ``3 * 32 + 8 = 104``.
    """
    bt_flat, bt_start = b.bt_flat, b.bt_start
    # prompt only: extract_batch leaves the flat tables None only for prepare_decode (flat_tables=False)
    assert bt_flat is not None and bt_start is not None
    bc = cfg.block_size // n
    idx = fdiv(c, bc)
    idx += bt_start if seq is None else bt_start[seq]
    skip = ~write
    idx[skip] = len(bt_flat) - 1
    slot = bt_flat[idx]
    slot *= bc
    slot += fmod(c, bc)
    slot[skip] = PAD_SLOT_ID
    return slot
