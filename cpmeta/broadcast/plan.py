"""``Plan``: everything derived from one layout, computed once per layout id on every rank.

A layout (``cpmeta.broadcast.frame`` sends it once, then only its id) is four lists: tensor paths
(aliases of one tensor joined by ``,``, tensors by ``;``), one dtype code and one rank per
tensor (tensors ordered by dtype code: each dtype is one RUN), and value paths; a
:class:`~cpmeta.broadcast.schema.DictSchema` layout adds the driver's key order. The plan checks
the layout against its schema once (paths, field kinds, pinned dtypes and ranks) and then, per
step, turns flat dims into sizes (:meth:`Plan.sizes`), proves a follower's dims
(:meth:`Plan.check_tensors`), cuts a received buffer into tensors (:meth:`Plan.views`), packs
the driver's tensors (:meth:`Plan.pack`) and rebuilds the object (:meth:`Plan.assemble`).

Worked example (decode, 2 tensors): ``positions`` int32 [3] and ``block_table`` int32 [3, 2]
form ONE run (same dtype), dims ``[3, 3, 2]``: run start 0, numels ``[3, 6]``, 36 bytes exact
(the header's tensor bytes), region 48 (rounded up to 16, the frame's length past the shapes);
the follower does ``buf[0:36].view(int32).split([3, 6])`` and views the second chunk as [3, 2].
"""

from __future__ import annotations

import ctypes
import struct
from itertools import accumulate
from math import prod
from typing import Any, Optional

import torch

from .dict_schema import DictSchema
from .schema import Schema
from .wire import (ALIAS_SEP, ELEMENT_SIZE, MAX_COLLECTIVE_BYTES, MAX_DIM, MAX_NDIM,
                   PATH_SEP, WIRE_DTYPES, WireError, getter, pack_up)
from .schema import MAX_LAYOUT_PATHS

__all__ = ["Plan", "split_layout", "one_source"]

AnySchema = Schema | DictSchema


def split_layout(paths: str, codes: list[int], ndims: list[int], vpaths: str
                 ) -> tuple[list[list[str]], list[str]]:
    """The layout's tensor paths (with aliases) and value paths, once its lists are proven
    consistent: at most ``MAX_LAYOUT_PATHS`` paths (counted before anything is split), one code
    and one rank per tensor, known codes in run order, ranks ``0..MAX_NDIM``. Example:
    ``("positions,positions_cp;klen.4", [4, 4], [1, 1], "is_prompt")`` gives
    ``([["positions", "positions_cp"], ["klen.4"]], ["is_prompt"])``."""
    n_paths = (paths.count(PATH_SEP) + paths.count(ALIAS_SEP) + 1 if paths else 0) + (
        vpaths.count(PATH_SEP) + 1 if vpaths else 0)
    if n_paths > MAX_LAYOUT_PATHS or len(codes) > MAX_LAYOUT_PATHS:
        raise WireError(f"layout has {max(n_paths, len(codes))} paths, more than "
                        f"MAX_LAYOUT_PATHS={MAX_LAYOUT_PATHS}")
    tpaths = [p.split(ALIAS_SEP) for p in paths.split(PATH_SEP)] if paths else []
    vlist = vpaths.split(PATH_SEP) if vpaths else []
    if not (len(tpaths) == len(codes) == len(ndims)):
        raise WireError("layout lists disagree in length")
    if any(type(c) is not int or not 0 <= c < len(WIRE_DTYPES) for c in codes):
        raise WireError(f"unknown dtype code in {codes[:16]}")
    if any(type(d) is not int or not 0 <= d <= MAX_NDIM for d in ndims):
        raise WireError(f"bad tensor rank (0..{MAX_NDIM}) in {ndims[:16]}")
    if any(a > b for a, b in zip(codes, codes[1:])):
        raise WireError("layout tensors are not ordered by dtype code (one run per dtype)")
    return tpaths, vlist


