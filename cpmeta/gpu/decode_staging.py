"""``DecodeStaging`` (the pinned int32 staging buffer of the in-place decode) and ``stage_decode``.

The layout it holds is :class:`cpmeta.gpu.staging_layout.StagingLayout` (one object per config:
written from a batch or straight from a ``BatchState``, validated, read back). One step:
``stage(batch, cfg)`` validates and fills the host buffer (``StagingLayout.write_batch``), checks
the batch against the captured buffers' capacity (``OutCapacity``) and uploads the used prefix with
ONE non-blocking copy; :func:`stage_decode` does the same straight from a ``BatchState``
(``StagingLayout.write_state``). ``replay`` / ``ready_on`` / ``consumed_on`` order a graph replay
on another stream with the uploads. Either writer is ONE compiled call into the host buffer
(:meth:`DecodeStaging.write_host`: after the previous upload, grown and run again when short).
The staging buffer owns and makes its typed cache ``out_cache``
(:class:`~cpmeta.gpu.decode_buffers.OutCache`, the checked buffers of the last ``out``:
:meth:`DecodeStaging.buffers_for`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import numpy as np
import torch

from ..state.batch import BatchInput, as_sequence_batch
from ..state.checks import check_placeholders
from ..config import MetadataConfig
from ..transport.envs import resolve_device
from .decode_buffers import OutCache, OutCapacity
from .staging_header import StagedDecode
from .staging_layout import StagingLayout, staging_capacity
from .staging_njit import REPORT_LEN

if TYPE_CHECKING:
    from ..state.batch_state import BatchState

__all__ = ["DecodeStaging", "stage_decode", "OutCapacity", "StagedDecode", "staging_capacity"]

#: Extra elements reserved when the staging buffer grows (amortises regrowth).
_GROWTH = 1.5

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: ``device index -> (stream_id, device_index, device_type)`` of the calling thread's current
#: stream: the C call behind ``torch.cuda.current_stream`` without the ``Stream`` it builds
#: (None in a build without CUDA, where no CUDA staging exists).
_CUR_STREAM_KEY = getattr(torch._C, "_cuda_getCurrentStream", None)


class DecodeStaging:
    """The reusable staging pair: a pinned host int32 buffer and its device twin.

    ``stage(seqs, cfg)`` waits on the CUDA event of the previous upload (so the CPU never
    overwrites bytes a pending non-blocking copy still reads), fills the host buffer, copies the
    used prefix to ``device`` in ONE ``copy_(non_blocking=True)`` and records the event. The
    buffers grow (x1.5) when a batch needs more room, unless ``fixed=True`` (required once a CUDA
    graph captured ``self.device_buffer``: its address must not change).

    On a CPU ``device`` the host buffer is also the device buffer (no copy).
    Example: ``st = DecodeStaging("cuda"); staged = st.stage(seqs, cfg)``.

    Capacity: ``out_capacity`` (an :class:`OutCapacity`, set by ``prepare_decode_inplace`` /
    ``launch_decode_inplace`` from the ``out`` buffers they last wrote) bounds what
    :meth:`stage` accepts: a batch needing more rows, sequences or block-table columns is a
    ``ValueError`` raised after the host fill and before the copy, so a captured graph never
    sees it. (On a CPU staging host and device buffer are one: the refused batch stays in it;
    the kernels are masked to their buffers either way.)

    Streams: :meth:`upload` copies on the current stream and records ``upload_event``; work that
    reads ``device_buffer`` on ANOTHER stream must wait for it: :meth:`replay` (``g.replay()``
    ordered both ways) or :meth:`ready_on` before and :meth:`consumed_on` after. The next
    :meth:`upload` waits (on the device) for the last ``consumed_on`` event, so it never
    overwrites bytes a replay on another stream has not read yet.
    """

    def __init__(self, device: torch.device | str, capacity: int = 4096, *, fixed: bool = False) -> None:
        if device is None:
            raise TypeError("device: expected a CPU or CUDA device, got None")
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise TypeError(f"capacity: expected an int, got {capacity!r}")
        if capacity < 0:
            raise ValueError(f"capacity: expected >= 0 (int32 elements), got {capacity}")
        self.device = resolve_device(device, None)
        self.fixed = fixed
        self._event: Optional[torch.cuda.Event] = None  # last upload done (host buffer free again)
        self._read_event: Optional[torch.cuda.Event] = None  # last consumer on ANOTHER stream done
        self._read_pending = False  # _read_event recorded since the last upload waited for it
        self._up_stream: Optional["torch.cuda.Stream"] = None  # stream of the last upload
        # (key, Stream) of the last current stream seen (ONE attribute: threads see a consistent pair)
        self._cur: Optional[tuple[object, "torch.cuda.Stream"]] = None
        self._dev_index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else -1)
        self._slices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # upload size -> (device, host) views
        self.out_cache: Optional[OutCache] = None  # the checked buffers of the last `out` (buffers_for)
        self.out_capacity: Optional[OutCapacity] = None  # limits of the buffers this staging feeds
        self.last_staged: Optional[StagedDecode] = None  # scalars of the batch in device_buffer
        self._report = np.zeros(REPORT_LEN, np.int64)  # the compiled writers' error slot + scalars
        self.host_buffer = torch.empty(0, dtype=torch.int32)
        self.device_buffer = self.host_buffer
        self._alloc(capacity)

    @property
    def capacity(self) -> int:
        """Int32 elements the buffers hold."""
        return self.host_buffer.shape[0]

    def _alloc(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self.wait()
        self.host_buffer = torch.zeros(capacity, dtype=torch.int32, pin_memory=cuda)
        self._view = self.host_buffer.numpy()
        self.device_buffer = (
            torch.zeros(capacity, dtype=torch.int32, device=self.device) if cuda else self.host_buffer
        )
        self._slices = {}

    def wait(self) -> None:
        """Block until the previous upload from the host buffer has completed."""
        if self._event is not None:
            self._event.synchronize()

    def buffers_for(self, out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int,
                    device: torch.device) -> tuple[OutCache, dict[str, Any]]:
        """The checked full-capacity buffers of ``out`` and the batch's prefix views, through this
        staging's one-entry :attr:`out_cache` (made anew for another ``out``, config or a batch
        that does not fit; :attr:`out_capacity` then records the new buffers' limits)."""
        c = self.out_cache
        if c is not None and c.fits(out, cfg, n_seq, total_q, device):
            return c, c.prefix_views(n_seq, total_q)
        c, views = OutCache.make(out, cfg, n_seq, total_q, device)
        self.out_cache, self.out_capacity = c, c.bufs.capacity()
        return c, views

    def fill(self, seqs: BatchInput, cfg: MetadataConfig) -> StagedDecode:
        """Validate ``seqs`` (``SequenceMetadata`` list or ``SequenceBatch``; the builders' checks and
        messages, ``prepare_decode``'s int32 bounds) and write them into the host buffer only (no
        copy): ONE compiled call (``StagingLayout.write_batch``); grows the buffer unless ``fixed``."""
        sb = as_sequence_batch(seqs, cfg, is_prompt=False)
        layout = StagingLayout.of(cfg)
        return self.write_host(lambda view, report: layout.write_batch(view, sb, report))

    def write_host(self, write: Callable[[np.ndarray, np.ndarray], T]) -> T:
        """``write(view, report)`` (a :class:`StagingLayout` writer) on the host buffer once the
        previous upload has read it; a ``BufferError(needed_elements)`` it raises grows the buffer
        (:meth:`host_view`: x1.5, or the fixed buffer's ``ValueError``) and runs it again.
        ``report``: this staging's ``int64[REPORT_LEN]`` scratch (error slot + staged scalars)."""
        self.wait()
        try:
            return write(self._view, self._report)
        except BufferError as e:
            return write(self.host_view(int(e.args[0])), self._report)

    def host_view(self, need: int) -> np.ndarray:
        """The int32 numpy view of the host buffer, free to write (the previous upload is done)
        and at least ``need`` elements long: grown (x1.5) unless ``fixed`` (then the same
        ``ValueError`` as :meth:`fill`). For writers that lay out a batch themselves
        (``cpmeta.gpu.stage_decode``)."""
        self.wait()
        if need > self.capacity:
            if self.fixed:
                raise ValueError(
                    f"seqs: batch needs {need} staging elements, the fixed staging buffer holds {self.capacity}")
            logger.debug("growing decode staging buffer %d -> %d", self.capacity, need)
            self._alloc(int(need * _GROWTH))
        return self._view

    def load(self, data: torch.Tensor) -> None:
        """Copy a staged buffer received from another rank (CPU int32, already validated) into the
        host buffer, growing it unless ``fixed`` (then a ``ValueError``). No upload."""
        self.wait()
        need = data.shape[0]
        if need > self.capacity:
            if self.fixed:
                raise ValueError(
                    f"staging: the batch needs {need} staging elements, the fixed staging buffer holds {self.capacity}")
            self._alloc(int(need * _GROWTH))
        self.host_buffer[:need].copy_(data)

    def upload(self, staged: StagedDecode) -> None:
        """ONE non-blocking host-to-device copy of the used prefix on the current stream, then
        record ``upload_event``. The copy first waits (device side) for the last
        :meth:`consumed_on` event of a consumer on another stream, and for the previous upload's
        stream when this one differs, so a kernel or replay still reading the previous batch is
        not overwritten under it.

        The copy is rounded up to a multiple of 1024 elements (4 KiB; never past the capacity):
        the kernels read only the staged prefix, and the few sizes that occur reuse cached
        slice views (a torch view costs a few us of host time per step)."""
        self.last_staged = staged
        if self.device.type != "cuda":
            return
        k = min(-(-staged.used // 1024) * 1024, self.capacity)
        pair = self._slices.get(k)
        if pair is None:
            pair = self._slices[k] = (self.device_buffer[:k], self.host_buffer[:k])
        self._write_device(lambda: pair[0].copy_(pair[1], non_blocking=True))

    def _current_stream(self) -> "torch.cuda.Stream":
        """``torch.cuda.current_stream(device)``, the same ``Stream`` object again while the
        calling thread's current stream is the same one: ``current_stream`` builds a new Python
        ``Stream`` per call (several us of host time per step); its key
        ``(stream_id, device_index, device_type)`` -- what ``Stream`` equality compares -- is one
        cheap C call (per thread, like the current stream). CUDA is initialized (the buffers are
        on the device). Switching streams (``torch.cuda.stream(s)``) changes the key: a new
        ``Stream`` equal to ``current_stream()``'s."""
        if _CUR_STREAM_KEY is None:
            return torch.cuda.current_stream(self._dev_index)
        key = _CUR_STREAM_KEY(self._dev_index)
        cur = self._cur
        if cur is None or cur[0] != key:
            cur = self._cur = (key, torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2]))
        return cur[1]

    def _write_device(self, write: Callable[[], object]) -> None:
        """Run ``write`` (whatever overwrites ``device_buffer`` from the host buffer: the copy, or
        a replay of a graph holding it) on the current stream, ordered after every reader of the
        previous batch, then record ``upload_event`` (the host buffer is free once it fires)."""
        stream = self._current_stream()
        up = self._up_stream
        if up is not None and up is not stream and stream != up:  # consumers ordered on the old upload stream
            stream.wait_stream(up)
        if self._read_pending:
            assert self._read_event is not None  # recorded before _read_pending is set
            stream.wait_event(self._read_event)
            self._read_pending = False  # later uploads are ordered after this one
        write()
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(stream)
        self._up_stream = stream

    def upload_in_graph(self) -> None:
        """Call while capturing a CUDA graph, before the kernels: the copy of the WHOLE host
        buffer to ``device_buffer`` becomes a node of the graph, so ONE replay uploads the batch
        the host filled and runs the kernels (:meth:`replay_uploading`). Saves the per-step
        ``copy_`` and event calls of :meth:`upload`. Needs ``fixed=True`` (the graph holds both
        addresses) and a capturing CUDA stream; the copy is the whole capacity (the kernels read
        the staged prefix only). Example::

            st = DecodeStaging("cuda", staging_capacity(cfg, n, q), fixed=True)
            ...warm up with prepare_decode_inplace(batch, cfg, out=out, staging=st)...
            g = capture_decode_graph(st, cfg, out=out, upload=True)   # or, by hand:
            with torch.cuda.graph(g):                                 # (after a warm-up launch)
                st.upload_in_graph()
                launch_decode_inplace(st, cfg, out=out)
            # every step:
            staged = stage_decode(st, state, slots, drafts, counts, upload=False)
            st.replay_uploading(g, staged)
        """
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            raise ValueError("upload_in_graph: call it while capturing a CUDA graph on the staging's device")
        if not self.fixed:
            raise ValueError("upload_in_graph: needs a fixed staging buffer (DecodeStaging(..., fixed=True)): "
                             "the graph keeps its addresses")
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)

    def replay_uploading(self, graph: "torch.cuda.CUDAGraph", staged: StagedDecode) -> None:
        """Replay a graph captured over :meth:`upload_in_graph` on the current stream: its copy
        reads the host buffer now (filled by ``fill`` / ``stage_decode(upload=False)`` for
        ``staged``), then ``upload_event`` is recorded, so the next fill waits until the graph
        has read the buffer. On CPU: ``graph.replay()`` only."""
        self.last_staged = staged
        if self.device.type != "cuda":
            graph.replay()
            return
        self._write_device(graph.replay)

    @property
    def upload_event(self) -> Optional["torch.cuda.Event"]:
        """CUDA event recorded after the last :meth:`upload` (None on CPU or before any)."""
        return self._event

    def ready_on(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Make ``stream`` (default: current) wait for the last upload: nothing to do on the
        upload's own stream (stream order). No-op on CPU and while the stream is capturing (an
        event recorded outside a capture cannot be waited on inside)."""
        if self._event is None:
            return
        s = stream or self._current_stream()
        if s is self._up_stream or s == self._up_stream or torch.cuda.is_current_stream_capturing():
            return
        s.wait_event(self._event)

    def consumed_on(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Record that work enqueued on ``stream`` (default: current) reads ``device_buffer``;
        the next :meth:`upload` waits for it on the device (on the upload's own stream stream
        order does that: no event). No-op on CPU and while capturing."""
        if self.device.type != "cuda":
            return
        s = stream or self._current_stream()
        if s is self._up_stream or s == self._up_stream or torch.cuda.is_current_stream_capturing():
            return
        if self._read_event is None:
            self._read_event = torch.cuda.Event()
        self._read_event.record(s)
        self._read_pending = True

    def replay(self, graph: "torch.cuda.CUDAGraph", stream: Optional["torch.cuda.Stream"] = None) -> None:
        """``graph.replay()`` on ``stream`` (default: current), ordered after the last upload and
        before the next one. Example: ``st.stage(batch, cfg)`` on the default stream, then
        ``st.replay(g, side)`` replays on ``side`` without racing the copy."""
        if self.device.type != "cuda":
            graph.replay()
            return
        if stream is None:
            s = self._current_stream()
            if s is self._up_stream or s == self._up_stream:  # the upload's own stream: stream order both ways
                graph.replay()
                return
            self.ready_on(s)
            graph.replay()
            self.consumed_on(s)
            return
        with torch.cuda.stream(stream):
            self.ready_on(stream)
            graph.replay()
            self.consumed_on(stream)

    def check_capacity(self, staged: StagedDecode, capacity: Optional[OutCapacity] = None) -> None:
        """``ValueError`` if ``staged`` does not fit ``capacity`` (default :attr:`out_capacity`)."""
        cap = capacity if capacity is not None else self.out_capacity
        if cap is not None:
            cap.check(staged)

    def stage(self, seqs: BatchInput, cfg: MetadataConfig) -> StagedDecode:
        """:meth:`fill`, the capacity check (:attr:`out_capacity`), then :meth:`upload`;
        returns the batch's host-side scalars."""
        staged = self.fill(seqs, cfg)
        self.check_capacity(staged)
        self.upload(staged)
        return staged


