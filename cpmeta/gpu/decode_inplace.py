"""``prepare_decode_inplace``: decode metadata built on the device, in place (DESIGN section 12).

One step::

    CPU   extract_batch (validation, O(n_seq) Python)  ->  ONE pinned int32 staging buffer
    H2D   ONE copy_(non_blocking=True) of its used prefix (CUDA event guards the next refill)
    GPU   _decode_metadata_kernel  (one program per sequence + tail programs; all ratios)
          _decode_block_tables_kernel (one program per sequence)

The result equals :func:`cpmeta.prepare_decode` field by field (``metadata_diff(..., cfg=cfg)``;
undefined ``block_tables`` columns excepted). Per-ratio fields (``klen``, ``positions_c``,
``slot_mapping_store_ca``, ``kv_ca_index_offset_len``) are row views of ONE stacked
``[n_ratio, q_cap, ...]`` buffer each. With ``out`` holding buffers of a larger batch every write
lands in their prefixes (no allocation, unchanged ``data_ptr``); rows past ``total_q`` get inert
values (see :class:`~cpmeta.gpu.decode_staging.DecodeBuffers`), so a CUDA graph captured at the
larger batch can be replayed::

    st = DecodeStaging("cuda", staging_capacity(cfg, max_seqs, max_q), fixed=True)
    out = {}
    prepare_decode_inplace(max_batch, cfg, out=out, device="cuda", staging=st)   # allocate + warm up
    with torch.cuda.graph(g):
        md = launch_decode_inplace(st, cfg, out=out)   # kernels only, full-capacity views
        md.compute_attn_info(cfg)
    st.stage(batch, cfg); g.replay()                  # every step: refill + copy, then replay

Backends: ``"triton"`` (the kernels; on CPU tensors only under ``TRITON_INTERPRET=1``),
``"torch"`` (vectorized emulation of the kernels on the same staging buffer), ``"auto"``
(triton on CUDA when importable, else torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .decode_staging import DecodeBuffers, DecodeStaging, OutCapacity, StagedDecode, staging_capacity
from ..config import MetadataConfig
from ..builders.decode import DECODE_STACKED_FIELDS, check_decode_out
from ..buffers import get_or_create_stacked, get_or_create_tensor
from ..metadata import InputMetadata
from ..sequence import SequenceMetadata

__all__ = [
    "prepare_decode_inplace",
    "launch_decode_inplace",
    "capture_decode_graph",
    "DecodeStaging",
    "StagedDecode",
    "OutCapacity",
    "staging_capacity",
    "BACKENDS",
]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
_STACKED = DECODE_STACKED_FIELDS
#: Prefix-view sets kept per ``out`` (one per distinct (n_seq, total_q); slicing ~25 views each
#: step costs ~20 us of host time).
_MAX_CACHED_VIEWS = 256
Out = Optional[dict[str, torch.Tensor]]

#: Default staging pair per device (used when ``staging=None``; not thread-safe).
_DEFAULT_STAGING: dict[torch.device, DecodeStaging] = {}


def _triton_usable(device: torch.device) -> bool:
    """Triton can run here: CUDA device, or CPU tensors under the Triton interpreter."""
    try:
        import triton
    except ImportError:
        return False
    return device.type == "cuda" or bool(triton.knobs.runtime.interpret)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _triton_usable(device) else "torch"
    if backend == "triton" and not _triton_usable(device):
        raise ValueError(
            f"backend: 'triton' needs a CUDA device or TRITON_INTERPRET=1 set before triton is "
            f"imported (device {device})"
        )
    return backend


def _resolve_device(device: Optional[torch.device | str], out: Out) -> torch.device:
    if device is not None:
        return torch.device(device)
    if out and "positions" in out:
        return out["positions"].device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _ensure(out: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``out[name]`` (allocated with ``shape`` on ``device`` if missing), device and layout checked."""
    if name not in out:
        out[name] = torch.empty(shape, dtype=dtype, device=device)
    t = out[name]
    if not _same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device} in out")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor in out")
    return t


