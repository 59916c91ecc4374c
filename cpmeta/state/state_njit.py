"""The state room's compiled kernels: a step's mutations of a ``BatchState`` and its gathers.

One kernel call per operation, over the state's preallocated arrays (DESIGN section 17):

- :func:`append_rows` -- ``append_tokens(_batch)``, ``append_blocks(_batch)``,
  ``append_compressed(_batch)``: the ragged append of ``counts[i]`` values to row ``slots[i]``,
  every check before any write;
- :func:`gather_step` -- ``prompt_batch`` / ``decode_batch``: the step's checks, then ONE
  buffer holding every int64 array of the ``SequenceBatch`` (two passes: count, then fill);
- :func:`vouch_step` -- ``vouch_decode``: whether the in-place GPU staging may lay out a decode
  step straight from the state's arrays (their ids cast to the staging's int32).

The state's per-slot counts are the rows of ONE ``[7, max_seqs]`` int64 array ``meta`` (row
``M_*``), its config constants one int64 array ``p`` (index ``P_*``: :func:`state_params`).
A kernel never raises: it returns an error code (``E_*``) and fills ``err = [code, index,
value, limit]``; ``cpmeta/state/batch_state.py`` turns it into the named ``ValueError``.
"""

from __future__ import annotations

import numpy as np

from ..config import MetadataConfig, blocks_needed
from ..constants import INT32_MAX
from ..base_njit import blocks_needed_one, copy_from0, copy_ids, fail as _fail
from ..jit import OK, kernel, warmer

__all__ = ["append_rows", "gather_step", "gathered_parts", "vouch_step", "check_slots", "state_params", "K_TOKENS", "K_BLOCKS",
           "K_COMPRESSED", "M_TOKENS", "M_COMPUTED", "M_PROMPT", "M_BLOCKS", "M_COMPRESSED", "M_STATE",
           "M_VALID_START", "M_FIRST_BAD", "NO_BAD", "N_META", "E_SLOT", "E_REPEAT", "E_COUNTS", "E_CAPACITY", "E_NEGATIVE_ID",
           "E_CHUNK", "E_CHUNK_PASSES", "E_NUM_DRAFTS", "E_DRAFT_ID", "E_PREFILL", "MAX_PLACEHOLDERS"]

# rows of ``meta`` ([N_META, max_seqs] int64): the per-slot counts, and M_FIRST_BAD: the index of
# the slot's first block id outside [0, max_block_id] (NO_BAD: none), kept by every table write
M_TOKENS, M_COMPUTED, M_PROMPT, M_BLOCKS, M_COMPRESSED, M_STATE, M_VALID_START, M_FIRST_BAD = range(8)
N_META = 8
NO_BAD = 1 << 62
# entries of ``p`` (int64): the config constants the kernels read
P_LOOKBACK, P_BLOCK, P_MIN_RATIO, P_KV_CYCLE, P_KV_INTER, P_MAX_LEN, P_MAX_BLOCK_ID, P_MAX_STATE_ID, \
    P_SWA, P_PH_BLOCKS = range(10)
# what append_rows appends (which ids are checked)
K_TOKENS, K_BLOCKS, K_COMPRESSED = range(3)

#: The placeholder rows one batch may pad with (``num_placeholders``: up to a captured CUDA-graph
#: size; a gather allocates the batch's rows at once, so an unbounded count would ask for
#: gigabytes where it should be refused: ``state.checks.check_placeholders``, the replay).
MAX_PLACEHOLDERS = 1 << 16
E_SLOT = 1  #: ``slots[err[1]]`` is outside ``[0, max_seqs)`` or holds no live request
E_REPEAT = 2  #: ``slots[err[1]]`` appeared earlier in ``slots``
E_COUNTS = 3  #: counts: wrong length, a negative count, or a sum other than the values' length
E_CAPACITY = 4  #: row of ``slots[err[1]]`` would hold ``err[2]`` entries, past ``err[3]``
E_NEGATIVE_ID = 5  #: a token id ``err[2] < 0`` of ``slots[err[1]]``, at index ``err[3]`` of its ids
E_CHUNK = 6  #: chunk_lens: wrong length or a chunk < 1
E_CHUNK_PASSES = 7  #: ``slots[err[1]]``'s chunk of ``err[2]`` tokens from ``err[3]`` passes its tokens
E_NUM_DRAFTS = 8  #: num_drafts: wrong length, a negative count, or a sum other than the drafts'
E_DRAFT_ID = 9  #: a draft id ``err[2]`` outside int32 of ``slots[err[1]]``, at index ``err[3]``
E_PREFILL = 10  #: ``slots[err[1]]`` has not prefilled its prompt yet


