"""Persistent outputs: ``MetadataBroadcaster(..., persistent_outputs=True | depth)``.

An engine pads its batches to a few captured sizes, so the same LAYOUT (fields, dtypes, shapes)
comes back step after step. For each layout every rank keeps ``depth`` arenas
(:class:`~cpmeta.broadcast.arena.LayoutArena`: host buffer, device buffer on CUDA, the metadata
built once as views of it), used in turn. A step of a held layout then costs, besides the header
and the few values::

    driver     md's tensors ──one memmove (a builder arena) or one per tensor──▶ ring slot (the region)
               after the publish: ring slot ──one memmove──▶ host arena
    follower   frame region ──one memmove──▶ host arena
    both       [CUDA: host arena ──one non-blocking H2D on the current stream──▶ device arena]
               values set on the cached md; the cached md is returned

Budget: at most ``MAX_HELD_LAYOUTS`` layouts and ``MAX_ARENA_BYTES`` host bytes (each arena counts
its tensor region once; on CUDA the device holds as many again); past either the least recently
used layout is dropped, all its arenas. A layout whose ``depth`` arenas alone exceed the bytes
gets fresh tensors, exactly as with ``persistent_outputs=False``.

Lifetime: a result lives in its arena until that arena's turn comes again, i.e. until ``depth``
more broadcasts of the same layout have run (tensors and values: with depth 1 it is the same
object), and at least until the ``depth``-th next ``broadcast`` of any layout: depth 1 "valid until
the next broadcast", depth 2 "valid until the broadcast after next" (step N's result is untouched
by step N+1's broadcast, so an engine may build and send N+1 while N runs). A dropped arena is
never rewritten: its results stay valid as long as the caller holds them. What the library derives
from a result keeps its own copies (``cpmeta.cp_kv_read_plan``).

Fields the caller adds to, or replaces in, a returned metadata (``compute_attn_info`` sets new
fields in place) are restored to the layout's state by the next step of that arena, so no stale
field survives into a later step. Changing a returned tensor's shape or storage in place
(``resize_``, ``set_``, ``squeeze_``) is not undone: those tensors are the arena's views.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch

from .arena import LayoutArena
from .plan import Plan

__all__ = ["LayoutArena", "PersistentArenas", "MAX_ARENA_BYTES", "MAX_HELD_LAYOUTS", "MAX_DEPTH",
           "depth_of"]

#: Host bytes the persistent arenas of one broadcaster may hold (prompt-32k is ~2.4 MB an arena,
#: decode-256 ~180 KB); past it the least recently used layouts are dropped.
MAX_ARENA_BYTES = 256 << 20
#: Layouts one broadcaster holds arenas for (an engine's captured batch sizes fit many times over).
MAX_HELD_LAYOUTS = 64
#: Most arenas per layout (deeper pipelines than this keep their own copies).
MAX_DEPTH = 8


def depth_of(value: Any) -> int:
    """The depth a ``persistent_outputs=`` argument asks for: ``False`` -> 0 (fresh tensors),
    ``True`` -> 1, an int in ``[1, MAX_DEPTH]`` -> itself (arenas per layout, used in turn)."""
    if value is None or value is False:
        return 0
    if value is True:
        return 1
    if type(value) is int and 1 <= value <= MAX_DEPTH:
        return value
    raise ValueError(f"persistent_outputs: expected a bool or an int depth in [1, {MAX_DEPTH}], "
                     f"got {value!r}")


class _Ring:
    """The ``depth`` arenas of one layout, handed out in turn."""

    __slots__ = ("slots", "turn", "nbytes")

    def __init__(self, slots: list[LayoutArena]) -> None:
        self.slots, self.turn = slots, 0
        self.nbytes = sum(a.region for a in slots)


class PersistentArenas:
    """The rings of :class:`LayoutArena` of one broadcaster, keyed by layout ``(plan key, flat
    dims)``, ``depth`` arenas each, within the budget (module docstring).

    ``get`` returns the arena this step lands in, or ``None`` when the layout does not fit the
    budget (the caller then makes fresh tensors). Counters for ``MetadataBroadcaster.stats()``:
    ``persisted`` / ``fresh`` steps, ``created`` / ``evicted`` arenas; :attr:`host_bytes` /
    :attr:`device_bytes` held.
    """

    def __init__(self, device: torch.device, depth: int = 1) -> None:
        self.device = device
        self._depth = depth
        self._rings: "OrderedDict[tuple, _Ring]" = OrderedDict()
        self._bytes = 0
        self.persisted = self.fresh = self.created = self.evicted = 0

    def __len__(self) -> int:
        """Layouts held."""
        return len(self._rings)

    def arenas(self) -> Iterator[LayoutArena]:
        """Every arena held (all slots of every layout)."""
        for ring in self._rings.values():
            yield from ring.slots

    @property
    def host_bytes(self) -> int:
        """Host bytes held by the arenas (pinned on CUDA)."""
        return self._bytes

    @property
    def device_bytes(self) -> int:
        """Device bytes held by the arenas (0 on a CPU device: the host arena is the arena)."""
        return self._bytes if self.device.type == "cuda" else 0

    # ---- per step ---------------------------------------------------------------------------
    def get(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
            region: int, values: list[Any]) -> Optional[LayoutArena]:
        """The arena this step of the layout lands in (made now on the layout's first persisted
        step), or ``None`` (not persisted: fresh tensors)."""
        key = (plan.key, dims)
        ring = self._rings.get(key)
        if ring is not None:
            self._rings.move_to_end(key)
            return self._next(ring)
        return self._new(key, plan, dims, numels, starts, region, values)

    def _new(self, key: tuple, plan: Plan, dims: tuple[int, ...], numels: list[int],
             starts: list[int], region: int, values: list[Any]) -> Optional[LayoutArena]:
        """The ring of a new layout (``depth`` arenas), after evicting the least recently used
        layouts it needs room from; ``None`` when it cannot fit at all."""
        need = region * self._depth
        if need > MAX_ARENA_BYTES:
            self.fresh += 1
            return None
        while self._rings and (len(self._rings) >= MAX_HELD_LAYOUTS
                               or self._bytes + need > MAX_ARENA_BYTES):
            _, old = self._rings.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted += len(old.slots)
        ring = _Ring([self._arena(plan, dims, numels, starts, region, values)
                      for _ in range(self._depth)])
        self._rings[key] = ring
        self._bytes += ring.nbytes
        return self._next(ring)

    def _arena(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
               region: int, values: list[Any]) -> LayoutArena:
        self.created += 1
        return LayoutArena(plan, dims, numels, starts, region, values, self.device)

    def _next(self, ring: _Ring) -> LayoutArena:
        """The ring's arena whose turn it is."""
        i = ring.turn
        ring.turn = (i + 1) % len(ring.slots)
        self.persisted += 1
        return ring.slots[i]
