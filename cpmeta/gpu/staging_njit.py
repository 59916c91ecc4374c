"""The decode staging buffer written by ONE compiled call per step (docs/design.md sections 12, 13, 17).

Two writers of the layout drawn in :mod:`cpmeta.gpu.staging_layout`, both plain loops into the
caller's int32 view (no allocation, no Python object):

- :func:`stage_batch` -- a validated decode ``SequenceBatch``: checks the needed block ids and
  the int32 bounds of ``prepare_decode``, then writes the header, the per-sequence rows, the
  input ids, the tables PACKED back to back and the Engram windows;
- :func:`stage_state` -- a ``BatchState``'s vouched step (``BatchState.vouch_decode``) straight
  from its arrays: the tables at a FIXED stride of ``max_num_blocks`` (other bytes, the
  same metadata), placeholders appended; an int32 bound it cannot vouch for returns
  :data:`E_FALLBACK` (the caller takes the general path, whose checks name the field).

Errors (``report`` = ``int64[REPORT_LEN]``: ``[code, index, value, limit]`` as
:func:`cpmeta.jit.error_slot`, then the staged scalars ``n_seq, total_q, total_k, max_seqlen_q,
max_seqlen_k, used, max_blocks`` of :class:`~cpmeta.gpu.staging_header.StagedDecode`): the codes
of :mod:`cpmeta.builders.common_njit` and ``E_KV_CA_OFFSET`` of the decode build (their messages
are ``prepare_decode``'s), plus :data:`E_VIEW_SMALL` (the scalars are set: the owner grows to
``used`` and calls again), :data:`E_CAPACITY` and :data:`E_FALLBACK` (:func:`stage_state`).

Worked example (the layout's: block_size 4, ratios (4,) in every set, G = 0; ``seqlen_q = (1,
3)``, ``seqlen_k = (5, 9)``, tables ``[7, 8]`` and ``[4, 6, 2]``): header length 8 + 3 = 11,
``off_ids = 11 + 7 * 2 = 25``, ``off_bt = 25 + 4 = 29``; needed blocks ``(1, 2)``, so
:func:`stage_batch` packs ``[7, 4, 6]`` at 29, ``bt_offset = (0, 1)``, ``used = 32``;
:func:`stage_state` (``max_num_blocks`` 3) writes ``max_num_blocks`` words per request: ``bt_offset = (0, 3)``,
``used = 25 + 4 + 2 * 3 = 35``.
"""

from __future__ import annotations

import numpy as np

from ..base_njit import blocks_needed_one, fail
from ..builders.common_njit import (
    COMMON_CODES_END, E_CU_SEQLENS_K, E_NGRAM_INT32, E_NGRAM_TABLE, NO_TABLE, check_tables,
)
from ..builders.decode_njit import E_KV_CA_OFFSET
from ..config import MetadataConfig
from ..constants import INT32_MAX
from ..fields import staged_ratios
from ..jit import OK, kernel, warmer
from .staging_header import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, HEADER_FIXED,
    SEQ_FIELDS,
)

__all__ = ["stage_batch", "stage_state", "staging_consts", "layout_words", "E_VIEW_SMALL", "E_CAPACITY",
           "E_FALLBACK", "REPORT_LEN", "NO_LIMIT"]

#: The view is shorter than the batch's ``used`` elements (nothing written; the scalars are set).
E_VIEW_SMALL = COMMON_CODES_END + 1  # after the decode build's E_KV_CA_OFFSET (COMMON_CODES_END)
#: :func:`stage_state`: the step exceeds the caller's capacity (rows, sequences, table columns).
E_CAPACITY = COMMON_CODES_END + 2
#: :func:`stage_state`: an int32 bound the fixed-stride layout cannot vouch for.
E_FALLBACK = COMMON_CODES_END + 3
#: ``report``'s length: the error slot's four words, then the seven staged scalars.
REPORT_LEN = 4 + 7
_R = 4  # report[_R:]: n_seq, total_q, total_k, max_seqlen_q, max_seqlen_k, used, max_blocks
#: A capacity with no limit (:func:`stage_state` without captured buffers).
NO_LIMIT = 2**62

# staging_consts slots
_HL, _BS, _MINR, _CYCLE, _INTER, _MAXBID, _ROW_OFF, _G, _IMG, _HAS_IMG, _HAS_TAB, _MNB = range(12)