_RowSpec = tuple[tuple[int, ...], torch.dtype, Optional[tuple[str, ...]]]


def _row_specs(cfg: MetadataConfig) -> dict[str, _RowSpec]:
    """Per-row buffers: name -> (shape after the row dim, dtype, ratio keys if stacked else None).
    Only the enabled features' fields (DESIGN 14): a plain config has 8 of them."""
    i32, keys = torch.int32, lambda rs: tuple(str(r) for r in rs)
    specs: dict[str, _RowSpec] = {
        "positions": ((), i32, None), "input_ids": ((), i32, None),
        "gate_force_random": ((), torch.bool, None), "valid_token_mask": ((), torch.bool, None),
        "query_indices": ((), i32, None), "context_lens": ((), i32, None),
        "block_tables": ((cfg.max_num_blocks,), i32, None),
    }
    if cfg.has_swa:
        specs.update({"slot_mapping_store_swa": ((), i32, None), "state_block_idx": ((), i32, None),
                      "kv_swa_index_offset_len": ((2,), i32, None)})
    if cfg.has_compressed_kv:
        specs.update({
            "positions_c": ((), i32, keys(cfg.ca_ratios)),
            "slot_mapping_store_ca": ((), i32, keys(cfg.ca_ratios)),
            "klen": ((), i32, keys(cfg.sparse_compress_ratios)),
            "kv_ca_index_offset_len": ((2,), i32, keys(cfg.dense_compress_ratios)),
        })
    if cfg.max_ngram_size:
        specs["ngram_token_ids"] = ((cfg.max_ngram_size,), i32, None)
    return specs


def _buffers(
    out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int, device: torch.device
) -> tuple[DecodeBuffers, dict]:
    """Full-capacity buffers (allocated into ``out`` where missing) and the ``[total_q]`` views.

    Every row buffer must have the same row capacity ``q_cap`` (the kernels take one), and
    ``cu_seqlens_q/k`` the same ``seq_cap + 1``; a mismatch is a ``ValueError`` naming the field.
    """
    full: dict[str, Any] = {}  # DecodeBuffers' fields: tensors, None for a switched-off feature
    views: dict = {}
    q_cap: Optional[int] = None
    for name, (rest, dtype, keys) in _row_specs(cfg).items():
        if keys is None:
            t = _ensure(out, name, (total_q, *rest), dtype, device)
            views[name] = get_or_create_tensor(out, name, (total_q, *rest), dtype, allow_prefix=True)
            cap = t.shape[0]
        else:
            t = _ensure(out, name, (len(keys), total_q, *rest), dtype, device)
            _, views[name] = get_or_create_stacked(out, name, keys, (total_q, *rest), dtype, allow_prefix=True)
            cap = t.shape[1]
            for k, v in views[name].items():
                assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), f"{name}.{k}"
                assert v.stride() == t.stride()[1:], f"{name}.{k}: row view strides differ"
        if q_cap is None:
            q_cap = cap
        elif cap != q_cap:
            raise ValueError(f"{name}: expected row capacity {q_cap} like positions, got {cap} in out")
        full[name] = t
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        full[name] = _ensure(out, name, (n_seq + 1,), torch.int32, device)
        views[name] = get_or_create_tensor(out, name, (n_seq + 1,), torch.int32, allow_prefix=True)
    if full["cu_seqlens_q"].shape != full["cu_seqlens_k"].shape:
        raise ValueError("cu_seqlens_k: expected the same capacity as cu_seqlens_q in out")
    for name in DecodeBuffers.__slots__:  # Engram, SWA, compressed KV switched off: None
        full.setdefault(name, None)
        views.setdefault(name, None)
    return DecodeBuffers(**full), views