def state_params(cfg: MetadataConfig, lookback: int) -> np.ndarray:
    """The int64 constants array ``p`` of a state. Example (plain, block 16, unsharded): lookback
    0, block 16, min ratio 1, KV cycle 1 and interleave 1, ...; placeholder blocks
    ``blocks_needed(1) = 1``."""
    p = np.zeros(10, np.int64)
    p[P_LOOKBACK], p[P_BLOCK], p[P_MIN_RATIO] = lookback, cfg.block_size, cfg.min_ratio
    p[P_KV_CYCLE], p[P_KV_INTER] = cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave
    p[P_MAX_LEN], p[P_MAX_BLOCK_ID], p[P_MAX_STATE_ID] = cfg.max_model_len, cfg.max_block_id, cfg.max_state_id
    p[P_SWA], p[P_PH_BLOCKS] = int(cfg.has_swa), blocks_needed(1, cfg)
    return p


@kernel
def _blocks_needed(k: int, p: np.ndarray) -> int:
    """:func:`cpmeta.base_njit.blocks_needed_one` with the state's config words ``p``."""
    return blocks_needed_one(k, p[P_BLOCK], p[P_MIN_RATIO], p[P_KV_CYCLE], p[P_KV_INTER])


@kernel
def check_slots(slots: np.ndarray, active: np.ndarray, mark: np.ndarray, err: np.ndarray) -> int:
    """Every slot live (:data:`E_SLOT`, the first bad position) and given once
    (:data:`E_REPEAT`: the first position whose slot appeared before). ``mark`` [max_seqs]
    scratch: filled back to front with each slot's position, it ends holding every slot's FIRST
    position. Example: slots ``[3, 1, 1, 3]`` -> mark[3] = 0, mark[1] = 1; position 2 reads 1:
    slots[2] repeats."""
    n, m = slots.shape[0], active.shape[0]
    for i in range(n):
        s = slots[i]
        if s < 0 or s >= m or not active[s]:
            return _fail(err, E_SLOT, i, s, m)
    for i in range(n - 1, -1, -1):
        mark[slots[i]] = i
    for i in range(n):
        if mark[slots[i]] != i:
            return _fail(err, E_REPEAT, i, slots[i], 0)
    return OK


@kernel
def append_rows(kind: int, slots: np.ndarray, values: np.ndarray, counts: np.ndarray, rows: np.ndarray,
                have: np.ndarray, active: np.ndarray, mark: np.ndarray, first_bad: np.ndarray, p: np.ndarray,
                err: np.ndarray) -> int:
    """Append ``counts[i]`` values of the flat ``values`` to row ``slots[i]`` of ``rows`` after
    its ``have[slot]`` entries (``have += counts``); ``rows.shape[1]`` is the capacity.

    Checks first, nothing written when one fails: live distinct slots, counts (length, >= 0,
    sum), capacity, and for tokens (``kind`` :data:`K_TOKENS`) ids >= 0. Blocks (:data:`K_BLOCKS`)
    keep ``first_bad[slot]`` (the ``meta`` row :data:`M_FIRST_BAD`): the index of the table's first
    id outside ``[0, max_block_id]``, so :func:`vouch_step` needs no scan of the table.
    Example: have ``[2, 0]``, slots ``[1, 0]``, counts ``[1, 2]``, values ``[9, 4, 5]`` -> row
    1 gets ``[9]`` at column 0, row 0 ``[4, 5]`` at columns 2-3; have ``[4, 1]``.
    """
    code = check_slots(slots, active, mark, err)
    if code:
        return code
    n, cap = slots.shape[0], rows.shape[1]
    if counts.shape[0] != n:
        return _fail(err, E_COUNTS, -1, counts.shape[0], n)
    tot = 0
    for i in range(n):
        if counts[i] < 0:
            return _fail(err, E_COUNTS, i, counts[i], 0)
        tot += counts[i]
    if tot != values.shape[0]:
        return _fail(err, E_COUNTS, -1, tot, values.shape[0])
    for i in range(n):
        new = have[slots[i]] + counts[i]
        if new > cap:
            return _fail(err, E_CAPACITY, i, new, cap)
    if kind == K_TOKENS:
        f = 0
        for i in range(n):
            for j in range(counts[i]):
                if values[f] < 0:
                    return _fail(err, E_NEGATIVE_ID, i, values[f], j)
                f += 1
    f = 0
    max_id = p[P_MAX_BLOCK_ID]
    for i in range(n):
        s, c = slots[i], counts[i]
        h = have[s]
        for j in range(c):
            rows[s, h + j] = values[f + j]
        if kind == K_BLOCKS and first_bad[s] == NO_BAD:
            for j in range(c):
                if values[f + j] < 0 or values[f + j] > max_id:
                    first_bad[s] = h + j
                    break
        have[s] = h + c
        f += c
    return OK


