"""``LayoutArena``: the persistent buffers and cached metadata of ONE layout (``persistent_outputs``).

See :mod:`cpmeta.broadcast.persistent` for the pool that holds these (budget, depth, eviction) and
the lifetime of what they hand out. One arena::

    host arena (uint8, the frame's tensor region byte for byte -- dtype runs, 16-aligned, the
                layout of a builder's cpmeta.buffers.ArenaLayout too; pinned on CUDA)
    device arena (CPU: the host arena itself; CUDA: one device buffer of the same bytes)
    md: the metadata built ONCE for the layout, its tensors views of the device arena

On CUDA a step's device copy is ordered after the kernels that read the arena's previous result
(stream order on the caller's stream, an event when the caller changed streams); refilling the
host arena first waits for the one event of its previous H2D copy (never a device-wide sync).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any, Iterator, Optional

import torch

from .outputs import all_cpu, copy_out_of_frame, copy_views
from .plan import Plan, one_source
from .schema import Schema

__all__ = ["LayoutArena", "tuple_getter", "value_setter"]

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS = operator.is_
_TOUCH_LINES = 1024  # cache lines a warm piece reads (64 KiB)


def tuple_getter(names: list[str]) -> Any:
    """``f(obj) -> tuple`` of the named attributes (one C call; ``()`` for none)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*names)


def value_setter(plan: Plan) -> Any:
    """``f(md, values)`` writing one step's values at the layout's value paths (made once)."""
    schema = plan.schema
    assert isinstance(schema, Schema), "persistent outputs hold dataclasses"
    names = schema.field_names
    slots = [(names[pos], sub) for pos, sub in plan.value_slots]

    def set_values(md: Any, values: list[Any]) -> None:
        for (n, sub), v in zip(slots, values):
            if sub is None:
                setattr(md, n, v)
            else:
                getattr(md, n)[sub] = v
    return set_values


