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

import ctypes
import hashlib
import logging
from dataclasses import fields
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import envs
from ..metadata import InputMetadata

__all__ = ["MetadataBroadcaster", "SCHEMA_FINGERPRINT", "MESSAGE_VERSION"]

logger = logging.getLogger(__name__)

#: Version of the broadcaster's message layout (on top of the codec's own protocol version).
MESSAGE_VERSION = 3

#: Wire code of a dtype = its index here (append only: the codes are part of the message layout).
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
_DTYPE_CODE: dict[torch.dtype, int] = {d: i for i, d in enumerate(WIRE_DTYPES)}
_ELEMENT_SIZE: tuple[int, ...] = tuple(torch.empty(0, dtype=d).element_size() for d in WIRE_DTYPES)
#: Packed tensors start at multiples of this many bytes inside the coalesced buffer.
PACK_ALIGN = 16
#: Separators of the tensor-path string: ``"positions,positions_cp;klen.4"`` (no field or ratio
#: key contains them).
_TENSOR_SEP, _ALIAS_SEP = ";", ","


def _schema_fingerprint() -> str:
    """sha256 over InputMetadata's field names and declared types (16 hex digits)."""
    desc = ";".join(f"{f.name}:{f.type}" for f in fields(InputMetadata))
    return hashlib.sha256(f"v{MESSAGE_VERSION}|{desc}".encode()).hexdigest()[:16]


SCHEMA_FINGERPRINT: str = _schema_fingerprint()


def collect(md: InputMetadata) -> tuple[dict[str, Any], list[list[str]], list[torch.Tensor]]:
    """Split ``md`` by path into non-tensor values and deduplicated tensors.

    Returns ``(values, tensor_paths, tensors)``: ``values`` maps each non-tensor path to its
    value (scalars, str, an empty dict; ``None`` fields are left out, the receiver's default);
    ``tensors[i]`` is reachable at every path in ``tensor_paths[i]``. Example: with
    ``positions_cp is positions`` the result holds one tensor with paths
    ``["positions", "positions_cp"]``.
    """
    values: dict[str, Any] = {}
    paths: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def put(path: str, v: Any) -> None:
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

    for name in InputMetadata.field_names():
        v = getattr(md, name)
        if v is None:
            continue
        if type(v) is dict:
            if not v:
                values[name] = {}
            for k, x in v.items():
                if type(x) is dict:
                    raise TypeError(f"{name}.{k}: nested dicts are not supported (one level only)")
                put(f"{name}.{k}", x)
        else:
            put(name, v)
    return values, paths, tensors


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], list[int], list[int], list[int], int]:
    """Wire description of ``tensors``: dtype codes, flat shapes, ndims, packed byte offsets, total.

    Tensors of one dtype that follow each other are packed back to back (so a receiver can
    split the run with one call); each run starts at a multiple of ``PACK_ALIGN``. Example: an
    int32 [3], an int32 [2, 2] and a bool [2] give codes ``[4, 4, 0]``, shapes ``[3, 2, 2, 2]``,
    ndims ``[1, 2, 1]``, offsets ``[0, 12, 32]`` (the bool run starts at 28 rounded up to 32),
    total 48.
    """
    codes, shapes, ndims, offsets = [], [], [], []
    pos, prev = 0, -1
    for t in tensors:
        code = _DTYPE_CODE.get(t.dtype)
        if code is None:
            raise TypeError(f"dtype {t.dtype} cannot be broadcast (supported: {WIRE_DTYPES})")
        if code != prev:
            pos = -(-pos // PACK_ALIGN) * PACK_ALIGN
            prev = code
        codes.append(code)
        shapes.extend(t.shape)
        ndims.append(t.dim())
        offsets.append(pos)
        pos += t.nbytes
    return codes, shapes, ndims, offsets, -(-pos // PACK_ALIGN) * PACK_ALIGN


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


def _pack(tensors: list[torch.Tensor], offsets: list[int], total: int, buf: Optional[torch.Tensor]
          ) -> torch.Tensor:
    """Copy CPU ``tensors`` into one uint8 buffer at ``offsets`` (``buf`` reused when big enough)."""
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 4096), dtype=torch.uint8)
    base = buf.data_ptr()
    for t, off in zip(tensors, offsets):
        n = t.nbytes
        if n:
            t = t if t.is_contiguous() else t.contiguous()
            ctypes.memmove(base + off, t.data_ptr(), n)
    return buf


