"""The in-place decode's device buffers, generated from the field table (DESIGN 12).

Which buffers exist, their dtypes and shapes come from ``InputMetadata``'s field table
(:func:`cpmeta.fields.step_outputs` of the decode step, the same source as ``prepare_decode``'s
host arena): every decode field whose first dim is ``total_q`` is a ROW buffer of ``q_cap`` rows
(per-ratio fields stacked ``[n_ratio, q_cap, ...]``), every one whose first dim is ``n_seq+1`` a
SEQUENCE buffer of ``seq_cap + 1`` entries. :func:`make_buffers` allocates what ``out`` lacks,
checks the rest, and returns the full-capacity :class:`DecodeBuffers` the kernels write plus the
``[total_q]`` prefix views the metadata holds. :class:`OutCache` keeps that result for one
``out`` dict on its staging buffer (``DecodeStaging.buffers_for``). Example: a plain config has 9
buffers (7 row, 2 sequence); ``MetadataConfig.compressed_swa()`` 16 (14 row: 4 of them stacked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ..buffers import get_or_create_stacked, get_or_create_tensor
from ..cache import BoundedCache
from ..config import MetadataConfig
from ..fields import DECODE, FieldTable, step_outputs
from ..metadata import FIELDS
from .staging_header import StagedDecode

__all__ = ["DecodeBuffers", "OutCapacity", "OutCache", "RowSpec", "row_specs", "make_buffers", "capacity_of", "same_device"]

Out = Optional[dict[str, torch.Tensor]]

#: Prefix-view sets kept per ``out`` (one per distinct (n_seq, total_q); slicing ~25 views each
#: step costs ~20 us of host time).
MAX_CACHED_VIEWS = 256


@dataclass(frozen=True, slots=True)
class OutCapacity:
    """What the device buffers fed from one staging buffer can hold (DESIGN section 12, capacity).

    ``q_cap`` rows, ``seq_cap`` sequences (``cu_seqlens_*`` hold ``seq_cap + 1``) and
    ``bt_cols`` block-table columns. A batch needing more of any is refused with a ``ValueError``
    naming the limit before anything reaches the device. Example: buffers captured for 4
    single-row sequences give ``OutCapacity(4, 4, 64)``; staging 8 sequences fails with
    ``"num_seqs: 8 sequences exceed the captured buffers' seq_cap=4"``.
    """

    q_cap: int
    seq_cap: int
    bt_cols: int

    def check(self, staged: StagedDecode) -> None:
        """``ValueError`` naming the first limit ``staged`` exceeds (rows, sequences, columns)."""
        if staged.total_q > self.q_cap:
            raise ValueError(f"total_q: {staged.total_q} rows exceed the captured buffers' q_cap={self.q_cap}")
        if staged.num_seqs > self.seq_cap:
            raise ValueError(
                f"num_seqs: {staged.num_seqs} sequences exceed the captured buffers' seq_cap={self.seq_cap}")
        if staged.max_blocks > self.bt_cols:
            raise ValueError(
                f"block_tables: {staged.max_blocks} columns exceed the captured buffers' "
                f"bt_cols={self.bt_cols} (a different max_model_len?)")


class DecodeBuffers:
    """Full-capacity output tensors the kernels write, by field name (``q_cap`` rows, ``seq_cap``
    sequences): ``bufs["positions"]``; ``bufs.get("klen")`` is ``None`` for a switched-off feature
    (never written, DESIGN 14).

    Rows ``[total_q, q_cap)`` and ``cu_seqlens_*[n_seq+1 : seq_cap+1]`` are the TAIL: the
    kernels fill it with inert values (positions 0, input id 0, ngram pad, not valid, query index
    998244353, every slot -1, lengths 0, offsets 0; ``cu_seqlens_q/k`` repeat ``total_q/total_k``)
    so a graph captured at a larger batch never writes KV or reads keys for padded rows.
    ``block_tables`` tail rows are left untouched (their lengths are 0, nothing reads them).
    Stacked fields are ``[n_ratio, q_cap, ...]`` (ratios of the field's set, config order).
    """

    __slots__ = ("tensors", "seq_names", "q_cap", "seq_cap")

    def __init__(self, tensors: Mapping[str, torch.Tensor],
                 seq_names: tuple[str, ...] = ("cu_seqlens_q", "cu_seqlens_k")) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        #: the sequence buffers (``[seq_cap + 1]``); every other one is a row buffer
        self.seq_names = seq_names
        self.q_cap = int(self.tensors["positions"].shape[0])
        self.seq_cap = int(self.tensors["cu_seqlens_q"].shape[0]) - 1

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors.get(name)

    def capacity(self) -> OutCapacity:
        return OutCapacity(self.q_cap, self.seq_cap, self.tensors["block_tables"].shape[1])


#: A row buffer: (shape after the row dim, dtype, ratio keys if stacked else None).
RowSpec = tuple[tuple[int, ...], torch.dtype, Optional[tuple[str, ...]]]


def row_specs(cfg: MetadataConfig, table: FieldTable = FIELDS) -> tuple[dict[str, RowSpec], dict[str, torch.dtype]]:
    """``(row buffers, sequence buffers)`` of the decode step for ``cfg``, from the field table:
    name -> :data:`RowSpec` for the ``total_q``-row fields, name -> dtype for the ``n_seq+1``
    ones. Example: plain config -> 7 row buffers (``block_tables``: ``((max_num_blocks,), int32,
    None)``) and ``cu_seqlens_q`` / ``cu_seqlens_k``."""
    rows: dict[str, RowSpec] = {}
    seqs: dict[str, torch.dtype] = {}
    for spec in step_outputs(table, cfg, DECODE):
        # fixed buffers: block_tables at its most columns (the host builder narrows it to the batch)
        first, rest = spec.shape[0], tuple(cfg.max_num_blocks if d == "table_width" else d for d in spec.shape[1:])
        if first == "total_q" and all(isinstance(d, int) for d in rest):
            rows[spec.name] = (tuple(int(d) for d in rest), spec.dtype, spec.keys)
        elif spec.shape == ("n_seq+1",):
            seqs[spec.name] = spec.dtype
        else:
            raise ValueError(f"{spec.name}: the in-place decode has no buffer for shape {spec.shape}")
    return rows, seqs


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _ensure(out: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """``out[name]`` (allocated with ``shape`` on ``device`` if missing), device and layout checked."""
    if name not in out:
        out[name] = torch.empty(shape, dtype=dtype, device=device)
    t = out[name]
    if not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device} in out")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor in out")
    return t


def make_buffers(out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int, device: torch.device,
                 table: FieldTable = FIELDS) -> tuple[DecodeBuffers, dict[str, Any]]:
    """Full-capacity buffers (allocated into ``out`` where missing) and the ``[total_q]`` views.

    Every row buffer must have the same row capacity ``q_cap`` (the kernels take one), and the
    sequence buffers the same ``seq_cap + 1``; a mismatch is a ``ValueError`` naming the field.
    Views of switched-off fields are ``None``.
    """
    rows, seqs = row_specs(cfg, table)
    full: dict[str, torch.Tensor] = {}
    views: dict[str, Any] = {}
    q_cap: Optional[int] = None
    for name, (rest, dtype, keys) in rows.items():
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
    seq_cap: Optional[int] = None
    for name, dtype in seqs.items():
        full[name] = t = _ensure(out, name, (n_seq + 1,), dtype, device)
        views[name] = get_or_create_tensor(out, name, (n_seq + 1,), dtype, allow_prefix=True)
        if seq_cap is not None and t.shape[0] != seq_cap:
            raise ValueError(f"{name}: expected the same capacity as cu_seqlens_q in out")
        seq_cap = t.shape[0]
    return DecodeBuffers(full, tuple(seqs)), views  # switched-off fields: absent, None in the metadata


@dataclass(slots=True)
class OutCache:
    """The checked :class:`DecodeBuffers` of one ``out`` dict, kept on its ``DecodeStaging``.

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
    views: BoundedCache[tuple[int, int], dict[str, Any]] = field(
        default_factory=lambda: BoundedCache(MAX_CACHED_VIEWS))  # (n_seq, total_q) -> prefix views
    graph: Optional["torch.cuda.CUDAGraph"] = None  # the two kernels, captured (CUDA + triton only)
    graph_key: tuple = ()  # (staging device buffer address, size, backend) the graph reads

    def fits(self, out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int,
             device: torch.device) -> bool:
        """This cache serves ``out`` for a batch of ``n_seq`` / ``total_q``."""
        return (self.out_id == id(out) and self.cfg is cfg and self.device == device
                and self.key == tuple(map(id, out.values())) and total_q <= self.bufs.q_cap
                and n_seq <= self.bufs.seq_cap)

    def prefix_views(self, n_seq: int, total_q: int) -> dict[str, Any]:
        """The metadata's views of the first ``n_seq`` / ``total_q`` (fresh dicts for dict fields)."""
        views = self.views.get((n_seq, total_q))
        if views is None:
            views = self.views.put((n_seq, total_q), _cut(self.bufs, self.keys, n_seq, total_q))
        return {k: dict(v) if isinstance(v, dict) else v for k, v in views.items()}

    @staticmethod
    def make(out: dict[str, torch.Tensor], cfg: MetadataConfig, n_seq: int, total_q: int,
             device: torch.device) -> tuple["OutCache", dict[str, Any]]:
        """:func:`make_buffers` and a cache of its result (with the views of this batch)."""
        bufs, views = make_buffers(out, cfg, n_seq, total_q, device)
        keys = {name: tuple(v) for name, v in views.items() if isinstance(v, dict)}
        return OutCache(id(out), tuple(map(id, out.values())), cfg, device, bufs, keys), views


def _cut(bufs: DecodeBuffers, keys: dict[str, tuple[str, ...]], n_seq: int, total_q: int) -> dict[str, Any]:
    """Prefix views ``[:total_q]`` (sequence buffers ``[:n_seq+1]``; stacked: ``{key: t[i, :total_q]}``)."""
    views: dict[str, Any] = {}
    for name, t in bufs.tensors.items():
        if name in keys:
            views[name] = {k: t[i, :total_q] for i, k in enumerate(keys[name])}
        elif name in bufs.seq_names:
            views[name] = t[: n_seq + 1]
        else:
            views[name] = t[:total_q]
    return views


def capacity_of(out: Out) -> Optional[OutCapacity]:
    """Limits of the buffers already in ``out`` (None while it lacks one the kernels index by:
    missing buffers are allocated at the batch's own size)."""
    if not out or not all(k in out for k in ("positions", "cu_seqlens_q", "block_tables")):
        return None
    bt = out["block_tables"]
    return OutCapacity(out["positions"].shape[0], out["cu_seqlens_q"].shape[0] - 1,
                       bt.shape[1] if bt.dim() == 2 else 0)
