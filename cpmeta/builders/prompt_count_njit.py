"""The prompt build's count pass: check every bound, then write the data-dependent sizes.

A prompt step's output sizes depend on the data (the load plans' segment counts, each ratio's
compressed rows, the widest block table, YoCo's kept rows), so the build is the reference engine's two
passes: :func:`prompt_count` (here) checks every bound the builder guarantees and writes the sizes
into ``cnt`` (:func:`count_slots` long); the Python wrapper (:func:`cpmeta.builders.prompt.prepare_prompt`)
makes the arena of those sizes; the fill pass (:mod:`.prompt_njit`) writes every field into it. Both
passes read a prompt ``SequenceBatch``'s arrays and the config's constants (:func:`prompt_consts`,
whose slot numbers are defined here); the block-table check comes from :mod:`.common_njit`.

Worked example (W = S = 4, block_size 16, ratio 4, one sequence ``seqlen_q = 3``, ``seqlen_k =
9`` (q_start 6), state 2, table ``[7]``, swa_valid_start 0): every check passes; ``total_q = 3``,
``sum(seqlen_k) = 9``, widest table 1; SWA history positions ``2..5`` at ring slots ``2, 3`` then
``0, 1`` (:func:`swa_run` ``(0, 2, 2, 2)``): 2 segments; ratio 4: compressed rows ``9 // 4 - 6 //
4 = 1``, paged segments ``cdiv(2, 4) = 1``, loaded rows ``max(1, 9 // 4) = 2``: ``cnt = [3, 9, 3,
9, 1, 2, 0, 1, 1, 2]``.
"""

from __future__ import annotations

import numpy as np

from ..config import MetadataConfig
from ..constants import INT32_MAX
from ..jit import OK, kernel
from .common_njit import (
    COMMON_CODES_END, E_CU_SEQLENS_K, check_state_id, check_tables, fail,
)

__all__ = [
    "prompt_count", "swa_run", "prompt_consts", "count_slots", "E_PIVOTS", "E_CU_COMPRESSED_K", "E_TABLE_ID",
    "CNT_T", "CNT_SUM_K", "CNT_MAX_Q", "CNT_MAX_K", "CNT_WIDTH", "CNT_SEG_SWA", "CNT_TOTAL_C", "CNT_RATIOS",
]

#: ``n_seq * W + total_q`` (the SWA pivots' buffer offsets) passes int32: ``err[1]`` n_seq,
#: ``err[2]`` the bound, ``err[3]`` total_q.
E_PIVOTS = COMMON_CODES_END
#: ``sum max(1, seqlen_k // n)`` of ca ratio ``n`` passes int32: ``err[1]`` the ratio's index in
#: ``ca_ratios``, ``err[2]`` the sum.
E_CU_COMPRESSED_K = COMMON_CODES_END + 1
#: A block id of a WHOLE table (``seq_block_tables``) outside ``[0, 2**31 - 1]``: ``err[1]`` sequence.
E_TABLE_ID = COMMON_CODES_END + 2

# prompt_consts slots
(_BS, _MINR, _CYCLE, _INTER, _MAXBID, _W, _S, _FORCE, _N, _PAD, _IMG, _HAS_IMG, _KEEP, _COMPACT, _NSP, _NCA,
 _NDE) = range(17)
#: Where the ratios start in :func:`prompt_consts`: ca ratios, then each sparse ratio's and each
#: dense ratio's index in ca.
_RATIOS = 17

# cnt slots (prompt_count's sizes), then 3 per ca ratio: compressed rows, paged segments, loaded rows
CNT_T, CNT_SUM_K, CNT_MAX_Q, CNT_MAX_K, CNT_WIDTH, CNT_SEG_SWA, CNT_TOTAL_C = range(7)
CNT_RATIOS = 7


def count_slots(cfg: MetadataConfig) -> int:
    """Length of :func:`prompt_count`'s ``cnt``: 7 sizes + 3 per ca ratio. Example: defaults -> 10."""
    return CNT_RATIOS + 3 * len(cfg.ca_ratios)


def prompt_consts(cfg: MetadataConfig) -> np.ndarray:
    """The config as one read-only int64 array: block_size, min_ratio, KV-CP cycle and interleave,
    max_block_id, W, S, force_load_balance, max_ngram_size, pad id, image id, has image, YoCo keep
    (-1 off), compact (1) / mask (0), the counts of sparse / ca / dense ratios, then the ca ratios,
    each sparse ratio's index in them, each dense ratio's index in them. Example:
    ``MetadataConfig.compressed_swa()`` -> ``[128, 4, 1, 1, 67108863, 128, 128, 0, 0, 0, -1, 0, -1, 1,
    1, 1, 1, 4, 0, 0]``; ``MetadataConfig()`` (plain) -> ``[16, 1, 1, 1, 134217727, 0, 128, 0, 0, 0, -1,
    0, -1, 1, 0, 0, 0]``."""
    img = cfg.image_token_id
    ca = list(cfg.ca_ratios)
    head = [cfg.block_size, cfg.min_ratio, cfg.kv_cp_world_size * cfg.kv_cp_interleave, cfg.kv_cp_interleave,
            cfg.max_block_id, cfg.window_size, cfg.swa_block_size, int(cfg.force_load_balance), cfg.max_ngram_size,
            cfg.ngram_pad_token, -1 if img is None else img, int(img is not None),
            -1 if cfg.yoco_keep_tokens is None else cfg.yoco_keep_tokens, int(cfg.yoco_mode == "compact"),
            len(cfg.sparse_compress_ratios), len(ca), len(cfg.dense_compress_ratios)]
    idx = [ca.index(r) for r in cfg.sparse_compress_ratios] + [ca.index(r) for r in cfg.dense_compress_ratios]
    c = np.array(head + ca + idx, np.int64)
    c.flags.writeable = False
    return c


