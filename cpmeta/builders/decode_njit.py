"""The decode build as ONE compiled call: every decode field of a batch into one arena.

:func:`decode_fill` reads a decode ``SequenceBatch``'s arrays and the config's constants
(:func:`decode_consts`), checks the bounds the numpy builder checked (needed block ids, int32
totals) and writes every field of docs/design.md section 4 ("Common" and "Decode only") into the arena's
bytes at the element offsets :func:`field_offsets` read from its layout. The Python wrapper
(:func:`cpmeta.builders.decode.prepare_decode`) owns the arena, the views and the messages.

Worked example (block_size 128, ratio 4, W = S = 128, one sequence ``seqlen_q = 2``,
``seqlen_k = 8``, state 3, table ``[5]``): positions ``[6, 7]``, context_lens ``[7, 8]``,
``klen["4"] = [1, 2]``, row 1 closes compressed token c = 1 -> ``positions_c["4"] = [0, 4]``,
``slot_mapping_store_ca["4"] = [-1, 5 * 32 + 1 = 161]``, SWA window of row 1: ``w = 8``, start
slot ``3 * 128 + 0`` -> ``kv_swa_index_offset_len[1] = (384, 8)``; ``block_tables`` ``[[5, -1, ..],
[5, -1, ..]]`` (16 columns: the batch's widest row rounded up, ``prepare_decode``);
``kv_ca_index_offset_len["4"]`` ``[(0, 1), (16 * 32, 2)]``.
"""

from __future__ import annotations

import numpy as np

from ..buffers import ArenaLayout
from ..config import MetadataConfig
from ..constants import INT32_MAX, PAD_SLOT_ID, TABLE_WIDTH_ALIGN
from ..jit import OK, kernel, warmer
from .common_njit import (
    COMMON_CODES_END, E_NGRAM_TABLE, NO_TABLE, check_tables, compressed_slot, fail,
    fill_common_rows, fill_cu_seqlens, fill_ngram_rows,
)

__all__ = ["decode_fill", "decode_fill_if", "decode_shape", "decode_consts", "field_offsets", "E_KV_CA_OFFSET", "DECODE_FIELDS"]

#: ``total_q * max_num_blocks * (block_size // min(dense ratios))`` (docs/design.md section 3's
#: bound of the ``kv_ca_index_offset_len`` offsets) passes int32: ``err[1]`` total_q, ``err[2]``
#: the product.
E_KV_CA_OFFSET = COMMON_CODES_END

#: The decode fields in the order of :func:`field_offsets` (kernel slot = index here).
DECODE_FIELDS: tuple[str, ...] = (
    "positions", "input_ids", "gate_force_random", "cu_seqlens_q", "cu_seqlens_k", "valid_token_mask",
    "query_indices", "slot_mapping_store_swa", "ngram_token_ids", "context_lens", "state_block_idx",
    "kv_swa_index_offset_len", "block_tables", "klen", "positions_c", "slot_mapping_store_ca",
    "kv_ca_index_offset_len",
)
(_POS, _IDS, _GATE, _CUQ, _CUK, _VALID, _QIDX, _SWA, _NGRAM, _CTX, _STATE, _KVSWA, _BT, _KLEN, _PC, _SLCA,
 _KVCA) = range(len(DECODE_FIELDS))
#: ``field_offsets``' last slot: the columns of ``block_tables``.
_WIDTH = len(DECODE_FIELDS)

# decode_consts slots
(_BS, _MINR, _CYCLE, _INTER, _MAXBID, _W, _S, _FORCE, _N, _PAD, _IMG, _HAS_IMG, _LOOKBACK, _NSP, _NCA,
 _NDE, _MNB) = range(17)
_RATIOS = 17


