"""``FrameChannel``: the frame codec over a transport channel, for one schema.

Every cpmeta message between the ranks of a group rides on one of these, as vLLM's
``MessageQueue`` contains a ``ShmRingBuffer``: a ``transport.ObjectChannel`` moves the bytes
(shared-memory ring to same-host followers, the process group to the others) and the codec of
:mod:`cpmeta.broadcast.wire` writes and proves them. ``MetadataBroadcaster`` (any dataclass),
``broadcast_tensor_dict`` (plain tensor dicts), ``ReplicatedBatchState`` (scheduler steps) and
``StagedDecodeBroadcaster`` (staged decode batches) are its users; each adds only what it does
with the tensors.

Driver, one frame::

    prep = ch.prepare(key, values, dims)       # layout (id; block when new), sizes, values checked
    ch.publish(prep, flags, tbytes, region, write_region)   # header + blocks + region, sealed

Follower::

    result = ch.receive(handler)               # handler(frame, view) inside the transport's read

Steps (``cpmeta.broadcast.wire``'s step protocol): every frame carries its step number. A driver
call that fails before its frame is published calls ``ch.abort(error)``: the followers' pending
``receive`` raises the driver's error class naming the step, and the next frame is in step. An
abort that cannot be sent now (the transport refused it) is sent before the next frame.

Construction is collective (every rank of ``group`` constructs the channel with the same
``src``) and checks, once, in the transport's bounded setup exchange, that every rank speaks the
same schema, source and checksum setting (``ValueError`` on every rank naming the ranks that
differ; a rank that never constructs is a ``TimeoutError`` naming it).
"""

from __future__ import annotations

import struct
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from cpmeta.transport.codec import CodecError, encode_body  # cpmeta -> transport only

from .. import envs
from .plan import Plan
from .schema import explain_mismatch
from .wire import (FLAG_ABORT, FLAG_CRC, FLAG_LAYOUT, FLAG_PACKED, MAX_FRAME_DIMS,
                   MAX_VALUES_BYTES, DriverAbort, Frame, FrameMismatch, FrameReader, FrameWriter,
                   WireError, abort_values, blocks_at, pack_up, seal)

__all__ = ["FrameChannel", "Prepared", "resolve_src"]

_MALFORMED = (CodecError, WireError, KeyError, TypeError, ValueError, IndexError, struct.error)


class Prepared(NamedTuple):
    """A driver's frame before it is written: layout, encoded values and tensor geometry."""

    key: tuple
    lid: int
    plan: Plan
    lblock: bytes  # the layout block (b"" when the followers hold it)
    vblock: bytes
    dims: tuple[int, ...]
    numels: list[int]
    starts: list[int]
    region: int  # packed tensor region (16-aligned runs)
    exact: int  # exact tensor bytes


