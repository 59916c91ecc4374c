"""``SequenceBatch``: one step's scheduled sequences as numpy arrays (DESIGN section 13).

The builders' input in array form. A list of ``SequenceMetadata`` converts with
:meth:`SequenceBatch.from_sequences` (validated with ``validate_batch``'s rules and messages;
:func:`as_sequence_batch` is every builder's way in, either form);
:class:`~cpmeta.state.batch_state.BatchState` produces one per step without touching Python
objects. ``prepare_prompt`` / ``prepare_decode`` / ``prepare_decode_inplace`` accept either form
with bit-identical results; the list path IS ``from_sequences`` followed by the array path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

from ..config import MetadataConfig, blocks_needed_array, check_config
from ..int_lists import first_bad, int_array
from ..sequence import SequenceMetadata, check_distinct_state_ids, validate_batch
from .checks import check_window_ids

__all__ = ["SequenceBatch", "BatchInput", "as_sequence_batch", "Vouch", "window_lookback", "prefix"]

_SQ = attrgetter("seqlen_q")
_SK = attrgetter("seqlen_k")
_STATE = attrgetter("state_id")
_SVS = attrgetter("swa_valid_start")
_PH = attrgetter("is_placeholder")
_TOK = attrgetter("token_ids")
_DRAFT = attrgetter("draft_tokens")
_BT = attrgetter("block_table")
_COMP = attrgetter("compressed_token_ids")


def window_lookback(cfg: MetadataConfig) -> int:
    """Positions before ``q_start`` a step reads: Engram's ``max_ngram_size - 1`` (0 when off)."""
    return max(cfg.max_ngram_size - 1, 0)


def prefix(lengths: np.ndarray) -> np.ndarray:
    """Exclusive offsets ``[n + 1]`` (int64) of ``lengths``. Example: ``[2, 1]`` -> ``[0, 2, 3]``."""
    cu = np.zeros(len(lengths) + 1, np.int64)
    np.add.accumulate(lengths, out=cu[1:])
    return cu


class Vouch(NamedTuple):
    """What the maker of a :class:`SequenceBatch` vouches for: that it is valid under ONE config
    ``cfg`` (immutable). Every vouched batch passed ``SequenceBatch.validate(cfg)``'s checks (or
    its maker's invariants and per-step checks cover them: ``BatchState``'s gather kernel): its
    builders skip ``validate`` and may rely on its token windows holding ids in ``[0, 2**31 -
    1]``."""

    cfg: MetadataConfig


