"""The op log's per-call recording and the step frame's column region, each ONE compiled call.

The driver's :class:`~cpmeta.replicate.ops.OpLog` keeps every logged column in ONE int64 buffer
``flat``: column ``c`` owns ``flat[off[c]:off[c] + cap[c]]`` and uses its first ``n[c]`` values;
``seen[slot]`` is the run id that last touched a slot and ``st = [run id, open run's code]``.
Each recording call (:func:`log_ragged`, :func:`log_add`, :func:`log_pair`, :func:`log_slots`, :func:`log_spec`,
:func:`log_extend`) first checks that every value fits: when one column lacks room it returns
``1 + c`` and writes nothing (the wrapper grows column ``c`` and calls again), else it writes
and returns :data:`~cpmeta.jit.OK`. A run is opened or extended as the ops module describes (a
slot the open run already holds starts a new run; a slot outside the state's range is never
marked, so such a call always opens its own run -- the replica refuses it when it applies).

The frame side: :func:`pack_region` writes the frame's flat dims and the columns' starts, then
lays the used columns and the batch digest back to back in one int64 buffer (the step frame's
tensor region: one int64 dtype run; the driver's ring slot, or the log's own buffer);
:func:`unpack_region` proves a received region against its dims (fixed widths, no negative or
oversized dim, exact bytes and region length as the header declares) and copies it out. Worked
example: columns ``runs [[TOK, 1]]``, ``tok_slots [3]``, ``tok_counts [1]``, ``tok_flat [7]``, the
rest empty, digest ``[0, 4]``: region ``[1, 1, 3, 1, 7]`` (40 bytes, 48 with the 16-byte padding),
dims ``(1, 2, 0, 7, 0, 0, 0, 1, 1, 1, ...)``.
"""

from __future__ import annotations

import numpy as np

from ..base_njit import copy_from0
from ..jit import OK, kernel
from ..state.state_njit import check_slots

__all__ = ["log_ragged", "log_add", "log_pair", "log_slots", "log_spec", "log_extend", "pack_region", "unpack_region",
           "R_DIMS", "R_BYTES", "SPEC_CODE", "RUNS", "ADD_META", "ADD_TOKENS", "SPEC_SLOTS"]

R_DIMS, R_BYTES = 1, 2  # unpack_region's refusals: a dim / the byte counts
_MAX_DIM = 1 << 48  # as the frame codec's MAX_DIM
#: what the kernels write themselves: the batch spec's run code and the indices (in
#: ``ops.COLUMNS``) of the columns they name (the ops module checks both at import)
SPEC_CODE, RUNS, ADD_META, ADD_TOKENS, SPEC_SLOTS = 7, 0, 1, 2, 17


@kernel
def _lack(cap: np.ndarray, n: np.ndarray, need: tuple) -> int:
    """0 when every ``(column, k)`` of ``need`` has room for ``k`` more values, else ``1 + c`` of
    the first column that lacks it (the caller writes nothing then)."""
    for c, k in need:
        if n[c] + k > cap[c]:
            return 1 + c
    return OK


@kernel
def _put(flat: np.ndarray, off: np.ndarray, n: np.ndarray, c: int, values: np.ndarray) -> None:
    at = off[c] + n[c]
    copy_from0(flat[at:at + len(values)], values)  # indexed from 0: it vectorizes
    n[c] += len(values)


@kernel
def _put3(flat: np.ndarray, off: np.ndarray, n: np.ndarray, c: int, a: np.ndarray, b: np.ndarray,
          v: np.ndarray) -> None:
    """``a``, ``b``, ``v`` into columns ``c``, ``c + 1``, ``c + 2`` (slots, counts, flat values)."""
    _put(flat, off, n, c, a)
    _put(flat, off, n, c + 1, b)
    _put(flat, off, n, c + 2, v)


@kernel
def _put1(flat: np.ndarray, off: np.ndarray, n: np.ndarray, c: int, v: int) -> None:
    flat[off[c] + n[c]] = v
    n[c] += 1


@kernel
def _entry(flat: np.ndarray, off: np.ndarray, n: np.ndarray, seen: np.ndarray, st: np.ndarray, code: int,
           slots: np.ndarray, k: int) -> None:
    """Open or extend the run of ``code`` for ``k`` entries on ``slots`` (room checked)."""
    rid = st[0]
    clash = st[1] != code
    for s in slots:
        if s < 0 or s >= len(seen) or seen[s] == rid:
            clash = True
    if clash:
        rid += 1
        st[0], st[1] = rid, code
        _put1(flat, off, n, RUNS, code)
        _put1(flat, off, n, RUNS, k)
    else:
        flat[off[RUNS] + n[RUNS] - 1] += k
    for s in slots:
        if 0 <= s < len(seen):
            seen[s] = rid


