"""The driver's compiled step frame writer (``step_write_njit.write_step_frame``) against the codec.

The writer takes only the common step frame (the layout every follower holds, no checksum; the
request ids as the codec's bytes); these tests hold its bytes to what the codec writes for the same step
(``FrameWriter.write`` + ``encode_body`` + ``OpLog.pack_into`` + ``seal``, as
``tests/test_step_read.py``'s ``_frame`` puts them together) on named and random steps and on
every msgpack int width of the spec words, into a slot full of stale bytes (the writer zeroes
the padding the codec leaves as it finds it); the parser and the compiled read take what it
writes. ``send_step_frame`` (the same writer claiming and publishing its ring slots in one call)
publishes those bytes in a real ring, or nothing when the ring cannot take the frame now. A
``ReplicatedBatchState`` run (``tests/test_replicate.py``) sends with it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_step_read import ID, IDS, LID, _by_parser, _compiled, _frame, _log
from cpmeta.broadcast.wire import blocks_at
from cpmeta.buffers import pack_up
from cpmeta.replicate.ops import WIDTHS, OpLog
from cpmeta.replicate.step_frame import STEP_SCHEMA, fixed_head
from cpmeta.replicate.step_write_njit import S_VALUES, send_step_frame, step_frame_size, write_step_frame
from cpmeta.transport import ShmRing, ShmRingHandle
from cpmeta.transport.codec import encode_body
from cpmeta.transport.ring_njit import CLAIM_SLOW

FIXED = fixed_head(STEP_SCHEMA.fingerprint.encode())


def _written(log: OpLog, frame_step: int, rstep: int, check: bool) -> bytes:
    """The compiled writer's frame of ``log`` (``_frame``'s digest), into a slot of stale bytes."""
    digest = _digest(log)
    words = log.words  # as the driver's send takes them (the spec kernel wrote them; _log checks their values)
    assert words.dtype == np.int64
    ids = np.frombuffer(encode_body(list(log.req_ids)), np.uint8)
    flat, off, n, dims, starts = log.buffers
    total, vlen = step_frame_size(flat, off, n, digest, WIDTHS, dims, starts, rstep, words, ids)
    assert vlen == len(encode_body([rstep, check, list(log.req_ids), list(log.specs)]))
    data_at = blocks_at(0, vlen, len(dims))[1]
    slot = np.full(data_at + pack_up(8 * total), 0xAB, np.uint8)
    got = write_step_frame(slot, slot[data_at:data_at + 8 * total].view(np.int64), FIXED, LID, frame_step, rstep,
                           check, ids, words, dims, flat, off, n, digest, WIDTHS, starts)
    assert got == total
    return slot.tobytes()


def _digest(log: OpLog) -> np.ndarray:
    return np.arange(4 * (len(log.specs) // 7 + 1), dtype=np.int64).reshape(-1, 4)


def _same_as_codec(log: OpLog, frame_step: int, rstep: int, check: bool) -> None:
    got = _written(log, frame_step, rstep, check)
    want = _frame(log, frame_step, values=[rstep, check, list(log.req_ids), list(log.specs)])
    assert len(got) == len(want)
    bad = [i for i in range(len(got)) if got[i] != want[i]]
    assert not bad, f"bytes {bad[:8]} differ (frame of {len(got)})"
    parsed = _by_parser(got, frame_step)
    assert isinstance(parsed, tuple) and _compiled(got, frame_step) == parsed


@pytest.mark.parametrize("n,drafts,specs", [(0, 0, 1), (1, 0, 1), (64, 0, 1), (64, 2, 1), (256, 0, 1), (3, 1, 2),
                                            (2, 0, 0), (5, 1, 3)])
def test_common_frames_written_as_the_codec_writes_them(n: int, drafts: int, specs: int) -> None:
    _same_as_codec(_log(n, n, drafts, specs), 7, 7, n % 2 == 1)


@pytest.mark.parametrize("ids", [IDS[:1], IDS, IDS[5:], IDS[:5] * 4])
def test_frames_with_request_ids_written_as_the_codec_writes_them(ids: list) -> None:
    _same_as_codec(_log(3, 1, ids=ids), 7, 7, True)


@pytest.mark.parametrize("word", [0, 1, 31, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
                                  -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63])
def test_every_int_width_of_the_values(word: int) -> None:
    """The spec words and the step in each of msgpack's int encodings (``words[1]`` is the
    placeholder count, ``words[3]`` the uniform draft count: any int64 the log holds)."""
    log = OpLog(4)
    log.batch_spec(False, np.array([0, 1]), np.zeros(0, np.int64), np.zeros(0, np.int64), word, True, word)
    assert log.specs == [0, word, 1, word, 2, 0, 0]
    _same_as_codec(log, 3, abs(word) if word != -2**63 else 5, True)


def test_spec_words_are_the_specs_past_their_first_room_and_after_extend() -> None:
    """``OpLog.words`` (the spec words the driver's writer sends, written by the spec's kernel)
    are each spec's arguments after more specs than its first room holds, after ``extend`` (a
    step's calls between two specs) and after ``clear``; a spec refused for a dead slot adds none."""
    log, later = OpLog(4), OpLog(4)
    for i in range(11):
        log.batch_spec(i % 2 == 0, np.array([0, 1]), np.array([1, 2]), np.zeros(0, np.int64), i, True, -2 - i)
    later.batch_spec(False, np.array([2]), np.zeros(0, np.int64), np.array([5, 6]), 1, False, 2)
    log.extend(later)
    want = [w for i in range(11) for w in (int(i % 2 == 0), i, 1, -2 - i, 2, 2, 0)] + [0, 1, 0, 2, 1, 0, 2]
    assert log.words.tolist() == log.specs == want
    log.clear()
    active, mark, err = np.array([1, 0], np.int64), np.zeros(2, np.int64), np.zeros(4, np.int64)
    assert log.batch_spec(False, np.array([1]), np.zeros(0, np.int64), np.zeros(0, np.int64), 0, True, 0,
                          live=(active, mark, err)) == -3
    log.batch_spec(True, np.array([3]), np.array([4]), np.zeros(0, np.int64), 0, False, -2)
    assert log.specs == log.words.tolist() == [1, 0, 0, -2, 1, 1, 0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.integers(0, 40), drafts=st.integers(0, 3), specs=st.integers(0, 4), frame_step=st.integers(1, 2**40),
       rstep=st.integers(1, 2**62), check=st.booleans(), ids=st.lists(ID, max_size=12))
