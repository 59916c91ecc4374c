"""The follower's side of a :class:`~cpmeta.broadcast.broadcaster.MetadataBroadcaster` step.

One ``broadcast(None)`` on a follower: the channel hands it the next proven frame
(``FrameChannel.receive``); :meth:`FollowerSide._consume` takes the frame's tensor region while the
ring slot is still held, and :meth:`FollowerSide._receive` turns what it took into the object::

    frame flags              _consume (slot held)                   _receive (slot released)
    FLAG_PACKED, arena       arena.land: one memmove                arena.finish(values)
    FLAG_PACKED              copy into a fresh (pinned) buffer      (H2D,) views -> Plan.assemble
    neither                  (the region follows in a collective)   ONE broadcast into the arena / a
                                                                    fresh buffer -> views, assemble

With ``out=`` every received tensor is written into the caller's buffers (``outputs.copy_to_out``).

Warming (:meth:`FollowerSide.warm`): while a same-host follower spins for its next frame (after
a frame, or once the driver announced a step: ``begin_step``), the ring calls it every ~100 us.
It replays, read-only, the last frame's checks (its header, layout, values and shapes, kept as
bytes) and reads the layout's arena, so the frame that lands meets warm caches instead of an
idle rank's cold ones.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, Callable, Iterator

import torch

from .channel import FrameChannel
from .outputs import copy_out_of_frame, copy_to_out
from .wire import FLAG_PACKED, Frame

__all__ = ["FollowerSide"]


class FollowerSide:
    """Mixin: the follower's half of ``MetadataBroadcaster`` (receive a frame, rebuild the object).

    The state below is set by ``MetadataBroadcaster.__init__``.
    """

    device: torch.device  # where received tensors live
    _ch: FrameChannel
    _persist: Any  # PersistentArenas with persistent_outputs, else None
    _pin: bool  # stage CUDA-bound bytes in pinned host memory
    _mark: float  # this step: when the frame arrived
    _info: tuple[int, bool]  # this step: payload bytes, layout block sent
    _tensor_channel: Callable[[], Any]  # the TensorChannel of the collective tensor path
    src: int  # the driver's global rank
    _warming: bool  # the ring calls warm (same-host follower, CPMETA_WARM, no checksum)
    _warm_from: Any  # (the last frame's bytes before its tensor region, its arena or None, its step)

    def _receive(self, out: Any) -> Any:
        plan, values, dims, numels, starts, region, buf = self._ch.receive(self._consume)
        if buf is None:  # the frame's tensor region follows as one collective (NCCL)
            arena = None if self._persist is None or out is not None else \
                self._persist.get(plan, dims, numels, starts, region, values)
            dev = arena.receive_device() if arena is not None else \
                torch.empty(region, dtype=torch.uint8, device=self.device)
            if region:
                self._tensor_channel().broadcast_buffer(dev)
            if arena is not None:
                return arena.result(values)
            got = plan.views(dev, dims, numels, starts)
        elif not isinstance(buf, torch.Tensor):  # a LayoutArena (landed by _consume)
            if out is None:
                return buf.finish(values)
            got = buf.tensors
            buf.finish(values)
        else:
            if self.device.type != "cpu":
                buf = buf.to(self.device, non_blocking=True)
            got = plan.views(buf, dims, numels, starts)
        per_path = copy_to_out(out, plan, got) if out is not None else None
        try:
            return plan.assemble(got, values, per_path)
        except (TypeError, ValueError, AttributeError) as e:
            raise self._ch.malformed(e) from None

    def warm(self) -> None:
        """Read-only replay of the last step's receive (module docstring): the frame checks of
        its saved head (this rank's step count untouched) and a read of its arena. Changes
        nothing a caller sees; raises what the checks raise (the ring then stops calling it)."""
        for _ in self._warm_pieces():
            pass

    def _warm_pieces(self) -> Iterator[None]:
        """:meth:`warm` one piece at a time (the ring's hook: it stops between two pieces once
        the next frame is in)."""
        got = self._warm_from
        if got is None:
            return
        head, arena, saved = got
        self._ch.recheck(head, saved)
        if arena is not None:
            yield
            yield from arena.touch()

    def _consume(self, frame: Frame, view: memoryview) -> tuple:
        """The tensor region of one proven frame (valid only during this call): landed in the
        layout's arena, copied into a fresh buffer, or left to the collective."""
        self._mark = perf_counter()
        h, plan, values, dims = frame.head, frame.plan, frame.values, frame.dims
        self._info = (h.tbytes + h.vlen + h.llen, h.llen > 0)
        numels, starts, total = plan.check_tensors(dims, bool(h.flags & FLAG_PACKED), h.tbytes,
                                                   view.nbytes - h.data_at)
        if not h.flags & FLAG_PACKED:
            return plan, values, dims, numels, starts, total, None
        arena = None if self._persist is None else \
            self._persist.get(plan, dims, numels, starts, total, values)
        if self._warming:
            self._warm_from = (bytes(view[:h.data_at]), arena, h.step)
        if arena is not None:  # the frame's region into the layout's arena, one memmove
            arena.land(view, h.data_at)
            return plan, values, dims, numels, starts, total, arena
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        if total:
            copy_out_of_frame(buf, view, h.data_at, total)
        return plan, values, dims, numels, starts, total, buf