@dataclass(slots=True)
class _OutCache:
    """The checked :class:`DecodeBuffers` of one ``out`` dict, kept on its :class:`DecodeStaging`.

    Valid while ``out`` is the same dict holding the same tensor objects (``key`` = their ids;
    the cache references them, so the ids cannot be reused) and ``cfg`` is the same object.
    Saves re-checking ~20 buffers and re-slicing their prefix views on every step.
    """

    out_id: int
    key: tuple[int, ...]
    cfg: MetadataConfig
    device: torch.device
    bufs: DecodeBuffers
    keys: dict[str, tuple[str, ...]]  # stacked field -> ratio keys
    views: dict = field(default_factory=dict)  # (n_seq, total_q) -> prefix views, bounded
    graph: Optional["torch.cuda.CUDAGraph"] = None  # the two kernels, captured (CUDA + triton only)
    graph_key: tuple = ()  # (staging device buffer address, size, backend) the graph reads


def _cut(bufs: DecodeBuffers, keys: dict[str, tuple[str, ...]], n_seq: int, total_q: int) -> dict:
    """Prefix views ``[:total_q]`` (``cu_seqlens``: ``[:n_seq+1]``; stacked: ``{key: t[i, :total_q]}``)."""
    views: dict = {}
    for name in DecodeBuffers.__slots__:
        t = getattr(bufs, name)
        if name in keys:
            views[name] = {k: t[i, :total_q] for i, k in enumerate(keys[name])}
        elif t is None:
            views[name] = None
        elif name.startswith("cu_seqlens"):
            views[name] = t[: n_seq + 1]
        else:
            views[name] = t[:total_q]
    return views


def _cached_buffers(
    st: DecodeStaging, out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int,
    device: torch.device,
) -> tuple[_OutCache, dict]:
    """:func:`_buffers` through the staging object's one-entry cache (same results, the buffers
    as the returned cache's ``bufs``; the cache is also ``st.out_cache``)."""
    c = st.out_cache
    if (
        isinstance(c, _OutCache) and c.out_id == id(out) and c.cfg is cfg and c.device == device
        and c.key == tuple(map(id, out.values()))
        and total_q <= c.bufs.q_cap and n_seq <= c.bufs.seq_cap
    ):
        views = c.views.get((n_seq, total_q))
        if views is None:
            if len(c.views) >= _MAX_CACHED_VIEWS:
                c.views.clear()
            views = c.views[(n_seq, total_q)] = _cut(c.bufs, c.keys, n_seq, total_q)
        return c, {k: dict(v) if isinstance(v, dict) else v for k, v in views.items()}
    bufs, views = _buffers(out, cfg, n_seq, total_q, device)
    keys = {name: tuple(views[name]) for name in _STACKED if views[name] is not None}
    st.out_cache = made = _OutCache(id(out), tuple(map(id, out.values())), cfg, device, bufs, keys)
    st.out_capacity = _capacity(bufs)
    return made, views


def _capacity(bufs: DecodeBuffers) -> OutCapacity:
    return OutCapacity(bufs.q_cap, bufs.seq_cap, bufs.block_tables.shape[1])


def _capacity_of(out: Out) -> Optional[OutCapacity]:
    """Limits of the buffers already in ``out`` (None while it lacks one the kernels index by:
    missing buffers are allocated at the batch's own size)."""
    if not out or not all(k in out for k in ("positions", "cu_seqlens_q", "block_tables")):
        return None
    bt = out["block_tables"]
    return OutCapacity(out["positions"].shape[0], out["cu_seqlens_q"].shape[0] - 1,
                       bt.shape[1] if bt.dim() == 2 else 0)


def _launch(stg: torch.Tensor, cfg: MetadataConfig, bufs: DecodeBuffers, backend: str) -> None:
    if backend == "triton":
        from .decode_triton import launch_decode_kernels

        launch_decode_kernels(stg, cfg, bufs)
    else:
        from .decode_emulate import emulate_decode_kernels

        emulate_decode_kernels(stg, cfg, bufs)


