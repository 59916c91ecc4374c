"""``MetadataBroadcaster``: every rank of a CP group gets the driver's ``InputMetadata``.

One step, on every rank of ``group``::

    driver (src)                                   follower
    md.to_flatten_dict()  (one level: "klen.4")
    walk by path: tensors -> list (dedupe by id)
                  others  -> values map
    message = {schema, values, tensor specs}
        ── ObjectChannel: msgpack over the shm ring (same host) / gloo bytes (other hosts) ──▶
    tensors ── packed inside the same message (CPU) ─────────────────────────────────────▶ views
            └─ or ONE coalesced TensorChannel broadcast (NCCL for CUDA) ──────────────────▶ views
                                                   InputMetadata.from_flatten_dict(values + tensors)

The message carries a schema fingerprint of ``InputMetadata``'s fields; a follower whose
``InputMetadata`` differs raises instead of misreading. Aliasing is kept: two paths holding the
same tensor object (``positions_cp`` is ``positions`` before a mirror) are sent once and are the
same tensor object on the receiver.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import fields
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import envs
from .metadata import InputMetadata

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]

logger = logging.getLogger(__name__)

#: Version of the broadcaster's message layout (on top of the codec's own protocol version).
MESSAGE_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
    )
}


def _schema_fingerprint() -> str:
    """sha256 over InputMetadata's field names and declared types (16 hex digits)."""
    desc = ";".join(f"{f.name}:{f.type}" for f in fields(InputMetadata))
    return hashlib.sha256(f"v{MESSAGE_VERSION}|{desc}".encode()).hexdigest()[:16]


SCHEMA_FINGERPRINT: str = _schema_fingerprint()


def _dtype_name(t: torch.Tensor, path: str) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"{path}: dtype {t.dtype} cannot be broadcast")
    return name


def collect(md: InputMetadata) -> tuple[dict[str, Any], list[list[str]], list[torch.Tensor]]:
    """Split ``md`` by path into non-tensor values and deduplicated tensors.

    Returns ``(values, tensor_paths, tensors)``: ``values`` maps each non-tensor path to its
    value (scalars, str, an empty dict; ``None`` fields are left out, the receiver's default); ``tensors[i]`` is reachable at every path in
    ``tensor_paths[i]``. Example: with ``positions_cp is positions`` the result holds one
    tensor with paths ``["positions", "positions_cp"]``.
    """
    values: dict[str, Any] = {}
    paths: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    for path, v in md.to_flatten_dict().items():
        if isinstance(v, torch.Tensor):
            i = index.get(id(v))
            if i is None:
                index[id(v)] = len(tensors)
                tensors.append(v)
                paths.append([path])
            else:
                paths[i].append(path)
        elif v is not None:  # None is every field's default: omitting it loses nothing
            values[path] = v
    return values, paths, tensors


def _specs(paths: list[list[str]], tensors: list[torch.Tensor]) -> list[list[Any]]:
    return [[p, _dtype_name(t, p[0]), list(t.shape)] for p, t in zip(paths, tensors)]


def _check_message(msg: Any, rank: int) -> None:
    if not isinstance(msg, dict) or "schema" not in msg:
        raise RuntimeError(f"rank {rank}: malformed metadata message (no schema field)")
    if msg.get("version") != MESSAGE_VERSION:
        raise RuntimeError(
            f"rank {rank}: metadata message version mismatch: driver sent {msg.get('version')!r}, "
            f"this rank speaks {MESSAGE_VERSION}"
        )
    if msg["schema"] != SCHEMA_FINGERPRINT:
        raise RuntimeError(
            f"rank {rank}: InputMetadata schema fingerprint mismatch: driver {msg['schema']!r}, "
            f"this rank {SCHEMA_FINGERPRINT!r} (driver and follower run different cpmeta versions)"
        )


