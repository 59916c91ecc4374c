"""A follower's common step frame read in ONE compiled call: the header, the values and the region.

Most frames a ``ReplicatedBatchState`` follower receives are alike: the step layout it already
holds (its id only), no checksum (values ``[step, check, request ids, spec words]``).
:func:`read_step_frame` accepts exactly such a frame -- proving what the frame codec's parser
proves for it (:func:`cpmeta.broadcast.wire.read_head`, the values block and its check, the
dims, then :func:`~cpmeta.replicate.ops_njit.unpack_region`) -- and copies its region out; any
other frame, a malformed one included, it leaves to that parser (:data:`ASK_PARSER`), which
accepts it or names what is wrong. It never accepts a frame the parser refuses, and what it
returns for a frame is what the parser returns (``tests/test_step_read.py`` holds the two to
each other on every byte of hostile frames).

The header words (``cpmeta.broadcast.wire``, little-endian): magic, version and flags at 0-8,
the schema fingerprint at 8-24, layout id 24, frame crc 28, layout / values block lengths 32 /
36, dims 40, meta crc 44, tensor bytes 48, step 56; the values block at 64; the shapes 8-aligned
after it, the region 16-aligned after them. The values block is msgpack: a 4-array of an int
(the replica's step), a bool, an array of the added requests' ids (each an int64 or a str; the
caller decodes those bytes with the codec) and an array of ints.

Worked example: a decode step of 64 sequences, step 2 -> values bytes ``94 02 c2 90 97 00 00
01 fe 40 00 00`` (``[2, False, [], [0, 0, 1, -2, 64, 0, 0]]``) -> ``vals[:15] = [2, 0, data_at,
7, 67, 68, 0, 0, 0, 0, 1, -2, 64, 0, 0]`` (the ids' array at bytes 67-68 of the frame: ``90``,
none; word 7: :func:`follow_decode`'s step check), the 26 dims in ``shapes``, the columns in
``out``, their starts in ``starts``.
"""

from __future__ import annotations

import numpy as np

from ..base_njit import crc32, le_word
from ..broadcast.wire import CRC_AT, HEADER, MAX_VALUES_BYTES, META_CRC_AT
from ..jit import OK, kernel
from .ops import BLK, CMP, COLUMNS, SPEC, SPEC_WORDS, TOK
from .ops_njit import unpack_region
from .replay_njit import S_SPEC, replay_decode

__all__ = ["read_step_frame", "follow_decode", "replay_step", "ASK_PARSER", "FIXED_HEAD", "F_READ", "F_DONE", "F_PART",
           "VALS_HEAD", "OWN"]

#: the frame is not the common step frame, or not a well-formed one: the codec's parser decides
ASK_PARSER = 1
#: :func:`replay_step`: nothing applied (not a decode step of the aimed shape; the frame read)
F_READ = 2
#: :func:`replay_step`: the step replayed, its batch gathered (and built, when the sink's code says so)
F_DONE = 3
#: :func:`replay_step`: the replay stopped at a run it refused (Python's replay resumes there, naming it)
F_PART = 4
_LAST = len(COLUMNS) - 1  # batch_digest: no run reads it (nor ``runs``, column 0)
#: header bytes every accepted frame begins with (magic, version, flags, fingerprint)
FIXED_HEAD = 24
_HEAD = HEADER.size
#: ``vals`` words before the spec words: step, bool, data_at, k, ids_at, ids_end, ids, checked
#: (:func:`follow_decode`: 1 when the frame's ``batch_digest`` equals the replica's check)
VALS_HEAD = 8
#: :func:`follow_decode`'s ``mine`` that asks for the check its replay writes (no columns)
OWN = np.zeros((1, 0), np.int64)


@kernel
def _be(buf: np.ndarray, at: int, n: int) -> int:
    """The big-endian ``n``-byte word at ``at`` (msgpack's order)."""
    v = np.int64(0)
    for k in range(n):
        v = (v << 8) | np.int64(buf[at + k])
    return v


