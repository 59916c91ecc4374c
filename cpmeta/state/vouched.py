"""Named constructors of the batches a ``BatchState`` vouches for, the one place that marks a
:class:`~cpmeta.state.batch.SequenceBatch` as validated without running ``validate``.

A ``BatchState`` knows, from its own invariants, what ``SequenceBatch.validate`` would check
(``cpmeta/state/gather.py`` says which invariants; ``cpmeta/state/decode_fast.py`` keeps them
per slot), and often two arrays the builders would compute again (``blocks_needed`` of every
sequence, the padded 2-D block table). The step gathers build their batches here:

- :func:`vouched_batch` -- a plain ``SequenceBatch`` and its :class:`~cpmeta.state.batch.Vouch`;
- :func:`vouched_decode_batch` -- a :class:`StateDecodeBatch`: the decode fast path's batch,
  whose flat block tables are made from its 2-D rows on first read.

The builders read what is vouched through ``SequenceBatch.vouch_for(cfg)`` (read-only); no
module outside this room reads or writes a batch's private fields.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..config import MetadataConfig
from .batch import SequenceBatch, Vouch, prefix

__all__ = ["vouched_batch", "vouched_decode_batch", "StateDecodeBatch"]

_BT = SequenceBatch.__dict__["block_tables"]  # the dataclass slots behind StateDecodeBatch's properties
_BT_OFF = SequenceBatch.__dict__["block_table_offsets"]


def vouched_batch(cfg: MetadataConfig, *, blocks_needed: Optional[np.ndarray] = None,
                  block_rows32: Optional[np.ndarray] = None, **fields: Any) -> SequenceBatch:
    """``SequenceBatch(**fields)`` vouched for ``cfg`` (``Vouch(cfg, blocks_needed,
    block_rows32)``): the caller guarantees that ``validate(cfg)`` would pass (see
    :class:`~cpmeta.state.batch.Vouch` for what the two arrays must hold)."""
    batch = SequenceBatch(**fields)
    for a in (blocks_needed, block_rows32):
        if a is not None:
            a.flags.writeable = False
    batch._vouch = Vouch(cfg, blocks_needed, block_rows32)
    return batch


def _made_on_first_read(slot: Any) -> property:
    """A property over the dataclass ``slot`` that runs ``self._tables()`` when it is still unset."""

    def get(self: "StateDecodeBatch") -> np.ndarray:
        try:
            return slot.__get__(self)
        except AttributeError:
            self._tables()
            return slot.__get__(self)

    return property(get, slot.__set__)


class StateDecodeBatch(SequenceBatch):
    """A decode ``SequenceBatch`` whose flat block tables are made from its 2-D rows on first read.

    Equal to the ``SequenceBatch`` the general path builds (``tests/test_batch_state.py`` compares
    every field on random steps). ``_rows`` is ``(bt2d, num_blocks)``: ``[n_seq,
    max_num_blocks]`` int32 rows, -1 padded, and each table's length (``<= max_num_blocks``).
    Example: rows ``[[7, 8, -1], [4, -1, -1]]``, lengths ``[2, 1]`` -> ``block_tables = [7, 8,
    4]``, ``block_table_offsets = [0, 2, 3]``. Made only by :func:`vouched_decode_batch`.
    """

    __slots__ = ("_rows",)
    _rows: tuple[np.ndarray, np.ndarray]  # ([n_seq, max_num_blocks] int32 rows, [n_seq] int64 lengths)

    def _tables(self) -> None:
        bt2d, nb = self._rows
        _BT.__set__(self, bt2d[np.arange(bt2d.shape[1]) < nb[:, None]].astype(np.int64))
        _BT_OFF.__set__(self, prefix(nb))

    def block_table_ends(self) -> tuple[np.ndarray, np.ndarray]:
        """As ``SequenceBatch.block_table_ends``, read from the 2-D rows (the flat tables, which
        the builders do not read on this path, stay unmade)."""
        bt2d, nb = self._rows
        nb = np.asarray(nb, np.int64)
        last = bt2d[np.arange(len(nb)), np.maximum(nb - 1, 0)].astype(np.int64) if bt2d.shape[1] else \
            np.zeros(len(nb), np.int64)
        return nb, np.where(nb > 0, last, -1)

    block_tables = _made_on_first_read(_BT)
    block_table_offsets = _made_on_first_read(_BT_OFF)


def vouched_decode_batch(cfg: MetadataConfig, *, seqlen_q: np.ndarray, seqlen_k: np.ndarray,
                         num_tokens: np.ndarray, state_id: np.ndarray, swa_valid_start: np.ndarray,
                         is_placeholder: np.ndarray, tokens: np.ndarray, token_offsets: np.ndarray,
                         compressed: np.ndarray, compressed_offsets: np.ndarray, block_rows32: np.ndarray,
                         num_blocks: np.ndarray) -> StateDecodeBatch:
    """A decode batch without look-back vouched for ``cfg``, its flat tables left to be made from
    ``block_rows32`` (``[n_seq, max_num_blocks]`` int32, -1 padded) and ``num_blocks`` (each
    table's length, ``<= max_num_blocks``) on first read; the rows are also the vouched
    ``block_rows32`` the builders copy. Every other argument is the ``SequenceBatch`` field of
    that name. The caller vouches for everything ``Vouch`` promises (``decode_fast`` does so
    per slot)."""
    b = StateDecodeBatch.__new__(StateDecodeBatch)  # the dataclass __init__ would set the tables
    b.is_prompt = False
    b.seqlen_q, b.seqlen_k, b.num_tokens = seqlen_q, seqlen_k, num_tokens
    b.state_id, b.swa_valid_start, b.is_placeholder = state_id, swa_valid_start, is_placeholder
    b.tokens, b.token_offsets = tokens, token_offsets
    b.compressed, b.compressed_offsets = compressed, compressed_offsets
    b.lookback = 0
    block_rows32.flags.writeable = False
    b._rows = (block_rows32, num_blocks)
    b._vouch = Vouch(cfg, None, block_rows32)
    return b
