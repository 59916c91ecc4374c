"""Persistent outputs: ``MetadataBroadcaster(..., persistent_outputs=True | PersistentPolicy(...))``.

An engine pads its batches to a few captured sizes, so the same LAYOUT (fields, dtypes, shapes)
comes back step after step. For each layout it persists, every rank keeps ``depth`` arenas
(:class:`~cpmeta.broadcast.arena.LayoutArena`: host buffer, device buffer on CUDA, the metadata
built once as views of it), used in turn. A step of a persisted layout then costs, besides the
header and the few values::

    driver     md's tensors ──one memmove (a builder arena) or one per tensor──▶ ring slot (the region)
               after the publish: ring slot ──one memmove──▶ host arena
    follower   frame region ──one memmove──▶ host arena
    both       [CUDA: host arena ──one non-blocking H2D on the current stream──▶ device arena]
               values set on the cached md; the cached md is returned

What is persisted, and the budget (:class:`~cpmeta.broadcast.policy.PersistentPolicy`): a layout
from its ``min_repeats``-th step on, of the step ``kinds`` named, while its ``depth`` arenas fit
``max_bytes`` and ``max_layouts`` (past either bound the least recently used layout is dropped,
all its arenas). Any other step gets fresh tensors, exactly as with ``persistent_outputs=False``.
``persistent_outputs=True`` is the default policy: every layout, 256 layouts, 1 GiB, depth 1.

Lifetime: a persisted result lives in its arena until that arena's turn comes again, i.e. until
``depth`` more broadcasts of the same layout have run (tensors and values: with depth 1 it is the
same object), and at least until the ``depth``-th next ``broadcast`` of any layout: depth 1
"valid until the next broadcast", depth 2 "valid until the broadcast after next" (step N's result
is untouched by step N+1's broadcast, so an engine may build and send N+1 while N runs). A dropped
arena is never rewritten: its results stay valid as long as the caller holds them. When the turn
comes the arena's generation is bumped (``cpmeta.lifetime``): an object derived from the old
result (``cpmeta.cp_kv_read_plan``) refuses to be used. With ``CPMETA_POISON_ARENAS=1`` (debug)
the old arena is retired instead: its tensors are poisoned (integers their max, floats NaN) and
the step lands in a new arena, so a result read past its lifetime fails loudly.

Fields the caller adds to, or replaces in, a returned metadata (``compute_attn_info`` sets new
fields in place) are restored to the layout's state by the next step of that arena, so no stale
field survives into a later step. Changing a returned tensor's shape or storage in place
(``resize_``, ``set_``, ``squeeze_``) is not undone: those tensors are the arena's views.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch

from ..cache import BoundedCache
from .. import envs
from .arena import LayoutArena
from .plan import Plan
from .policy import MAX_ARENA_BYTES, PersistentPolicy
from .schema import Schema

__all__ = ["LayoutArena", "PersistentArenas", "PersistentPolicy", "MAX_ARENA_BYTES", "SEEN_LAYOUTS"]

#: Layouts whose steps ``min_repeats`` counts before they are persisted (least recently seen
#: forgotten first; a forgotten layout counts from 1 again).
SEEN_LAYOUTS = 4096


class _Ring:
    """The ``depth`` arenas of one layout, handed out in turn; ``uses`` counts its steps."""

    __slots__ = ("slots", "turn", "uses", "nbytes")

    def __init__(self, slots: list[LayoutArena]) -> None:
        self.slots, self.turn, self.uses = slots, 0, 0
        self.nbytes = sum(a.region for a in slots)


class PersistentArenas:
    """The rings of :class:`LayoutArena` of one broadcaster, keyed by layout ``(plan key, flat
    dims)``, under a :class:`PersistentPolicy` (module docstring).

    ``get`` returns the arena this step lands in, or ``None`` when the policy
    does not persist the step (the caller then makes fresh tensors). Counters for
    ``MetadataBroadcaster.stats()``: ``persisted`` / ``fresh`` steps, ``created`` / ``evicted`` /
    ``retired`` arenas; :attr:`host_bytes` / :attr:`device_bytes` held.
    """

    def __init__(self, device: torch.device, schema: Schema,
                 policy: Optional[PersistentPolicy] = None) -> None:
        self.device = device
        self.policy = policy = policy if policy is not None else PersistentPolicy()
        if policy.kinds is not None and "is_prompt" not in schema.field_names:
            raise ValueError(f"PersistentPolicy.kinds: {schema.name} has no is_prompt field to tell "
                             "a step's kind; use kinds=None")
        # plan -> index of is_prompt in its values
        self._kind_at: BoundedCache[Any, Optional[int]] = BoundedCache(SEEN_LAYOUTS)
        self._depth, self._min_repeats = policy.depth, policy.min_repeats
        self._poison = envs.poison_arenas()
        self._rings: "OrderedDict[tuple, _Ring]" = OrderedDict()
        self._seen: "OrderedDict[tuple, int]" = OrderedDict()
        self._bytes = 0
        self.persisted = self.fresh = self.created = self.evicted = self.retired = 0

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
            return self._next(ring, plan, dims, values)
        if not self._admit(key, plan, values):
            self.fresh += 1
            return None
        return self._new(key, plan, dims, numels, starts, region, values)

    # ---- policy -----------------------------------------------------------------------------
    def _admit(self, key: tuple, plan: Plan, values: list[Any]) -> bool:
        """Whether a layout not held yet is persisted from this step on: a step kind the policy
        names, and the layout's ``min_repeats``-th step (counted in ``_seen``)."""
        kinds = self.policy.kinds
        if kinds is not None:
            at = self._kind_at.get(plan, -1)
            if at == -1:
                at = self._kind_index(plan)
            is_prompt = values[at] if at is not None else None
            if type(is_prompt) is not bool or ("prompt" if is_prompt else "decode") not in kinds:
                return False
        if self._min_repeats > 1:
            n = self._seen.pop(key, 0) + 1
            if n < self._min_repeats:
                self._seen[key] = n
                if len(self._seen) > SEEN_LAYOUTS:
                    self._seen.popitem(last=False)
                return False
        return True

    def _kind_index(self, plan: Plan) -> Optional[int]:
        schema = plan.schema
        assert isinstance(schema, Schema), "persistent outputs hold dataclasses"
        names = schema.field_names
        at = next((i for i, (pos, sub) in enumerate(plan.value_slots)
                   if sub is None and names[pos] == "is_prompt"), None)
        self._kind_at.put(plan, at)
        return at

    def _new(self, key: tuple, plan: Plan, dims: tuple[int, ...], numels: list[int],
             starts: list[int], region: int, values: list[Any]) -> Optional[LayoutArena]:
        """The ring of a newly persisted layout (``depth`` arenas), after evicting the least
        recently used layouts it needs room from; ``None`` when it cannot fit at all."""
        need = region * self._depth
        pol = self.policy
        if need > pol.max_bytes or pol.max_layouts == 0:
            self.fresh += 1
            return None
        while self._rings and (len(self._rings) >= pol.max_layouts
                               or self._bytes + need > pol.max_bytes):
            _, old = self._rings.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted += len(old.slots)
        what = f"persistent arena of a {plan.schema.name} layout ({len(plan.codes)} tensors)"
        ring = _Ring([self._arena(plan, dims, numels, starts, region, values, what, i)
                      for i in range(self._depth)])
        self._rings[key] = ring
        self._bytes += ring.nbytes
        return self._next(ring, plan, dims, values)

    def _arena(self, plan: Plan, dims: tuple[int, ...], numels: list[int], starts: list[int],
               region: int, values: list[Any], what: str, slot: int) -> LayoutArena:
        self.created += 1
        return LayoutArena(plan, dims, numels, starts, region, values, self.device,
                           f"{what}, slot {slot + 1} of {self._depth}")

    def _next(self, ring: _Ring, plan: Plan, dims: tuple[int, ...], values: list[Any]) -> LayoutArena:
        """The ring's arena whose turn it is; a used one expires now (generation bumped, or, with
        ``CPMETA_POISON_ARENAS``, poisoned and replaced by a new arena)."""
        i = ring.turn
        a = ring.slots[i]
        ring.turn = (i + 1) % len(ring.slots)
        ring.uses += 1
        self.persisted += 1
        if ring.uses <= len(ring.slots):
            return a  # the arena's first step
        if not self._poison:
            a.recycle()
            return a
        a.poison()
        self.retired += 1
        what = a.gen.what.rsplit(", slot", 1)[0]
        numels, starts, region, _ = plan.sizes(dims)
        ring.slots[i] = new = self._arena(plan, dims, numels, starts, region, values, what, i)
        return new