class LayoutArena:
    """The persistent buffers and cached metadata of one layout (see the module docstring).

    ``region`` is the frame's tensor-region size for this layout (``Plan.sizes(dims)[2]``);
    tensor ``i`` lies at ``starts[run] + sum(numel * element size of the run's earlier tensors)``,
    exactly as in the frame. Worked example: int32 ``positions`` [3] and int32 ``block_table``
    [3, 2] are one run at byte 0, region 48: positions is ``dev[0:12].view(int32)``, block_table
    ``dev[12:36].view(int32).view(3, 2)``.
    """

    __slots__ = ("region", "exact", "host", "host_ptr", "dev", "md", "tensors", "event",
                 "reader_stream", "_fence", "src_ptrs", "_names", "_packed_ptrs", "_src",
                 "_offsets", "_nbytes", "_base", "_values", "_fixed", "_snap",
                 "_dict_snap", "_dict_lens", "_dict_tensors", "_lines")

    def __init__(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
                 region: int, values: list[Any], device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.region = region
        self.host = torch.empty(self.region, dtype=torch.uint8, pin_memory=cuda)
        self.host_ptr = self.host.data_ptr()
        self.dev = torch.empty(self.region, dtype=torch.uint8, device=device) if cuda else self.host
        self.event: Any = torch.cuda.Event() if cuda else None  # the H2D copy read the host arena
        self._fence: Any = torch.cuda.Event() if cuda else None  # readers on another stream done
        self.reader_stream: Any = None  # CUDA: the stream current when the last result was returned
        self.tensors = tensors = plan.views(self.dev, dims, numels, starts)
        self.md = plan.assemble(tensors, values)
        # byte offset of every tensor in the region: a source whose tensors lie at base + these
        # offsets of ONE allocation is copied with one memmove (src_ptrs caches the last such base)
        self._offsets = [t.data_ptr() - self.dev.data_ptr() for t in tensors]
        self._nbytes = [t.numel() * t.element_size() for t in tensors]
        self.src_ptrs: Optional[tuple[int, ...]] = None
        self._base = 0  # address the one memmove copies from (with src_ptrs)
        self._packed_ptrs: Optional[tuple[int, ...]] = None  # last source that did NOT qualify
        self._src: list[torch.Tensor] = []  # the source tensors that qualified (compared by id)
        self._values = value_setter(plan)
        self._snapshot(plan)
        self._lines = self.host.numpy()[::64]  # one byte of each cache line (touch)

    def _snapshot(self, plan: Plan) -> None:
        """What the layout fixes (tensor, dict and None fields; dict entries holding tensors): the
        identity snapshot checked per step, restored when the caller changed it."""
        vpos = {pos for pos, sub in plan.value_slots if sub is None}
        schema = plan.schema
        assert isinstance(schema, Schema), "persistent outputs hold dataclasses"
        self._names = names = schema.field_names
        fixed = [i for i in range(len(names)) if i not in vpos]
        # one C call reads every fixed field (InputMetadata has ~57, a layout fixes all but its
        # few value fields, so the getter always returns a tuple)
        self._fixed = (fixed, tuple_getter([names[i] for i in fixed]))
        self._snap = self._fixed[1](self.md)
        self._dict_snap = [(d, dict(d)) for d in schema.get_all(self.md) if type(d) is dict]
        self._dict_lens = ([d for d, _ in self._dict_snap], [len(d) for d, _ in self._dict_snap])
        ents = [(d, k, v) for d, snap in self._dict_snap for k, v in snap.items()
                if isinstance(v, torch.Tensor)]
        self._dict_tensors = ([e[0] for e in ents], [e[1] for e in ents], [e[2] for e in ents])

    # ---- per step ---------------------------------------------------------------------------
    def wait_host(self) -> None:
        """CUDA: block until the previous step's H2D copy has read the host arena (normally long
        done), so refilling it cannot race that copy. No-op on CPU."""
        if self.event is not None:
            self.event.synchronize()

    def write(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Driver: the step's tensors (layout order) as the frame's tensor region at address
        ``dst`` (the ring slot itself; the host arena when no rank reads a frame, world 1): ONE
        ``memmove`` when the tensors lie in one allocation at exactly this arena's offsets (a
        builder's ``HostArena``: ``ArenaLayout`` lays fields out by the frame's rule; checked
        per step once a source qualified: the same tensor objects at the same addresses), else
        one per tensor; CUDA sources go through the host arena (device-to-host copies)."""
        if not self.region:
            return
        memmove = ctypes.memmove
        ptrs = tuple(map(_DATA_PTR, tensors))
        if (ptrs == self.src_ptrs and all(map(_IS, tensors, self._src))) or (
                ptrs != self._packed_ptrs and self._single_source(ptrs, tensors)):
            memmove(dst, self._base, self.region)
        elif ptrs == self._packed_ptrs or all_cpu(tensors):
            if not all(map(_IS_CONTIGUOUS, tensors)):
                tensors = [t.contiguous() for t in tensors]
                ptrs = tuple(map(_DATA_PTR, tensors))
            for p, o, n in zip(ptrs, self._offsets, self._nbytes):
                if n:
                    memmove(dst + o, p, n)
        else:
            self.wait_host()
            for d, t in zip(self.host_views(), tensors):
                d.copy_(t)
            if dst != self.host_ptr:
                memmove(dst, self.host_ptr, self.region)

    def take(self, src: int) -> None:
        """Driver, after the publish (off the followers' path): the frame's region at address
        ``src`` (still the driver's until its next step) into its own host arena, one memmove."""
        self.wait_host()
        if self.region:
            ctypes.memmove(self.host_ptr, src, self.region)

    def host_views(self) -> list[torch.Tensor]:
        """The host arena's tensors (same layout as the device views); used off the hot path."""
        return [self.host[o:o + n].view(t.dtype).view(t.shape)
                for o, n, t in zip(self._offsets, self._nbytes, self.tensors)]

    def _single_source(self, ptrs: tuple[int, ...], tensors: list[torch.Tensor]) -> bool:
        """Whether every non-empty tensor lies, contiguous, in one CPU allocation at this arena's
        offsets from one base (``plan.one_source``; then cached)."""
        cpu = all_cpu(tensors)
        base = one_source(tensors, list(ptrs), self._offsets, self._nbytes, self.region) \
            if cpu and all(map(_IS_CONTIGUOUS, tensors)) else 0
        if base:
            self.src_ptrs, self._src, self._base = ptrs, list(tensors), base
        elif cpu:
            self._packed_ptrs = ptrs
        return bool(base)

    def touch(self) -> Iterator[None]:
        """Read every cache line of the host arena and run the per-step identity check of the
        fields the layout fixes (a follower warming up for its next step; writes nothing). A
        generator: one piece per 1024 lines (64 KiB), for a ring that stops between pieces."""
        lines = self._lines
        for at in range(0, len(lines), _TOUCH_LINES):
            lines[at:at + _TOUCH_LINES].sum()
            yield
        all(map(_IS, self._fixed[1](self.md), self._snap))

    def land(self, view: memoryview, at: int) -> None:
        """Follower: the frame's tensor region ``view[at:at + region]`` (bounds already proven)
        into the host arena: one ``memmove`` (a read-only view: one slice assignment)."""
        if self.event is not None:
            self.event.synchronize()  # (wait_host, inlined: the follower's per-step path)
        if self.region:
            copy_out_of_frame(self.host, view, at, self.region)

    def finish(self, values: list[Any]) -> Any:
        """Both sides: [CUDA: one non-blocking H2D copy of the arena on the current stream, after
        the kernels that read the previous result (:meth:`_after_readers`)], the layout's fields
        restored if the caller changed them, this step's values set; returns the cached metadata."""
        self._upload()
        return self._current(values)

    def _upload(self) -> None:
        """CUDA: the host arena into the device arena, ONE non-blocking copy on the current
        stream after the previous result's readers (event recorded). No-op on CPU."""
        if self.event is not None:
            stream = self._after_readers()
            self.dev.copy_(self.host, non_blocking=True)  # on the current stream
            self.event.record(stream)

    # ---- the collective path: the frame's tensor region as ONE broadcast of the device arena ----
    def fill_device(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Driver: the step's ``tensors`` (layout order) into the device arena, which the
        collective then sends whole: CPU tensors through the host arena (:meth:`write`) and ONE
        H2D copy, device tensors copied into its views, stream-ordered after the previous
        result's readers. Returns the device arena."""
        if self.event is None or all_cpu(tensors):
            self.wait_host()
            self.write(tensors, self.host_ptr)
            self._upload()
        else:
            self._after_readers()
            copy_views(self.tensors, tensors)
        return self.dev

    def receive_device(self) -> torch.Tensor:
        """Follower: the device arena, for the collective to overwrite with the frame's tensor
        region; ordered (CUDA) after the kernels that read the previous result."""
        if self._fence is not None:
            self._after_readers()
        return self.dev

    def result(self, values: list[Any]) -> Any:
        """After the collective filled the device arena: the cached metadata with this step's
        values (as :meth:`finish`, without its H2D copy)."""
        return self._current(values)

    def _after_readers(self) -> Any:
        """CUDA: order this step's device writes after every kernel that may read the previous
        result. Those run on the stream that was current when it was returned (the caller's
        stream); when that is the current stream, stream order already does it; otherwise an
        event recorded on it now is waited for on the current stream (no host wait, no device-wide
        sync). Returns the current stream, which becomes the readers' stream."""
        cur = torch.cuda.current_stream(self.dev.device)
        prev = self.reader_stream
        if prev is not None and prev != cur:
            self._fence.record(prev)
            cur.wait_event(self._fence)
        self.reader_stream = cur
        return cur

    def _current(self, values: list[Any]) -> Any:
        """The cached metadata with this step's values, after putting back what the caller
        changed: the fixed fields (one identity pass), the dicts' sizes and tensor entries."""
        md = self.md
        ds, ks, vs = self._dict_tensors
        if not (all(map(_IS, self._fixed[1](md), self._snap))
                and list(map(len, self._dict_lens[0])) == self._dict_lens[1]
                and all(map(_IS, map(dict.get, ds, ks), vs))):
            self._restore()
        self._values(md, values)
        return md

    def _restore(self) -> None:
        """Put back every field the layout fixes (the caller replaced or added some)."""
        for i, v in zip(self._fixed[0], self._snap):
            setattr(self.md, self._names[i], v)
        for d, snap in self._dict_snap:
            d.clear()
            d.update(snap)
