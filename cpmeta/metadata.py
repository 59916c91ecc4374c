"""``InputMetadata``: every tensor an attention step needs, plus container operations.

Fields are grouped as in docs/design.md section 4 (common / prompt / decode), 5 (expanded, derived),
8 (CP mirror) and 10 (YoCo). A field that does not apply to the path or config is ``None``.
Dict-valued fields are keyed by the ratio's decimal string (``"4"``, ``"128"``).

Each field is declared with its :class:`~cpmeta.fields.FieldInfo` (``tensor_field`` /
``value_field``): dtype, rank, symbolic shape, ratio set, feature switches, step kinds, who fills it
and its order after the CP mirror. :data:`FIELDS` is that table; the builders' arenas, the in-place
decode's buffers and every derived-field list are generated from it (:mod:`cpmeta.fields`).
Example: ``FIELDS["block_tables"].shape == ("total_q", "table_width")``,
``FIELDS["klen"].ratios == "sparse"``, ``DERIVED_FIELDS == ("kv_ca_index", "kv_ca_index_len",
"kv_swa_full_index", "kv_swa_index")``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional

import torch

from .fields import (
    CA, COMPRESSED_KV, CP, DECODE_ONLY, DENSE, DERIVE, ENGRAM, MIRROR, PROMPT_ONLY, RANK, SPARSE, SWA,
    YOCO_COMPACT, YOCO_MASK, FieldTable, derived_fields, field_table, tensor_field, value_field,
)

__all__ = [
    "InputMetadata",
    "FIELDS",
    "DERIVED_FIELDS",
]

Tensor = torch.Tensor
TDict = Optional[dict[str, torch.Tensor]]
I32, BOOL = torch.int32, torch.bool


@dataclass(slots=True)
class InputMetadata:
    """Attention metadata of one engine step (CPU tensors unless moved).

    Rows are query rows in varlen order (sequences concatenated); ``total_q = sum(seqlen_q)``.
    """

    # Each field's FieldInfo (cpmeta.fields) is the one table the layouts and field lists are
    # generated from; the comment repeats it for readers: [shape] dtype, meaning.

    # ---- scalars -------------------------------------------------------------------------
    is_prompt: Optional[bool] = value_field()
    num_seqs: Optional[int] = value_field()
    total_q: Optional[int] = value_field()
    max_seqlen_q: Optional[int] = value_field()
    max_seqlen_k: Optional[int] = value_field()

    # ---- common (prompt and decode) -------------------------------------------------------
    positions: Optional[Tensor] = tensor_field(  # [total_q] int32, absolute position of each query row
        I32, ("total_q",), order=RANK, pad=0)
    input_ids: Optional[Tensor] = tensor_field(I32, ("total_q",))  # [total_q] int32, token id fed at each row
    gate_force_random: Optional[Tensor] = tensor_field(BOOL, ("total_q",))  # [total_q] bool, = cfg.force_load_balance
    ngram_token_ids: Optional[Tensor] = tensor_field(  # [total_q, max_ngram_size] int32, Engram look-back
        I32, ("total_q", "max_ngram_size"), features=(ENGRAM,), order=RANK, pad=0)
    cu_seqlens_q: Optional[Tensor] = tensor_field(I32, ("n_seq+1",))  # [n_seq+1] int32, exclusive prefix sums of seqlen_q
    cu_seqlens_k: Optional[Tensor] = tensor_field(I32, ("n_seq+1",))  # [n_seq+1] int32, exclusive prefix sums of seqlen_k
    valid_token_mask: Optional[Tensor] = tensor_field(  # [total_q] bool, not a placeholder (nor a CP pad row)
        BOOL, ("total_q",), order=RANK, pad=False)
    query_indices: Optional[Tensor] = tensor_field(I32, ("total_q",))  # [total_q] int32, sequence index or 998244353
    positions_c: TDict = tensor_field(  # {n: [rows_n] int32} position of each compressed token written
        I32, ("total_q",), prompt_shape=("rows_n",), ratios=CA, features=(COMPRESSED_KV,))
    slot_mapping_store_ca: TDict = tensor_field(  # {n: [rows_n] int32} compressed-KV write slot or -1
        I32, ("total_q",), prompt_shape=("rows_n",), ratios=CA, features=(COMPRESSED_KV,))
    slot_mapping_store_swa: Optional[Tensor] = tensor_field(  # [total_q] int32, SWA ring write slot or -1
        I32, ("total_q",), features=(SWA,))

    # ---- prompt only ----------------------------------------------------------------------
    cu_compressed_seqlens_q: TDict = tensor_field(  # {n: [n_seq+1] int32} prefix sums of compressed rows
        I32, ("n_seq+1",), ratios=CA, features=(COMPRESSED_KV,), steps=PROMPT_ONLY)
    state_block_idx: Optional[Tensor] = tensor_field(  # prompt [n_seq] / decode [total_q] int32, state_id
        I32, ("total_q",), prompt_shape=("n_seq",), features=(SWA,))
    total_k_swa: Optional[int] = value_field(features=(SWA,), steps=PROMPT_ONLY)  # n_seq * W rows of SWA history buffer
    load_segments_swa: Optional[Tensor] = tensor_field(  # [num_segments, 4] int32 (src, begin, end, dst)
        I32, ("num_segments", 4), features=(SWA,), steps=PROMPT_ONLY)
    cu_compressed_seqlens_k: TDict = tensor_field(  # {n: [n_seq+1] int32} prefix sums of max(1, seqlen_k//n)
        I32, ("n_seq+1",), ratios=CA, features=(COMPRESSED_KV,), steps=PROMPT_ONLY)
    load_segments_ca: TDict = tensor_field(  # {n: [num_segments, 4] int32} paged compressed-KV load plan
        I32, ("num_segments", 4), ratios=CA, features=(COMPRESSED_KV,), steps=PROMPT_ONLY)
    total_k_compressed: Optional[dict[str, int]] = value_field(  # {n: int} = cu_compressed_seqlens_k[n][-1]
        ratios=CA, features=(COMPRESSED_KV,), steps=PROMPT_ONLY)
    ks: TDict = tensor_field(  # {r: [total_q] int32} first visible compressed key of each row (sparse r)
        I32, ("total_q",), ratios=SPARSE, features=(COMPRESSED_KV,), steps=PROMPT_ONLY, order=RANK)
    ke: TDict = tensor_field(  # {r: [total_q] int32} one past the last visible compressed key (sparse r)
        I32, ("total_q",), ratios=SPARSE, features=(COMPRESSED_KV,), steps=PROMPT_ONLY, order=RANK)
    kv_ca_index_offset_len: TDict = tensor_field(  # {n: [total_q, 2] int32} (offset, len) per dense n
        I32, ("total_q", 2), ratios=DENSE, features=(COMPRESSED_KV,))
    kv_swa_full_index_pivots: Optional[Tensor] = tensor_field(  # [total_q, 4] int32 (P0, P1, P2, P3)
        I32, ("total_q", 4), features=(SWA,), steps=PROMPT_ONLY)
    seq_block_tables: Optional[Tensor] = tensor_field(  # [n_seq, max len(block_table)] int32, whole tables, -1 pad
        I32, ("n_seq", "max_table_len"), steps=PROMPT_ONLY)

    # ---- decode only ----------------------------------------------------------------------
    context_lens: Optional[Tensor] = tensor_field(I32, ("total_q",), steps=DECODE_ONLY)  # [total_q] int32, pos + 1
    klen: TDict = tensor_field(  # {r: [total_q] int32} (pos + 1) // r
        I32, ("total_q",), ratios=SPARSE, features=(COMPRESSED_KV,), steps=DECODE_ONLY, consumer_clear=True)
    kv_swa_index_offset_len: Optional[Tensor] = tensor_field(  # [total_q, 2] int32 (ring start slot, w)
        I32, ("total_q", 2), features=(SWA,), steps=DECODE_ONLY)
    block_tables: Optional[Tensor] = tensor_field(  # [total_q, table_width] int32, row = sequence's table
        I32, ("total_q", "table_width"), steps=DECODE_ONLY)

    # ---- derived by compute_attn_info (section 5) ------------------------------------------
    kv_ca_index: TDict = tensor_field(  # {n: [rows, width_n] int32} compressed-KV index, -1 past len
        I32, ("rows", "width_n"), ratios=DENSE, features=(COMPRESSED_KV,), stage=DERIVE, order=RANK, pad=-1)
    kv_ca_index_len: TDict = tensor_field(  # {n: [rows] int32} valid entries of kv_ca_index[n]
        I32, ("rows",), ratios=DENSE, features=(COMPRESSED_KV,), stage=DERIVE, order=RANK, pad=0)
    kv_swa_full_index: Optional[Tensor] = tensor_field(  # prompt [rows, W] int32, SWA buffer rows or -1
        I32, ("rows", "W"), features=(SWA,), steps=PROMPT_ONLY, stage=DERIVE, order=RANK, pad=-1)
    kv_swa_index: Optional[Tensor] = tensor_field(  # decode [total_q, W] int32, SWA ring slots or -1
        I32, ("total_q", "W"), features=(SWA,), steps=DECODE_ONLY, stage=DERIVE)

    # ---- context-parallel mirror (section 8) -----------------------------------------------
    cp_rank: Optional[int] = value_field(features=(CP,), steps=PROMPT_ONLY, stage=MIRROR, order=RANK)
    cp_size: Optional[int] = value_field(features=(CP,), steps=PROMPT_ONLY, stage=MIRROR)
    cp_mirror_len: Optional[int] = value_field(  # 2 * sum_s cdiv(seqlen_q, 2 * cp_size)
        features=(CP,), steps=PROMPT_ONLY, stage=MIRROR)
    mirror_cp_index: Optional[Tensor] = tensor_field(  # [cp_mirror_len] int32, global row or -1 (pad)
        I32, ("cp_mirror_len",), features=(CP,), steps=PROMPT_ONLY, stage=MIRROR, order=RANK)
    mirror_cp_reverse_index: Optional[Tensor] = tensor_field(  # [total_q] int32, row in rank-major gather
        I32, ("total_q",), features=(CP,), steps=PROMPT_ONLY, stage=MIRROR)
    positions_cp: Optional[Tensor] = tensor_field(  # [total_q] int32, the full-layout positions
        I32, ("total_q",), features=(CP,), steps=PROMPT_ONLY, stage=MIRROR)
    gate_force_random_cp: Optional[Tensor] = tensor_field(  # [cp_mirror_len] bool, gathered gate flag
        BOOL, ("cp_mirror_len",), features=(CP,), steps=PROMPT_ONLY, stage=MIRROR, order=RANK, pad=False)

    # ---- YoCo (section 10) -----------------------------------------------------------------
    yoco_mask_swa_index_pivots: Optional[Tensor] = tensor_field(  # [total_q, 4] int32, mask-mode pivots
        I32, ("total_q", 4), features=(YOCO_MASK,), steps=PROMPT_ONLY)
    yoco_consumer_cu_seqlens_q: Optional[Tensor] = tensor_field(  # [n_seq+1] int32, sums of keep_len
        I32, ("n_seq+1",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="cu_seqlens_q")
    yoco_consumer_total_q: Optional[int] = value_field(  # total kept rows (total_q_c)
        features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="total_q")
    yoco_consumer_query_indices: Optional[Tensor] = tensor_field(  # [total_q_c] int32, full-layout row
        I32, ("total_q_c",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="query_indices")
    yoco_consumer_positions: Optional[Tensor] = tensor_field(  # [total_q_c] int32
        I32, ("total_q_c",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="positions")
    yoco_consumer_slot_mapping_store_swa: Optional[Tensor] = tensor_field(  # [total_q_c] int32
        I32, ("total_q_c",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="slot_mapping_store_swa")
    yoco_consumer_ks: TDict = tensor_field(  # {r: [total_q_c] int32}
        I32, ("total_q_c",), ratios=SPARSE, features=(YOCO_COMPACT, COMPRESSED_KV), steps=PROMPT_ONLY,
        replaces="ks")
    yoco_consumer_ke: TDict = tensor_field(  # {r: [total_q_c] int32}
        I32, ("total_q_c",), ratios=SPARSE, features=(YOCO_COMPACT, COMPRESSED_KV), steps=PROMPT_ONLY,
        replaces="ke")
    yoco_consumer_kv_ca_index_offset_len: TDict = tensor_field(  # {n: [total_q_c, 2] int32}
        I32, ("total_q_c", 2), ratios=DENSE, features=(YOCO_COMPACT, COMPRESSED_KV), steps=PROMPT_ONLY,
        replaces="kv_ca_index_offset_len")
    yoco_consumer_kv_swa_full_index_pivots: Optional[Tensor] = tensor_field(  # [total_q_c, 4] int32
        I32, ("total_q_c", 4), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, replaces="kv_swa_full_index_pivots")
    yoco_consumer_cp_mirror_len: Optional[int] = value_field(  # 2 * sum_s cdiv(keep_len, 2p)
        features=(YOCO_COMPACT,), steps=PROMPT_ONLY, stage=MIRROR)
    yoco_consumer_cp_contrib_pad_len: Optional[int] = value_field(  # max kept rows of a rank (full mirror)
        features=(YOCO_COMPACT,), steps=PROMPT_ONLY, stage=MIRROR)
    yoco_cp_contrib_index: Optional[Tensor] = tensor_field(  # [contrib_pad_len] int32, -1 padded
        I32, ("contrib_pad_len",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, stage=MIRROR, order=RANK)
    yoco_cp_boundary_index: Optional[Tensor] = tensor_field(  # [yoco_consumer_cp_mirror_len] int32, -1 pad
        I32, ("yoco_consumer_cp_mirror_len",), features=(YOCO_COMPACT,), steps=PROMPT_ONLY, stage=MIRROR,
        order=RANK)

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
        if not isinstance(flat, dict):
            raise TypeError(f"flat: expected a dict of field paths, got {type(flat).__name__}")
        kwargs: dict[str, Any] = {}
        for key, v in flat.items():
            if not isinstance(key, str):
                raise TypeError(f"{key!r}: a field path is a str, got {type(key).__name__}")
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
        if not isinstance(other, InputMetadata):
            raise TypeError(f"other: expected InputMetadata, got {type(other).__name__}")
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
        """Expand offsets and pivots into dense indices (docs/design.md section 5); idempotent."""
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
        """A copy with every tensor moved to ``device`` (aliasing kept). ``non_blocking`` applies to
        copies onto an accelerator; a copy back to the CPU always blocks (a non-blocking CUDA ->
        CPU copy returns pinned tensors before their bytes arrive, and a caller reading them at
        once reads stale memory)."""
        moved: dict[int, torch.Tensor] = {}
        non_blocking = non_blocking and torch.device(device).type != "cpu"

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

#: The field table of ``InputMetadata`` (``name -> FieldInfo``, declaration order).
FIELDS: FieldTable = field_table(InputMetadata)

#: Fields filled by ``compute_attn_info`` (reset by ``get_clean_list`` before graph replay).
DERIVED_FIELDS: tuple[str, ...] = derived_fields(FIELDS)


def _copy_into(path: str, dst: Any, src: torch.Tensor) -> None:
    if not isinstance(dst, torch.Tensor):
        raise ValueError(f"{path}: no destination tensor to copy into (got {type(dst).__name__})")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        hint = ("; decode block_tables follow the batch's widest row: build with "
                "prepare_decode(..., table_width=<the destination's columns>) for fixed shapes"
                if path == "block_tables" and dst.dim() == src.dim() == 2 and dst.shape[0] == src.shape[0] else "")
        raise ValueError(
            f"{path}: expected {tuple(dst.shape)} {dst.dtype} like the destination, "
            f"got {tuple(src.shape)} {src.dtype}{hint}"
        )
    dst.copy_(src, non_blocking=dst.device.type != "cpu")  # into host memory: wait for the bytes