@dataclass(slots=True, eq=False)
class SequenceBatch:
    """One step's sequences, flat (CSR) numpy arrays; ``len(batch)`` = number of sequences.

    Per-sequence arrays are ``[n_seq]``. Three ragged arrays are stored flat with exclusive
    offsets ``[n_seq+1]`` (sequence s owns ``flat[off[s]:off[s+1]]``):

    - ``block_tables``: each sequence's WHOLE ``block_table``.
    - ``tokens``: the token window the step reads, absolute positions ``[lo, seqlen_k)`` with
      ``lo = max(0, q_start - lookback)``, ``q_start = seqlen_k - seqlen_q``,
      ``lookback = max_ngram_size - 1`` (0 without Engram). Prompt: ``token_ids[lo:seqlen_k]``;
      decode: ``token_ids[lo:]`` then the ``seqlen_q - 1`` draft tokens (positions after q_start).
    - ``compressed``: Engram ``compressed_token_ids`` of the same window's first positions,
      ``compressed_token_ids[lo:min(len, seqlen_k)]`` (empty when the history ends before lo).

    ``num_tokens`` is ``len(token_ids)``, the confirmed tokens (prompt: the whole prompt, which
    YoCo needs; decode: exactly ``seqlen_k - seqlen_q + 1``). The token window lets a step read
    only what it needs: a decode row costs ``1 + lookback + drafts`` ids, whatever its history.

    Worked example (Engram ``max_ngram_size = 3`` so lookback 2; one prompt chunk and one decode
    sequence with one draft)::

        seq 0 prompt chunk: seqlen_q 3, seqlen_k 5, token_ids [11, 12, 13, 14, 15, 16] (6-token
              prompt), block_table [7], compressed_token_ids [90, 91]
              q_start 2, lo 0 -> tokens [11, 12, 13, 14, 15], compressed [90, 91]
        seq 1 decode: seqlen_q 2, seqlen_k 9, token_ids = 8 confirmed tokens [20..27],
              draft_tokens [50], block_table [4, 6]
              q_start 7, lo 5 -> tokens [25, 26, 27, 50], compressed []
        seqlen_q [3, 2]  seqlen_k [5, 9]  num_tokens [6, 8]
        block_tables [7, 4, 6]            block_table_offsets [0, 1, 3]
        tokens [11, 12, 13, 14, 15, 25, 26, 27, 50]  token_offsets [0, 5, 9]
        compressed [90, 91]               compressed_offsets [0, 2, 2]

    (a real batch is all prompt or all decode; the two rows only show both windows). Input ids
    are the last ``seqlen_q`` entries of each window: ``[13, 14, 15]`` and ``[27, 50]``.

    Treat a batch as immutable once built: the builders may cache that it was validated for a
    config. ``validate(cfg)`` raises the ``seqs[i].field`` errors of ``validate_batch``.
    """

    is_prompt: bool
    seqlen_q: np.ndarray  # [n_seq] int64, query rows this step
    seqlen_k: np.ndarray  # [n_seq] int64, keys after this step
    state_id: np.ndarray  # [n_seq] int64, SWA ring / state slot
    swa_valid_start: np.ndarray  # [n_seq] int64
    is_placeholder: np.ndarray  # [n_seq] bool
    num_tokens: np.ndarray  # [n_seq] int64, len(token_ids)
    block_tables: np.ndarray  # [sum len(block_table)] int64, whole tables back to back
    block_table_offsets: np.ndarray  # [n_seq+1] int64
    tokens: np.ndarray  # [sum window] int64, positions [lo, seqlen_k) of each sequence
    token_offsets: np.ndarray  # [n_seq+1] int64
    compressed: np.ndarray  # [sum c] int64, compressed ids of positions [lo, lo + c)
    compressed_offsets: np.ndarray  # [n_seq+1] int64
    lookback: int  # window reaches lookback positions before q_start (max_ngram_size - 1)
    # what the batch is vouched for, for ONE config (``Vouch``): set by from_sequences and
    # validate(), and by the state room's gather (``cpmeta/state/gather.py``) for the batches
    # BatchState makes. NOT a constructor argument, so a batch built from user arrays
    # always starts unchecked; other rooms read it through ``vouch_for`` only.
    _vouch: Optional["Vouch"] = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return int(self.seqlen_q.shape[0])

    def vouch_for(self, cfg: MetadataConfig) -> Optional["Vouch"]:
        """What this batch is vouched for under ``cfg`` (read-only), or ``None`` when it has not
        been validated for that config. ``validate(cfg)`` returns at once for a vouched batch."""
        v = self._vouch
        return v if v is not None and v.cfg is cfg else None

    @property
    def q_start(self) -> np.ndarray:
        """``seqlen_k - seqlen_q`` ([n_seq] int64)."""
        return self.seqlen_k - self.seqlen_q

    # ---- conversion from the list API --------------------------------------------------------
    @classmethod
    def from_sequences(
        cls, seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, is_prompt: bool
    ) -> "SequenceBatch":
        """Validate ``seqs`` (same errors as ``validate_batch``) and read them into arrays.

        ONE Python pass (``map(attrgetter)`` column reads; token windows and tables read list by
        list with ``array.array("q").fromlist``); the checks run vectorized, and only when one
        fails (or a value is not a plain ``int``) does ``validate_batch`` run for the message.
        """
        if (
            isinstance(seqs, SequenceMetadata) or not isinstance(seqs, Sequence) or len(seqs) == 0
            or set(map(type, seqs)) != {SequenceMetadata}
        ):
            validate_batch(seqs, cfg, is_prompt=is_prompt)
        n = len(seqs)
        cols = [list(map(g, seqs)) for g in (_SQ, _SK, _STATE, _SVS)]
        kinds = {*map(type, cols[0]), *map(type, cols[1]), *map(type, cols[2]), *map(type, cols[3])}
        plain = all(t is int or issubclass(t, np.integer) for t in kinds)  # numpy integers count, bools not
        flags = list(map(_PH, seqs))
        if set(map(type, flags)) != {bool}:
            validate_batch(seqs, cfg, is_prompt=is_prompt)  # names the sequence with a non-bool flag
        toks, drafts, tables = list(map(_TOK, seqs)), list(map(_DRAFT, seqs)), list(map(_BT, seqs))
        n_tok = np.fromiter(map(len, toks), np.int64, n)
        n_draft = np.fromiter(map(len, drafts), np.int64, n) if any(map(len, drafts)) else None
        n_bt = np.fromiter(map(len, tables), np.int64, n)
        ints = _int_columns(cols) if plain else None
        if ints is None or not _fast_checks_ok(cfg, is_prompt, ints, n_tok, n_draft, n_bt):
            validate_batch(seqs, cfg, is_prompt=is_prompt)
            ints = _int_columns([[int(x) for x in c] for c in cols])
            assert ints is not None, "validate_batch refuses ints outside int64"
        sq, sk = ints[0], ints[1]
        lb = window_lookback(cfg)
        q_start = sk - sq
        lo = np.maximum(q_start - lb, 0) if lb else q_start
        tok_off = prefix(sk - lo)
        bt_off = prefix(n_bt)
        tokens = _read_windows(is_prompt, toks, drafts, lo, cols[1], n, int(tok_off[-1]))
        if cfg.max_ngram_size > 0:
            comps = list(map(_COMP, seqs))
            comp, comp_off = _read_compressed(comps, lo, sk)
        else:
            comp, comp_off = np.zeros(0, np.int64), np.zeros(n + 1, np.int64)
        batch = cls(
            is_prompt=is_prompt, seqlen_q=sq, seqlen_k=sk, state_id=ints[2], swa_valid_start=ints[3],
            is_placeholder=np.fromiter(flags, bool, n), num_tokens=n_tok,
            block_tables=int_array(tables, int(bt_off[-1]), "seqs[i].block_table"),
            block_table_offsets=bt_off, tokens=tokens, token_offsets=tok_off,
            compressed=comp, compressed_offsets=comp_off, lookback=lb,
        )
        batch._check_values(cfg)
        batch._vouch = Vouch(cfg)
        return batch

    # ---- validation of a batch built from arrays -----------------------------------------------
    def validate(self, cfg: MetadataConfig) -> None:
        """Raise ``validate_batch``'s ``ValueError("seqs[i].field: ...")`` for the first bad
        sequence (vectorized; the message is worked out for that one sequence only), or a
        ``ValueError("batch.<array>: ...")`` for arrays of the wrong shape. Beyond
        ``validate_batch``'s checks, the VALUES: every id of the token windows in ``[0, 2**31 -
        1]``, and (sliding-window state cache) no two non-placeholder sequences sharing a
        ``state_id``. Cached per config (``vouch_for``)."""
        if self.vouch_for(cfg) is not None:
            return
        _check_shapes(self)
        n = len(self)
        if n == 0:
            raise ValueError("seqs: expected at least one sequence, got an empty batch")
        lb = window_lookback(cfg)
        if self.lookback != lb:
            raise ValueError(
                f"batch.lookback: expected {lb} (max_ngram_size - 1 of this config), got "
                f"{self.lookback}; build the batch with the config it is used with")
        sq, sk = self.seqlen_q, self.seqlen_k
        n_bt = np.diff(self.block_table_offsets)
        ints = np.stack([sq, sk, self.state_id, self.swa_valid_start])
        n_draft = np.zeros(n, np.int64) if self.is_prompt else sq - 1
        ok = _row_checks(cfg, self.is_prompt, ints, self.num_tokens, n_draft, n_bt)
        if not ok.all():
            i = int(np.argmin(ok))
            try:
                validate_batch([_one_sequence(self, i)], cfg, is_prompt=self.is_prompt)
            except ValueError as e:
                raise ValueError(str(e).replace("seqs[0]", f"seqs[{i}]", 1)) from None
            raise AssertionError("vectorized checks and validate_batch disagree")  # pragma: no cover
        q_start = sk - sq
        lo = np.maximum(q_start - lb, 0)
        win = np.diff(self.token_offsets)
        bad = np.flatnonzero(win != sk - lo)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"seqs[{i}].token_ids: expected a window of seqlen_k - max(0, q_start - "
                             f"{lb}) = {int(sk[i] - lo[i])} tokens, got {int(win[i])}")
        bad = np.flatnonzero(np.diff(self.compressed_offsets) > win)
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"seqs[{i}].compressed_token_ids: expected at most the window's "
                             f"{int(win[i])} ids, got {int(np.diff(self.compressed_offsets)[i])}")
        self._check_values(cfg)
        self._vouch = Vouch(cfg)

    def _check_values(self, cfg: MetadataConfig) -> None:
        """The checks of values a count check cannot see: the token windows' ids, each in
        ``[0, 2**31 - 1]`` (``check_window_ids``), and distinct state ids of the non-placeholder
        sequences under the state cache (``check_distinct_state_ids``). O(total window) + one
        sort of ``[n_seq]`` ids."""
        check_window_ids(self.tokens, self.token_offsets, self.seqlen_q, self.seqlen_k, self.lookback,
                         self.is_prompt)
        check_distinct_state_ids(self.state_id, self.is_placeholder, cfg)


