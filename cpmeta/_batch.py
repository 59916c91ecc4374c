"""Per-sequence array extraction and the fields both builders share (DESIGN sections 3 and 4).

The builders do ONE Python pass over the ``SequenceMetadata`` objects (a handful of
``map(attrgetter)`` list extractions; token ids and block tables are read list by list with
``array.array("q").fromlist``, a C loop); everything after that is vectorized numpy over all
sequences / rows at once, with no loop over rows, segments or tokens. Results are
written straight into the output tensors through their ``.numpy()`` views, so no intermediate torch
tensors are created on the hot path.

Row layout: rows are query rows in varlen order. For sequence ``s`` with ``seqlen_q = 3`` and
``seqlen_k = 10`` the rows hold local index ``j = 0, 1, 2`` and absolute positions ``7, 8, 9``
(``q_start = seqlen_k - seqlen_q = 7``).
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Optional, Sequence, TypeVar

import numpy as np
import torch

from .config import MetadataConfig
from .constants import INT32_MAX, PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from .metadata import get_or_create_tensor
from .sequence import SequenceMetadata, validate_batch

__all__ = [
    "BatchArrays",
    "extract_batch",
    "loaded_compressed_len",
    "cdiv",
    "fdiv",
    "fmod",
    "check_int32",
    "alloc",
    "fill_common",
    "int_array",
    "check_common_int32",
    "compressed_slots",
]

logger = logging.getLogger(__name__)

_SQ = attrgetter("seqlen_q")
_SK = attrgetter("seqlen_k")
_STATE = attrgetter("state_id")
_SVS = attrgetter("swa_valid_start")
_PH = attrgetter("is_placeholder")
_TOK = attrgetter("token_ids")
_DRAFT = attrgetter("draft_tokens")
_BT = attrgetter("block_table")

_LIST_TYPES = frozenset((list, tuple, range))

IntLike = TypeVar("IntLike", int, np.ndarray, torch.Tensor)


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
    out: Optional[dict[str, torch.Tensor]], name: str, shape: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray]:
    """``get_or_create_tensor`` plus the tensor's numpy view (same memory) for vectorized fills."""
    t = get_or_create_tensor(out, name, tuple(shape), dtype)
    return t, t.numpy()


def int_array(parts: Sequence[Any], total: int, field: Any = "seqs[i] ids") -> np.ndarray:
    """Concatenate int sequences (lists, tuples, numpy arrays or tensors) into one int64 array.

    Python lists go through ``array.array("q").fromlist`` (one C loop per list, about twice as
    fast as ``np.fromiter`` over ``itertools.chain``); other sequences through ``np.fromiter``;
    ``np.concatenate`` / ``torch.cat`` when every part already is an array / tensor.
    ``total`` is the expected length (checked). An id that is not an int within int64 is a
    ``ValueError`` naming ``field`` (``"seqs[i].token_ids"``: ``i`` becomes the offending part's
    index; or a callable mapping that index to the name).
    """
    try:
        return _int_array(parts, total)
    except (OverflowError, TypeError, ValueError) as e:
        bad = _first_bad(parts)
        if callable(field):
            where = field(bad) if bad is not None else "seqs"
        else:
            where = field.replace("[i]", f"[{bad}]") if bad is not None else field
        raise ValueError(f"{where}: expected ints within int64 ({type(e).__name__}: {e})") from None


def _first_bad(parts: Sequence[Any]) -> Optional[int]:
    """Index of the first part that does not convert on its own (error paths only)."""
    return next((i for i, p in enumerate(parts) if not _fits_int64(p)), None)


def _fits_int64(part: Any) -> bool:
    """Whether ``part`` alone converts (the same conversion that just failed for the batch)."""
    try:
        _int_array([part], len(part))
        return True
    except (OverflowError, TypeError, ValueError, AssertionError):
        return False


def _int_array(parts: Sequence[Any], total: int) -> np.ndarray:
    kinds = set(map(type, parts))
    if kinds == {list}:
        buf = array.array("q")
        for _ in map(buf.fromlist, parts):  # per-sequence loop inside map, C per token
            pass
        res = np.frombuffer(buf, np.int64) if len(buf) else np.zeros(0, np.int64)
    elif kinds <= _LIST_TYPES:
        res = np.fromiter(chain.from_iterable(parts), np.int64, total)
    elif kinds == {np.ndarray}:
        res = np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)
    elif kinds == {torch.Tensor}:
        res = torch.cat([p.reshape(-1) for p in parts]).to(torch.int64).numpy()
    else:
        res = np.fromiter((int(x) for x in chain.from_iterable(parts)), np.int64, total)
    assert len(res) == total, f"int_array: expected {total} ids, got {len(res)}"
    return res


