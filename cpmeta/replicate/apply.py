"""A follower applies one step frame to its replica: the runs in order, the batch spec in place.

Every run is replayed with the ``BatchState`` call the driver made (vectorized where the driver
made one call for many slots), so the replica goes through exactly the driver's states and the
batch spec yields, bit for bit, the driver's ``SequenceBatch``. A frame whose runs do not add up
to its columns, or whose ``add_request`` lands in another slot than the driver's, is refused
(``ReplicaError``), never half-applied silently: the caller stops the replica (it is diverged).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..state import BatchState, SequenceBatch
from .ops import ADD, BLK, CMP, FIN, SID, SPEC, SPEC_WORDS, SVS, TOK

__all__ = ["apply_step", "ReplicaError"]


class ReplicaError(RuntimeError):
    """A step this replica cannot apply as the driver did (the replica has diverged)."""


#: the columns each run code reads, in order (a ragged run: slots, counts, then its flat ids)
_READS = {ADD: ("add_meta",), TOK: ("tok_slots", "tok_counts", "tok_flat"),
          BLK: ("blk_slots", "blk_counts", "blk_flat"), CMP: ("cmp_slots", "cmp_counts", "cmp_flat"),
          SID: ("sid_pairs",), SVS: ("svs_pairs",), FIN: ("fin_slots",)}
_UNREAD = ("runs", "batch_digest")  # columns no run reads from


def _take(cols: dict[str, np.ndarray], at: dict[str, int], name: str, k: int) -> Any:
    """The next ``k`` rows of column ``name`` (``ReplicaError`` past its end): an int64 array."""
    a = at[name]
    col = cols[name]
    if k < 0 or a + k > len(col):
        raise ReplicaError(f"step frame: {name} holds {len(col)} entries, its runs read {a + k}")
    at[name] = a + k
    return col[a:a + k]


def apply_step(state: BatchState, cols: dict[str, np.ndarray], req_ids: list[Any],
               spec: list[int]) -> list[SequenceBatch]:
    """Apply the step's runs to ``state`` in order; return the specs' batches (in call order).

    ``cols`` maps every name of :data:`cpmeta.replicate.ops.COLUMNS` to its int64 array (as the
    frame carried it); ``req_ids`` the added requests' ids in order; ``spec`` the batch specs'
    values, ``SPEC_WORDS`` per spec (``[is_prompt, num_placeholders, advance, uniform drafts,
    #slots, #lens, #drafts]``). One ``BatchState`` call per run (a vectorized one for appends:
    a decode step is typically three -- ``append_tokens_batch``, ``append_blocks_batch``,
    ``decode_batch``) and one per added, finished or moved request.
    """
    if len(spec) % SPEC_WORDS:
        raise ReplicaError(f"step frame: {len(spec)} spec values, not a multiple of {SPEC_WORDS}")
    at = dict.fromkeys(cols, 0)
    batches: list[SequenceBatch] = []
    adds = iter(req_ids)
    for code, n in cols["runs"].tolist():
        if code == TOK or code == BLK or code == CMP:
            names = _READS[code]
            slots, counts = _take(cols, at, names[0], n), _take(cols, at, names[1], n)
            flat = _take(cols, at, names[2], int(counts.sum()))
            (state.append_tokens_batch if code == TOK else state.append_blocks_batch if code == BLK
             else state.append_compressed_batch)(slots, flat, counts)
        elif code == ADD:
            for meta in _take(cols, at, "add_meta", n).tolist():
                _add(state, cols, at, meta, next(adds, None))
        elif code == FIN:
            for slot in _take(cols, at, "fin_slots", n).tolist():
                state.finish(slot)
        elif code == SID or code == SVS:
            for slot, v in _take(cols, at, _READS[code][0], n).tolist():
                (state.set_state_id if code == SID else state.set_swa_valid_start)(slot, v)
        elif code == SPEC and n == 1 and len(spec) > SPEC_WORDS * len(batches):
            w = SPEC_WORDS * len(batches)
            batches.append(_spec(state, cols, at, spec[w:w + SPEC_WORDS]))
        else:
            raise ReplicaError(f"step frame: unknown run ({code}, {n})")
    for name, a in at.items():
        if a != len(cols[name]) and name not in _UNREAD:
            raise ReplicaError(f"step frame: {name} holds {len(cols[name])} entries, its runs read {a}")
    if next(adds, None) is not None or len(spec) != SPEC_WORDS * len(batches):
        raise ReplicaError("step frame: more request ids or specs than its runs use")
    return batches


def _add(state: BatchState, cols: dict[str, np.ndarray], at: dict[str, int], meta: list[int],
         req_id: Any) -> None:
    slot, state_id, valid_start, num_computed, nt, nb, nc = meta
    if req_id is None:
        raise ReplicaError("step frame: fewer request ids than its add_request entries")
    s = state.add_request(req_id, _take(cols, at, "add_tokens", nt), _take(cols, at, "add_blocks", nb),
                          state_id, compressed_token_ids=_take(cols, at, "add_comp", nc),
                          swa_valid_start=valid_start, num_computed=num_computed)
    if s != slot:
        raise ReplicaError(f"request {req_id!r}: added in slot {s} here, slot {slot} on the driver")


def _spec(state: BatchState, cols: dict[str, np.ndarray], at: dict[str, int], spec: list[int]) -> SequenceBatch:
    is_prompt, n_ph, advance, uniform, n_slots, n_lens, n_drafts = spec
    slots = _take(cols, at, "spec_slots", n_slots)
    lens = _take(cols, at, "spec_lens", n_lens)
    drafts = _take(cols, at, "spec_drafts", n_drafts)
    if is_prompt:
        return state.prompt_batch(slots, lens, num_placeholders=n_ph, advance=bool(advance))
    nd: Any = uniform if uniform >= 0 else (lens if uniform == -1 else None)
    return state.decode_batch(slots, drafts if len(drafts) or nd is not None else None, nd,
                              num_placeholders=n_ph)
