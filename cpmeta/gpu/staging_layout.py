"""The staging layout of the in-place decode path, defined once: :class:`StagingLayout`.

Per-sequence arrays of one decode step live in ONE int32 buffer (owned, uploaded and ordered with
graph replays by :class:`cpmeta.gpu.decode_staging.DecodeStaging`); the kernels (or their CPU
emulation) derive every per-row value from it. The layout object of a config writes it from
extracted arrays (:meth:`StagingLayout.write_batch`, the builders' ``BatchArrays``) or straight
from a ``BatchState`` (:meth:`StagingLayout.write_state`), validates a received one
(:meth:`StagingLayout.validate`, every CP follower, every step) and reads one back
(:meth:`StagingLayout.unpack`). Offsets are stored in the header so the kernels need no host
scalars (a captured CUDA graph replays with a new batch)::

    [0 .. HEADER_FIXED)        n_seq, total_q, total_k, off_seq, off_ids, off_bt, off_ngv, off_ngb
    [HEADER_FIXED .. +R)       ratios: every ratio set in fields.RATIO_ORDER (ca, sparse, dense)
    off_seq: [SEQ_FIELDS, n_seq] rows seqlen_q, seqlen_k, cu_seqlens_q_incl, cu_seqlens_k_incl,
                                      state_id, is_placeholder, bt_offset
    off_ids: [total_q]           input id of every row (token_ids[-1], then the drafts)
    off_bt:  [...]               block tables: the nb_s = cdiv(seqlen_k // m, b_m) defined blocks
                                 of sequence s at off_bt + bt_offset[s] (m = min ratio, b_m =
                                 block_size // m): packed back to back by write_batch, at a fixed
                                 stride of max_num_blocks by write_state (same metadata)
    off_ngv: [total_q + n_seq*(G-1)]  Engram source value of every window position (G = max_ngram_size)
    off_ngb: [total_q + n_seq*(G-1)]  1 where the window position is a barrier (image token or t < 0)

``cu_seqlens_q_incl`` is the INCLUSIVE prefix sum (length n_seq, no leading 0): the sequence's
last row + 1, so its first row is ``cu_seqlens_q_incl[s] - seqlen_q[s]``.

Worked example: two sequences ``seqlen_q = (1, 3)``, ``seqlen_k = (5, 9)``, ``block_size=4``,
dense and sparse ratios ``(4,)`` (so m=4, b_m=1): ``cu_seqlens_q_incl = (1, 4)``, ``cu_seqlens_k_incl = (5, 14)``,
``nb = (1, 2)``, ``bt_offset = (0, 1)``; header length 8 + 3 (ca, sparse, dense: 4, 4, 4) = 11,
``off_ids = 11 + 7*2 = 25``, ``off_bt = 29``, ``used = 32``. Sequence 1 owns rows 1..3 at positions
6, 7, 8; with G=2 its Engram window covers positions 5..8 and starts at element ``1 + 1 = 2``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ..cache import IdentityCache

from ..config import MetadataConfig, blocks_needed_array
from ..constants import INT32_MAX
from ..fields import CA, DENSE, RATIO_ORDER, SPARSE, staged_ratios
from .staging_header import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, H_N_SEQ, H_OFF_BT,
    H_OFF_IDS, H_OFF_NGB, H_OFF_NGV, H_OFF_SEQ, H_TOTAL_K, H_TOTAL_Q, HEADER_FIXED, SEQ_FIELDS, StagedDecode,
)
from .staging_state import StateStagingCache, state_plan, write_state_rows

#: the longest ``max_model_len`` for which :meth:`StagingLayout.blocks_of` gathers from a table
#: of every length (2**21 + 1 int64: 16 MiB)
NEED_TABLE_MAX = 1 << 21

if TYPE_CHECKING:
    from ..builders.batch_arrays import BatchArrays
    from ..state.batch_state import BatchState

__all__ = [
    "HEADER_FIXED", "SEQ_FIELDS",
    "H_N_SEQ", "H_TOTAL_Q", "H_TOTAL_K", "H_OFF_SEQ", "H_OFF_IDS", "H_OFF_BT", "H_OFF_NGV", "H_OFF_NGB",
    "F_SEQLEN_Q", "F_SEQLEN_K", "F_CU_Q_INCL", "F_CU_K_INCL", "F_STATE", "F_PLACEHOLDER", "F_BT_OFFSET",
    "StagedDecode", "StagingLayout", "StateStagingCache", "staging_capacity", "unpack_staging",
]

# the kernels (decode_triton, decode_emulate) read the ratio words in this order
assert RATIO_ORDER == (CA, SPARSE, DENSE), RATIO_ORDER


_LAYOUTS: IdentityCache[MetadataConfig, "StagingLayout"] = IdentityCache(16)


class StagingLayout:
    """The staging layout of one config (see the module docstring); :meth:`of` caches it per config.

    ``header_len``: ``HEADER_FIXED`` + every ratio; ``ratios``: the ratio words (int32, read-only).
    Example: ``MetadataConfig.compressed_swa()`` -> ``header_len == 11``, ``ratios == [4, 4, 4]``.
    """

    __slots__ = ("cfg", "header_len", "ratios", "ratio_counts", "_need")

    def __init__(self, cfg: MetadataConfig) -> None:
        self.cfg = cfg
        words = staged_ratios(cfg)
        self.header_len = HEADER_FIXED + len(words)
        self.ratios = np.array(words, np.int32)
        self.ratios.flags.writeable = False
        #: ratios per set, in RATIO_ORDER (ca, sparse, dense): the kernels' N_CA, N_SP, N_DN
        self.ratio_counts = tuple(len(cfg.ca_ratios if s == CA else cfg.sparse_compress_ratios if s == SPARSE
                                      else cfg.dense_compress_ratios) for s in RATIO_ORDER)
        self._need: Optional[np.ndarray] = None

    @staticmethod
    def of(cfg: MetadataConfig) -> "StagingLayout":
        hit = _LAYOUTS.get(cfg)
        return hit if hit is not None else _LAYOUTS.put(cfg, StagingLayout(cfg))

    def blocks_of(self, k: np.ndarray) -> np.ndarray:
        """``blocks_needed`` of every ``k`` (int64 array, entries in ``[0, max_model_len]``): one
        gather from a table of every length, made on the first call, while the table stays
        small (``max_model_len <= NEED_TABLE_MAX``, 16 MiB); the arithmetic itself past that (a
        table for ``max_model_len`` 2**29 would be 4 GiB)."""
        if self.cfg.max_model_len > NEED_TABLE_MAX:
            return blocks_needed_array(k, self.cfg)
        if self._need is None:
            self._need = blocks_needed_array(np.arange(self.cfg.max_model_len + 1, dtype=np.int64), self.cfg)
        return self._need.take(k)

    def capacity(self, max_seqs: int, max_total_q: int) -> int:
        """Int32 elements any batch of ``<= max_seqs`` / ``<= max_total_q`` needs (either writer).
        Example: ``compressed_swa()``, 256 seqs, 768 rows, no Engram: ``11 + 7*256 + 768 + 256*64 = 19,163``."""
        g = self.cfg.max_ngram_size
        ngram = 2 * (max_total_q + max_seqs * max(g - 1, 0)) if g else 0
        return self.header_len + SEQ_FIELDS * max_seqs + max_total_q + max_seqs * self.cfg.max_num_blocks + ngram

    def state_cache(self, st: "BatchState") -> StateStagingCache:
        """A new :class:`StateStagingCache` for writing ``st``'s steps (its owner, the staging
        buffer, keeps one: ``DecodeStaging.state_cache_for``)."""
        return StateStagingCache(st, self.header_len, self.ratios)

    def write_header(self, view: np.ndarray, n: int, total_q: int, total_k: int, off_bt_len: int,
                     n_win: int) -> tuple[int, int]:
        """The header and ratio words; returns ``(off_ids, used)``."""
        hl = self.header_len
        off_ids = hl + SEQ_FIELDS * n
        off_ngv = off_ids + total_q + off_bt_len
        used = off_ngv + 2 * n_win
        view[:HEADER_FIXED] = (n, total_q, total_k, hl, off_ids, off_ids + total_q, off_ngv, off_ngv + n_win)
        view[HEADER_FIXED:hl] = self.ratios
        return off_ids, used

    # ---- writers ---------------------------------------------------------------------------------
    def write_batch(self, view: np.ndarray, b: "BatchArrays") -> StagedDecode:
        """Write extracted, validated arrays ``b`` (``extract_batch``'s, flat tables packed back to
        back) into ``view``. ``BufferError(needed_elements)`` if ``view`` is too small (nothing
        written: the owner grows its buffer and retries)."""
        n, total_q, cfg = b.n_seq, b.total_q, self.cfg
        bt_flat, bt_start, bt_need = b.bt_flat, b.bt_start, b.bt_need
        assert bt_flat is not None and bt_start is not None and bt_need is not None  # flat_tables=True
        total_b, g = len(bt_flat) - 1, cfg.max_ngram_size
        n_win = (total_q + n * (g - 1)) if g else 0
        used = self.header_len + SEQ_FIELDS * n + total_q + total_b + 2 * n_win
        if used > view.shape[0]:
            raise BufferError(used)
        ng = _ngram_windows(b, cfg) if g else None
        off_ids, _ = self.write_header(view, n, total_q, int(b.cu_k[-1]), total_b, n_win)
        blk = view[self.header_len:off_ids].reshape(SEQ_FIELDS, n)
        blk[F_SEQLEN_Q], blk[F_SEQLEN_K] = b.seqlen_q, b.seqlen_k
        blk[F_CU_Q_INCL], blk[F_CU_K_INCL] = b.cu_q[1:], b.cu_k[1:]
        blk[F_STATE], blk[F_PLACEHOLDER], blk[F_BT_OFFSET] = b.state_id, b.is_placeholder, bt_start
        off_bt = off_ids + total_q
        view[off_ids:off_bt] = b.input_ids
        view[off_bt:off_bt + total_b] = bt_flat[:total_b]
        if ng is not None:
            off_ngv = off_bt + total_b
            view[off_ngv:off_ngv + n_win], view[off_ngv + n_win:used] = ng
        max_blocks = int(bt_need.max()) if n else 0
        return StagedDecode(n, total_q, int(b.cu_k[-1]), int(b.seqlen_q.max()), int(b.seqlen_k.max()), used,
                            max_blocks)

    #: ``plan_state(cache, step, n_ph) -> StagedDecode | None``: the scalars of a vouched
    #: ``BatchState`` step (``n_ph`` placeholders) in the fixed-stride layout, or ``None`` when an
    #: int32 bound fails (the caller falls back to the general path, whose checks name the field);
    #: touches no staging buffer. ``write_state(cache, view, staged, step)``: the planned step
    #: written straight from the state's arrays into ``view`` (tables at a fixed stride of
    #: ``max_num_blocks``: one row gather of the state's int32 table mirror). Both are the state
    #: half of the layout, :mod:`cpmeta.gpu.staging_state` (called with no layout frame between).
    plan_state = staticmethod(state_plan)
    write_state = staticmethod(write_state_rows)

    # ---- readers ---------------------------------------------------------------------------------
    def validate(self, a: np.ndarray, staged: StagedDecode) -> Optional[str]:
        """Why the int32 staging prefix ``a`` is not a well-formed batch for this config (None when
        it is). Every address the kernels derive is checked; values are not.

        Example (dense and sparse ratios (4,), no Engram, ``block_size 4``, two sequences
        ``seqlen_q = (1, 3)``, ``seqlen_k = (5, 9)``): header length 8 + 3 = 11, ``off_ids = 11 + 7*2 = 25``, ``off_bt = 25 + 4 = 29``,
        ``nb = (1, 2)`` so ``off_ngv = off_ngb = used = 32``.
        """
        n, tq, g, hl, cfg = staged.num_seqs, staged.total_q, self.cfg.max_ngram_size, self.header_len, self.cfg
        if staged.used != a.shape[0] or staged.used < hl:
            return f"buffer of {a.shape[0]} elements, header says {staged.used} (header alone {hl})"
        hdr = a[:HEADER_FIXED].astype(np.int64)
        if not np.array_equal(a[HEADER_FIXED:hl], self.ratios):
            return f"ratios {a[HEADER_FIXED:hl].tolist()} differ from this rank's config {self.ratios.tolist()}"
        n_win = (tq + n * (g - 1)) if g else 0
        off_ids = hl + SEQ_FIELDS * n
        want = (n, tq, staged.total_k, hl, off_ids, off_ids + tq)
        if n < 0 or tq < n or tuple(hdr[:6].tolist()) != want:
            return f"header {hdr[:6].tolist()} does not match the scalars (expected {list(want)})"
        off_ngv, off_ngb = int(hdr[H_OFF_NGV]), int(hdr[H_OFF_NGB])
        if not (off_ids + tq <= off_ngv and off_ngb == off_ngv + n_win and staged.used == off_ngb + n_win):
            return f"section offsets {hdr[5:8].tolist()} inconsistent with used={staged.used}"
        if n == 0:
            return None if tq == 0 else "total_q > 0 without sequences"
        # every follower runs this per step: ~20 numpy calls over [7, n] (int64, so no prefix sum
        # wraps; count_nonzero: cheaper than any() on small masks)
        blk = a[hl:off_ids].reshape(SEQ_FIELDS, n).astype(np.int64)
        q, k = blk[F_SEQLEN_Q], blk[F_SEQLEN_K]
        lo, hi = blk.min(axis=1), blk.max(axis=1)  # per field: two reductions instead of six
        if lo[F_SEQLEN_Q] < 1 or np.count_nonzero(k < q):
            return "a sequence has seqlen_q < 1 or seqlen_k < seqlen_q"
        if np.count_nonzero(np.add.accumulate(q) != blk[F_CU_Q_INCL]) or \
                np.count_nonzero(np.add.accumulate(k) != blk[F_CU_K_INCL]):
            return "cu_seqlens_q/k_incl are not the prefix sums of seqlen_q/k"
        if blk[F_CU_Q_INCL, -1] != tq or blk[F_CU_K_INCL, -1] != staged.total_k:
            return "prefix sums do not end at total_q / total_k"
        max_k = int(hi[F_SEQLEN_K])
        if int(hi[F_SEQLEN_Q]) != staged.max_seqlen_q or max_k != staged.max_seqlen_k:
            return "max_seqlen_q/k differ from the staged sequences"
        if lo[F_STATE] < 0 or lo[F_PLACEHOLDER] < 0 or hi[F_PLACEHOLDER] > 1:  # flags: 0 or 1 only
            return "negative state id or placeholder flag not 0/1"
        if max_k > cfg.max_model_len:
            return f"seqlen_k {max_k} exceeds max_model_len {cfg.max_model_len}"
        nb = self.blocks_of(k)  # blocks_needed per sequence (k in [1, max_model_len])
        if lo[F_BT_OFFSET] < 0 or np.count_nonzero(blk[F_BT_OFFSET] + nb > off_ngv - (off_ids + tq)):
            return "a block-table offset points outside the block-table section"
        most = int(nb.max())  # blocks_needed is monotone: the longest sequence's
        if most != staged.max_blocks or staged.max_blocks > cfg.max_num_blocks:
            return f"max_blocks {staged.max_blocks} differs from the tables ({most}) or the config"
        return None

    def unpack(self, a: np.ndarray, staged: StagedDecode) -> dict[str, object]:
        """A staged batch read back, independent of where the block tables sit: ``sizes`` (header
        without the section offsets past the tables), ``seq`` (the per-sequence rows without
        ``bt_offset``), ``ids``, ``tables`` (each sequence's defined ids), the Engram sections. Two
        staged batches describe the same batch iff these are equal. For tests and debugging; a
        well-formed buffer is assumed (:meth:`validate`)."""
        hl, n = self.header_len, staged.num_seqs
        hdr = a[:hl].astype(np.int64)
        off_ids, off_bt = int(hdr[H_OFF_IDS]), int(hdr[H_OFF_BT])
        off_ngv, off_ngb = int(hdr[H_OFF_NGV]), int(hdr[H_OFF_NGB])
        seq = a[hl:off_ids].reshape(SEQ_FIELDS, n).astype(np.int64)
        nb = blocks_needed_array(seq[F_SEQLEN_K], self.cfg)
        return {
            "sizes": (hdr[:H_OFF_BT].tolist(), hdr[HEADER_FIXED:].tolist(), staged._replace(used=0)),
            "seq": np.delete(seq, F_BT_OFFSET, axis=0), "ids": a[off_ids:off_bt].copy(),
            "tables": [a[off_bt + int(o):off_bt + int(o) + int(c)].copy() for o, c in zip(seq[F_BT_OFFSET], nb)],
            "ngram": (a[off_ngv:off_ngb].copy(), a[off_ngb:staged.used].copy()),
        }


def _ngram_windows(b: BatchArrays, cfg: MetadataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Engram windows (values, barrier flags), each ``[total_q + n_seq*(G-1)]`` int64.

    Window of sequence s = positions ``[q_start - G + 1, seqlen_k)``. value(t) =
    ``compressed_token_ids[t]`` if ``t < len(compressed)`` else ``lookup[token_at(t)]`` (identity
    without a table); barrier(t) = the token is the image sentinel, or ``t < 0``. Kernel rule:
    column c of row j reads window element ``G-1+j-c`` and is the pad id if any barrier lies in
    ``[G-1+j-c, G-1+j]``. Example: G=3, q_start=1, seqlen_q=1: positions -1, 0, 1, barriers
    ``(1, img(0), img(1))``; column 2 (t=-1) is always pad.
    """
    g, n = cfg.max_ngram_size, b.n_seq
    assert b.comp_len is not None  # extract_batch fills it whenever max_ngram_size > 0 (the caller's g)
    win = b.seqlen_q + (g - 1)
    n_win = int(win.sum())
    seq_of = np.repeat(np.arange(n), win)
    starts = np.cumsum(win) - win
    t = b.q_start[seq_of] - (g - 1) + (np.arange(n_win) - starts[seq_of])
    toks = np.zeros(n_win, dtype=np.int64)
    toks[t >= 0] = b.tok_flat  # the batch's token windows cover exactly positions [max(t, 0), seqlen_k)
    barrier = t < 0
    if cfg.image_token_id is not None:
        barrier |= toks == cfg.image_token_id
    vals, ok = toks, np.ones(n_win, dtype=bool)
    use_c = (t >= 0) & (t - b.tok_lo[seq_of] < b.comp_len[seq_of])
    if cfg.ngram_lookup is not None:
        tab = cfg.ngram_lookup.detach().cpu().to(torch.int64).numpy()
        ok = use_c | ((toks >= 0) & (toks < len(tab)))
        vals = tab[np.where(ok & ~use_c, toks, 0)] if len(tab) else np.zeros_like(toks)
    if use_c.any():
        vals[use_c] = b.comp_flat
    _check_ngram_reads(b, cfg, win, t, barrier, ok, vals)
    return vals, barrier


def _check_ngram_reads(
    b: BatchArrays, cfg: MetadataConfig, win: np.ndarray, t: np.ndarray, barrier: np.ndarray,
    ok: np.ndarray, vals: np.ndarray,
) -> None:
    """``prepare_decode``'s Engram errors: a token read unpadded is outside ``ngram_lookup``, or an
    id does not fit int32. Window element i (position t) is read unpadded iff no barrier lies in
    ``[i, i + max(0, q_start - t)]`` (the first row at or after t)."""
    bad = ~ok | (vals > INT32_MAX) | (vals < -INT32_MAX - 1)
    if not bad.any():
        return
    i = np.arange(len(t))
    last_bar = np.maximum.accumulate(np.where(barrier, i, -1))
    seq_of = np.repeat(np.arange(b.n_seq), win)
    first_reader = i + np.maximum(b.q_start[seq_of] - t, 0)
    read = last_bar[first_reader] < i
    if (~ok & read).any():
        raise ValueError("ngram_lookup: a token id read by ngram_token_ids is outside the table")
    if (bad & read).any():
        raise ValueError("ngram_token_ids: an id does not fit in int32")


def staging_capacity(cfg: MetadataConfig, max_seqs: int, max_total_q: int) -> int:
    """Int32 elements a staging buffer needs for any batch of ``<= max_seqs`` / ``<= max_total_q``
    (:meth:`StagingLayout.capacity`). Example: ``compressed_swa()`` (max_num_blocks 64), 256 seqs, 768
    rows, no Engram: ``11 + 7*256 + 768 + 256*64 = 19,163`` elements (~75 KiB)."""
    return StagingLayout.of(cfg).capacity(max_seqs, max_total_q)


def unpack_staging(a: np.ndarray, staged: StagedDecode, cfg: MetadataConfig) -> dict[str, object]:
    """:meth:`StagingLayout.unpack` of ``cfg``'s layout."""
    return StagingLayout.of(cfg).unpack(a, staged)

