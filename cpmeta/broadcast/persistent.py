"""Persistent outputs: ``MetadataBroadcaster(..., persistent_outputs=True)`` (DESIGN 7).

An engine pads its batches to a few captured sizes, so the same LAYOUT (fields, dtypes, shapes)
comes back step after step. For each layout seen, every rank keeps one :class:`LayoutArena`:

    host arena (uint8, the frame's tensor region byte for byte -- dtype runs, 16-aligned, or
                a span of the driver's allocation (cpmeta.broadcast.span); pinned on CUDA)
    device arena (CPU: the host arena itself; CUDA: one device buffer of the same bytes)
    md: the InputMetadata built ONCE for the layout, its tensors views of the device arena

A step of a known layout then costs, besides the header and the few values::

    driver     md's tensors ──one memmove (span) or one per tensor──▶ ring slot (the region)
               after the publish: ring slot ──one memmove──▶ host arena
    follower   frame region ──one memmove──▶ host arena
    both       [CUDA: host arena ──one non-blocking H2D on the current stream──▶ device arena]
               values set on the cached md; the cached md is returned

Validity: the returned metadata lives in the broadcaster's arena of its layout; it stays valid
until the next ``broadcast`` with the SAME layout, which overwrites it (tensors and values; it is
the same object). A broadcast of another layout leaves it alone. At most ``MAX_LAYOUTS`` arenas
(and ``MAX_ARENA_BYTES`` of host arena) are kept, the least recently used dropped first; a dropped
arena's metadata stays alive (and unchanged) as long as the caller holds it.

Fields the caller adds to, or replaces in, a returned metadata (``compute_attn_info`` sets new
fields in place) are restored to the layout's state by the next step of that layout, so no stale
field survives into a later step. Changing a returned tensor's shape or storage in place
(``resize_``, ``set_``, ``squeeze_``) is not undone: those tensors are the arena's views.
"""

from __future__ import annotations

import ctypes
import operator
from collections import OrderedDict
from typing import Any, Optional

import torch

from .collect_memo import CollectMemo
from .outputs import copy_out_of_frame
from .plan import Plan
from .schema import Schema
from .span import check_span, span_of, table_bytes
from .wire import ELEMENT_SIZE, MAX_LAYOUTS, WIRE_DTYPES, WireError

__all__ = ["LayoutArena", "PersistentArenas", "MAX_ARENA_BYTES"]

#: Host bytes the persistent arenas of one broadcaster may hold; past it the least recently used
#: arenas are dropped (prompt-32k is ~2.4 MB an arena, decode-256 ~180 KB).
MAX_ARENA_BYTES = 1 << 30

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS = operator.is_


