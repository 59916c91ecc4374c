"""Bounded caches: the one helper behind every per-shape / per-config memo of the library.

Builders and staging keep small memos (arena layouts per batch shape, per-config constant columns,
views per staged shape). Each used to be a plain dict cleared by hand when it grew; these two
classes bound them once, dropping the OLDEST entry first (insertion order), so a workload that
cycles through a few shapes keeps them and one that makes new shapes forever stays bounded:

- :class:`BoundedCache`: a dict with at most ``maxsize`` entries; reads are plain dict reads,
  inserts go through ``put`` (the hot paths call ``get`` then ``put`` on a miss, no closure per
  call); :meth:`BoundedCache.get_or_make` for cold paths.
- :class:`IdentityCache`: keyed by an object's IDENTITY (``id(obj)``, checked with ``is``; the
  entry keeps the object alive, so its id cannot be reused). For keys whose equality leaves out
  what the memo depends on -- ``MetadataConfig`` compares without its ``ngram_lookup`` table, and a
  staging layout made for one config writes that config's table
  (``tests/test_staging_njit.py::test_configs_equal_but_for_their_ngram_table_stage_their_own``) --
  and for keys that are expensive to hash (that config's hash builds a tuple of every field).

Example::

    layouts: BoundedCache[tuple[int, int], ArenaLayout] = BoundedCache(256)
    lay = layouts.get((T, n))
    if lay is None:
        lay = layouts.put((T, n), make_layout(T, n))     # the 257th shape drops the oldest

    per_cfg: IdentityCache[MetadataConfig, dict] = IdentityCache(64)
    consts = per_cfg.get_or_make(cfg, dict)              # the same dict for the same cfg object

Not thread-safe (like the memos they replace): a race can only make an entry twice.
This module imports nothing from the project, so every room can use it.
"""

from __future__ import annotations

from typing import Callable, Generic, Hashable, Optional, TypeVar

__all__ = ["BoundedCache", "IdentityCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
O = TypeVar("O")


class BoundedCache(dict[K, V]):
    """A dict of at most ``maxsize`` entries: :meth:`put` on a full cache drops the oldest first.

    Reads are the dict's own (``get``, ``in``, ``len``: C calls, no Python frame on the hot path);
    INSERT through :meth:`put` / :meth:`get_or_make` (a plain ``c[k] = v`` is not bounded).
    """

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        if maxsize < 1:
            raise ValueError(f"maxsize: expected >= 1, got {maxsize}")
        self.maxsize = int(maxsize)

    def put(self, key: K, value: V) -> V:
        """Store ``value`` (dropping the oldest entry when full) and return it."""
        if key not in self and len(self) >= self.maxsize:
            del self[next(iter(self))]
        self[key] = value
        return value

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """``get(key)``, or ``put(key, make())`` on a miss (values are never ``None``)."""
        v = self.get(key)
        return self.put(key, make()) if v is None else v


class IdentityCache(Generic[O, V]):
    """Values per object IDENTITY, at most ``maxsize`` objects (the oldest dropped first)."""

    __slots__ = ("_c",)

    def __init__(self, maxsize: int) -> None:
        self._c: BoundedCache[int, tuple[O, V]] = BoundedCache(maxsize)

    def get(self, obj: O) -> Optional[V]:
        hit = self._c.get(id(obj))
        return hit[1] if hit is not None and hit[0] is obj else None

    def put(self, obj: O, value: V) -> V:
        self._c.put(id(obj), (obj, value))
        return value

    def get_or_make(self, obj: O, make: Callable[[], V]) -> V:
        """The value of ``obj``, or ``put(obj, make())`` on a miss."""
        hit = self._c.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        return self.put(obj, make())

    def __len__(self) -> int:
        return len(self._c)