def decode_consts(cfg: MetadataConfig) -> np.ndarray:
    """The config as one int64 array: block_size, min_ratio, KV-CP cycle and interleave,
    max_block_id, W, S (0 without the state cache), force_load_balance, max_ngram_size, pad id,
    image id, has image, look-back, the counts of sparse / ca / dense ratios, max_num_blocks, then
    those ratios. Example: ``MetadataConfig.compressed_swa()`` -> ``[128, 4, 1, 1, 67108863, 128,
    128, 0, 0, 0, -1, 0, 0, 1, 1, 1, 64, 4, 4, 4]``."""
    img = cfg.image_token_id
    head = [cfg.block_size, cfg.min_ratio, cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave,
            cfg.max_block_id, cfg.window_size, cfg.swa_block_size if cfg.has_swa else 0,
            int(cfg.force_load_balance), cfg.max_ngram_size, cfg.ngram_pad_token, -1 if img is None else img,
            int(img is not None), max(cfg.max_ngram_size - 1, 0), len(cfg.sparse_compress_ratios),
            len(cfg.ca_ratios), len(cfg.dense_compress_ratios), cfg.max_num_blocks]
    c = np.array(head + [*cfg.sparse_compress_ratios, *cfg.ca_ratios, *cfg.dense_compress_ratios], np.int64)
    c.flags.writeable = False
    return c


def field_offsets(layout: ArenaLayout) -> np.ndarray:
    """Each :data:`DECODE_FIELDS` entry's start in the arena, in elements of its dtype (int32 or
    bool views of the same bytes), -1 for a field the layout lacks; then ``block_tables``'
    columns. Example: a plain config's layout with ``block_tables`` [T, 9] -> ``positions`` 0, ...,
    ``klen`` -1, last slot 9."""
    fo = np.full(_WIDTH + 1, -1, np.int64)
    for k, name in enumerate(DECODE_FIELDS):
        f = layout.fields.get(name)
        if f is not None:
            fo[k] = f[0]
    fo[_WIDTH] = layout.fields["block_tables"][2][1]
    fo.flags.writeable = False
    return fo


