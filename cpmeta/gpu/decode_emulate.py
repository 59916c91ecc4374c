"""CPU fallback of the in-place decode kernels: vectorized torch over the SAME staging buffer.

:func:`emulate_decode_kernels` writes exactly what ``_decode_triton``'s two kernels write, into
the same :class:`~cpmeta.gpu.decode_buffers.DecodeBuffers` (tail rows included), reading the same
int32 staging layout. CI tests the kernel logic through it (and through the Triton interpreter).

Per row ``i`` of sequence ``s`` (local index ``j``), everything derives from four staged
per-sequence values: ``row0 = cu_seqlens_q_incl[s] - seqlen_q[s]``, ``j = i - row0``,
``pos = seqlen_k[s] - seqlen_q[s] + j``. Example: ``seqlen_q = (1, 3)``, ``seqlen_k = (5, 9)``
give ``cu_seqlens_q_incl = (1, 4)``, rows 0..3 belong to sequences (0, 1, 1, 1), ``j = (0, 0, 1, 2)``
and ``pos = (4, 6, 7, 8)``.
"""

from __future__ import annotations

import torch

from .decode_buffers import DecodeBuffers
from .staging_header import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, HEADER_FIXED, SEQ_FIELDS,
)
from .staging_layout import StagingLayout
from ..config import MetadataConfig, blocks_needed_tensor
from ..constants import PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX

__all__ = ["emulate_decode_kernels"]


