"""In-place decode across a CP group (DESIGN section 12): broadcast the STAGING buffer, not the metadata.

The driver validates and stages the batch (``DecodeStaging.fill``: a few KB of int32), sends that
buffer and its host scalars as ONE frame of the common codec (``cpmeta.broadcast.channel``'s
``FrameChannel``: shared-memory ring for same-host followers, gloo otherwise), and every rank -- driver included -- uploads it
and runs the two kernels (or replays its graph) into ITS OWN buffers. Every rank's result equals
broadcasting ``prepare_decode``'s output (``metadata_diff(..., cfg=cfg)``), but followers get
CUDA-graph-ready buffers (fixed addresses, inert tail) instead of ~20 freshly received tensors.

Message (``cpmeta.gpu.staged_frame.StagedFrame``)::

    values  n_seq, total_q, total_k, max_seqlen_q, max_seqlen_k, used, max_blocks
            or the refusal's message when the driver refused the batch (followers raise too)
    tensor  the staging buffer's used prefix: [used] int32 (layout: decode_staging)

The driver's batch is a list of ``SequenceMetadata`` / a ``SequenceBatch`` (:meth:`broadcast`,
:meth:`stage`: ``DecodeStaging.fill``) or a ``BatchState`` (:meth:`broadcast_state`,
:meth:`stage_state`: ``stage_decode(staging, state, ..., upload=False)`` writes the staging straight from
the state's arrays, the cheaper step); both send the same message, followers cannot tell.

A follower checks the message against ITS ``cfg`` before any write (:func:`check_staged_layout`:
header offsets, ratios, prefix sums, block-table offsets inside the buffer); anything else is a
``RuntimeError`` naming the rank, never a kernel reading or writing out of bounds.
Every rank must construct the broadcaster with the same ``cfg`` (same ratios, block size,
``max_model_len``, Engram settings); the ratios are checked, the rest is the caller's contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .decode_buffers import capacity_of as _capacity_of, same_device as _same_device
from .decode_inplace import Out, finish_staged, resolve_backend as _resolve_backend
from .decode_staging import DecodeStaging, StagedDecode, stage_decode
from .staged_frame import STAGED_DECODE_VERSION, staged_of, staged_values
from .staging_layout import StagingLayout
from ..builders.decode import check_decode_out
from ..config import MetadataConfig
from ..metadata import InputMetadata
from ..sequence import SequenceMetadata

if TYPE_CHECKING:
    from ..state.batch_state import BatchState

__all__ = ["StagedDecodeBroadcaster", "check_staged_layout", "STAGED_DECODE_VERSION"]



def check_staged_layout(a: np.ndarray, staged: StagedDecode, cfg: MetadataConfig) -> Optional[str]:
    """Why the int32 staging prefix ``a`` does not describe a well-formed batch for ``cfg`` (None
    when it does): :meth:`cpmeta.gpu.staging_layout.StagingLayout.validate`, where the layout is."""
    return StagingLayout.of(cfg).validate(a, staged)


class StagedDecodeBroadcaster:
    """Decode metadata for every rank of a CP group from ONE broadcast of the staging buffer.

    Collective: every rank of ``group`` constructs it (same ``cfg``, same ``src``) and calls
    :meth:`broadcast` (or :meth:`stage`) the same number of times; the driver passes the batch,
    the others ``None``. The driver may instead call :meth:`broadcast_state` (:meth:`stage_state`)
    with its ``BatchState`` while the followers still call ``broadcast(None)`` (``stage(None)``).
    Each rank owns a :class:`DecodeStaging` (``staging``; pass a ``fixed`` one when a CUDA graph
    reads its device buffer) and its own ``out`` buffers.

    Per-rank example (group [0, 1, 2] on one host, src 0, each rank on its own GPU or all on one)::

        bc = StagedDecodeBroadcaster(cfg, group, src=0, device=dev)            # ranks 0, 1, 2
        md = bc.broadcast(seqs if rank == 0 else None, out=out)                # ranks 0, 1, 2
        # every rank: md == prepare_decode(seqs, cfg) on dev, written into ITS out buffers

        staged = bc.stage(seqs if rank == 0 else None)   # with a captured graph instead:
        bc.staging.replay(graph)                         # each rank replays its own graph

        if rank == 0:                                    # the driver keeps a BatchState:
            md = bc.broadcast_state(state, slots, drafts, counts, out=out)
        else:                                            # md == prepare_decode(
            md = bc.broadcast(None, out=out)             #   state.decode_batch(slots, ...), cfg)

    Args:
        cfg: the decode config (every rank the same).
        group: process group (default WORLD); gloo or NCCL (control traffic goes over gloo).
        src: GLOBAL rank of the driver.
        device: where this rank's metadata lives (default: current CUDA device for NCCL, else CPU).
        staging: this rank's :class:`DecodeStaging` (default: a new growable one on ``device``).
        backend: kernel backend as for ``prepare_decode_inplace``.
        timeout, force_remote: as for ``transport.ObjectChannel``.
    """

    def __init__(self, cfg: MetadataConfig, group: Any = None, src: Optional[int] = None, *,
                 group_src: Optional[int] = None, device: Optional[torch.device | str] = None,
                 staging: Optional[DecodeStaging] = None, backend: str = "auto",
                 timeout: Optional[float] = None, force_remote: Optional[bool] = None,
                 checksum: Optional[bool] = None) -> None:
        from .. import envs
        from ..broadcast.channel import FrameChannel, resolve_src
        from ..transport.envs import resolve_device, resolve_group
        from .staged_frame import STAGED_SCHEMA, error_key, staged_key

        self.cfg = cfg
        self.group = resolve_group(group)
        self.src = resolve_src(self.group, src, group_src)
        self.rank = dist.get_rank()
        self.is_src = self.rank == self.src
        self.device = resolve_device(device, self.group)
        self.backend = _resolve_backend(backend, self.device)
        if staging is not None and not isinstance(staging, DecodeStaging):
            raise TypeError(f"staging: expected a cpmeta.gpu.DecodeStaging, got {type(staging).__name__}")
        self.staging = staging if staging is not None else DecodeStaging(self.device)
        if not _same_device(self.staging.device, self.device):
            raise ValueError(f"staging: expected a staging buffer for {self.device}, got one for "
                             f"{self.staging.device}")
        self._ch = FrameChannel(self.group, self.src, STAGED_SCHEMA, what="StagedDecodeBroadcaster",
                                timeout=timeout, force_remote=force_remote,
                                checksum=envs.checksum() if checksum is None else bool(checksum))
        self._keys = (staged_key(), error_key())
        self._alone = not self._ch.has_readers  # CP size 1: the driver skips the (empty) broadcast

    # ---- public -------------------------------------------------------------------------------
    def broadcast(self, seqs: Optional[Sequence[SequenceMetadata]] = None, *, out: Out = None,
                  use_graph: bool = True) -> InputMetadata:
        """This rank's decode ``InputMetadata`` (tensors on ``device``, written into ``out``).

        Driver: ``seqs``; followers: ``None``. Same result and buffer rules as
        ``prepare_decode_inplace(seqs, cfg, out=out)`` on every rank. A batch that does not fit
        the driver's ``out`` is refused on every rank (the followers get a ``RuntimeError``
        naming the driver's reason); one that does not fit a follower's ``out`` is a
        ``ValueError`` on that follower, before its upload.
        """
        check_decode_out(out)
        staged = self._exchange(seqs, _capacity_of(out))
        return finish_staged(self.staging, staged, self.cfg, out=out, device=self.device,
                             backend=self.backend, use_graph=use_graph)

    def stage(self, seqs: Optional[Sequence[SequenceMetadata]] = None) -> StagedDecode:
        """Broadcast + upload only (``DecodeStaging.stage`` for the group): each rank then replays
        its own captured graph (``staging.replay(g)``). Capacity: the staging's ``out_capacity``."""
        staged = self._exchange(seqs, self.staging.out_capacity)
        self.staging.upload(staged)
        return staged

    def broadcast_state(self, state: "BatchState", slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                        num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0, out: Out = None,
                        use_graph: bool = True) -> InputMetadata:
        """Driver only: :meth:`broadcast` of ``state.decode_batch(slots, draft_tokens, num_drafts,
        num_placeholders=...)``, the staging written straight from ``state`` (``stage_decode``,
        no ``SequenceBatch``); the followers call ``broadcast(None, out=out)``. Same result,
        errors and capacity rules as :meth:`broadcast` (limits: this ``out``'s buffers)."""
        check_decode_out(out)
        cap = _capacity_of(out)
        staged = self._send(self._state_fill(state, slots, draft_tokens, num_drafts, num_placeholders, cap), cap)
        return finish_staged(self.staging, staged, self.cfg, out=out, device=self.device,
                             backend=self.backend, use_graph=use_graph)

    def stage_state(self, state: "BatchState", slots: np.ndarray, draft_tokens: Optional[np.ndarray] = None,
                    num_drafts: Optional[np.ndarray | int] = None, *, num_placeholders: int = 0) -> StagedDecode:
        """Driver only: :meth:`stage` from ``state`` (as :meth:`broadcast_state`); the followers
        call ``stage(None)``, then every rank replays its own graph."""
        cap = self.staging.out_capacity
        staged = self._send(self._state_fill(state, slots, draft_tokens, num_drafts, num_placeholders, cap), cap)
        self.staging.upload(staged)
        return staged

    def close(self) -> None:
        """Release the channel's shared memory (idempotent)."""
        self._ch.close()

    def __enter__(self) -> "StagedDecodeBroadcaster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _exchange(self, seqs: Optional[Sequence[SequenceMetadata]], cap: Any) -> StagedDecode:
        """Fill + send (driver) or receive + validate (followers) the host staging buffer; no upload."""
        if self.is_src:
            if seqs is None:
                raise ValueError(f"rank {self.rank} (src): expected the batch, got None")
            return self._send(lambda: self.staging.fill(seqs, self.cfg), cap)
        if seqs is not None:
            raise ValueError(f"rank {self.rank}: only src={self.src} passes seqs; followers pass None")
        staged = self._receive()
        if cap is not None:
            try:
                cap.check(staged)
            except ValueError as e:
                raise ValueError(f"rank {self.rank}: {e}") from None
        return staged

    def _send(self, fill: Callable[[], StagedDecode], cap: Any) -> StagedDecode:
        """Driver: ``fill()`` the host staging buffer, check it against ``cap``, send it. A
        ``ValueError`` of either is sent to the followers (they raise too), then re-raised."""
        try:
            staged = fill()
            if cap is not None:
                cap.check(staged)
        except ValueError as e:
            if self._alone:
                raise
            self._ch.send_packed(self._keys[1], [], [str(e)])
            raise
        if self._alone:  # a group of one: nobody to send to
            return staged
        self._ch.send_packed(self._keys[0], [self.staging.host_buffer[: staged.used]], staged_values(staged))
        return staged

    def _state_fill(self, state: "BatchState", slots: np.ndarray, draft_tokens: Optional[np.ndarray],
                    num_drafts: Optional[np.ndarray | int], n_ph: int, cap: Any) -> Callable[[], StagedDecode]:
        """The driver's fill from a ``BatchState``: ``stage_decode(upload=False, capacity=cap)``,
        so its check (made before the host buffer is touched) uses the limits :meth:`broadcast`
        uses, not those of the last ``out`` this staging fed."""
        if not self.is_src:
            raise ValueError(f"rank {self.rank}: only src={self.src} passes a BatchState; followers call "
                             f"broadcast(None) / stage(None)")

        def fill() -> StagedDecode:
            if state.cfg is not self.cfg and state.cfg != self.cfg:
                raise ValueError(f"state: expected a BatchState for the broadcaster's cfg, got one for {state.cfg}")
            return stage_decode(self.staging, state, slots, draft_tokens, num_drafts, num_placeholders=n_ph,
                                upload=False, capacity=cap)
        return fill

    def _receive(self) -> StagedDecode:
        where = f"rank {self.rank}: staged decode message from src={self.src}"
        frame, tensors = self._ch.recv_packed()  # header, schema, layout, dtype and rank proven
        if frame.plan.key == self._keys[1]:
            raise RuntimeError(f"{where}: the driver refused the batch: {frame.values[0]}")
        if frame.plan.key != self._keys[0]:
            raise RuntimeError(f"{where} is malformed: layout {frame.plan.tensor_paths} is not a staged step")
        staged = staged_of(frame.values)
        why = check_staged_layout(tensors[0].numpy(), staged, self.cfg)
        if why is not None:
            raise RuntimeError(f"{where} is malformed: {why}")
        self.staging.load(tensors[0])
        return staged
