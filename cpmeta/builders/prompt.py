"""``prepare_prompt``: prefill / chunked-prefill ``InputMetadata`` on the CPU, vectorized.

DESIGN sections 3 and 4. Rows are query rows in varlen order; per-ratio fields are dicts keyed by
``str(ratio)``. The compressed KV of a sequence is loaded into one contiguous buffer per ratio with
``loaded_compressed_len(seqlen_k, n) = max(1, seqlen_k // n)`` rows per sequence; ``ks``/``ke`` and
``kv_ca_index_offset_len`` index that buffer, the SWA pivots index the buffer
``[history: n_seq * W rows ; this chunk's new keys: total_q rows]``.

Worked example (W = 4, ratio 4, one sequence ``seqlen_q = 3``, ``seqlen_k = 9``, so q_start 6):
positions ``6, 7, 8``; loaded compressed rows ``max(1, 9 // 4) = 2`` so ``ks["4"] = [0, 0, 0]``,
``ke["4"] = [1, 2, 2]``; compressed rows written this chunk: c in ``[6 // 4, 9 // 4) = [1, 2)``
-> ``positions_c["4"] = [4]``; SWA pivots of row j = 0 (pos 6, sees 3..6): history part starts
at slot 3 - (6 - 4) = 1 -> ``(P0, P1, P2, P3) = (1, 3, 4, 1)``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch

from ..config import MetadataConfig
from ..metadata import InputMetadata
from ..constants import INT32_MAX
from ..state.batch import prefix
from ..buffers import alloc
from .batch_arrays import BatchArrays, arange_ro, expand_rows
from .common_fields import check_common_int32, compressed_slots, fill_common
from .int_ops import check_int32, fdiv, loaded_compressed_len
from .extract import BatchInput, extract_batch
from .load_plan import paged_load_segments, swa_load_segments
from .yoco import build_yoco_fields

__all__ = ["prepare_prompt", "prompt_fields"]

logger = logging.getLogger(__name__)

Out = Optional[dict[str, torch.Tensor]]


def _check_prompt_int32(b: BatchArrays, cfg: MetadataConfig, cu_ck: dict[int, np.ndarray]) -> None:
    """Overflow checks before allocation: totals, buffer offsets and slot values."""
    check_common_int32(b, cfg)
    W = cfg.window_size
    if W:  # the SWA pivots' buffer offsets (sliding-window state cache only)
        check_int32(
            "kv_swa_full_index_pivots", b.n_seq * W + b.total_q,
            f"n_seq ({b.n_seq}) * window_size ({W}) + total_q ({b.total_q})",
        )
    for n, cu in cu_ck.items():
        check_int32(
            f"cu_compressed_seqlens_k.{n}", int(cu[-1]),
            f"sum over sequences of max(1, seqlen_k // {n})",
        )


def _fill_compressed_writes(b: BatchArrays, cfg: MetadataConfig, out: Out, f: dict[str, Any]) -> None:
    """``positions_c``, ``slot_mapping_store_ca``, ``cu_compressed_seqlens_q`` for every ca ratio.

    Sequence s writes compressed tokens ``c in [q_start // n, seqlen_k // n)``, at least one row
    (``n_cq = max(1, seqlen_k//n - q_start//n)``); a sequence with none gets one row
    ``(positions_c = 0, slot = -1)``. Example: n = 4, q_start 6, seqlen_k 9 -> one row c = 1
    (position 4); q_start 5, seqlen_k 7 -> no token, one ``(0, -1)`` row.
    """
    writes = ~b.is_placeholder
    f["positions_c"], f["slot_mapping_store_ca"], f["cu_compressed_seqlens_q"] = {}, {}, {}
    for n in cfg.ca_ratios:
        k = str(n)
        c_lo, c_hi = b.q_start // n, b.seqlen_k // n
        n_cq = np.maximum(c_hi - c_lo, 1)
        cu = prefix(n_cq)
        R = int(cu[-1])
        seq = np.repeat(np.arange(b.n_seq), n_cq)
        c = expand_rows(c_lo - cu[:-1], n_cq, seq) + arange_ro(R)
        valid = c < expand_rows(c_hi, n_cq, seq)
        f["positions_c"][k], a = alloc(out, f"positions_c.{k}", (R,), torch.int32)
        a[:] = np.where(valid, c * n, 0)
        f["slot_mapping_store_ca"][k], a = alloc(out, f"slot_mapping_store_ca.{k}", (R,), torch.int32)
        a[:] = compressed_slots(b, seq, c, valid & expand_rows(writes, n_cq, seq), n, cfg)
        name = f"cu_compressed_seqlens_q.{k}"
        f["cu_compressed_seqlens_q"][k], a = alloc(out, name, (b.n_seq + 1,), torch.int32)
        a[:] = cu


def _fill_compressed_reads(
    b: BatchArrays, cfg: MetadataConfig, out: Out, f: dict[str, Any], cu_ck: dict[int, np.ndarray]
) -> None:
    """``cu_compressed_seqlens_k``, ``load_segments_ca``, ``total_k_compressed``, ``ks``/``ke``
    (sparse ratios) and ``kv_ca_index_offset_len`` (dense ratios).

    Row of sequence s at position pos sees loaded compressed rows
    ``[base, base + (pos + 1) // n)`` with ``base = cu_compressed_seqlens_k[n][s]``.
    """
    T = b.total_q
    pos1 = b.row_pos + 1
    f["cu_compressed_seqlens_k"], f["load_segments_ca"], f["total_k_compressed"] = {}, {}, {}
    for n in cfg.ca_ratios:
        k = str(n)
        name = f"cu_compressed_seqlens_k.{k}"
        f["cu_compressed_seqlens_k"][k], a = alloc(out, name, (b.n_seq + 1,), torch.int32)
        a[:] = cu_ck[n]
        f["load_segments_ca"][k] = paged_load_segments(b, cfg, n, cu_ck[n][:-1], out)
        f["total_k_compressed"][k] = int(cu_ck[n][-1])
    f["ks"], f["ke"] = {}, {}
    for r in cfg.sparse_compress_ratios:
        k = str(r)
        base = b.per_row(cu_ck[r][:-1])
        f["ks"][k], a = alloc(out, f"ks.{k}", (T,), torch.int32)
        a[:] = base
        f["ke"][k], a = alloc(out, f"ke.{k}", (T,), torch.int32)
        a[:] = base + fdiv(pos1, r)
    f["kv_ca_index_offset_len"] = {}
    for n in cfg.dense_compress_ratios:
        k = str(n)
        f["kv_ca_index_offset_len"][k], a = alloc(out, f"kv_ca_index_offset_len.{k}", (T, 2), torch.int32)
        a[:, 0] = b.per_row(cu_ck[n][:-1])
        fdiv(pos1, n, out=a[:, 1])


def _fill_swa_pivots(b: BatchArrays, cfg: MetadataConfig, out: Out) -> torch.Tensor:
    """``kv_swa_full_index_pivots`` [total_q, 4] int32 ``(P0, P1, P2, P3)`` (DESIGN section 4).

    Row j of sequence s (pos = q_start + j) sees ``[abs_lo, pos]`` with
    ``abs_lo = clamp(max(pos - W + 1, swa_valid_start), 0, pos + 1)``: history part
    ``P0 = s*W + start_slot``, ``P1 = W - start_slot`` with
    ``start_slot = min(abs_lo, q_start) - (q_start - W)``; chunk part
    ``P2 = n_seq*W + cu_seqlens_q[s] + k_lo``, ``P3 = j - k_lo + 1``, ``k_lo = max(0, abs_lo - q_start)``.
    Example: W = 4, s = 0, q_start = 6, j = 2 (pos 8, sees 5..8): start_slot 3, ``P0 = 3``,
    ``P1 = 1``, ``P2 = 4``, ``P3 = 3`` with n_seq = 1.
    """
    W, n, sq = cfg.window_size, b.n_seq, b.seqlen_q
    t, a = alloc(out, "kv_swa_full_index_pivots", (b.total_q, 4), torch.int32)
    # swa_visibility_pivots' rule (builders/swa_pivots.py, shared with YoCo) rewritten per row with
    # d = abs_lo - q_start = min(max(j - W + 1, m_s), j + 1), m_s = max(swa_valid_start - q_start,
    # -q_start): start_slot = W + min(d, 0), k_lo = max(d, 0). Per-row work is int32 (every value
    # is bounded by max_model_len or the checked n_seq * W + total_q); m_s is clipped to
    # seqlen_q first (any m_s >= j + 1 gives the same d), so it fits as well.
    m = np.maximum(b.swa_valid_start - b.q_start, -b.q_start)
    np.minimum(m, sq, out=m)
    j1 = np.add(b.row_j, 1, dtype=np.int32, casting="unsafe")  # j + 1
    d = np.repeat(m.astype(np.int32), sq)
    np.maximum(d, j1 - W, out=d)
    np.minimum(d, j1, out=d)
    lo = np.minimum(d, 0)  # start_slot - W
    np.maximum(d, 0, out=d)  # k_lo
    seq = np.arange(1, n + 1, dtype=np.int64)
    seq *= W
    np.add(np.repeat(seq.astype(np.int32), sq), lo, out=a[:, 0])  # P0 = s*W + start_slot
    np.negative(lo, out=a[:, 1])  # P1 = W - start_slot
    np.add(np.repeat((b.cu_q[:-1] + n * W).astype(np.int32), sq), d, out=a[:, 2])  # P2
    np.subtract(j1, d, out=a[:, 3])  # P3 = j - k_lo + 1
    return t


#: Fill value of ``seq_block_tables`` past a sequence's own blocks (never a real block id).
SEQ_BLOCK_TABLE_PAD: int = -1


def _fill_seq_block_tables(b: BatchArrays, out: Out) -> torch.Tensor:
    """``seq_block_tables`` [n_seq, width] int32: each sequence's WHOLE ``block_table``, -1 padded.

    ``width = max len(block_table)`` (not only the ``blocks_needed`` prefix the compressed fields
    read): a follower rank derives its own KV slot mapping from it (DESIGN 4 and 11), with no
    access to the scheduler. Example: tables ``[[7, 3, 9], [4]]`` -> ``[[7, 3, 9], [4, -1, -1]]``.
    """
    flat, whole_off = b.bt_whole, b.bt_whole_off
    # a prompt batch: extract_batch leaves the whole tables None only for prepare_decode (flat_tables=False)
    assert flat is not None and whole_off is not None
    lengths = np.diff(whole_off)
    width = int(lengths.max()) if b.n_seq else 0
    if flat.size and (flat.min() < 0 or flat.max() > INT32_MAX):
        bad = int(np.searchsorted(whole_off[1:], int(np.argmax((flat < 0) | (flat > INT32_MAX))),
                                  side="right"))
        raise ValueError(f"seqs[{bad}].block_table: expected block ids in [0, 2**31 - 1]")
    t, a = alloc(out, "seq_block_tables", (b.n_seq, width), torch.int32)
    a.fill(SEQ_BLOCK_TABLE_PAD)
    a[np.arange(width)[None, :] < lengths[:, None]] = flat
    return t


def prepare_prompt(
    seqs: BatchInput, cfg: MetadataConfig, *, out: Out = None
) -> InputMetadata:
    """Build prompt (prefill chunk) ``InputMetadata`` (CPU tensors; pinned when CUDA is available).

    Args:
        seqs: one ``SequenceMetadata`` per sequence (``token_ids`` holds at least ``seqlen_k``
            tokens, no drafts), or the same as a prompt ``SequenceBatch`` (bit-identical
            result). Bad input raises ``ValueError`` naming ``seqs[i].field``.
        cfg: the engine's ``MetadataConfig``.
        out: optional dict of preallocated tensors keyed by flattened path (``"positions"``,
            ``"ks.4"``, ``"load_segments_ca.4"``, ...), filled in place; missing ones are
            allocated and stored; a shape/dtype mismatch is a ``ValueError``.

    Returns every prompt field of DESIGN section 4: common fields ([total_q] rows),
    ``positions_c[n]`` / ``slot_mapping_store_ca[n]`` [sum n_cq], ``cu_compressed_seqlens_q[n]`` /
    ``cu_compressed_seqlens_k[n]`` [n_seq+1], ``state_block_idx`` [n_seq], ``total_k_swa``,
    ``load_segments_swa`` / ``load_segments_ca[n]`` [num_segments, 4], ``total_k_compressed[n]``,
    ``ks[r]`` / ``ke[r]`` [total_q], ``kv_ca_index_offset_len[n]`` [total_q, 2],
    ``kv_swa_full_index_pivots`` [total_q, 4], ``seq_block_tables`` [n_seq, max len(block_table)]
    (whole tables, -1 padded). Decode-only fields are ``None``, and so are the fields of a
    feature the config switches off (DESIGN 14): without compressed KV (``ca_ratios == ()``)
    every per-ratio field; without the sliding-window state cache (``window_size == 0``)
    ``slot_mapping_store_swa``, ``state_block_idx``, ``total_k_swa``, ``load_segments_swa`` and
    ``kv_swa_full_index_pivots``. A plain config keeps the common fields and ``seq_block_tables``.
    Int32 overflow of any total, offset or slot raises ``ValueError`` before allocation.
    """
    if out is not None and not isinstance(out, dict):  # prompt shapes depend on the fill: no arena layout
        raise TypeError(f"out: prepare_prompt takes None or a dict of tensors, got {type(out).__name__} "
                        "(an OutputBuffers arena serves prepare_decode, whose shapes are known from the batch)")
    return InputMetadata(**prompt_fields(extract_batch(seqs, cfg, is_prompt=True), cfg, out))


def prompt_fields(b: BatchArrays, cfg: MetadataConfig, out: Out = None, *, ngram: bool = True
                  ) -> dict[str, Any]:
    """Every prompt field of an extracted batch (:func:`prepare_prompt`'s work) as kwargs;
    ``ngram=False`` leaves ``ngram_token_ids`` out (``cpmeta.prepare_prompt_cp`` builds one
    rank's rows of it)."""
    cu_ck = {n: prefix(loaded_compressed_len(b.seqlen_k, n)) for n in cfg.ca_ratios}
    _check_prompt_int32(b, cfg, cu_ck)
    f = fill_common(b, cfg, out, ngram=ngram)
    # a disabled feature's fields are not built at all (they stay None: DESIGN 14)
    if cfg.has_compressed_kv:
        _fill_compressed_writes(b, cfg, out, f)
        _fill_compressed_reads(b, cfg, out, f, cu_ck)
    if cfg.has_swa:
        f["state_block_idx"], a = alloc(out, "state_block_idx", (b.n_seq,), torch.int32)
        a[:] = b.state_id
        f["total_k_swa"] = b.n_seq * cfg.window_size
        f["load_segments_swa"] = swa_load_segments(b, cfg, out)
        f["kv_swa_full_index_pivots"] = _fill_swa_pivots(b, cfg, out)
    f["seq_block_tables"] = _fill_seq_block_tables(b, out)
    if cfg.yoco_keep_tokens is not None:  # YoCo truncation fields (DESIGN 10), built in builders/yoco.py
        f.update(build_yoco_fields(f, b, cfg, out=out))
    return f

