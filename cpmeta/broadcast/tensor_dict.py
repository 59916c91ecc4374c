"""``broadcast_tensor_dict``: vLLM's ``GroupCoordinator.broadcast_tensor_dict`` on cpmeta's frame.

vLLM's version sends a pickled list of ``(key, TensorMetadata | value)`` over the CPU group and
then one ``torch.distributed.broadcast`` per tensor. This one sends ONE frame
(``cpmeta.broadcast.wire``): keys, dtypes and ranks as a layout sent once per key set and then
referred to by id, the plain values as strict msgpack (never pickle), and the tensors inside the
frame over the shared-memory ring (CPU) or as ONE coalesced NCCL broadcast (CUDA tensors above
``CPMETA_PACKED_MAX_BYTES``). The swap in an engine is one line::

    # metadata = get_tp_group().broadcast_tensor_dict(metadata, src=0)
    metadata = cpmeta.broadcast_tensor_dict(metadata, src=0, group=cp_group)

What changes: values must be plain (``None``, bool, int, float, str, lists / tuples of those;
anything else is a ``TypeError`` naming the key, on the driver); keys are str (1-256 printable
ASCII characters without ``;`` or ``,``); received tensors live on this rank's device (CUDA for
an NCCL group, CPU for gloo; vLLM keeps each tensor's device type); the first call on a group
is collective set-up (every rank constructs the channel; later calls reuse it, cached per group,
source and device: :func:`close_tensor_dict_channels` releases them).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["broadcast_tensor_dict", "close_tensor_dict_channels"]

_CHANNELS: dict[tuple, Any] = {}  # (group, src rank in group, device) -> MetadataBroadcaster


def broadcast_tensor_dict(tensor_dict: Optional[dict[str, Any]] = None, src: int = 0,
                          group: Optional[Any] = None, *, device: Optional[torch.device | str] = None,
                          timeout: Optional[float] = None) -> dict[str, Any]:
    """Every rank of ``group`` returns the driver's ``dict`` (collective; vLLM's semantics).

    ``src`` is the driver's rank INSIDE ``group`` (vLLM's ``GroupCoordinator`` convention; with
    the default WORLD group it is the global rank). The driver passes its dict of str ->
    tensor or plain value and gets that same dict back; every other rank passes ``None`` (or
    nothing) and gets an equal dict: same keys in the same order, equal values, tensors with the
    driver's dtypes, shapes and bytes (aliased keys stay one tensor) on ``device`` (default: the
    current CUDA device for an NCCL group, else CPU). A group of one returns ``tensor_dict``.

    Per-rank example (2 ranks)::

        d = broadcast_tensor_dict({"ids": torch.arange(4), "n": 4} if rank == 0 else None)
        # rank 0: its own dict; rank 1: {"ids": tensor([0, 1, 2, 3]), "n": 4}
    """
    g = group if group is not None else dist.group.WORLD
    if dist.get_world_size(g) == 1:
        return tensor_dict if tensor_dict is not None else {}
    bc = _channel(g, src, device, timeout)
    if bc.is_src:
        if type(tensor_dict) is not dict:
            raise TypeError(f"rank {bc.rank} (src): tensor_dict: expected a dict, got "
                            f"{type(tensor_dict).__name__}")
        bc.broadcast(tensor_dict)
        return tensor_dict
    if tensor_dict is not None:
        raise ValueError(f"rank {bc.rank}: only the driver (rank {src} of the group) passes "
                         "tensor_dict; the others pass None")
    out: dict[str, Any] = bc.broadcast(None)
    return out


def _channel(group: Any, src: int, device: Optional[torch.device | str],
             timeout: Optional[float]) -> Any:
    key = (group, src, None if device is None else str(torch.device(device)))
    bc = _CHANNELS.get(key)
    if bc is None:
        from .broadcaster import MetadataBroadcaster

        bc = _CHANNELS[key] = MetadataBroadcaster(group=group, group_src=src, device=device,
                                                  schema=dict, timeout=timeout)
    return bc


def close_tensor_dict_channels() -> None:
    """Release every cached ``broadcast_tensor_dict`` channel (its shared-memory ring); the next
    call sets up again (collectively). Safe to call more than once."""
    for bc in _CHANNELS.values():
        bc.close()
    _CHANNELS.clear()