def _move_views(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move views of ONE CPU storage to ``device`` with one copy, keeping offsets and shapes."""
    if not tensors or device.type == "cpu":
        return tensors
    storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
    if len(storages) > 1:
        return [t.to(device, non_blocking=True) for t in tensors]
    src = tensors[0].untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(src, 0, (src.nbytes(),))
    dev = flat.to(device, non_blocking=True).untyped_storage()
    out = []
    for t in tensors:
        v = torch.empty(0, dtype=t.dtype, device=device)
        v.set_(dev, t.storage_offset(), t.shape, t.stride())
        out.append(v)
    return out


class MetadataBroadcaster:
    """Broadcast ``InputMetadata`` from ``src`` to every rank of ``group``.

    Collective: every rank of ``group`` constructs it (hostnames are exchanged once) and calls
    :meth:`broadcast` the same number of times. Per-rank example with 2 ranks::

        b = MetadataBroadcaster()                   # rank 0 and rank 1
        md = b.broadcast(prepare_decode(seqs, cfg))  # rank 0 (src)
        md = b.broadcast(None)                       # rank 1
        b.close()                                    # both

    Args:
        group: a torch.distributed process group (default WORLD); NCCL or gloo.
        src: GLOBAL rank of the driver inside ``group``.
        device: where received tensors live (default: current CUDA device for NCCL, else CPU).
        tensor_path: ``auto`` (CPU: inside the object message; CUDA: one NCCL broadcast, or
            inside the message below ``CPMETA_PACKED_MAX_BYTES``), ``packed`` or ``collective``.
        timeout: seconds any wait may take before a ``TimeoutError`` naming the lagging rank.
        force_remote: send the object bytes through the process group even on one host.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        src: int = 0,
        device: Optional[torch.device | str] = None,
        *,
        tensor_path: Optional[str] = None,
        timeout: Optional[float] = None,
        force_remote: Optional[bool] = None,
    ) -> None:
        from transport import ObjectChannel  # cpmeta -> transport, never the reverse

        self.group = group if group is not None else dist.group.WORLD
        self.src = src
        self.rank = dist.get_rank()
        self.is_src = self.rank == src
        backend = str(dist.get_backend(self.group)).lower()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
        self.device = torch.device(device)
        self.tensor_path = tensor_path or envs.tensor_path()
        if self.tensor_path not in envs.TENSOR_PATHS:
            raise ValueError(f"tensor_path: expected one of {envs.TENSOR_PATHS}, got {self.tensor_path!r}")
        if self.tensor_path == "collective" and "nccl" not in backend and self.device.type == "cuda":
            raise ValueError("tensor_path='collective' with CUDA tensors needs an NCCL group")
        self._packed_max = envs.packed_max_bytes()
        self._backend = backend
        self._objects = ObjectChannel(self.group, src, timeout=timeout, force_remote=force_remote,
                                      schema=SCHEMA_FINGERPRINT.encode())
        self._tensors: Any = None  # TensorChannel, created on first collective use
        self._closed = False

    # ---- public ---------------------------------------------------------------------------
    def broadcast(self, md: Optional[InputMetadata]) -> InputMetadata:
        """Return the driver's metadata on every rank (tensors on ``self.device``).

        ``src`` passes its ``InputMetadata``, every other rank ``None``. Followers receive an
        independently constructed object, bit-identical field by field, aliasing re-created.
        """
        if self._closed:
            raise RuntimeError("MetadataBroadcaster: broadcast() after close()")
        if self.is_src:
            if not isinstance(md, InputMetadata):
                raise TypeError(f"rank {self.rank} (src): expected InputMetadata, got {type(md).__name__}")
            return self._send(md)
        if md is not None:
            raise ValueError(f"rank {self.rank}: only src={self.src} passes metadata; followers pass None")
        return self._receive()

    def close(self) -> None:
        """Release the shared-memory ring and channels (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._objects.close()
        if self._tensors is not None and hasattr(self._tensors, "close"):
            self._tensors.close()

    def __enter__(self) -> "MetadataBroadcaster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------
    def _use_packed(self, tensors: list[torch.Tensor]) -> bool:
        if self.tensor_path != "auto":
            return self.tensor_path == "packed"
        if self.device.type == "cpu" and "nccl" not in self._backend:
            return True
        if any(t.device.type != "cpu" for t in tensors):
            return False
        return sum(t.numel() * t.element_size() for t in tensors) <= self._packed_max

    def _tensor_channel(self) -> Any:
        if self._tensors is None:
            from transport import TensorChannel

            self._tensors = TensorChannel(self.group, self.src, self.device)
        return self._tensors

    def _send(self, md: InputMetadata) -> InputMetadata:
        values, paths, tensors = collect(md)
        packed = self._use_packed(tensors)
        msg = {
            "version": MESSAGE_VERSION,
            "schema": SCHEMA_FINGERPRINT,
            "values": values,
            "tensors": _specs(paths, tensors),
            "packed": packed,
        }
        if packed:
            cpu = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
            self._objects.broadcast_packed(msg, cpu)
            out = _move_views_each(cpu, self.device)
        else:
            self._objects.broadcast_packed(msg, [])
            out = self._tensor_channel().broadcast(tensors)
        return _assemble(values, paths, out)

    def _receive(self) -> InputMetadata:
        from transport import CodecError

        try:
            msg, payload = self._objects.broadcast_packed(None, None)
        except CodecError as e:
            raise RuntimeError(f"rank {self.rank}: metadata message from src={self.src} rejected: {e}") from e
        _check_message(msg, self.rank)
        specs = msg["tensors"]
        paths = [s[0] for s in specs]
        if msg["packed"]:
            out = _move_views(list(payload), self.device)
        else:
            out = self._tensor_channel().broadcast([(_parse_dtype(s[1], s[0]), tuple(s[2])) for s in specs])
        if len(out) != len(paths):
            raise RuntimeError(f"rank {self.rank}: expected {len(paths)} tensors, received {len(out)}")
        return _assemble(msg["values"], paths, out)


def _move_views_each(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == "cpu":
        return tensors
    return [t.to(device, non_blocking=True) for t in tensors]


def _parse_dtype(name: Any, path: Any) -> torch.dtype:
    d = _DTYPES.get(name) if isinstance(name, str) else None
    if d is None:
        raise RuntimeError(f"{path}: unknown dtype {name!r} in metadata message")
    return d


def _assemble(values: dict[str, Any], paths: list[list[str]], tensors: list[torch.Tensor]) -> InputMetadata:
    flat = dict(values)
    for ps, t in zip(paths, tensors):
        for p in ps:
            flat[p] = t
    return InputMetadata.from_flatten_dict(flat)