class FrameChannel:
    """Frames of one schema from global rank ``src`` to every rank of ``group`` (see module doc).

    Args:
        group: torch.distributed process group (NCCL or gloo; control traffic goes over gloo).
        src: GLOBAL rank of the driver (already resolved, e.g. by :func:`resolve_src`).
        schema: the ``Schema`` / ``DictSchema`` of what the frames carry.
        what: the user's name, for error messages (``"MetadataBroadcaster"``).
        timeout, force_remote: as for ``transport.ObjectChannel``.
        checksum: stamp / require the frame crc32 (every rank the same: checked here).
        agree: further settings every rank must pass equal (``{"state setting": fp}``).
    """

    def __init__(self, group: Any, src: int, schema: Any, *, what: str, timeout: Optional[float],
                 force_remote: Optional[bool], checksum: bool,
                 agree: Optional[dict[str, Any]] = None) -> None:
        from cpmeta.transport import ObjectChannel  # cpmeta -> transport, never the reverse

        self.group, self.src, self.schema, self.what = group, src, schema, what
        self.rank = dist.get_rank()
        self.is_src = self.rank == src
        self.checksum = checksum
        # the setup exchange checks these on every rank (and src), bounded by the timeout
        settings = {"checksum setting": bool(checksum), f"{what} schema setting": schema.fingerprint,
                    **(agree or {})}
        try:
            self.objects = ObjectChannel(group, src, timeout=timeout, force_remote=force_remote,
                                         agree=settings)
        except ValueError as e:  # every member refused the schema: name the class and field
            why = explain_mismatch(group, schema, what, 30.0) if f"{what} schema setting" in str(e) else None
            if why is None:
                raise
            raise ValueError(f"{str(e).partition('setup: ')[0]}setup: {why}") from None
        self.timeout = self.objects.timeout
        self.writer = FrameWriter(schema, Plan)
        self.reader = FrameReader(schema, Plan, checksum)
        self._aborts: list[list[str]] = []  # driver: abort frames still to send, oldest first

    @property
    def step(self) -> int:
        """The last step this rank sent (driver) or holds (follower)."""
        return self.writer.step if self.is_src else self.reader.step

    @property
    def has_readers(self) -> bool:
        """Whether any other rank reads what the driver sends (False in a group of one)."""
        return self.objects.has_readers

    # ---- driver -----------------------------------------------------------------------------
    def prepare(self, key: tuple, values: list[Any], dims: Optional[tuple[int, ...]],
                tensors: Optional[list[torch.Tensor]] = None, *, one_run: Optional[int] = None,
                made: bool = False) -> Prepared:
        """Layout, sizes and values of one frame. ``dims`` (flat tensor dims) or ``tensors``
        (read when ``dims`` is None). Every check a follower makes runs here first (layout
        against the schema, pinned dtypes / ndims, fixed dims, dim range, values, block sizes):
        a ``ValueError`` naming the path or the limit, before a byte is written. ``one_run``:
        the exact tensor bytes of a layout of ONE dtype run whose ``dims`` the caller's compiled
        code produced and proved (the step frame's columns); its sizes are not recomputed.
        ``made``: the library made ``values`` to the layout's types itself (the step frame's):
        not checked again here (every follower still checks them)."""
        lid, plan, lblock = self.writer.layout(key)
        if dims is None:
            dims = tuple([d for t in tensors or () for d in t.shape])
        if len(dims) > MAX_FRAME_DIMS:
            raise WireError(f"{len(dims)} shape words, at most {MAX_FRAME_DIMS}")
        if one_run is None:
            numels, starts, region, exact = plan.sizes(dims)
        elif len(plan.run_slices) == 1:
            numels, starts, region, exact = [], [0], pack_up(one_run), one_run
        else:
            raise ValueError(f"one_run: the layout has {len(plan.run_slices)} dtype runs")
        if not made:
            plan.check_values(values)
        vblock = encode_body(values, made=made)
        if len(vblock) > MAX_VALUES_BYTES:
            raise WireError(f"values block of {len(vblock)} bytes, at most MAX_VALUES_BYTES="
                            f"{MAX_VALUES_BYTES} (the followers would refuse it)")
        return Prepared(key, lid, plan, lblock, vblock, dims, numels, starts, region, exact)

    def publish(self, prep: Prepared, flags: int, tbytes: int, region: int,
                write_region: Optional[Callable[[memoryview, int, int], None]]) -> None:
        """Write and send the frame: header (+ ``flags``; FLAG_LAYOUT and FLAG_CRC are added
        here), blocks, shapes, then ``write_region(view, address, data_at)`` for the ``region``
        bytes of tensors (none when ``region`` is 0), sealed last. No-op without readers. The
        step (and a new layout) counts as sent once the transport took the frame; aborts still
        pending go first."""
        if not self.objects.has_readers:
            return
        if self._aborts:
            self._flush_aborts()
        flags |= (FLAG_LAYOUT if prep.lblock else 0) | (FLAG_CRC if self.checksum else 0)
        shapes_at, data_at = blocks_at(len(prep.lblock), len(prep.vblock), prep.plan.n_dims)
        step = self.writer.step + 1

        def fill(view: memoryview, addr: int) -> None:
            self.writer.write(view, flags, prep.lid, prep.lblock, prep.vblock, prep.plan, prep.dims,
                              tbytes, shapes_at, step)
            if region and write_region is not None:
                write_region(view, addr, data_at)
            seal(view, data_at, self.checksum)

        self._send_step(data_at + region, fill, lambda: self._sent(step, prep))

    def publish_written(self, nbytes: int, write: Callable[[memoryview, int], None]) -> None:
        """Send a frame of ``nbytes`` that ``write(view, step)`` writes whole -- header included,
        as frame number ``step``, of a layout every follower holds (its id only; no FLAG_CRC:
        only without ``checksum``) -- as :meth:`publish` sends one (aborts still pending first;
        a no-op without readers). The caller proves what :meth:`prepare` would (the step frame's
        compiled writer)."""
        if not self.objects.has_readers:
            return
        if self.checksum:
            raise RuntimeError(f"{self.what}: a frame written whole carries no frame crc (checksum is on)")
        if self._aborts:
            self._flush_aborts()
        step = self.writer.step + 1
        self._send_step(nbytes, lambda view, addr: write(view, step), lambda: setattr(self.writer, "step", step))

    def direct(self) -> Optional[Any]:
        """The ring (``ShmRing``) a compiled writer sends the next :meth:`publish_written` frame
        through, claimed, written and published in its own call (``ShmRing.direct``; then
        :meth:`direct_sent`) -- only same-host followers, no checksum, no abort pending -- else
        None."""
        if self.checksum or self._aborts:
            return None
        return self.objects.direct_ring()

    def direct_sent(self, ring: Any, wake: bool) -> None:
        """A compiled writer published frame ``writer.step + 1`` into ``ring``: counted as sent
        first (a dead reader named by the liveness poll after it does not undo it), then what the
        ring does after a publish (``ShmRing.direct_published``)."""
        self.writer.step += 1
        ring.direct_published(wake)

    def _sent(self, step: int, prep: Prepared) -> None:
        self.writer.step = step
        if prep.lblock:
            self.writer.sent(prep.key, prep.lid)

    def _send_step(self, nbytes: int, fill: Callable[[memoryview, int], None], sent: Callable[[], None]) -> None:
        """One numbered frame; ``sent()`` once it reached the followers -- also when the ring
        names a dead reader right AFTER publishing it (its liveness poll follows each publish):
        the live followers hold that step, so the next frame must be numbered after it."""
        out = self.objects.frames_out
        try:
            self.objects.send_frame(nbytes, fill)
        except BaseException:
            if self.objects.frames_out != out:
                sent()
            raise
        sent()

    def abort(self, error: BaseException) -> None:
        """Driver: the current step failed before its frame was published; every follower's
        pending receive raises ``error``'s builtin class naming the step (``cpmeta.broadcast.
        wire.DriverAbort``). When the transport cannot take the abort now it stays pending and
        goes before the next frame (its failure is left to the caller's own error)."""
        if not self.objects.has_readers:
            return
        self._aborts.append(abort_values(error))
        try:
            self._flush_aborts()
        except Exception:  # noqa: BLE001 - the caller raises its own error; sent later
            pass

    def _flush_aborts(self) -> None:
        while self._aborts:
            vblock = encode_body(self._aborts[0])
            flags = FLAG_ABORT | (FLAG_CRC if self.checksum else 0)
            _, data_at = blocks_at(0, len(vblock), 0)
            step = self.writer.step + 1

            def fill(view: memoryview, addr: int) -> None:
                self.writer.write(view, flags, 0, b"", vblock, None, (), 0, 0, step)
                seal(view, data_at, self.checksum)

            self._send_step(data_at, fill, lambda: self._abort_sent(step))

    def _abort_sent(self, step: int) -> None:
        self.writer.step = step
        del self._aborts[0]

    def send_packed(self, key: tuple, tensors: list[torch.Tensor], values: list[Any],
                    dims: Optional[tuple[int, ...]] = None) -> Prepared:
        """One frame with the CPU ``tensors`` (layout order) packed in it."""
        prep = self.prepare(key, values, dims, tensors)

        def write(view: memoryview, addr: int, data_at: int) -> None:
            prep.plan.pack(addr + data_at, tensors, prep.dims, prep.numels, prep.starts, prep.region)

        self.publish(prep, FLAG_PACKED, prep.exact, prep.region, write)
        return prep

    # ---- follower ---------------------------------------------------------------------------
    def receive(self, handler: Callable[[Frame, memoryview], Any],
                fast: Optional[Callable[[memoryview, int], Any]] = None) -> Any:
        """``handler(frame, view)`` of the next frame, inside the transport's read (``view`` is
        valid only during the call: copy what you keep). The frame's plan is cached once the
        handler returned. A malformed frame is a ``RuntimeError`` naming this rank and the
        source; a peer of another version or schema likewise. ``fast(view, step)``: a caller's
        compiled read of the frames it knows (``cpmeta.replicate.step_frame.StepReader``): what
        it returns (not None) is the result, the frame counted as step ``step``; None leaves the
        frame to the parser and ``handler``."""
        def consume(view: memoryview) -> Any:
            if fast is not None:
                got = fast(view, self.reader.step + 1)
                if got is not None:
                    self.reader.step += 1
                    return got
            frame = self.reader.parse(view, self.src)
            out = handler(frame, view)
            self.reader.keep(frame)
            return out

        try:
            return self.objects.recv_frame(consume)
        except DriverAbort as e:
            raise e.base(f"rank {self.rank}: step {e.step}: the driver (rank {self.src}) refused "
                         f"this step: {e.text}") from None
        except FrameMismatch as e:
            raise RuntimeError(f"rank {self.rank}: {e}") from None
        except _MALFORMED as e:
            raise self.malformed(e) from None

    def recv_packed(self) -> tuple[Frame, list[torch.Tensor]]:
        """The next packed frame and its tensors: views of ONE private CPU buffer (one copy out
        of the transport)."""
        from .outputs import copy_out_of_frame

        def handler(frame: Frame, view: memoryview) -> tuple[Frame, list[torch.Tensor]]:
            h = frame.head
            if not h.flags & FLAG_PACKED:
                raise WireError(f"{self.what}: frame without FLAG_PACKED (tensors must ride in it)")
            numels, starts, region = frame.plan.check_tensors(frame.dims, True, h.tbytes,
                                                              view.nbytes - h.data_at)
            buf = torch.empty(region, dtype=torch.uint8)
            if region:
                copy_out_of_frame(buf, view, h.data_at, region)
            return frame, frame.plan.views(buf, frame.dims, numels, starts)

        return self.receive(handler)

    def warm_with(self, hook: Callable[[], Any]) -> bool:
        """Follower: have the ring call ``hook`` while this rank spins for its next frame, when it
        can (a same-host follower, ``CPMETA_WARM`` on, no checksum: a checksummed frame's crc
        covers its tensor region, which a saved head lacks). Returns whether it will. A hook that
        returns an iterator (a generator: one piece of warming per item) is left between two
        pieces as soon as the frame is in."""
        ring = self.objects.ring
        if self.is_src or ring is None or not envs.warm() or self.checksum:
            return False
        ring.warm = hook
        return True

    def recheck(self, head: bytes, step: int) -> Frame:
        """Parse again, read-only, a frame this rank already accepted: ``head`` its bytes before
        the tensor region, ``step`` its step number (this rank's step count is left as it is).
        A follower spinning for its next frame runs it to keep the parse path warm (the
        ``warm`` hooks of ``MetadataBroadcaster`` and ``ReplicatedBatchState``)."""
        reader = self.reader
        now = reader.step
        reader.step = step - 1  # parse proves the saved frame's step (an abort may have come since)
        try:
            return reader.parse(memoryview(head), self.src)
        finally:
            reader.step = now

    def malformed(self, e: BaseException) -> RuntimeError:
        return RuntimeError(f"rank {self.rank}: malformed {self.what} message from src={self.src}: "
                            f"{type(e).__name__}: {e}")

    def announce(self) -> None:
        self.objects.announce()

    def close(self) -> None:
        self.objects.close()


def resolve_src(group: Any, src: Optional[int], group_src: Optional[int]) -> int:
    """Global rank of the driver from ``src`` (global) or ``group_src`` (inside ``group``)."""
    ranks = dist.get_process_group_ranks(group)
    if src is not None and group_src is not None:
        raise ValueError(f"give src (global rank) or group_src (rank inside the group), not both: "
                         f"src={src}, group_src={group_src}")
    if group_src is not None:
        if type(group_src) is not int or not 0 <= group_src < len(ranks):
            raise ValueError(f"group_src: expected a rank inside the group (0..{len(ranks) - 1}), "
                             f"got {group_src!r}")
        return ranks[group_src]
    src = 0 if src is None else src
    if type(src) is not int or src not in ranks:
        raise ValueError(f"src: global rank {src!r} is not in the group (global ranks {ranks}); "
                         "to name the driver by its rank inside the group use group_src=")
    return src