def _ratios(stg: torch.Tensor, cfg: MetadataConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ca / sparse / dense ratio lists from the header (the layout's ratio order), each
    ``[n_ratio, 1]`` int64."""
    n_ca, n_sp, n_dn = StagingLayout.of(cfg).ratio_counts
    r = stg[HEADER_FIXED:HEADER_FIXED + n_ca + n_sp + n_dn].long()[:, None]
    return r[:n_ca], r[n_ca:n_ca + n_sp], r[n_ca + n_sp:]


def _write_tail(b: DecodeBuffers, cfg: MetadataConfig, n: int, tq: int, tk: int) -> None:
    """Inert values for rows ``[tq, q_cap)`` and ``cu_seqlens_*[n+1:]`` (see DecodeBuffers);
    the buffers of switched-off features are ``None`` and skipped."""
    t = slice(tq, b.q_cap)
    for name in ("positions", "input_ids", "context_lens"):
        b[name][t] = 0
    b["gate_force_random"][t] = cfg.force_load_balance
    ngram = b.get("ngram_token_ids")
    if ngram is not None:
        ngram[t] = cfg.ngram_pad_token
    b["valid_token_mask"][t] = False
    b["query_indices"][t] = PLACEHOLDER_QUERY_INDEX
    for name, fill in (("state_block_idx", 0), ("kv_swa_index_offset_len", 0), ("slot_mapping_store_swa", PAD_SLOT_ID)):
        x = b.get(name)  # the sliding-window fields: absent with window_size == 0
        if x is not None:
            x[t] = fill
    for name, fill in (("positions_c", 0), ("slot_mapping_store_ca", PAD_SLOT_ID), ("klen", 0),
                       ("kv_ca_index_offset_len", 0)):
        stacked = b.get(name)
        if stacked is not None:
            stacked[:, t] = fill
    b["cu_seqlens_q"][n + 1:] = tq
    b["cu_seqlens_k"][n + 1:] = tk


def _write_compressed(
    b: DecodeBuffers, stg: torch.Tensor, cfg: MetadataConfig, tq: int, off_bt: int,
    pos: torch.Tensor, ph: torch.Tensor, bto: torch.Tensor,
) -> None:
    """positions_c / slot_mapping_store_ca (ca ratios), klen (sparse), kv_ca_index_offset_len (dense).

    Ratio n, row at ``pos``: ``(pos+1) % n == 0`` completes compressed token ``c = pos // n``,
    slot ``table[c // b_c] * b_c + c % b_c`` with ``b_c = block_size // n``. Example: n=4,
    block_size=16 (b_c=4), pos=23: c=5, slot = table[1]*4 + 1.
    """
    posc, slot_ca, klen, off_len = (b.get(n) for n in ("positions_c", "slot_mapping_store_ca", "klen",
                                                      "kv_ca_index_offset_len"))
    if posc is None or slot_ca is None or klen is None or off_len is None:  # no compressed KV
        return
    ca, sp, dn = _ratios(stg, cfg)
    if ca.numel():
        done = (pos + 1) % ca == 0
        c = pos // ca
        b_c = cfg.block_size // ca
        idx = torch.where(done, off_bt + bto + c // b_c, 0)
        blk = stg[idx].long()
        posc[:, :tq] = torch.where(done, c * ca, 0)
        slot_ca[:, :tq] = torch.where(done & ~ph, blk * b_c + c % b_c, PAD_SLOT_ID)
    if sp.numel():
        klen[:, :tq] = (pos + 1) // sp
    if dn.numel():
        rows = torch.arange(tq, device=pos.device)
        off_len[:, :tq, 0] = rows * cfg.max_num_blocks * (cfg.block_size // dn)
        off_len[:, :tq, 1] = (pos + 1) // dn


def _write_ngram(
    b: DecodeBuffers, stg: torch.Tensor, cfg: MetadataConfig, hdr: list[int],
    s_of: torch.Tensor, row0_r: torch.Tensor, j: torch.Tensor, lim: int,
) -> None:
    """Column c of row (s, j) reads window element ``w = row0 + s*(G-1) + G-1 + j - c``; pad if any
    barrier lies in ``[w, w + c]``. Example: G=2, s=1, row0=1, j=0: c=0 reads 3, c=1 reads 2."""
    g, ngram = cfg.max_ngram_size, b.get("ngram_token_ids")
    if ngram is None or g == 0:
        return
    off_v, off_b = hdr[6], hdr[7]
    here = row0_r + s_of * (g - 1) + (g - 1) + j
    w = here[:, None] - torch.arange(g, device=here.device)[None, :]
    barrier = (stg[off_b + w] != 0).int().cummax(dim=1).values.bool()
    vals = stg[off_v + w]
    ngram[:lim] = torch.where(barrier, cfg.ngram_pad_token, vals)


def _write_block_tables(
    b: DecodeBuffers, stg: torch.Tensor, cfg: MetadataConfig, tq: int, off_bt: int,
    k_r: torch.Tensor, bto_r: torch.Tensor,
) -> None:
    """Row i gets the ``blocks_needed(seqlen_k)`` defined blocks of its sequence: ``cdiv(L // m,
    block_size // m)`` with L the keys of rank 0's KV share (``seqlen_k`` unless the KV is
    sharded)."""
    nb = blocks_needed_tensor(k_r, cfg)
    bt = b["block_tables"]
    cols = torch.arange(bt.shape[1], device=k_r.device)
    keep = cols[None, :] < nb[:, None]
    src = off_bt + bto_r[:, None] + cols[None, :]
    bt[:tq][keep] = stg[src[keep]]


def _rows_written(b: DecodeBuffers, seq: torch.Tensor, n: int, tq: int) -> int:
    """Rows the kernels write: ``min(q_cap, rows of the first seq_cap sequences)`` (the grid has
    ``seq_cap`` sequence programs, every store is masked to ``row < q_cap``). Example: q_cap 4,
    seq_cap 4, eight one-row sequences: 4 rows; q_cap 8, seq_cap 2, ``seqlen_q = (3, 3, 1)``: 6."""
    lim = tq if n <= b.seq_cap else int(seq[F_CU_Q_INCL, b.seq_cap - 1]) if b.seq_cap else 0
    return max(0, min(lim, b.q_cap))


def emulate_decode_kernels(stg: torch.Tensor, cfg: MetadataConfig, b: DecodeBuffers) -> None:
    """Fill ``b`` from the int32 staging buffer ``stg`` (same device as ``b``), like the kernels.

    Writes every per-row decode field for rows ``[0, total_q)``, ``cu_seqlens_q/k``, the tail,
    and the defined columns of ``block_tables``. Reads the header with ``tolist()`` (a host sync
    on CUDA: this fallback is for CPU; the Triton path reads the header on the device). Like the
    kernels, it never writes outside ``b`` (see :func:`_rows_written`).
    """
    hdr = stg[:HEADER_FIXED].tolist()
    n, tq, tk, off_seq, off_ids, off_bt = hdr[:6]
    seq = stg[off_seq:off_seq + SEQ_FIELDS * n].view(SEQ_FIELDS, n).long()
    q, k = seq[F_SEQLEN_Q], seq[F_SEQLEN_K]
    row0 = seq[F_CU_Q_INCL] - q
    lim = _rows_written(b, seq, n, tq)
    s_of = torch.repeat_interleave(torch.arange(n, device=stg.device), q, output_size=tq)[:lim]
    j = torch.arange(lim, device=stg.device) - row0[s_of]
    q_r, k_r = q[s_of], k[s_of]
    pos = k_r - q_r + j
    ph = seq[F_PLACEHOLDER][s_of] != 0
    state = seq[F_STATE][s_of]
    S, W = cfg.swa_block_size, cfg.window_size
    b["positions"][:lim] = pos
    b["input_ids"][:lim] = stg[off_ids:off_ids + lim]
    b["gate_force_random"][:lim] = cfg.force_load_balance
    b["valid_token_mask"][:lim] = ~ph
    b["query_indices"][:lim] = torch.where(ph, PLACEHOLDER_QUERY_INDEX, s_of)
    b["context_lens"][:lim] = pos + 1
    swa_slot, st_idx, swa_ol = (b.get(n) for n in ("slot_mapping_store_swa", "state_block_idx",
                                                   "kv_swa_index_offset_len"))
    if swa_slot is not None and st_idx is not None and swa_ol is not None:  # the sliding-window state cache
        swa_slot[:lim] = torch.where(ph | (q_r - j > S), PAD_SLOT_ID, state * S + pos % S)
        st_idx[:lim] = state
        w = torch.clamp(pos + 1, max=W)
        swa_ol[:lim, 0] = state * S + (pos - w + 1) % S
        swa_ol[:lim, 1] = w
    _write_compressed(b, stg, cfg, lim, off_bt, pos, ph, seq[F_BT_OFFSET][s_of])
    _write_ngram(b, stg, cfg, hdr, s_of, row0[s_of], j, lim)
    ns = min(n, b.seq_cap)
    b["cu_seqlens_q"][0] = 0
    b["cu_seqlens_k"][0] = 0
    b["cu_seqlens_q"][1:ns + 1] = seq[F_CU_Q_INCL, :ns]
    b["cu_seqlens_k"][1:ns + 1] = seq[F_CU_K_INCL, :ns]
    _write_tail(b, cfg, n, tq, tk)
    _write_block_tables(b, stg, cfg, lim, off_bt, k_r, seq[F_BT_OFFSET][s_of])
