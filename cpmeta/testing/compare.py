"""Field-by-field comparison for :mod:`cpmeta.testing`: :func:`assert_same` (two values in one
process) and :func:`assert_same_on_ranks` (collective: every rank's value against rank ``src``'s,
over the group's own collectives, no pickle).

Example: ``assert_same({"p": torch.tensor([0, 1, 5])}, {"p": torch.tensor([0, 1, 2])})`` raises
``AssertionError: 'p' differs from expected: 1 of 3 elements, first at index (2,): 5 here, 2 on
expected``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Optional

import numpy as np
import torch

__all__ = ["assert_same", "assert_same_on_ranks"]

_ALIASING = "<aliasing>"  # the pseudo-field: which paths hold one tensor object


def _flatten(value: Any) -> dict[str, Any]:
    """Leaves by dotted path: a dataclass's fields, a dict's keys, a list's or tuple's indices;
    tensors, scalars and empty containers are leaves; ``<aliasing>`` lists the paths that share
    one tensor object. Example: ``{"klen": {"4": t}, "n": 2}`` -> ``{"klen.4": t, "n": 2,
    "<aliasing>": []}``."""
    flat: dict[str, Any] = {}

    def walk(path: str, v: Any) -> None:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            items: list[tuple[Any, Any]] = [(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)]
        elif isinstance(v, dict):
            items = list(v.items())
        elif isinstance(v, (list, tuple)):
            items = list(enumerate(v))
        else:
            if isinstance(v, torch.Tensor) and (v.layout != torch.strided or v.is_nested or v.is_meta):
                kind = "meta" if v.is_meta else "nested" if v.is_nested else str(v.layout).replace("torch.", "")
                raise TypeError(f"{path or 'value'}: a {kind} tensor has no bytes to compare (dense tensors "
                                "with data only)")
            flat[path] = v
            return
        if not items and path:
            flat[path] = v  # an empty container is information (absent keys)
        for k, x in items:
            walk(f"{path}.{k}" if path else str(k), x)

    walk("", value)
    groups: dict[int, list[str]] = {}
    for path, v in flat.items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), []).append(path)
    flat[_ALIASING] = sorted(g for g in groups.values() if len(g) > 1)
    return flat


def _digest(v: Any) -> str:
    """64-bit BLAKE2b (hex) of a leaf: a tensor's dtype, shape and bytes, else its type and repr."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{type(v).__name__}:{v!r}".encode())
    return h.hexdigest()


