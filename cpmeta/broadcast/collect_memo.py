"""``CollectMemo``: the persistent driver's ``collect`` for a step made of an earlier step's tensors.

An engine that builds with ``out=OutputArenas()`` hands the broadcaster a new ``InputMetadata``
(or any schema'd dataclass) every step whose tensors are the SAME objects (new dicts, new
values). ``collect.collect`` still walks
the fields, the dict entries, the aliasing, dtypes and ranks to find the layout; when the tensors
are the objects of the last step of those field types, all of that is known. Per step the memo
checks, in C-level passes: the tensor fields and dict entries are the same objects, the dict keys
and entry types are unchanged, and every tensor still has its dtype and rank (``.data =`` can change
both in place); then it returns the cached layout key and tensor list with this step's values. Any
difference falls back to ``collect`` (and remembers that step instead). Shapes are not part of the
check: the broadcaster reads them every step.

Worked example: fields ``(is_prompt: bool, positions: Tensor, klen: dict, ...)``, step 1 collects
``positions`` = tensor P and ``klen`` = ``{"4": K}``; step 2 has ``positions is P``, ``klen`` a new
dict ``{"4": K}``: the memo returns step 1's key and ``[P, K]`` (in layout order) with step 2's
``is_prompt``.
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import Any, Callable, Optional

import torch

from ..cache import BoundedCache
from .collect import collect, field_kinds
from .schema import Schema
from .wire import MAX_LAYOUTS

__all__ = ["CollectMemo"]

_DTYPE = operator.attrgetter("dtype")
_DIM = torch.Tensor.dim
_SHAPE = operator.attrgetter("shape")
_IS = operator.is_
_NONE = type(None)


def _tuple_getter(idx: list[int]) -> Callable[[Any], tuple]:
    """``f(seq) -> tuple`` of the items at ``idx`` (one C call; ``()`` for none)."""
    if not idx:
        return lambda seq: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*idx)


def _fields_getter(names: tuple[str, ...], idx: list[int]) -> Callable[[Any], tuple]:
    """``f(md) -> tuple`` of the fields at positions ``idx`` of ``names`` (one C call; ``()``
    for none)."""
    if not idx:
        return lambda md: ()
    if len(idx) == 1:
        get = operator.attrgetter(names[idx[0]])
        return lambda md: (get(md),)
    return operator.attrgetter(*[names[i] for i in idx])


class _Entry:
    """What one step of one tuple of field types looked like (see the module docstring).

    The per-step check reads the fields by kind, straight from the metadata (no row of all ~57
    fields, no tuple of their types): tensor fields must be the same objects, ``None`` fields
    still ``None``, value fields of the same types, dict fields dicts with the same keys, entry
    types and tensor entries; together that is the field-type tuple this entry was made for.
    """

    __slots__ = ("tget", "tobjs", "nget", "nones", "vget", "vtypes", "dicts", "dget",
                 "dkeys", "dtypes", "dtget", "dtobjs", "dvget", "n_empty", "key", "tensors",
                 "tdtypes", "tdims")

    def __init__(self, names: tuple[str, ...], sig: tuple[type, ...], vals: tuple, key: tuple,
                 tensors: list[torch.Tensor]) -> None:
        tpos, npos, dpos, vpos = field_kinds(sig)
        self.tget, self.nget = _fields_getter(names, tpos), _fields_getter(names, npos)
        self.dget, self.vget = _fields_getter(names, dpos), _fields_getter(names, vpos)
        self.tobjs = _tuple_getter(tpos)(vals)
        self.nones = (None,) * len(npos)
        self.vtypes = tuple(sig[i] for i in vpos)
        self.dicts = (dict,) * len(dpos)
        ds = _tuple_getter(dpos)(vals)
        self.dkeys = tuple(map(tuple, ds))
        flat = list(chain.from_iterable(map(dict.values, ds)))
        self.dtypes = tuple(map(type, flat))
        dt = [n for n, t in enumerate(self.dtypes) if issubclass(t, torch.Tensor)]
        dv = [n for n, t in enumerate(self.dtypes)
              if t is not _NONE and not issubclass(t, torch.Tensor)]
        self.dtget, self.dvget = _tuple_getter(dt), _tuple_getter(dv)
        self.dtobjs = self.dtget(flat)
        self.n_empty = sum(1 for k in self.dkeys if not k)
        self.key, self.tensors = key, tensors
        self.tdtypes = tuple(map(_DTYPE, tensors))
        self.tdims = tuple(map(_DIM, tensors))

    def values(self, vv: tuple, flat: list) -> list[Any]:
        """This step's values in ``collect``'s order: value fields ``vv``, dict entries, empty
        dicts."""
        return [*vv, *self.dvget(flat), *({} for _ in range(self.n_empty))]

    def match(self, md: Any
              ) -> Optional[tuple[tuple, list[torch.Tensor], list[Any], tuple]]:
        """``(key, tensors, values, flat dims)`` when ``md`` is this entry's step again with new
        values, else ``None``. The shapes are read once here: their lengths are the ranks
        checked, their concatenation the frame's dims."""
        if not all(map(_IS, self.tget(md), self.tobjs)) or \
                not all(map(_IS, self.nget(md), self.nones)):
            return None
        vv = self.vget(md)
        ds = self.dget(md)
        if tuple(map(type, vv)) != self.vtypes or tuple(map(type, ds)) != self.dicts or \
                tuple(map(tuple, ds)) != self.dkeys:
            return None
        flat = list(chain.from_iterable(map(dict.values, ds)))
        if tuple(map(type, flat)) != self.dtypes or not all(map(_IS, self.dtget(flat), self.dtobjs)):
            return None
        ts = self.tensors
        shapes = tuple(map(_SHAPE, ts))
        if tuple(map(_DTYPE, ts)) != self.tdtypes or tuple(map(len, shapes)) != self.tdims:
            return None
        return self.key, ts, self.values(vv, flat), tuple(chain.from_iterable(shapes))