@kernel
def _int(buf: np.ndarray, at: int, end: int) -> tuple[int, int]:
    """``(value, next)`` of the msgpack int at ``at``; ``next`` -1 when it is not an int64."""
    if at >= end:
        return 0, -1
    b = buf[at]
    if b <= 0x7F:  # positive fixint
        return np.int64(b), at + 1
    if b >= 0xE0:  # negative fixint
        return np.int64(b) - 256, at + 1
    if 0xCC <= b <= 0xD3:  # uint 8/16/32/64, int 8/16/32/64
        signed = b >= 0xD0
        n = 1 << (b - (0xD0 if signed else 0xCC))
        if at + 1 + n > end or (n == 8 and not signed and buf[at + 1] >= 0x80):
            return 0, -1  # a uint64 past int64: not an int64 (the value check refuses it)
        v = _be(buf, at + 1, n)
        if signed and n < 8 and v >= np.int64(1) << (8 * n - 1):
            v -= np.int64(1) << (8 * n)
        return v, at + 1 + n
    return 0, -1


@kernel
def _len(buf: np.ndarray, at: int, end: int, fix: int, top: int, c8: int, c16: int, c32: int) -> tuple[int, int]:
    """``(length, next)`` of the msgpack array or str header at ``at``: a fix form ``fix`` ..
    ``top`` (the length in its low bits), or the code ``c8`` / ``c16`` / ``c32`` and a big-endian
    1 / 2 / 4-byte length (``c8`` -1: no such form); ``next`` -1 for anything else or past ``end``.
    Example: arrays ``(0x90, 0x9F, -1, 0xDC, 0xDD)``, ``dc 00 12`` -> ``(18, at + 3)``."""
    if at >= end:
        return 0, -1
    b = np.int64(buf[at])
    if fix <= b <= top:
        return b - fix, at + 1
    w = 1 if b == c8 else 2 if b == c16 else 4 if b == c32 else 0
    if w == 0 or at + 1 + w > end:
        return 0, -1
    return _be(buf, at + 1, w), at + 1 + w


@kernel
def _ids(buf: np.ndarray, at: int, end: int) -> tuple[int, int]:
    """``(count, next)`` of the msgpack array at ``at`` whose items are int64s or strs (what a
    request id is); ``next`` -1 when it is anything else, or runs past ``end``."""
    n, at = _len(buf, at, end, 0x90, 0x9F, -1, 0xDC, 0xDD)
    for _ in range(n):
        if at < 0:
            break
        ln, nxt = _len(buf, at, end, 0xA0, 0xBF, 0xD9, 0xDA, 0xDB)
        if nxt < 0:  # not a str: an int64, else refused
            _, at = _int(buf, at, end)
        elif nxt + ln <= end:
            at = nxt + ln
        else:
            at = -1
    return (n, at) if at >= 0 else (0, -1)