#: What every builder accepts as its batch: ``SequenceMetadata`` objects, or their arrays.
BatchInput = Union[Sequence[SequenceMetadata], SequenceBatch]


def as_sequence_batch(seqs: BatchInput, cfg: MetadataConfig, *, is_prompt: bool) -> SequenceBatch:
    """A builder's batch as a ``SequenceBatch`` validated for ``cfg``: ``seqs`` itself when it is
    one of the right path (``validate``: at once when vouched for ``cfg``), else
    ``SequenceBatch.from_sequences``. A batch of the other path is a ``ValueError``. Example: a
    decode builder handed a prompt batch -> ``"seqs: expected a decode SequenceBatch, got a
    prompt one"``."""
    check_config(cfg)
    if isinstance(seqs, SequenceBatch):
        if seqs.is_prompt != is_prompt:
            want, got = ("prompt", "decode") if is_prompt else ("decode", "prompt")
            raise ValueError(f"seqs: expected a {want} SequenceBatch, got a {got} one")
        seqs.validate(cfg)
        return seqs
    return SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)


def _one_sequence(b: SequenceBatch, i: int) -> SequenceMetadata:
    """Sequence ``i`` with the right COUNTS of tokens, drafts and blocks (error paths only: it
    gets ``validate_batch``'s message)."""
    nt, q = int(b.num_tokens[i]), int(b.seqlen_q[i])
    return SequenceMetadata(
        seqlen_q=q, seqlen_k=int(b.seqlen_k[i]),
        block_table=range(int(b.block_table_offsets[i + 1] - b.block_table_offsets[i])),
        state_id=int(b.state_id[i]), token_ids=range(max(nt, 0)), is_placeholder=bool(b.is_placeholder[i]),
        swa_valid_start=int(b.swa_valid_start[i]), draft_tokens=() if b.is_prompt else range(max(q - 1, 0)),
    )