class CollectMemo:
    """``memo(md) -> (key, tensors, values)``, equal to ``walk.collect(md)`` (the driver of a
    persistent broadcaster calls it once per step). One entry per tuple of field types, at most
    ``MAX_LAYOUTS``; an entry whose rebuilt values disagree with ``collect``'s is never used."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self._by_sig: BoundedCache[tuple, Optional[_Entry]] = BoundedCache(MAX_LAYOUTS)
        self._last: Optional[_Entry] = None  # the entry of the last hit, tried first

    def __call__(self, md: Any) -> tuple[tuple, list[torch.Tensor], list[Any]]:
        return self.step(md)[:3]

    def step(self, md: Any
             ) -> tuple[tuple, list[torch.Tensor], list[Any], Optional[tuple]]:
        """``(key, tensors, values)`` of ``collect(md)`` plus, on a hit, the tensors' dims
        concatenated (``(64, 64, 4)`` for shapes ``[64]``, ``[64, 4]``; ``None`` on a miss: the
        caller reads them), the broadcaster's per-step call."""
        e = self._last  # the last hit's entry first: no row of all fields, no type tuple
        if e is not None:
            got = e.match(md)
            if got is not None:
                return got
        vals = self.schema.get_all(md)
        sig = tuple(map(type, vals))
        e = self._by_sig.get(sig)
        if e is not None:
            got = e.match(md)
            if got is not None:
                self._last = e
                return got
        elif sig in self._by_sig:  # disabled for these field types
            return (*collect(md, self.schema), None)
        key, tensors, values = collect(md, self.schema)
        self._last = None
        e = _Entry(self.schema.field_names, sig, vals, key, tensors)
        flat = list(chain.from_iterable(map(dict.values, e.dget(md))))
        again = e.values(e.vget(md), flat)
        ok = len(again) == len(values) and all(
            a is b or (type(a) is dict and type(b) is dict and not a and not b)
            for a, b in zip(again, values))
        self._by_sig.put(sig, e if ok and type(tensors) is list else None)
        return key, tensors, values, None