def stage_decode(staging: DecodeStaging, st: "BatchState", slots: np.ndarray,
                 draft_tokens: Optional[np.ndarray] = None, num_drafts: Optional[np.ndarray | int] = None,
                 *, num_placeholders: int = 0, upload: bool = True, capacity: Any = ...) -> StagedDecode:
    """``staging.stage(st.decode_batch(slots, draft_tokens, num_drafts, num_placeholders=...),
    cfg)`` written STRAIGHT from the state arrays (``StagingLayout.write_state``): no
    ``SequenceBatch``. ``staging`` [capacity] int32 pinned host buffer +
    device twin; ``slots`` int64 [n] live request slots; ``draft_tokens`` int32/int64
    [sum(num_drafts)]; ``num_drafts`` int64 [n] or ONE int for every request.
    ``upload=False``: fill the host buffer only (``staging.fill``'s contract: the caller uploads,
    e.g. a CP driver broadcasting the buffer first). ``capacity``: the limits checked before the
    host buffer is touched -- default ``staging.out_capacity``; an ``OutCapacity``; ``None`` for
    none (a CP driver checks the ``out`` it was given, not the last one this staging fed).

    Same staged batch, same errors, same capacity refusal, same upload (ONE non-blocking copy,
    event recorded), same return value; ``launch_decode_inplace`` and graph replay read it
    unchanged. A step is two compiled calls, the state's vouching (``BatchState.vouch_decode``) and
    the writer (:func:`~cpmeta.gpu.staging_njit.stage_state`: the scalars, int32 bounds and
    capacity first, then the rows and each request's whole row of the ``[max_seqs,
    max_num_blocks]`` int32 table mirror -- the tables sit at a fixed stride: other staging bytes
    than ``write_batch``'s packed ones, the same metadata).

    Falls back to the ``decode_batch`` + ``stage`` path (identical result, slower) when the fast
    path cannot vouch for the batch: Engram configs (the look-back windows are written by
    ``write_batch``), a batch the state's invariants do not validate (``seqlen_k >
    max_model_len``, negative state id / valid start, too few blocks), a block id outside
    ``[0, (2**31 - b_c) // b_c]``, any int32 overflow, or no real request (placeholders only).
    Any error is thus the builders' own message.
    Example: ``staged = stage_decode(staging, st, slots, drafts, 2); staging.replay(g)``.
    """
    check_placeholders(num_placeholders)  # (int() took 1.5 as 1 and True as 1)
    n_ph = int(num_placeholders)
    step = None if st.cfg.max_ngram_size else st.vouch_decode(slots, draft_tokens, num_drafts)
    if step is not None:
        layout = StagingLayout.of(st.cfg)
        cap = staging.out_capacity if capacity is ... else capacity  # checked before any write
        staged = staging.write_host(lambda view, report: layout.write_state(view, st, step, n_ph, cap, report))
        if staged is not None:
            if upload:
                staging.upload(staged)
            return staged
    return _slow(st, staging, slots, draft_tokens, num_drafts, n_ph, upload, capacity)


def _slow(st: "BatchState", staging: DecodeStaging, slots: np.ndarray, draft_tokens: Optional[np.ndarray],
          num_drafts: Optional[np.ndarray | int], n_ph: int, upload: bool, capacity: Any) -> StagedDecode:
    """``staging.stage(st.decode_batch(...), cfg)`` (or ``fill`` + the capacity check without
    ``upload``): the general path, its checks and errors."""
    batch = st.decode_batch(slots, draft_tokens, num_drafts, num_placeholders=n_ph)
    staged = staging.fill(batch, st.cfg)
    _check(staging, staged, capacity)
    if upload:
        staging.upload(staged)
    return staged


def _check(staging: DecodeStaging, staged: StagedDecode, capacity: Any) -> None:
    """``stage_decode``'s capacity rule: ``...`` the staging's ``out_capacity``, ``None`` none."""
    if capacity is ...:
        staging.check_capacity(staged)
    elif capacity is not None:
        capacity.check(staged)
