"""``extract_batch``: validate a list of ``SequenceMetadata`` and read it into ``BatchArrays``.

ONE Python pass over the ``SequenceMetadata`` objects (a handful of ``map(attrgetter)`` list
extractions; token ids and block tables are read list by list with ``array.array("q").fromlist``,
a C loop); the checks of ``validate_batch`` run vectorized on the extracted arrays.
"""

from __future__ import annotations

import logging
from operator import attrgetter
from typing import Optional, Sequence

import numpy as np

from ..config import MetadataConfig
from ..sequence import SequenceMetadata, validate_batch
from .arrays import BatchArrays, cdiv, first_bad, int_array

__all__ = ["extract_batch"]

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
                         lambda _: f"seqs[{first_bad([[t[-1]] for t in toks])}].token_ids")
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
