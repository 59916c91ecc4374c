"""Array helpers of the host builders (DESIGN sections 3 and 4) and ``BatchArrays``.

Every builder turns its input into ONE ``BatchArrays`` (per-sequence and per-row int64 numpy
arrays, see :mod:`cpmeta.builders.extract`); everything after that is vectorized numpy over all
sequences / rows at once, with no loop over rows, segments or tokens. Results are written straight
into the output tensors through their ``.numpy()`` views (:func:`alloc`), so no intermediate torch
tensors are created on the hot path.

Row layout: rows are query rows in varlen order. For sequence ``s`` with ``seqlen_q = 3`` and
``seqlen_k = 10`` the rows hold local index ``j = 0, 1, 2`` and absolute positions ``7, 8, 9``
(``q_start = seqlen_k - seqlen_q = 7``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from ..cache import BoundedCache
from ..buffers import HostArena, get_or_create_stacked, get_or_create_tensor
from ..constants import INT32_MAX
from ..int_lists import int_array  # re-exported: the builders read ids with them

__all__ = [
    "BatchArrays",
    "loaded_compressed_len",
    "cdiv",
    "fdiv",
    "fmod",
    "check_int32",
    "alloc",
    "alloc_stacked",
    "AllocOut",
    "int_array",
]

IntLike = TypeVar("IntLike", int, np.ndarray, torch.Tensor)

#: Where :func:`alloc` / :func:`alloc_stacked` put a field: the caller's ``out`` dict (reused and
#: filled), a :class:`~cpmeta.buffers.HostArena` (its views), or ``None`` (a new tensor each).
AllocOut = Union[dict[str, torch.Tensor], HostArena, None]


def loaded_compressed_len(seqlen_k: IntLike, r: int) -> IntLike:
    """Compressed KV rows loaded for a sequence: ``max(1, seqlen_k // r)``.

    The ONE helper behind ``cu_compressed_seqlens_k`` (loaded rows), the ``ks``/``ke`` base and
    the prompt ``kv_ca_index_offset_len`` offset: a sequence shorter than ``r`` still occupies one
    (zero-filled) row, so all three must step by the same amount. Works on ``int``, numpy arrays and
    torch tensors (elementwise). Example: ``seqlen_k = [3, 8, 13]``, ``r = 4`` -> ``[1, 2, 3]``.
    """
    if isinstance(seqlen_k, torch.Tensor):
        return torch.clamp(seqlen_k // r, min=1)
    if isinstance(seqlen_k, np.ndarray):
        return np.maximum(seqlen_k // r, 1)
    return max(1, seqlen_k // r)


def fdiv(x: np.ndarray, d: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Elementwise floor ``x // d``; an arithmetic right shift when ``d`` is a power of two
    (exact for negative ``x`` too, and 2-3x faster than numpy's integer divide).
    Example: ``fdiv(np.array([-1, 7, 8]), 4) -> [-1, 1, 2]``."""
    if d & (d - 1) == 0:
        return np.right_shift(x, d.bit_length() - 1, out=out, casting="unsafe")
    return np.floor_divide(x, d, out=out, casting="unsafe")


def fmod(x: np.ndarray, d: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Elementwise floor modulo ``x % d`` (in ``[0, d)``); a bitwise and when ``d`` is a power of
    two (about 10x faster than numpy's integer remainder). Example: ``fmod(np.array([-1, 9]), 4)
    -> [3, 1]``."""
    if d & (d - 1) == 0:
        return np.bitwise_and(x, d - 1, out=out, casting="unsafe")
    return np.remainder(x, d, out=out, casting="unsafe")


def cdiv(a: IntLike, b: int) -> IntLike:
    """Ceiling division ``-(-a // b)`` (elementwise for arrays). Example: ``cdiv(75, 32) == 3``."""
    return -(-a // b)


def check_int32(what: str, value: int, why: str) -> None:
    """Raise ``ValueError`` if ``value`` (a bound computed BEFORE allocation) exceeds int32.

    ``what`` names the field, ``why`` the config/batch quantities that produce the bound.
    """
    if int(value) > INT32_MAX:
        raise ValueError(
            f"{what}: int32 overflow, {why} = {int(value)} > 2**31 - 1; "
            "reduce the batch, max_model_len or the ids, or raise the compress ratio"
        )


def alloc(
    out: AllocOut, name: str, shape: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray]:
    """``get_or_create_tensor`` plus the tensor's numpy view (same memory) for vectorized fills;
    with a :class:`~cpmeta.buffers.HostArena` as ``out``, the arena's view of that field."""
    if isinstance(out, HostArena):
        got = out.take(name)
        if got is not None:
            return got
        out = None
    t = get_or_create_tensor(out, name, tuple(shape), dtype)
    return t, t.numpy()


def alloc_stacked(
    out: AllocOut, name: str, ratios: Sequence[int], shape: Sequence[int],
) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """``get_or_create_stacked`` for int32 per-ratio rows: ``({"4": row view, ...}, numpy view
    of the whole [len(ratios), *shape] buffer)``. Example: ratios ``(4, 128)``, shape ``(5,)``
    -> a ``[2, 5]`` buffer whose rows are ``md.<name>["4"]`` and ``md.<name>["128"]``."""
    if isinstance(out, HostArena):
        got = out.take_rows(name)
        if got is not None:
            rows, a = got
            return {str(r): t for r, t in zip(ratios, rows)}, a
        out = None
    t, views = get_or_create_stacked(out, name, [str(r) for r in ratios], tuple(shape), torch.int32)
    return views, t.numpy()


#: Rows per sequence from which ``np.repeat`` beats a gather through ``row_seq`` (measured: 8
#: sequences x 4096 rows, repeat ~13 us vs gather ~47 us; 256 x 3 rows, gather 1.5 vs 3 us).
REPEAT_MIN_ROWS = 8


def expand_rows(x: np.ndarray, counts: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """``x[seq]`` where ``seq = repeat(arange(len(x)), counts)``: a repeat when the rows are long
    (few sequences, many rows each: the prompt), else the gather. Same values either way."""
    if len(seq) >= REPEAT_MIN_ROWS * len(x):
        return np.repeat(x, counts)
    return x[seq]


_ARANGE: BoundedCache[int, np.ndarray] = BoundedCache(16)


def arange_ro(n: int) -> np.ndarray:
    """``np.arange(n)`` int64, cached read-only (a prompt step needs arange(total_q) for 32k
    rows: ~20 us to make each time)."""
    a = _ARANGE.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int64)
        a.flags.writeable = False
        _ARANGE.put(n, a)
    return a


@dataclass(slots=True)
class BatchArrays:
    """Per-sequence ([n_seq]) and per-row ([total_q]) int64 numpy arrays of one batch.

    Derived from a :class:`~cpmeta.state.batch.SequenceBatch` (whose token / compressed windows
    it shares without a copy) by :func:`~cpmeta.builders.extract.extract_batch`.

    ``bt_flat`` holds each sequence's first ``bt_need[s]`` block ids (``blocks_needed``) back to
    back, starting at ``bt_start[s]``, plus ONE trailing 0 that masked lookups point at, so a
    gather never needs a bounds branch.
    """

    n_seq: int
    total_q: int
    seqlen_q: np.ndarray  # [n_seq] int64
    seqlen_k: np.ndarray  # [n_seq] int64
    q_start: np.ndarray  # [n_seq] int64, seqlen_k - seqlen_q
    state_id: np.ndarray  # [n_seq] int64
    swa_valid_start: np.ndarray  # [n_seq] int64
    is_placeholder: np.ndarray  # [n_seq] bool
    cu_q: np.ndarray  # [n_seq+1] int64, exclusive prefix sums of seqlen_q
    cu_k: np.ndarray  # [n_seq+1] int64, exclusive prefix sums of seqlen_k
    # the three bt_* below and bt_whole / bt_whole_off are None when extract_batch was called with
    # flat_tables=False for a batch carrying bt2d (prepare_decode reads bt2d only)
    bt_flat: Optional[np.ndarray]  # [sum(bt_need) + 1] int64, needed block ids + a trailing 0
    bt_start: Optional[np.ndarray]  # [n_seq] int64, offset of each table in bt_flat
    bt_need: Optional[np.ndarray]  # [n_seq] int64, blocks_needed(seqlen_k)
    input_ids: np.ndarray  # [total_q] int64
    row_seq: np.ndarray  # [total_q] int64, sequence of each row
    row_j: np.ndarray  # [total_q] int64, local index j
    row_pos: np.ndarray  # [total_q] int64, absolute position q_start + j
    tok_flat: np.ndarray  # [sum window] int64, token window [tok_lo, seqlen_k) of each sequence
    tok_off: np.ndarray  # [n_seq+1] int64, offsets of the windows in tok_flat
    tok_lo: np.ndarray  # [n_seq] int64, first position of each window, max(0, q_start - lookback)
    comp_flat: np.ndarray  # [sum comp_len] int64, Engram compressed ids of positions [tok_lo, tok_lo + comp_len)
    comp_len: Optional[np.ndarray]  # [n_seq] int64; None without Engram (max_ngram_size == 0)
    data_len: np.ndarray  # [n_seq] int64, len(token_ids) (YoCo: the whole prompt)
    bt_whole: Optional[np.ndarray]  # [sum len(block_table)] int64, every WHOLE table back to back (seq_block_tables)
    bt_whole_off: Optional[np.ndarray]  # [n_seq+1] int64, offsets of the whole tables in bt_whole
    is_prompt: bool
    # [n_seq, max_num_blocks] int32: first max_num_blocks ids of each WHOLE table, -1 padded (the
    # flat bt_whole as a 2-D table), when the batch came with one (BatchState decode); else None
    bt2d: Optional[np.ndarray] = None
    # is_placeholder.any(), computed once by extract_batch (True is always safe: the placeholder
    # branches then run and find no placeholder rows)
    any_placeholder: bool = True
    # every input id is known to fit int32 (SequenceBatch._ids_ok): the int32 check skips them
    ids_ok: bool = False

    def per_row(self, x: np.ndarray) -> np.ndarray:
        """``x[row_seq]`` for a per-sequence array; ``x`` itself (not a copy: do not modify it)
        when every sequence has exactly one row, the common decode case."""
        return x if self.total_q == self.n_seq else expand_rows(x, self.seqlen_q, self.row_seq)