@dataclass(slots=True)
class BatchArrays:
    """Per-sequence ([n_seq]) and per-row ([total_q]) int64 numpy arrays of one batch.

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
    bt_flat: np.ndarray  # [sum(bt_need) + 1] int64, needed block ids + a trailing 0
    bt_start: np.ndarray  # [n_seq] int64, offset of each table in bt_flat
    bt_need: np.ndarray  # [n_seq] int64, blocks_needed(seqlen_k)
    input_ids: np.ndarray  # [total_q] int64
    row_seq: np.ndarray  # [total_q] int64, sequence of each row
    row_j: np.ndarray  # [total_q] int64, local index j
    row_pos: np.ndarray  # [total_q] int64, absolute position q_start + j
    seqs: Sequence[SequenceMetadata]  # the input (for Engram token windows)
    is_prompt: bool

    def per_row(self, x: np.ndarray) -> np.ndarray:
        """``x[row_seq]`` for a per-sequence array; ``x`` itself (not a copy: do not modify it)
        when every sequence has exactly one row, the common decode case."""
        return x if self.total_q == self.n_seq else x[self.row_seq]


def _fast_checks_ok(
    cfg: MetadataConfig, is_prompt: bool, ints: np.ndarray, n_tok: np.ndarray,
    n_draft: Optional[np.ndarray], n_bt: np.ndarray, need: np.ndarray,
) -> bool:
    """Vectorized ``validate_batch`` checks on ``ints = [seqlen_q, seqlen_k, state_id,
    swa_valid_start]`` ([4, n_seq]); ``n_draft=None`` means "every sequence has no drafts".
    False sends the caller to ``validate_batch`` for the precise error."""
    sq, sk = ints[0], ints[1]
    ok = (sq >= 1) & (sq <= sk) & (sk <= cfg.max_model_len) & (n_bt >= need)
    ok &= (ints[2:] >= 0).all(axis=0)
    if is_prompt:
        ok &= n_tok >= sk
        ok &= n_draft is None
    else:
        ok &= n_tok == sk - sq + 1
        ok &= (sq == 1) if n_draft is None else (n_draft == sq - 1)
    return bool(ok.all())


def _blocks_needed(sk: np.ndarray, cfg: MetadataConfig) -> np.ndarray:
    """Vectorized ``sequence.blocks_needed``: ``max_n cdiv(seqlen_k // n, block_size // n)``."""
    need = None
    for n in cfg.ca_ratios:
        x = cdiv(sk // n, cfg.block_size // n)
        need = x if need is None else np.maximum(need, x)
    return need


def _row_arrays(n: int, total_q: int, sq: np.ndarray, cu_q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``row_seq`` and ``row_j`` ([total_q] int64); one row per sequence is the common decode case."""
    if total_q == n:
        return np.arange(n, dtype=np.int64), np.zeros(n, np.int64)
    row_seq = np.repeat(np.arange(n, dtype=np.int64), sq)
    return row_seq, np.arange(total_q, dtype=np.int64) - cu_q[row_seq]


def _input_ids(
    is_prompt: bool, toks: list, drafts: list, q_start: np.ndarray, sk_l: list, n: int, total_q: int
) -> np.ndarray:
    """Prompt: ``token_ids[q_start:seqlen_k]``; decode: ``token_ids[-1]`` then ``draft_tokens``."""
    if is_prompt:
        return int_array(list(map(_slice, toks, q_start.tolist(), sk_l)), total_q, "seqs[i].token_ids")
    if total_q == n:
        return int_array([[t[-1] for t in toks]], n,  # one part: one C loop for the batch
                         lambda _: f"seqs[{_first_bad([[t[-1]] for t in toks])}].token_ids")
    return int_array([x for t, d in zip(toks, drafts) for x in ((t[-1],), d)], total_q,
                     lambda k: f"seqs[{k // 2}].{'draft_tokens' if k % 2 else 'token_ids'}")


def extract_batch(
    seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: bool
) -> BatchArrays:
    """Validate ``seqs`` (same errors as ``validate_batch``) and extract every array the builders use.

    The checks of ``validate_batch`` run vectorized first; only when one fails (or an input is not
    a plain ``int``) is ``validate_batch`` itself called, so the error message comes from the one
    place that defines it. Example: 2 decode sequences ``(seqlen_q, seqlen_k) = (1, 5), (3, 9)``
    give ``cu_q = [0, 1, 4]``, ``row_seq = [0, 1, 1, 1]``, ``row_j = [0, 0, 1, 2]``,
    ``row_pos = [4, 6, 7, 8]``.
    """
    if (
        isinstance(seqs, SequenceMetadata) or not isinstance(seqs, Sequence) or len(seqs) == 0
        or set(map(type, seqs)) != {SequenceMetadata}
    ):
        validate_batch(seqs, cfg, is_prompt=is_prompt)
    n = len(seqs)
    cols = [list(map(g, seqs)) for g in (_SQ, _SK, _STATE, _SVS)]
    plain = {*map(type, cols[0]), *map(type, cols[1]), *map(type, cols[2]), *map(type, cols[3])}
    flags = list(map(_PH, seqs))
    if set(map(type, flags)) != {bool}:
        validate_batch(seqs, cfg, is_prompt=is_prompt)  # names the sequence with a non-bool flag
    toks, drafts, tables = list(map(_TOK, seqs)), list(map(_DRAFT, seqs)), list(map(_BT, seqs))
    n_tok = np.fromiter(map(len, toks), np.int64, n)
    n_draft = np.fromiter(map(len, drafts), np.int64, n) if any(map(len, drafts)) else None
    n_bt = np.fromiter(map(len, tables), np.int64, n)
    ints = _int_columns(cols) if plain == {int} else None
    need = _blocks_needed(ints[1], cfg) if ints is not None else None
    if ints is None or not _fast_checks_ok(cfg, is_prompt, ints, n_tok, n_draft, n_bt, need):
        validate_batch(seqs, cfg, is_prompt=is_prompt)
        ints = _int_columns([[int(x) for x in c] for c in cols])
        if ints is None:
            raise ValueError("seqs: seqlen_q/seqlen_k/state_id/swa_valid_start must fit in int64")
        need = _blocks_needed(ints[1], cfg)
    sq, sk = ints[0], ints[1]
    cu = np.zeros((2, n + 1), np.int64)
    np.cumsum(ints[:2], axis=1, out=cu[:, 1:])
    total_q = int(cu[0, -1])
    q_start = sk - sq
    bt_flat, bt_start = _flat_tables(tables, n_bt, need)
    row_seq, row_j = _row_arrays(n, total_q, sq, cu[0])
    return BatchArrays(
        n_seq=n, total_q=total_q, seqlen_q=sq, seqlen_k=sk, q_start=q_start,
        state_id=ints[2], swa_valid_start=ints[3],
        is_placeholder=np.fromiter(flags, bool, n), cu_q=cu[0], cu_k=cu[1],
        bt_flat=bt_flat, bt_start=bt_start, bt_need=need,
        input_ids=_input_ids(is_prompt, toks, drafts, q_start, cols[1], n, total_q),
        row_seq=row_seq, row_j=row_j,
        row_pos=q_start if total_q == n else q_start[row_seq] + row_j,  # one row each: pos = q_start
        seqs=seqs,
        is_prompt=is_prompt,
    )


def _int_columns(cols: list[list[int]]) -> Optional[np.ndarray]:
    """``[4, n_seq]`` int64 array of the int columns, or None if a value does not fit in int64."""
    try:
        return np.array(cols, np.int64)
    except OverflowError:
        return None


def _slice(x: Sequence[int], a: int, b: int) -> Sequence[int]:
    return x[a:b]


def _flat_tables(
    tables: list[Sequence[int]], n_bt: np.ndarray, need: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the first ``need[s]`` block ids of every table, plus one trailing 0.

    Example: tables ``[[7, 8, 9], [4]]``, need ``[2, 1]`` -> ``bt_flat = [7, 8, 4, 0]``,
    ``bt_start = [0, 2]``.
    """
    start = np.zeros(len(tables) + 1, np.int64)
    np.cumsum(need, out=start[1:])
    total = int(start[-1])
    if not np.array_equal(n_bt, need):
        tables = list(map(_slice, tables, [0] * len(tables), need.tolist()))
    flat = np.empty(total + 1, np.int64)
    flat[:total] = int_array(tables, total, "seqs[i].block_table")
    flat[total] = 0
    if total and flat[:total].min() < 0:
        bad = int(np.searchsorted(start[1:], int(np.argmax(flat[:total] < 0)), side="right"))
        raise ValueError(f"seqs[{bad}].block_table: expected block ids >= 0, got a negative id")
    return flat, start[:-1]


def fill_common(
    b: BatchArrays, cfg: MetadataConfig, out: Optional[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """Fields shared by prompt and decode (DESIGN section 4, "Common"), as InputMetadata kwargs.

    ``positions``, ``input_ids``, ``gate_force_random``, ``ngram_token_ids`` (None when
    ``max_ngram_size == 0``), ``cu_seqlens_q``/``cu_seqlens_k`` [n_seq+1], ``valid_token_mask``,
    ``query_indices`` (998244353 on placeholder rows), ``slot_mapping_store_swa`` and the scalars.
    Example (S = 4, one sequence, state 2, seqlen_q = 6, seqlen_k = 9): positions 3..8; rows with
    ``seqlen_q - j <= 4`` are j = 2..5 (positions 5..8) -> SWA slots ``[-1, -1, 9, 10, 11, 8]``.
    """
    T, n = b.total_q, b.n_seq
    ph_row = b.per_row(b.is_placeholder)
    any_ph = bool(b.is_placeholder.any())
    f: dict[str, Any] = {
        "is_prompt": b.is_prompt, "num_seqs": n, "total_q": T,
        "max_seqlen_q": int(b.seqlen_q.max()), "max_seqlen_k": int(b.seqlen_k.max()),
    }
    f["positions"], a = alloc(out, "positions", (T,), torch.int32)
    a[:] = b.row_pos
    f["input_ids"], a = alloc(out, "input_ids", (T,), torch.int32)
    a[:] = b.input_ids
    f["gate_force_random"], a = alloc(out, "gate_force_random", (T,), torch.bool)
    a.fill(cfg.force_load_balance)
    f["cu_seqlens_q"], a = alloc(out, "cu_seqlens_q", (n + 1,), torch.int32)
    a[:] = b.cu_q
    f["cu_seqlens_k"], a = alloc(out, "cu_seqlens_k", (n + 1,), torch.int32)
    a[:] = b.cu_k
    f["valid_token_mask"], a = alloc(out, "valid_token_mask", (T,), torch.bool)
    np.logical_not(ph_row, out=a)
    f["query_indices"], a = alloc(out, "query_indices", (T,), torch.int32)
    a[:] = b.row_seq
    if any_ph:
        a[ph_row] = PLACEHOLDER_QUERY_INDEX
    S = cfg.swa_block_size
    f["slot_mapping_store_swa"], a = alloc(out, "slot_mapping_store_swa", (T,), torch.int32)
    a[:] = b.per_row(b.state_id) * S + fmod(b.row_pos, S)
    if T != n:  # only the last S rows of a chunk stay in the ring
        drop = (b.seqlen_q[b.row_seq] - b.row_j) > S
        a[drop | ph_row if any_ph else drop] = PAD_SLOT_ID
    elif any_ph:
        a[ph_row] = PAD_SLOT_ID
    f["ngram_token_ids"] = None
    if cfg.max_ngram_size > 0:
        from ._ngram import fill_ngram_token_ids

        f["ngram_token_ids"] = fill_ngram_token_ids(b, cfg, out)
    return f


def check_common_int32(b: BatchArrays, cfg: MetadataConfig) -> None:
    """Overflow checks shared by both paths (run before any allocation).

    Bounds: ``sum(seqlen_k)`` (``cu_seqlens_k``), ``max(state_id) * S + S - 1`` (SWA slots),
    ``max(block id) * b_c + b_c - 1`` with ``b_c = block_size // min_ratio`` (compressed slots),
    and every token id.
    """
    check_int32("cu_seqlens_k", int(b.cu_k[-1]), "sum(seqlen_k)")
    S = cfg.swa_block_size
    check_int32(
        "slot_mapping_store_swa", int(b.state_id.max()) * S + S - 1,
        f"max(state_id) * swa_block_size + swa_block_size - 1 (swa_block_size={S})",
    )
    bc = cfg.block_size // cfg.min_ratio
    check_int32(
        "slot_mapping_store_ca", int(b.bt_flat.max()) * bc + bc - 1,
        f"max(block id) * (block_size // min_ratio) + block_size // min_ratio - 1 (b_c={bc})",
    )
    if b.total_q and (b.input_ids.max() > INT32_MAX or b.input_ids.min() < -INT32_MAX - 1):
        raise ValueError("input_ids: token id does not fit in int32")


def compressed_slots(
    b: BatchArrays, seq: Optional[np.ndarray], c: np.ndarray, write: np.ndarray, n: int, cfg: MetadataConfig
) -> np.ndarray:
    """Compressed-KV slot of compressed index ``c`` of sequence ``seq``, or -1 where not ``write``.

    ``seq=None`` means ``c`` has one entry per sequence, in order.
    ``slot = block_table[c // b_c] * b_c + c % b_c`` with ``b_c = block_size // n``. Rows that do
    not write read the trailing 0 of ``bt_flat`` instead of a possibly out-of-table block.
    Example: block_size 128, n = 4 (b_c = 32), table ``[7, 3]``, c = 40 -> ``3 * 32 + 8 = 104``.
    """
    bc = cfg.block_size // n
    idx = fdiv(c, bc)
    idx += b.bt_start if seq is None else b.bt_start[seq]
    skip = ~write
    idx[skip] = len(b.bt_flat) - 1
    slot = b.bt_flat[idx]
    slot *= bc
    slot += fmod(c, bc)
    slot[skip] = PAD_SLOT_ID
    return slot