def layout_words(cfg: MetadataConfig) -> tuple[int, np.ndarray, np.ndarray]:
    """``(header length, ratio words, consts)`` of ``cfg``'s staging layout, the arrays int32 /
    int64 and read-only: what :class:`~cpmeta.gpu.staging_layout.StagingLayout` holds and the
    writers read. Example: ``MetadataConfig.compressed_swa()`` -> ``(11, [4, 4, 4], ...)``."""
    words = staged_ratios(cfg)
    ratios = np.array(words, np.int32)
    ratios.flags.writeable = False
    header_len = HEADER_FIXED + len(words)
    return header_len, ratios, staging_consts(cfg, header_len)


def staging_consts(cfg: MetadataConfig, header_len: int) -> np.ndarray:
    """The config as the writers read it (int64, read-only): header length, block_size, min ratio,
    KV-CP cycle and interleave, max_block_id, ``max_num_blocks * (block_size // min dense ratio)``
    (0 without dense ratios: the ``kv_ca_index_offset_len`` offset of one row), max_ngram_size,
    image id, has image, has ``ngram_lookup``, ``max_num_blocks`` (:func:`stage_state`'s table
    stride). Example: ``MetadataConfig.compressed_swa()``, header 11 -> ``[11, 128, 4, 1, 1,
    67108863, 2048, 0, -1, 0, 0, 64]``."""
    img = cfg.image_token_id
    dense = cfg.dense_compress_ratios
    c = np.array([header_len, cfg.block_size, cfg.min_ratio, cfg.kv_cp_world_size * cfg.kv_cp_interleave,
                  cfg.kv_cp_interleave, cfg.max_block_id,
                  cfg.max_num_blocks * (cfg.block_size // min(dense)) if dense else 0, cfg.max_ngram_size,
                  -1 if img is None else img, int(img is not None), int(cfg.ngram_lookup is not None),
                  cfg.max_num_blocks], np.int64)
    c.flags.writeable = False
    return c


@kernel
def _header(view: np.ndarray, ratios: np.ndarray, hl: int, n: int, tq: int, tk: int, off_ngv: int,
            n_win: int) -> None:
    """The fixed header and the ratio words (see :mod:`cpmeta.gpu.staging_header`)."""
    off_ids = hl + SEQ_FIELDS * n
    view[0] = n
    view[1] = tq
    view[2] = tk
    view[3] = hl
    view[4] = off_ids
    view[5] = off_ids + tq
    view[6] = off_ngv
    view[7] = off_ngv + n_win
    for i in range(ratios.shape[0]):
        view[HEADER_FIXED + i] = ratios[i]


@kernel
def _window_word(t: int, s: int, lo: int, tokens: np.ndarray, tok_off: np.ndarray, comp: np.ndarray,
                 comp_off: np.ndarray, table: np.ndarray, k: np.ndarray) -> tuple[int, bool, bool]:
    """``(value, ok, barrier)`` of position ``t`` of sequence ``s``'s Engram window (its token
    window starts at position ``lo``): barrier when ``t < 0`` or the token is the image sentinel;
    value = the compressed id when the history covers ``t``, else ``ngram_lookup[token]`` (``ok``
    False outside the table: value ``table[0]``, 0 for an empty one), else the token (0 for
    ``t < 0``). Example: no table, tokens ``[5, 7]`` from lo 0, t = 1 -> ``(7, True, False)``."""
    tok = 0
    bar = t < 0
    kk = t - lo
    if not bar:
        tok = tokens[tok_off[s] + kk]
        bar = k[_HAS_IMG] != 0 and tok == k[_IMG]
        if kk < comp_off[s + 1] - comp_off[s]:
            return comp[comp_off[s] + kk], True, bar
    if k[_HAS_TAB] == 0:
        return tok, True, bar
    nt = table.shape[0]
    if 0 <= tok < nt:
        return table[tok], True, bar
    return (table[0] if nt > 0 else 0), False, bar


@kernel
def _check_windows(seqlen_q: np.ndarray, seqlen_k: np.ndarray, tokens: np.ndarray, tok_off: np.ndarray,
                   comp: np.ndarray, comp_off: np.ndarray, table: np.ndarray, k: np.ndarray, err: np.ndarray) -> int:
    """``prepare_decode``'s Engram errors, nothing written: a word the kernels read unpadded is
    outside ``ngram_lookup`` (:data:`E_NGRAM_TABLE`, anywhere in the batch first) or outside int32
    (:data:`E_NGRAM_INT32`). Window element i (``G - 1 + j - c`` for column c of row j) is read
    unpadded iff no barrier lies in ``[i, max(i, G - 1)]`` (its first reader: row ``max(0, i - G +
    1)``). Example: G = 3, barrier at element 1 -> element 0 is never read, elements 1.. only by
    rows whose range excludes a barrier."""
    G = k[_G]
    bad32 = -1  # the first sequence with a value outside int32
    for s in range(seqlen_q.shape[0]):
        q0 = seqlen_k[s] - seqlen_q[s]
        lo = seqlen_k[s] - (tok_off[s + 1] - tok_off[s])
        blocked = False
        for i in range(seqlen_q[s] + G - 2, -1, -1):  # back to front: barriers of [i, G - 1]
            v, ok, bar = _window_word(q0 - G + 1 + i, s, lo, tokens, tok_off, comp, comp_off, table, k)
            if i >= G - 1:
                blocked = bar  # element G - 1's flag is the last one kept
            else:
                blocked = blocked or bar
            if blocked:
                continue
            if not ok:
                return fail(err, E_NGRAM_TABLE, s, i, table.shape[0])
            if (v > INT32_MAX or v < -INT32_MAX - 1) and bad32 < 0:
                bad32 = s
    return fail(err, E_NGRAM_INT32, bad32, 0, INT32_MAX) if bad32 >= 0 else OK


@kernel
def _batch_sizes(seqlen_q: np.ndarray, seqlen_k: np.ndarray, bt: np.ndarray, bt_off: np.ndarray, k: np.ndarray,
                 report: np.ndarray) -> int:
    """Pass 1 of :func:`stage_batch`: every needed block id in ``[0, max_block_id]`` (sequence
    by sequence), ``sum(seqlen_k)`` and the ``kv_ca_index_offset_len`` offsets in int32, then the
    staged scalars into ``report[4:]``. Example: the module's batch -> ``[2, 4, 14, 3, 9, 32, 2]``."""
    n = seqlen_q.shape[0]
    code, tq, tk, tb, mq, mk, mb, _w = check_tables(seqlen_q, seqlen_k, bt, bt_off, k[_BS], k[_MINR], k[_CYCLE],
                                                    k[_INTER], k[_MAXBID], report)
    if code != OK:
        return code
    if tk > INT32_MAX:
        return fail(report, E_CU_SEQLENS_K, -1, tk, INT32_MAX)
    per_row = k[_ROW_OFF]
    if per_row > 0 and tq > INT32_MAX // per_row:
        return fail(report, E_KV_CA_OFFSET, tq, tq * per_row, INT32_MAX)
    G = k[_G]
    n_win = tq + n * (G - 1) if G > 0 else 0
    r = report[_R:]
    r[0], r[1], r[2], r[3], r[4] = n, tq, tk, mq, mk
    r[5] = k[_HL] + SEQ_FIELDS * n + tq + tb + 2 * n_win
    r[6] = mb
    return OK


@kernel
def stage_batch(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, is_ph: np.ndarray,
                tokens: np.ndarray, tok_off: np.ndarray, comp: np.ndarray, comp_off: np.ndarray, bt: np.ndarray,
                bt_off: np.ndarray, k: np.ndarray, ratios: np.ndarray, table: np.ndarray, view: np.ndarray,
                report: np.ndarray) -> int:
    """Check a validated decode batch (the arrays of a ``SequenceBatch``) and write it into ``view``.

    Checks first, nothing written before they pass (:func:`_batch_sizes`, the view's length,
    :func:`_check_windows`). Then per sequence s (rows ``[r0, r0 + q)``, ``q0 = seqlen_k - q``):
    the per-sequence rows (inclusive prefix sums, ``bt_offset`` = the needed blocks of the
    sequences before), input ids = the last q ids of its token window, the first
    ``blocks_needed(seqlen_k)`` ids of its table packed at ``off_bt + bt_offset``, and with G > 0
    its window words ``q0 - G + 1 .. seqlen_k - 1`` (:func:`_window_word`: value, then barrier
    flag ``G + q - 1`` words later in the section). ``report`` is zeroed first. Example: see the
    module doc.
    """
    report[:] = 0
    code = _batch_sizes(seqlen_q, seqlen_k, bt, bt_off, k, report)
    if code != OK:
        return code
    n = seqlen_q.shape[0]
    tq, tk, used = report[_R + 1], report[_R + 2], report[_R + 5]
    if used > view.shape[0]:
        return fail(report, E_VIEW_SMALL, -1, used, view.shape[0])
    G = k[_G]
    if G > 0:
        code = _check_windows(seqlen_q, seqlen_k, tokens, tok_off, comp, comp_off, table, k, report)
        if code != OK:
            return code
    hl = k[_HL]
    n_win = tq + n * (G - 1) if G > 0 else 0
    off_ids = hl + SEQ_FIELDS * n
    off_bt = off_ids + tq
    off_ngv = used - 2 * n_win
    _header(view, ratios, hl, n, tq, tk, off_ngv, n_win)
    blk = view[hl:off_ids]
    cq = ck = b0 = w0 = 0
    for s in range(n):
        q = seqlen_q[s]
        sk = seqlen_k[s]
        cq += q
        ck += sk
        blk[F_SEQLEN_Q * n + s] = q
        blk[F_SEQLEN_K * n + s] = sk
        blk[F_CU_Q_INCL * n + s] = cq
        blk[F_CU_K_INCL * n + s] = ck
        blk[F_STATE * n + s] = state_id[s]
        blk[F_PLACEHOLDER * n + s] = 1 if is_ph[s] else 0
        blk[F_BT_OFFSET * n + s] = b0
        # slices indexed by range variables: no negative-index fix-up, the copies vectorize
        t_end = tok_off[s + 1]
        ids, win = view[off_ids + cq - q:off_ids + cq], tokens[t_end - q:t_end]
        for j in range(q):
            ids[j] = win[j]
        need = blocks_needed_one(sk, k[_BS], k[_MINR], k[_CYCLE], k[_INTER])
        dst, src = view[off_bt + b0:off_bt + b0 + need], bt[bt_off[s]:bt_off[s] + need]
        for c in range(need):
            dst[c] = src[c]
        b0 += need
        if G > 0:
            lo = sk - (t_end - tok_off[s])
            for i in range(q + G - 1):
                v, _ok, bar = _window_word(sk - q - G + 1 + i, s, lo, tokens, tok_off, comp, comp_off, table, k)
                view[off_ngv + w0 + i] = v  # an unread word past int32 wraps, as numpy's cast did
                view[off_ngv + n_win + w0 + i] = 1 if bar else 0
            w0 += q + G - 1
    return OK


@kernel
def stage_state(slots: np.ndarray, nt: np.ndarray, sk: np.ndarray, drafts: np.ndarray, nd: np.ndarray, k_hi: int,
                n_ph: int, token_ids: np.ndarray, block_table: np.ndarray, num_blocks: np.ndarray,
                state_id: np.ndarray, k: np.ndarray, ratios: np.ndarray, q_cap: int, seq_cap: int, bt_cols: int,
                view: np.ndarray, report: np.ndarray) -> int:
    """A vouched ``BatchState`` decode step (``n_real = len(slots)`` requests holding ``nt``
    confirmed tokens each, then ``n_ph`` placeholders) into ``view`` straight from the state's
    arrays (``token_ids``, ``block_table``, ``num_blocks``, ``state_id``: int64, cast to the
    layout's int32 as they are copied), tables at the fixed stride ``mnb = max_num_blocks``.

    Scalars first: ``total_q = n + len(drafts)``, ``total_k = sum(sk) + n_ph``, ``used = hl + 7n +
    total_q + n_real * mnb + n_ph * blocks_needed(1)``, ``max_blocks = blocks_needed(max(sk))``
    (monotone); :data:`E_FALLBACK` when ``total_k``, the decode offsets (``total_q * mnb *
    block_size // min dense ratio``) or ``used`` pass int32, :data:`E_CAPACITY` when ``total_q >
    q_cap``, ``n > seq_cap`` or ``max_blocks > bt_cols``, :data:`E_VIEW_SMALL`; nothing written
    before. Then request s: ``seqlen_q = 1 + nd[s]`` (``1 + k_hi`` when ``nd`` is empty: one count
    for all), ``seqlen_k = sk[s]``, state ``state_id[slot]``, ids = its last confirmed token
    ``token_ids[slot, nt[s] - 1]`` then its drafts (in order), ``bt_offset = s * mnb`` and ``mnb``
    table words: its first ``min(num_blocks, mnb)`` block ids, then -1; placeholder p: ``(1, 1)``
    rows, state 0, flag 1, id 0, ``bt_offset = n_real * mnb + p * blocks_needed(1)``, zero tables.
    Example: 2 requests ``sk = (7, 11)``, one draft each, mnb 64, no placeholder -> ``total_q = 4``,
    ``cu_seqlens_q_incl = (2, 4)``, ``bt_offset = (0, 64)``, ``used = hl + 14 + 4 + 128``.
    """
    report[:] = 0
    n_real = slots.shape[0]
    n = n_real + n_ph
    mnb = k[_MNB]
    tq = n + drafts.shape[0]
    tk = n_ph
    mk = 0
    for s in range(n_real):
        tk += sk[s]
        mk = max(mk, sk[s])
    per_row = max(k[_ROW_OFF], 1)
    ph_nb = blocks_needed_one(1, k[_BS], k[_MINR], k[_CYCLE], k[_INTER])
    hl = k[_HL]
    off_ids = hl + SEQ_FIELDS * n
    off_bt = off_ids + tq
    used = off_bt + n_real * mnb + n_ph * ph_nb
    if tk > INT32_MAX or tq > INT32_MAX // per_row or used > INT32_MAX:
        return E_FALLBACK
    mb = blocks_needed_one(mk, k[_BS], k[_MINR], k[_CYCLE], k[_INTER])
    r = report[_R:]
    r[0], r[1], r[2], r[3] = n, tq, tk, 1 + k_hi
    r[4] = max(mk, 1) if n_ph > 0 else mk
    r[5] = used
    r[6] = max(mb, ph_nb) if n_ph > 0 else mb
    if tq > q_cap or n > seq_cap or r[6] > bt_cols:
        return E_CAPACITY
    if used > view.shape[0]:
        return fail(report, E_VIEW_SMALL, -1, used, view.shape[0])
    _header(view, ratios, hl, n, tq, tk, used, 0)
    blk = view[hl:off_ids]
    cq = ck = d = 0
    uniform = nd.shape[0] == 0
    for s in range(n_real):
        q = 1 + (k_hi if uniform else nd[s])
        slot = slots[s]
        cq += q
        ck += sk[s]
        blk[F_SEQLEN_Q * n + s] = q
        blk[F_SEQLEN_K * n + s] = sk[s]
        blk[F_CU_Q_INCL * n + s] = cq
        blk[F_CU_K_INCL * n + s] = ck
        blk[F_STATE * n + s] = state_id[slot]
        blk[F_PLACEHOLDER * n + s] = 0
        blk[F_BT_OFFSET * n + s] = s * mnb
        r0 = off_ids + cq - q
        view[r0] = token_ids[slot, nt[s] - 1]
        for j in range(1, q):
            view[r0 + j] = drafts[d]
            d += 1
        nb = min(num_blocks[slot], mnb)
        row = block_table[slot]
        dst = view[off_bt + s * mnb:off_bt + (s + 1) * mnb]
        for c in range(nb):
            dst[c] = row[c]
        dst[nb:] = -1  # one fill: a loop here was 1.5x slower at 512 columns
    for p in range(n_ph):
        s = n_real + p
        cq += 1
        ck += 1
        blk[F_SEQLEN_Q * n + s] = 1
        blk[F_SEQLEN_K * n + s] = 1
        blk[F_CU_Q_INCL * n + s] = cq
        blk[F_CU_K_INCL * n + s] = ck
        blk[F_STATE * n + s] = 0
        blk[F_PLACEHOLDER * n + s] = 1
        blk[F_BT_OFFSET * n + s] = n_real * mnb + p * ph_nb
        view[off_ids + cq - 1] = 0
    view[off_bt + n_real * mnb:used] = 0
    return OK


@warmer
def _warm() -> None:
    """Both writers once on tiny inputs, in the argument types the library passes: the batch
    writer without and with an ``ngram_lookup`` table (read-only, as :func:`ngram_table` gives them),
    the state writer over a real state's arrays, int64 and int32 drafts."""
    from ..state.batch_state import BatchState

    def layout(cfg: MetadataConfig) -> tuple[np.ndarray, np.ndarray]:
        _, ratios, consts = layout_words(cfg)
        return consts, ratios

    i64 = np.int64
    view, report = np.zeros(256, np.int32), np.zeros(REPORT_LEN, i64)
    table8 = np.arange(8, dtype=i64)
    table8.flags.writeable = False
    for cfg in (MetadataConfig.compressed_swa(), MetadataConfig.compressed_swa(max_ngram_size=2, image_token_id=5)):
        consts, ratios = layout(cfg)
        for table in (NO_TABLE, table8):
            stage_batch(np.array([1], i64), np.array([3], i64), np.array([0], i64), np.zeros(1, np.bool_),
                        np.array([4, 5, 6], i64), np.array([0, 3], i64), np.zeros(0, i64), np.zeros(2, i64),
                        np.array([2], i64), np.array([0, 1], i64), consts, ratios, table, view, report)
    cfg = MetadataConfig.compressed_swa()
    st = BatchState(cfg, max_seqs=2)
    slot = st.add_request(0, [1, 2, 3], [4], 0, num_computed=3)
    consts, ratios = layout(cfg)
    for drafts in (np.array([7], i64), np.array([7], np.int32)):
        stage_state(np.array([slot], i64), np.array([3], i64), np.array([4], i64), drafts, np.zeros(0, i64), 1, 1,
                    st.token_ids, st.block_table, st.num_blocks, st.state_id, consts, ratios, NO_LIMIT,
                    NO_LIMIT, NO_LIMIT, view, report)