def _check_shapes(b: SequenceBatch) -> None:
    n = b.seqlen_q.shape[0] if isinstance(b.seqlen_q, np.ndarray) else -1
    for name in ("seqlen_q", "seqlen_k", "state_id", "swa_valid_start", "num_tokens", "is_placeholder"):
        a = getattr(b, name)
        kind = "b" if name == "is_placeholder" else "i"
        if not isinstance(a, np.ndarray) or a.shape != (n,) or a.dtype.kind != kind:
            raise ValueError(f"batch.{name}: expected a [n_seq] {'bool' if kind == 'b' else 'int'} "
                             f"numpy array, got {getattr(a, 'dtype', type(a).__name__)} "
                             f"{getattr(a, 'shape', '')}")
    for flat, off in (("block_tables", "block_table_offsets"), ("tokens", "token_offsets"),
                      ("compressed", "compressed_offsets")):
        f, o = getattr(b, flat), getattr(b, off)
        if not isinstance(o, np.ndarray) or o.shape != (n + 1,) or o.dtype.kind != "i" or o[0] != 0 \
                or (np.diff(o) < 0).any():
            raise ValueError(f"batch.{off}: expected [n_seq+1] non-decreasing int offsets from 0")
        if not isinstance(f, np.ndarray) or f.ndim != 1 or f.dtype.kind != "i" or f.shape[0] != o[-1]:
            raise ValueError(f"batch.{flat}: expected a flat int array of {int(o[-1])} entries "
                             f"(batch.{off}[-1]), got {getattr(f, 'shape', type(f).__name__)}")


