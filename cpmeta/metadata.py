"""``InputMetadata``: every tensor an attention step needs, plus container operations.

Fields are grouped as in DESIGN section 4 (common / prompt / decode), 5 (expanded, derived),
8 (CP mirror) and 10 (YoCo). A field that does not apply to the path or config is ``None``.
Dict-valued fields are keyed by the ratio's decimal string (``"4"``, ``"128"``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional

import torch

__all__ = [
    "InputMetadata",
    "DERIVED_FIELDS",
    "SCALAR_FIELDS",
]

Tensor = torch.Tensor
TDict = Optional[dict[str, torch.Tensor]]

#: Fields filled by ``compute_attn_info`` (reset by ``get_clean_list`` before graph replay).
DERIVED_FIELDS: tuple[str, ...] = ("kv_ca_index_len", "kv_swa_index", "kv_ca_index", "kv_swa_full_index")


@dataclass(slots=True)
class InputMetadata:
    """Attention metadata of one engine step (CPU tensors unless moved).

    Rows are query rows in varlen order (sequences concatenated); ``total_q = sum(seqlen_q)``.
    """

    # ---- scalars -------------------------------------------------------------------------
    is_prompt: Optional[bool] = None
    num_seqs: Optional[int] = None
    total_q: Optional[int] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None

    # ---- common (prompt and decode) -------------------------------------------------------
    positions: Optional[Tensor] = None  # [total_q] int32, absolute position of each query row
    input_ids: Optional[Tensor] = None  # [total_q] int32, token id fed at each row
    gate_force_random: Optional[Tensor] = None  # [total_q] bool, = cfg.force_load_balance
    ngram_token_ids: Optional[Tensor] = None  # [total_q, max_ngram_size] int32, Engram look-back
    cu_seqlens_q: Optional[Tensor] = None  # [n_seq+1] int32, exclusive prefix sums of seqlen_q
    cu_seqlens_k: Optional[Tensor] = None  # [n_seq+1] int32, exclusive prefix sums of seqlen_k
    valid_token_mask: Optional[Tensor] = None  # [total_q] bool, not a placeholder (nor a CP pad row)
    query_indices: Optional[Tensor] = None  # [total_q] int32, sequence index or 998244353
    positions_c: TDict = None  # {n: [rows_n] int32} position of each compressed token written
    slot_mapping_store_ca: TDict = None  # {n: [rows_n] int32} compressed-KV write slot or -1
    slot_mapping_store_swa: Optional[Tensor] = None  # [total_q] int32, SWA ring write slot or -1

    # ---- prompt only ----------------------------------------------------------------------
    cu_compressed_seqlens_q: TDict = None  # {n: [n_seq+1] int32} prefix sums of compressed rows
    state_block_idx: Optional[Tensor] = None  # prompt [n_seq] / decode [total_q] int32, state_id
    total_k_swa: Optional[int] = None  # n_seq * W rows of SWA history buffer
    load_segments_swa: Optional[Tensor] = None  # [num_segments, 4] int32 (src, begin, end, dst)
    cu_compressed_seqlens_k: TDict = None  # {n: [n_seq+1] int32} prefix sums of max(1, seqlen_k//n)
    load_segments_ca: TDict = None  # {n: [num_segments, 4] int32} paged compressed-KV load plan
    total_k_compressed: Optional[dict[str, int]] = None  # {n: int} = cu_compressed_seqlens_k[n][-1]
    ks: TDict = None  # {r: [total_q] int32} first visible compressed key of each row (sparse r)
    ke: TDict = None  # {r: [total_q] int32} one past the last visible compressed key (sparse r)
    kv_ca_index_offset_len: TDict = None  # {n: [total_q, 2] int32} (offset, len) per dense n
    kv_swa_full_index_pivots: Optional[Tensor] = None  # [total_q, 4] int32 (P0, P1, P2, P3)
    seq_block_tables: Optional[Tensor] = None  # [n_seq, max len(block_table)] int32, whole tables, -1 pad

    # ---- decode only ----------------------------------------------------------------------
    context_lens: Optional[Tensor] = None  # [total_q] int32, pos + 1
    klen: TDict = None  # {r: [total_q] int32} (pos + 1) // r
    kv_swa_index_offset_len: Optional[Tensor] = None  # [total_q, 2] int32 (ring start slot, w)
    block_tables: Optional[Tensor] = None  # [total_q, max_num_blocks] int32, row = sequence's table

    # ---- derived by compute_attn_info (section 5) ------------------------------------------
    kv_ca_index: TDict = None  # {n: [rows, width_n] int32} compressed-KV index, -1 past len
    kv_ca_index_len: TDict = None  # {n: [rows] int32} valid entries of kv_ca_index[n]
    kv_swa_full_index: Optional[Tensor] = None  # prompt [rows, W] int32, SWA buffer rows or -1
    kv_swa_index: Optional[Tensor] = None  # decode [total_q, W] int32, SWA ring slots or -1

    # ---- context-parallel mirror (section 8) -----------------------------------------------
    cp_rank: Optional[int] = None
    cp_size: Optional[int] = None
    cp_mirror_len: Optional[int] = None  # 2 * sum_s cdiv(seqlen_q, 2 * cp_size)
    mirror_cp_index: Optional[Tensor] = None  # [cp_mirror_len] int32, global row or -1 (pad)
    mirror_cp_reverse_index: Optional[Tensor] = None  # [total_q] int32, row in rank-major gather
    positions_cp: Optional[Tensor] = None  # [total_q] int32, the full-layout positions
    gate_force_random_cp: Optional[Tensor] = None  # [cp_mirror_len] bool, gathered gate flag

    # ---- YoCo (section 10) -----------------------------------------------------------------
    yoco_mask_swa_index_pivots: Optional[Tensor] = None  # [total_q, 4] int32, mask-mode pivots
    yoco_consumer_cu_seqlens_q: Optional[Tensor] = None  # [n_seq+1] int32, sums of keep_len
    yoco_consumer_total_q: Optional[int] = None  # total kept rows (total_q_c)
    yoco_consumer_query_indices: Optional[Tensor] = None  # [total_q_c] int32, full-layout row
    yoco_consumer_positions: Optional[Tensor] = None  # [total_q_c] int32
    yoco_consumer_slot_mapping_store_swa: Optional[Tensor] = None  # [total_q_c] int32
    yoco_consumer_ks: TDict = None  # {r: [total_q_c] int32}
    yoco_consumer_ke: TDict = None  # {r: [total_q_c] int32}
    yoco_consumer_kv_ca_index_offset_len: TDict = None  # {n: [total_q_c, 2] int32}
    yoco_consumer_kv_swa_full_index_pivots: Optional[Tensor] = None  # [total_q_c, 4] int32
    yoco_consumer_cp_mirror_len: Optional[int] = None  # 2 * sum_s cdiv(keep_len, 2p)
    yoco_consumer_cp_contrib_pad_len: Optional[int] = None  # max kept rows of a rank (full mirror)
    yoco_cp_contrib_index: Optional[Tensor] = None  # [contrib_pad_len] int32, -1 padded
    yoco_cp_boundary_index: Optional[Tensor] = None  # [yoco_consumer_cp_mirror_len] int32, -1 pad

    # ---- container operations ---------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return _FIELD_NAMES

    def to_flatten_dict(self) -> dict[str, Any]:
        """Flatten one level: ``{"klen": {"4": t}}`` becomes ``{"klen.4": t}``.

        ``None`` values and an EMPTY dict are kept under the field's own name (the absence of
        keys is information). A dict nested two levels deep is a ``TypeError`` naming the path.
        """
        flat: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            v = getattr(self, name)
            if isinstance(v, dict):
                if not v:
                    flat[name] = {}
                    continue
                for k, x in v.items():
                    if not isinstance(k, str) or "." in k:
                        raise TypeError(f"{name}: dict key {k!r} must be a str without '.'")
                    if isinstance(x, dict):
                        raise TypeError(f"{name}.{k}: nested dicts are not supported (one level only)")
                    flat[f"{name}.{k}"] = x
            else:
                flat[name] = v
        return flat

    @classmethod
    def from_flatten_dict(cls, flat: dict[str, Any]) -> "InputMetadata":
        """Inverse of :meth:`to_flatten_dict` (keys split at the first ``.``)."""
        kwargs: dict[str, Any] = {}
        for key, v in flat.items():
            name, dot, sub = key.partition(".")
            if name not in _FIELD_SET:
                raise KeyError(f"{key}: InputMetadata has no field {name!r}")
            if dot:
                d = kwargs.setdefault(name, {})
                if not isinstance(d, dict):
                    raise TypeError(f"{key}: field {name!r} holds both a value and dict entries")
                d[sub] = v
            else:
                if isinstance(v, dict) and v:
                    raise TypeError(f"{key}: a non-empty dict must be flattened to '{key}.<k>' keys")
                if name in kwargs:
                    raise TypeError(f"{key}: field {name!r} holds both a value and dict entries")
                kwargs[name] = {} if isinstance(v, dict) else v
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "InputMetadata":
        """A shallow copy with ``changes`` applied (the original is untouched)."""
        return dataclasses.replace(self, **changes)

    def recursive_copy_(self, other: "InputMetadata") -> "InputMetadata":
        """Copy ``other``'s tensors into this object's existing tensors (``non_blocking=True``).

        One level of dict values is followed. Scalars are not copied (callers update them).
        Fields that are ``None`` in ``other`` are skipped; a tensor in ``other`` with no
        destination here, or a shape/dtype mismatch, is a ``ValueError`` naming the path.
        """
        for name in _FIELD_NAMES:
            src = getattr(other, name)
            if src is None:
                continue
            dst = getattr(self, name)
            if isinstance(src, torch.Tensor):
                _copy_into(name, dst, src)
            elif isinstance(src, dict):
                if not any(isinstance(x, torch.Tensor) for x in src.values()):
                    continue
                if not isinstance(dst, dict):
                    raise ValueError(f"{name}: no destination dict to copy into")
                for k, x in src.items():
                    if isinstance(x, torch.Tensor):
                        _copy_into(f"{name}.{k}", dst.get(k), x)
        return self

    @staticmethod
    def get_clean_list() -> list[str]:
        """Derived fields to reset to ``None`` before replaying a captured graph on new inputs."""
        return list(DERIVED_FIELDS)

    def clean_derived_(self) -> "InputMetadata":
        """Set every field of :meth:`get_clean_list` to ``None`` (in place)."""
        for name in DERIVED_FIELDS:
            setattr(self, name, None)
        return self

    def compute_attn_info(self, cfg: Any) -> "InputMetadata":
        """Expand offsets and pivots into dense indices (DESIGN section 5); idempotent."""
        from .builders.attn_info import compute_attn_info

        compute_attn_info(self, cfg)
        return self

    def get_mask_view(self) -> "InputMetadata":
        """YoCo mask mode: shallow copy using ``yoco_mask_swa_index_pivots`` (section 10)."""
        from .cp.yoco_views import get_mask_view

        return get_mask_view(self)

    def get_consumer_view(self) -> "InputMetadata":
        """YoCo compact mode: shallow copy in the consumer row layout (section 10)."""
        from .cp.yoco_views import get_consumer_view

        return get_consumer_view(self)

    def tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield ``(path, tensor)`` for every tensor, dict entries as ``name.key``."""
        for name, v in self.to_flatten_dict().items():
            if isinstance(v, torch.Tensor):
                yield name, v

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "InputMetadata":
        """A copy with every tensor moved to ``device`` (aliasing kept)."""
        moved: dict[int, torch.Tensor] = {}

        def mv(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) not in moved:
                moved[id(t)] = t.to(device, non_blocking=non_blocking)
            return moved[id(t)]

        changes: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            v = getattr(self, name)
            if isinstance(v, dict):
                changes[name] = {k: mv(x) for k, x in v.items()}
            elif isinstance(v, torch.Tensor):
                changes[name] = mv(v)
        return dataclasses.replace(self, **changes)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(InputMetadata))
_FIELD_SET = frozenset(_FIELD_NAMES)

#: Fields whose value is a plain scalar (or a dict of scalars); never tensors.
SCALAR_FIELDS: tuple[str, ...] = (
    "is_prompt", "num_seqs", "total_q", "max_seqlen_q", "max_seqlen_k", "total_k_swa",
    "total_k_compressed", "cp_rank", "cp_size", "cp_mirror_len", "yoco_consumer_total_q",
    "yoco_consumer_cp_mirror_len", "yoco_consumer_cp_contrib_pad_len",
)


def _copy_into(path: str, dst: Any, src: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor):
        raise ValueError(f"{path}: no destination tensor to copy into (got {type(dst).__name__})")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(
            f"{path}: expected {tuple(dst.shape)} {dst.dtype} like the destination, "
            f"got {tuple(src.shape)} {src.dtype}"
        )
    dst.copy_(src, non_blocking=True)
