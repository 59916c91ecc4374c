"""The staging layout of the in-place decode path, defined once: :class:`StagingLayout`.

Per-sequence arrays of one decode step live in ONE int32 buffer (owned, uploaded and ordered with
graph replays by :class:`cpmeta.gpu.decode_staging.DecodeStaging`); the kernels (or their CPU
emulation) derive every per-row value from it. The layout object of a config writes it from a
validated ``SequenceBatch`` (:meth:`StagingLayout.write_batch`) or straight from a ``BatchState``
(:meth:`StagingLayout.write_state`), each ONE compiled call (:mod:`cpmeta.gpu.staging_njit`),
validates a received one (:meth:`StagingLayout.validate`, every CP follower, every step) and reads
one back (:meth:`StagingLayout.unpack`). Offsets are stored in the header so the kernels need no host
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

from ..builders.common_njit import NO_TABLE, ngram_table
from ..builders.decode import raise_decode_error
from ..cache import IdentityCache
from ..config import MetadataConfig, blocks_needed_array
from ..fields import CA, DENSE, RATIO_ORDER, SPARSE
from ..jit import OK
from .staging_header import (
    F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, H_N_SEQ, H_OFF_BT,
    H_OFF_IDS, H_OFF_NGB, H_OFF_NGV, H_OFF_SEQ, H_TOTAL_K, H_TOTAL_Q, HEADER_FIXED, SEQ_FIELDS, StagedDecode,
)
from .decode_buffers import OutCapacity
from .staging_njit import (
    E_CAPACITY, E_FALLBACK, E_VIEW_SMALL, NO_LIMIT, REPORT_LEN, layout_words, stage_batch, stage_state,
)

#: the longest ``max_model_len`` for which :meth:`StagingLayout.blocks_of` gathers from a table
#: of every length (2**21 + 1 int64: 16 MiB)
NEED_TABLE_MAX = 1 << 21

if TYPE_CHECKING:
    from ..state.batch import SequenceBatch
    from ..state.batch_state import BatchState, VouchedStep

__all__ = [
    "HEADER_FIXED", "SEQ_FIELDS",
    "H_N_SEQ", "H_TOTAL_Q", "H_TOTAL_K", "H_OFF_SEQ", "H_OFF_IDS", "H_OFF_BT", "H_OFF_NGV", "H_OFF_NGB",
    "F_SEQLEN_Q", "F_SEQLEN_K", "F_CU_Q_INCL", "F_CU_K_INCL", "F_STATE", "F_PLACEHOLDER", "F_BT_OFFSET",
    "StagedDecode", "StagingLayout", "staging_capacity", "unpack_staging",
]

# the kernels (decode_triton, decode_emulate) read the ratio words in this order
assert RATIO_ORDER == (CA, SPARSE, DENSE), RATIO_ORDER

#: The batch arrays' dtype the writer is compiled for (others are converted).
_I64 = np.dtype(np.int64)
#: ``report[_SCALARS:]``: the staged scalars (:data:`~cpmeta.gpu.staging_njit.REPORT_LEN`).
_SCALARS = 4
#: No draft ids / one draft count for all (:meth:`StagingLayout.write_state`; never written).
_NO_IDS = np.zeros(0, np.int64)


_LAYOUTS: IdentityCache[MetadataConfig, "StagingLayout"] = IdentityCache(16)


class StagingLayout:
    """The staging layout of one config (see the module docstring); :meth:`of` caches it per config.

    ``header_len``: ``HEADER_FIXED`` + every ratio; ``ratios``: the ratio words (int32, read-only);
    ``consts``: the config as the compiled writers read it (:func:`~cpmeta.gpu.staging_njit.staging_consts`).
    Example: ``MetadataConfig.compressed_swa()`` -> ``header_len == 11``, ``ratios == [4, 4, 4]``.
    """

    __slots__ = ("cfg", "header_len", "ratios", "ratio_counts", "consts", "_need")

    def __init__(self, cfg: MetadataConfig) -> None:
        self.cfg = cfg
        # the header length, the ratio words (int32, read-only) and what the compiled writers read
        self.header_len, self.ratios, self.consts = layout_words(cfg)
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

    # ---- writers: one compiled call each (cpmeta.gpu.staging_njit) ------------------------------
    def write_batch(self, view: np.ndarray, sb: "SequenceBatch", report: Optional[np.ndarray] = None) -> StagedDecode:
        """Write a decode ``SequenceBatch`` validated for this config (``as_sequence_batch``'s)
        into ``view``: tables packed back to back, the Engram windows with ``max_ngram_size >
        0``; ONE :func:`~cpmeta.gpu.staging_njit.stage_batch` call. ``prepare_decode``'s errors
        (a needed block id out of range naming ``seqs[i].block_table``, ``sum(seqlen_k)``, the
        ``kv_ca_index_offset_len`` offsets, an Engram word outside ``ngram_lookup`` or int32) as
        its ``ValueError``; ``BufferError(needed_elements)`` if ``view`` is too small (nothing
        written: the owner grows its buffer and retries). ``report``: the caller's
        ``int64[REPORT_LEN]`` scratch (a new one when None)."""
        rep = np.zeros(REPORT_LEN, np.int64) if report is None else report
        cfg = self.cfg
        tab = ngram_table(cfg) if cfg.max_ngram_size else NO_TABLE
        code = stage_batch(*[a if a.dtype == _I64 else a.astype(np.int64) for a in (  # type: ignore[call-arg]
            sb.seqlen_q, sb.seqlen_k, sb.state_id)], sb.is_placeholder, *[
            a if a.dtype == _I64 else a.astype(np.int64) for a in (
                sb.tokens, sb.token_offsets, sb.compressed, sb.compressed_offsets, sb.block_tables,
                sb.block_table_offsets)], self.consts, self.ratios, tab, view, rep)
        if code:
            self._raise(code, rep)
        return StagedDecode._make(rep.tolist()[_SCALARS:])

    def write_state(self, view: np.ndarray, st: "BatchState", step: "VouchedStep", n_ph: int,
                    cap: Optional[OutCapacity], report: np.ndarray) -> Optional[StagedDecode]:
        """Write a step ``st`` vouched for (``BatchState.vouch_decode``) and ``n_ph`` placeholders
        into ``view`` straight from the state's arrays (``token_ids``, ``block_table``,
        ``num_blocks``, ``state_id``): tables at a fixed stride of ``max_num_blocks``;
        ONE :func:`~cpmeta.gpu.staging_njit.stage_state` call. ``None`` when an int32 bound fails
        (``sum(seqlen_k)``, the decode offsets, the section offsets: the caller falls back to the
        general path and its messages); ``cap``'s ``ValueError`` for a step it cannot hold and
        ``BufferError(needed_elements)`` for a short ``view``, both before anything is written."""
        d, nd = step.drafts, step.nd  # nd: one count per request only when they differ
        code = stage_state(_plain(step.slots), step.nt, step.sk, _NO_IDS if d is None else _plain(d),
                           _NO_IDS if step.uniform or nd is None else nd,
                           step.k_hi, n_ph, st.token_ids, st.block_table, st.num_blocks, st.state_id, self.consts,
                           self.ratios, *((NO_LIMIT,) * 3 if cap is None else (cap.q_cap, cap.seq_cap, cap.bt_cols)),
                           view, report)
        if code == OK:
            return StagedDecode._make(report.tolist()[_SCALARS:])
        if code == E_FALLBACK:
            return None
        if code == E_CAPACITY:
            assert cap is not None  # no limit without one
            cap.check(StagedDecode._make(report.tolist()[_SCALARS:]))
        self._raise(code, report)
        return None  # pragma: no cover  (_raise raises)

    def _raise(self, code: int, report: np.ndarray) -> None:
        """The error of a writer's code: ``BufferError(used)`` for a short view, else the decode
        build's ``ValueError`` (:func:`cpmeta.builders.decode.raise_decode_error`)."""
        if code == E_VIEW_SMALL:
            raise BufferError(int(report[2]))
        raise_decode_error(report[:4], self.cfg)

    # ---- readers ---------------------------------------------------------------------------------
    def validate(self, a: np.ndarray, staged: StagedDecode) -> Optional[str]:
        """Why the int32 staging prefix ``a`` is not a well-formed batch for this config (None when
        it is). Every address the kernels derive is checked; values are not.

        Example (dense and sparse ratios (4,), no Engram, ``block_size 4``, two sequences
        ``seqlen_q = (1, 3)``, ``seqlen_k = (5, 9)``): header length 8 + 3 = 11, ``off_ids = 11 +
        7*2 = 25``, ``off_bt = 25 + 4 = 29``, ``nb = (1, 2)`` so ``off_ngv = off_ngb = used = 32``.
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


def _plain(a: np.ndarray) -> np.ndarray:
    """``a`` when C-contiguous and writable (the one array type the writers are compiled for,
    int32 or int64), else a copy that is: a caller's strided or read-only ids cost a copy, not a
    compilation."""
    return a if a.flags.c_contiguous and a.flags.writeable else a.copy()


def staging_capacity(cfg: MetadataConfig, max_seqs: int, max_total_q: int) -> int:
    """Int32 elements a staging buffer needs for any batch of ``<= max_seqs`` / ``<= max_total_q``
    (:meth:`StagingLayout.capacity`). Example: ``compressed_swa()`` (max_num_blocks 64), 256 seqs, 768
    rows, no Engram: ``11 + 7*256 + 768 + 256*64 = 19,163`` elements (~75 KiB)."""
    return StagingLayout.of(cfg).capacity(max_seqs, max_total_q)


def unpack_staging(a: np.ndarray, staged: StagedDecode, cfg: MetadataConfig) -> dict[str, object]:
    """:meth:`StagingLayout.unpack` of ``cfg``'s layout."""
    return StagingLayout.of(cfg).unpack(a, staged)