def _unpack(buf: torch.Tensor, codes: list[int], shapes: list[int], ndims: list[int],
            offsets: list[int]) -> list[torch.Tensor]:
    """Views of ``buf`` (uint8, 16-byte aligned start) with the original dtypes and shapes.

    A run of same-dtype tensors packed back to back becomes views with ONE ``view(dtype)`` and
    ONE ``split`` (a C++ loop; a Python-level view per tensor costs several microseconds); only
    tensors that are not 1-D need one more ``view(shape)``. Example: int32 [3] at 0 and int32
    [2, 2] at 12 give ``buf[0:28].view(int32).split([3, 4])``, the second chunk viewed [2, 2].
    """
    dims, numels, at = [], [], 0
    for nd in ndims:
        d = shapes[at:at + nd]
        at += nd
        dims.append(d)
        numels.append(_numel(d))
    if buf.data_ptr() % PACK_ALIGN or buf.numel() % PACK_ALIGN:  # unaligned: small copies
        return [buf[off:off + k * _ELEMENT_SIZE[c]].clone().view(WIRE_DTYPES[c]).view(d)
                for c, off, k, d in zip(codes, offsets, numels, dims)]
    out: list[torch.Tensor] = []
    i, n = 0, len(codes)
    while i < n:
        esz = _ELEMENT_SIZE[codes[i]]
        j, end = i, offsets[i] + numels[i] * esz
        while j + 1 < n and codes[j + 1] == codes[i] and offsets[j + 1] == end:
            j += 1
            end += numels[j] * esz
        chunks = buf[offsets[i]:end].view(WIRE_DTYPES[codes[i]]).split(numels[i:j + 1])
        for k, t in zip(range(i, j + 1), chunks):
            out.append(t if len(dims[k]) == 1 else t.view(dims[k]))
        i = j + 1
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _to_device(tensors: list[torch.Tensor], buf: Optional[torch.Tensor], offsets: list[int],
               device: torch.device) -> list[torch.Tensor]:
    """Move packed tensors to ``device`` with ONE copy of the coalesced buffer (views kept)."""
    if device.type == "cpu" or not tensors:
        return tensors
    assert buf is not None
    dev = buf.to(device, non_blocking=True)
    return [dev[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip(tensors, offsets)]


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
        self._pack_buf: Optional[torch.Tensor] = None  # driver's reusable coalescing buffer
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

            self._tensors = TensorChannel(self.group, self.src, self.device,
                                          timeout=self._objects.timeout)
        return self._tensors

    def _send(self, md: InputMetadata) -> InputMetadata:
        values, paths, tensors = collect(md)
        order = sorted(range(len(tensors)), key=lambda i: _DTYPE_CODE.get(tensors[i].dtype, -1))
        paths, tensors = [paths[i] for i in order], [tensors[i] for i in order]  # dtype runs
        codes, shapes, ndims, offsets, total = _layout(tensors)
        packed = self._use_packed(tensors)
        msg = {
            "version": MESSAGE_VERSION,
            "schema": SCHEMA_FINGERPRINT,
            "values": values,
            "paths": _TENSOR_SEP.join(_ALIAS_SEP.join(p) for p in paths),
            "dtypes": codes,
            "shapes": shapes,
            "ndims": ndims,
            "offsets": offsets,
            "packed": packed,
        }
        if packed:
            cpu = [t if t.device.type == "cpu" else t.cpu() for t in tensors]
            self._pack_buf = _pack(cpu, offsets, total, self._pack_buf)
            self._objects.broadcast_packed(msg, [self._pack_buf[:total]])
            out = _to_device(cpu, self._pack_buf[:total], offsets, self.device)
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
        try:
            paths, codes, shapes, ndims, offsets = _parse_layout(msg)
            if msg["packed"]:
                buf = payload[0] if payload else torch.empty(0, dtype=torch.uint8)
                _check_packed_bounds(buf, codes, shapes, ndims, offsets)
                out = _unpack(buf, codes, shapes, ndims, offsets)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
            raise RuntimeError(f"rank {self.rank}: malformed metadata message from src={self.src}: "
                               f"{type(e).__name__}: {e}") from None
        if msg["packed"]:
            out = _to_device(out, buf, offsets, self.device)
        else:
            specs, at = [], 0
            for c, nd in zip(codes, ndims):
                specs.append((WIRE_DTYPES[c], tuple(shapes[at:at + nd])))
                at += nd
            out = self._tensor_channel().broadcast(specs)
        if len(out) != len(paths):
            raise RuntimeError(f"rank {self.rank}: expected {len(paths)} tensors, received {len(out)}")
        try:
            return _assemble(msg["values"], paths, out)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise RuntimeError(f"rank {self.rank}: malformed metadata message from src={self.src}: "
                               f"{type(e).__name__}: {e}") from None


def _parse_layout(msg: dict) -> tuple[list[list[str]], list[int], list[int], list[int], list[int]]:
    """Type-check the tensor layout lists of a received message (untrusted input)."""
    p, codes, shapes, ndims, offsets = (msg["paths"], msg["dtypes"], msg["shapes"], msg["ndims"],
                                        msg["offsets"])
    if type(p) is not str or type(msg["packed"]) is not bool or type(msg["values"]) is not dict:
        raise TypeError("paths/packed/values have the wrong types")
    for name, xs in (("dtypes", codes), ("shapes", shapes), ("ndims", ndims), ("offsets", offsets)):
        if type(xs) is not list or any(type(x) is not int or x < 0 for x in xs):
            raise TypeError(f"{name}: expected a list of non-negative ints")
    paths = [q.split(_ALIAS_SEP) for q in p.split(_TENSOR_SEP)] if p else []
    if not (len(paths) == len(codes) == len(ndims) == len(offsets)) or sum(ndims) != len(shapes):
        raise ValueError("tensor layout lists disagree in length")
    if any(c >= len(WIRE_DTYPES) for c in codes):
        raise ValueError(f"unknown dtype code in {codes}")
    return paths, codes, shapes, ndims, offsets


def _check_packed_bounds(buf: torch.Tensor, codes: list[int], shapes: list[int], ndims: list[int],
                         offsets: list[int]) -> None:
    """Every packed tensor must lie inside the received buffer at an aligned offset."""
    at = 0
    for c, nd, off in zip(codes, ndims, offsets):
        numel = 1
        for d in shapes[at:at + nd]:
            numel *= d
        at += nd
        esz = _ELEMENT_SIZE[c]
        if off % esz or off + numel * esz > buf.numel():
            raise ValueError(f"packed tensor at offset {off} ({numel} x {WIRE_DTYPES[c]}) "
                             f"outside the {buf.numel()}-byte payload")


def _assemble(values: dict[str, Any], paths: list[list[str]], tensors: list[torch.Tensor]) -> InputMetadata:
    kwargs: dict[str, Any] = {}
    for key, v in values.items():
        name, dot, sub = key.partition(".")
        if dot:
            kwargs.setdefault(name, {})[sub] = v
        else:
            kwargs[name] = v
    for ps, t in zip(paths, tensors):
        for key in ps:
            name, dot, sub = key.partition(".")
            if dot:
                kwargs.setdefault(name, {})[sub] = t
            else:
                kwargs[name] = t
    try:
        return InputMetadata(**kwargs)
    except TypeError as e:
        raise RuntimeError(f"metadata message names an unknown field: {e}") from None
