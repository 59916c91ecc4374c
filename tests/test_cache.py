"""``cpmeta.cache``: the bounded memo every room uses (oldest entry dropped first, identity keys)."""

from __future__ import annotations

import gc
import weakref

import pytest

from cpmeta.cache import BoundedCache, IdentityCache


def test_bounded_cache_drops_the_oldest_entry_first() -> None:
    c: BoundedCache[int, str] = BoundedCache(3)
    for k in range(3):
        assert c.put(k, str(k)) == str(k)
    c.put(1, "one")  # an update does not evict
    assert len(c) == 3 and c.get(1) == "one"
    c.put(3, "3")  # full: 0, the oldest insert, goes
    assert 0 not in c and list(c) == [1, 2, 3] and c.get(0) is None
    made = []
    assert c.get_or_make(2, lambda: made.append(1) or "x") == "2" and not made
    assert c.get_or_make(9, lambda: "nine") == "nine" and 1 not in c and len(c) == 3
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError, match="maxsize"):
        BoundedCache(0)


class _Key:
    """Unhashable by value on purpose: only its identity may key the cache."""

    __hash__ = None  # type: ignore[assignment]


def test_identity_cache_keys_by_object_and_keeps_it_alive() -> None:
    c: IdentityCache[_Key, list[int]] = IdentityCache(2)
    a, b = _Key(), _Key()
    va = c.get_or_make(a, list)
    assert c.get_or_make(a, list) is va and c.get(b) is None
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is not None  # the entry holds the key object: its id cannot be reused meanwhile
    c.put(b, [2])
    fresh = _Key()
    c.put(fresh, [3])  # a third object: the oldest (a) is dropped, and with it the last reference
    gc.collect()
    assert alive() is None and len(c) == 2 and c.get(b) == [2] and c.get(fresh) == [3]
