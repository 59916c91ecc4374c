"""The follower's compiled step frame read (``StepReader``) against the codec's parser.

The compiled read takes only the common step frame (the layout the follower holds, no checksum;
request ids of int64s and strs, which it hands to the codec to decode) and leaves every other
frame to the parser (``cpmeta.broadcast.wire``'s
``FrameReader.parse`` and ``read_region``). These tests hold it to the parser: on named and
random steps it takes the frame and gives what the parser gives; on every byte of hostile frames
(flipped, resealed so the crc passes, cut, extended) it either leaves the frame to the parser or
gives exactly what the parser accepts -- never a frame the parser refuses.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliability_wire import reseal
from cpmeta.broadcast.plan import Plan
from cpmeta.broadcast.wire import FLAG_CRC, FLAG_LAYOUT, FLAG_PACKED, FrameReader, FrameWriter, blocks_at, seal
from cpmeta.replicate.ops import BLK, FIN, SID, TOK, OpLog
from cpmeta.replicate.step_frame import STEP_SCHEMA, StepReader, read_region, step_key
from cpmeta.transport.codec import encode_body

_WRITER = FrameWriter(STEP_SCHEMA, Plan)
LID, PLAN, LBLOCK = _WRITER.layout(step_key())


#: request ids of every msgpack form the compiled read walks: fixstr, str 8 / 16 / 32 (multi-byte
#: UTF-8), positive and negative ints of each width
IDS = ["a", "", "req-" + "x" * 40, "é" * 200, "ü" * 40000, 0, 127, 128, 2**16, 2**40, 2**63 - 1, -1, -33, -2**15,
       -2**63]


def _log(n: int, seed: int, drafts: int = 0, specs: int = 1, ids: Sequence[Any] = ()) -> OpLog:
    """A decode-like step of ``n`` sequences: a token run, a block run, a finish, a state id,
    ``specs`` decode specs (``drafts`` per sequence); with ``ids``, one added request each
    (two tokens, one block) first."""
    rng = np.random.default_rng(seed)
    log = OpLog(max(n, 2) + 2 + len(ids))
    for i, rid in enumerate(ids):
        log.add(n + 2 + i, rid, [5, 6], [9], [], i, 0, 0)
    slots = np.arange(n, dtype=np.int64)
    log.ragged(TOK, slots, np.ones(n, np.int64), rng.integers(0, 2**31, n))
    if n:
        log.ragged(BLK, slots[:1], np.array([2]), rng.integers(0, 999, 2))
        log.pair(SID, 0, 5)
    log.finish(np.array([n], np.int64)) if n else None
    _ = FIN
    for _i in range(specs):
        d = np.arange(n * drafts, dtype=np.int64)
        log.batch_spec(False, slots, np.zeros(0, np.int64), d, 1, True, drafts if drafts else -2)
    # the words the spec kernel wrote, from the calls' arguments (what every frame carries)
    assert log.specs == [0, 1, 1, drafts if drafts else -2, n, 0, n * drafts] * specs, log.specs
    return log


def _frame(log: OpLog, step: int, *, values: Optional[list[Any]] = None, flags: int = FLAG_PACKED,
           rstep: Optional[int] = None) -> bytes:
    """The frame ``ReplicatedBatchState._send`` writes for ``log`` (frame step ``step``; the
    replica's step in the values ``rstep``, default the same)."""
    digest = np.arange(4 * (len(log.specs) // 7 + 1), dtype=np.int64).reshape(-1, 4)
    vals = values if values is not None else [step if rstep is None else rstep, step % 3 == 0, list(log.req_ids),
                                              list(log.specs)]
    vblock = encode_body(vals)
    lblock = LBLOCK if flags & FLAG_LAYOUT else b""
    dims, total = log.layout(digest)
    exact = 8 * total
    shapes_at, data_at = blocks_at(len(lblock), len(vblock), PLAN.n_dims)
    buf = bytearray(data_at + -(-exact // 16) * 16)
    view = memoryview(buf)
    _WRITER.write(view, flags, LID, lblock, vblock, PLAN, dims, exact, shapes_at, step)
    assert log.pack_into(digest, np.frombuffer(view, np.int64, total, data_at)) == total
    seal(view, data_at, bool(flags & FLAG_CRC))
    return bytes(buf)


def _parser() -> FrameReader:
    """A follower's parser holding the step layout (as after its first frame)."""
    r = FrameReader(STEP_SCHEMA, Plan, False)
    first = _frame(_log(1, 0), 1, flags=FLAG_PACKED | FLAG_LAYOUT)
    r.keep(r.parse(memoryview(first), 0))
    return r


def _by_parser(frame: bytes, want: int) -> Any:
    """What the parser path gives (``ReplicatedBatchState``'s handler): ``(columns, values)`` as
    plain lists, or the exception it raises."""
    r = _parser()
    r.step = want - 1
    view = memoryview(frame)
    try:
        f = r.parse(view, 0)
        h = f.head
        if not h.flags & FLAG_PACKED:
            raise ValueError("step frame without FLAG_PACKED")
        cols, _ = read_region(f, np.frombuffer(view, np.int64, h.n_dims, h.shapes_at),
                              np.frombuffer(view, np.uint8, len(frame) - h.data_at, h.data_at))
    except Exception as e:  # noqa: BLE001 - the outcome compared
        return type(e).__name__
    return _plain(cols, f.values)


def _plain(cols: Any, values: list[Any]) -> tuple:
    return (cols.buf.tolist(), cols.starts.tolist(), tuple(cols.dims), values)


def _compiled(frame: bytes, want: int) -> Any:
    reader = StepReader(STEP_SCHEMA.fingerprint.encode())
    reader.arm(LID)
    got = reader.read(memoryview(frame), want)
    if got is None:
        return None
    cols, region, data_at, values, fused = got
    assert fused is None  # nothing applied without a replica
    assert region.tobytes() == frame[data_at:]  # the whole region, a private copy
    return _plain(cols, values)


@pytest.mark.parametrize("n,drafts,specs", [(0, 0, 1), (1, 0, 1), (64, 0, 1), (64, 2, 1), (256, 0, 1), (3, 1, 2),
                                            (2, 0, 0)])
def test_common_frames_read_as_the_parser_reads_them(n: int, drafts: int, specs: int) -> None:
    frame = _frame(_log(n, n, drafts, specs), 7)
    want = _by_parser(frame, 7)
    assert isinstance(want, tuple), want
    assert _compiled(frame, 7) == want
    assert _compiled(frame, 8) is None  # another step: the parser names the gap / replay


@pytest.mark.parametrize("ids", [IDS[:1], IDS, IDS[5:], IDS[:5] * 4])
def test_frames_with_request_ids_read_as_the_parser_reads_them(ids: list[Any]) -> None:
    """A step that adds requests: the compiled read walks the ids' array and the codec decodes
    it; the same values and columns as the parser's."""
    frame = _frame(_log(3, 1, ids=ids), 7)
    want = _by_parser(frame, 7)
    assert isinstance(want, tuple) and want[3][2] == ids
    assert _compiled(frame, 7) == want


ID = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.integers(0, 40), drafts=st.integers(0, 3), specs=st.integers(0, 3), step=st.integers(1, 2**40),
       rstep=st.integers(-(2**63), 2**63 - 1), ids=st.lists(ID, max_size=20))
def test_random_frames_read_as_the_parser_reads_them(n: int, drafts: int, specs: int, step: int, rstep: int,
                                                     ids: list[Any]) -> None:
    frame = _frame(_log(n, step % 97, drafts, specs, ids), step, rstep=rstep)
    want = _by_parser(frame, step)
    assert isinstance(want, tuple) and _compiled(frame, step) == want


def test_a_request_id_of_broken_utf8_goes_to_the_parser() -> None:
    """The kernel walks a str's bytes without reading them; the codec's decode refuses broken
    UTF-8, so the read leaves the frame to the parser, which names it."""
    frame = bytearray(_frame(_log(2, 1, ids=["abé"]), 7))
    at = bytes(frame).index("abé".encode())
    frame[at + 3] = 0x28  # é's second byte: no longer UTF-8
    bad = reseal(bytes(frame), False)
    assert _compiled(bad, 7) is None
    assert _by_parser(bad, 7) == "CodecError"  # (the channel reports it as a malformed frame)


@pytest.mark.parametrize("why,kw", [
    ("a uint64 request id", {"values": [7, False, ["req-a", 2**64 - 1], [0, 0, 1, -2, 1, 0, 0]]}),
    ("a bool request id", {"values": [7, False, [True], [0, 0, 1, -2, 1, 0, 0]]}),
    ("a float request id", {"values": [7, False, [1.0], [0, 0, 1, -2, 1, 0, 0]]}),
    ("a bytes request id", {"values": [7, False, [b"r"], [0, 0, 1, -2, 1, 0, 0]]}),
    ("a tuple request id", {"values": [7, False, [(1, 2)], [0, 0, 1, -2, 1, 0, 0]]}),
    ("no request list", {"values": [7, False, None, [0, 0, 1, -2, 1, 0, 0]]}),
    ("the layout block", {"flags": FLAG_PACKED | FLAG_LAYOUT}),
    ("a checksum", {"flags": FLAG_PACKED | FLAG_CRC}),
    ("a uint64 spec word", {"values": [7, False, [], [2**64 - 1]]}),
    ("a float", {"values": [7, False, [], [1.0]]}),
    ("five values", {"values": [7, False, [], [], 1]}),
    ("a str step", {"values": ["7", False, [], []]}),
])
def test_other_frames_go_to_the_parser(why: str, kw: dict) -> None:
    frame = _frame(_log(4, 1), 7, **kw)
    assert _compiled(frame, 7) is None, why


def _hostile(frame: bytes) -> list[bytes]:
    """Every byte flipped (bit 0, bit 7, set to 0 / 0xff), each as it is and resealed (the meta
    crc recomputed, as a writer that knows the format would), the values block's length grown
    into its padding (resealed), cut at every 8 bytes, extended."""
    out = []
    for i in range(len(frame)):
        for v in (frame[i] ^ 1, frame[i] ^ 0x80, 0, 0xFF):
            if v != frame[i]:
                b = frame[:i] + bytes((v,)) + frame[i + 1:]
                out += [b, reseal(b, False)]
    vlen = int.from_bytes(frame[36:40], "little")
    for extra in range(1, 9):  # trailing bytes after the values' list
        out.append(reseal(frame[:36] + (vlen + extra).to_bytes(4, "little") + frame[40:], False))
    out += [frame[:k] for k in range(0, len(frame), 8)]
    out += [frame + bytes(16), frame + bytes(1)]
    return out


@pytest.mark.parametrize("n,drafts,ids", [(2, 0, ()), (3, 2, ()), (1, 0, ("r1", 300, "é" * 20, -5))])
def test_hostile_frames_never_taken_where_the_parser_refuses(n: int, drafts: int, ids: tuple) -> None:
    """On every byte: the compiled read leaves the frame to the parser, or gives exactly what the
    parser accepts (request ids included: a flip inside a str that breaks its UTF-8 the codec's
    decode refuses, and the parser names)."""
    frame = _frame(_log(n, 5, drafts, ids=ids), 9)
    taken = 0
    for bad in _hostile(frame):
        got = _compiled(bad, 9)
        if got is not None:
            assert got == _by_parser(bad, 9), bad.hex()
            taken += 1
    # resealed flips of ids and spec words stay valid frames: some are taken (and checked above)
    assert taken > 0
