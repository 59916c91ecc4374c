"""A decode step written into the staging layout STRAIGHT from a ``BatchState`` (DESIGN 12 + 13).

The state half of :class:`cpmeta.gpu.staging_layout.StagingLayout` (``plan_state`` /
``write_state`` call :func:`state_plan` / :func:`write_state_rows`): instead of a
``SequenceBatch``, its extraction and ``write_batch``, the state's public read-only views
(``block_rows32``, ``last_tokens32``, ``state_ids32``, ``placeholder_blocks``) and its vouched
step (``BatchState.vouch_decode``) are copied into the layout. The block tables sit at a FIXED
stride (sequence s at ``s * max_num_blocks``: its ``blocks_needed`` ids, then padding the kernels
never read) instead of packed -- the same metadata, other staging bytes. What only this needs (the
fixed-stride offsets, the per-shape step views) is cached per staging buffer and state in a
:class:`StateStagingCache`, made by its owner (``DecodeStaging.state_cache_for``).
``tests/test_stage_decode.py`` checks both writers stage the same batch and the same metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np

from ..cache import BoundedCache
from ..config import blocks_needed
from ..constants import INT32_MAX
from .staging_header import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, H_TOTAL_K,
    HEADER_FIXED, SEQ_FIELDS, StagedDecode,
)

if TYPE_CHECKING:
    from ..state.batch_state import BatchState
    from ..state.batch_state import VouchedStep

__all__ = ["StateStagingCache", "state_plan", "write_state_rows"]


class StateStagingCache:
    """What writing one ``BatchState``'s steps into one staging buffer reuses every step.

    ``header``: ``(header length, ratio words int32)``; ``stride_off`` [max_seqs] int32: sequence
    s's block-table offset ``s * max_num_blocks``; ``ar32`` [max_seqs + 1] int32 ``0..max_seqs``;
    ``q_lim``: the most query rows whose decode offsets fit int32 (``rows * max_num_blocks *
    block_size // min dense ratio``); ``views``: per (sequences, rows per sequence) of the common step (no placeholders, one draft
    count for all), the staging prefix its values do not change and the views of the host buffer
    ``views_of`` it writes (:class:`_StepViews`), so that step slices nothing; ``cu_k`` [max_seqs]
    int64 scratch and ``step_cu_k``: the planned step's inclusive prefix sum of seqlen_k.
    Example: 4 slots, max_num_blocks 3 -> stride_off ``[0, 3, 6, 9]``.
    """

    __slots__ = ("state", "header", "stride_off", "ar32", "q_lim", "views", "views_of", "cu_k", "step_cu_k")

    def __init__(self, st: "BatchState", header_len: int, ratios: np.ndarray) -> None:
        cfg, n, mnb = st.cfg, st.max_seqs, st.block_rows32.shape[1]
        self.state = st
        self.header = (header_len, ratios)
        self.stride_off = (np.arange(n, dtype=np.int64) * mnb).astype(np.int32)
        self.ar32 = np.arange(n + 1, dtype=np.int32)
        bc_d = cfg.block_size // min(cfg.dense_compress_ratios) if cfg.dense_compress_ratios else 0
        self.q_lim = INT32_MAX // (mnb * bc_d) if bc_d else INT32_MAX
        self.views: BoundedCache[tuple[int, int], _StepViews] = BoundedCache(32)
        self.views_of: Optional[np.ndarray] = None  # the host view ``views`` alias
        self.cu_k = np.empty(n, np.int64)  # a step's cu_seqlens_k (inclusive), before the host buffer is free
        self.step_cu_k = self.cu_k[:0]


def state_plan(cache: StateStagingCache, step: "VouchedStep", n_ph: int) -> Optional[StagedDecode]:
    """The scalars of a vouched step with ``n_ph`` placeholders in the fixed-stride layout (its
    ``cu_seqlens_k`` left in ``cache.step_cu_k``), or ``None`` when an int32 bound of the builders
    fails (``sum(seqlen_k)``, the decode offsets, the int32 section offsets): the caller falls back
    to the general path and its messages. Example: 256 one-row requests, no placeholder, default
    config: ``used = 11 + 7*256 + 256 + 256*64``."""
    st, sk, drafts = cache.state, step.sk, step.drafts
    n_real, n_d, max_q = len(step.slots), 0 if drafts is None else len(drafts), 1 + step.k_hi
    n = n_real + n_ph
    total_q = n + n_d
    # cu_seqlens_k (inclusive) in int64, exact: its last entry is the step's total (no separate sum)
    cu_k = cache.cu_k[:n_real] if n_real <= len(cache.cu_k) else np.empty(n_real, np.int64)
    np.add.accumulate(sk, out=cu_k)
    cache.step_cu_k = cu_k
    total_k = int(cu_k[-1]) + n_ph
    if total_k > INT32_MAX or total_q > cache.q_lim:  # the builders' int32 checks (check_decode_int32)
        return None
    ph_nb = st.placeholder_blocks
    used = cache.header[0] + SEQ_FIELDS * n + total_q + n_real * st.block_rows32.shape[1] + n_ph * ph_nb
    if used > INT32_MAX:  # the header holds int32 offsets (the packed layout of the general path is smaller)
        return None
    # the tables cover seqlen_k <= max_model_len, so blocks_needed <= max_num_blocks; it is
    # monotone, so the batch's need is that of max(sk)
    max_sk = int(np.maximum.reduce(sk))  # (the ufunc: no Python wrapper of ndarray.max)
    return StagedDecode(n, total_q, total_k, max_q, max(max_sk, 1 if n_ph else 0), used,
                        max(blocks_needed(max_sk, st.cfg), ph_nb if n_ph else 0))


def write_state_rows(cache: StateStagingCache, view: np.ndarray, staged: StagedDecode, step: "VouchedStep") -> None:
    """Write the planned step into ``view``: the common step (no placeholders, one draft count for
    all) through the views cached per shape (:func:`_write_common`), any other through
    :func:`_write_fixed` + :func:`_write_values`; the same bytes either way."""
    n_real = len(step.slots)
    if step.uniform and staged.num_seqs == n_real:
        _write_common(cache, view, staged, step, cache.step_cu_k)
    else:
        _write_fixed(cache, view, staged, n_real, None if step.uniform else step.nd)
        _write_values(cache, view, staged, step, cache.step_cu_k, staged.num_seqs - n_real)


class _StepViews(NamedTuple):
    """Views of the host buffer that the common step of one shape writes: ``fixed`` (a copy of
    the prefix its values do not change) goes to ``prefix``; ``sk`` / ``cu_k`` / ``state``: the
    rows seqlen_k, cu_seqlens_k (inclusive), state id [n]; ``cols``: the input ids, as ``(ids,)``
    without drafts, else ``(last-token column, draft column 1, ..)`` of the ``[n, 1 + k]`` rows
    (``(last-token column, [n, k] draft columns)`` when ``k > 3``); ``bt`` [n, max_num_blocks]:
    the block-table section."""

    fixed: np.ndarray
    prefix: np.ndarray
    sk: np.ndarray
    cu_k: np.ndarray
    state: np.ndarray
    cols: tuple[np.ndarray, ...]
    bt: np.ndarray


def _step_views(cache: StateStagingCache, view: np.ndarray, staged: StagedDecode) -> _StepViews:
    """Write the common step's fixed prefix (:func:`_write_fixed`) and make its :class:`_StepViews`.
    Example: 256 sequences, 2 drafts each -> ids rows ``[256, 3]``, ``cols`` = 3 strided columns."""
    n, max_q = staged.num_seqs, staged.max_seqlen_q
    _write_fixed(cache, view, staged, n, None)
    hl, mnb = cache.header[0], cache.state.block_rows32.shape[1]
    off_ids = hl + SEQ_FIELDS * n
    off_bt = off_ids + staged.total_q
    blk = view[hl:off_ids].reshape(SEQ_FIELDS, n)
    ids = view[off_ids:off_bt]
    if max_q == 1:
        cols: tuple[np.ndarray, ...] = (ids,)
    else:  # a few 1-D strided copies beat one 2-D one (~1 us at 256 x 2)
        rows = ids.reshape(n, max_q)
        cols = (rows[:, 0], *(rows[:, j] for j in range(1, max_q))) if max_q <= 4 else (rows[:, 0], rows[:, 1:])
    return _StepViews(view[:off_ids].copy(), view[:off_ids], blk[F_SEQLEN_K], blk[F_CU_K_INCL], blk[F_STATE],
                      cols, view[off_bt:off_bt + n * mnb].reshape(n, mnb))


def _write_common(cache: StateStagingCache, view: np.ndarray, staged: StagedDecode, step: VouchedStep,
                  cu_k: np.ndarray) -> None:
    """The common step (no placeholders, one draft count for all) through the views cached per
    (sequences, rows per sequence): the same bytes as :func:`_write_fixed` + :func:`_write_values`
    in ~10 numpy calls (the prefix copy, seqlen_k and its prefix sum ``cu_k`` [n] int64, total_k,
    state ids, input ids, ONE block-table row gather)."""
    if cache.views_of is not view:  # the staging grew: the views alias the old buffer
        cache.views.clear()
        cache.views_of = view
    key = (staged.num_seqs, staged.max_seqlen_q)
    v = cache.views.get(key)
    if v is None:
        v = cache.views.put(key, _step_views(cache, view, staged))
    else:
        v.prefix[...] = v.fixed
    st, slots, cols = cache.state, step.slots, v.cols
    v.sk[...] = step.sk
    v.cu_k[...] = cu_k
    view[H_TOTAL_K] = staged.total_k
    st.state_ids32.take(slots, out=v.state, mode="clip")  # clip: no buffering (slots checked)
    if len(cols) == 1:  # the last confirmed tokens (int32: the state vouched for every slot)
        st.last_tokens32.take(slots, out=cols[0], mode="clip")
    else:  # rows of sequence s: [s * (1 + k), (s + 1) * (1 + k)): last token, drafts
        drafts, k = step.drafts, staged.max_seqlen_q - 1
        assert drafts is not None  # k > 0: the step has drafts
        cols[0][...] = st.last_tokens32[slots]
        if len(cols) == 1 + k:  # one strided column per draft
            for j in range(k):
                cols[1 + j][...] = drafts[j::k]
        else:
            cols[1][...] = drafts.reshape(len(slots), k)
    st.block_rows32.take(slots, axis=0, out=v.bt, mode="clip")


def _write_values(cache: StateStagingCache, view: np.ndarray, staged: StagedDecode, step: VouchedStep,
                  cu_k: np.ndarray, n_ph: int) -> None:
    """The step's values: ``seqlen_k`` and its prefix sum (``cu_k`` [n_real] int64), ``total_k``,
    state ids, input ids (each request's last confirmed token, then its drafts; placeholders 0)
    and the block-table rows."""
    slots, drafts, nd = step.slots, step.drafts, step.nd
    n, total_q, total_k, max_q = staged.num_seqs, staged.total_q, staged.total_k, staged.max_seqlen_q
    st = cache.state
    n_real, mnb = len(slots), st.block_rows32.shape[1]
    off_ids = cache.header[0] + SEQ_FIELDS * n
    off_bt, total_b_real = off_ids + total_q, n_real * mnb
    blk = view[cache.header[0]:off_ids].reshape(SEQ_FIELDS, n)
    r = slice(0, n_real)
    blk[F_SEQLEN_K, r] = step.sk
    blk[F_CU_K_INCL, r] = cu_k
    view[H_TOTAL_K] = total_k
    if n_ph:
        blk[F_CU_K_INCL, n_real:] = np.arange(total_k - n_ph + 1, total_k + 1)
    st.state_ids32.take(slots, out=blk[F_STATE, r], mode="clip")  # clip: no buffering (slots checked)
    ids = view[off_ids:off_bt]
    if drafts is not None and step.uniform:  # rows of sequence s: [s * (1 + k), (s + 1) * (1 + k)): last token, drafts
        rows = ids[:n_real * max_q].reshape(n_real, max_q)
        rows[:, 0] = st.last_tokens32[slots]
        if max_q <= 4:  # a few 1-D strided copies beat one 2-D one (~1 us at 256 x 2)
            for j in range(1, max_q):
                rows[:, j] = drafts[j - 1::max_q - 1]
        else:
            rows[:, 1:] = drafts.reshape(n_real, max_q - 1)
    elif drafts is not None:  # row of draft i of sequence s: i + s + 1 (every earlier sequence adds its last token)
        assert nd is not None  # counts differ: one per request
        ids[blk[F_CU_Q_INCL, r] - blk[F_SEQLEN_Q, r]] = st.last_tokens32.take(slots)
        ids[np.arange(len(drafts)) + np.repeat(cache.ar32[1:n_real + 1], nd)] = drafts
    else:  # the last confirmed tokens (int32: the state vouched for every slot)
        st.last_tokens32.take(slots, out=ids[:n_real], mode="clip")
    if n_ph:
        ids[total_q - n_ph:] = 0
        view[off_bt + total_b_real:staged.used] = 0
    # the tables: row s of the section is the slot's row of the int32 mirror (clip: no buffering)
    st.block_rows32.take(slots, axis=0, out=view[off_bt:off_bt + total_b_real].reshape(n_real, mnb), mode="clip")


def _write_fixed(cache: StateStagingCache, view: np.ndarray, staged: StagedDecode, n_real: int,
                 nd: Optional[np.ndarray]) -> None:
    """The staging prefix a step's values do not change: the header (total_k left to the
    caller), the ratios, and the per-sequence rows seqlen_q, cu_seqlens_q (from ``nd``, the
    per-request draft counts, when they differ; else every request has ``staged.max_seqlen_q`` rows),
    is_placeholder and the block-table offsets (stride ``max_num_blocks``), placeholders included."""
    n, total_q, used = staged.num_seqs, staged.total_q, staged.used
    hl, ratios = cache.header
    mnb = cache.state.block_rows32.shape[1]
    off_ids = hl + SEQ_FIELDS * n
    view[:HEADER_FIXED] = (n, total_q, 0, hl, off_ids, off_ids + total_q, used, used)
    view[HEADER_FIXED:hl] = ratios
    blk = view[hl:off_ids].reshape(SEQ_FIELDS, n)
    n_ph, r = n - n_real, slice(0, n_real)
    if n_ph:
        ph_nb = cache.state.placeholder_blocks
        blk[:, n_real:] = ((1,), (1,), (0,), (0,), (0,), (1,), (0,))  # cu rows, bt offsets: set below
        blk[F_CU_Q_INCL, n_real:] = np.arange(total_q - n_ph + 1, total_q + 1)
        blk[F_BT_OFFSET, n_real:] = n_real * mnb + ph_nb * np.arange(n_ph)
    if nd is not None:
        np.add(nd, 1, out=blk[F_SEQLEN_Q, r])
        np.add.accumulate(blk[F_SEQLEN_Q, r], out=blk[F_CU_Q_INCL, r])
    else:  # seqlen_q = 1 + k for all: cu_q_incl = (s + 1) * (1 + k)
        blk[F_SEQLEN_Q, r] = staged.max_seqlen_q
        np.multiply(cache.ar32[1:n_real + 1], staged.max_seqlen_q, out=blk[F_CU_Q_INCL, r])
    blk[F_PLACEHOLDER, r] = 0
    blk[F_BT_OFFSET, r] = cache.stride_off[:n_real]