@kernel
def decode_shape(seqlen_q: np.ndarray, n_tokens: int, bt_off: np.ndarray, lookback: int, max_nb: int
                 ) -> tuple[int, int, int]:
    """A decode batch's arena shape: ``(total_q, widest, width)``. ``total_q`` is ``n_tokens``
    (one id per row) without look-back, else ``sum(seqlen_q)``; ``widest`` the longest table
    (a row is its sequence's table; 0 for no sequence), cut to ``max_nb``; ``width`` the
    default ``block_tables`` columns: ``widest`` rounded up to ``TABLE_WIDTH_ALIGN``, at most
    ``max_nb``. Example: tables of 3, 20 and 2 ids (``bt_off = [0, 3, 23, 25]``), ``max_nb``
    64 -> widest 20, width 32."""
    total_q = n_tokens
    if lookback != 0:
        total_q = 0
        for s in range(seqlen_q.shape[0]):
            total_q += seqlen_q[s]
    widest = 0
    for s in range(bt_off.shape[0] - 1):
        n = bt_off[s + 1] - bt_off[s]
        if n > widest:
            widest = n
    widest = min(widest, max_nb)
    width = min(-(-widest // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN, max_nb)
    return total_q, widest, width


@kernel
def decode_fill(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, is_ph: np.ndarray,
                tokens: np.ndarray, tok_off: np.ndarray, comp: np.ndarray, comp_off: np.ndarray,
                bt: np.ndarray, bt_off: np.ndarray, k: np.ndarray, table: np.ndarray, raw: np.ndarray,
                fo: np.ndarray, total_q: int, err: np.ndarray, info: np.ndarray) -> int:
    """Check and fill one decode batch (``total_q`` rows) into ``raw`` (the arena's uint8 bytes).

    Checks first, nothing written before they pass: every needed block id (``blocks_needed``
    of ``seqlen_k``) in ``[0, max_block_id]``, ``sum(seqlen_k)`` and ``total_q * max_num_blocks *
    (block_size // min(dense ratios))`` in int32. ``width`` (``block_tables``' columns, the
    layout's) is at least the batch's widest row (:func:`decode_shape`). Then per sequence s, rows ``[r0, r0 + q)``, pos
    ``= q_start + j``, ``pos1 = pos + 1``: the common fields (:mod:`.common_njit`),
    ``context_lens = pos1``, with W > 0 ``state_block_idx = state`` and
    ``kv_swa_index_offset_len = (state * S + (pos1 - w) % S, w)``, ``w = min(pos1, W)``;
    ``block_tables`` row = the table's first ``width`` ids, -1 after; ``klen[r] = pos1 // r``;
    ratio n closes compressed token ``c = pos1 // n - 1`` when ``pos1 % n == 0``:
    ``positions_c = pos1 - n`` and slot ``table[c // b_c] * b_c + c % b_c`` (-1 on placeholders),
    else ``(0, -1)``; ``kv_ca_index_offset_len[n] = (row * width * (block_size // n), pos1 // n)``.
    ``info`` gets ``[max(seqlen_q), max(seqlen_k)]``; ``err`` is zeroed first. Example: see the
    module doc.
    """
    err[:] = 0  # the caller may hand in the slot of an earlier call
    n = seqlen_q.shape[0]
    T = total_q
    bs = k[_BS]
    W = k[_W]
    S = k[_S]
    N = k[_N]
    nsp = k[_NSP]
    nca = k[_NCA]
    nde = k[_NDE]
    width = fo[_WIDTH]
    # ---- checks (needed block ids, then the int32 bounds: the staging writer's order too)
    code, _tq, _tk, _tb, mq, mk, _mb, _w = check_tables(seqlen_q, seqlen_k, bt, bt_off, bs, k[_MINR], k[_CYCLE],
                                                        k[_INTER], k[_MAXBID], err)
    if code != OK:
        return code
    info[0] = mq
    info[1] = mk
    a32 = raw.view(np.int32)
    ab = raw.view(np.bool_)
    code = fill_cu_seqlens(seqlen_q, seqlen_k, a32[fo[_CUQ]:fo[_CUQ] + n + 1], a32[fo[_CUK]:fo[_CUK] + n + 1], err)
    if code != OK:
        return code
    if nde > 0:
        md = k[_RATIOS + nsp + nca]
        for a in range(1, nde):
            if k[_RATIOS + nsp + nca + a] < md:
                md = k[_RATIOS + nsp + nca + a]
        v = T * k[_MNB] * (bs // md)
        if v > INT32_MAX:
            return fail(err, E_KV_CA_OFFSET, T, v, INT32_MAX)
    # ---- fills
    positions = a32[fo[_POS]:fo[_POS] + T]
    input_ids = a32[fo[_IDS]:fo[_IDS] + T]
    gate = ab[fo[_GATE]:fo[_GATE] + T]
    valid = ab[fo[_VALID]:fo[_VALID] + T]
    qidx = a32[fo[_QIDX]:fo[_QIDX] + T]
    swa = a32[fo[_SWA]:fo[_SWA] + T] if S > 0 else a32[0:0]
    ngram = a32[fo[_NGRAM]:fo[_NGRAM] + T * N].reshape((T, N)) if N > 0 else a32[0:0].reshape((0, 0))
    force = k[_FORCE] != 0
    ctx = a32[fo[_CTX]:fo[_CTX] + T]
    st_idx = a32[fo[_STATE]:fo[_STATE] + T] if W > 0 else a32[0:0]
    kvswa = a32[fo[_KVSWA]:fo[_KVSWA] + 2 * T].reshape((T, 2)) if W > 0 else a32[0:0].reshape((0, 2))
    btab = a32[fo[_BT]:fo[_BT] + T * width].reshape((T, width))
    klen = a32[fo[_KLEN]:fo[_KLEN] + nsp * T].reshape((nsp, T)) if nsp > 0 else a32[0:0].reshape((0, T))
    pc = a32[fo[_PC]:fo[_PC] + nca * T].reshape((nca, T)) if nca > 0 else a32[0:0].reshape((0, T))
    sl = a32[fo[_SLCA]:fo[_SLCA] + nca * T].reshape((nca, T)) if nca > 0 else a32[0:0].reshape((0, T))
    kvca = a32[fo[_KVCA]:fo[_KVCA] + 2 * nde * T].reshape((nde, T, 2)) if nde > 0 else \
        a32[0:0].reshape((0, T, 2))
    sp = k[_RATIOS:_RATIOS + nsp]
    ca = k[_RATIOS + nsp:_RATIOS + nsp + nca]
    de = k[_RATIOS + nsp + nca:_RATIOS + nsp + nca + nde]
    r0 = 0
    for s in range(n):
        q = seqlen_q[s]
        sk = seqlen_k[s]
        q0 = sk - q
        st = state_id[s]
        ph = is_ph[s]
        fill_common_rows(s, r0, q, sk, st, ph, tokens, tok_off[s + 1], S, force, positions, input_ids, gate,
                         valid, qidx, swa)
        if N > 0:
            win = tok_off[s + 1] - tok_off[s]
            code = fill_ngram_rows(s, r0, q, q0, tokens, tok_off[s], sk - win, comp, comp_off[s],
                                   comp_off[s + 1] - comp_off[s], k[_PAD], k[_IMG], k[_HAS_IMG] != 0, table,
                                   table.shape[0] > 0, ngram, err)
            if code == E_NGRAM_TABLE:
                return code
        b0 = bt_off[s]
        blen = min(bt_off[s + 1] - b0, width)
        tab = bt[b0:b0 + blen]
        for j in range(q):
            r = r0 + j
            pos1 = q0 + j + 1
            ctx[r] = pos1
            if W > 0:
                st_idx[r] = st
                w = min(pos1, W)
                kvswa[r, 0] = st * S + (pos1 - w) % S
                kvswa[r, 1] = w
            row = btab[r]  # slices indexed by range variables: no negative-index fix-up, the copy vectorizes
            for c in range(blen):
                row[c] = tab[c]
            row[blen:] = -1
            for a in range(nsp):
                klen[a, r] = pos1 // sp[a]
            for a in range(nca):
                m = ca[a]
                if pos1 % m == 0:
                    pc[a, r] = pos1 - m
                    sl[a, r] = PAD_SLOT_ID if ph else compressed_slot(tab, 0, pos1 // m - 1, bs // m)
                else:
                    pc[a, r] = 0
                    sl[a, r] = PAD_SLOT_ID
            for a in range(nde):
                kvca[a, r, 0] = r * width * (bs // de[a])
                kvca[a, r, 1] = pos1 // de[a]
        r0 += q
    return err[0]  # OK, or an ngram id outside int32 recorded on the way


@kernel
def decode_fill_if(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, is_ph: np.ndarray,
                   tokens: np.ndarray, tok_off: np.ndarray, comp: np.ndarray, comp_off: np.ndarray,
                   bt: np.ndarray, bt_off: np.ndarray, lookback: int, k: np.ndarray, table: np.ndarray,
                   raw: np.ndarray, fo: np.ndarray, shape: np.ndarray, err: np.ndarray, info: np.ndarray) -> int:
    """:func:`decode_fill` of a batch whose arena shape is ``shape`` = ``(total_q, n_seq, width)``,
    the arena ``raw`` / ``fo`` is laid out for (a compiled caller that gathers the batch and
    fills the arena its rows and sequences had before in the same call: ``cpmeta.replicate``'s replay,
    ``cpmeta.builders.decode_sink.DecodeSink``). Another shape (:func:`decode_shape` with the
    default width) writes nothing and returns -1 (``shape``, the caller's aim, is only read); else
    :func:`decode_fill`'s code."""
    n = seqlen_q.shape[0]
    T, _, width = decode_shape(seqlen_q, tokens.shape[0], bt_off, lookback, k[_MNB])
    if T != shape[0] or n != shape[1] or width != shape[2]:
        return -1
    return decode_fill(seqlen_q, seqlen_k, state_id, is_ph, tokens, tok_off, comp, comp_off, bt, bt_off, k, table,
                       raw, fo, T, err, info)


@warmer
def _warm() -> None:
    """:func:`decode_fill` once: the compressed-KV config (MetadataConfig.compressed_swa()), two sequences (one with a draft)."""
    from ..buffers import HostArena
    from ..fields import DECODE, step_outputs
    from ..metadata import FIELDS

    cfg = MetadataConfig.compressed_swa()
    specs = step_outputs(FIELDS, cfg, DECODE)
    lay = ArenaLayout([(s.name, s.resolve({"total_q": 3, "n_seq": 2, "table_width": 1}), s.dtype) for s in specs])
    i64 = np.int64
    decode_shape(np.array([1, 2], i64), 3, np.array([0, 1, 2], i64), 0, 4)
    decode_fill(np.array([1, 2], i64), np.array([5, 9], i64), np.array([0, 1], i64), np.zeros(2, np.bool_),
                np.array([4, 7, 8], i64), np.array([0, 1, 3], i64), np.zeros(0, i64), np.zeros(3, i64),
                np.array([3, 6], i64), np.array([0, 1, 2], i64), decode_consts(cfg), NO_TABLE,
                HostArena(lay).raw.numpy(), field_offsets(lay), 3, np.zeros(4, i64), np.zeros(2, i64))
