"""Output buffers the builders write into: the ``out=`` protocol, arenas, and the dict helpers.

A builder's ``out=`` is one of three things, dispatched in one place per builder:

- ``None``: the builder allocates; ``prepare_decode`` carves every output from ONE new
  :class:`HostArena` (one allocation per call);
- a dict of tensors: reused through :func:`get_or_create_tensor` / :func:`get_or_create_stacked`
  (shape and dtype checked; with ``allow_prefix`` a larger buffer captured for a CUDA graph is
  written through its prefix view), what had to be allocated is stored in it;
- an :class:`OutputBuffers`: caller-owned memory (FlashInfer's caller-owned workspace is the
  model). The builder computes the :class:`ArenaLayout` of the call (every output's name, shape,
  dtype) and asks ``out.arena(layout)`` for the :class:`HostArena` to write into; the caller
  decides where that memory lives and how long a result stays valid. :class:`OutputArenas` is the
  implementation for an engine loop (one arena per batch shape, refilled every step).

A builder takes each output field through :func:`alloc` (the tensor and
its numpy view, from whichever of the three it was handed). Host buffers are pinned when CUDA is
available, so the separate host-to-device step can copy them with ``non_blocking=True``.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from .cache import BoundedCache

__all__ = ["get_or_create_tensor", "get_or_create_stacked", "ArenaLayout", "HostArena", "OutputBuffers",
           "OutputArenas", "WIRE_DTYPES", "DTYPE_CODE", "PACK_ALIGN", "pack_up", "AllocOut", "alloc"]

@functools.lru_cache(maxsize=1)
def pin_host_memory() -> bool:
    """Whether host buffers are allocated pinned: when a GPU exists (checked once per process;
    ``pin_host_memory.cache_clear()`` asks again)."""
    return torch.cuda.is_available()


def _stored(out: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """``out[name]``: a tensor of ``dtype``, else ``TypeError`` / ``ValueError`` naming it."""
    t = out[name]
    if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):
        raise TypeError(f"out[{name!r}]: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype} in out")
    return t


def get_or_create_tensor(
    out: Optional[dict[str, torch.Tensor]],
    name: str,
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    *,
    allow_prefix: bool = False,
) -> torch.Tensor:
    """Return ``out[name]`` (shape and dtype checked) or allocate a new tensor.

    With ``out`` given and holding ``name``, the stored tensor is returned after checking
    ``shape`` and ``dtype`` (``ValueError`` naming ``name`` on a mismatch). With
    ``allow_prefix=True`` a stored tensor whose first dim is LARGER (a buffer captured for a
    bigger batch) is accepted and its prefix view ``out[name][:shape[0]]`` returned (same
    storage, so a captured CUDA graph sees the writes). Otherwise a tensor is allocated
    (pinned when CUDA is available) and, if ``out`` is a dict, stored under ``name``.
    """
    shape = tuple(int(s) for s in shape)
    if out is not None and name in out:
        t = _stored(out, name, dtype)
        if tuple(t.shape) == shape:
            return t
        if (
            allow_prefix
            and t.dim() == len(shape)
            and len(shape) > 0
            and t.shape[0] >= shape[0]
            and tuple(t.shape[1:]) == shape[1:]
        ):
            return t[: shape[0]]
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)} in out")
    t = torch.empty(shape, dtype=dtype, pin_memory=pin_host_memory())
    if out is not None:
        out[name] = t
    return t


def get_or_create_stacked(
    out: Optional[dict[str, torch.Tensor]],
    name: str,
    keys: Iterable[str],
    shape: tuple[int, ...] | list[int],
    dtype: torch.dtype,
    *,
    allow_prefix: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One ``[len(keys), *shape]`` tensor and ``{key: row view}`` sharing its storage.

    Example: keys ``("4", "128")``, shape ``(5,)`` gives a ``[2, 5]`` tensor ``t`` and
    ``{"4": t[0], "128": t[1]}``. With ``allow_prefix`` a stored ``[2, Q, ...]`` buffer with
    ``Q >= shape[0]`` yields views ``t[i, :shape[0]]`` (no allocation, same addresses).
    """
    keys = list(keys)
    shape = tuple(int(s) for s in shape)
    full = (len(keys), *shape)
    if out is not None and name in out:
        t = _stored(out, name, dtype)
        ok_exact = tuple(t.shape) == full
        ok_prefix = (
            allow_prefix
            and len(shape) > 0
            and t.dim() == len(full)
            and t.shape[0] == len(keys)
            and t.shape[1] >= shape[0]
            and tuple(t.shape[2:]) == shape[1:]
        )
        if not (ok_exact or ok_prefix):
            raise ValueError(f"{name}: expected shape {full}, got {tuple(t.shape)} in out")
        stacked = t
    else:
        stacked = torch.empty(full, dtype=dtype, pin_memory=pin_host_memory())
        if out is not None:
            out[name] = stacked
    views = {}
    for i, k in enumerate(keys):
        v = stacked[i]
        if shape and v.shape[0] != shape[0]:
            v = v[: shape[0]]
        views[k] = v
    base = stacked.untyped_storage().data_ptr()
    for k, v in views.items():
        assert v.untyped_storage().data_ptr() == base, f"{name}.{k}: row view lost the shared storage"
    return stacked, views


