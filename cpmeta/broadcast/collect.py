"""Collect by path: the driver splits a schema'd object into its layout key, tensors and values.

``collect(md, schema)`` is the driver's first step of every broadcast of a dataclass
(``cpmeta.broadcast.broadcaster``); ``collect_dict(d)`` the same for a plain tensor dict
(``cpmeta.broadcast_tensor_dict``). The layout key returned is what
``cpmeta.broadcast.plan.Plan`` is built from (and checked against the schema, once per layout).
Everything that repeats is cached per tuple of field types (:class:`Walk`, one cache per schema)
or per key tuple (dicts), so a step of a known layout is a few C-level gathers.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch

from ..cache import BoundedCache
from .dict_schema import TREE_KEY, check_dict_key, token_path
from .schema import INPUT_METADATA, Schema
from .wire import ALIAS_SEP, DTYPE_CODE, MAX_LAYOUTS, PATH_SEP, WIRE_DTYPES, getter

__all__ = ["collect", "collect_dict", "Walk", "field_kinds", "not_dense", "value_failure"]


def collect(md: Any, schema: Schema = INPUT_METADATA) -> tuple[tuple, list[torch.Tensor], list[Any]]:
    """Split ``md`` by path: ``(key, tensors, values)``.

    ``key`` identifies the layout (hashable; :meth:`Walk.layout` turns it into the sent
    ``(tensor paths, dtype codes, ndims, value paths)``); ``tensors`` are deduplicated by object
    and ordered by dtype code (so each dtype is one run); ``values[i]`` belongs to the i-th value
    path (``None`` fields are left out, an empty dict is a value). Example: with
    ``positions_cp is positions`` one tensor has the paths ``("positions", "positions_cp")``.

    Per step this is one C call for every field, one for their types, a lookup of the cached
    :class:`Walk` of those types, and the walk's few C-level gathers.
    """
    if type(md) is not schema.cls:
        raise TypeError(f"expected {schema.name}, got {type(md).__name__}")
    vals = schema.get_all(md)
    sig = tuple(map(type, vals))
    w = schema.walks.get(sig)
    if w is None:
        w = schema.walks.put(sig, Walk(sig, schema.field_names))
    return w(vals)


def collect_dict(d: Any) -> tuple[tuple, list[torch.Tensor], list[Any]]:
    """Split a tensor dict (``cpmeta.broadcast_tensor_dict``) by key: ``(key, tensors, values)``.

    Like :func:`collect` with the keys as paths: tensors deduplicated by object and ordered by
    dtype code, every other value (``None`` included) a value, the driver's key order in the
    layout key. Keys are checked once per key tuple (:func:`schema.check_dict_key`). Example:
    ``{"ids": t, "n": 3}`` -> key ``("ids", (4,), (1,), "n", ("ids", "n"))``, ``[t]``, ``[3]``.
    """
    if type(d) is not dict:
        raise TypeError(f"tensor_dict: expected a dict, got {type(d).__name__}")
    keys = tuple(d)
    vals = tuple(d.values())
    sig = (keys, tuple(map(type, vals)))
    w = _DICT_WALKS.get(sig)
    if w is None:
        for k in keys:
            check_dict_key(k)
        w = _DICT_WALKS.put(sig, Walk(sig[1], keys, order=keys))
    return w(vals)


_DICT_WALKS: BoundedCache[tuple, "Walk"] = BoundedCache(MAX_LAYOUTS)


def field_kinds(sig: tuple[type, ...]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Positions of the tensor, ``None``, dict and value fields in a tuple of field types.

    Example: ``(bool, NoneType, Tensor, dict, int)`` -> ``([2], [1], [3], [0, 4])``.
    """
    tidx, nidx, didx, vidx = [], [], [], []
    for i, t in enumerate(sig):
        if issubclass(t, torch.Tensor):
            tidx.append(i)
        elif t is type(None):
            nidx.append(i)
        elif t is dict:
            didx.append(i)
        else:
            vidx.append(i)
    return tidx, nidx, didx, vidx


