"""The step frame: one scheduler step as a schema'd dataclass on the common frame codec.

``StepFrame`` is what ``ReplicatedBatchState.sync()`` sends: the step number, whether the
replicas compare digests after it, the added requests' ids, the batch spec, and every op-log
column of :mod:`cpmeta.replicate.ops` as an int64 tensor (raw little-endian bytes in the frame,
strictly parsed like every frame: ``cpmeta.broadcast.wire``). Its layout never changes (every
column is sent, empty when unused), so after the first step a frame carries only the layout id,
the four values and the column lengths.

Driver and followers move the columns as ONE int64 buffer (``ops.Columns``), never a torch tensor
per step: the driver's op log sizes the region (``OpLog.layout``) and lays its columns out
straight into the frame's region in the ring slot in one compiled call (``OpLog.pack_into``); a
follower proves the region against its shapes and copies it out in one compiled call
(:func:`read_region`). The bytes are exactly what the common codec writes for these tensors
(``tests/test_replay.py`` holds one to the other), and the compiled replay of
:mod:`cpmeta.replicate.replay_njit` walks that buffer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from ..broadcast.schema import Schema
from ..buffers import pack_up
from ..builders.decode_sink import DecodeSink
from ..config import MetadataConfig
from ..state import BatchState
from ..broadcast.wire import (FLAG_PACKED, FRAME_MAGIC, HEADER, MAX_VALUES_BYTES, MESSAGE_VERSION, Frame, WireError,
                              blocks_at)
from ..jit import OK, warmer
from ..transport.codec import CodecError, decode_body, encode_body
from .ops import COLUMNS, SPEC_WORDS, WIDE, WIDTHS, Columns, OpLog
from .ops_njit import R_BYTES, unpack_region
from .step_write_njit import S_CHANGED, send_step_frame, step_frame_size, write_step_frame
from .step_read_njit import ASK_PARSER, F_READ, FIXED_HEAD, OWN, VALS_HEAD, follow_decode, read_step_frame, replay_step

__all__ = ["StepFrame", "STEP_SCHEMA", "step_key", "read_region", "state_fingerprint", "StepReader",
           "FusedStep", "receive_step", "send_step", "fixed_head"]


def _col(name: str) -> Any:  # a column's field metadata: int64, rank 1 or 2 (the schema pins both)
    return field(default=None, metadata={"cpmeta": SimpleNamespace(dtype=torch.int64, ndim=2 if name in WIDE else 1)})


@dataclass(slots=True)
class StepFrame:
    """One step of a ``ReplicatedBatchState`` (columns: see :mod:`cpmeta.replicate.ops`)."""

    step: Optional[int] = None  # 1, 2, ...: followers refuse a gap or a replay
    check: Optional[bool] = None  # compare replica digests after this step
    req_ids: Optional[list[int | str]] = None  # ids of the requests added, in order
    spec: Optional[list[int]] = None  # [is_prompt, num_placeholders, advance, drafts] or []
    runs: Optional[torch.Tensor] = _col("runs")  # [r, 2] int64 (op code, entries)
    add_meta: Optional[torch.Tensor] = _col("add_meta")  # [a, 7] int64
    add_tokens: Optional[torch.Tensor] = _col("add_tokens")  # [sum #tokens] int64
    add_blocks: Optional[torch.Tensor] = _col("add_blocks")  # [sum #blocks] int64
    add_comp: Optional[torch.Tensor] = _col("add_comp")  # [sum #compressed] int64
    tok_slots: Optional[torch.Tensor] = _col("tok_slots")  # [t] int64
    tok_counts: Optional[torch.Tensor] = _col("tok_counts")  # [t] int64
    tok_flat: Optional[torch.Tensor] = _col("tok_flat")  # [sum tok_counts] int64
    blk_slots: Optional[torch.Tensor] = _col("blk_slots")
    blk_counts: Optional[torch.Tensor] = _col("blk_counts")
    blk_flat: Optional[torch.Tensor] = _col("blk_flat")
    cmp_slots: Optional[torch.Tensor] = _col("cmp_slots")
    cmp_counts: Optional[torch.Tensor] = _col("cmp_counts")
    cmp_flat: Optional[torch.Tensor] = _col("cmp_flat")
    sid_pairs: Optional[torch.Tensor] = _col("sid_pairs")  # [s, 2] int64 (slot, state id)
    svs_pairs: Optional[torch.Tensor] = _col("svs_pairs")  # [s, 2] int64 (slot, valid start)
    fin_slots: Optional[torch.Tensor] = _col("fin_slots")  # [f] int64
    spec_slots: Optional[torch.Tensor] = _col("spec_slots")  # [n] int64
    spec_lens: Optional[torch.Tensor] = _col("spec_lens")  # [n] or [0] int64
    spec_drafts: Optional[torch.Tensor] = _col("spec_drafts")  # [sum drafts] int64
    batch_digest: Optional[torch.Tensor] = _col("batch_digest")  # [rows, 4] int64 (digest.batch_check)


STEP_SCHEMA: Schema = Schema.of(StepFrame)
assert tuple(f for f in STEP_SCHEMA.field_names[4:]) == COLUMNS, "StepFrame columns = ops.COLUMNS"


def step_key() -> tuple:
    """The layout key of every step frame (the one layout: every column int64, field order)."""
    from ..broadcast.collect import collect

    empty = {c: torch.zeros((0, WIDE[c]) if c in WIDE else 0, dtype=torch.int64) for c in COLUMNS}
    key, _, _ = collect(StepFrame(step=1, check=False, req_ids=[], spec=[], **empty), STEP_SCHEMA)
    return key


def read_region(frame: Frame, shapes: np.ndarray, data: np.ndarray) -> tuple[Columns, np.ndarray]:
    """A follower's columns of a parsed step frame: ``shapes`` its shape words (int64), ``data``
    its tensor region (uint8), proven and copied out in one compiled call
    (:func:`~cpmeta.replicate.ops_njit.unpack_region`). Returns the columns and the private
    buffer holding the whole region (its first ``tbytes // 8`` values are ``cols.buf``). A
    refused region raises the codec's named ``WireError`` (the shapes by path)."""
    tbytes = frame.head.tbytes
    code = R_BYTES
    if len(data) % 16 == 0 and 0 <= tbytes <= len(data):
        out, starts = np.empty(len(data) // 8, np.int64), np.empty(len(COLUMNS) + 1, np.int64)
        code = unpack_region(shapes, data, tbytes, WIDTHS, out, starts)
    if code != OK:
        frame.plan.check_tensors(frame.dims, True, tbytes, len(data))  # names the shapes it refuses
        raise WireError(f"step frame: {len(shapes)} shape words and {len(data)} region bytes refused "
                        f"for {tbytes} column bytes")
    return Columns(out[:tbytes // 8], starts), out


_N_DIMS = int(sum(2 if w > 1 else 1 for w in WIDTHS.tolist()))  # a step frame's shape words
_MAX_SPECS = 64  # batch specs a frame may hold for the compiled read (more: the parser reads it)


class FusedStep:
    """A replica's decode step replayed and built in the call that has its columns
    (:func:`~.step_read_njit.replay_step`): a follower's compiled read (:class:`StepReader`) and a
    ``defer_apply`` driver's own apply. Holds the replay's cursors and two step-check buffers,
    used in turn (``defer_apply`` compares the last step's check with the next frame's).
    :meth:`tail` is the kernel's arguments after the columns; :meth:`took` what
    ``apply.apply_step(fused=...)`` takes of the kernel's return."""

    def __init__(self) -> None:
        self.count = 0  #: steps replayed (and built) this way
        self.digest = True  #: write the step check's rows (``defer_apply`` ranks make them later)
        self._at = np.zeros(len(COLUMNS), np.int64)
        self._checks: list[np.ndarray] = []

    def tail(self, state: BatchState, sink: DecodeSink, dry: bool) -> tuple:
        if not self._checks:  # rows: a header, one per sequence and placeholder (none: no digests)
            rows = 1 + state.max_seqs + 256 if self.digest else 0
            self._checks = [np.empty((rows, 4), np.int64) for _ in range(2)]
        return (self._at, self._checks[self.count & 1], *state.kernel_arrays(), state.lookback, *_NO_FREE,
                *sink.args, dry)

    def took(self, got: tuple) -> Any:
        """None when nothing was applied, else ``(status, replay's return, cursors, check buffer)``."""
        if got[0] == F_READ or got[0] == ASK_PARSER:
            return None
        check, self.count = self._checks[self.count & 1], self.count + 1
        return got[0], got[1:], self._at, check

    def apply(self, cols: Columns, words: Any, state: BatchState, sink: DecodeSink, again: bool = False) -> Any:
        """The step of ``cols`` and spec words ``words`` (ints; an int64 array is taken as it is) on
        ``state``, the sink aimed at the shape its words name (as ``apply_step`` aims it); None
        (nothing applied) unless one decode spec. ``again``: the call with the sink's last aim took
        nothing (None at once when the aim was already this shape: the step is not one the call takes)."""
        if len(words) != SPEC_WORDS or words[0] != 0:
            return None
        n, t = int(words[4] + words[1]), int(words[4] + words[1] + words[6])
        if again and sink.aimed(t, n):
            return None
        sink.refresh(t, n)
        w = np.asarray(words, np.int64)
        return self.took(replay_step(cols.buf, cols.starts, w, *self.tail(state, sink, False)))


_NO_FREE = (np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))  # the fused replay adds nothing
_NO_IDS = np.frombuffer(encode_body([]), np.uint8)  # a step that adds no request: msgpack's empty array


class StepReader:
    """A follower's step frame read in ONE compiled call (:mod:`.step_read_njit`) for the common
    frame: the step layout this rank already holds, no checksum. Off until
    :meth:`arm` names the layout (after the codec's parser accepted a step frame of it); a frame
    it does not take (``read`` returns None) goes to the parser. Given the replica and its
    ``DecodeSink`` (``fuse``), the same call replays and builds a decode step of the sink's
    shape (:func:`~.step_read_njit.follow_decode`). Example::

        got = reader.read(view, want)     # (columns, region, where it starts, values, None) or None
    """

    def __init__(self, fingerprint: bytes) -> None:
        self._fixed = fixed_head(fingerprint)
        self.lid, self.checked = -1, False  # the layout it reads (-1: off); see read
        self.taken = 0  #: frames a follower's receive took this way (:func:`receive_step`; the parser read the others)
        self.fused = FusedStep()  #: the steps of those replayed (and built) in the same call
        self._vals = np.zeros(VALS_HEAD + SPEC_WORDS * _MAX_SPECS, np.int64)
        self._shapes = np.zeros(_N_DIMS, np.int64)
        # the columns' buffers: used in turn (a step's stay valid through the next), grown, not made per step
        self._out, self._turn = [np.empty(1024, np.int64) for _ in range(2)], 0
        self._starts = np.empty((2, len(COLUMNS) + 1), np.int64)

    def arm(self, lid: int) -> None:
        """Read frames of layout ``lid`` from now on (the parser accepted one: this rank holds it)."""
        self.lid = lid

    def read(self, view: memoryview, want: int, fuse: Optional[tuple[BatchState, DecodeSink]] = None,
             dry: bool = False, mine: np.ndarray = OWN) -> Optional[tuple[Columns, np.ndarray, int, list[Any], Any]]:
        """Step ``want``'s frame in ``view``: its columns (as :func:`read_region` gives them), the
        whole region (a private copy), where the region starts, the values ``[step, check,
        request ids, spec words]`` and, with ``fuse`` = ``(state, sink)`` (the sink aimed by
        ``refresh()``), what the same call applied (:meth:`FusedStep.took`; nothing for a step
        that adds requests). None when the compiled read does not take the frame (the parser
        decides, and names what is wrong: request ids the codec refuses, e.g.). ``dry``: the warm's
        read (None). :attr:`checked`: the frame's ``batch_digest`` is ``mine`` (:data:`OWN`: its check)."""
        if self.lid < 0:
            return None
        frame = np.frombuffer(view, np.uint8)
        turn, v = self._turn, self._vals  # (a dry read warms the buffer the next step's read takes)
        out, starts = self._out[turn], self._starts[turn]
        if len(out) < len(frame) // 8:
            out = self._out[turn] = np.empty(len(frame) // 4, np.int64)
        head = (frame, self._fixed, self.lid, want, WIDTHS, v, self._shapes, out, starts)
        fused = None
        if fuse is None:  # (dry: the warm's read, nothing to hand back -- a frame landing mid-warm waits less)
            if read_step_frame(*head) != OK or dry:
                return None
        else:
            got = follow_decode(*head, *self.fused.tail(*fuse, dry) + (mine,))
            if got[0] == ASK_PARSER or dry:
                return None
            fused = self.fused.took(got)
        (step, check, data_at, k, ids_at, ids_end, n_ids, checked), ids = v[:VALS_HEAD].tolist(), []
        if n_ids:  # the added requests' ids: the codec decodes them (strictly)
            try:
                ids = decode_body(view[ids_at:ids_end])
            except CodecError:
                return None
        self._turn, self.checked = turn ^ 1, checked == 1
        cols = Columns(out[:starts[-1]], starts)
        words = v[VALS_HEAD:VALS_HEAD + k]
        if fuse is not None and fused is None and k == SPEC_WORDS and not n_ids:  # another shape: aimed, once more
            fused = self.fused.apply(cols, words, *fuse, again=True)
        return cols, out[:(len(frame) - data_at) // 8], data_at, [step, check == 1, ids, words.tolist()], fused


def fixed_head(fingerprint: bytes) -> np.ndarray:
    """The first :data:`~.step_read_njit.FIXED_HEAD` bytes of every common step frame: magic,
    version, ``FLAG_PACKED`` alone, the schema's ``fingerprint``."""
    head = HEADER.pack(FRAME_MAGIC, MESSAGE_VERSION, FLAG_PACKED, fingerprint, 0, 0, 0, 0, 0, 0, 0, 0)
    return np.frombuffer(head[:FIXED_HEAD], np.uint8)


def _changed() -> RuntimeError:
    return RuntimeError("ReplicatedBatchState: the step's columns changed between their layout and pack")


def send_step(ch: Any, key: tuple, log: OpLog, digest: np.ndarray, step: int, check: bool, fixed: np.ndarray) -> bool:
    """The driver's step frame of ``log``'s columns and ``digest`` (values ``[step, check,
    request ids, spec words]``) through ``ch`` (its ``FrameChannel``): the common frame (the
    layout every follower holds, no checksum) written whole by ONE compiled call into the slot
    (:func:`~.step_write_njit.write_step_frame`; ``fixed``: :func:`fixed_head`; the request ids,
    if any, as the codec's bytes) -- with only same-host followers and room in the ring, the
    same call claims and publishes the slot too (:func:`~.step_write_njit.send_step_frame`) --
    any other through the codec (``prepare`` / ``publish``), the region packed straight into the
    slot either way. True when the compiled call wrote it."""
    lid, _, lblock = ch.writer.layout(key)
    common = not (lblock or ch.checksum) and step < 1 << 63
    ids = _NO_IDS
    if common:
        try:
            words = log.words
            if log.req_ids:  # ints and strs (the recorder's rule); one the codec refuses it names below
                ids = np.frombuffer(encode_body(log.req_ids, made=True), np.uint8)
        except (OverflowError, ValueError):  # a spec value past int64, an unencodable id: the codec
            common = False
    if common:
        ring = ch.direct()  # only same-host followers: claimed, written and published by one call
        got = -1 if ring is None else _send_direct(ring, fixed, lid, ch.writer.step + 1, step, check, ids, words,
                                                     log.buffers, digest)
        if got >= 0:
            ch.direct_sent(ring, bool(got))  # (its liveness poll may raise: no view of the ring is held here)
            return True
        if got == S_CHANGED:
            raise _changed()
        flat, off, n, dims, starts = log.buffers
        total, vlen = step_frame_size(flat, off, n, digest, WIDTHS, dims, starts, step, words, ids)
        if vlen <= MAX_VALUES_BYTES:
            data_at = blocks_at(0, vlen, len(dims))[1]

            def write_all(view: memoryview, frame_step: int) -> None:
                got = write_step_frame(np.frombuffer(view, np.uint8), np.frombuffer(view, np.int64, total, data_at),
                                       fixed, lid, frame_step, step, check, ids, words, dims, flat, off, n, digest,
                                       WIDTHS, starts)
                if got != total:
                    raise _changed()

            ch.publish_written(data_at + pack_up(8 * total), write_all)
            return True
    dims_t, total = log.layout(digest)  # the frame's region, packed below straight into its slot
    prep = ch.prepare(key, [step, check, list(log.req_ids), log.specs], dims_t, one_run=8 * total, made=True)

    def write(view: memoryview, addr: int, data_at: int) -> None:
        if log.pack_into(digest, np.frombuffer(view, np.int64, total, data_at)) != total:  # one compiled copy
            raise _changed()

    ch.publish(prep, FLAG_PACKED, prep.exact, prep.region, write)
    return False


def _send_direct(ring: Any, fixed: np.ndarray, lid: int, frame_step: int, step: int, check: bool, ids: np.ndarray,
                 words: np.ndarray, buffers: tuple[np.ndarray, ...], digest: np.ndarray) -> int:
    """:func:`~.step_write_njit.send_step_frame` into ``ring`` (``ShmRing.direct``'s words; -1
    while the ring holds a reserved message): its return. The ring's arrays die with this call."""
    mapped = ring.direct()
    if mapped is None:
        return -1
    m32, m64, m8, readers, slots, size, ring_at, floor = mapped
    flat, off, n, dims, starts = buffers
    return int(send_step_frame(m32, m64, m8, readers, slots, size, ring_at, floor, fixed, lid, frame_step, step, check,
                               ids, words, flat, off, n, dims, starts, digest, WIDTHS, MAX_VALUES_BYTES))


def receive_step(ch: Any, reader: Optional[StepReader], keep: bool,
                 fuse: Optional[tuple[BatchState, DecodeSink]] = None,
                 mine: np.ndarray = OWN) -> tuple[Columns, list[Any], list[Any], Any]:
    """A follower's next step frame from ``ch`` (its ``FrameChannel``): the columns, the values
    ``[step, check, request ids, spec words]``, the saved frame and what the compiled call
    applied -- by ``reader``'s compiled read when it takes the frame (with ``fuse``, a decode
    step replayed, built and checked against ``mine`` in the same call), else by the codec's
    parser and :func:`read_region` (after which ``reader`` reads that layout; nothing applied:
    None). ``keep``: also a private copy of the frame's head and whole region (the warm's),
    else ``[]``."""
    saved: list[Any] = []

    def handler(frame: Frame, view: memoryview) -> tuple[Columns, list[Any], Any]:
        h = frame.head
        if not h.flags & FLAG_PACKED:
            raise WireError("step frame without FLAG_PACKED")
        cols, region = read_region(frame, np.frombuffer(view, np.int64, h.n_dims, h.shapes_at),
                                   np.frombuffer(view, np.uint8, view.nbytes - h.data_at, h.data_at))
        if keep:
            saved[:] = (bytes(view[:h.data_at]), region)
        if reader is not None:
            reader.arm(h.lid)  # this rank holds the layout now
        return cols, frame.values, None

    def fast(view: memoryview, want: int) -> Optional[tuple[Columns, list[Any], Any]]:
        assert reader is not None  # (given to the channel only with one)
        got = reader.read(view, want, fuse, False, mine)
        if got is None:
            return None
        reader.taken += 1
        if keep:
            saved[:] = (bytes(view[:got[2]]), got[1])
        return got[0], got[3], got[4]

    cols, values, fused = ch.receive(handler, fast if reader is not None else None)
    return cols, values, saved, fused


@warmer
def _warm() -> None:
    """Compile / load :func:`~cpmeta.replicate.ops_njit.unpack_region` on an empty step's region,
    the compiled read on a header it refuses, the compiled writer (into a buffer and into a
    scratch ring) and the fused read of what it wrote."""
    out, starts = np.empty(0, np.int64), np.empty(len(COLUMNS) + 1, np.int64)
    shapes = np.array([d for w in WIDTHS.tolist() for d in ((0,) if w == 1 else (0, w))], np.int64)
    unpack_region(shapes, np.zeros(0, np.uint8), 0, WIDTHS, out, starts)
    r = StepReader(b"0" * 16)
    r.arm(0)
    r.read(memoryview(bytearray(64)), 1)  # writable, as a ring slot's view (one specialization each)
    # the compiled writer, then the fused read of what it wrote (dry, as the follower's warm reads
    # its saved copy, then as a step): one decode step of one request
    from ..buffers import OutputArenas
    from .ops import TOK

    st = BatchState(MetadataConfig(dense_compress_ratios=(), sparse_compress_ratios=(), window_size=0), 2)
    slot = st.add_request(0, [1, 2], [0], 0)
    log = OpLog(2)
    log.ragged(TOK, np.array([slot]), np.array([1]), np.array([7]))
    log.batch_spec(False, np.array([slot]), _NO_FREE[0], _NO_FREE[0], 0, True, -2)
    flat, off, n, dims, starts = log.buffers
    words, digest = log.words, np.zeros((0, 4), np.int64)
    total, vlen = step_frame_size(flat, off, n, digest, WIDTHS, dims, starts, 1, words, _NO_IDS)
    data_at = blocks_at(0, vlen, len(dims))[1]
    frame = bytearray(data_at + pack_up(8 * total))
    write_step_frame(np.frombuffer(frame, np.uint8), np.frombuffer(frame, np.int64, total, data_at), r._fixed, 0, 1,
                     1, False, _NO_IDS, words, dims, flat, off, n, digest, WIDTHS, starts)
    # the same frame claimed, written and published in a scratch ring mapping (one reader, two
    # slots of 1 KB), byte for byte
    ring_at = 4096  # a one-reader ring's control block: one page
    m8 = np.zeros(ring_at + 2048, np.uint8)
    m32, m64 = m8[:ring_at].view(np.uint32), m8.view(np.uint64)
    assert send_step_frame(m32, m64, m8, 1, 2, 1024, ring_at, 0, r._fixed, 0, 1, 1, False, _NO_IDS, words, flat,
                           off, n, dims, starts, digest, WIDTHS, MAX_VALUES_BYTES) == 0
    assert m8[ring_at + 16:ring_at + 16 + len(frame)].tobytes() == bytes(frame)
    sink = DecodeSink(st.cfg, OutputArenas())
    r.read(memoryview(frame), 1, (st, sink), dry=True)
    r.read(memoryview(frame), 1, (st, sink))


def state_fingerprint(cfg: MetadataConfig, *caps: int) -> str:
    """16 hex digits of the config (every field; tensors by their bytes) and the capacities: what
    every rank of a ``ReplicatedBatchState`` must agree on."""
    h = hashlib.sha256()
    for name in sorted(cfg.__dataclass_fields__):
        v = getattr(cfg, name)
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{name}={v!r};".encode())
    h.update(repr(caps).encode())
    return h.hexdigest()[:16]