def _row_checks(
    cfg: MetadataConfig, is_prompt: bool, ints: np.ndarray, n_tok: np.ndarray,
    n_draft: Optional[np.ndarray], n_bt: np.ndarray,
) -> np.ndarray:
    """Per-sequence ``validate_batch`` checks on ``ints = [seqlen_q, seqlen_k, state_id,
    swa_valid_start]`` ([4, n_seq]); ``n_draft=None``: no sequence has drafts. [n_seq] bool."""
    sq, sk = ints[0], ints[1]
    ok = (sq >= 1) & (sq <= sk) & (sk <= cfg.max_model_len)
    ok &= (ints[2:] >= 0).all(axis=0)
    if cfg.has_swa:  # the ring slots state_id * S + S - 1 fit int32
        ok &= ints[2] <= cfg.max_state_id
    if ok.all():  # blocks_needed only for in-range seqlen_k
        ok &= n_bt >= blocks_needed_array(sk, cfg)
    if is_prompt:
        ok &= n_tok >= sk
        if n_draft is not None:
            ok &= n_draft == 0
    else:
        ok &= n_tok == sk - sq + 1
        ok &= (sq == 1) if n_draft is None else (n_draft == sq - 1)
    return ok


def _fast_checks_ok(cfg: MetadataConfig, is_prompt: bool, ints: np.ndarray, n_tok: np.ndarray,
                    n_draft: Optional[np.ndarray], n_bt: np.ndarray) -> bool:
    if is_prompt and n_draft is not None:
        return False
    return bool(_row_checks(cfg, is_prompt, ints, n_tok, n_draft, n_bt).all())


def _int_columns(cols: list[list[int]]) -> Optional[np.ndarray]:
    """``[4, n_seq]`` int64 array of the int columns, or None if a value does not fit in int64."""
    try:
        return np.array(cols, np.int64)
    except OverflowError:
        return None


def _read_windows(is_prompt: bool, toks: list, drafts: list, lo: np.ndarray, sk_l: list, n: int,
                  total: int) -> np.ndarray:
    """Token windows ``[lo, seqlen_k)`` back to back (prompt: ``token_ids[lo:seqlen_k]``; decode:
    ``token_ids[lo:]`` then the drafts). One ``int_array`` call: a C loop per list."""
    if is_prompt:
        return int_array(list(map(_slice, toks, lo.tolist(), sk_l)), total, "seqs[i].token_ids")
    if total == n:  # one confirmed token, no drafts, no look-back: one part, one C loop
        return int_array([[t[-1] for t in toks]], n,
                         lambda _: f"seqs[{first_bad([[t[-1]] for t in toks])}].token_ids")
    parts = [x for t, d, a in zip(toks, drafts, lo.tolist()) for x in (t[a:], d)]
    return int_array(parts, total, lambda k: f"seqs[{k // 2}].{'draft_tokens' if k % 2 else 'token_ids'}")


def _read_compressed(comps: list, lo: np.ndarray, sk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Engram history of each window: ``compressed_token_ids[lo:min(len, seqlen_k)]``."""
    ce = np.minimum(np.fromiter(map(len, comps), np.int64, len(comps)), sk)
    cl = np.maximum(ce - lo, 0)
    off = prefix(cl)
    if not off[-1]:
        return np.zeros(0, np.int64), off
    parts = list(map(_slice, comps, lo.tolist(), np.maximum(ce, lo).tolist()))
    return int_array(parts, int(off[-1]), "seqs[i].compressed_token_ids"), off


def _slice(x: Sequence[int], a: int, b: int) -> Sequence[int]:
    return x[a:b]
