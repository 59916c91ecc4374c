"""``broadcast_tensor_dict``: vLLM's ``GroupCoordinator.broadcast_tensor_dict`` on cpmeta's frame.

vLLM's version pickles a list of ``(key, TensorMetadata | value)`` over the CPU group and then
runs one ``torch.distributed.broadcast`` per tensor. This one sends ONE frame
(``cpmeta.broadcast.wire``): the dict's tree as strict msgpack (never pickle), its tensors --
at any depth -- inside the frame over the shared-memory ring (CPU) or as ONE coalesced NCCL
broadcast (CUDA tensors above ``CPMETA_PACKED_MAX_BYTES``), their paths, dtypes and ndims as a
layout sent once and then referred to by id. The swap in an engine is one line::

    # metadata = get_tp_group().broadcast_tensor_dict(metadata, src=0)
    metadata = cpmeta.broadcast_tensor_dict(metadata, src=0, group=cp_group)

What travels (``cpmeta.broadcast.dict_schema`` has the encoding and a worked example): tensors,
``None``, bool, int (int64), float, str, nested dicts, lists and tuples of those, enums (sent as
their value). Keys: str, int (they stay int), bool, float, None, or enums of those. Limits: at
most 1,023 distinct tensors per dict and nesting at most 32 levels (else a ``TypeError`` naming
the path), the non-tensor part at most 1 MiB of msgpack (about 90,000 entries of a short str key
and an int; else a ``ValueError``); the number of keys is otherwise free. Every refusal happens
on the driver before anything is sent, and every follower's call of that step raises it too.

What differs from vLLM: an enum arrives as its value (vLLM unpickles the enum); other objects
(numpy arrays, dataclasses, ``torch.Size``) are refused instead of pickled; received tensors
live on this rank's device (CUDA for an NCCL group, CPU for gloo; vLLM keeps each tensor's
device type); a tensor held under two paths arrives as one tensor at both; the first call on a
group is collective set-up (every rank constructs the channel; later calls reuse it, cached per
group, source and device: :func:`close_tensor_dict_channels` releases them).
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from cpmeta.transport.codec import encode_body
from cpmeta.transport.envs import ENV_TIMEOUT, resolve_device, resolve_group

from .collect import not_dense, value_failure
from .dict_schema import TREE_KEY, decode_tree, encode_tree
from .wire import PATH_SEP

__all__ = ["broadcast_tensor_dict", "close_tensor_dict_channels"]

_CHANNELS: dict[tuple, Any] = {}  # (group, src rank in group, device) -> MetadataBroadcaster


def broadcast_tensor_dict(tensor_dict: Optional[dict[Any, Any]] = None, src: int = 0,
                          group: Optional[Any] = None, *, device: Optional[torch.device | str] = None,
                          timeout: Any = ENV_TIMEOUT) -> Optional[dict[Any, Any]]:
    """Every rank of ``group`` returns the driver's dict (collective; vLLM's semantics).

    ``src`` is the driver's rank INSIDE ``group`` (vLLM's ``GroupCoordinator`` convention: with
    ``group = new_group([2, 3])``, ``src=1`` is global rank 3; with the default WORLD group it
    is the global rank); ``0 <= src < group size``, else ``ValueError``. The driver passes its
    dict and gets that same object back; every other rank passes ``None`` (or nothing) and gets
    an equal dict: the same keys (of the same types) in the same order at every depth, the same
    containers (dict, list, tuple), equal plain values of the same types, enums as their values,
    tensors with the driver's dtypes, shapes and bytes on ``device`` (default: the current CUDA
    device for an NCCL group, else CPU), one tensor wherever the driver held one object. A
    group of one returns ``tensor_dict`` after the driver's checks.

    A follower that passes a dict still takes its part in the step (the frame is consumed, so it
    stays in step with the driver), then raises ``ValueError``.

    Per-rank example (2 ranks)::

        d = broadcast_tensor_dict({"ids": torch.arange(4), "n": 4, 3: (None, 0.5)}
                                  if rank == 0 else None)
        # rank 0: its own dict; rank 1: {"ids": tensor([0, 1, 2, 3]), "n": 4, 3: (None, 0.5)}
    """
    g = resolve_group(group)
    size = dist.get_world_size(g)
    if type(src) is not int or not 0 <= src < size:
        raise ValueError(f"src: expected the driver's rank inside the group (0..{size - 1}), got "
                         f"{src!r}")
    if size == 1:
        if device is not None:
            resolve_device(device, g)  # the check a larger group's channel makes
        if tensor_dict is not None:
            tokens, tensors, labels = encode_tree(tensor_dict)  # the checks a larger group would make
            err = not_dense((PATH_SEP.join(labels),), tensors)
            if err is not None:
                raise err
            _encodes(tokens)
        return tensor_dict
    bc = _channel(g, src, device, timeout)
    if bc.is_src:
        try:
            tokens, tensors, labels = encode_tree(cast(dict, tensor_dict))  # encode_tree refuses a non-dict
        except Exception as e:
            bc.refuse(e)  # the followers' pending call raises it too: every rank stays in step
            raise
        flat: dict[str, Any] = {TREE_KEY: tokens}
        flat.update(zip(labels, tensors))
        bc.broadcast(flat)
        return tensor_dict
    got: dict[str, Any] = bc.broadcast(None)
    if tensor_dict is not None:
        raise ValueError(f"rank {bc.rank}: only the driver (rank {src} of the group) passes "
                         "tensor_dict; the others pass None (this step was received and dropped)")
    tokens = got.pop(TREE_KEY)
    return decode_tree(tokens, list(got.values()))


def _encodes(tokens: list[Any]) -> None:
    """The codec's check of a group of one's tree (a str with a lone surrogate), named as a
    larger group's driver names it (the tree's tokens are small: a few us)."""
    try:
        encode_body([tokens])
    except ValueError as e:
        named = value_failure((None, None, None, TREE_KEY), [tokens], str(e))
        if named is None:
            raise
        raise ValueError(named) from None


def _channel(group: Any, src: int, device: Optional[torch.device | str],
             timeout: Any) -> Any:
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