def test_random_frames_written_as_the_codec_writes_them(n: int, drafts: int, specs: int, frame_step: int, rstep: int,
                                                        check: bool, ids: list) -> None:
    _same_as_codec(_log(n, frame_step % 1000, drafts, specs, ids), frame_step, rstep, check)


def test_a_region_of_another_length_is_refused_unsealed() -> None:
    """A region view that is not the columns' length (they changed since the sizes): nothing
    sealed, ``-need`` or the count returned, not the region's length."""
    log = _log(3, 0)
    digest = np.zeros((2, 4), np.int64)
    words = np.array(log.specs, np.int64)
    flat, off, n, dims, starts = log.buffers
    none = np.frombuffer(encode_body([]), np.uint8)
    total, _ = step_frame_size(flat, off, n, digest, WIDTHS, dims, starts, 1, words, none)
    slot = np.zeros(4096, np.uint8)
    for k in (total - 1, total + 1):
        got = write_step_frame(slot, slot[256:256 + 8 * k].view(np.int64), FIXED, LID, 1, 1, False, none, words, dims,
                               flat, off, n, digest, WIDTHS, starts)
        assert got < 0 and not slot[:64].any()


def _sent(w: ShmRing, log: OpLog, frame_step: int, rstep: int, check: bool, max_values: int = 1 << 20) -> int:
    """``send_step_frame`` of ``log`` into the ring ``w`` (then ``direct_published``): its return."""
    words, ids = np.array(log.specs, np.int64), np.frombuffer(encode_body(list(log.req_ids)), np.uint8)
    flat, off, n, dims, starts = log.buffers
    got = int(send_step_frame(*w.direct(), FIXED, LID, frame_step, rstep, check, ids, words, flat, off, n, dims,
                              starts, _digest(log), WIDTHS, max_values))
    if got >= 0:
        w.direct_published(bool(got))
    return got


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.integers(0, 40), drafts=st.integers(0, 3), specs=st.integers(0, 4), frame_step=st.integers(1, 2**40),
       rstep=st.integers(1, 2**62), check=st.booleans(), ids=st.lists(ID, max_size=12))
def test_random_frames_claimed_written_and_published_in_a_ring_as_the_writer_writes_them(
        n: int, drafts: int, specs: int, frame_step: int, rstep: int, check: bool, ids: list) -> None:
    """``send_step_frame`` (the driver's send in one call) publishes in a real ring the bytes the
    compiled writer writes into a slot (the codec's, above), as one message a reader takes whole."""
    w = ShmRing.create(1, slot_size=4096, num_slots=8, timeout=5.0)
    r = ShmRing.attach(ShmRingHandle.from_bytes(w.handle.to_bytes()), 0, timeout=5.0)
    try:
        log = _log(n, frame_step % 1000, drafts, specs, ids)
        assert _sent(w, log, frame_step, rstep, check) >= 0
        assert r.read_bytes() == _written(log, frame_step, rstep, check)
    finally:
        r.close()
        w.close()


def test_a_send_the_ring_cannot_take_now_publishes_nothing() -> None:
    """Nothing is published (the head stays) when the values are over the limit (the codec's path
    names them) or the slots are not free (the reader holds them: the Python path waits); the
    frame goes once the reader frees them."""
    w = ShmRing.create(1, slot_size=1024, num_slots=2, timeout=5.0)
    r = ShmRing.attach(ShmRingHandle.from_bytes(w.handle.to_bytes()), 0, timeout=5.0)
    try:
        log = _log(3, 1)
        assert _sent(w, log, 1, 1, False, max_values=4) == S_VALUES and w.backlog() == 0
        assert _sent(w, log, 1, 1, False) >= 0 and _sent(w, log, 2, 2, False) >= 0 and w.backlog() == 2
        assert _sent(w, log, 3, 3, False) == CLAIM_SLOW and w.backlog() == 2  # both slots unread
        assert r.read_bytes() == _written(log, 1, 1, False)
        assert _sent(w, log, 3, 3, False) >= 0 and w.backlog() == 2  # the claim read the reader's tail
        assert [r.read_bytes() for _ in range(2)] == [_written(log, s, s, False) for s in (2, 3)]
    finally:
        r.close()
        w.close()
