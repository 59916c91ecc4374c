"""The two Triton kernels of the in-place decode path (imported lazily: needs ``triton``).

``_decode_metadata_kernel`` -- grid ``seq_cap + n_tail``: program ``s < seq_cap`` handles
sequence ``s`` (nothing if ``s >= n_seq``, read from the staging header on the device), writing
every per-row field of its rows, all ratios in one launch (stacked ``[n_ratio, q_cap]`` outputs);
programs ``>= seq_cap`` pad the tail (rows ``[total_q, q_cap)``, ``cu_seqlens[n_seq+1:]``) in
blocks of ``BLOCK_T``. ``_decode_block_tables_kernel`` -- grid ``seq_cap``: copies each
sequence's defined blocks into every one of its rows.

No host scalar of the batch is a kernel argument (only capacities and config constants), so a
CUDA graph captured at ``seq_cap`` / ``q_cap`` replays correctly for any smaller batch staged
into the same device buffer. Every store is masked to the buffers' shapes (``row < q_cap``,
programs ``s < seq_cap``, block-table ``col < n_cols``): a batch too large for them (refused on
the host by ``OutCapacity``; this is the second line of defence) is truncated, never written
past the end. ``emulate_decode_kernels`` in ``_decode_emulate`` is the same logic
in vectorized torch; the two are tested equal through ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import staging_header as L
from .decode_buffers import DecodeBuffers
from .staging_layout import StagingLayout
from ..config import MetadataConfig
from ..constants import PAD_SLOT_ID as _PAD, PLACEHOLDER_QUERY_INDEX as _PLACEHOLDER

__all__ = ["launch_decode_kernels"]

# Layout constants as constexpr globals (jit functions may only read constexpr globals).
H_N_SEQ = tl.constexpr(L.H_N_SEQ)
H_TOTAL_Q = tl.constexpr(L.H_TOTAL_Q)
H_TOTAL_K = tl.constexpr(L.H_TOTAL_K)
H_OFF_SEQ = tl.constexpr(L.H_OFF_SEQ)
H_OFF_IDS = tl.constexpr(L.H_OFF_IDS)
H_OFF_BT = tl.constexpr(L.H_OFF_BT)
H_OFF_NGV = tl.constexpr(L.H_OFF_NGV)
H_OFF_NGB = tl.constexpr(L.H_OFF_NGB)
HEADER_FIXED = tl.constexpr(L.HEADER_FIXED)
F_SEQLEN_Q = tl.constexpr(L.F_SEQLEN_Q)
F_SEQLEN_K = tl.constexpr(L.F_SEQLEN_K)
F_CU_Q_INCL = tl.constexpr(L.F_CU_Q_INCL)
F_CU_K_INCL = tl.constexpr(L.F_CU_K_INCL)
F_STATE = tl.constexpr(L.F_STATE)
F_PLACEHOLDER = tl.constexpr(L.F_PLACEHOLDER)
F_BT_OFFSET = tl.constexpr(L.F_BT_OFFSET)
PAD_SLOT_ID = tl.constexpr(_PAD)
PLACEHOLDER_QUERY_INDEX = tl.constexpr(_PLACEHOLDER)

#: Rows of one sequence handled per loop iteration (decode: 1 + drafts, usually <= 4).
BLOCK_Q = 16
#: Rows (and cu_seqlens entries) padded per tail program.
BLOCK_T = 256
#: Block-table columns copied per loop iteration.
BLOCK_C = 256


@triton.jit
def _ratio_rows(
    stg, bt, ph, row, pos, m, posc, slot_ca, klen, ca_off_len, stride_ca, stride_sp, stride_dn,
    BS, MNB, N_CA: tl.constexpr, N_SP: tl.constexpr, N_DN: tl.constexpr,
):
    """All ratios in one pass: positions_c / slot_mapping_store_ca (ca), klen (sparse),
    kv_ca_index_offset_len (dense). Ratio n, row at pos: ``(pos+1) % n == 0`` closes compressed
    token ``c = pos // n`` -> slot ``bt[c // b_c] * b_c + c % b_c`` (b_c = BS // n); e.g. n=4,
    BS=16, pos=23: c=5, slot = bt[1]*4 + 1. Dense offset of row i: ``i * MNB * (BS // n)``."""
    for ri in tl.static_range(N_CA):
        n = tl.load(stg + HEADER_FIXED + ri)
        b_c = BS // n
        done = ((pos + 1) % n) == 0
        c = pos // n
        blk = tl.load(bt + c // b_c, mask=m & done, other=0)
        tl.store(posc + ri * stride_ca + row, tl.where(done, c * n, 0), mask=m)
        slot = tl.where(done & (ph == 0), blk * b_c + c % b_c, PAD_SLOT_ID)
        tl.store(slot_ca + ri * stride_ca + row, slot, mask=m)
    for ri in tl.static_range(N_SP):
        r = tl.load(stg + HEADER_FIXED + N_CA + ri)
        tl.store(klen + ri * stride_sp + row, (pos + 1) // r, mask=m)
    for ri in tl.static_range(N_DN):
        n = tl.load(stg + HEADER_FIXED + N_CA + N_SP + ri)
        dst = ca_off_len + ri * stride_dn + row * 2
        tl.store(dst, row * (MNB * (BS // n)), mask=m)
        tl.store(dst + 1, (pos + 1) // n, mask=m)


@triton.jit
def _ngram_rows(stg, ngram, here, row, m, NGRAM_PAD, G: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Engram row from the staged window: ``here`` is the window element of the row's own position;
    column c reads ``here - c`` and is the pad id once any barrier was met at ``here - c .. here``
    (running OR). E.g. G=3, barrier flags (0, 1, 0) at here-2, here-1, here: columns 0, 1, 2 =
    (v[here], pad, pad)."""
    here = tl.load(stg + H_OFF_NGV) + here
    bar_base = tl.load(stg + H_OFF_NGB) - tl.load(stg + H_OFF_NGV)
    flag = tl.zeros([BLOCK_Q], tl.int32)
    for c in tl.static_range(G):
        flag = flag | tl.load(stg + bar_base + here - c, mask=m, other=1)
        v = tl.load(stg + here - c, mask=m, other=0)
        tl.store(ngram + row * G + c, tl.where(flag != 0, NGRAM_PAD, v), mask=m)


@triton.jit
def _seq_rows(
    stg, s, n_seq, q_cap, positions, input_ids, gate, ngram, cu_q, cu_k, valid, qidx, swa_slot, state_idx,
    ctx_lens, swa_off_len, posc, slot_ca, klen, ca_off_len, stride_ca, stride_sp, stride_dn,
    BS, S, W, MNB, NGRAM_PAD, G: tl.constexpr, N_CA: tl.constexpr, N_SP: tl.constexpr,
    N_DN: tl.constexpr, GATE: tl.constexpr, SWA: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """Every per-row field of sequence ``s`` (rows ``row0 .. row0 + seqlen_q``), masked to
    ``row < q_cap`` so a staged batch larger than the buffers can never write past them.
    ``SWA`` False (``window_size == 0``): the sliding-window fields do not exist, nothing is
    stored through their (dummy) pointers."""
    active = s < n_seq
    seq = stg + tl.load(stg + H_OFF_SEQ) + s
    q = tl.load(seq + F_SEQLEN_Q * n_seq, mask=active, other=0)
    k = tl.load(seq + F_SEQLEN_K * n_seq, mask=active, other=0)
    cuq = tl.load(seq + F_CU_Q_INCL * n_seq, mask=active, other=0)
    cuk = tl.load(seq + F_CU_K_INCL * n_seq, mask=active, other=0)
    state = tl.load(seq + F_STATE * n_seq, mask=active, other=0)
    ph = tl.load(seq + F_PLACEHOLDER * n_seq, mask=active, other=0)
    bt = stg + tl.load(stg + H_OFF_BT) + tl.load(seq + F_BT_OFFSET * n_seq, mask=active, other=0)
    ids = stg + tl.load(stg + H_OFF_IDS)
    row0 = cuq - q
    q_start = k - q
    tl.store(cu_q + s + 1, cuq, mask=active)
    tl.store(cu_k + s + 1, cuk, mask=active)
    tl.store(cu_q + s, 0, mask=s == 0)
    tl.store(cu_k + s, 0, mask=s == 0)
    j0 = q * 0
    while j0 < q:  # `while`, not range(): the interpreter cannot take a loaded bound (numpy 2)
        j = j0 + tl.arange(0, BLOCK_Q)
        row = row0 + j
        m = (j < q) & (row < q_cap)
        pos = q_start + j
        tl.store(positions + row, pos, mask=m)
        tl.store(input_ids + row, tl.load(ids + row, mask=m, other=0), mask=m)
        tl.store(gate + row, tl.full([BLOCK_Q], GATE, tl.int1), mask=m)
        tl.store(valid + row, tl.full([BLOCK_Q], 0, tl.int32) == ph, mask=m)
        tl.store(qidx + row, tl.where(ph != 0, PLACEHOLDER_QUERY_INDEX, s + 0 * j), mask=m)
        tl.store(ctx_lens + row, pos + 1, mask=m)
        if SWA:
            no_swa = (ph != 0) | (q - j > S)
            tl.store(swa_slot + row, tl.where(no_swa, PAD_SLOT_ID, state * S + pos % S), mask=m)
            tl.store(state_idx + row, state + 0 * j, mask=m)
            w = tl.minimum(pos + 1, W)
            tl.store(swa_off_len + row * 2, state * S + (pos - w + 1) % S, mask=m)
            tl.store(swa_off_len + row * 2 + 1, w, mask=m)
        _ratio_rows(stg, bt, ph, row, pos, m, posc, slot_ca, klen, ca_off_len, stride_ca, stride_sp,
                    stride_dn, BS, MNB, N_CA, N_SP, N_DN)
        if G > 0:
            _ngram_rows(stg, ngram, row0 + s * (G - 1) + (G - 1) + j, row, m, NGRAM_PAD, G, BLOCK_Q)
        j0 += BLOCK_Q


@triton.jit
def _tail_rows(
    t, n_seq, total_q, total_k, seq_cap, q_cap, positions, input_ids, gate, ngram, cu_q, cu_k, valid,
    qidx, swa_slot, state_idx, ctx_lens, swa_off_len, posc, slot_ca, klen, ca_off_len,
    stride_ca, stride_sp, stride_dn, NGRAM_PAD, G: tl.constexpr, N_CA: tl.constexpr,
    N_SP: tl.constexpr, N_DN: tl.constexpr, GATE: tl.constexpr, SWA: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Inert values for rows ``[total_q, q_cap)`` and ``cu_seqlens[n_seq+1 : seq_cap+1]``."""
    idx = t * BLOCK_T + tl.arange(0, BLOCK_T)
    m = (idx >= total_q) & (idx < q_cap)
    zero = tl.zeros([BLOCK_T], tl.int32)
    tl.store(positions + idx, zero, mask=m)
    tl.store(input_ids + idx, zero, mask=m)
    tl.store(gate + idx, tl.full([BLOCK_T], GATE, tl.int1), mask=m)
    tl.store(valid + idx, zero != 0, mask=m)
    tl.store(qidx + idx, zero + PLACEHOLDER_QUERY_INDEX, mask=m)
    tl.store(ctx_lens + idx, zero, mask=m)
    if SWA:
        tl.store(swa_slot + idx, zero + PAD_SLOT_ID, mask=m)
        tl.store(state_idx + idx, zero, mask=m)
        tl.store(swa_off_len + idx * 2, zero, mask=m)
        tl.store(swa_off_len + idx * 2 + 1, zero, mask=m)
    for ri in tl.static_range(N_CA):
        tl.store(posc + ri * stride_ca + idx, zero, mask=m)
        tl.store(slot_ca + ri * stride_ca + idx, zero + PAD_SLOT_ID, mask=m)
    for ri in tl.static_range(N_SP):
        tl.store(klen + ri * stride_sp + idx, zero, mask=m)
    for ri in tl.static_range(N_DN):
        tl.store(ca_off_len + ri * stride_dn + idx * 2, zero, mask=m)
        tl.store(ca_off_len + ri * stride_dn + idx * 2 + 1, zero, mask=m)
    for c in tl.static_range(G):
        tl.store(ngram + idx * G + c, zero + NGRAM_PAD, mask=m)
    mc = (idx > n_seq) & (idx <= seq_cap)
    tl.store(cu_q + idx, zero + total_q, mask=mc)
    tl.store(cu_k + idx, zero + total_k, mask=mc)


@triton.jit
def _decode_metadata_kernel(
    stg, positions, input_ids, gate, ngram, cu_q, cu_k, valid, qidx, swa_slot, state_idx, ctx_lens,
    swa_off_len, posc, slot_ca, klen, ca_off_len, seq_cap, q_cap, stride_ca, stride_sp, stride_dn,
    BS, S, W, MNB, NGRAM_PAD, G: tl.constexpr, N_CA: tl.constexpr, N_SP: tl.constexpr,
    N_DN: tl.constexpr, GATE: tl.constexpr, SWA: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Config sizes (BS, S, W, MNB, NGRAM_PAD) are runtime ints so a new config does not recompile;
    only the loop structure (G, ratio counts, GATE, SWA, block sizes) is specialised. A plain
    config (DESIGN 14) is ``N_CA = N_SP = N_DN = 0``, ``SWA`` False: only the common fields."""
    pid = tl.program_id(0)
    n_seq = tl.load(stg + H_N_SEQ)
    if pid < seq_cap:
        _seq_rows(
            stg, pid, n_seq, q_cap, positions, input_ids, gate, ngram, cu_q, cu_k, valid, qidx, swa_slot,
            state_idx, ctx_lens, swa_off_len, posc, slot_ca, klen, ca_off_len, stride_ca, stride_sp,
            stride_dn, BS, S, W, MNB, NGRAM_PAD, G, N_CA, N_SP, N_DN, GATE, SWA, BLOCK_Q,
        )
    else:
        _tail_rows(
            pid - seq_cap, n_seq, tl.load(stg + H_TOTAL_Q), tl.load(stg + H_TOTAL_K), seq_cap, q_cap,
            positions, input_ids, gate, ngram, cu_q, cu_k, valid, qidx, swa_slot, state_idx, ctx_lens,
            swa_off_len, posc, slot_ca, klen, ca_off_len, stride_ca, stride_sp, stride_dn,
            NGRAM_PAD, G, N_CA, N_SP, N_DN, GATE, SWA, BLOCK_T,
        )


@triton.jit
def _decode_block_tables_kernel(stg, block_tables, bt_stride, q_cap, n_cols, BS, M, KV_W, KV_I,
                                BLOCK_C: tl.constexpr):
    """Row ``row0 + j`` of sequence ``s`` gets its ``blocks_needed(seqlen_k)`` defined blocks,
    ``cdiv(L // M, BS // M)`` with ``L`` the keys of rank 0's share of KV sharded over ``KV_W``
    ranks in runs of ``KV_I`` (``L = (k // (W*I)) * I + min(k % (W*I), I)``; ``k`` when
    ``KV_W = 1``; e.g. W=3, I=1, k=300 -> L=100); writes are masked to ``row < q_cap`` and
    ``col < n_cols`` (the buffer's shape)."""
    s = tl.program_id(0)
    n_seq = tl.load(stg + H_N_SEQ)
    active = s < n_seq
    seq = stg + tl.load(stg + H_OFF_SEQ) + s
    q = tl.load(seq + F_SEQLEN_Q * n_seq, mask=active, other=0)
    k = tl.load(seq + F_SEQLEN_K * n_seq, mask=active, other=0)
    row0 = tl.load(seq + F_CU_Q_INCL * n_seq, mask=active, other=0) - q
    src = stg + tl.load(stg + H_OFF_BT) + tl.load(seq + F_BT_OFFSET * n_seq, mask=active, other=0)
    share = (k // (KV_W * KV_I)) * KV_I + tl.minimum(k % (KV_W * KV_I), KV_I)
    nb = (share // M + (BS // M) - 1) // (BS // M)
    q_rows = tl.minimum(q, q_cap - row0)  # rows of this sequence inside the buffer
    c0 = nb * 0
    while c0 < nb:
        cols = c0 + tl.arange(0, BLOCK_C)
        mc = (cols < nb) & (cols < n_cols)
        v = tl.load(src + cols, mask=mc, other=0)
        j = q * 0
        while j < q_rows:
            dst = block_tables + (row0 + j).to(tl.int64) * bt_stride
            tl.store(dst + cols, v, mask=mc)
            j += 1
        c0 += BLOCK_C


def launch_decode_kernels(stg: torch.Tensor, cfg: MetadataConfig, b: DecodeBuffers) -> None:
    """Launch both kernels on ``stg`` (device int32 staging) writing ``b`` (same device).

    Grid: ``seq_cap + cdiv(max(q_cap, seq_cap + 1), BLOCK_T)`` metadata programs, ``seq_cap``
    block-table programs. Example: 256 sequences, 768 rows: 256 + 3 and 256 programs.
    """
    n_tail = triton.cdiv(max(b.q_cap, b.seq_cap + 1), BLOCK_T)
    pos_t = b["positions"]
    # a field that does not exist (Engram, SWA or compressed KV off) or an empty stacked buffer
    # (no sparse / dense ratio) is never dereferenced: pass a real tensor, stride 0
    ngram, swa_slot, state_idx, swa_off_len, posc, slot_ca, klen, off_len = (
        x if x is not None and x.numel() else pos_t
        for x in (b.get(n) for n in ("ngram_token_ids", "slot_mapping_store_swa", "state_block_idx",
                                     "kv_swa_index_offset_len", "positions_c", "slot_mapping_store_ca", "klen",
                                     "kv_ca_index_offset_len"))
    )
    strides = (0 if x is None else x.stride(0) for x in (b.get(n) for n in ("positions_c", "klen",
                                                                            "kv_ca_index_offset_len")))
    n_ca, n_sp, n_dn = StagingLayout.of(cfg).ratio_counts  # the header's ratio words, in its order
    bt = b["block_tables"]
    _decode_metadata_kernel[(b.seq_cap + n_tail,)](
        stg, pos_t, b["input_ids"], b["gate_force_random"], ngram, b["cu_seqlens_q"], b["cu_seqlens_k"],
        b["valid_token_mask"], b["query_indices"], swa_slot, state_idx, b["context_lens"], swa_off_len,
        posc, slot_ca, klen, off_len, b.seq_cap, b.q_cap, *strides,
        cfg.block_size, cfg.swa_block_size, cfg.window_size, cfg.max_num_blocks, cfg.ngram_pad_token,
        G=cfg.max_ngram_size, N_CA=n_ca, N_SP=n_sp, N_DN=n_dn, GATE=cfg.force_load_balance, SWA=cfg.has_swa,
        BLOCK_Q=BLOCK_Q, BLOCK_T=BLOCK_T,
    )
    _decode_block_tables_kernel[(b.seq_cap,)](
        stg, bt, bt.stride(0), b.q_cap, bt.shape[1], cfg.block_size,
        cfg.min_ratio, cfg.kv_cp_world_size, cfg.kv_cp_interleave, BLOCK_C=BLOCK_C,
    )