@kernel
def read_step_frame(frame: np.ndarray, fixed: np.ndarray, lid: int, want: int, widths: np.ndarray,
                    vals: np.ndarray, shapes: np.ndarray, out: np.ndarray, starts: np.ndarray) -> int:
    """Accept ``frame`` (uint8) when it is the common step frame of step ``want``: its first
    :data:`FIXED_HEAD` bytes ``fixed`` (flags exactly ``FLAG_PACKED``: no layout block, no
    checksum, no abort), layout id ``lid``, ``len(shapes)`` dims, a meta crc that matches, values
    ``[int, bool, [int | str, ...], [int, ...]]``, the region as ``unpack_region`` proves it. Writes
    ``vals``, ``shapes``, the region into ``out[:len(region) // 8]`` and the columns' starts.
    ``vals``: the step, the bool, where the region starts, the number ``k`` of spec words, the
    request ids' msgpack array (its bytes ``frame[ids_at:ids_end]``, ``ids`` items: the caller
    decodes them), then the ``k`` words. Returns OK, or :data:`ASK_PARSER` (nothing to rely on
    written)."""
    n = frame.shape[0]
    n_dims = shapes.shape[0]
    if n < _HEAD:
        return ASK_PARSER
    for i in range(FIXED_HEAD):
        if frame[i] != fixed[i]:
            return ASK_PARSER
    vlen = le_word(frame, 36, 4)
    if le_word(frame, 24, 4) != lid or le_word(frame, 32, 4) != 0 or le_word(frame, 40, 4) != n_dims \
            or vlen > MAX_VALUES_BYTES or le_word(frame, 56, 8) != want:
        return ASK_PARSER
    shapes_at = (_HEAD + vlen + 7) // 8 * 8
    data_at = (shapes_at + 8 * n_dims + 15) // 16 * 16
    if data_at > n:
        return ASK_PARSER
    c = crc32(frame, 0, CRC_AT, 0)
    c = crc32(frame, CRC_AT + 4, META_CRC_AT, c)
    if crc32(frame, META_CRC_AT + 4, data_at, c) != le_word(frame, META_CRC_AT, 4):
        return ASK_PARSER
    at, end = _HEAD, _HEAD + vlen
    if vlen < 5 or frame[at] != 0x94:  # a 4-array
        return ASK_PARSER
    vals[0], at = _int(frame, at + 1, end)
    if at < 0 or at + 2 >= end or (frame[at] != 0xC2 and frame[at] != 0xC3):
        return ASK_PARSER  # the bool
    vals[1] = frame[at] - 0xC2
    vals[4] = at + 1
    vals[6], at = _ids(frame, at + 1, end)  # the request ids
    if at < 0 or at >= end:
        return ASK_PARSER
    vals[5], vals[7] = at, 0
    k, at = _len(frame, at, end, 0x90, 0x9F, -1, 0xDC, 0xDD)  # the spec words
    if at < 0 or VALS_HEAD + k > vals.shape[0]:
        return ASK_PARSER
    vals[2], vals[3] = data_at, k
    for i in range(k):
        vals[VALS_HEAD + i], at = _int(frame, at, end)
        if at < 0:
            return ASK_PARSER
    if at != end:  # the values block holds nothing after the list
        return ASK_PARSER
    for i in range(n_dims):
        shapes[i] = le_word(frame, shapes_at + 8 * i, 8)
    tbytes = le_word(frame, 48, 8)
    data = frame[data_at:]
    m = data.shape[0]
    if m % 16 or tbytes < 0 or tbytes > m or out.shape[0] < m // 8:
        return ASK_PARSER
    if unpack_region(shapes, data, tbytes, widths, out[:m // 8], starts) != OK:
        return ASK_PARSER
    return OK


@kernel
def replay_step(buf: np.ndarray, starts: np.ndarray, words: np.ndarray, at: np.ndarray, check: np.ndarray,
                meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray, block_table: np.ndarray,
                compressed: np.ndarray, p: np.ndarray, mark: np.ndarray, err: np.ndarray, lookback: int,
                stack: np.ndarray, nfree: np.ndarray, scratch: np.ndarray, k: np.ndarray, table: np.ndarray,
                raw: np.ndarray, fo: np.ndarray, shape: np.ndarray, ferr: np.ndarray, info: np.ndarray,
                code: np.ndarray, dry: bool) -> tuple[int, int, int, int, int, np.ndarray, np.ndarray, bool]:
    """A decode step's replay and build in ONE call, from its columns (``buf``, ``starts``:
    ``ops.Columns``) and spec words: for a step whose runs are appends (``TOK`` / ``BLK`` /
    ``CMP``) and one decode spec, last, of the shape the sink aims at (``shape[:2]`` = its rows
    and sequences), :func:`~cpmeta.replicate.replay_njit.replay_decode` from run 0, its check
    rows in ``check[:1 + sequences + placeholders]`` (a ``check`` of no rows: none, the caller
    makes the check later), cursors in ``at``. ``k`` .. ``code``: the sink's arguments; ``dry``
    (the warm): the replay's entry only, nothing applied.

    Returns ``(status, *replay)``: :data:`F_READ` (nothing applied: not such a step; Python's
    replay takes it), :data:`F_DONE` (every run applied, every column read to its end) or
    :data:`F_PART` (stopped at a run Python's replay resumes at and names); ``replay`` what
    ``replay_decode`` returned (status, r, si, crow, batch buffer, placeholder mask, vouched)."""
    empty, no_ph = np.zeros(0, np.int64), np.zeros(0, np.bool_)
    n_runs = (starts[1] - starts[0]) // 2
    if words.shape[0] != SPEC_WORDS or words[0] != 0 or n_runs < 1:
        return F_READ, 0, 0, 0, 0, empty, no_ph, False
    for i in range(n_runs):
        c, n = buf[starts[0] + 2 * i], buf[starts[0] + 2 * i + 1]
        if (c != SPEC or n != 1) if i == n_runs - 1 else (c != TOK and c != BLK and c != CMP):
            return F_READ, 0, 0, 0, 0, empty, no_ph, False
    n_seq = words[4] + words[1]  # a row per sequence and placeholder, one per draft
    rows = 1 + n_seq if check.shape[0] > 0 else 0  # the step check's rows (none: made later)
    if words[1] < 0 or words[4] < 0 or words[6] < 0 or n_seq + words[6] != shape[0] or n_seq != shape[1] \
            or rows > check.shape[0]:
        return F_READ, 0, 0, 0, 0, empty, no_ph, False
    runs = buf[starts[0]:starts[1]].reshape((n_runs, 2))
    end = starts[1:]
    if dry:  # from the end of the runs: the call returns at once, nothing applied
        replay_decode(n_runs, runs, buf, end.copy(), end, words, 0, meta, active, token_ids, block_table,
                      compressed, p, mark, err, check, 0, lookback, False, stack, nfree, scratch, k, table, raw,
                      fo, shape, ferr, info, code)
        return F_READ, 0, 0, 0, 0, empty, no_ph, False
    for c in range(_LAST + 1):
        at[c] = starts[c]
    at[0], at[_LAST] = end[0], end[_LAST]
    code[0] = -1
    status, r, si, crow, g, ph, ok = replay_decode(0, runs, buf, at, end, words, 0, meta, active, token_ids,
                                                   block_table, compressed, p, mark, err, check[:rows], 0,
                                                   lookback, False, stack, nfree, scratch, k, table, raw, fo,
                                                   shape, ferr, info, code)
    if status != S_SPEC or r != n_runs or crow != rows:
        return F_PART, status, r, si, crow, g, ph, ok
    for c in range(_LAST + 1):
        if at[c] != end[c]:
            return F_PART, status, r, si, crow, g, ph, ok
    return F_DONE, status, r, si, crow, g, ph, ok


@kernel
def follow_decode(frame: np.ndarray, fixed: np.ndarray, lid: int, want: int, widths: np.ndarray,
                  vals: np.ndarray, shapes: np.ndarray, out: np.ndarray, starts: np.ndarray, at: np.ndarray,
                  check: np.ndarray, meta: np.ndarray, active: np.ndarray, token_ids: np.ndarray,
                  block_table: np.ndarray, compressed: np.ndarray, p: np.ndarray, mark: np.ndarray,
                  err: np.ndarray, lookback: int, stack: np.ndarray, nfree: np.ndarray, scratch: np.ndarray,
                  k: np.ndarray, table: np.ndarray, raw: np.ndarray, fo: np.ndarray, shape: np.ndarray,
                  ferr: np.ndarray, info: np.ndarray, code: np.ndarray, dry: bool, mine: np.ndarray
                  ) -> tuple[int, int, int, int, int, np.ndarray, np.ndarray, bool]:
    """A follower's whole decode step in ONE call: :func:`read_step_frame`, then
    :func:`replay_step` on what it read (``at`` .. ``dry`` are its), then the step check: after
    :data:`F_DONE`, ``vals[7]`` is 1 when the frame's ``batch_digest`` column holds exactly the
    rows of ``mine`` (a ``defer_apply`` follower's check of the last step), or of the check rows
    the replay wrote when ``mine`` has no columns (:data:`OWN`: the others); else 0 (Python compares and
    names the difference). Returns :data:`ASK_PARSER` (not read: nothing else), :data:`F_READ`
    for a frame with request ids (read only: Python's replay adds them), or what
    :func:`replay_step` returns."""
    if read_step_frame(frame, fixed, lid, want, widths, vals, shapes, out, starts) != OK:
        return ASK_PARSER, 0, 0, 0, 0, np.zeros(0, np.int64), np.zeros(0, np.bool_), False
    if vals[6] != 0:
        return F_READ, 0, 0, 0, 0, np.zeros(0, np.int64), np.zeros(0, np.bool_), False
    got = replay_step(out, starts, vals[VALS_HEAD:VALS_HEAD + vals[3]], at, check, meta, active, token_ids,
                      block_table, compressed, p, mark, err, lookback, stack, nfree, scratch, k, table, raw, fo,
                      shape, ferr, info, code, dry)
    if got[0] == F_DONE:
        vals[7] = _same(out[starts[_LAST]:starts[_LAST + 1]], mine if mine.shape[1] else check[:got[4]])
    return got


@kernel
def _same(col: np.ndarray, rows: np.ndarray) -> int:
    """1 when ``col`` (a ``batch_digest`` column, 4 values a row) holds exactly ``rows``."""
    if col.shape[0] != 4 * rows.shape[0] or rows.shape[1] != 4:
        return 0
    for i in range(rows.shape[0]):
        for j in range(4):
            if col[4 * i + j] != rows[i, j]:
                return 0
    return 1
