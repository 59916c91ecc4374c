"""The prompt build's fill pass: every field of a counted batch into one arena, one compiled call.

The build is the reference engine's two passes: the count pass (:mod:`.prompt_count_njit`:
``prompt_count`` checks the bounds and writes the data-dependent sizes into ``cnt``); the Python
wrapper (:func:`cpmeta.builders.prompt.prepare_prompt`) makes the arena of those sizes;
:func:`prompt_fill` (here) writes every field of docs/design.md sections 4 ("Common", "Prompt
only") and 10 (YoCo) into the arena's bytes at the element offsets :func:`field_offsets` reads
from its layout. Both read a prompt ``SequenceBatch``'s arrays and the config's constants
(``prompt_consts``); the common per-row fields come from :mod:`.common_njit`. This module is the
wrapper's one import of the prompt kernels: it names the count pass's too (``__all__``).

Worked example (W = S = 4, block_size 16, ratio 4, one sequence ``seqlen_q = 3``, ``seqlen_k =
9`` (q_start 6), state 2, table ``[7]``, swa_valid_start 0): positions ``6, 7, 8``; SWA slots
``[8 + 2, 8 + 3, 8 + 0] = [10, 11, 8]``; loaded compressed rows ``max(1, 9 // 4) = 2``:
``cu_compressed_seqlens_k["4"] = [0, 2]``, ``ks["4"] = [0, 0, 0]``, ``ke["4"] = [1, 2, 2]``;
compressed rows written ``c in [6 // 4, 9 // 4) = [1, 2)``: ``positions_c["4"] = [4]``, slot
``7 * 4 + 1 = 29``; paged plan ``[[7, 0, 2, 0]]``; SWA history positions ``2..5`` at ring slots
``2, 3`` then ``0, 1``: ``load_segments_swa = [[2, 2, 4, 0], [2, 0, 2, 2]]``; pivots of row j = 0
(pos 6 sees 3..6): ``(1, 3, 4, 1)``.
"""

from __future__ import annotations

import numpy as np

from ..buffers import ArenaLayout
from ..config import MetadataConfig
from ..constants import NO_SOURCE_BLOCK, PAD_SLOT_ID
from ..jit import OK, kernel
from .common_njit import E_NGRAM_TABLE, compressed_slot, fill_common_rows, fill_cu_seqlens, fill_ngram_rows
from .prompt_count_njit import (
    _BS, _FORCE, _HAS_IMG, _IMG, _KEEP, _N, _NCA, _NDE, _NSP, _PAD, _RATIOS, _S, _W, CNT_MAX_K, CNT_MAX_Q,
    CNT_RATIOS, CNT_SEG_SWA, CNT_SUM_K, CNT_T, CNT_TOTAL_C, CNT_WIDTH, E_CU_COMPRESSED_K, E_PIVOTS, E_TABLE_ID,
    count_slots, prompt_consts, prompt_count, swa_run,
)

__all__ = [
    "prompt_fill", "pivot_rows", "yoco_compact", "ratio_shift", "fdiv", "field_offsets", "PROMPT_FIELDS",
    # the count pass (prompt_count_njit), named here for the wrapper
    "prompt_count", "swa_run", "prompt_consts", "count_slots", "E_PIVOTS", "E_CU_COMPRESSED_K", "E_TABLE_ID",
    "CNT_T", "CNT_SUM_K", "CNT_MAX_Q", "CNT_MAX_K", "CNT_WIDTH", "CNT_SEG_SWA", "CNT_TOTAL_C", "CNT_RATIOS",
]

#: The prompt fields in the order of :func:`field_offsets` (kernel slot = index here); a per-ratio
#: field takes one column per ratio of its set (ca, sparse or dense, config order).
PROMPT_FIELDS: tuple[str, ...] = (
    "positions", "input_ids", "gate_force_random", "ngram_token_ids", "cu_seqlens_q", "cu_seqlens_k",
    "valid_token_mask", "query_indices", "positions_c", "slot_mapping_store_ca", "slot_mapping_store_swa",
    "cu_compressed_seqlens_q", "state_block_idx", "load_segments_swa", "cu_compressed_seqlens_k",
    "load_segments_ca", "ks", "ke", "kv_ca_index_offset_len", "kv_swa_full_index_pivots", "seq_block_tables",
    "yoco_mask_swa_index_pivots", "yoco_consumer_cu_seqlens_q", "yoco_consumer_query_indices",
    "yoco_consumer_positions", "yoco_consumer_slot_mapping_store_swa", "yoco_consumer_ks", "yoco_consumer_ke",
    "yoco_consumer_kv_ca_index_offset_len", "yoco_consumer_kv_swa_full_index_pivots",
)
(_POS, _IDS, _GATE, _NGRAM, _CUQ, _CUK, _VALID, _QIDX, _PC, _SLCA, _SWA, _CUCQ, _STATE, _SEGSWA, _CUCK, _SEGCA,
 _KS, _KE, _KVCA, _PIV, _SBT, _YMASK, _YCU, _YQI, _YPOS, _YSLOT, _YKS, _YKE, _YKVCA, _YPIV) = range(len(PROMPT_FIELDS))