@kernel
def swa_run(q0: int, valid_start: int, W: int, S: int) -> tuple[int, int, int, int]:
    """One sequence's SWA history ``[q0 - W, q0)`` as ``(pad, a % S, first, second)``: ``pad =
    clamp(swa_valid_start - (q0 - W), 0, W)`` zero-filled rows, then the ring run from position
    ``a = q0 - W + pad``: ``first`` rows from slot ``a % S``, ``second`` more from slot 0 (the
    wrap). Example: W = S = 8, q0 = 11, valid start 0 -> ``(0, 3, 5, 3)``; q0 = 5 -> ``(3, 0, 5, 0)``."""
    pad = min(max(valid_start - (q0 - W), 0), W)
    a = q0 - W + pad
    length = q0 - a
    a_mod = a % S
    first = min(length, S - a_mod)
    return pad, a_mod, first, length - first


@kernel
def prompt_count(seqlen_q: np.ndarray, seqlen_k: np.ndarray, state_id: np.ndarray, valid_start: np.ndarray,
                 num_tokens: np.ndarray, bt: np.ndarray, bt_off: np.ndarray, k: np.ndarray, cnt: np.ndarray,
                 err: np.ndarray) -> int:
    """Pass 1: check the bounds and write the sizes of one prompt batch into ``cnt``.

    Checks, in the numpy builder's order (the first failure returns its code, ``err`` filled):
    every needed block id (``blocks_needed(seqlen_k)``) in ``[0, max_block_id]``; ``sum(seqlen_k)``,
    with the state cache the SWA ring slot of every state and ``n_seq * W + total_q``, and each
    ratio's ``sum max(1, seqlen_k // n)`` in int32; every id of every WHOLE table in ``[0, 2**31 -
    1]`` (:data:`E_TABLE_ID`). Sizes (``cnt``): ``total_q``, ``sum(seqlen_k)``, the largest
    ``seqlen_q`` / ``seqlen_k`` / table length, the SWA plan's segments (per sequence a zero fill
    when ``pad > 0``, then the ring run split at the wrap: :func:`swa_run`), YoCo compact's kept
    rows (``seqlen_q - clip_prefix``); per ca ratio n (``b_c = block_size // n``): compressed
    rows ``max(1, seqlen_k // n - q_start // n)``, paged segments ``max(1, cdiv(seqlen_k // n,
    b_c))``, loaded rows ``max(1, seqlen_k // n)``.
    Example (W = S = 4, block 16, ratio 4, one sequence q 3, k 9, state 2, table [7]): ``cnt = [3,
    9, 3, 9, 1, 2, 0, 1, 1, 2]``.
    """
    n = seqlen_q.shape[0]
    bs = k[_BS]
    W = k[_W]
    S = k[_S]
    code, T, tk, _tb, mq, mk, _mb, width = check_tables(seqlen_q, seqlen_k, bt, bt_off, bs, k[_MINR], k[_CYCLE],
                                                        k[_INTER], k[_MAXBID], err)
    if code != OK:
        return code
    if tk > INT32_MAX:
        return fail(err, E_CU_SEQLENS_K, -1, tk, INT32_MAX)
    nseg = 0
    total_c = 0
    if W > 0:
        for s in range(n):
            code = check_state_id(s, state_id[s], S, err)
            if code != OK:
                return code
        if n * W + T > INT32_MAX:
            return fail(err, E_PIVOTS, n, n * W + T, T)
        for s in range(n):
            pad, _, first, second = swa_run(seqlen_k[s] - seqlen_q[s], valid_start[s], W, S)
            nseg += (1 if pad > 0 else 0) + (1 if first > 0 else 0) + (1 if second > 0 else 0)
        keep = k[_KEEP]
        if keep >= 0 and k[_COMPACT] != 0:
            for s in range(n):
                q = seqlen_q[s]
                total_c += q - min(max(num_tokens[s] - keep - (seqlen_k[s] - q), 0), q - 1)
    for a in range(k[_NCA]):
        m = k[_RATIOS + a]
        bc = bs // m
        rows = 0
        segs = 0
        loaded = 0
        for s in range(n):
            c_hi = seqlen_k[s] // m
            rows += max(c_hi - (seqlen_k[s] - seqlen_q[s]) // m, 1)
            segs += max((c_hi + bc - 1) // bc, 1)
            loaded += max(c_hi, 1)
        if loaded > INT32_MAX:
            return fail(err, E_CU_COMPRESSED_K, a, loaded, INT32_MAX)
        cnt[CNT_RATIOS + 3 * a] = rows
        cnt[CNT_RATIOS + 3 * a + 1] = segs
        cnt[CNT_RATIOS + 3 * a + 2] = loaded
    for s in range(n):
        for b in range(bt_off[s], bt_off[s + 1]):
            if bt[b] < 0 or bt[b] > INT32_MAX:
                return fail(err, E_TABLE_ID, s, bt[b], INT32_MAX)
    cnt[CNT_T] = T
    cnt[CNT_SUM_K] = tk
    cnt[CNT_MAX_Q] = mq
    cnt[CNT_MAX_K] = mk
    cnt[CNT_WIDTH] = width
    cnt[CNT_SEG_SWA] = nseg
    cnt[CNT_TOTAL_C] = total_c
    return OK
