"""Compiled pieces both host builders share (docs/design.md section 4, "Common"), callable from kernels.

Each function is a ``@kernel`` (numba njit) that a builder's one kernel calls per sequence: it
fills the common fields of that sequence's query rows ``[row0, row0 + seqlen_q)`` straight into
the output arrays, or checks one bound. Inputs are the ``SequenceBatch`` arrays (int64, bool) and
config constants as plain ints; outputs int32 / bool arrays (views into the builder's arena).

Error codes (``err`` = ``int64[4]`` ``[code, index, value, limit]``, :func:`cpmeta.jit.error_slot`)
below :data:`COMMON_CODES_END`; a builder numbers its own codes from there. :func:`raise_common`
turns a common code into the exact ``ValueError`` the builders raise.

Worked example (S = 4, state 2, one sequence ``seqlen_q = 6``, ``seqlen_k = 9``, window tokens
``[t3 .. t8]``): :func:`fill_common_rows` writes positions ``3..8``, input ids ``t3..t8``, query
indices ``[0] * 6``, SWA slots ``[-1, -1, 9, 10, 11, 8]`` (rows with ``seqlen_q - j <= 4``:
``2 * 4 + pos % 4``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import MetadataConfig
from ..constants import INT32_MAX, PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from ..base_njit import blocks_needed_one, fail
from ..cache import IdentityCache
from ..jit import OK, kernel, warmer
from .int_ops import check_int32

__all__ = [
    "E_CU_SEQLENS_K", "E_SWA_STATE", "E_BLOCK_NEGATIVE", "E_BLOCK_TOO_LARGE", "E_NGRAM_TABLE",
    "E_NGRAM_INT32", "COMMON_CODES_END", "fail", "blocks_needed_one", "check_block_table", "check_tables",
    "check_state_id", "fill_cu_seqlens", "fill_common_rows", "fill_ngram_rows", "ngram_of_rows",
    "ngram_table", "compressed_slot", "raise_common",
]

#: ``sum(seqlen_k)`` (``cu_seqlens_k[-1]``) passes int32: ``err[2]`` the sum.
E_CU_SEQLENS_K = 1
#: ``state_id * S + S - 1`` passes int32 (SWA ring slot): ``err[1]`` sequence, ``err[2]`` the slot.
E_SWA_STATE = 2
#: A needed block id < 0: ``err[1]`` sequence, ``err[2]`` the id, ``err[3]`` its index in the table.
E_BLOCK_NEGATIVE = 3
#: A needed block id > ``max_block_id``: same slots as :data:`E_BLOCK_NEGATIVE`.
E_BLOCK_TOO_LARGE = 4
#: ``ngram_lookup`` read outside the table: ``err[1]`` the sequence, ``err[2]`` the raw token id,
#: ``err[3]`` the table's length.
E_NGRAM_TABLE = 5
#: An ``ngram_token_ids`` value outside int32: ``err[1]`` the sequence, ``err[2]`` the value.
E_NGRAM_INT32 = 6
#: Builder-specific codes start here.
COMMON_CODES_END = 16

_I32_MIN = -INT32_MAX - 1


@kernel
def check_block_table(s: int, bt: np.ndarray, b0: int, need: int, max_block_id: int, err: np.ndarray) -> int:
    """The first ``need`` ids of sequence ``s``'s table (``bt[b0:b0 + need]``) in ``[0,
    max_block_id]``, else :data:`E_BLOCK_NEGATIVE` / :data:`E_BLOCK_TOO_LARGE` (``err[3]`` = the
    index in the table). Example: table ``[7, -2]``, need 2 -> code 3, ``err = [3, s, -2, 1]``."""
    ids = bt[b0:b0 + need]  # a slice indexed by the range variable: no negative-index fix-up
    bad = False
    for k in range(need):
        bad |= (ids[k] < 0) | (ids[k] > max_block_id)
    if bad:  # error path: find the first
        for k in range(need):
            v = ids[k]
            if v < 0:
                return fail(err, E_BLOCK_NEGATIVE, s, v, k)
            if v > max_block_id:
                return fail(err, E_BLOCK_TOO_LARGE, s, v, k)
    return OK


@kernel
def check_tables(seqlen_q: np.ndarray, seqlen_k: np.ndarray, bt: np.ndarray, bt_off: np.ndarray, bs: int,
                 min_ratio: int, cycle: int, inter: int, max_block_id: int, err: np.ndarray
                 ) -> tuple[int, int, int, int, int, int, int, int]:
    """Every sequence's needed block ids (``blocks_needed_one`` of its ``seqlen_k``) checked by
    :func:`check_block_table`, sequence by sequence, and the batch's totals on the way:
    ``(code, sum q, sum k, sum needed blocks, max q, max k, max needed blocks, longest table)``
    (the sums stop at the first bad sequence). The builders' and the staging writer's first pass.
    Example: block 4, ``seqlen_k = (5, 2)``, tables ``[7, 8]`` / ``[3]``, ``seqlen_q = (1, 2)`` ->
    ``(0, 3, 7, 3, 2, 5, 2, 2)``."""
    tq = tk = tb = mq = mk = mb = width = 0
    for s in range(seqlen_q.shape[0]):
        need = blocks_needed_one(seqlen_k[s], bs, min_ratio, cycle, inter)
        code = check_block_table(s, bt, bt_off[s], need, max_block_id, err)
        if code != OK:
            return code, tq, tk, tb, mq, mk, mb, width
        tq += seqlen_q[s]
        tk += seqlen_k[s]
        tb += need
        mq = max(mq, seqlen_q[s])
        mk = max(mk, seqlen_k[s])
        mb = max(mb, need)
        width = max(width, bt_off[s + 1] - bt_off[s])
    return OK, tq, tk, tb, mq, mk, mb, width


@kernel
def check_state_id(s: int, state_id: int, S: int, err: np.ndarray) -> int:
    """The SWA ring's last slot of the state, ``state_id * S + S - 1``, fits int32 (call only
    with the sliding-window state cache), else :data:`E_SWA_STATE`. Example: S = 128, state
    ``2**24`` -> slot ``2**31 + 127``: code 2."""
    v = state_id * S + S - 1
    if v > INT32_MAX:
        return fail(err, E_SWA_STATE, s, v, INT32_MAX)
    return OK


@kernel
def fill_cu_seqlens(seqlen_q: np.ndarray, seqlen_k: np.ndarray, cu_q: np.ndarray, cu_k: np.ndarray,
                    err: np.ndarray) -> int:
    """``cu_seqlens_q`` / ``cu_seqlens_k`` [n_seq + 1] (int32, exclusive prefix sums from 0),
    after checking ``sum(seqlen_k) <= 2**31 - 1`` (:data:`E_CU_SEQLENS_K`, nothing written).
    ``sum(seqlen_q) <= sum(seqlen_k)`` needs no check. Example: q ``[1, 3]``, k ``[5, 9]`` ->
    ``[0, 1, 4]``, ``[0, 5, 14]``."""
    n = seqlen_k.shape[0]
    tk = 0
    for s in range(n):
        tk += seqlen_k[s]
    if tk > INT32_MAX:
        return fail(err, E_CU_SEQLENS_K, -1, tk, INT32_MAX)
    aq = 0
    ak = 0
    cu_q[0] = 0
    cu_k[0] = 0
    for s in range(n):
        aq += seqlen_q[s]
        ak += seqlen_k[s]
        cu_q[s + 1] = aq
        cu_k[s + 1] = ak
    return OK


@kernel
def fill_common_rows(s: int, row0: int, sq: int, sk: int, state_id: int, is_ph: bool, tokens: np.ndarray,
                     tok_end: int, S: int, force: bool, positions: np.ndarray, input_ids: np.ndarray,
                     gate: np.ndarray, valid: np.ndarray, query_indices: np.ndarray, swa_slots: np.ndarray) -> None:
    """The per-row common fields of sequence ``s``, rows ``[row0, row0 + sq)``: ``positions``
    (``q_start + j``), ``input_ids`` (the last ``sq`` ids of its token window, which ends at
    ``tokens[tok_end]``), ``gate_force_random`` (``force``), ``valid_token_mask`` (``not
    is_ph``), ``query_indices`` (``s``, 998244353 on a placeholder), and with ``S > 0`` (the
    sliding-window state cache; pass 0 without it, ``swa_slots`` then unused)
    ``slot_mapping_store_swa`` = ``state_id * S + pos % S`` on the last ``S`` rows, -1 before
    them and on placeholders. Bounds: positions < max_model_len, window ids and the SWA slot
    validated. Example: see the module doc."""
    q0 = sk - sq
    qi = PLACEHOLDER_QUERY_INDEX if is_ph else s
    # the rows through slices indexed from 0 (an offset index keeps numba's negative-index test)
    src = tokens[tok_end - sq:tok_end]
    p = positions[row0:row0 + sq]
    ids = input_ids[row0:row0 + sq]
    g = gate[row0:row0 + sq]
    v = valid[row0:row0 + sq]
    qx = query_indices[row0:row0 + sq]
    for j in range(sq):
        p[j] = q0 + j
        ids[j] = src[j]
        g[j] = force
        v[j] = not is_ph
        qx[j] = qi
    if S > 0:
        base = state_id * S
        sw = swa_slots[row0:row0 + sq]
        for j in range(sq):
            sw[j] = PAD_SLOT_ID if (is_ph or sq - j > S) else base + (q0 + j) % S


@kernel
def fill_ngram_rows(seq: int, row0: int, sq: int, q_start: int, tokens: np.ndarray, tok_start: int, lo: int,
                    comp: np.ndarray, comp_start: int, comp_len: int, pad_id: int, image_id: int,
                    has_image: bool, table: np.ndarray, has_table: bool, out: np.ndarray,
                    err: np.ndarray) -> int:
    """``ngram_token_ids`` rows ``[row0, row0 + sq)`` of sequence ``seq`` (``out`` [total_q, N] int32).

    Column c of the row at ``pos = q_start + j`` looks back to ``t = pos - c``: pad when ``t <
    0`` or a raw token at ``t..pos`` is the image sentinel (``has_image``); else
    ``comp[comp_start + t - lo]`` when ``t - lo < comp_len`` (Engram history), else
    ``table[token]`` (``has_table``; identity without) of the window token
    ``tokens[tok_start + t - lo]`` (the window starts at position ``lo``). A table read out of
    range returns :data:`E_NGRAM_TABLE` at once; a value outside int32 is recorded as
    :data:`E_NGRAM_INT32` in ``err`` only when ``err[0]`` is still 0, and the fill goes on (the
    builder checks ``err[0]`` after every sequence: a table error anywhere wins, as in the
    whole-batch check). Example: N = 3, prompt tokens ``[5, 7, IMG, 8]``, q_start 0, lo 0: row
    pos 3 -> ``[8, pad, pad]``; row pos 1 -> ``[7, 5, pad]``.
    """
    N = out.shape[1]
    nt = table.shape[0]
    for j in range(sq):
        r = row0 + j
        pos = q_start + j
        if j > 0 and N > 1:
            # column c >= 1 looks back to the position column c - 1 of the row before did, and is
            # blocked as it was unless the token at pos is the image sentinel (then every column
            # is): the row before shifted by one, only column 0 read (its reads and errors come in
            # the same order as reading every column: a position is first read on the first row
            # that sees it)
            if has_image and tokens[tok_start + pos - lo] == image_id:
                for c in range(N):
                    out[r, c] = pad_id
                continue
            for c in range(N - 1, 0, -1):
                out[r, c] = out[r - 1, c - 1]
            last = 1
        else:
            last = N
        blocked = False
        for c in range(last):
            t = pos - c
            if blocked or t < 0:
                out[r, c] = pad_id
                continue
            k = t - lo
            tok = tokens[tok_start + k]
            if has_image and tok == image_id:
                blocked = True
                out[r, c] = pad_id
                continue
            if k < comp_len:
                v = comp[comp_start + k]
            elif has_table:
                if tok < 0 or tok >= nt:
                    return fail(err, E_NGRAM_TABLE, seq, tok, nt)
                v = table[tok]
            else:
                v = tok
            if v > INT32_MAX or v < _I32_MIN:
                if err[0] == 0:
                    fail(err, E_NGRAM_INT32, seq, v, INT32_MAX)
                out[r, c] = 0
                continue
            out[r, c] = v
    return OK


@kernel
def ngram_of_rows(seqlen_q: np.ndarray, seqlen_k: np.ndarray, tokens: np.ndarray, tok_off: np.ndarray,
                  comp: np.ndarray, comp_off: np.ndarray, rows: np.ndarray, pad_id: int, image_id: int,
                  has_image: bool, table: np.ndarray, has_table: bool, out: np.ndarray, err: np.ndarray) -> int:
    """``ngram_token_ids`` of the query rows ``rows`` only (``out`` [len(rows), N] int32; a row
    ``-1``, a CP pad row, all 0): :func:`fill_ngram_rows` for each, on a prompt or decode
    ``SequenceBatch``'s arrays (one CP rank's rows: ``cpmeta.prepare_prompt_cp``). Returns OK or
    :data:`E_NGRAM_TABLE`; an int32 overflow is recorded in ``err`` as there. Example: N = 2, one
    sequence of tokens ``[5, 7, 9]`` (no table), rows ``[2, -1]`` -> ``[[9, 7], [0, 0]]``."""
    n = seqlen_q.shape[0]
    cu_q = np.zeros(n + 1, np.int64)
    for s in range(n):
        cu_q[s + 1] = cu_q[s] + seqlen_q[s]
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            out[i, :] = 0
            continue
        s = np.searchsorted(cu_q, r, side="right") - 1
        sk = seqlen_k[s]
        lo = sk - (tok_off[s + 1] - tok_off[s])
        code = fill_ngram_rows(s, 0, 1, sk - seqlen_q[s] + r - cu_q[s], tokens, tok_off[s], lo, comp,
                               comp_off[s], comp_off[s + 1] - comp_off[s], pad_id, image_id, has_image,
                               table, has_table, out[i:i + 1], err)
        if code != OK:
            return code
    return OK


#: ``ngram_table`` of a config without ``ngram_lookup`` (the kernels' "no table")
NO_TABLE = np.zeros(0, np.int64)
NO_TABLE.flags.writeable = False


#: ``ngram_table``'s int64 arrays per table object, with the table's version counter when made
_TABLES: IdentityCache[torch.Tensor, tuple[int, np.ndarray]] = IdentityCache(8)


def ngram_table(cfg: MetadataConfig) -> np.ndarray:
    """``cfg.ngram_lookup`` as the kernels read it: int64 on the CPU (an int64 CPU table through a
    view, any other converted), made once per table and again after each in-place edit of it (the
    tensor's version counter moves); :data:`NO_TABLE` without one. Converting on every call cost
    a vocabulary-sized allocation a step: 32,000 int32 entries, 250 KB, ~10 µs hot and the better
    part of the seed config's ~190 µs decode build after an idle gap (H200 host, world 8)."""
    t = cfg.ngram_lookup
    if t is None:
        return NO_TABLE
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor has no version counter: convert every call
        return _as_int64(t)
    hit = _TABLES.get(t)
    if hit is not None and hit[0] == version:
        return hit[1]
    return _TABLES.put(t, (version, _as_int64(t)))[1]


def _as_int64(t: torch.Tensor) -> np.ndarray:
    """Read-only, as :data:`NO_TABLE` (one array type: one compiled signature of each kernel)."""
    a = t.detach().cpu().to(torch.int64).contiguous().numpy()
    a.flags.writeable = False
    return a


@kernel
def compressed_slot(bt: np.ndarray, b0: int, c: int, bc: int) -> int:
    """Compressed-KV slot of compressed index ``c`` of the table ``bt[b0:]``:
    ``bt[b0 + c // bc] * bc + c % bc``. Example: bc 32, table ``[7, 3]``, c 40 -> 104."""
    return bt[b0 + c // bc] * bc + c % bc


def raise_common(err: np.ndarray, cfg: MetadataConfig) -> None:
    """Raise the ``ValueError`` of a common code in ``err`` (the messages of the per-token
    references in ``tests/``); returns for a code it does not own (the builder raises its own)."""
    code, i, v, lim = (int(x) for x in err)
    if code == E_CU_SEQLENS_K:
        check_int32("cu_seqlens_k", v, "sum(seqlen_k)")
    elif code == E_SWA_STATE:
        S = cfg.swa_block_size
        check_int32("slot_mapping_store_swa", v,
                    f"max(state_id) * swa_block_size + swa_block_size - 1 (swa_block_size={S})")
    elif code == E_BLOCK_NEGATIVE:
        raise ValueError(f"seqs[{i}].block_table: expected block ids >= 0, got {v} at index {lim}")
    elif code == E_BLOCK_TOO_LARGE:
        bc = cfg.block_size // cfg.min_ratio
        what = "slot_mapping_store_ca" if cfg.has_compressed_kv else "the paged KV slot"
        raise ValueError(
            f"seqs[{i}].block_table: expected block ids <= {cfg.max_block_id}, got {v} at index {lim} "
            f"({what} int32 overflow: block id * b_c + b_c - 1 must be <= 2**31 - 1, "
            f"b_c = block_size // min_ratio = {bc})")
    elif code == E_NGRAM_TABLE:
        raise ValueError(f"ngram_lookup: a token id of seqs[{i}] read by ngram_token_ids is outside the table "
                         f"({lim} entries)")
    elif code == E_NGRAM_INT32:
        raise ValueError(f"ngram_token_ids: an id of seqs[{i}] does not fit in int32 (an ngram_lookup entry or a "
                         "compressed token id)")


@warmer
def _warm() -> None:
    """Every kernel once on one sequence ``seqlen_q = 2, seqlen_k = 5`` (state 1, S = 4, N = 2)."""
    err = np.zeros(4, np.int64)
    sq, sk = np.array([2], np.int64), np.array([5], np.int64)
    cu_q, cu_k = np.zeros(2, np.int32), np.zeros(2, np.int32)
    fill_cu_seqlens(sq, sk, cu_q, cu_k, err)
    bt = np.array([3, 4], np.int64)
    check_block_table(0, bt, 0, 1, 100, err)
    check_tables(sq, sk, bt, np.array([0, 2], np.int64), 4, 1, 1, 1, 100, err)
    check_state_id(0, 1, 4, err)
    blocks_needed_one(5, 4, 1, 1, 1)
    compressed_slot(bt, 0, 1, 4)
    toks = np.array([9, 10, 11], np.int64)
    i32 = [np.zeros(2, np.int32) for _ in range(4)]
    b = [np.zeros(2, np.bool_) for _ in range(2)]
    fill_common_rows(0, 0, 2, 5, 1, False, toks, 3, 4, False, i32[0], i32[1], b[0], b[1], i32[2], i32[3])
    fill_ngram_rows(0, 0, 2, 3, toks, 0, 2, np.zeros(0, np.int64), 0, 0, 0, -1, False,
                    np.zeros(0, np.int64), False, np.zeros((2, 2), np.int32), err)
    ngram_of_rows(sq, sk, toks, np.array([0, 3], np.int64), np.zeros(0, np.int64), np.zeros(2, np.int64),
                  np.array([1, -1], np.int64), 0, -1, False, np.zeros(0, np.int64), False,
                  np.zeros((2, 2), np.int32), err)
