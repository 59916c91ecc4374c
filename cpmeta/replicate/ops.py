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
           "RUN_NAMES", "SPEC_WORDS", "flat_ints"]

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
WIDE: dict[str, int] = {"runs": 2, "add_meta": 7, "sid_pairs": 2, "svs_pairs": 2, "batch_digest": 4}
#: values per batch spec in a frame's ``spec`` list (see OpLog.batch_spec)
SPEC_WORDS = 7

(_RUNS, _ADD_META, _ADD_TOKENS, _ADD_BLOCKS, _ADD_COMP, _TOK_SLOTS, _TOK_COUNTS, _TOK_FLAT, _BLK_SLOTS,
 _BLK_COUNTS, _BLK_FLAT, _CMP_SLOTS, _CMP_COUNTS, _CMP_FLAT, _SID, _SVS, _FIN, _SPEC_SLOTS, _SPEC_LENS,
 _SPEC_DRAFTS, _DIGEST) = range(len(COLUMNS))
#: first column (slots; counts and flat ids follow) of each ragged run code
_RAGGED = {TOK: _TOK_SLOTS, BLK: _BLK_SLOTS, CMP: _CMP_SLOTS}
_LOGGED = range(_DIGEST)  # the columns an OpLog fills (the batch digest comes at send)
_WIDTH = [WIDE.get(c, 1) for c in COLUMNS]
_EMPTY = np.zeros(0, np.int64)


def flat_ints(values: Any) -> np.ndarray:
    """``values`` as a flat array (a numpy array's own view; anything else converted once) for
    the log to copy in. Example: ``[3, 5]`` -> ``array([3, 5])``."""
    a = values if type(values) is np.ndarray else np.asarray(values, np.int64)
    return a if a.ndim == 1 else a.reshape(-1)


class OpLog:
    """The driver's record of one step (see the module docstring), in preallocated int64
    columns: a call copies its values in (one slice assignment per column, no allocation; a
    column that fills up doubles, once); :meth:`columns` hands views of the used parts to the
    frame, :meth:`clear` starts the next step (resets counters), :meth:`extend` appends another
    log's calls (those made between two specs of one step)."""

    def __init__(self, max_seqs: int) -> None:
        # run id that last touched each slot: a slot already in the current run starts a new one
        self._seen = np.zeros(max_seqs, np.int64)
        self._run_id = 0
        cap = 4 * max_seqs + 64
        self._bufs = [np.zeros(cap * w, np.int64) for w in _WIDTH[:_DIGEST]]
        self._n = [0] * _DIGEST  # int64 values used per column
        self._last_code = -1  # the open run's code (-1: none)
        self.req_ids: list[Any] = []
        self.specs: list[int] = []  # SPEC_WORDS values per batch spec, in call order
        self.clear()

    def clear(self) -> None:
        self._n[:] = [0] * _DIGEST
        self._last_code = -1
        self._run_id += 1
        self.req_ids.clear()
        self.specs.clear()

    def _grow(self, c: int, need: int) -> np.ndarray:
        """Column ``c``'s buffer, doubled (at least to ``need`` values), its used part kept."""
        buf = self._bufs[c]
        grown = np.zeros(max(need, 2 * len(buf)), np.int64)
        grown[:self._n[c]] = buf[:self._n[c]]
        self._bufs[c] = grown
        return grown

    def _put(self, c: int, values: Any, k: int) -> None:
        """Append ``k`` values (an array of ``k`` or one int when ``k == 1``) to column ``c``."""
        buf, n = self._bufs[c], self._n[c]
        if n + k > len(buf):
            buf = self._grow(c, n + k)
        buf[n:n + k] = values
        self._n[c] = n + k

    def extend(self, other: "OpLog") -> None:
        """Append ``other``'s runs and columns after this log's (calls made later)."""
        for c in _LOGGED:
            k = other._n[c]
            if k:
                self._put(c, other._bufs[c][:k], k)
        self._run_id += 1
        self._last_code = -1  # other's runs stay whole: the next call opens a new one
        self.req_ids += other.req_ids
        self.specs += other.specs

    def _entry(self, code: int, slots: Any, n: int) -> None:
        """Open or extend the run of ``code`` for ``n`` entries on ``slots`` (an int or an int64
        array of live slots, distinct: the driver's state checked them). Only a call of the open
        run's kind looks for a clash (a slot the run already holds: a new run keeps the order)."""
        seen, rid = self._seen, self._run_id
        if self._last_code == code and not (
                seen[slots] == rid if type(slots) is int else (seen[slots] == rid).any()):
            self._bufs[_RUNS][self._n[_RUNS] - 1] += n
        else:
            self._run_id = rid = rid + 1
            self._last_code = code
            self._put(_RUNS, (code, n), 2)
        seen[slots] = rid

    # ---- recording (after the driver's own state applied the call) ---------------------------
    def add(self, slot: int, req_id: Hashable, tokens: np.ndarray, blocks: np.ndarray,
            comp: np.ndarray, state_id: int, swa_valid_start: int, num_computed: int) -> None:
        nt, nb, nc = len(tokens), len(blocks), len(comp)
        self._entry(ADD, slot, 1)
        self._put(_ADD_META, (slot, state_id, swa_valid_start, num_computed, nt, nb, nc), 7)
        self._put(_ADD_TOKENS, tokens, nt)
        self._put(_ADD_BLOCKS, blocks, nb)
        self._put(_ADD_COMP, comp, nc)
        self.req_ids.append(req_id)

    def ragged(self, code: int, slots: Any, counts: Any, flat: np.ndarray) -> None:
        """TOK / BLK / CMP entries: ``counts[i]`` values of ``flat`` for ``slots[i]`` (arrays),
        or one slot and its count (ints: a single-slot call)."""
        n = 1 if type(slots) is int else len(slots)
        self._entry(code, slots, n)
        c = _RAGGED[code]
        self._put(c, slots, n)
        self._put(c + 1, counts, n)
        self._put(c + 2, flat, len(flat))

    def pair(self, code: int, slot: int, value: int) -> None:
        self._entry(code, slot, 1)
        self._put(_SID if code == SID else _SVS, (slot, value), 2)

    def finish(self, slot: int) -> None:
        self._entry(FIN, slot, 1)
        self._put(_FIN, slot, 1)

    def batch_spec(self, is_prompt: bool, slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray,
                   num_placeholders: int, advance: bool, uniform: int) -> None:
        """A batch spec; its values ``[is_prompt, num_placeholders, advance, uniform drafts,
        #slots, #lens, #drafts]`` (:data:`SPEC_WORDS`) go to :attr:`specs`."""
        self._put(_RUNS, (SPEC, 1), 2)
        self._run_id += 1
        self._last_code = -1
        self._put(_SPEC_SLOTS, slots, len(slots))
        self._put(_SPEC_LENS, lens, len(lens))
        self._put(_SPEC_DRAFTS, drafts, len(drafts))
        self.specs += [int(is_prompt), int(num_placeholders), int(advance), int(uniform), len(slots),
                       len(lens), len(drafts)]

    # ---- the frame ----------------------------------------------------------------------------
    def columns(self, batch_digest: np.ndarray) -> list[np.ndarray]:
        """Every column of :data:`COLUMNS`: views of the used parts (valid until the next
        :meth:`clear`), ``[k, w]`` for the wide ones, then ``batch_digest``."""
        out = [b[:n] if w == 1 else b[:n].reshape(-1, w) for b, n, w in zip(self._bufs, self._n, _WIDTH)]
        out.append(batch_digest)
        return out
