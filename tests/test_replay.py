"""A follower's replay of a step frame (``cpmeta.replicate.apply.apply_step``: the compiled
append / batch-spec replay, Python for the rest) against the driver's direct ``BatchState`` calls.

The driver side is the real recorder (``cpmeta.replicate.recorder.Recorder``) on a plain state,
no process group: its calls apply to state A and are recorded as ``ReplicatedBatchState._send``
frames them; state B applies each frame and must return A's batches and stand where A stood at
the frame's last batch spec. Malformed frames raise the named error and leave the refused run
unwritten.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmeta import BatchState, OutputArenas, SequenceBatch, prepare_decode
from cpmeta.builders.decode_sink import DecodeSink
from cpmeta.testing import assert_same
from cpmeta.launch.scheduler import default_config, plain_config
from cpmeta.replicate import apply as apply_mod
from cpmeta.replicate.apply import Gathered, ReplicaError, apply_step, batches_of
from cpmeta.replicate.digest import batch_check
from cpmeta.replicate.ops import ADD, BLK, CMP, COLUMNS, FIN, SPEC, TOK, OpLog
from cpmeta.replicate.recorder import Recorder
from cpmeta.broadcast.plan import Plan
from cpmeta.broadcast.wire import (FLAG_CRC, FLAG_LAYOUT, FLAG_PACKED, PACK_ALIGN, FrameReader, FrameWriter, WireError,
                                   blocks_at, seal)
from cpmeta.replicate.ops import Columns
from cpmeta.replicate.step_frame import STEP_SCHEMA, FusedStep, read_region, step_key
from cpmeta.replicate.step_read_njit import F_PART
from cpmeta.transport.codec import encode_body

CFGS = {"plain": plain_config(max_model_len=2048), "seed": default_config(max_model_len=2048)}  # seed: Engram + SWA
NO_DIGEST = np.zeros((0, 4), np.int64)
ROOT = Path(__file__).resolve().parents[1]
COL = {c: i for i, c in enumerate(COLUMNS)}
ARRAY_FIELDS = [f.name for f in dataclasses.fields(SequenceBatch) if f.name not in ("is_prompt", "lookback", "_vouch")]


def flat_columns(cols: list[np.ndarray]) -> Columns:
    """Columns given one array each (``OpLog.columns``, maybe altered) as ONE int64 buffer, as a
    follower holds them after ``read_region``."""
    buf = np.concatenate([c.ravel() for c in cols])
    starts = np.array([0, *itertools.accumulate(c.size for c in cols)], np.int64)
    return Columns(buf, starts)


def _state(cfg_name: str) -> BatchState:
    return BatchState(CFGS[cfg_name], max_seqs=8, max_tokens=48, max_blocks=8)


def _public(s: BatchState, full: bool = False) -> dict[str, Any]:
    """The state's public arrays (copies); ``full``: whole rows, else each row's used part."""
    def rows(a: np.ndarray, k: np.ndarray) -> np.ndarray:
        return a.copy() if full else np.concatenate([a[i, :k[i]] for i in range(s.max_seqs)])
    out = {"token_ids": rows(s.token_ids, s.num_tokens), "block_table": rows(s.block_table, s.num_blocks),
           "compressed": rows(s.compressed, s.num_compressed), "free_slots": s.free_slots(),
           "requests": [s.request_of(i) for i in range(s.max_seqs)]}
    for name in ("num_tokens", "num_computed", "prompt_len", "num_blocks", "num_compressed", "state_id",
                 "swa_valid_start", "active"):
        out[name] = getattr(s, name).copy()
    return out


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    for name, w in want.items():
        assert np.array_equal(got[name], w), (name, got[name], w)


def _assert_same_batches(got: list[SequenceBatch], want: list[SequenceBatch]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for name in ARRAY_FIELDS:
            a, b = getattr(g, name), getattr(w, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (name, a, b)
        assert (g.is_prompt, g.lookback, g._vouch is None) == (w.is_prompt, w.lookback, w._vouch is None)


class _Driver(Recorder):
    """The recorder's calls on a plain ``BatchState`` (state A); :meth:`frame` cuts a step as
    ``ReplicatedBatchState._send`` does and notes where A stood at the step's last spec."""

    def __init__(self, state: BatchState) -> None:
        self.state = state
        self._init_recorder()
        self._at_last_spec: dict[str, Any] | None = None

    def _driver(self, what: str) -> None:
        pass

    def _at_spec(self) -> None:
        self._at_last_spec = _public(self.state)

    def frame(self) -> tuple[Any, list[Any], list[int], list[SequenceBatch], dict[str, Any]]:
        log = self._log
        _assert_frame_as_codec_writes(log, batch_check(self._batches))
        out = (log.pack(NO_DIGEST), list(log.req_ids), list(log.specs), list(self._batches),
               self._at_last_spec or _public(self.state))
        self._log, self._next = self._next, log  # calls after the last spec open the next step
        log.clear()
        self._batches, self._pending, self._at_last_spec = [], [], None
        return out