def _leaf_diff(got: Any, want: Any, other: str) -> Optional[str]:
    """How leaf ``got`` (here) differs from ``want`` (on ``other``), or None when bit-identical."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        a, b = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{tuple(a.shape)} here, {b.dtype}{tuple(b.shape)} on {other}"
        # bitwise, element by element (NaN payloads and -0.0 count): compare each element's bytes
        width = a.element_size()
        bad = (a.reshape(-1).view(torch.uint8).reshape(-1, width)
               != b.reshape(-1).view(torch.uint8).reshape(-1, width)).any(dim=1).nonzero()
        if bad.numel() == 0:
            return None
        i = int(bad[0])
        index = tuple(int(x) for x in np.unravel_index(i, tuple(a.shape))) if a.dim() else ()
        return (f"{bad.shape[0]} of {a.numel()} elements, first at index {index}: "
                f"{a.reshape(-1)[i].item()!r} here, {b.reshape(-1)[i].item()!r} on {other}")
    kind = want.kind if isinstance(want, _Shown) else type(want).__name__
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor) or kind != type(got).__name__:
        return f"{type(got).__name__} here, {kind} on {other}"
    if not isinstance(want, _Shown) and _digest(got) == _digest(want):
        return None
    return f"{got!r} here, {want!r} on {other}"


def assert_same(actual: Any, expected: Any) -> None:
    """Raise ``AssertionError`` unless ``actual`` and ``expected`` (``InputMetadata``, any
    dataclass, dicts / lists / tuples of tensors and plain values) are bit-identical field by
    field: same paths, tensor dtypes, shapes and bytes, equal plain values, same aliasing.

    Example: ``assert_same({"p": torch.tensor([0, 1, 5])}, {"p": torch.tensor([0, 1, 2])})``
    -> ``AssertionError: 'p' differs from expected: 1 of 3 elements, first at index (2,): 5 here,
    2 on expected``.
    """
    got, want = _flatten(actual), _flatten(expected)
    problems = []
    for path in list(want) + [p for p in got if p not in want]:
        if path not in got or path not in want:
            problems.append(f"{path!r} {'missing here' if path in want else 'not in expected'}")
            continue
        why = _leaf_diff(got[path], want[path], "expected")
        if why is not None:
            problems.append(f"{path!r} differs from expected: {why}")
    if problems:
        raise AssertionError("; ".join(problems))


def assert_same_on_ranks(value: Any, *, src: int = 0, group: Any = None) -> None:
    """Collective: every rank of ``group`` (default: the whole world) calls it with what it holds;
    raises the SAME ``AssertionError`` on every rank unless every rank's ``value`` is
    bit-identical, field by field (as :func:`assert_same`), to rank ``src``'s (``src`` is a rank
    of ``group``, as are the ranks named in the message).

    Cost when every rank agrees: one broadcast of ``src``'s table of per-field 64-bit digests and
    one all-gather of each rank's differing fields (two collectives each: length, then bytes).
    Otherwise ``src`` then broadcasts the values of the differing fields only, every rank names its
    differences (field, first differing index, both values) and the messages are all-gathered.
    Per-rank example, 2 ranks, rank 1 holding ``{"positions": tensor([0, 1, 9])}`` where rank 0
    holds ``tensor([0, 1, 2])``: both ranks raise ``rank 1: 'positions' differs from rank 0's:
    1 of 3 elements, first at index (2,): 9 here, 2 on rank 0``. A tensor without bytes to
    compare (sparse, nested, meta) on any rank is a ``TypeError`` naming it on every rank.
    """
    import torch.distributed as dist

    me, size = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= src < size:
        raise ValueError(f"src: expected a rank of the group in [0, {size}), got {src}")
    wire = _Bytes(group, src if group is None else dist.get_global_rank(group, src), size)
    try:
        flat = _flatten(value)
        table = {p: _digest(v) for p, v in flat.items()}
        refused = ""
    except TypeError as e:  # (a tensor without bytes): raised on EVERY rank, none left waiting
        flat, table, refused = {}, {}, f"rank {me}: {e}"
    refusals = [m.decode() for m in wire.gather(refused.encode())]
    if any(refusals):
        raise TypeError("; ".join(m for m in refusals if m))
    theirs: dict[str, str] = json.loads(wire.bcast(json.dumps(table).encode() if me == src else None))
    differing = [p for p in theirs if table.get(p) != theirs[p]] + [p for p in table if p not in theirs]
    union: list[str] = []
    for blob in wire.gather(json.dumps(differing).encode()):
        union += [p for p in json.loads(blob) if p not in union]
    if not union:
        return
    problems = []
    for path in union:  # the same paths in the same order on every rank
        if path not in theirs:
            problems += [f"rank {me}: {path!r} not on rank {src}"] if path in differing else []
            continue
        want = _leaf_from_src(wire, flat[path] if me == src else None, me == src)
        if path not in differing:
            continue
        if path not in flat:
            problems.append(f"rank {me}: {path!r} missing here (rank {src} has it)")
        else:
            problems.append(f"rank {me}: {path!r} differs from rank {src}'s: "
                            f"{_leaf_diff(flat[path], want, f'rank {src}')}")
    messages = [m.decode() for m in wire.gather("; ".join(problems).encode())]
    raise AssertionError("; ".join(m for m in messages if m))


class _Bytes:
    """Bytes over the group's collectives (a length, then a uint8 tensor on the backend's device:
    CUDA for NCCL); no pickle."""

    def __init__(self, group: Any, src_global: int, size: int) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.src, self.size = dist, group, src_global, size
        nccl = "nccl" in str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _tensor(self, data: bytes) -> torch.Tensor:
        if not data:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def _count(self, n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int64, device=self.device)

    def bcast(self, data: Optional[bytes]) -> bytes:
        """``src`` passes the bytes, every other rank ``None``; every rank returns them."""
        n = self._count(len(data) if data is not None else 0)
        self.dist.broadcast(n, self.src, group=self.group)
        buf = self._tensor(data) if data is not None else torch.empty(int(n), dtype=torch.uint8, device=self.device)
        if int(n):
            self.dist.broadcast(buf, self.src, group=self.group)
        return bytes(buf.cpu().numpy())

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, on every rank."""
        sizes = [self._count(0) for _ in range(self.size)]
        self.dist.all_gather(sizes, self._count(len(data)), group=self.group)
        width = max(int(n) for n in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = self._tensor(data)
        bufs = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.dist.all_gather(bufs, mine, group=self.group)
        return [bytes(b[:int(n)].cpu().numpy()) for b, n in zip(bufs, sizes)]


class _Shown:
    """A non-tensor leaf of another rank, as its type name and ``repr`` (compared by digest)."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind, self.text = kind, text

    def __repr__(self) -> str:
        return self.text


def _leaf_from_src(wire: _Bytes, leaf: Any, is_src: bool) -> Any:
    """``src``'s leaf on every rank: a tensor as a JSON header (dtype, shape) then its bytes,
    another value as its type name and ``repr``. Every rank calls it for the same paths."""
    head = None
    if is_src:
        head = ({"dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
                if isinstance(leaf, torch.Tensor) else {"kind": type(leaf).__name__, "repr": repr(leaf)})
    h = json.loads(wire.bcast(json.dumps(head).encode() if is_src else None))
    if "repr" in h:
        return _Shown(h["kind"], h["repr"])
    data = wire.bcast(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if is_src else None)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, h["dtype"])) \
        .reshape(h["shape"]) if data else torch.empty(h["shape"], dtype=getattr(torch, h["dtype"]))