class LayoutArena:
    """The persistent buffers and cached metadata of one layout (see the module docstring).

    ``region`` is the frame's tensor-region size for this layout (``Plan.sizes(dims)[2]``);
    tensor ``i`` lies at ``starts[run] + sum(numel * element size of the run's earlier tensors)``,
    exactly as in the frame. Worked example: int32 ``positions`` [3] and int32 ``block_table``
    [3, 2] are one run at byte 0, region 48: positions is ``dev[0:12].view(int32)``, block_table
    ``dev[12:36].view(int32).view(3, 2)``.
    """

    __slots__ = ("region", "exact", "span", "host", "host_ptr", "dev", "md", "tensors", "event",
                 "src_ptrs", "_names", "_packed_ptrs", "_src", "_offsets", "_nbytes", "_data_at", "_base",
                 "_values", "_fixed", "_snap", "_dict_snap", "_dict_lens", "_dict_tensors")

    def __init__(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
                 region: int, values: list[Any], device: torch.device,
                 span: Optional[tuple[bytes, list[int], int]] = None) -> None:
        cuda = device.type == "cuda"
        #: span geometry (FLAG_SPAN): (offsets table, offsets, span bytes); None: packed runs
        self.span = span
        self.region = region if span is None else len(span[0]) + span[2]
        self.host = torch.empty(self.region, dtype=torch.uint8, pin_memory=cuda)
        self.host_ptr = self.host.data_ptr()
        self.dev = torch.empty(self.region, dtype=torch.uint8, device=device) if cuda else self.host
        self.event: Any = torch.cuda.Event() if cuda else None
        if span is None:
            self._data_at = 0
            tensors = plan.views(self.dev, dims, numels, starts)
        else:
            self._data_at = len(span[0])
            self.host[:self._data_at] = torch.frombuffer(bytearray(span[0]), dtype=torch.uint8)
            at = [self._data_at + o for o in span[1]]
            tensors = _span_views(self.dev, plan, dims, numels, at)
        self.tensors = tensors
        self.md = plan.assemble(tensors, values)
        # byte offset of every tensor in the region: a source whose tensors lie at base + these
        # offsets of ONE allocation is copied with one memmove (src_ptrs caches the last such base)
        self._offsets = [t.data_ptr() - self.dev.data_ptr() for t in tensors]
        self._nbytes = [t.numel() * t.element_size() for t in tensors]
        self.exact = sum(self._nbytes)  # the header's tensor bytes
        self.src_ptrs: Optional[tuple[int, ...]] = None
        self._base = 0  # address the one memmove copies from (with src_ptrs)
        self._packed_ptrs: Optional[tuple[int, ...]] = None  # last source that did NOT qualify
        self._src: list[torch.Tensor] = []  # the source tensors that qualified (compared by id)
        self._values = _value_setter(plan)
        # what the layout fixes (tensor, dict and None fields; dict entries holding tensors): the
        # identity snapshot checked per step, restored when the caller changed it
        vpos = {pos for pos, sub in plan.value_slots if sub is None}
        schema = plan.schema
        assert isinstance(schema, Schema), "persistent outputs hold dataclasses"
        self._names = names = schema.field_names
        fixed = [i for i in range(len(names)) if i not in vpos]
        # one C call reads every fixed field (InputMetadata has ~57, a layout fixes all but its
        # few value fields, so the getter always returns a tuple)
        self._fixed = (fixed, _tuple_getter([names[i] for i in fixed]))
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
        ``dst`` (the ring slot itself; the host arena when no rank reads a frame, world 1): a
        span's offsets table (unless ``dst`` is the host arena), then ONE ``memmove`` when the
        tensors lie in one allocation at exactly this arena's offsets (checked per step once a
        source qualified: the same tensor objects at the same addresses), else one per tensor;
        CUDA sources go through the host arena (device-to-host copies)."""
        if not self.region:
            return
        memmove = ctypes.memmove
        if self._data_at and dst != self.host_ptr:
            memmove(dst, self.host_ptr, self._data_at)  # the offsets table (fixed per arena)
        ptrs = tuple(map(_DATA_PTR, tensors))
        if (ptrs == self.src_ptrs and all(map(_IS, tensors, self._src))) or (
                ptrs != self._packed_ptrs and self._single_source(ptrs, tensors)):
            memmove(dst + self._data_at, self._base, self.region - self._data_at)
        elif ptrs == self._packed_ptrs or all(t.device.type == "cpu" for t in tensors):
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
        offsets from one base, the whole data section inside that allocation (then cached)."""
        live = [(p, o) for p, o, n in zip(ptrs, self._offsets, self._nbytes) if n]
        if not live:
            return False
        base = live[0][0] - live[0][1] + self._data_at
        s0 = tensors[0].untyped_storage()
        lo, hi = s0.data_ptr(), s0.data_ptr() + s0.nbytes()
        ok = (base >= lo and base + self.region - self._data_at <= hi
              and all(p - o + self._data_at == base for p, o in live)
              and all(t.device.type == "cpu" and t.is_contiguous()
                      and t.untyped_storage().data_ptr() == lo for t in tensors))
        if ok:
            self.src_ptrs, self._src, self._base = ptrs, list(tensors), base
        elif all(t.device.type == "cpu" for t in tensors):
            self._packed_ptrs = ptrs
        return ok

    def land(self, view: memoryview, at: int) -> None:
        """Follower: the frame's tensor region ``view[at:at + region]`` (bounds already proven)
        into the host arena: one ``memmove`` (a read-only view: one slice assignment)."""
        if self.event is not None:
            self.event.synchronize()  # (wait_host, inlined: the follower's per-step path)
        if self.region:
            copy_out_of_frame(self.host, view, at, self.region)

    def finish(self, values: list[Any]) -> Any:
        """Both sides: [CUDA: one non-blocking H2D copy of the arena, stream-ordered on the
        current stream], the layout's fields restored if the caller changed them, this step's
        values set; returns the cached metadata."""
        if self.event is not None:
            self.dev.copy_(self.host, non_blocking=True)  # on dev's device's current stream
            self.event.record(torch.cuda.current_stream(self.dev.device))
        return self._current(values)

    def finish_collective(self, got: list[torch.Tensor], values: list[Any]) -> Any:
        """Tensors that came by one collective (NCCL): copied into the arena's device views
        (stream-ordered), then as :meth:`finish` without the H2D copy."""
        if got:
            torch._foreach_copy_(self.tensors, got, non_blocking=True)
        return self._current(values)

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


def _tuple_getter(names: list[str]) -> Any:
    """``f(obj) -> tuple`` of the named attributes (one C call; ``()`` for none)."""
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*names)


def _span_views(buf: torch.Tensor, plan: Plan, dims: tuple[int, ...], numels: list[int],
                offsets: list[int]) -> list[torch.Tensor]:
    """Tensor ``i`` of the layout as ``buf[offsets[i]:...]`` viewed with its dtype and shape
    (offsets already proven aligned and in bounds)."""
    out, at = [], 0
    for code, nd, m, o in zip(plan.codes, plan.ndims, numels, offsets):
        out.append(buf[o:o + m * ELEMENT_SIZE[code]].view(WIRE_DTYPES[code])
                   .view(tuple(dims[at:at + nd])))
        at += nd
    return out


