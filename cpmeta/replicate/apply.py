"""A follower applies one step frame to its replica: the runs in order, the batch spec in place.

Every run is replayed with the ``BatchState`` call the driver made (vectorized where the driver
made one call for many slots), so the replica goes through exactly the driver's states and the
batch spec yields, bit for bit, the driver's ``SequenceBatch``. A frame whose runs do not add up
to its columns, or whose ``add_request`` lands in another slot than the driver's, is refused
(``ReplicaError``), never half-applied silently: the caller stops the replica (it is diverged).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..state import BatchState, SequenceBatch
from .ops import ADD, BLK, CMP, FIN, SID, SPEC, SPEC_WORDS, SVS, TOK

__all__ = ["apply_step", "ReplicaError"]


class ReplicaError(RuntimeError):
    """A step this replica cannot apply as the driver did (the replica has diverged)."""


class _Cursor:
    """Read positions in each column: ``take(name, n)`` -> the next ``n`` rows."""

    def __init__(self, cols: dict[str, np.ndarray]) -> None:
        self.cols = cols
        self.at = dict.fromkeys(cols, 0)

    def take(self, name: str, n: int) -> Any:  # an int64 ndarray (the BatchState calls take arrays)
        a = self.at[name]
        col = self.cols[name]
        if a + n > len(col):
            raise ReplicaError(f"step frame: {name} holds {len(col)} entries, its runs read {a + n}")
        self.at[name] = a + n
        return col[a:a + n]

    def done(self) -> None:
        for name, a in self.at.items():
            if name not in ("runs", "batch_digest") and a != len(self.cols[name]):
                raise ReplicaError(f"step frame: {name} holds {len(self.cols[name])} entries, its "
                                   f"runs read {a}")


def apply_step(state: BatchState, cols: dict[str, np.ndarray], req_ids: list[Any],
               spec: list[int]) -> list[SequenceBatch]:
    """Apply the step's runs to ``state`` in order; return the specs' batches (in call order).

    ``cols`` maps every name of :data:`cpmeta.replicate.ops.COLUMNS` to its int64 array (as the
    frame carried it); ``req_ids`` the added requests' ids in order; ``spec`` the batch specs'
    values, ``SPEC_WORDS`` per spec (``[is_prompt, num_placeholders, advance, uniform drafts,
    #slots, #lens, #drafts]``).
    """
    if len(spec) % SPEC_WORDS:
        raise ReplicaError(f"step frame: {len(spec)} spec values, not a multiple of {SPEC_WORDS}")
    cur = _Cursor(cols)
    batches: list[SequenceBatch] = []
    adds = iter(req_ids)
    for code, n in cols["runs"].tolist():
        if code == TOK or code == BLK or code == CMP:
            name = ("tok", "blk", "cmp")[code - TOK]
            slots, counts = cur.take(f"{name}_slots", n), cur.take(f"{name}_counts", n)
            flat = cur.take(f"{name}_flat", int(counts.sum()))
            _ragged(state, code, slots, counts, flat)
        elif code == ADD:
            for meta in cur.take("add_meta", n).tolist():
                _add(state, cur, meta, next(adds))
        elif code == SID or code == SVS:
            for slot, v in cur.take("sid_pairs" if code == SID else "svs_pairs", n).tolist():
                (state.set_state_id if code == SID else state.set_swa_valid_start)(slot, v)
        elif code == FIN:
            for slot in cur.take("fin_slots", n).tolist():
                state.finish(slot)
        elif code == SPEC and n == 1 and len(spec) > SPEC_WORDS * len(batches):
            at = SPEC_WORDS * len(batches)
            batches.append(_spec(state, cur, spec[at:at + SPEC_WORDS]))
        else:
            raise ReplicaError(f"step frame: unknown run ({code}, {n})")
    cur.done()
    if next(adds, None) is not None or len(spec) != SPEC_WORDS * len(batches):
        raise ReplicaError("step frame: more request ids or specs than its runs use")
    return batches


def _ragged(state: BatchState, code: int, slots: np.ndarray, counts: np.ndarray, flat: np.ndarray) -> None:
    if code == TOK:
        state.append_tokens_batch(slots, flat, counts)
    elif code == BLK:
        state.append_blocks_batch(slots, flat, counts)
    else:
        state.append_compressed_batch(slots, flat, counts)


def _add(state: BatchState, cur: _Cursor, meta: list[int], req_id: Any) -> None:
    slot, state_id, valid_start, num_computed, nt, nb, nc = meta
    toks = cur.take("add_tokens", nt)
    got = state.add_request(req_id, toks, cur.take("add_blocks", nb), state_id,
                            compressed_token_ids=cur.take("add_comp", nc),
                            swa_valid_start=valid_start, num_computed=num_computed)
    if got != slot:
        raise ReplicaError(f"request {req_id!r}: added in slot {got} here, slot {slot} on the driver")


def _spec(state: BatchState, cur: _Cursor, spec: list[int]) -> SequenceBatch:
    is_prompt, n_ph, advance, uniform, n_slots, n_lens, n_drafts = spec
    slots = cur.take("spec_slots", n_slots)
    lens = cur.take("spec_lens", n_lens)
    drafts = cur.take("spec_drafts", n_drafts)
    if is_prompt:
        return state.prompt_batch(slots, lens, num_placeholders=n_ph, advance=bool(advance))
    nd: Any = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return state.decode_batch(slots, drafts if len(drafts) or nd is not None else None, nd,
                              num_placeholders=n_ph)