class Walk:
    """Which fields hold tensors, dicts and values, for one tuple of field types (computed once).

    Worked example: types ``(bool, int, NoneType, Tensor, dict, ...)`` give value fields
    ``[0, 1]``, tensor fields ``[3]`` and dict fields ``[4]``; a step then gathers them with
    ``itemgetter`` calls, walks only the dict fields' entries, and looks its layout up by
    ``(dict keys and entry types, aliasing, dtypes, ranks)``.
    """

    def __init__(self, sig: tuple[type, ...], names: tuple[str, ...],
                 order: Optional[tuple[str, ...]] = None) -> None:
        tidx, nidx, didx, vidx = field_kinds(sig)
        if order is not None:  # a tensor dict: None is a value, a dict value is refused
            if didx:
                raise TypeError(f"{names[didx[0]]}: a dict value cannot be broadcast (plain values: "
                                "None, bool, int, float, str, lists / tuples of those)")
            vidx = sorted(vidx + nidx)
        self.order = order
        self.tnames = [names[i] for i in tidx]
        self.vnames = [names[i] for i in vidx]
        self.dicts = [(i, names[i]) for i in didx]
        self.get_t = getter(tidx)
        self.get_v = getter(vidx)
        self.subs: BoundedCache[tuple, tuple] = BoundedCache(MAX_LAYOUTS)  # dict keys + entry types -> _entries()
        self.keys: BoundedCache[tuple, tuple] = BoundedCache(MAX_LAYOUTS)  # step key -> (layout key, order)

    def __call__(self, vals: tuple) -> tuple[tuple, list[torch.Tensor], list[Any]]:
        objs = self.get_t(vals)
        values = self.get_v(vals)
        if self.dicts:
            ds = [vals[i] for i, _ in self.dicts]
            dvals = [x for d in ds for x in d.values()]
            dkey: tuple = (tuple(map(tuple, ds)), tuple(map(type, dvals)))
            sub = self.subs.get(dkey)
            if sub is None:
                sub = self.subs.put(dkey, self._entries(dkey))
            objs += sub[0](dvals)
            values += sub[1](dvals)
            if sub[2]:
                values += [{} for _ in range(sub[2])]
        else:
            dkey = ()
        ids = list(map(id, objs))
        alias = None if len(set(ids)) == len(ids) else tuple(map({i: n for n, i in reversed(
            list(enumerate(ids)))}.__getitem__, ids))
        skey = (dkey, alias, tuple(map(_DTYPE, objs)), tuple(map(_DIM, objs)))
        hit = self.keys.get(skey)
        if hit is None:
            hit = self.keys.put(skey, self._layout(skey, objs))
        key, order = hit
        return key, (order(objs) if order is not None else objs), values

    def _entries(self, dkey: tuple) -> tuple[Any, Any, int, list[str], list[str]]:
        """For dict keys and entry types ``dkey``: (tensor entries getter, value entries getter,
        number of empty dicts, tensor entry paths, value paths incl. empty dicts), run once."""
        keys, types = dkey
        tidx, vidx, tpaths, vpaths, empty = [], [], [], [], []
        n = 0
        for (_, name), ks in zip(self.dicts, keys):
            for k in ks:
                t, p = types[n], f"{name}.{k}"
                if t is dict:
                    raise TypeError(f"{p}: nested dicts are not supported (one level only)")
                if issubclass(t, torch.Tensor):
                    tidx.append(n)
                    tpaths.append(p)
                elif t is not type(None):
                    vidx.append(n)
                    vpaths.append(p)
                n += 1
            if not ks:
                empty.append(name)
        return getter(tidx), getter(vidx), len(empty), tpaths, vpaths + empty

    def _layout(self, skey: tuple, objs: list[torch.Tensor]) -> tuple[tuple, Any]:
        """The layout key and the gather of the step's tensors in layout order (run once)."""
        dkey, alias, dtypes, ndims = skey
        paths, vpaths = list(self.tnames), list(self.vnames)
        if dkey:
            sub = self.subs[dkey]
            paths += sub[3]
            vpaths += sub[4]
        first = alias if alias is not None else range(len(objs))
        found: dict[int, list] = {}  # first index -> [code, index, [paths]]
        for n, f in enumerate(first):
            e = found.get(f)
            if e is None:
                found[f] = e = [DTYPE_CODE.get(dtypes[n], -1), n, []]
            e[2].append(paths[n])
        rows = sorted(found.values(), key=lambda e: e[0])
        for e in rows:
            if e[0] < 0:
                raise TypeError(f"{e[2][0]}: dtype {dtypes[e[1]]} cannot be broadcast "
                                f"(supported: {WIRE_DTYPES})")
        idx = [e[1] for e in rows]
        key: tuple = (PATH_SEP.join(ALIAS_SEP.join(e[2]) for e in rows), tuple(e[0] for e in rows),
                      tuple(ndims[i] for i in idx), PATH_SEP.join(vpaths))
        if self.order is not None:
            key += (self.order,)
        return key, (None if idx == list(range(len(objs))) else getter(idx))


_DTYPE = operator.attrgetter("dtype")
_DIM = torch.Tensor.dim


def not_dense(key: tuple, tensors: list[torch.Tensor]) -> Optional[TypeError]:
    """The named error for the first of a step's ``tensors`` (layout order, ``key`` their layout
    key) that is not dense and strided -- a sparse or nested tensor, whose own torch error (at its
    shape or its copy) names no field -- else None. Example: ``{"m": t.to_sparse()}`` ->
    ``TypeError("m: a sparse_coo tensor cannot be broadcast (dense, strided tensors only: ...)")``."""
    for path, t in zip(key[0].split(PATH_SEP), tensors):
        if t.layout is not torch.strided or t.is_nested:
            kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            return TypeError(f"{path.split(ALIAS_SEP)[0]}: a {kind} tensor cannot be broadcast (dense, strided "
                             "tensors only: .to_dense() it first)")
    return None


def value_failure(key: tuple, values: list[Any], text: str) -> Optional[str]:
    """The codec's refusal of a step's values (``$[i]...: why``, e.g. a str with a lone
    surrogate) with the field's path for ``$[i]`` (``key``'s i-th value path; inside a tensor
    dict's tree, the key path of the refused token); None for any other text. Example:
    ``"$[0][4]: 'utf-8' codec can't encode ..."`` of ``{"x": "\\ud800"}`` -> ``"x: 'utf-8' ..."``."""
    m = re.fullmatch(r"\$\[(\d+)\]((?:\[\d+\]|\.[^:]*)*): (.*)", text, re.S)
    paths = key[3].split(PATH_SEP) if len(key) > 3 and isinstance(key[3], str) else []
    if m is None or int(m[1]) >= len(paths):
        return None
    i, rest, why = int(m[1]), m[2], m[3]
    token = re.fullmatch(r"\[(\d+)\]", rest)
    where = f"{paths[i]}{rest}"
    if paths[i] == TREE_KEY and token is not None and isinstance(values[i], list):
        where = token_path(values[i], int(token[1]))
    return f"{ascii(where)[1:-1] if not where.isascii() else where}: {why}"  # (the refused key itself, escaped)
