"""Generations of reusable buffers: refuse an object derived from a result that has been rewritten.

``MetadataBroadcaster(..., persistent_outputs=...)`` hands every rank metadata whose tensors are
views of a persistent arena, rewritten in place when the arena's turn comes again
(``cpmeta.broadcast.persistent``). An object DERIVED from such a result and kept across that
rewrite (``cpmeta.cp_kv_read_plan`` keeps ``md.block_tables`` by reference) would silently mix
the new contents with what it computed from the old ones. So every arena carries a
:class:`Generation`, bumped each time its contents are replaced, and a derived object stamps the
generation of what it keeps (:func:`stamp`) and checks it before using it again (:func:`check`)::

    md = bc.broadcast(None)                      # step N: md's tensors live in arena A (gen 3)
    plan = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=r)   # stamps (A's generation, 3)
    bc.broadcast(None)                           # step N+1, same layout: A rewritten, gen 4
    plan.slots                                   # StaleResultError: derived at generation 3, now 4

This module is the lowest room's (``cp`` and ``broadcast`` both use it): the broadcast room
registers each arena's storage, any room stamps and checks. A tensor outside every registered
storage has no stamp (``None``): it is never rewritten behind its holder's back.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["Generation", "StaleResultError", "register", "stamp", "check"]


class StaleResultError(RuntimeError):
    """An object derived from a persistent result was used after that result was rewritten."""


class Generation:
    """A counter bumped each time the buffer it belongs to is given new contents.

    ``what`` names the buffer for error messages (``"persistent arena of layout 3fa2c1 (slot 1 of
    2)"``)."""

    __slots__ = ("value", "what", "__weakref__")

    def __init__(self, what: str) -> None:
        self.value = 0
        self.what = what

    def bump(self) -> None:
        self.value += 1


#: (device type, device index, storage address) -> the generation of the arena owning that storage
_OWNERS: dict[tuple[str, int, int], "weakref.ref[Generation]"] = {}


def _key(t: torch.Tensor) -> tuple[str, int, int]:
    d = t.device
    return d.type, -1 if d.index is None else d.index, t.untyped_storage().data_ptr()


def register(storage: torch.Tensor, gen: Generation) -> None:
    """Record that every view of ``storage``'s storage belongs to the buffer counted by ``gen``
    (the entry goes when ``gen`` is collected; a later registration of the same address wins)."""
    key = _key(storage)
    if not key[2]:
        return  # an empty buffer (no address): nothing in it can be rewritten

    def gone(ref: "weakref.ref[Generation]") -> None:
        if _OWNERS.get(key) is ref:
            del _OWNERS[key]

    _OWNERS[key] = weakref.ref(gen, gone)


def stamp(t: Optional[torch.Tensor]) -> Optional[tuple[Generation, int]]:
    """``(generation, value now)`` of the registered buffer ``t`` is a view of; ``None`` when
    ``t`` is ``None`` or lies in no registered buffer."""
    if t is None:
        return None
    if not _OWNERS:
        return None
    ref = _OWNERS.get(_key(t))
    gen = ref() if ref is not None else None
    return None if gen is None else (gen, gen.value)


def check(st: Optional[tuple[Generation, int]], what: str) -> None:
    """Raise :class:`StaleResultError` naming ``what`` when the buffer stamped in ``st`` has been
    rewritten since (no-op for ``None``)."""
    if st is not None and st[0].value != st[1]:
        gen, was = st
        raise StaleResultError(
            f"{what}: derived from a broadcast result in the {gen.what} at generation {was}, "
            f"which a later broadcast has rewritten (generation {gen.value} now); derive it again "
            "from the current result, or keep results longer with "
            "PersistentPolicy(depth=...) (docs/metrics.md, 'Lifetime')")