def field_offsets(layout: ArenaLayout, cfg: MetadataConfig) -> np.ndarray:
    """``[len(PROMPT_FIELDS), max(1, n_ca)]`` int64: each field's start in the arena in elements of
    its dtype (int32 or bool views of the same bytes), one column per ratio of a per-ratio field
    (layout names ``"ks.4"``), -1 where the layout lacks it. Example: a plain layout -> row
    ``positions`` ``[0]``, row ``ks`` ``[-1]``."""
    from ..fields import ratios_of
    from ..metadata import FIELDS

    fo = np.full((len(PROMPT_FIELDS), max(1, len(cfg.ca_ratios))), -1, np.int64)
    for k, name in enumerate(PROMPT_FIELDS):
        rs = FIELDS[name].ratios
        keys = [name] if rs is None else [f"{name}.{r}" for r in ratios_of(cfg, rs)]
        for a, key in enumerate(keys):
            f = layout.fields.get(key)
            if f is not None:
                fo[k, a] = f[0]
    fo.flags.writeable = False
    return fo


@kernel
def ratio_shift(d: int) -> int:
    """``log2(d)`` when ``d`` is a power of two, else -1 (:func:`fdiv` then divides). Example:
    ``ratio_shift(128) == 7``, ``ratio_shift(12) == -1``."""
    sh = 0
    while (1 << sh) < d:
        sh += 1
    return sh if (1 << sh) == d else -1


@kernel
def fdiv(x: int, d: int, sh: int) -> int:
    """``x // d`` for ``x >= 0``: a shift when ``sh = ratio_shift(d) >= 0``. Example: ``fdiv(9, 4,
    2) == 2``."""
    return x >> sh if sh >= 0 else x // d


@kernel
def pivot_rows(piv: np.ndarray, s: int, j0: int, j1: int, q0: int, lower: int, W: int, sec2: int) -> None:
    """SWA pivots ``(P0, P1, P2, P3)`` of rows ``j0 <= j < j1`` of sequence ``s`` into ``piv``
    (``[4 * (j1 - j0)]``,
    docs/design.md sections 4 and 10; ``lower``: ``swa_valid_start``, with YoCo ``max(rect_lo, swa_valid_start)``;
    ``sec2 = n_seq * W + cu_seqlens_q[s]``). Row j, ``pos = q0 + j``: ``abs_lo = clamp(max(pos - W
    + 1, lower), 0, pos + 1)``, ``start_slot = min(abs_lo, q0) - (q0 - W)``, ``P0 = s * W +
    start_slot``, ``P1 = W - start_slot``, ``k_lo = max(0, abs_lo - q0)``, ``P2 = sec2 + k_lo``,
    ``P3 = j - k_lo + 1``. Example: W = 4, s = 1, q0 = 5, sec2 = 11, row j = 1 (pos 6): lower 0 ->
    ``(6, 2, 11, 2)``; lower 6 -> ``(8, 0, 12, 1)``; lower 9 -> ``(8, 0, 13, 0)`` (nothing visible)."""
    for i in range(j1 - j0):
        j = j0 + i
        pos = q0 + j
        abs_lo = min(max(max(pos - W + 1, lower), 0), pos + 1)
        start_slot = min(abs_lo, q0) - (q0 - W)
        k_lo = max(0, abs_lo - q0)
        piv[4 * i] = s * W + start_slot
        piv[4 * i + 1] = W - start_slot
        piv[4 * i + 2] = sec2 + k_lo
        piv[4 * i + 3] = j - k_lo + 1