@kernel
def _counts_ok(counts: np.ndarray, k: int, total: int) -> bool:
    """``k`` counts, each ``>= 0``, summing to ``total`` (never wraps)."""
    if len(counts) != k:
        return False
    s = 0
    for v in counts:
        if v < 0 or v > total - s:
            return False
        s += v
    return s == total


@kernel
def _ids_ok(values: np.ndarray) -> bool:
    """Every id ``>= 0`` (token ids: what the state's apply would refuse)."""
    for v in values:
        if v < 0:
            return False
    return True


@kernel
def log_ragged(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, seen: np.ndarray, st: np.ndarray,
               code: int, c: int, slots: np.ndarray, counts: np.ndarray, values: np.ndarray, ids: bool,
               active: np.ndarray, mark: np.ndarray, err: np.ndarray) -> int:
    """``TOK`` / ``BLK`` / ``CMP`` entries: slots at column ``c``, counts at ``c + 1``, the flat
    values at ``c + 2``; nothing written and -3 when ``active`` is given (not empty: a deferred
    recorder's live requests; ``mark`` / ``err`` the state's ``check_slots`` scratch) and a slot
    is not one of them or appears twice, -1 when the counts are not one per slot, ``>= 0``,
    summing to the values, -2 when ``ids`` and a value is negative (the state's order)."""
    if len(active) and check_slots(slots, active, mark, err):
        return -3
    if not _counts_ok(counts, len(slots), len(values)):
        return -1
    if ids and not _ids_ok(values):
        return -2
    lack = _lack(cap, n, ((RUNS, 2), (c, len(slots)), (c + 1, len(counts)), (c + 2, len(values))))
    if lack == OK:
        _entry(flat, off, n, seen, st, code, slots, len(slots))
        _put3(flat, off, n, c, slots, counts, values)
    return lack


@kernel
def log_add(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, seen: np.ndarray, st: np.ndarray,
            code: int, slots: np.ndarray, scalars: np.ndarray, tokens: np.ndarray, tc: np.ndarray,
            blocks: np.ndarray, bc: np.ndarray, comp: np.ndarray, cc: np.ndarray) -> int:
    """``ADD``: ``len(slots)`` requests; ``scalars`` [3, k] their state id, valid start and num
    computed; request ``i``'s ids the next ``tc[i]`` / ``bc[i]`` / ``cc[i]`` of ``tokens`` /
    ``blocks`` / ``comp``. Writes the ``add_meta`` rows (slot, state id, valid start, num
    computed, #tokens, #blocks, #compressed) and the flat ids. ``-1`` / ``-2`` / ``-3`` (nothing
    written) when the token / block / compressed counts are not ``k`` values ``>= 0`` summing
    to their ids, ``-4`` when a token id is negative."""
    k = len(slots)
    if not _counts_ok(tc, k, len(tokens)):
        return -1
    if not _counts_ok(bc, k, len(blocks)):
        return -2
    if not _counts_ok(cc, k, len(comp)):
        return -3
    if not _ids_ok(tokens):
        return -4
    lack = _lack(cap, n, ((RUNS, 2), (ADD_META, 7 * k), (ADD_TOKENS, len(tokens)), (ADD_TOKENS + 1, len(blocks)),
                          (ADD_TOKENS + 2, len(comp))))
    if lack == OK:
        _entry(flat, off, n, seen, st, code, slots, k)
        row = flat[off[ADD_META] + n[ADD_META]:off[ADD_META] + n[ADD_META] + 7 * k]
        for i in range(k):
            row[7 * i], row[7 * i + 1], row[7 * i + 2], row[7 * i + 3] = slots[i], scalars[0, i], scalars[1, i], \
                scalars[2, i]
            row[7 * i + 4], row[7 * i + 5], row[7 * i + 6] = tc[i], bc[i], cc[i]
        n[ADD_META] += 7 * k
        _put3(flat, off, n, ADD_TOKENS, tokens, blocks, comp)
    return lack


@kernel
def log_pair(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, seen: np.ndarray, st: np.ndarray,
             code: int, c: int, pair: np.ndarray) -> int:
    """One entry of ``pair`` (slot, value) at column ``c`` (``SID``, ``SVS``)."""
    lack = _lack(cap, n, ((RUNS, 2), (c, len(pair))))
    if lack == OK:
        _entry(flat, off, n, seen, st, code, pair[:1], 1)
        _put(flat, off, n, c, pair)
    return lack


@kernel
def log_slots(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, seen: np.ndarray, st: np.ndarray,
              code: int, c: int, slots: np.ndarray) -> int:
    """``len(slots)`` entries of one slot each at column ``c`` (``FIN``)."""
    lack = _lack(cap, n, ((RUNS, 2), (c, len(slots))))
    if lack == OK:
        _entry(flat, off, n, seen, st, code, slots, len(slots))
        _put(flat, off, n, c, slots)
    return lack