@kernel
def gather_step(is_prompt: bool, slots: np.ndarray, q: np.ndarray, k_all: int, drafts: np.ndarray,
                n_ph: int, advance: bool, meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray,
                block_table: np.ndarray, compressed: np.ndarray, p: np.ndarray, mark: np.ndarray,
                err: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """A step's ``SequenceBatch`` arrays: ``(buf, is_placeholder, vouched)``.

    Prompt (``is_prompt``): slot ``slots[i]`` prefills ``q[i]`` tokens from its
    ``num_computed`` (``advance``: they count as computed). Decode: ``q[i]`` drafts each (or
    ``k_all`` each when ``k_all >= 0``; ``q`` is then unread), the next ids of ``drafts``.
    ``n_ph`` placeholder rows follow (seqlen 1, token 0, ``blocks_needed(1)`` zero blocks).

    Pass 1 checks (the first failure writes its code into ``err`` and returns an EMPTY buffer,
    nothing else written; a batch of no rows has one of 3 entries): live distinct slots;
    prompt: chunks >= 1 within the confirmed tokens; decode: draft counts, draft ids in int32,
    prefill done. It counts the windows (``[lo, seqlen_k)``, ``lo = max(q_start - lookback,
    0)``), tables and Engram ids. Pass 2 allocates the batch's ONE int64 buffer (the step's
    snapshot: nothing later writes it) -- seqlen_q, seqlen_k, state_id, swa_valid_start,
    num_tokens ``[n]`` each, block_table / token / compressed offsets ``[n + 1]`` each, then the
    tokens, block tables and compressed ids (``8 n + 3`` entries before the tokens) -- and
    fills it. ``vouched``: what ``SequenceBatch.validate`` checks beyond the
    state's invariants holds (seqlen_k <= max_model_len, state ids and valid starts >= 0, state
    ids <= max_state_id with the state cache, tables >= blocks_needed, window ids in int32).

    Example: decode, lookback 0, slots ``[2, 0]`` with 5 and 3 tokens (last ids 14 and 7),
    ``k_all`` 1, drafts ``[50, 51]``, tables ``[8, 9]`` and ``[4]`` -> seqlen_q ``[2, 2]``,
    seqlen_k ``[6, 4]``, token_offsets ``[0, 2, 4]``, tokens ``[14, 50, 7, 51]``,
    block_table_offsets ``[0, 2, 3]``, block_tables ``[8, 9, 4]``.
    """
    empty = np.zeros(0, np.int64)
    no_ph = np.zeros(0, np.bool_)
    code = check_slots(slots, active, mark, err)
    if code:
        return empty, no_ph, False
    nr = slots.shape[0]
    if is_prompt:
        if q.shape[0] != nr:
            _fail(err, E_CHUNK, -1, q.shape[0], nr)
            return empty, no_ph, False
        for i in range(nr):
            if q[i] < 1:
                _fail(err, E_CHUNK, i, q[i], 1)
                return empty, no_ph, False
        for i in range(nr):
            s = slots[i]
            if meta[M_COMPUTED, s] + q[i] > meta[M_TOKENS, s]:
                _fail(err, E_CHUNK_PASSES, i, q[i], meta[M_COMPUTED, s])
                return empty, no_ph, False
    else:
        nd_tot = 0
        if k_all >= 0:
            nd_tot = k_all * nr
        else:
            if q.shape[0] != nr:
                _fail(err, E_NUM_DRAFTS, -1, q.shape[0], nr)
                return empty, no_ph, False
            for i in range(nr):
                if q[i] < 0:
                    _fail(err, E_NUM_DRAFTS, i, q[i], 0)
                    return empty, no_ph, False
                nd_tot += q[i]
        if nd_tot != drafts.shape[0]:
            _fail(err, E_NUM_DRAFTS, -1, nd_tot, drafts.shape[0])
            return empty, no_ph, False
        f = 0
        for i in range(nr):
            c = k_all if k_all >= 0 else q[i]
            for j in range(c):
                if drafts[f] < 0 or drafts[f] > INT32_MAX:
                    _fail(err, E_DRAFT_ID, i, drafts[f], j)
                    return empty, no_ph, False
                f += 1
        for i in range(nr):
            s = slots[i]
            if meta[M_COMPUTED, s] < meta[M_PROMPT, s]:
                _fail(err, E_PREFILL, i, meta[M_COMPUTED, s], meta[M_PROMPT, s])
                return empty, no_ph, False
    lb, phb = p[P_LOOKBACK], p[P_PH_BLOCKS]
    n = nr + n_ph
    tot_t = n_ph
    tot_b = n_ph * phb
    tot_c = 0
    ok = n > 0
    for i in range(nr):
        s = slots[i]
        if is_prompt:
            sq = q[i]
            sk = meta[M_COMPUTED, s] + sq
        else:
            sq = 1 + (k_all if k_all >= 0 else q[i])
            sk = meta[M_TOKENS, s] + sq - 1
        qs = sk - sq
        lo = qs - lb if qs > lb else 0
        tot_t += sk - lo
        nb = meta[M_BLOCKS, s]
        tot_b += nb
        ce = meta[M_COMPRESSED, s]
        ce = ce if ce < sk else sk
        tot_c += ce - lo if ce > lo else 0
        st, svs = meta[M_STATE, s], meta[M_VALID_START, s]
        if sk > p[P_MAX_LEN] or st < 0 or svs < 0 or (p[P_SWA] and st > p[P_MAX_STATE_ID]) \
                or nb < _blocks_needed(sk, p):
            ok = False
    h = 8 * n + 3  # the per-sequence arrays and offsets before the tokens
    buf = np.empty(h + tot_t + tot_b + tot_c, np.int64)
    ph = np.zeros(n, np.bool_)
    o_sk, o_st, o_svs, o_nt, o_bto, o_to, o_co = n, 2 * n, 3 * n, 4 * n, 5 * n, 6 * n + 1, 7 * n + 2
    o_t = h
    o_b = h + tot_t
    o_c = o_b + tot_b
    t = b = c = 0
    buf[o_bto] = buf[o_to] = buf[o_co] = 0
    f = 0
    for i in range(nr):
        s = slots[i]
        nt = meta[M_TOKENS, s]
        if is_prompt:
            sq = q[i]
            sk = meta[M_COMPUTED, s] + sq
            last = sk  # confirmed positions [lo, sk)
        else:
            nd = k_all if k_all >= 0 else q[i]
            sq = 1 + nd
            sk = nt + nd
            last = nt  # confirmed positions [lo, nt), then the drafts
        qs = sk - sq
        lo = qs - lb if qs > lb else 0
        buf[i], buf[o_sk + i] = sq, sk
        buf[o_st + i], buf[o_svs + i], buf[o_nt + i] = meta[M_STATE, s], meta[M_VALID_START, s], nt
        if copy_ids(buf[o_t + t:o_t + t + last - lo], token_ids[s, lo:last]):
            ok = False
        t += last - lo
        copy_from0(buf[o_t + t:o_t + t + sk - last], drafts[f:f + sk - last])
        t += sk - last
        f += sk - last
        nb = meta[M_BLOCKS, s]
        copy_from0(buf[o_b + b:o_b + b + nb], block_table[s, :nb])
        b += nb
        ce = meta[M_COMPRESSED, s]
        ce = ce if ce < sk else sk
        if ce > lo:
            copy_from0(buf[o_c + c:o_c + c + ce - lo], compressed[s, lo:ce])
            c += ce - lo
        buf[o_bto + i + 1], buf[o_to + i + 1], buf[o_co + i + 1] = b, t, c
        if is_prompt and advance:
            meta[M_COMPUTED, s] = sk
    for i in range(nr, n):  # placeholders: one row at position 0, token 0, zero blocks, state 0
        buf[i] = buf[o_sk + i] = buf[o_nt + i] = 1
        buf[o_st + i] = buf[o_svs + i] = 0
        buf[o_t + t] = 0
        t += 1
        for j in range(phb):
            buf[o_b + b] = 0
            b += 1
        buf[o_bto + i + 1], buf[o_to + i + 1], buf[o_co + i + 1] = b, t, c
        ph[i] = True
    return buf, ph, ok


@kernel
def gathered_parts(g: np.ndarray, n: int) -> tuple:
    """:func:`gather_step`'s buffer of ``n`` sequences as its ``SequenceBatch`` arrays (views):
    ``(seqlen_q, seqlen_k, state_id, swa_valid_start, num_tokens, block_tables,
    block_table_offsets, tokens, token_offsets, compressed, compressed_offsets)`` -- the layout
    ``BatchState._batch_of`` reads, for compiled callers of the gather (``cpmeta.replicate``)."""
    h = 8 * n + 3
    t = h + g[7 * n + 1]
    b = t + g[6 * n]
    return (g[:n], g[n:2 * n], g[2 * n:3 * n], g[3 * n:4 * n], g[4 * n:5 * n], g[t:b], g[5 * n:6 * n + 1], g[h:t],
            g[6 * n + 1:7 * n + 2], g[b:], g[7 * n + 2:h])


@kernel
def vouch_step(slots: np.ndarray, q: np.ndarray, k_all: int, meta: np.ndarray, active: np.ndarray,
               token_ids: np.ndarray, block_table: np.ndarray, p: np.ndarray, mark: np.ndarray, err: np.ndarray,
               nt_out: np.ndarray, sk_out: np.ndarray) -> bool:
    """Whether a decode step (``k_all >= 0`` drafts each, else ``q[i]``; counts and draft ids
    checked by the caller) may be staged straight from the state's arrays: every slot
    live, given once (``err``: that check's scratch, unread), done with its prefill, its state
    id in ``[0, max_state_id]``, valid start >= 0, last token in int32, ``seqlen_k =
    num_tokens + drafts <= max_model_len`` and its first ``blocks_needed(seqlen_k)`` block ids
    present and in ``[0, max_block_id]``. Writes each slot's ``num_tokens`` and ``seqlen_k``
    into ``nt_out`` / ``sk_out``. Example: block 16, a slot with 2 blocks ``[3, 4]`` and 20
    tokens, 2 drafts -> seqlen_k 22 needs 2 blocks: True."""
    if check_slots(slots, active, mark, err):
        return False
    for i in range(slots.shape[0]):
        s = slots[i]
        nt = meta[M_TOKENS, s]
        sk = nt + (k_all if k_all >= 0 else q[i])
        st = meta[M_STATE, s]
        if meta[M_COMPUTED, s] < meta[M_PROMPT, s] or st < 0 or st > p[P_MAX_STATE_ID] \
                or meta[M_VALID_START, s] < 0 or sk > p[P_MAX_LEN]:
            return False
        v = token_ids[s, nt - 1]
        if v < 0 or v > INT32_MAX:
            return False
        need = _blocks_needed(sk, p)
        if need > meta[M_BLOCKS, s] or need > meta[M_FIRST_BAD, s]:  # M_FIRST_BAD: no scan of the table
            return False
        nt_out[i] = nt
        sk_out[i] = sk
    return True


@warmer
def _warm() -> None:
    """Each kernel once on a 2-slot state (plain, block 16)."""
    from ..config import MetadataConfig

    cfg = MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=(),
                         max_model_len=64)
    p = state_params(cfg, 0)
    meta = np.zeros((N_META, 2), np.int64)
    active = np.ones(2, np.bool_)
    mark, err = np.zeros(2, np.int64), np.zeros(4, np.int64)
    tok, bt, comp = np.zeros((2, 64), np.int64), np.zeros((2, 4), np.int64), np.zeros((2, 0), np.int64)
    one = np.ones(2, np.int64)
    for kind, rows, have in ((K_TOKENS, tok, meta[M_TOKENS]), (K_BLOCKS, bt, meta[M_BLOCKS])):
        append_rows(kind, np.arange(2, dtype=np.int64), np.array([3, 4], np.int64), one, rows, have, active,
                    mark, meta[M_FIRST_BAD], p, err)
    check_slots(np.arange(2, dtype=np.int64), active, mark, err)  # (also a deferred recorder's own call)
    meta[M_PROMPT] = meta[M_COMPUTED] = 1
    gather_step(False, np.arange(2, dtype=np.int64), one, -1, np.array([5, 6], np.int64), 1, False, meta,
                active, tok, bt, comp, p, mark, err)
    vouch_step(np.arange(2, dtype=np.int64), one, 0, meta, active, tok, bt, p, mark, err, np.zeros(2, np.int64),
               np.zeros(2, np.int64))