class Plan:
    """Everything derived from one layout (see the module docstring).

    ``runs``: ``(code, first, last + 1)`` per dtype run; ``targets``: per tensor, the
    ``(field, dict key or None)`` paths it fills; ``value_targets`` likewise per value.
    """

    def __init__(self, schema: AnySchema, paths: str, codes: list[int], ndims: list[int],
                 vpaths: str, order: Optional[list[str]] = None) -> None:
        """Build (and check, once) the plan of one layout; linear in the layout's size.

        Raises ``WireError``/``schema.LayoutError`` (ValueErrors naming the path) for a layout
        that ``schema`` does not allow, or larger than ``MAX_LAYOUT_PATHS`` (counted before
        anything is split). ``order`` (DictSchema layouts only): every path, in the driver's
        key order.
        """
        tpaths, vlist = split_layout(paths, codes, ndims, vpaths)
        targets, value_targets = schema.check_layout(tpaths, vlist)
        schema.check_tensors(targets, [WIRE_DTYPES[c] for c in codes], ndims)
        self.schema = schema
        self.codes, self.ndims, self.n_dims = codes, ndims, sum(ndims)
        self.key = (paths, tuple(codes), tuple(ndims), vpaths) + ((tuple(order),) if order is not None else ())
        self.shapes = struct.Struct(f"<{self.n_dims}q")
        self.all_1d = all(d == 1 for d in ndims)
        starts = [0, *accumulate(ndims)][:len(ndims)]  # dims index of each tensor's first dim
        self.reshape = [(i, at, nd) for i, (at, nd) in enumerate(zip(starts, ndims)) if nd != 1]
        self.runs: list[tuple[int, int, int]] = []
        i = 0
        while i < len(codes):
            j = i
            while j + 1 < len(codes) and codes[j + 1] == codes[i]:
                j += 1
            self.runs.append((codes[i], i, j + 1))
            i = j + 1
        self.targets = targets
        self.value_targets = value_targets
        self.check_values = schema.value_check(value_targets)
        self.fixed = schema.fixed_dims(targets, ndims)  # dims the schema fixes, checked per new dims
        self.tensor_paths = [ps[0] for ps in tpaths]  # for error messages
        #: dims of the last sizes() -> its result (+ its offsets(), once asked for)
        self._last: tuple = ((-1,), ())
        # split: dims index of each tensor's first dim (1-D tensors: that dim is the numel)
        # (0-d tensors: a placeholder, set to 1 by the reshape list)
        self.first_dim = (getter([at if nd else 0 for at, nd in zip(starts, ndims)])
                          if self.n_dims else (lambda d: [1] * len(ndims)))
        self.run_slices = [(slice(a, b), ELEMENT_SIZE[code], WIRE_DTYPES[code])
                           for code, a, b in self.runs]
        if isinstance(schema, DictSchema):
            self._dict_order(tpaths, vlist, order)
        else:
            if order is not None:
                raise WireError(f"layout of {schema.name} carries a key order (only dict layouts do)")
            self._rows(schema)

    def _rows(self, schema: Schema) -> None:
        """Assembly of a dataclass: a positional row; dict fields created per step."""
        pos = schema.positions
        self.dict_fields = sorted({pos[n] for n, sub in self.value_targets if sub is not None}
                                  | {pos[n] for ts in self.targets for n, sub in ts if sub is not None})
        self.value_slots = [(pos[n], sub) for n, sub in self.value_targets]
        self.tensor_slots = [[(pos[n], sub) for n, sub in ts] for ts in self.targets]
        self.flat_values = all(sub is None for _, sub in self.value_slots)
        self.value_pos = [i for i, _ in self.value_slots]
        self.flat_tensors = all(len(ts) == 1 and ts[0][1] is None for ts in self.tensor_slots)
        self.tensor_pos = [ts[0][0] for ts in self.tensor_slots] if self.flat_tensors else []
        self.order: Optional[list[str]] = None

    def _dict_order(self, tpaths: list[list[str]], vlist: list[str], order: Optional[list[str]]) -> None:
        """Assembly of a tensor dict: the driver's key order as indices into ``[every tensor
        path's object..., every value...]``. Example: tensor paths ``[["a", "b"]]``, values
        ``["n"]``, order ``["n", "a", "b"]`` -> ``[2, 0, 1]``."""
        flat = [p for ps in tpaths for p in ps] + vlist
        if order is None or type(order) is not list or sorted(order) != sorted(flat):
            raise WireError("tensor-dict layout: the key order is not a permutation of its paths")
        at = {p: i for i, p in enumerate(flat)}
        self.order = order
        self._perm = [at[k] for k in order]
        self._fanout = [len(ps) for ps in tpaths]
        self.value_slots, self.tensor_slots, self.dict_fields = [], [], []
        self.flat_values = self.flat_tensors = False
        self.value_pos, self.tensor_pos = [], []

    # ---- per step, both sides --------------------------------------------------------------
    def sizes(self, dims: tuple[int, ...] | list[int]) -> tuple[list[int], list[int], int, int]:
        """``(numels, run starts, region bytes, exact payload bytes)`` for these flat ``dims``,
        once they are proven (every dim in ``[0, MAX_DIM]``, the dims the schema fixes).

        Runs start 16-aligned and the region is rounded up to 16; the exact payload is
        ``sum(numel_i * element_size_i)`` (what the header declares). Worked example: bool [406]
        and bool [406] then int32 [406]: bool run 812 B at 0, int32 run at 816 (812 rounded up),
        region 816 + 1624 = 2440 -> 2448, exact 812 + 1624 = 2436. The last call's dims and
        result are kept: the same dims again (a repeated layout with fixed shapes) cost one
        tuple comparison. The returned lists are shared: do not modify them.
        """
        dims = tuple(dims)
        last = self._last
        if last[0] == dims:
            return last[1]
        if dims and (min(dims) < 0 or max(dims) > MAX_DIM):
            raise WireError(f"tensor dims out of range [0, 2**48]: {self._shapes_text(dims, last[0])}")
        for at, size, path in self.fixed:
            if dims[at] != size:
                raise WireError(f"{path}: dim {dims[at]} where {self.schema.name} fixes {size} "
                                f"({self._shapes_text(dims)})")
        if self.all_1d:
            numels = list(dims)
        else:
            numels = self.first_dim(dims)
            for i, at, nd in self.reshape:
                numels[i] = prod(dims[at:at + nd])
        starts, pos, exact = [], 0, 0
        for sl, esz, _ in self.run_slices:
            pos = pack_up(pos)
            starts.append(pos)
            n = sum(numels[sl]) * esz
            pos += n
            exact += n
        res = (numels, starts, pack_up(pos), exact)
        self._last = (dims, res)
        return res

    def check_tensors(self, dims: tuple[int, ...], packed: bool, tbytes: int, avail: int
                      ) -> tuple[list[int], list[int], int]:
        """Follower: ``(numels, run starts, region)`` of a frame's ``dims`` once they are proven.

        Every dim in ``[0, MAX_DIM]``; ``packed``: the exact payload equals the header's
        ``tbytes`` and the region equals ``avail`` (the frame's bytes after its shapes), so no
        product can exceed the frame; not packed (the region follows in a collective): ``tbytes``
        and ``avail`` are 0 and the region is at most ``MAX_COLLECTIVE_BYTES``. A mismatch is a
        ``WireError`` listing the declared shapes by path, first those that differ from the
        previous frame of this layout (``gate_force_random [407] bool (was [406])``).
        """
        prev = self._last[0]
        numels, starts, region, exact = self.sizes(dims)
        if packed:
            if exact != tbytes or region != avail:
                raise WireError(f"tensor shapes declare {exact} bytes (region {region}), the frame "
                                f"declares {tbytes} (region {avail}): {self._shapes_text(dims, prev)}")
        elif tbytes or avail or region > MAX_COLLECTIVE_BYTES:
            raise WireError(f"frame without FLAG_PACKED: {tbytes} tensor bytes and {avail} bytes "
                            f"after the shapes (expected 0), a region of {region} bytes to receive")
        return numels, starts, region

    def _shapes_text(self, dims: tuple[int, ...], prev: tuple = (), most: int = 8) -> str:
        """``"klen.4 [5] int32 (was [4]), positions [3] int32, ..."`` for error messages: the
        tensors whose shape differs from ``prev`` (the last frame's dims, when as long) first."""
        changed, same, at = [], [], 0
        for path, code, nd in zip(self.tensor_paths, self.codes, self.ndims):
            now = list(dims[at:at + nd])
            text = f"{path} {now} {WIRE_DTYPES[code]}".replace("torch.", "")
            if len(prev) == len(dims) and list(prev[at:at + nd]) != now:
                changed.append(f"{text} (was {list(prev[at:at + nd])})")
            else:
                same.append(text)
            at += nd
        out = changed + same
        return ", ".join(out[:most]) + (f", ... ({len(out)} tensors)" if len(out) > most else "")

    def specs(self, dims: Any) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        """``(dtype, shape)`` of every tensor, layout order (what a collective receives)."""
        out, at = [], 0
        for c, nd in zip(self.codes, self.ndims):
            out.append((WIRE_DTYPES[c], tuple(dims[at:at + nd])))
            at += nd
        return out

    def views(self, buf: torch.Tensor, dims: Any, numels: list[int], starts: list[int]
              ) -> list[torch.Tensor]:
        """Views of the uint8 ``buf`` with every tensor's dtype and shape (one split per run)."""
        out: list[torch.Tensor] = []
        for (sl, esz, dtype), s in zip(self.run_slices, starts):
            ns = numels[sl]
            out += buf[s:s + sum(ns) * esz].view(dtype).split_with_sizes(ns)
        for i, at, nd in self.reshape:
            out[i] = out[i].view(*dims[at:at + nd]) if nd else out[i].view(())
        return out

    def offsets(self, dims: tuple[int, ...], numels: list[int], starts: list[int]) -> list[int]:
        """Every tensor's byte offset in the region of these ``dims`` (``numels`` / ``starts``:
        their :meth:`sizes`); kept with the last :meth:`sizes` result. Example: the worked
        example's two int32 tensors -> ``[0, 12]``."""
        last = self._last
        if last[0] == tuple(dims) and len(last) == 3:
            return last[2]
        out = []
        for (sl, esz, _), s in zip(self.run_slices, starts):
            for n in numels[sl]:
                out.append(s)
                s += n * esz
        if last[0] == tuple(dims):
            self._last = (last[0], last[1], out)
        return out

    def pack(self, base: int, tensors: list[torch.Tensor], dims: tuple[int, ...], numels: list[int],
             starts: list[int], region: int) -> None:
        """Copy CPU ``tensors`` to address ``base`` in the run layout of :meth:`sizes`: ONE
        ``memmove`` of the region when they already lie that way in one allocation (a builder's
        ``HostArena``: ``ArenaLayout`` lays its fields out by this rule; :func:`one_source`),
        else one per tensor (non-contiguous ones made contiguous first)."""
        if not all(map(_IS_CONTIGUOUS, tensors)):
            tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        memmove, ptrs = ctypes.memmove, list(map(_DATA_PTR, tensors))
        src = one_source(tensors, ptrs, self.offsets(dims, numels, starts), numels, region)
        if src:
            memmove(base, src, region)
            return
        for (sl, esz, _), s in zip(self.run_slices, starts):
            at = base + s
            for p, n in zip(ptrs[sl], numels[sl]):
                if n:
                    memmove(at, p, n * esz)
                    at += n * esz

    def assemble(self, tensors: list[torch.Tensor], values: list[Any],
                 per_path: Optional[list[list[torch.Tensor]]] = None) -> Any:
        """The object holding ``tensors`` and ``values`` at the layout's paths
        (``per_path[i][j]``, when given, is tensor i's object at its j-th path)."""
        if self.order is not None:
            return self._assemble_dict(tensors, values, per_path)
        assert isinstance(self.schema, Schema)
        row: list[Any] = [None] * len(self.schema.field_names)
        for f in self.dict_fields:
            row[f] = {}
        if self.flat_values:
            for f, v in zip(self.value_pos, values):
                row[f] = v
        else:
            for (f, sub), v in zip(self.value_slots, values):
                if sub is None:
                    row[f] = v
                else:
                    row[f][sub] = v
        if per_path is None and self.flat_tensors:
            for f, t in zip(self.tensor_pos, tensors):
                row[f] = t
        else:
            for i, (ts, t) in enumerate(zip(self.tensor_slots, tensors)):
                for j, (f, sub) in enumerate(ts):
                    x = t if per_path is None else per_path[i][j]
                    if sub is None:
                        row[f] = x
                    else:
                        row[f][sub] = x
        return self.schema.build(row)

    def _assemble_dict(self, tensors: list[torch.Tensor], values: list[Any],
                       per_path: Optional[list[list[torch.Tensor]]]) -> dict[str, Any]:
        flat: list[Any] = []
        for i, (t, n) in enumerate(zip(tensors, self._fanout)):
            flat += per_path[i] if per_path is not None else [t] * n
        flat += values
        assert self.order is not None
        return dict(zip(self.order, map(flat.__getitem__, self._perm)))


def one_source(tensors: list[torch.Tensor], ptrs: list[int], offsets: list[int], numels: list[int],
               region: int) -> int:
    """The address of the region when every non-empty one of the contiguous CPU ``tensors``
    (addresses ``ptrs``) lies at ``base + offsets[i]`` and ``[base, base + region)`` is inside
    the first one's allocation (so one ``memmove`` copies them all, the gaps between runs with
    them); else 0. Example: a decode step built into one ``HostArena`` -> the arena's address."""
    live = [i for i, n in enumerate(numels) if n]
    if not live:
        return 0
    base = ptrs[live[0]] - offsets[live[0]]
    for i in live:
        if ptrs[i] - offsets[i] != base:
            return 0
    s0 = tensors[live[0]].untyped_storage()
    lo = s0.data_ptr()
    return base if lo <= base and base + region <= lo + s0.nbytes() else 0


_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