def _value_setter(plan: Plan) -> Any:
    """``f(md, values)`` writing one step's values at the layout's value paths (compiled once)."""
    slots = [(plan.schema.field_names[pos], sub) for pos, sub in plan.value_slots]
    if all(sub is None for _, sub in slots):
        names = [n for n, _ in slots]

        def set_flat(md: Any, values: list[Any]) -> None:
            for n, v in zip(names, values):
                setattr(md, n, v)
        return set_flat

    def set_nested(md: Any, values: list[Any]) -> None:
        for (n, sub), v in zip(slots, values):
            if sub is None:
                setattr(md, n, v)
            else:
                getattr(md, n)[sub] = v
    return set_nested


class PersistentArenas:
    """One :class:`LayoutArena` per layout ``(plan key, flat dims)``, least recently used dropped
    first past ``MAX_LAYOUTS`` arenas or ``max_bytes`` of host arena."""

    def __init__(self, device: torch.device, schema: Schema, max_bytes: int = MAX_ARENA_BYTES) -> None:
        self.device = device
        self.collect = CollectMemo(schema)  # the driver's collect, memoised per tuple of field types
        self.max_bytes = int(max_bytes)
        self._arenas: "OrderedDict[tuple, LayoutArena]" = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._arenas)

    def get(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
            region: int, values: list[Any], table: Optional[bytes] = None,
            span: Optional[tuple[bytes, list[int], int]] = None) -> tuple[LayoutArena, bool]:
        """``(arena, new)``: the arena of this layout, made now (``new``) on its first step.

        Followers key span frames by their offsets ``table`` too (``span`` then gives the proven
        geometry for a new arena); the driver passes neither and chooses the geometry with
        :meth:`driver_arena`."""
        key = (plan.key, dims, table)
        a = self.find(key)
        if a is not None:
            return a, False
        return self._add(key, LayoutArena(plan, dims, numels, starts, region, values, self.device,
                                          span)), True

    def driver_arena(self, plan: Plan, dims: tuple[int, ...], numels: list[int],
                     starts: list[int], region: int, exact: int, values: list[Any],
                     tensors: list[torch.Tensor]) -> LayoutArena:
        """Driver: the arena of this layout; a new one takes the span geometry when this first
        step's tensors lie in one host allocation (``span.span_of``), else the packed runs."""
        key = (plan.key, dims, None)
        a = self.find(key)
        if a is not None:
            return a
        span = span_of(tensors, exact)
        return self._add(key, LayoutArena(plan, dims, numels, starts, region, values, self.device,
                                          span))

    def find(self, key: tuple) -> Optional[LayoutArena]:
        """The arena under ``key`` (marked most recently used), or ``None``."""
        a = self._arenas.get(key)
        if a is not None:
            self._arenas.move_to_end(key)
        return a

    def _add(self, key: tuple, a: LayoutArena) -> LayoutArena:
        while self._arenas and (len(self._arenas) >= MAX_LAYOUTS
                                or self._bytes + a.region > self.max_bytes):
            _, old = self._arenas.popitem(last=False)
            self._bytes -= old.region
        self._arenas[key] = a
        self._bytes += a.region
        return a


def land_span(arenas: Optional[PersistentArenas], plan: Plan, dims: tuple[int, ...],
              tbytes: int, view: memoryview, data_at: int, values: list[Any],
              device: torch.device) -> LayoutArena:
    """Follower, a ``FLAG_SPAN`` frame whose header, layout and values passed their checks: its
    region into the arena of (layout, dims, offsets table), proven once by ``span.check_span``.
    Without persistent arenas (``arenas`` None) a fresh arena each call (fresh tensors)."""
    tl = table_bytes(len(plan.codes))
    avail = view.nbytes - data_at
    if avail < tl:
        raise WireError(f"span frame: {avail} bytes after the shapes, offsets table needs {tl}")
    table = bytes(view[data_at:data_at + tl])
    a = arenas.find((plan.key, dims, table)) if arenas is not None else None
    if a is None or a.region != avail or a.exact != tbytes:
        numels, offsets, exact = check_span(plan, dims, tbytes, table, avail)
        geo = (table, offsets, avail - tl)
        if arenas is None:
            a = LayoutArena(plan, dims, numels, [], 0, values, device, geo)
        else:
            a = arenas.get(plan, dims, numels, [], 0, values, table, geo)[0]
            if a.region != avail or a.exact != tbytes:  # same table, other length: never cached
                a = LayoutArena(plan, dims, numels, [], 0, values, device, geo)
    a.land(view, data_at)
    return a