#: Wire code of a dtype = its index here (append only: the codes are part of every frame). The
#: frame (``cpmeta.broadcast.wire``) and :class:`ArenaLayout` order tensors by it.
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(WIRE_DTYPES)}
#: Every dtype run of a frame's tensor region (and of an :class:`ArenaLayout`) starts at a
#: multiple of this many bytes.
PACK_ALIGN = 16


def pack_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`PACK_ALIGN` (where a run starts, how long a
    region is): ``pack_up(17) == 32``."""
    return -(-n // PACK_ALIGN) * PACK_ALIGN


class ArenaLayout:
    """Where each field of a :class:`HostArena` lives: compiled once per batch shape (builders
    cache it), so carving an arena costs one allocation plus one view per field.

    ``layout`` lists ``(name, shape, dtype)``. The fields are laid out by the frame's rule (the
    ONE rule that lays tensors into bytes, ``cpmeta.broadcast.plan.Plan.sizes``): ordered by dtype
    code (:data:`WIRE_DTYPES`), a field's own tensors before dict entries (names ``"ks.4"`` and
    ``stacked`` fields, whose rows are a dict's entries), the given order otherwise; each dtype
    one run starting at a multiple of :data:`PACK_ALIGN`, the fields of a run back to back. So a
    builder's outputs lie exactly where a broadcast frame puts them, and a persistent broadcaster
    copies the whole arena into the frame with one ``memmove``. Example: ``[("positions", (256,),
    int32), ("valid_token_mask", (256,), bool)]`` -> the mask at byte 0 (256 bytes), positions at
    byte 256: ``nbytes`` 1,280.
    """

    __slots__ = ("fields", "nbytes", "dtypes", "stacked", "gaps")

    def __init__(self, layout: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 stacked: Iterable[str] = ()) -> None:
        self.stacked = frozenset(stacked)  #: fields handed out as per-row tensors (``take_rows``)
        order = sorted(range(len(layout)), key=lambda i: (
            DTYPE_CODE[layout[i][2]], "." in layout[i][0] or layout[i][0] in self.stacked, i))
        fields, pos, run, gaps = {}, 0, None, []
        for name, shape, dtype in (layout[i] for i in order):
            if dtype != run:
                start = pack_up(pos)
                if start > pos:
                    gaps.append((pos, start))
                pos, run = start, dtype
            size, strides = 1, []
            for d in reversed(shape):
                strides.append(size)
                size *= int(d)
            fields[name] = (pos // dtype.itemsize, size, tuple(shape), tuple(reversed(strides)), dtype)
            pos += size * dtype.itemsize
        self.fields: dict[str, tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]] = fields
        self.nbytes = max(pack_up(pos), PACK_ALIGN)
        if self.nbytes > pos:
            gaps.append((pos, self.nbytes))
        #: byte ranges between runs and after the last one: no field's, zeroed once per arena (a
        #: frame copies the region whole, so it carries no stale bytes of the allocation)
        self.gaps = tuple(gaps)
        self.dtypes = tuple({f[4] for f in fields.values()})


class HostArena:
    """ONE host allocation (pinned when CUDA is available) carved into a builder call's outputs.

    A builder called without ``out`` knows every output shape once the batch is read; instead of
    one ``torch.empty`` (a pinned allocation each, plus a ``.numpy()``) per field it allocates
    ``layout.nbytes`` once and hands out contiguous views: a torch view (``as_strided`` of the
    arena, so it shares the arena's storage and a non-blocking copy keeps that storage alive) and
    the numpy view of the same bytes.

    ``take(name)`` returns ``(tensor, ndarray)``, or ``None`` for a name not in the layout (the
    caller then allocates on its own). Each call's arena is new: results of an earlier call are
    never overwritten.

    ``raw``: the memory to carve instead of a new allocation, a contiguous CPU ``uint8`` tensor of
    at least ``layout.nbytes`` bytes (what an :class:`OutputBuffers` implementation that owns its
    memory hands in; ``ValueError`` otherwise). Its first ``layout.nbytes`` bytes hold the fields.
    """

    __slots__ = ("_fields", "_views", "_made", "raw")

    _NP = {torch.int32: np.int32, torch.bool: np.bool_, torch.int64: np.int64}

    def __init__(self, layout: ArenaLayout, raw: Optional[torch.Tensor] = None) -> None:
        if raw is None:
            raw = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin_host_memory())
        elif (raw.dtype != torch.uint8 or raw.device.type != "cpu" or raw.dim() != 1 or not raw.is_contiguous()
              or raw.shape[0] < layout.nbytes):
            raise ValueError(f"raw: expected a contiguous 1-D CPU uint8 tensor of >= {layout.nbytes} bytes, "
                             f"got {raw.dtype} {tuple(raw.shape)} on {raw.device}")
        #: the carved memory (a caller's ``raw`` itself, or the arena's own allocation)
        self.raw = raw
        raw_np = raw.numpy()
        for a, b in layout.gaps:
            raw_np[a:b] = 0
        self._fields = layout.fields
        views: dict[torch.dtype, tuple[torch.Tensor, np.ndarray]] = {
            dt: (raw.view(dt), raw_np.view(self._NP[dt])) for dt in layout.dtypes}
        self._views = views
        # every view is made here, the torch ones in one run: interleaved with the builders'
        # numpy calls each torch view cost several times its isolated ~2 us (cold dispatcher code)
        stacked = layout.stacked
        tens: dict[str, Any] = {}  # a Tensor, or for a stacked field the list of its row Tensors
        for name, (start, size, shape, strides, dtype) in layout.fields.items():
            t_all = views[dtype][0]
            tens[name] = [t_all.as_strided(shape[1:], strides[1:], start + i * strides[0]) for i in range(shape[0])] \
                if name in stacked else t_all.as_strided(shape, strides, start)
        self._made = {name: (tens[name], views[dtype][1][start:start + size] if len(shape) == 1 else
                             views[dtype][1][start:start + size].reshape(shape))
                      for name, (start, size, shape, strides, dtype) in layout.fields.items()}

    def take(self, name: str) -> Optional[tuple[torch.Tensor, np.ndarray]]:
        got = self._made.get(name)
        if got is None or type(got[0]) is torch.Tensor:
            return got
        start, size, shape, strides, dtype = self._fields[name]  # a stacked field as one tensor
        return self._views[dtype][0].as_strided(shape, strides, start), got[1]

    def take_rows(self, name: str) -> Optional[tuple[list[torch.Tensor], np.ndarray]]:
        """A stacked ``[n, ...]`` field as its ``n`` row tensors (each one ``as_strided`` view of
        the arena, no view of the whole field in between) and the numpy view of the whole field;
        ``None`` for a name not in the layout."""
        got = self._made.get(name)
        if got is None or type(got[0]) is list:
            return got
        start, size, shape, strides, dtype = self._fields[name]  # not declared stacked: rows now
        t_all = self._views[dtype][0]
        return [t_all.as_strided(shape[1:], strides[1:], start + i * strides[0]) for i in range(shape[0])], got[1]


class OutputBuffers(abc.ABC):
    """The ``out=`` protocol for caller-owned outputs: a builder asks for the arena of its call.

    One method. A builder that knows every output shape of a call (``prepare_decode``, once the
    batch is read) compiles them into an :class:`ArenaLayout` (cached per batch shape, so the same
    shape gives the same layout object) and writes its outputs into the :class:`HostArena` that
    :meth:`arena` returns; the returned ``InputMetadata``'s tensors are views of that arena. The
    implementation owns the memory (a :class:`HostArena` may be built over a caller's ``raw``
    bytes) and states how long a result stays valid. Implementations: :class:`OutputArenas`;
    a broadcaster's persistent arenas may implement it too. Minimal example::

        class OneArena(OutputBuffers):                     # every call refills the same bytes
            def __init__(self, nbytes): self.raw = torch.empty(nbytes, dtype=torch.uint8)
            def arena(self, layout): return HostArena(layout, raw=self.raw)

    (``OneArena`` re-carves its views on every call; :class:`OutputArenas` keeps one arena per
    layout so the views too are the same objects each step.)
    """

    __slots__ = ()

    @abc.abstractmethod
    def arena(self, layout: ArenaLayout) -> HostArena:
        """The arena this call's outputs (``layout``) are written into."""


class OutputArenas(OutputBuffers):
    """Reusable outputs for a builder called every step: ``prepare_decode(batch, cfg, out=arenas)``.

    Holds ONE :class:`HostArena` per batch shape (``(config, total_q, n_seq)``; at most
    ``max_shapes``, the oldest dropped first), made on the first call with that shape and
    REFILLED by every later one: the returned metadata's tensors are the same objects each step
    (same addresses), and no tensor is created per call. The contract of a reused ``out`` dict:
    a result is valid until the next call with the same shape, so the caller must be done with it
    -- including any non-blocking copy from it -- before that call (e.g. sync on the copy's event,
    or copy inside the step that built it). Example::

        arenas = OutputArenas()
        for step in steps:
            md = prepare_decode(state.decode_batch(slots), cfg, out=arenas)   # same tensors each step
            dev_md = md.to("cuda", non_blocking=True); ev.record(); ...; ev.synchronize()
    """

    __slots__ = ("_arenas", "max_shapes")

    def __init__(self, max_shapes: int = 8) -> None:
        if not isinstance(max_shapes, (int, np.integer)) or isinstance(max_shapes, bool):
            raise TypeError(f"max_shapes: expected an int, got {max_shapes!r}")
        if max_shapes < 1:
            raise ValueError(f"max_shapes: expected >= 1, got {max_shapes}")
        self.max_shapes = int(max_shapes)
        self._arenas: BoundedCache[ArenaLayout, HostArena] = BoundedCache(self.max_shapes)

    def arena(self, layout: ArenaLayout) -> HostArena:
        """The arena of ``layout`` (one allocation the first time; builders cache layouts, so the
        same batch shape gives the same layout object)."""
        a = self._arenas.get(layout)
        return a if a is not None else self._arenas.put(layout, HostArena(layout))

    def __len__(self) -> int:
        return len(self._arenas)


#: Where :func:`alloc` puts a field: the caller's ``out`` dict (reused and
#: filled), a :class:`HostArena` (its views), or ``None`` (a new tensor each).
AllocOut = Union[dict[str, torch.Tensor], HostArena, None]


def alloc(
    out: AllocOut, name: str, shape: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, np.ndarray]:
    """``get_or_create_tensor`` plus the tensor's numpy view (same memory) for vectorized fills;
    with a :class:`~cpmeta.buffers.HostArena` as ``out``, the arena's view of that field."""
    if isinstance(out, HostArena):
        got = out.take(name)
        if got is not None:
            return got
        out = None
    t = get_or_create_tensor(out, name, tuple(shape), dtype)
    return t, t.numpy()
