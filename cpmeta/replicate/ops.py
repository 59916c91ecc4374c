"""The step's op log: what the driver did to its ``BatchState``, as ONE frame's arrays.

A step's mutating calls (``add_request``, ``append_tokens`` ...) and its batch spec
(``prompt_batch`` / ``decode_batch``) are recorded in call order as RUNS: consecutive calls of
one kind on distinct slots form one run, applied by one vectorized call on the replica (a call
on a slot the current run already holds starts a new run, so two appends to one slot keep their
order). Each kind keeps its entries in flat columns:

==========  =====================================================  ==============================
run code    columns (int64; ragged ones flat with counts)          applied as
==========  =====================================================  ==============================
``ADD``     ``add_meta`` [a, 7] (slot, state id, valid start,      ``add_request`` per entry
            num computed, #tokens, #blocks, #compressed), the
            flat ``add_tokens`` / ``add_blocks`` / ``add_comp``,
            request ids (values)
``TOK``     ``tok_slots``, ``tok_counts``, ``tok_flat``            ``append_tokens_batch``
``BLK``     ``blk_slots``, ``blk_counts``, ``blk_flat``            ``append_blocks_batch``
``CMP``     ``cmp_slots``, ``cmp_counts``, ``cmp_flat``            ``append_compressed_batch``
``SID``     ``sid_pairs`` [s, 2] (slot, state id)                  ``set_state_id`` per entry
``SVS``     ``svs_pairs`` [s, 2] (slot, valid start)               ``set_swa_valid_start``
``FIN``     ``fin_slots``                                          ``finish`` per entry
``SPEC``    ``spec_slots``, ``spec_lens`` (chunk lengths or draft   ``prompt_batch`` /
            counts), ``spec_drafts``; ``SPEC_WORDS`` values each    ``decode_batch`` (one or more
                                                                   per step: a mixed step)
==========  =====================================================  ==============================

``runs`` [r, 2] = (code, entries) in call order. Worked example: ``finish(3)``, ``add_request("b",
...)`` (gets slot 3 again), ``append_blocks(3, [9])``, ``append_blocks(5, [4, 2])``,
``decode_batch([3, 5])`` -> runs ``[[FIN, 1], [ADD, 1], [BLK, 2], [SPEC, 1]]``, ``fin_slots
[3]``, ``blk_slots [3, 5]``, ``blk_counts [1, 2]``, ``blk_flat [9, 4, 2]``, ``spec_slots [3, 5]``.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np

__all__ = ["OpLog", "ADD", "TOK", "BLK", "CMP", "SID", "SVS", "FIN", "SPEC", "COLUMNS",
           "RUN_NAMES", "SPEC_WORDS"]

ADD, TOK, BLK, CMP, SID, SVS, FIN, SPEC = range(8)
RUN_NAMES = ("add_request", "append_tokens", "append_blocks", "append_compressed",
             "set_state_id", "set_swa_valid_start", "finish", "batch spec")
#: every array column of a step frame, in frame order (all int64)
COLUMNS: tuple[str, ...] = (
    "runs", "add_meta", "add_tokens", "add_blocks", "add_comp",
    "tok_slots", "tok_counts", "tok_flat", "blk_slots", "blk_counts", "blk_flat",
    "cmp_slots", "cmp_counts", "cmp_flat", "sid_pairs", "svs_pairs", "fin_slots",
    "spec_slots", "spec_lens", "spec_drafts", "batch_digest",
)
#: columns of rank 2 and their second dim
WIDE: dict[str, int] = {"runs": 2, "add_meta": 7, "sid_pairs": 2, "svs_pairs": 2}
_EMPTY = np.zeros(0, np.int64)


class OpLog:
    """The driver's record of one step (see the module docstring); :meth:`arrays` hands the
    columns to the frame, :meth:`clear` starts the next step, :meth:`extend` appends another
    log's calls (those made between two specs of one step)."""

    def __init__(self, max_seqs: int) -> None:
        # run id that last touched each slot: a slot already in the current run starts a new one
        self._seen = np.zeros(max_seqs, np.int64)
        self._run_id = 0
        self.clear()

    def clear(self) -> None:
        self._runs: list[list[int]] = []  # [code, entries]
        self._run_id += 1
        # per column: python ints (one per single-slot call) or int64 arrays, in call order
        self._cols: dict[str, list[Any]] = {c: [] for c in COLUMNS if c not in ("runs", "batch_digest")}
        self.req_ids: list[Any] = []
        self.specs: list[int] = []  # SPEC_WORDS values per batch spec, in call order
        self.n_ops = 0

    def extend(self, other: "OpLog") -> None:
        """Append ``other``'s runs and columns after this log's (calls made later)."""
        self._runs += other._runs
        self._run_id += 1
        for name, parts in other._cols.items():
            self._cols[name] += parts
        self.req_ids += other.req_ids
        self.specs += other.specs
        self.n_ops += other.n_ops

    def _entry(self, code: int, slots: Any) -> None:
        """Open or extend the run of ``code`` for entries on ``slots`` (an int or an int64 array
        of live slots, distinct: the driver's state checked them)."""
        seen, rid = self._seen, self._run_id
        if type(slots) is int:
            n, clash = 1, seen[slots] == rid
        else:
            n, clash = len(slots), bool((seen[slots] == rid).any())
        last = self._runs[-1] if self._runs else None
        if last is None or last[0] != code or clash:
            self._run_id = rid = rid + 1
            self._runs.append([code, 0])
            last = self._runs[-1]
        last[1] += n
        seen[slots] = rid
        self.n_ops += 1

    # ---- recording (after the driver's own state applied the call) ---------------------------
    def add(self, slot: int, req_id: Hashable, tokens: np.ndarray, blocks: np.ndarray,
            comp: np.ndarray, state_id: int, swa_valid_start: int, num_computed: int) -> None:
        self._entry(ADD, slot)
        c = self._cols
        c["add_meta"].append(np.array([[slot, state_id, swa_valid_start, num_computed, len(tokens),
                                        len(blocks), len(comp)]], np.int64))
        c["add_tokens"].append(tokens)
        c["add_blocks"].append(blocks)
        c["add_comp"].append(comp)
        self.req_ids.append(req_id)

    def ragged(self, code: int, slots: Any, counts: Any, flat: np.ndarray) -> None:
        """TOK / BLK / CMP entries: ``counts[i]`` values of ``flat`` for ``slots[i]`` (arrays),
        or one slot and its count (ints: a single-slot call)."""
        self._entry(code, slots)
        name = _RAGGED[code]
        c = self._cols
        c[name[0]].append(slots)
        c[name[1]].append(counts)
        c[name[2]].append(flat)

    def pair(self, code: int, slot: int, value: int) -> None:
        self._entry(code, slot)
        self._cols["sid_pairs" if code == SID else "svs_pairs"].append(np.array([[slot, value]], np.int64))

    def finish(self, slot: int) -> None:
        self._entry(FIN, slot)
        self._cols["fin_slots"].append(slot)

    def batch_spec(self, is_prompt: bool, slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray,
                   num_placeholders: int, advance: bool, uniform: int) -> None:
        """A batch spec; its values ``[is_prompt, num_placeholders, advance, uniform drafts,
        #slots, #lens, #drafts]`` (:data:`SPEC_WORDS`) go to :attr:`specs`."""
        self._runs.append([SPEC, 1])
        self._run_id += 1
        self.n_ops += 1
        c = self._cols
        c["spec_slots"].append(slots)
        c["spec_lens"].append(lens)
        c["spec_drafts"].append(drafts)
        self.specs += [int(is_prompt), int(num_placeholders), int(advance), int(uniform), len(slots),
                       len(lens), len(drafts)]

    # ---- the frame ----------------------------------------------------------------------------
    def arrays(self, batch_digest: np.ndarray) -> list[np.ndarray]:
        """Every column of :data:`COLUMNS` as one contiguous int64 array (empty when unused)."""
        out: list[np.ndarray] = [np.array(self._runs, np.int64).reshape(-1, 2)]
        for name in COLUMNS[1:-1]:
            parts = self._cols[name]
            out.append(_flat(parts) if parts else (_EMPTY.reshape(0, WIDE[name]) if name in WIDE else _EMPTY))
        out.append(batch_digest)
        return out


#: values per batch spec in a frame's ``spec`` list (see OpLog.batch_spec)
SPEC_WORDS = 7
_RAGGED = {TOK: ("tok_slots", "tok_counts", "tok_flat"), BLK: ("blk_slots", "blk_counts", "blk_flat"),
           CMP: ("cmp_slots", "cmp_counts", "cmp_flat")}


def _flat(parts: list[Any]) -> np.ndarray:
    """One contiguous int64 array of ints (single-slot calls: gathered into one array per
    stretch) and arrays. Example: ``[3, 5, array([7, 8])]`` -> ``[3, 5, 7, 8]``."""
    if len(parts) == 1 and type(parts[0]) is not int:
        return np.ascontiguousarray(parts[0], np.int64)
    out: list[Any] = []
    ints: list[int] = []
    for p in parts:
        if type(p) is int:
            ints.append(p)
            continue
        if ints:
            out.append(np.array(ints, np.int64))
            ints = []
        out.append(p)
    if ints:
        out.append(np.array(ints, np.int64))
    return out[0] if len(out) == 1 else np.concatenate(out).astype(np.int64, copy=False)