def _capture_kernels(stg: torch.Tensor, cfg: MetadataConfig, bufs: DecodeBuffers) -> "torch.cuda.CUDAGraph":
    """The two kernels captured once on a side stream (nothing runs; no allocation inside)."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(stg.device)
    side.wait_stream(torch.cuda.current_stream(stg.device))
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            _launch(stg, cfg, bufs, "triton")
        finally:
            g.capture_end()
    torch.cuda.current_stream(stg.device).wait_stream(side)
    return g


def _launch_cached(st: DecodeStaging, cfg: MetadataConfig, cache: Optional[_OutCache], backend: str,
                   bufs: DecodeBuffers, use_graph: bool) -> None:
    """Launch the kernels; with a cached ``out`` on CUDA, replay them from a CUDA graph instead.

    The kernels take only fixed addresses and capacities (the batch comes from the staging
    header on the device), so ONE graph per (``out`` buffers, staging buffer) serves every batch
    that fits: a replay costs a few us of host time against tens of us per Triton launch.
    The first call launches directly (compiling) and captures; inside a caller's own capture
    the kernels are launched directly (graphs do not nest).
    """
    stg = st.device_buffer
    cuda = stg.device.type == "cuda"
    stream = torch.cuda.current_stream(stg.device) if cuda else None  # looked up once for both calls
    st.ready_on(stream)  # the upload may have been enqueued on another stream
    if cache is None or not use_graph or backend != "triton" or not cuda or torch.cuda.is_current_stream_capturing():
        _launch(stg, cfg, bufs, backend)
    elif cache.graph is not None and cache.graph_key == (stg.data_ptr(), stg.shape[0], backend):
        cache.graph.replay()
    else:
        _launch(stg, cfg, bufs, backend)
        cache.graph = _capture_kernels(stg, cfg, cache.bufs)
        cache.graph_key = (stg.data_ptr(), stg.shape[0], backend)
    st.consumed_on(stream)  # the next upload waits for these reads


def _default_staging(device: torch.device) -> DecodeStaging:
    st = _DEFAULT_STAGING.get(device)
    if st is None:
        st = _DEFAULT_STAGING[device] = DecodeStaging(device)
    return st


def prepare_decode_inplace(
    seqs: Sequence[SequenceMetadata],
    cfg: MetadataConfig,
    *,
    out: Out = None,
    device: Optional[torch.device | str] = None,
    backend: str = "auto",
    staging: Optional[DecodeStaging] = None,
    use_graph: bool = True,
) -> InputMetadata:
    """Decode ``InputMetadata`` on ``device``, equal to ``prepare_decode(seqs, cfg)`` moved there.

    Args:
        seqs, cfg: as for :func:`cpmeta.prepare_decode` (same validation and error messages).
        out: dict of buffers in the decode ``out=`` schema shared with ``prepare_decode``
            (:data:`cpmeta.builders.decode.DECODE_STACKED_FIELDS`): keyed ``"positions"``, ...,
            stacked ones under ``"klen"``, ``"positions_c"``, ``"slot_mapping_store_ca"``,
            ``"kv_ca_index_offset_len"`` ([n_ratio, q_cap, ...]). Missing ones are allocated on ``device`` and stored; larger
            ones (a captured batch) are written in their prefixes.
        device: where the metadata lives (default: ``out``'s device, else CUDA if available).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (see module docstring).
        staging: the :class:`DecodeStaging` to reuse (default: one per device).
        use_graph: with ``out`` on CUDA (triton backend), replay the two kernels from a CUDA graph
            captured on first use for these buffers (host cost of two Triton launches ~100 us
            -> one replay ~10 us). Ignored inside a caller's own graph capture.

    Returns fields of shape ``[total_q, ...]`` (row views of the buffers), ``cu_seqlens_q/k``
    [n_seq+1] int32, dict fields ``{str(ratio): row view}``, scalars from the host arrays.
    Work is enqueued on the current stream; nothing waits for the device.
    """
    check_decode_out(out)
    dev = _resolve_device(device, out)
    be = _resolve_backend(backend, dev)
    st = staging if staging is not None else _default_staging(dev)
    if not _same_device(st.device, dev):
        raise ValueError(f"staging: expected a staging buffer for {dev}, got one for {st.device}")
    staged = st.fill(seqs, cfg)  # host only: nothing reaches the device before the checks
    return finish_staged(st, staged, cfg, out=out, device=dev, backend=be, use_graph=use_graph)


def finish_staged(
    st: DecodeStaging, staged: StagedDecode, cfg: MetadataConfig, *, out: Out, device: torch.device,
    backend: str, use_graph: bool = True,
) -> InputMetadata:
    """The device half of :func:`prepare_decode_inplace` for a batch already in ``st``'s host buffer:
    capacity check against ``out`` (``ValueError`` before anything reaches the device), buffers,
    ONE upload, the kernels (or their cached graph). Shared with the CP path (``decode_cp``)."""
    cache = None
    if out is None:
        bufs, views = _buffers({}, cfg, staged.num_seqs, staged.total_q, device)
    else:
        cap = _capacity_of(out)  # this out's limits (the staging may remember another out's)
        if cap is not None:
            cap.check(staged)
        cache, views = _cached_buffers(st, out, cfg, staged.num_seqs, staged.total_q, device)
        bufs = cache.bufs
    st.upload(staged)
    _launch_cached(st, cfg, cache, backend, bufs, use_graph)
    return InputMetadata(
        is_prompt=False, num_seqs=staged.num_seqs, total_q=staged.total_q,
        max_seqlen_q=staged.max_seqlen_q, max_seqlen_k=staged.max_seqlen_k, **views,
    )


def launch_decode_inplace(
    staging: DecodeStaging, cfg: MetadataConfig, *, out: dict[str, torch.Tensor], backend: str = "auto"
) -> InputMetadata:
    """Only the kernels, on whatever batch ``staging`` last uploaded (for CUDA-graph capture).

    ``out`` must hold every buffer already (e.g. from a :func:`prepare_decode_inplace` warm-up at
    the capture batch); nothing is allocated. Returns ``InputMetadata`` whose tensors are the FULL
    ``[q_cap, ...]`` buffers (rows past the staged ``total_q`` hold the inert tail) and whose
    batch scalars are ``None`` (the host knows them from :meth:`DecodeStaging.stage`).
    Example: capture with 256 sequences staged, replay after ``staging.stage(64 seqs)``: rows
    ``[0, total_q)`` equal ``prepare_decode(64 seqs)``.

    Capacity: these buffers' limits are recorded on ``staging`` (``out_capacity``), so a later
    ``staging.stage(batch)`` needing more rows, sequences or block-table columns is refused
    before its copy; a batch staged earlier that does not fit is refused here, before the kernels.
    """
    if "positions" not in out or "cu_seqlens_q" not in out:
        raise ValueError("out: expected the buffers of a previous prepare_decode_inplace call")
    dev = out["positions"].device
    be = _resolve_backend(backend, dev)
    q_cap, n_cap = out["positions"].shape[0], out["cu_seqlens_q"].shape[0] - 1
    cache, views = _cached_buffers(staging, out, cfg, n_cap, q_cap, dev)
    if staging.last_staged is not None:  # staged before these buffers were known to it
        staging.check_capacity(staging.last_staged, _capacity(cache.bufs))
    _launch_cached(staging, cfg, cache, be, cache.bufs, use_graph=True)
    return InputMetadata(is_prompt=False, **views)


def capture_decode_graph(staging: DecodeStaging, cfg: MetadataConfig, *, out: dict[str, torch.Tensor],
                         upload: bool = False) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of :func:`launch_decode_inplace` into ``out`` (its buffers exist already, e.g.
    from a ``prepare_decode_inplace`` warm-up at the largest batch), warmed up once on a side
    stream first. ``upload=True``: the graph starts with ``staging.upload_in_graph()`` (the H2D
    copy of the whole fixed staging buffer), so each step is ``staged = stage_decode(staging, state,
    ..., upload=False)`` then ``staging.replay_uploading(g, staged)``; without it, each step is
    ``staging.stage(...)`` / ``stage_decode(staging, state, ...)`` then ``staging.replay(g)``."""
    dev = staging.device_buffer.device  # with its index
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        launch_decode_inplace(staging, cfg, out=out)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        if upload:
            staging.upload_in_graph()
        launch_decode_inplace(staging, cfg, out=out)
    return g
