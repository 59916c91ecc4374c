"""``prepare_decode_inplace``: decode metadata built on the device, in place (DESIGN section 12).

One step::

    CPU   as_sequence_batch (validation) + ONE compiled write  ->  ONE pinned int32 staging buffer
    H2D   ONE copy_(non_blocking=True) of its used prefix (CUDA event guards the next refill)
    GPU   _decode_metadata_kernel  (one program per sequence + tail programs; all ratios)
          _decode_block_tables_kernel (one program per sequence)

The result equals :func:`cpmeta.prepare_decode` at the buffers' table width
(``prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks)``) field by field
(``metadata_diff(..., cfg=cfg)``; undefined ``block_tables`` columns excepted). Per-ratio fields (``klen``, ``positions_c``,
``slot_mapping_store_ca``, ``kv_ca_index_offset_len``) are row views of ONE stacked
``[n_ratio, q_cap, ...]`` buffer each. With ``out`` holding buffers of a larger batch every write
lands in their prefixes (no allocation, unchanged ``data_ptr``); rows past ``total_q`` get inert
values (see :class:`~cpmeta.gpu.decode_buffers.DecodeBuffers`), so a CUDA graph captured at the
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
from typing import Optional

import torch

from .decode_buffers import DecodeBuffers, OutCache, OutCapacity, capacity_of, make_buffers, same_device
from .decode_staging import DecodeStaging, StagedDecode, staging_capacity
from ..state.batch import BatchInput
from ..config import MetadataConfig
from ..builders.decode import check_decode_out
from ..metadata import InputMetadata
from ..transport.envs import resolve_device

__all__ = [
    "prepare_decode_inplace",
    "launch_decode_inplace",
    "capture_decode_graph",
    "DecodeStaging",
    "StagedDecode",
    "OutCapacity",
    "staging_capacity",
    "BACKENDS",
    "finish_staged",
    "resolve_backend",
]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
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


def resolve_backend(backend: str, device: torch.device) -> str:
    """``backend`` checked for ``device`` (``"auto"``: triton on CUDA when importable, else torch)."""
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
        return resolve_device(device, None)  # (a CPU or CUDA device this process has, else named)
    if out and "positions" in out:
        return out["positions"].device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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


def _launch_cached(st: DecodeStaging, cfg: MetadataConfig, cache: Optional[OutCache], backend: str,
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
    seqs: BatchInput,
    cfg: MetadataConfig,
    *,
    out: Out = None,
    device: Optional[torch.device | str] = None,
    backend: str = "auto",
    staging: Optional[DecodeStaging] = None,
    use_graph: bool = True,
) -> InputMetadata:
    """Decode ``InputMetadata`` on ``device``, equal to ``prepare_decode(seqs, cfg,
    table_width=cfg.max_num_blocks)`` moved there (the in-place buffers' fixed table width).

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
    be = resolve_backend(backend, dev)
    if staging is not None and not isinstance(staging, DecodeStaging):
        raise TypeError(f"staging: expected a cpmeta.gpu.DecodeStaging, got {type(staging).__name__}")
    st = staging if staging is not None else _default_staging(dev)
    if not same_device(st.device, dev):
        raise ValueError(f"staging: expected a staging buffer for {dev}, got one for {st.device}")
    staged = st.fill(seqs, cfg)  # host only: nothing reaches the device before the checks
    return finish_staged(st, staged, cfg, out=out, device=dev, backend=be, use_graph=use_graph)


def finish_staged(
    st: DecodeStaging, staged: StagedDecode, cfg: MetadataConfig, *, out: Out, device: torch.device,
    backend: str, use_graph: bool = True,
) -> InputMetadata:
    """The device half of :func:`prepare_decode_inplace` for a batch already in ``st``'s host buffer:
    capacity check against ``out`` (``ValueError`` before anything reaches the device), buffers,
    ONE upload, the kernels (or their cached graph). Shared with the CP path (``decode_cp``).
    ``backend`` as for :func:`prepare_decode_inplace` (``"auto"``: Triton on CUDA)."""
    backend = resolve_backend(backend, device)  # "auto" must never mean the emulation on CUDA
    cache = None
    if out is None:
        bufs, views = make_buffers({}, cfg, staged.num_seqs, staged.total_q, device)
    else:
        cap = capacity_of(out)  # this out's limits (the staging may remember another out's)
        if cap is not None:
            cap.check(staged)
        cache, views = st.buffers_for(out, cfg, staged.num_seqs, staged.total_q, device)
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
    be = resolve_backend(backend, dev)
    q_cap, n_cap = out["positions"].shape[0], out["cu_seqlens_q"].shape[0] - 1
    cache, views = staging.buffers_for(out, cfg, n_cap, q_cap, dev)
    if staging.last_staged is not None:  # staged before these buffers were known to it
        staging.check_capacity(staging.last_staged, cache.bufs.capacity())
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
