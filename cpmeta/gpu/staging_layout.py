"""Staging layout of the in-place decode path: per-sequence arrays in ONE int32 buffer.

(The buffer object that owns it, uploads it and orders it with graph replays is
:class:`cpmeta.gpu.decode_staging.DecodeStaging`.)

The CPU side of :func:`cpmeta.prepare_decode_inplace` does O(n_seq) Python work (plus copying the
raw token / block ids it must read anyway): the builders' ``extract_batch`` (same validation and
messages as ``prepare_decode``) gives per-sequence numpy arrays, which are written through a numpy
view into one pinned int32 buffer; ONE non-blocking host-to-device copy of the used prefix
follows. The kernels (or the CPU emulation) derive every per-row value from that buffer.

Engram choice: the CPU stages one look-back WINDOW per sequence (value and barrier flag of each
position ``[q_start - G + 1, seqlen_k)``, O(total_q + n_seq * G)), the kernel expands it to the
``[total_q, G]`` rows with a running OR of the barriers (O(total_q * G) on the device).

Layout (int32 elements, every section contiguous, offsets stored in the header so the kernels
need no host scalars -- a captured CUDA graph replays with a new batch)::

    [0 .. HEADER_FIXED)        n_seq, total_q, total_k, off_seq, off_ids, off_bt, off_ngv, off_ngb
    [HEADER_FIXED .. +R)       ratios: ca_ratios, then sparse ratios, then dense ratios
    off_seq: [SEQ_FIELDS, n_seq] rows seqlen_q, seqlen_k, cu_seqlens_q_incl, cu_seqlens_k_incl,
                                      state_id, is_placeholder, bt_offset
    off_ids: [total_q]           input id of every row (token_ids[-1], then the drafts)
    off_bt:  [sum nb_s]          flat block tables: the nb_s = cdiv(seqlen_k // m, b_m) defined
                                 blocks of sequence s at off_bt + bt_offset[s] (m = min ratio,
                                 b_m = block_size // m); write_staging packs them back to back,
                                 stage_decode (from a BatchState) puts them at a fixed stride of
                                 max_num_blocks (the section is then n_seq * max_num_blocks long)
    off_ngv: [total_q + n_seq*(G-1)]  Engram source value of every window position (G = max_ngram_size)
    off_ngb: [total_q + n_seq*(G-1)]  1 where the window position is a barrier (image token or t < 0)

``cu_seqlens_q_incl`` is the INCLUSIVE prefix sum (length n_seq, no leading 0): the sequence's
last row + 1, so its first row is ``cu_seqlens_q_incl[s] - seqlen_q[s]``.

Worked example: two sequences ``seqlen_q = (1, 3)``, ``seqlen_k = (5, 9)``, ``block_size=4``,
ratios ``(4,)`` (so m=4, b_m=1): ``cu_seqlens_q_incl = (1, 4)``, ``cu_seqlens_k_incl = (5, 14)``,
``nb = (cdiv(1, 1), cdiv(2, 1)) = (1, 2)``, ``bt_offset = (0, 1)``; sequence 1 owns rows 1..3 at
positions 6, 7, 8. With G=2 its Engram window covers positions 5..8 and starts at element
``row0 + s*(G-1) = 1 + 1 = 2`` of the ngram sections.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

from ..builders.arrays import BatchArrays, check_int32
from ..builders.common import check_common_int32
from ..builders.extract import BatchInput, extract_batch
from ..config import MetadataConfig, blocks_needed_array
from ..constants import INT32_MAX

__all__ = [
    "HEADER_FIXED",
    "SEQ_FIELDS",
    "H_N_SEQ", "H_TOTAL_Q", "H_TOTAL_K", "H_OFF_SEQ", "H_OFF_IDS", "H_OFF_BT", "H_OFF_NGV", "H_OFF_NGB",
    "F_SEQLEN_Q", "F_SEQLEN_K", "F_CU_Q_INCL", "F_CU_K_INCL", "F_STATE", "F_PLACEHOLDER", "F_BT_OFFSET",
    "StagedDecode",
    "OutCapacity",
    "DecodeBuffers",
    "staging_capacity",
    "fill_staging",
    "write_staging",
    "check_staging_int32",
    "header_len",
    "unpack_staging",
]

logger = logging.getLogger(__name__)

# header slots
H_N_SEQ, H_TOTAL_Q, H_TOTAL_K, H_OFF_SEQ, H_OFF_IDS, H_OFF_BT, H_OFF_NGV, H_OFF_NGB = range(8)
HEADER_FIXED = 8
# rows of the per-sequence block
F_SEQLEN_Q, F_SEQLEN_K, F_CU_Q_INCL, F_CU_K_INCL, F_STATE, F_PLACEHOLDER, F_BT_OFFSET = range(7)
SEQ_FIELDS = 7

#: Extra elements reserved when the staging buffer grows (amortises regrowth).
_GROWTH = 1.5

class StagedDecode(NamedTuple):
    """Host-side scalars of one staged batch (the buffer itself holds the arrays).

    ``used`` is the number of int32 elements of the staging buffer this batch occupies. A named
    tuple (immutable; made once per step on the hot path: ~4x cheaper to build than a frozen
    dataclass).
    """

    num_seqs: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    used: int
    max_blocks: int = 0  # block-table columns the widest sequence defines (max nb_s)


@dataclass(frozen=True, slots=True)
class OutCapacity:
    """What the device buffers fed from one staging buffer can hold (DESIGN section 12, capacity).

    ``q_cap`` rows, ``seq_cap`` sequences (``cu_seqlens_*`` hold ``seq_cap + 1``) and
    ``bt_cols`` block-table columns. A batch needing more of any is refused with a ``ValueError``
    naming the limit before anything reaches the device. Example: buffers captured for 4
    single-row sequences give ``OutCapacity(4, 4, 64)``; staging 8 sequences fails with
    ``"num_seqs: 8 sequences exceed the captured buffers' seq_cap=4"``.
    """

    q_cap: int
    seq_cap: int
    bt_cols: int

    def check(self, staged: StagedDecode) -> None:
        """``ValueError`` naming the first limit ``staged`` exceeds (rows, sequences, columns)."""
        if staged.total_q > self.q_cap:
            raise ValueError(f"total_q: {staged.total_q} rows exceed the captured buffers' q_cap={self.q_cap}")
        if staged.num_seqs > self.seq_cap:
            raise ValueError(
                f"num_seqs: {staged.num_seqs} sequences exceed the captured buffers' seq_cap={self.seq_cap}")
        if staged.max_blocks > self.bt_cols:
            raise ValueError(
                f"block_tables: {staged.max_blocks} columns exceed the captured buffers' "
                f"bt_cols={self.bt_cols} (a different max_model_len?)")


@dataclass(slots=True)
class DecodeBuffers:
    """Full-capacity output tensors the kernels write (``q_cap`` rows, ``seq_cap`` sequences).

    Rows ``[total_q, q_cap)`` and ``cu_seqlens_*[n_seq+1 : seq_cap+1]`` are the TAIL: the
    kernels fill it with inert values (positions 0, input id 0, ngram pad, not valid, query index
    998244353, every slot -1, lengths 0, offsets 0; ``cu_seqlens_q/k`` repeat ``total_q/total_k``)
    so a graph captured at a larger batch never writes KV or reads keys for padded rows.
    ``block_tables`` tail rows are left untouched (their lengths are 0, nothing reads them).
    Stacked fields are ``[n_ratio, q_cap, ...]`` (ca / sparse / dense ratios in config order).
    The fields of a feature the config switches off are ``None`` and never written (DESIGN 14):
    the sliding-window ones with ``window_size == 0``, the stacked ones without compressed KV.
    """

    positions: torch.Tensor  # [q_cap] int32
    input_ids: torch.Tensor  # [q_cap] int32
    gate_force_random: torch.Tensor  # [q_cap] bool
    ngram_token_ids: Optional[torch.Tensor]  # [q_cap, G] int32, None when G == 0
    cu_seqlens_q: torch.Tensor  # [seq_cap+1] int32
    cu_seqlens_k: torch.Tensor  # [seq_cap+1] int32
    valid_token_mask: torch.Tensor  # [q_cap] bool
    query_indices: torch.Tensor  # [q_cap] int32
    slot_mapping_store_swa: Optional[torch.Tensor]  # [q_cap] int32 (None: no sliding window)
    state_block_idx: Optional[torch.Tensor]  # [q_cap] int32 (None: no sliding window)
    context_lens: torch.Tensor  # [q_cap] int32
    kv_swa_index_offset_len: Optional[torch.Tensor]  # [q_cap, 2] int32 (None: no sliding window)
    block_tables: torch.Tensor  # [q_cap, max_num_blocks] int32
    positions_c: Optional[torch.Tensor]  # [n_ca, q_cap] int32 (None: no compressed KV, as below)
    slot_mapping_store_ca: Optional[torch.Tensor]  # [n_ca, q_cap] int32
    klen: Optional[torch.Tensor]  # [n_sparse, q_cap] int32
    kv_ca_index_offset_len: Optional[torch.Tensor]  # [n_dense, q_cap, 2] int32

    @property
    def q_cap(self) -> int:
        return self.positions.shape[0]

    @property
    def seq_cap(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def header_len(cfg: MetadataConfig) -> int:
    return HEADER_FIXED + len(cfg.ca_ratios) + len(cfg.sparse_compress_ratios) + len(cfg.dense_compress_ratios)


def unpack_staging(a: np.ndarray, staged: StagedDecode, cfg: MetadataConfig) -> dict[str, object]:
    """A staged batch read back from the int32 buffer ``a``, independent of where the block tables
    sit: ``sizes`` (header without the section offsets past the tables), ``seq`` (the
    ``[SEQ_FIELDS - 1, n]`` per-sequence rows without ``bt_offset``), ``ids``, ``tables`` (each
    sequence's defined ``nb_s`` block ids) and the Engram sections. Two staged batches describe the
    same batch iff these are equal (``write_staging`` packs the tables, ``stage_decode`` strides
    them). For tests and debugging; a well-formed buffer is assumed (``check_staged_layout``)."""
    hl, n = header_len(cfg), staged.num_seqs
    hdr = a[:hl].astype(np.int64)
    off_ids, off_bt, off_ngv, off_ngb = int(hdr[H_OFF_IDS]), int(hdr[H_OFF_BT]), int(hdr[H_OFF_NGV]), int(hdr[H_OFF_NGB])
    seq = a[hl:off_ids].reshape(SEQ_FIELDS, n).astype(np.int64)
    nb = blocks_needed_array(seq[F_SEQLEN_K], cfg)
    return {
        "sizes": (hdr[:H_OFF_BT].tolist(), hdr[HEADER_FIXED:].tolist(), staged._replace(used=0)),
        "seq": np.delete(seq, F_BT_OFFSET, axis=0), "ids": a[off_ids:off_bt].copy(),
        "tables": [a[off_bt + int(o):off_bt + int(o) + int(k)].copy() for o, k in zip(seq[F_BT_OFFSET], nb)],
        "ngram": (a[off_ngv:off_ngb].copy(), a[off_ngb:staged.used].copy()),
    }


def staging_capacity(cfg: MetadataConfig, max_seqs: int, max_total_q: int) -> int:
    """Int32 elements a staging buffer needs for any batch of ``<= max_seqs`` / ``<= max_total_q``.

    Example: default config (max_num_blocks 64), 256 seqs, 768 rows, no Engram:
    ``8 + 3 + 7*256 + 768 + 256*64 = 19,163`` elements (~75 KiB).
    """
    g = cfg.max_ngram_size
    ngram = 2 * (max_total_q + max_seqs * max(g - 1, 0)) if g else 0
    return header_len(cfg) + SEQ_FIELDS * max_seqs + max_total_q + max_seqs * cfg.max_num_blocks + ngram


def check_staging_int32(b: BatchArrays, cfg: MetadataConfig) -> None:
    """The builders' overflow checks (same messages as ``prepare_decode``), before any write.

    Bounds: ``check_common_int32`` (``sum(seqlen_k)``, SWA / compressed slot values, token ids)
    and DESIGN section 3's decode bound ``total_q * max_num_blocks * (block_size // min(dense))``.
    Example: block_size 128, dense (1,), max_model_len 2**20: 8192 * 128 = 2**20 per row, so
    ``total_q <= 2047``.
    """
    check_common_int32(b, cfg)
    if cfg.dense_compress_ratios:
        mnb, md = cfg.max_num_blocks, min(cfg.dense_compress_ratios)
        check_int32(
            "kv_ca_index_offset_len", b.total_q * mnb * (cfg.block_size // md),
            f"total_q ({b.total_q}) * max_num_blocks ({mnb}, from max_model_len={cfg.max_model_len})"
            f" * (block_size // min(dense_compress_ratios)) ({cfg.block_size}//{md})",
        )


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


def fill_staging(
    view: np.ndarray, seqs: BatchInput, cfg: MetadataConfig
) -> StagedDecode:
    """Validate ``seqs`` and write them into ``view`` (an int32 numpy view of the staging buffer).

    Extraction and validation are the builders' (``extract_batch``: ``validate_batch`` semantics
    and messages; ``check_common_int32`` + the decode bound). Raises ``ValueError`` naming the
    field for bad input, ``BufferError(needed_elements)`` if ``view`` is too small (nothing is
    written then; the caller grows the buffer and retries). Returns the host-side scalars.
    """
    b = extract_batch(seqs, cfg, is_prompt=False)
    check_staging_int32(b, cfg)
    return write_staging(view, b, cfg)


def write_staging(view: np.ndarray, b: BatchArrays, cfg: MetadataConfig) -> StagedDecode:
    """Write already extracted and validated per-sequence arrays ``b`` into ``view`` (numpy only).

    Split from :func:`fill_staging` so the cost of reading ``SequenceMetadata`` objects (which
    dominates the host time) and the cost of the staging itself can be measured apart.
    """
    n, total_q = b.n_seq, b.total_q
    bt_flat, bt_start, bt_need = b.bt_flat, b.bt_start, b.bt_need
    # staging reads the flat tables: extract_batch's default (flat_tables=True) fills them
    assert bt_flat is not None and bt_start is not None and bt_need is not None
    total_b = len(bt_flat) - 1
    g = cfg.max_ngram_size
    n_win = (total_q + n * (g - 1)) if g else 0
    hl = header_len(cfg)
    off_ids = hl + SEQ_FIELDS * n
    off_bt = off_ids + total_q
    off_ngv = off_bt + total_b
    off_ngb = off_ngv + n_win
    used = off_ngb + n_win
    if used > view.shape[0]:
        raise BufferError(used)
    ng = _ngram_windows(b, cfg) if g else None
    view[:HEADER_FIXED] = (n, total_q, int(b.cu_k[-1]), hl, off_ids, off_bt, off_ngv, off_ngb)
    view[HEADER_FIXED:hl] = cfg.ca_ratios + cfg.sparse_compress_ratios + cfg.dense_compress_ratios
    blk = view[hl:off_ids].reshape(SEQ_FIELDS, n)
    blk[F_SEQLEN_Q], blk[F_SEQLEN_K] = b.seqlen_q, b.seqlen_k
    blk[F_CU_Q_INCL], blk[F_CU_K_INCL] = b.cu_q[1:], b.cu_k[1:]
    blk[F_STATE], blk[F_PLACEHOLDER], blk[F_BT_OFFSET] = b.state_id, b.is_placeholder, bt_start
    view[off_ids:off_bt] = b.input_ids
    view[off_bt:off_ngv] = bt_flat[:total_b]
    if ng is not None:
        view[off_ngv:off_ngb], view[off_ngb:used] = ng
    max_blocks = int(bt_need.max()) if n else 0
    return StagedDecode(n, total_q, int(b.cu_k[-1]), int(b.seqlen_q.max()), int(b.seqlen_k.max()), used,
                        max_blocks)