def _frame_bytes(log: OpLog, digest: np.ndarray, compiled: bool) -> bytes:
    """Step 3's frame of ``log``'s columns: as ``ReplicatedBatchState._send`` writes it
    (``compiled``: ``OpLog.layout`` sizes one run, ``OpLog.pack_into`` writes the region straight
    into the frame), or as the common
    codec writes any dataclass of tensors (the columns as torch tensors, ``Plan.sizes`` and
    ``Plan.pack``: the oracle)."""
    values = [3, False, list(log.req_ids), list(log.specs)]
    writer = FrameWriter(STEP_SCHEMA, Plan)
    lid, plan, lblock = writer.layout(step_key())
    vblock = encode_body(values)
    if compiled:
        dims, total = log.layout(digest)
        exact = 8 * total
        region = -(-exact // PACK_ALIGN) * PACK_ALIGN
    else:
        tensors = [torch.from_numpy(c.copy()) for c in log.columns(digest)]
        dims = tuple(d for t in tensors for d in t.shape)
        numels, starts, region, exact = plan.sizes(dims)
    shapes_at, data_at = blocks_at(len(lblock), len(vblock), plan.n_dims)
    buf = bytearray(data_at + region)
    view = memoryview(buf)
    writer.write(view, FLAG_PACKED | FLAG_LAYOUT | FLAG_CRC, lid, lblock, vblock, plan, dims, exact, shapes_at, 3)
    if compiled:
        assert log.pack_into(digest, np.frombuffer(view, np.int64, total, data_at)) == total
    else:
        src = (ctypes.c_char * len(buf)).from_buffer(buf)
        plan.pack(ctypes.addressof(src) + data_at, tensors, dims, numels, starts, region)
        del src
    seal(view, data_at, True)
    return bytes(buf)


def _assert_frame_as_codec_writes(log: OpLog, digest: np.ndarray) -> None:
    """The driver's compiled frame is, byte for byte, the common codec's frame of the same
    columns; a follower's ``read_region`` of it gives the log's columns back."""
    got, want = _frame_bytes(log, digest, True), _frame_bytes(log, digest, False)
    assert got == want
    reader = FrameReader(STEP_SCHEMA, Plan, True)
    reader.step = 2
    view = memoryview(got)
    frame = reader.parse(view, 0)
    h = frame.head
    cols, _ = read_region(frame, np.frombuffer(view, np.int64, h.n_dims, h.shapes_at),
                          np.frombuffer(view, np.uint8, len(got) - h.data_at, h.data_at))
    for c, w in zip([cols.col(i) for i in range(len(COLUMNS))], log.columns(digest)):
        assert c.shape == w.shape and np.array_equal(c, w)


def _sync_one(d: _Driver, b: BatchState, sink: DecodeSink | None = None) -> list[SequenceBatch]:
    """One step: B applies A's frame; B's batches and state must equal A's, and no append run or
    batch spec of this valid frame left the compiled replay for the Python one -- nor an add or
    a finish, unless the frame adds an id B holds at its start (one finished and added again).
    With ``sink``: each decode batch's metadata the replay built equals ``prepare_decode`` of
    A's batch; one it did not build is built through the sink (as ``sync_metadata`` does)."""
    cols, req_ids, specs, want, at_spec = d.frame()
    fresh = b.all_new(req_ids)
    with mock.patch.object(apply_mod, "_run", wraps=apply_mod._run) as in_python:
        got, check, mds = apply_step(b, cols, req_ids, specs, sink)
    assert len(mds) == len(got) and (sink is not None or mds == [None] * len(got))
    for md, bt, w in zip(mds, got, want):
        if sink is None or bt.is_prompt:
            continue
        try:
            expected = prepare_decode(w, b.cfg)
        except ValueError as e:  # a batch the builder refuses: never built in the replay's call
            assert md is None
            with pytest.raises(ValueError) as refused:
                sink.build(bt)
            assert str(refused.value) == str(e)
            continue
        assert_same(md if md is not None else sink.build(bt), expected)
    codes = [call.args[3] for call in in_python.call_args_list]  # _run(state, cols, at, code, ...)
    assert not ({TOK, BLK, CMP, SPEC} | ({ADD, FIN} if fresh else set())) & set(codes), codes
    _assert_same_batches(got, want)
    want_check = batch_check(want)  # the step check the replay wrote = the driver's batch_check
    assert check.shape == want_check.shape and np.array_equal(check, want_check), (check, want_check)
    _assert_same_state(_public(b), at_spec)
    return got


@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_named_steps_replay_as_driver_calls(cfg_name: str) -> None:
    """Prefill chunks (placeholders, advance off), a mixed step, decode with drafts None / one
    count / per-slot counts, two appends to one slot, finish + re-add in one step, a step
    without a spec: every frame replays to A's batches and A's state."""
    engram = CFGS[cfg_name].max_ngram_size > 0
    d, b = _Driver(_state(cfg_name)), _state(cfg_name)
    sink = DecodeSink(b.cfg, OutputArenas())
    _sync = functools.partial(_sync_one, sink=sink)
    comp = [40, 41] if engram else []
    x = d.add_request("a", [3, 4, 5, 6, 7, 8], [1], 1, compressed_token_ids=comp)
    y = d.add_request(7, [9, 10, 11, 12], [2, 3], 2, num_computed=4, swa_valid_start=1)
    d.prompt_batch([x], [4], num_placeholders=1)
    d.append_blocks(x, [5])  # after the spec: travels with the next frame
    assert len(_sync(d, b)) == 1
    d.prompt_batch([x], [1], advance=False)
    d.append_tokens(y, [13])  # between two specs of one step (a mixed step)
    d.prompt_batch([x], [2])
    d.decode_batch(np.array([y]))
    assert [bt.is_prompt for bt in _sync(d, b)] == [True, True, False]
    d.append_tokens_batch(np.array([x, y]), np.array([14, 15, 16]), np.array([1, 2]))
    d.append_tokens(x, [17])  # x again: a new run keeps the order
    d.append_blocks_batch(np.array([y, x]), np.array([6, 7]), np.array([1, 1]))
    d.set_state_id(y, 5)
    d.set_swa_valid_start(x, 2)
    if engram:
        d.append_compressed_batch(np.array([x, y]), np.array([42, 43, 44]), np.array([2, 1]))
    d.decode_batch(np.array([x, y]), np.array([20, 21, 22, 23]), 2)
    _sync(d, b)
    d.decode_batch(np.array([y, x]), np.array([24, 25, 26]), np.array([1, 2]), num_placeholders=2)
    d.decode_batch(np.array([x]), None, np.int64(0))
    _sync(d, b)
    d.finish(x)
    z = d.add_request("c", [1, 2], [8], 3)  # x's slot again
    assert z == x
    d.append_tokens(z, [9])
    d.decode_batch(np.array([y]), np.array([27]), [1])
    _sync(d, b)
    d.finish(y)
    d.set_state_id(z, 6)
    assert _sync(d, b) == []  # ops only: no batch
    _assert_same_state(_public(b), _public(d.state))


@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_decode_steps_built_in_the_replay_call(cfg_name: str) -> None:
    """Steady decode steps (the shape of the last step) are built by the replay's own call
    (``replay_decode``), into the same arena every step, each equal to ``prepare_decode`` of the
    driver's batch; a new shape (a longer table, another batch size) falls back to the sink's
    ``prepare_decode`` once, then the replay builds again -- also for a batch size that comes
    back (the sink aims by the spec's rows and sequences)."""
    cfg = CFGS[cfg_name] if cfg_name == "plain" else default_config(max_model_len=4096)  # 32 blocks a row
    d, b = (_Driver(BatchState(cfg, 4, max_tokens=32, max_blocks=20)), BatchState(cfg, 4, max_tokens=32, max_blocks=20))
    arenas = OutputArenas()
    sink = DecodeSink(cfg, arenas)
    comp = [1, 2] if cfg.max_ngram_size > 0 else []
    slots = np.array([d.add_request(i, [5 + i, 6, 7], [i], i, compressed_token_ids=comp, num_computed=3)
                      for i in range(3)])
    fused: list[bool] = []
    addr: list[int] = []
    for step in range(9):
        d.append_tokens_batch(slots, np.arange(3, dtype=np.int64) + 10 * step, np.ones(3, np.int64))
        if step == 4:  # past block 16 on every table: the widest row goes from 16 columns to 32
            d.append_blocks_batch(slots, np.arange(48, dtype=np.int64) % 8, np.full(3, 16, np.int64))
        two = step in (6, 8)  # a sequence sits out steps 6 and 8
        d.decode_batch(slots[:2] if two else slots, np.arange(4 if two else 6) + 100, 2)
        cols, req_ids, specs, want, _ = d.frame()
        got, _, mds = apply_step(b, cols, req_ids, specs, sink, lazy=step % 2 == 1)
        fused.append(mds[0] is not None)
        # lazy (as sync_metadata asks): a batch built in the call comes unmade, equal once made
        assert isinstance(got[0], Gathered) == (step % 2 == 1 and fused[-1]), (step, got)
        _assert_same_batches(batches_of(got), want)
        md = mds[0] if mds[0] is not None else sink.build(got[0])
        assert_same(md, prepare_decode(want[0], cfg))
        addr.append(md.positions.data_ptr())
    assert fused == [False, True, True, True, False, True, False, True, True], fused
    assert addr[1:4] == [addr[0]] * 3 and addr[5] == addr[4] == addr[7] and addr[8] == addr[6]
    assert len(arenas) == 3


@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_decode_steps_replayed_and_built_in_one_call(cfg_name: str) -> None:
    """``FusedStep.apply`` (a follower's compiled read and a ``defer_apply`` driver run it): a
    step of appends and one decode spec of the sink's last shape is replayed AND built by one
    call from its columns; its batch, step check, metadata and state equal the two-call path's
    (``apply_step`` alone, on a twin) and ``prepare_decode`` of the driver's batch; any other step
    (an add, a new shape, a prompt) is left to ``apply_step`` untouched. What the call did not
    build ``DecodeSink.fill`` builds (a wider table at step 4: a kernel that once noted that
    shape in the sink's aim filled it into the narrower arena); each step's metadata a new object."""
    cfg = CFGS[cfg_name] if cfg_name == "plain" else default_config(max_model_len=4096)
    mk = lambda: BatchState(cfg, 4, max_tokens=32, max_blocks=20)  # noqa: E731
    d, b, twin = _Driver(mk()), mk(), mk()
    sink, twin_sink, fuse = DecodeSink(cfg, OutputArenas()), DecodeSink(cfg, OutputArenas()), FusedStep()
    comp = [1, 2] if cfg.max_ngram_size > 0 else []
    slots = np.array([d.add_request(i, [5 + i, 6, 7], [i], i, compressed_token_ids=comp, num_computed=3)
                      for i in range(3)])
    done, made = [], []
    for step in range(10):
        d.append_tokens_batch(slots, np.arange(3, dtype=np.int64) + 10 * step, np.ones(3, np.int64))
        if step == 4:  # past block 16 on every table: a wider table, another shape
            d.append_blocks_batch(slots, np.arange(48, dtype=np.int64) % 8, np.full(3, 16, np.int64))
        if cfg.max_ngram_size > 0 and step % 3 == 1:
            d.append_compressed_batch(slots, np.arange(3, dtype=np.int64) + step, np.ones(3, np.int64))
        two = step in (6, 8)  # a sequence sits out steps 6 and 8
        d.decode_batch(slots[:2] if two else slots, np.arange(4 if two else 6) + 100, 2)
        cols, req_ids, specs, want, at_spec = d.frame()
        fused = fuse.apply(cols, specs, b, sink)
        done.append(fused is not None)
        got, check, mds = apply_step(b, cols, req_ids, specs, sink, lazy=True, fused=fused)
        got2, check2, mds2 = apply_step(twin, cols, req_ids, specs, twin_sink, lazy=True)
        assert np.array_equal(check, check2) and np.array_equal(check, batch_check(want))
        _assert_same_batches(batches_of(got), want)
        _assert_same_batches(batches_of(got2), want)
        assert (mds[0] is None) == (mds2[0] is None), step  # built in the replay's call either way
        # as sync_metadata builds what the call did not: fill (one kernel call when it can), else build
        md = mds[0] if mds[0] is not None else sink.fill(batches_of(got)[0])
        md2 = mds2[0] if mds2[0] is not None else twin_sink.build(batches_of(got2)[0])
        assert_same(md, prepare_decode(want[0], cfg))
        assert_same(md2, md)
        assert all(md is not m for m in made), step  # a new object every step (an engine may keep one)
        made.append(md)
        _assert_same_state(_public(b), at_spec)
        _assert_same_state(_public(b, full=True), _public(twin, full=True))
    assert done == [False, True, True, True, True, True, False, True, True, True], done  # step 6: a size not built yet
    assert fuse.count == sum(done)
    # another kind of step: nothing applied by the call, apply_step takes it
    d.finish(int(slots[2]))
    d.decode_batch(slots[:2], np.arange(4) + 100, 2)
    cols, req_ids, specs, want, _ = d.frame()
    assert fuse.apply(cols, specs, b, sink) is None
    _assert_same_batches(apply_step(b, cols, req_ids, specs, sink)[0], want)


@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_sink_fill_is_prepare_decode(cfg_name: str) -> None:
    """``DecodeSink.fill`` (a replicated rank's build of a batch its replay did not build, and
    the validating driver's build) equals ``prepare_decode`` on every batch -- one kernel call
    into the aimed arena when the batch has a shape built before (a batch size that comes and
    goes, a table that widens and another that does not), ``build`` else; a batch of user arrays
    (not vouched) is built, checked, as ``prepare_decode`` checks it."""
    cfg = CFGS[cfg_name] if cfg_name == "plain" else default_config(max_model_len=8192)
    st = BatchState(cfg, 4, max_tokens=32, max_blocks=40)
    comp = [1, 2] if cfg.max_ngram_size > 0 else []
    slots = np.array([st.add_request(i, [5 + i, 6, 7], [i], i, compressed_token_ids=comp, num_computed=3)
                      for i in range(3)])
    sink = DecodeSink(cfg, OutputArenas())
    built = []
    for step in range(10):
        st.append_tokens_batch(slots, np.arange(3, dtype=np.int64) + step, np.ones(3, np.int64))
        if step in (3, 7):  # tables past 16 and then 32 columns: wider shapes
            st.append_blocks_batch(slots, np.arange(48, dtype=np.int64) % 8, np.full(3, 16, np.int64))
        batch = st.decode_batch(slots[:2] if step % 2 else slots, np.arange(4 if step % 2 else 6) + 100, 2)
        before = sink.filled
        assert_same(sink.fill(batch), prepare_decode(batch, cfg))
        built.append(sink.filled > before)
    assert built == [False, False, True, False, False, True, True, False, False, True], built
    user = dataclasses.replace(batch)  # the same arrays, vouched for nothing
    assert user.vouch_for(cfg) is None
    assert_same(sink.fill(user), prepare_decode(batch, cfg))
    bad = dataclasses.replace(batch, block_tables=batch.block_tables + 10**9)
    with pytest.raises(ValueError, match="block"):
        sink.fill(bad)


def test_a_sink_that_never_built_fills_nothing() -> None:
    """A ``DecodeSink`` before its first ``build`` aims at no arena: the replay's call fills
    nothing, however many steps of one shape come (a kernel that once noted each batch's shape
    in the aim filled an arena the sink does not have on the second such step)."""
    cfg = CFGS["plain"]
    d, b = _Driver(BatchState(cfg, 4, max_tokens=32, max_blocks=20)), BatchState(cfg, 4, max_tokens=32, max_blocks=20)
    sink = DecodeSink(cfg, OutputArenas())
    slots = np.array([d.add_request(i, [5 + i, 6, 7], [i], i, num_computed=3) for i in range(3)])
    for step in range(3):
        d.append_tokens_batch(slots, np.arange(3, dtype=np.int64) + 10 * step, np.ones(3, np.int64))
        d.decode_batch(slots, np.arange(6) + 100, 2)
        cols, req_ids, specs, want, _ = d.frame()
        got, _, mds = apply_step(b, cols, req_ids, specs, sink)
        assert mds == [None] and sink.args[-1][0] == -1, step  # the kernel's code: not filled
        assert not sink.aimed(9, 3) and FusedStep().apply(cols, specs, b, sink) is None
        _assert_same_batches(got, want)


@pytest.mark.parametrize("tamper, exc, match", [
    (lambda c: _put(c, "tok_slots", 1, 5), ValueError, r"slots: expected slots of live requests, got \[5\]"),
    (lambda c: _put(c, "tok_flat", 1, -3), ValueError, "request 'b': tokens: expected ids >= 0, got -3"),
    (lambda c: c.__setitem__(COL["blk_flat"], np.append(c[COL["blk_flat"]], 4)), ReplicaError,
     "step frame: blk_flat holds 2 entries, its runs read 1"),
])
def test_refused_run_in_the_one_call_named_as_in_two(tamper: Callable, exc: type, match: str) -> None:
    """A decode step of the sink's shape whose append run the state refuses: the one call stops
    there, writing nothing of that run, and ``apply_step`` resumes and raises the error the
    two-call path raises (a column left unread: after the step, as there)."""
    def frame() -> tuple[list[np.ndarray], list[int]]:
        log = OpLog(8)
        log.ragged(BLK, np.array([0]), np.array([1]), np.array([9]))
        log.ragged(TOK, np.array([0, 1]), np.array([1, 1]), np.array([7, 8]))
        log.batch_spec(False, np.array([0, 1]), np.zeros(0, np.int64), np.zeros(0, np.int64), 0, True, -2)
        return [c.copy() for c in log.columns(NO_DIGEST)], list(log.specs)

    states, sinks = [_live3(), _live3(), _live3()], [DecodeSink(CFGS["plain"], OutputArenas()) for _ in range(3)]
    cols, words = frame()
    for s, k in zip(states, sinks):  # every replica has built this shape once: the sinks aim at it
        apply_step(s, flat_columns(cols), [], words, k)
        k.build(s.decode_batch(np.array([0, 1])))
    cols, words = frame()
    tamper(cols)
    fuse = FusedStep()
    fused = fuse.apply(flat_columns(cols), words, states[0], sinks[0])
    assert fused is not None and fused[0] == F_PART
    errors = []
    for s, k, f in ((states[0], sinks[0], fused), (states[1], sinks[1], None)):
        with pytest.raises(exc, match=match) as e:
            apply_step(s, flat_columns(cols), [], words, k, fused=f)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    _assert_same_state(_public(states[0], full=True), _public(states[1], full=True))


def _draw_calls(d: _Driver, data: st.DataObject, ids: list[int]) -> None:
    """One step's random driver calls; a call state A refuses is neither applied nor recorded."""
    s = d.state
    engram = s.cfg.max_ngram_size > 0
    ints = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    for _ in range(ints(0, 6)):
        live = [int(i) for i in np.flatnonzero(s.active)]
        done = [i for i in live if s.num_computed[i] == s.prompt_len[i]]
        op = data.draw(st.sampled_from(["add", "tok", "blk", "cmp", "sid", "svs", "fin", "prompt", "decode"]
                                       if live else ["add"]))
        some = data.draw(st.lists(st.sampled_from(done if op == "decode" and done else live or [0]),
                                  unique=True, max_size=4))
        counts = [ints(0, 3) for _ in some]
        flat = [ints(0, 999) for _ in range(sum(counts))]
        try:
            if op == "add":
                ids[0] += 1
                n = ints(1, 8)
                d.add_request(ids[0], [ints(0, 999) for _ in range(n)], [ints(0, 99) for _ in range(ints(0, 2))],
                              ints(0, 20), compressed_token_ids=list(range(ints(0, n) if engram else 0)),
                              swa_valid_start=ints(0, 4), num_computed=n if ints(0, 1) else ints(0, n))
            elif op in ("tok", "blk") or op == "cmp" and engram:
                call = {"tok": d.append_tokens_batch, "blk": d.append_blocks_batch, "cmp": d.append_compressed_batch}
                call[op](np.array(some, np.int64), np.array(flat, np.int64), np.array(counts, np.int64))
            elif op in ("sid", "svs") and some:
                (d.set_state_id if op == "sid" else d.set_swa_valid_start)(some[0], ints(0, 20))
            elif op == "fin" and some:
                d.finish(some[0]) if ints(0, 1) else d.finish_batch(some)
            elif op == "prompt":
                lens = [max(1, int(s.prompt_len[i] - s.num_computed[i])) for i in some]
                d.prompt_batch(some, [k if ints(0, 1) else ints(1, k) for k in lens], num_placeholders=ints(0, 2),
                               advance=ints(0, 3) > 0)
            elif op == "decode":
                k = ints(0, 2)  # drafts: none, one count for all, per-slot counts
                drafts = {"none": (None, None), "one": (np.arange(k * len(some)) + 100 if k else None, k),
                          "per": (np.array(flat, np.int64), np.array(counts, np.int64))}
                d.decode_batch(np.array(some, np.int64), *drafts[data.draw(st.sampled_from(list(drafts)))],
                               num_placeholders=ints(0, 2))
        except ValueError:
            pass  # refused by A (a capacity, a state id held, still in prefill ...): nothing recorded


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
@pytest.mark.parametrize("cfg_name", list(CFGS))
def test_random_steps_replay_as_driver_calls(cfg_name: str, data: st.DataObject) -> None:
    d, b, ids = _Driver(_state(cfg_name)), _state(cfg_name), [0]
    sink = DecodeSink(b.cfg, OutputArenas()) if data.draw(st.booleans()) else None
    for _ in range(data.draw(st.integers(1, 6))):
        _draw_calls(d, data, ids)
        _sync_one(d, b, sink)


# ---- malformed / refused frames -----------------------------------------------------------------
BIG = 2**63 - 1  # a count whose cursor + count would overflow int64 (the replay must not wrap)


def _live3() -> BatchState:
    """Slots 0 and 1 done with their prefill, slot 2 still in it (plain config)."""
    s = BatchState(CFGS["plain"], max_seqs=8, max_tokens=48, max_blocks=8)
    for rid, computed in (("a", 3), ("b", 3), ("c", 1)):
        s.add_request(rid, [3, 4, 5], [1], 0, num_computed=computed)
    return s


def _tok(log: OpLog, slots: list[int], counts: list[int], flat: list[int]) -> None:
    log.ragged(TOK, np.array(slots), np.array(counts), np.array(flat))


def _spec(log: OpLog, is_prompt: bool, slots: list[int], lens: list[int], drafts: list[int], n_ph: int,
          uniform: int) -> None:
    i64 = lambda v: np.array(v, np.int64)  # noqa: E731
    log.batch_spec(is_prompt, i64(slots), i64(lens), i64(drafts), n_ph, True, uniform)


def _put(cols: list[np.ndarray], name: str, at: Any, v: Any) -> None:
    cols[COL[name]][at] = v


def _case(name: str, record: Callable, tamper: Callable | None, exc: type, match: str) -> Any:
    return pytest.param(record, tamper, exc, match, id=name)


BAD = [  # (record the bad part, tamper (columns, spec words), exception, message)
    _case("tok_on_free_slot", lambda g: _tok(g, [5], [1], [7]), None, ValueError,
          r"slots: expected slots of live requests, got \[5\]"),
    _case("runs_past_tok_slots", lambda g: _tok(g, [1], [1], [7]), lambda c, w: _put(c, "runs", (-1, 1), 2),
          ReplicaError, "step frame: tok_slots holds 1 entries, its runs read 2"),
    _case("tok_flat_truncated", lambda g: _tok(g, [1], [2], [7, 8]),
          lambda c, w: c.__setitem__(COL["tok_flat"], c[COL["tok_flat"]][:1]),
          ReplicaError, "step frame: tok_flat holds 1 entries, its runs read 2"),
    _case("negative_token_id", lambda g: _tok(g, [1], [2], [7, 3]), lambda c, w: _put(c, "tok_flat", (1,), -3),
          ValueError, "request 'b': tokens: expected ids >= 0, got -3"),  # (the driver's log refuses it now)
    _case("decode_lens_not_per_slot", lambda g: _spec(g, False, [0, 1], [1], [5], 0, -1), None, ValueError,
          "num_drafts: expected 2 counts >= 0"),
    _case("decode_no_slots_with_drafts", lambda g: _spec(g, False, [], [], [5, 6], 0, 2), None, ValueError,
          r"num_drafts: expected 0 counts >= 0 \(or one count for all\) summing to 2 drafts"),
    _case("decode_drafts_without_counts", lambda g: _spec(g, False, [0, 1], [], [5, 6], 0, -2), None, ValueError,
          "num_drafts: expected 2 counts >= 0 summing to 2 drafts"),
    _case("prompt_negative_placeholders", lambda g: _spec(g, True, [2], [1], [], -1, -2), None, ValueError,
          "num_placeholders: expected >= 0, got -1"),
    _case("decode_placeholders_past_the_bound", lambda g: _spec(g, False, [0], [], [], 2**31, 0), None, ValueError,
          "num_placeholders: expected <= 65536 .rows padding one batch., got 2147483648"),
    _case("add_counts_negative_summing_right",  # one request's count -1, the next's +1: the sum still fits
          lambda g: (g.add(3, "x", [1], [0], [], 0, 0, 0), g.add(4, "y", [2], [0], [], 0, 0, 0)),
          lambda c, w: (_put(c, "add_meta", (0, 4), 2), _put(c, "add_meta", (1, 4), 0)), ValueError,
          "request 'y': expected a non-empty prompt"),
    _case("add_count_negative",
          lambda g: (g.add(3, "x", [1], [0], [], 0, 0, 0), g.add(4, "y", [2], [0], [], 0, 0, 0)),
          lambda c, w: (_put(c, "add_meta", (0, 4), 3), _put(c, "add_meta", (1, 4), -1)), ReplicaError,
          "step frame: an add_request entry with a negative count"),
    _case("add_in_another_slot", lambda g: g.add(5, "x", [1], [0], [], 0, 0, 0), None, ReplicaError,
          "request 'x': added in slot 3 here, slot 5 on the driver"),
    _case("add_second_in_another_slot",
          lambda g: (g.add(3, "x", [1], [0], [], 0, 0, 0), g.add(6, "y", [2], [0], [], 0, 0, 0)), None, ReplicaError,
          "request 'y': added in slot 4 here, slot 6 on the driver"),
    _case("add_every_free_slot_out_of_order",  # as many adds as free slots: the order still checked
          lambda g: [g.add(s, f"x{s}", [1], [0], [], 0, 0, 0) for s in (3, 4, 5, 7, 6)], None, ReplicaError,
          "request 'x7': added in slot 6 here, slot 7 on the driver"),
    _case("add_past_the_free_slots", lambda g: [g.add(s, f"x{s}", [1], [0], [], 0, 0, 0) for s in (3, 4, 5, 6, 7, 0)],
          None, ValueError, "request 'x0': all max_seqs=8 slots are in use"),
    _case("finish_free_slot", lambda g: g.finish(np.array([2, 5])), None, ValueError,
          r"slots: expected slots of live requests, got \[5\] without one"),
    _case("finish_slot_twice", lambda g: g.finish(np.array([1, 1])), None, ValueError,
          r"slots: request 'b' \(slot 1\) appears twice in one step"),
    _case("unknown_run_code", lambda g: None, lambda c, w: c.__setitem__(0, np.vstack([c[0], [[99, 1]]])),
          ReplicaError, r"unknown run \(99, 1\)"),
    _case("spec_run_of_two", lambda g: _spec(g, False, [0], [], [], 0, -2), lambda c, w: _put(c, "runs", (-1, 1), 2),
          ReplicaError, rf"unknown run \({SPEC}, 2\)"),
    _case("decode_drafts_count_overflows_then_tok_run",  # the spec is refused: the TOK run after it not applied
          lambda g: (_spec(g, False, [0], [], [], 0, 0), _tok(g, [1], [1], [7])), lambda c, w: w.__setitem__(6, BIG),
          ReplicaError, "step frame: spec_drafts holds 0 entries"),
]


@pytest.mark.parametrize("record, tamper, exc, match", BAD)
def test_refused_run_raises_its_error_and_writes_nothing(record: Callable, tamper: Any, exc: type, match: str) -> None:
    """Each frame opens with a valid BLK run (applied: B ends where a twin with that one call
    stands), then the bad run: its named error, none of it written."""
    log = OpLog(8)
    log.ragged(BLK, np.array([0]), np.array([1]), np.array([9]))
    record(log)
    cols, words = [c.copy() for c in log.columns(NO_DIGEST)], list(log.specs)
    if tamper:
        tamper(cols, words)
    twin, b = _live3(), _live3()
    twin.append_blocks(0, [9])
    with pytest.raises(exc, match=match):
        apply_step(b, flat_columns(cols), list(log.req_ids), words)
    _assert_same_state(_public(b, full=True), _public(twin, full=True))


def test_spec_words_not_a_multiple_refused_before_any_run() -> None:
    log = OpLog(8)
    _tok(log, [0], [1], [7])
    _spec(log, False, [0], [], [], 0, -2)
    b = _live3()
    before = _public(b, full=True)
    with pytest.raises(ReplicaError, match="13 spec values, not a multiple of 7"):
        apply_step(b, flat_columns(log.columns(NO_DIGEST)), [], list(log.specs) + [0] * 6)
    _assert_same_state(_public(b, full=True), before)


def test_run_count_near_int64_max_is_refused_not_a_crash() -> None:
    """runs [[TOK, 2**63 - 1]] (tok_slots at buffer index 2): a ReplicaError, in a child process
    (the compiled replay may crash it)."""
    code = (f"import numpy as np; from tests import test_replay as t; g = t.OpLog(8); t._tok(g, [0], [1], [7]); "
            f"c = list(g.columns(t.NO_DIGEST)); c[0] = np.array([[{TOK}, {BIG}]])\n"
            "try: t.apply_step(t._live3(), t.flat_columns(c), [], [])\n"
            "except t.ReplicaError as e: print('refused:', e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "refused: step frame: tok_slots holds 1 entries" in out.stdout, out


@pytest.mark.parametrize("changes, match", [
    ({0: -1}, r"tensor dims out of range"),  # runs' rows
    ({1: 3}, r"tensor shapes declare 80 bytes \(region 80\), the frame declares 64 \(region 64\): runs \[2, 3\]"),
    ({7: 2}, r"tensor shapes declare 72 bytes .* the frame declares 64 .*tok_slots \[2\] int64"),  # 2 entries, not 1
    ({0: 1, 1: 4}, r"step frame: 26 shape words and 64 region bytes refused for 64 column bytes"),  # runs [1, 4]
])
def test_follower_refuses_a_region_its_shapes_do_not_describe(changes: dict[int, int], match: str) -> None:
    """Shape words changed (the frame resealed, so only the region check can catch them): the
    compiled check refuses them, with the codec's message naming the shapes where the codec
    refuses them too (``runs [1, 4]`` has the right bytes, only the step frame's width rule
    refuses it); nothing is returned."""
    log = OpLog(8)
    _tok(log, [1], [1], [7])
    _spec(log, False, [1], [], [], 0, -2)
    buf = bytearray(_frame_bytes(log, NO_DIGEST, True))
    view = memoryview(buf)
    reader = FrameReader(STEP_SCHEMA, Plan, True)
    reader.step = 2
    h = reader.parse(view, 0).head
    shapes = np.frombuffer(view, np.int64, h.n_dims, h.shapes_at)
    for word, value in changes.items():
        shapes[word] = value
    seal(view, h.data_at, True)
    reader.step = 2
    frame = reader.parse(view, 0)
    with pytest.raises(WireError, match=match):
        read_region(frame, shapes, np.frombuffer(view, np.uint8, len(buf) - h.data_at, h.data_at))


def test_log_grows_a_full_column_and_keeps_every_call() -> None:
    """Calls past a column's first capacity (68 values for one slot): the column doubles, the
    earlier values and runs stay, and the packed region equals the columns laid end to end."""
    rng = np.random.default_rng(0)
    log, other, want_tok = OpLog(1), OpLog(1), []
    for i in range(40):  # 40 runs of TOK (each call repeats slot 0: a new run), 200 tokens each
        toks = rng.integers(0, 1000, 200)
        _tok(log, [0], [200], list(toks))
        want_tok.append(toks)
    for i in range(30):
        log.add(0, i, np.arange(50), np.arange(9), np.zeros(0, np.int64), i, 0, 0)
        other.ragged(BLK, np.array([0]), np.array([3]), np.array([i, i + 1, i + 2]))
    log.extend(other)
    cols = log.columns(NO_DIGEST)
    assert np.array_equal(cols[COL["tok_flat"]], np.concatenate(want_tok))
    assert cols[COL["runs"]].tolist() == [[TOK, 1]] * 40 + [[0, 1]] * 30 + [[BLK, 1]] * 30
    assert cols[COL["add_meta"]][:, 1].tolist() == list(range(30)) and len(cols[COL["add_tokens"]]) == 1500
    assert cols[COL["blk_flat"]].tolist() == [v for i in range(30) for v in (i, i + 1, i + 2)]
    digest = rng.integers(0, 1 << 62, (5, 4))
    packed, oracle = log.pack(digest), flat_columns(log.columns(digest))
    assert packed.dims == oracle.dims and np.array_equal(packed.buf, oracle.buf)
    assert np.array_equal(packed.starts, oracle.starts)
    assert log.layout(digest) == (oracle.dims, len(oracle.buf))  # the sizes a ring slot is reserved with
    short = np.full(len(oracle.buf) - 1, -7, np.int64)
    assert log.pack_into(digest, short) == -len(oracle.buf) and (short == -7).all()  # nothing written