@kernel
def log_spec(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, st: np.ndarray,
             slots: np.ndarray, lens: np.ndarray, drafts: np.ndarray, active: np.ndarray, mark: np.ndarray,
             err: np.ndarray, words: np.ndarray, is_prompt: int, n_ph: int, advance: int, uniform: int) -> int:
    """A batch spec: its own ``SPEC`` run of one, the slots / lens / drafts columns; the next
    call opens a new run; its words ``[is_prompt, n_ph, advance, uniform, #slots, #lens,
    #drafts]`` in ``words[:7]`` (the caller's view, past the words it holds). Nothing written
    and -3 when ``active`` is given and a slot is not live or appears twice (as
    :func:`log_ragged`)."""
    if len(active) and check_slots(slots, active, mark, err):
        return -3
    lack = _lack(cap, n, ((RUNS, 2), (SPEC_SLOTS, len(slots)), (SPEC_SLOTS + 1, len(lens)),
                          (SPEC_SLOTS + 2, len(drafts))))
    if lack == OK:
        _put1(flat, off, n, RUNS, SPEC_CODE)
        _put1(flat, off, n, RUNS, 1)
        st[0] += 1
        st[1] = -1
        _put3(flat, off, n, SPEC_SLOTS, slots, lens, drafts)
        words[0], words[1], words[2], words[3] = is_prompt, n_ph, advance, uniform
        words[4], words[5], words[6] = len(slots), len(lens), len(drafts)
    return lack


@kernel
def log_extend(flat: np.ndarray, off: np.ndarray, cap: np.ndarray, n: np.ndarray, st: np.ndarray,
               oflat: np.ndarray, ooff: np.ndarray, on: np.ndarray) -> int:
    """Append another log's columns (its runs stay whole: the next call opens a new run)."""
    for c in range(len(on)):
        if n[c] + on[c] > cap[c]:
            return 1 + c
    for c in range(len(on)):
        _put(flat, off, n, c, oflat[ooff[c]:ooff[c] + on[c]])
    st[0] += 1
    st[1] = -1
    return OK


@kernel
def pack_region(flat: np.ndarray, off: np.ndarray, n: np.ndarray, digest: np.ndarray, widths: np.ndarray,
                out: np.ndarray, dims: np.ndarray, starts: np.ndarray) -> int:
    """The frame's flat dims and the columns' starts (``starts[c]`` .. ``starts[c + 1]``) for the
    used columns, then ``digest`` (``[rows, 4]``); then those values back to back into ``out``.
    Returns the values written, or ``-need`` when ``out`` holds fewer than the ``need`` values
    (dims and starts written, no value: an empty ``out`` asks for the sizes alone)."""
    at, d = 0, 0
    for c in range(len(n) + 1):
        starts[c] = at
        k = n[c] if c < len(n) else digest.size
        at += k
        if widths[c] == 1:
            dims[d] = k
            d += 1
        else:
            dims[d] = k // widths[c]
            dims[d + 1] = widths[c]
            d += 2
    starts[len(n) + 1] = at
    if at > len(out):
        return -at
    for c in range(len(n)):
        out[starts[c]:starts[c + 1]] = flat[off[c]:off[c] + n[c]]
    out[starts[len(n)]:at] = digest.ravel()
    return at


@kernel
def unpack_region(shapes: np.ndarray, data: np.ndarray, tbytes: int, widths: np.ndarray, out: np.ndarray,
                  starts: np.ndarray) -> int:
    """A follower's check and copy of a step frame's region: every dim in ``[0, 2**48]``, every
    wide column's second dim its width, the columns' bytes exactly ``tbytes`` and the region
    (``data``) ``tbytes`` rounded up to 16; then the whole region into ``out`` (``len(data) // 8``
    values) and the columns' starts. Returns OK, :data:`R_DIMS` or :data:`R_BYTES` (nothing
    copied)."""
    for v in shapes:
        if v < 0 or v > _MAX_DIM:
            return R_DIMS
    at, d = 0, 0
    for c in range(len(widths)):
        starts[c] = at
        if widths[c] == 1:
            at += shapes[d]
            d += 1
        else:
            if shapes[d + 1] != widths[c]:
                return R_DIMS
            at += shapes[d] * widths[c]
            d += 2
        if at > tbytes:  # (each dim <= 2**48: no sum can wrap before this test)
            return R_BYTES
    starts[len(widths)] = at
    if d != len(shapes) or at * 8 != tbytes or len(data) != (tbytes + 15) // 16 * 16 or len(out) * 8 != len(data):
        return R_BYTES
    out[:] = data.view(np.int64)
    return OK