@kernel
def prompt_fill(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, valid_start: np.ndarray,
                is_ph: np.ndarray, num_tokens: np.ndarray, tokens: np.ndarray, tok_off: np.ndarray,
                comp: np.ndarray, comp_off: np.ndarray, bt: np.ndarray, bt_off: np.ndarray, k: np.ndarray,
                table: np.ndarray, cnt: np.ndarray, raw: np.ndarray, fo: np.ndarray, err: np.ndarray) -> int:
    """Pass 2: every prompt field of a batch :func:`prompt_count` accepted into ``raw`` (the arena's
    uint8 bytes) at the offsets ``fo`` (:func:`field_offsets`; a field at -1 is not written).

    Per sequence s (rows ``[r0, r0 + q)``, ``q0 = seqlen_k - q``, row j at ``pos = q0 + j``):
    the common fields (:mod:`.common_njit`); ``state_block_idx = state``; the SWA plan
    (:func:`swa_run`: ``[-1, 0, pad, s*W]``, ``[state, a % S, a % S + first, s*W + pad]``,
    ``[state, 0, second, s*W + pad + first]``, empty ones left out); the pivots
    (:func:`pivot_rows`); ``seq_block_tables`` row = the whole table, -1 after. Per ca ratio n
    (``b_c = block_size // n``): ``cu_compressed_seqlens_k`` sums ``max(1, seqlen_k // n)``
    (``base`` = the sequence's entry); compressed rows ``c in [q0 // n, seqlen_k // n)`` with
    ``positions_c = c * n`` and slot ``table[c // b_c] * b_c + c % b_c`` (-1 on placeholders), one
    ``(0, -1)`` row when there is none; paged plan ``[table[i], 0, min(b_c, m - i*b_c), base +
    i*b_c]`` over ``m = seqlen_k // n`` (``[-1, 0, 1, base]`` when m = 0). ``ks[r] = base``,
    ``ke[r] = base + (pos + 1) // r``; ``kv_ca_index_offset_len[n] = (base, (pos + 1) // n)``.
    YoCo (``rect_lo = max(0, num_tokens - keep)``, pivots with ``lower = max(rect_lo,
    swa_valid_start)``): mask pivots on every row; compact keeps rows ``j >= clip = min(max(
    num_tokens - keep - q0, 0), q - 1)`` (:func:`yoco_compact`). Returns OK, or an Engram code
    (a table error first). Rows are written through per-sequence slices indexed from 0 (numba
    checks a possibly negative index on every access; ``row0 + j`` would cost ~3x). Example: see
    the module doc.
    """
    n = seqlen_q.shape[0]
    T = cnt[CNT_T]
    bs = k[_BS]
    W = k[_W]
    S = k[_S] if W > 0 else 0
    N = k[_N]
    keep = k[_KEEP]
    nsp = k[_NSP]
    nca = k[_NCA]
    nde = k[_NDE]
    width = cnt[CNT_WIDTH]
    a32 = raw.view(np.int32)
    ab = raw.view(np.bool_)
    cu_q = a32[fo[_CUQ, 0]:fo[_CUQ, 0] + n + 1]
    code = fill_cu_seqlens(seqlen_q, seqlen_k, cu_q, a32[fo[_CUK, 0]:fo[_CUK, 0] + n + 1], err)
    if code != OK:
        return code
    positions = a32[fo[_POS, 0]:fo[_POS, 0] + T]
    input_ids = a32[fo[_IDS, 0]:fo[_IDS, 0] + T]
    gate = ab[fo[_GATE, 0]:fo[_GATE, 0] + T]
    valid = ab[fo[_VALID, 0]:fo[_VALID, 0] + T]
    qidx = a32[fo[_QIDX, 0]:fo[_QIDX, 0] + T]
    swa = a32[fo[_SWA, 0]:fo[_SWA, 0] + T] if S > 0 else a32[0:0]
    ngram_on = fo[_NGRAM, 0] >= 0
    ngram = a32[fo[_NGRAM, 0]:fo[_NGRAM, 0] + T * N].reshape((T, N)) if ngram_on else a32[0:0].reshape((0, 0))
    force = k[_FORCE] != 0
    for s in range(n):
        q = seqlen_q[s]
        sk = seqlen_k[s]
        r0 = cu_q[s]
        r1 = r0 + q
        fill_common_rows(s, 0, q, sk, state_id[s], is_ph[s], tokens, tok_off[s + 1], S, force, positions[r0:r1],
                         input_ids[r0:r1], gate[r0:r1], valid[r0:r1], qidx[r0:r1], swa[r0:r1] if S > 0 else swa)
        if ngram_on:
            code = fill_ngram_rows(s, 0, q, sk - q, tokens, tok_off[s], sk - (tok_off[s + 1] - tok_off[s]), comp,
                                   comp_off[s], comp_off[s + 1] - comp_off[s], k[_PAD], k[_IMG], k[_HAS_IMG] != 0,
                                   table, table.shape[0] > 0, ngram[r0:r1], err)
            if code == E_NGRAM_TABLE:
                return code
    # ---- the sliding-window state cache: state slots, SWA load plan, pivots (and YoCo mask's)
    if W > 0:
        o_st, o_piv, o_y = fo[_STATE, 0], fo[_PIV, 0], fo[_YMASK, 0]
        seg = a32[fo[_SEGSWA, 0]:fo[_SEGSWA, 0] + 4 * cnt[CNT_SEG_SWA]]
        g = 0
        for s in range(n):
            st = state_id[s]
            a32[o_st + s] = st
            q = seqlen_q[s]
            q0 = seqlen_k[s] - q
            pad, a_mod, first, second = swa_run(q0, valid_start[s], W, S)
            dst = s * W
            if pad > 0:
                seg[g], seg[g + 1], seg[g + 2], seg[g + 3] = NO_SOURCE_BLOCK, 0, pad, dst
                g += 4
            if first > 0:
                seg[g], seg[g + 1], seg[g + 2], seg[g + 3] = st, a_mod, a_mod + first, dst + pad
                g += 4
            if second > 0:
                seg[g], seg[g + 1], seg[g + 2], seg[g + 3] = st, 0, second, dst + pad + first
                g += 4
            r0 = cu_q[s]
            pivot_rows(a32[o_piv + 4 * r0:o_piv + 4 * (r0 + q)], s, 0, q, q0, valid_start[s], W, n * W + r0)
            if keep >= 0 and o_y >= 0:
                lower = max(max(num_tokens[s] - keep, 0), valid_start[s])
                pivot_rows(a32[o_y + 4 * r0:o_y + 4 * (r0 + q)], s, 0, q, q0, lower, W, n * W + r0)
    # ---- compressed KV writes, loaded rows and paged load plan, per ca ratio
    for a in range(nca):
        m = k[_RATIOS + a]
        bc = bs // m
        cuck = a32[fo[_CUCK, a]:fo[_CUCK, a] + n + 1]
        cucq = a32[fo[_CUCQ, a]:fo[_CUCQ, a] + n + 1]
        nrows = cnt[CNT_RATIOS + 3 * a]
        pc = a32[fo[_PC, a]:fo[_PC, a] + nrows]
        sl = a32[fo[_SLCA, a]:fo[_SLCA, a] + nrows]
        seg = a32[fo[_SEGCA, a]:fo[_SEGCA, a] + 4 * cnt[CNT_RATIOS + 3 * a + 1]]
        cuck[0] = 0
        cucq[0] = 0
        rc = 0
        g = 0
        for s in range(n):
            sk = seqlen_k[s]
            c_lo = (sk - seqlen_q[s]) // m
            c_hi = sk // m
            base = cuck[s]
            cuck[s + 1] = base + max(c_hi, 1)
            if c_hi <= c_lo:
                pc[rc] = 0
                sl[rc] = PAD_SLOT_ID
                rc += 1
            else:
                pcs = pc[rc:rc + c_hi - c_lo]
                sls = sl[rc:rc + c_hi - c_lo]
                for i in range(c_hi - c_lo):
                    c = c_lo + i
                    pcs[i] = c * m
                    sls[i] = PAD_SLOT_ID if is_ph[s] else compressed_slot(bt, bt_off[s], c, bc)
                rc += c_hi - c_lo
            cucq[s + 1] = rc
            if c_hi == 0:
                seg[g], seg[g + 1], seg[g + 2], seg[g + 3] = NO_SOURCE_BLOCK, 0, 1, base
                g += 4
            for i in range((c_hi + bc - 1) // bc):
                seg[g], seg[g + 1], seg[g + 2], seg[g + 3] = bt[bt_off[s] + i], 0, min(bc, c_hi - i * bc), base + i * bc
                g += 4
    # ---- per-row compressed-KV read ranges: ks / ke (sparse), kv_ca_index_offset_len (dense)
    for a in range(nsp):
        ci = k[_RATIOS + nca + a]  # the sparse ratio's index in ca
        r = k[_RATIOS + ci]
        sh = ratio_shift(r)
        cuck = a32[fo[_CUCK, ci]:fo[_CUCK, ci] + n + 1]
        ks = a32[fo[_KS, a]:fo[_KS, a] + T]
        ke = a32[fo[_KE, a]:fo[_KE, a] + T]
        for s in range(n):
            base = cuck[s]
            q = seqlen_q[s]
            q1 = seqlen_k[s] - q + 1
            r0 = cu_q[s]
            kss = ks[r0:r0 + q]
            kes = ke[r0:r0 + q]
            for j in range(q):
                kss[j] = base
                kes[j] = base + fdiv(q1 + j, r, sh)
    for a in range(nde):
        ci = k[_RATIOS + nca + nsp + a]
        r = k[_RATIOS + ci]
        sh = ratio_shift(r)
        cuck = a32[fo[_CUCK, ci]:fo[_CUCK, ci] + n + 1]
        ol = a32[fo[_KVCA, a]:fo[_KVCA, a] + 2 * T]
        for s in range(n):
            base = cuck[s]
            q = seqlen_q[s]
            q1 = seqlen_k[s] - q + 1
            r0 = cu_q[s]
            ols = ol[2 * r0:2 * (r0 + q)]
            for j in range(q):
                ols[2 * j] = base
                ols[2 * j + 1] = fdiv(q1 + j, r, sh)
    # ---- whole block tables, -1 padded
    sbt = a32[fo[_SBT, 0]:fo[_SBT, 0] + n * width]
    for s in range(n):
        b0 = bt_off[s]
        blen = bt_off[s + 1] - b0
        row = sbt[s * width:(s + 1) * width]
        for c in range(blen):
            row[c] = bt[b0 + c]
        for c in range(blen, width):
            row[c] = -1
    if keep >= 0 and W > 0 and fo[_YCU, 0] >= 0:
        yoco_compact(seqlen_q, seqlen_k, state_id, valid_start, is_ph, num_tokens, k, cu_q, a32, fo)
    return err[0]  # OK, or an Engram id outside int32 recorded on the way


@kernel
def yoco_compact(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, valid_start: np.ndarray,
                 is_ph: np.ndarray, num_tokens: np.ndarray, k: np.ndarray, cu_q: np.ndarray, a32: np.ndarray,
                 fo: np.ndarray) -> None:
    """YoCo compact's consumer rows (docs/design.md section 10): per sequence the rows ``j in [clip, q)``, ``clip =
    min(max(num_tokens - keep - q0, 0), q - 1)``, each with its full-layout row ``cu_q[s] + j``,
    position, SWA slot (the full one, -1 before ``rect_lo = max(0, num_tokens - keep)``), ks / ke /
    kv_ca_index_offset_len (the full ones: ``cu_compressed_seqlens_k`` is filled) and pivots
    (lower ``max(rect_lo, swa_valid_start)``). Example (k = 2; prompts of 3 and 5 tokens, whole
    chunks): ``rect_lo = (1, 3)``, clip ``(1, 3)``, consumer cu ``[0, 2, 4]``, query indices ``[1,
    2, 6, 7]``, positions ``[1, 2, 3, 4]``."""
    n = seqlen_q.shape[0]
    W = k[_W]
    S = k[_S]
    keep = k[_KEEP]
    nsp = k[_NSP]
    nca = k[_NCA]
    nde = k[_NDE]
    o_cu, o_qi, o_pos, o_sl, o_piv = fo[_YCU, 0], fo[_YQI, 0], fo[_YPOS, 0], fo[_YSLOT, 0], fo[_YPIV, 0]
    a32[o_cu] = 0
    rc = 0
    for s in range(n):
        q = seqlen_q[s]
        q0 = seqlen_k[s] - q
        rect_lo = max(num_tokens[s] - keep, 0)
        clip = min(max(num_tokens[s] - keep - q0, 0), q - 1)
        kept = q - clip
        pivot_rows(a32[o_piv + 4 * rc:o_piv + 4 * (rc + kept)], s, clip, q, q0, max(rect_lo, valid_start[s]), W,
                   n * W + cu_q[s])
        base_st = state_id[s] * S
        for i in range(kept):
            j = clip + i
            pos = q0 + j
            a32[o_qi + rc] = cu_q[s] + j
            a32[o_pos + rc] = pos
            a32[o_sl + rc] = PAD_SLOT_ID if (is_ph[s] or q - j > S or pos < rect_lo) else base_st + pos % S
            for a in range(nsp):
                ci = k[_RATIOS + nca + a]
                base = a32[fo[_CUCK, ci] + s]
                a32[fo[_YKS, a] + rc] = base
                a32[fo[_YKE, a] + rc] = base + (pos + 1) // k[_RATIOS + ci]
            for a in range(nde):
                ci = k[_RATIOS + nca + nsp + a]
                a32[fo[_YKVCA, a] + 2 * rc] = a32[fo[_CUCK, ci] + s]
                a32[fo[_YKVCA, a] + 2 * rc + 1] = (pos + 1) // k[_RATIOS + ci]
            rc += 1
        a32[o_cu + s + 1] = rc
