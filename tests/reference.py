"""Literal per-token Python reference of the builders (docs/design.md sections 4 and 5): the test oracle.

Written for clarity, not speed: plain loops over sequences, rows and tokens, one line per formula
of docs/design.md, no torch vectorization. The builders in ``cpmeta/`` are compared against it exactly
(``tensor.tolist() == ref[name]``).

Output: a dict keyed by the exact ``InputMetadata`` field names, holding python ints / bools,
(nested) lists, and dicts keyed by ``str(ratio)``. Fields that do not apply to the path or config
are ``None``: without compressed KV (no ratios at all) every per-ratio field, with
``window_size == 0`` every sliding-window / state-slot field (docs/design.md section 14); with compressed KV, a
dict field over an empty ratio set (e.g. ``klen`` without sparse ratios) is ``{}``. One exception to "the full tensor":
decode ``block_tables`` holds, per row, only the DEFINED prefix of the row (its first
``ref_defined_block_columns(seqlen_k, cfg)`` entries); the tensor has ``table_width`` columns (a
decode reference's one key that is not a field: ``ref_decode_width(seqs, cfg)``, the batch's
longest table rounded up to 16 columns, at most ``max_num_blocks``, or a caller's fixed width) and
the rest are unspecified.

Functions: :func:`ref_prepare_prompt`, :func:`ref_prepare_decode` (section 4) and
:func:`ref_compute_attn_info` (section 5, returns a new dict with the derived fields filled).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from cpmeta.config import MetadataConfig
from cpmeta.sequence import SequenceMetadata

__all__ = [
    "ref_prepare_prompt",
    "ref_prepare_decode",
    "ref_compute_attn_info",
    "ref_max_num_blocks",
    "ref_decode_width",
    "ref_defined_block_columns",
    "ref_index_width",
    "COMMON_FIELDS",
    "PROMPT_FIELDS",
    "DECODE_FIELDS",
    "DERIVED",
    "ALL_REF_FIELDS",
]

PAD = -1  # slot / index meaning "nothing"
PLACEHOLDER_QI = 998244353  # query_indices of a placeholder row
ALIGN = 128  # kv_ca_index width alignment

COMMON_FIELDS = (
    "is_prompt", "num_seqs", "total_q", "max_seqlen_q", "max_seqlen_k",
    "positions", "input_ids", "gate_force_random", "ngram_token_ids", "cu_seqlens_q",
    "cu_seqlens_k", "valid_token_mask", "query_indices", "positions_c", "slot_mapping_store_ca",
    "slot_mapping_store_swa", "state_block_idx", "kv_ca_index_offset_len",
)
PROMPT_FIELDS = (
    "cu_compressed_seqlens_q", "total_k_swa", "load_segments_swa", "cu_compressed_seqlens_k",
    "load_segments_ca", "total_k_compressed", "ks", "ke", "kv_swa_full_index_pivots",
    "seq_block_tables",
)
DECODE_FIELDS = ("context_lens", "klen", "kv_swa_index_offset_len", "block_tables")
DERIVED = ("kv_ca_index", "kv_ca_index_len", "kv_swa_full_index", "kv_swa_index")
ALL_REF_FIELDS = COMMON_FIELDS + PROMPT_FIELDS + DECODE_FIELDS + DERIVED


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rank0_keys(seqlen_k: int, cfg: MetadataConfig) -> int:
    """Keys of positions ``0..seqlen_k-1`` rank 0 holds: ``(p // I) % W == 0``, counted one by one
    (all of them when the KV is not sharded, ``W == 1``)."""
    W, inter = cfg.kv_cp_world_size, cfg.kv_cp_interleave
    return sum(1 for p in range(seqlen_k) if (p // inter) % W == 0)


def _min_ratio(cfg: MetadataConfig) -> int:
    """Smallest compressed ratio, or 1 for a plain model (a block holds block_size tokens)."""
    ratios = _ca_ratios(cfg)
    return ratios[0] if ratios else 1


def ref_max_num_blocks(cfg: MetadataConfig) -> int:
    """Columns of decode ``block_tables``: ``cdiv(L // m, block_size // m)``, m = min ratio (1 for a
    plain model), L = rank 0's keys of ``max_model_len`` positions."""
    return ref_defined_block_columns(cfg.max_model_len, cfg)


def ref_decode_width(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> int:
    """Columns of decode ``block_tables``: the widest row (the longest table; a row is the
    sequence's table) rounded up to a multiple of 16, at most ``ref_max_num_blocks(cfg)`` (0 for
    no sequence)."""
    widest = max((len(seq.block_table) for seq in seqs), default=0)
    return min(_cdiv(widest, 16) * 16, ref_max_num_blocks(cfg))


def ref_defined_block_columns(seqlen_k: int, cfg: MetadataConfig) -> int:
    """Defined columns of a decode ``block_tables`` row: ``cdiv(L // m, block_size // m)``."""
    m = _min_ratio(cfg)
    return _cdiv(_rank0_keys(seqlen_k, cfg) // m, cfg.block_size // m)


def ref_index_width(cfg: MetadataConfig, n: int) -> int:
    """``width_n = cdiv(max_model_len // n, 128) * 128``."""
    return _cdiv(cfg.max_model_len // n, ALIGN) * ALIGN


def _ca_ratios(cfg: MetadataConfig) -> list[int]:
    return sorted(set(cfg.dense_compress_ratios) | set(cfg.sparse_compress_ratios))


def _loaded_len(seqlen_k: int, n: int) -> int:
    """Compressed KV rows loaded for one sequence: at least one (a zero-filled row)."""
    return max(1, seqlen_k // n)


def _prefix_sums(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _token_at(seq: SequenceMetadata, t: int) -> int:
    """Raw token at absolute position ``t``: ``token_ids`` first, then ``draft_tokens``."""
    if t < len(seq.token_ids):
        return int(seq.token_ids[t])
    return int(seq.draft_tokens[t - len(seq.token_ids)])


def _ngram_row(seq: SequenceMetadata, pos: int, cfg: MetadataConfig) -> list[int]:
    row = []
    for c in range(cfg.max_ngram_size):
        t = pos - c
        if t < 0:
            row.append(cfg.ngram_pad_token)
            continue
        crosses_image = cfg.image_token_id is not None and any(
            _token_at(seq, u) == cfg.image_token_id for u in range(t, pos + 1)
        )
        if crosses_image:
            row.append(cfg.ngram_pad_token)
        elif t < len(seq.compressed_token_ids):
            row.append(int(seq.compressed_token_ids[t]))
        elif cfg.ngram_lookup is not None:
            row.append(int(cfg.ngram_lookup[_token_at(seq, t)]))
        else:
            row.append(_token_at(seq, t))
    return row


def _compressed_slot(seq: SequenceMetadata, c: int, n: int, cfg: MetadataConfig) -> int:
    b_c = cfg.block_size // n
    return int(seq.block_table[c // b_c]) * b_c + c % b_c


def _rows(seqs: Sequence[SequenceMetadata]) -> list[tuple[int, int, int, int]]:
    """``(row i, sequence s, local j, pos)`` for every query row in varlen order."""
    out, i = [], 0
    for s, seq in enumerate(seqs):
        q_start = seq.seqlen_k - seq.seqlen_q
        for j in range(seq.seqlen_q):
            out.append((i, s, j, q_start + j))
            i += 1
    return out


def _common(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> dict[str, Any]:
    """Fields shared by both paths (section 4 "Common"), except the compressed write path."""
    S = cfg.swa_block_size
    d: dict[str, Any] = {name: None for name in ALL_REF_FIELDS}
    d["is_prompt"] = is_prompt
    d["num_seqs"] = len(seqs)
    d["total_q"] = sum(seq.seqlen_q for seq in seqs)
    d["max_seqlen_q"] = max(seq.seqlen_q for seq in seqs)
    d["max_seqlen_k"] = max(seq.seqlen_k for seq in seqs)
    d["cu_seqlens_q"] = _prefix_sums([seq.seqlen_q for seq in seqs])
    d["cu_seqlens_k"] = _prefix_sums([seq.seqlen_k for seq in seqs])
    positions, input_ids, gate, ngram, valid, qidx, swa_slot = [], [], [], [], [], [], []
    for _i, s, j, pos in _rows(seqs):
        seq = seqs[s]
        positions.append(pos)
        if is_prompt:
            input_ids.append(int(seq.token_ids[pos]))
        else:
            input_ids.append(int(seq.token_ids[-1]) if j == 0 else int(seq.draft_tokens[j - 1]))
        gate.append(cfg.force_load_balance)
        ngram.append(_ngram_row(seq, pos, cfg))
        valid.append(not seq.is_placeholder)
        qidx.append(PLACEHOLDER_QI if seq.is_placeholder else s)
        if seq.is_placeholder or seq.seqlen_q - j > S or cfg.window_size == 0:
            swa_slot.append(PAD)
        else:
            swa_slot.append(seq.state_id * S + pos % S)
    d["positions"] = positions
    d["input_ids"] = input_ids
    d["gate_force_random"] = gate
    d["ngram_token_ids"] = ngram if cfg.max_ngram_size > 0 else None
    d["valid_token_mask"] = valid
    d["query_indices"] = qidx
    d["slot_mapping_store_swa"] = swa_slot if cfg.window_size > 0 else None
    return d


def _drop_disabled(d: dict[str, Any], cfg: MetadataConfig) -> dict[str, Any]:
    """Set the fields of the features ``cfg`` switches off to ``None`` (docs/design.md section 14)."""
    if not _ca_ratios(cfg):
        for name in ("positions_c", "slot_mapping_store_ca", "cu_compressed_seqlens_q", "cu_compressed_seqlens_k",
                     "load_segments_ca", "total_k_compressed", "ks", "ke", "kv_ca_index_offset_len", "klen"):
            d[name] = None
    if cfg.window_size == 0:
        for name in ("slot_mapping_store_swa", "state_block_idx", "total_k_swa", "load_segments_swa",
                     "kv_swa_full_index_pivots", "kv_swa_index_offset_len"):
            d[name] = None
    return d


# ---- prompt -----------------------------------------------------------------------------------


def _prompt_compressed_writes(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, d: dict[str, Any]) -> None:
    """positions_c / slot_mapping_store_ca / cu_compressed_seqlens_q of the prompt path."""
    d["positions_c"], d["slot_mapping_store_ca"], d["cu_compressed_seqlens_q"] = {}, {}, {}
    for n in _ca_ratios(cfg):
        pos_c, slots, n_cq = [], [], []
        for seq in seqs:
            q_start = seq.seqlen_k - seq.seqlen_q
            first, end = q_start // n, seq.seqlen_k // n
            if end - first <= 0:  # no compressed token completes in this chunk: one dummy row
                pos_c.append(0)
                slots.append(PAD)
                n_cq.append(1)
                continue
            for c in range(first, end):
                pos_c.append(c * n)
                slots.append(PAD if seq.is_placeholder else _compressed_slot(seq, c, n, cfg))
            n_cq.append(end - first)
        d["positions_c"][str(n)] = pos_c
        d["slot_mapping_store_ca"][str(n)] = slots
        d["cu_compressed_seqlens_q"][str(n)] = _prefix_sums(n_cq)


def _swa_load_plan(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> list[list[int]]:
    """Rows ``[src_block, src_begin, src_end, dst_offset]``; zero fill, then ring runs split at wrap."""
    W, S = cfg.window_size, cfg.swa_block_size
    segs: list[list[int]] = []
    for s, seq in enumerate(seqs):
        hist_end = seq.seqlen_k - seq.seqlen_q
        hist_begin = hist_end - W
        pad = min(max(seq.swa_valid_start - hist_begin, 0), W)
        valid_begin = hist_begin + pad
        if pad > 0:
            segs.append([-1, 0, pad, s * W])
        current: Optional[list[int]] = None
        for a in range(valid_begin, hist_end):  # one token at a time
            slot = a % S
            if current is None or slot == 0:  # first token, or the ring wrapped: new segment
                current = [seq.state_id, slot, slot + 1, s * W + (a - hist_begin)]
                segs.append(current)
            else:
                current[2] += 1
    return segs


def _paged_load_plan(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, n: int, cu_k: list[int]) -> list[list[int]]:
    """Rows ``[block, begin_in_block, end_in_block, dst]`` loading ``seqlen_k // n`` compressed tokens."""
    b_c = cfg.block_size // n
    segs: list[list[int]] = []
    for s, seq in enumerate(seqs):
        m = seq.seqlen_k // n
        if m == 0:
            segs.append([-1, 0, 1, cu_k[s]])
            continue
        current: list[int] = []
        for c in range(m):  # one compressed token at a time
            block, offset = divmod(c, b_c)
            if offset == 0:  # block boundary: new segment
                current = [int(seq.block_table[block]), 0, 1, cu_k[s] + c]
                segs.append(current)
            else:
                current[2] += 1
    return segs


def _swa_pivots(seq: SequenceMetadata, s: int, j: int, n_seq: int, cu_q_s: int, W: int) -> list[int]:
    q_start = seq.seqlen_k - seq.seqlen_q
    pos = q_start + j
    abs_lo = min(max(max(pos - W + 1, seq.swa_valid_start), 0), pos + 1)
    sec1_lo = min(abs_lo, q_start)
    start_slot = sec1_lo - (q_start - W)
    p0 = s * W + start_slot
    p1 = W - start_slot
    k_lo = max(0, abs_lo - q_start)
    p2 = n_seq * W + cu_q_s + k_lo
    p3 = j - k_lo + 1
    return [p0, p1, p2, p3]


def ref_prepare_prompt(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> dict[str, Any]:
    """Every prompt field of docs/design.md section 4 (derived fields of section 5 are ``None``)."""
    d = _common(seqs, cfg, is_prompt=True)
    W = cfg.window_size
    n_seq = len(seqs)
    _prompt_compressed_writes(seqs, cfg, d)
    d["state_block_idx"] = [seq.state_id for seq in seqs]
    d["total_k_swa"] = n_seq * W
    d["load_segments_swa"] = _swa_load_plan(seqs, cfg)
    d["cu_compressed_seqlens_k"], d["load_segments_ca"], d["total_k_compressed"] = {}, {}, {}
    for n in _ca_ratios(cfg):
        cu_k = _prefix_sums([_loaded_len(seq.seqlen_k, n) for seq in seqs])
        d["cu_compressed_seqlens_k"][str(n)] = cu_k
        d["load_segments_ca"][str(n)] = _paged_load_plan(seqs, cfg, n, cu_k)
        d["total_k_compressed"][str(n)] = cu_k[-1]
    cu_q = d["cu_seqlens_q"]
    d["ks"], d["ke"], d["kv_ca_index_offset_len"] = {}, {}, {}
    for r in cfg.sparse_compress_ratios:
        base_of = d["cu_compressed_seqlens_k"][str(r)]
        d["ks"][str(r)] = [base_of[s] for _i, s, _j, _pos in _rows(seqs)]
        d["ke"][str(r)] = [base_of[s] + (pos + 1) // r for _i, s, _j, pos in _rows(seqs)]
    for n in cfg.dense_compress_ratios:
        base_of = d["cu_compressed_seqlens_k"][str(n)]
        d["kv_ca_index_offset_len"][str(n)] = [[base_of[s], (pos + 1) // n] for _i, s, _j, pos in _rows(seqs)]
    d["kv_swa_full_index_pivots"] = [
        _swa_pivots(seqs[s], s, j, n_seq, cu_q[s], W) for _i, s, j, _pos in _rows(seqs)
    ]
    width = max(len(seq.block_table) for seq in seqs)  # whole tables, padded with -1
    d["seq_block_tables"] = [
        [int(b) for b in seq.block_table] + [PAD] * (width - len(seq.block_table)) for seq in seqs
    ]
    return _drop_disabled(d, cfg)


# ---- decode -----------------------------------------------------------------------------------


def ref_prepare_decode(
    seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, *, width: Optional[int] = None
) -> dict[str, Any]:
    """Every decode field of docs/design.md section 4 (derived fields of section 5 are ``None``);
    ``block_tables`` has ``width`` columns (default :func:`ref_decode_width`; a caller's fixed
    ``out`` buffer may be wider), which sets the ``kv_ca_index_offset_len`` offsets; the dict's
    ``table_width`` says it."""
    d = _common(seqs, cfg, is_prompt=False)
    W, S, bs = cfg.window_size, cfg.swa_block_size, cfg.block_size
    mnb = ref_decode_width(seqs, cfg) if width is None else width
    rows = _rows(seqs)
    d["positions_c"], d["slot_mapping_store_ca"] = {}, {}
    for n in _ca_ratios(cfg):
        pos_c, slots = [], []
        for _i, s, _j, pos in rows:
            if (pos + 1) % n == 0:  # this row completes compressed token pos // n
                c = pos // n
                pos_c.append(c * n)
                slots.append(PAD if seqs[s].is_placeholder else _compressed_slot(seqs[s], c, n, cfg))
            else:
                pos_c.append(0)
                slots.append(PAD)
        d["positions_c"][str(n)] = pos_c
        d["slot_mapping_store_ca"][str(n)] = slots
    d["state_block_idx"] = [seqs[s].state_id for _i, s, _j, _pos in rows]
    d["context_lens"] = [pos + 1 for _i, _s, _j, pos in rows]
    d["klen"] = {str(r): [(pos + 1) // r for _i, _s, _j, pos in rows] for r in cfg.sparse_compress_ratios}
    swa = []
    for _i, s, _j, pos in rows:
        w = min(pos + 1, W)
        swa.append([seqs[s].state_id * S + (pos - w + 1) % S, w])
    d["kv_swa_index_offset_len"] = swa
    d["block_tables"] = [
        [int(b) for b in seqs[s].block_table[: ref_defined_block_columns(seqs[s].seqlen_k, cfg)]]
        for _i, s, _j, _pos in rows
    ]
    d["kv_ca_index_offset_len"] = {
        str(n): [[i * mnb * (bs // n), (pos + 1) // n] for i, _s, _j, pos in rows]
        for n in cfg.dense_compress_ratios
    }
    d["table_width"] = mnb
    return _drop_disabled(d, cfg)


# ---- section 5 --------------------------------------------------------------------------------


def _expand_pivots(p0: int, p1: int, p2: int, p3: int, W: int) -> list[int]:
    row = [p0 + k for k in range(p1)] + [p2 + k for k in range(p3)]
    return row + [PAD] * (W - len(row))


def ref_compute_attn_info(ref: dict[str, Any], cfg: MetadataConfig) -> dict[str, Any]:
    """A copy of ``ref`` with ``kv_ca_index``, ``kv_ca_index_len`` and the SWA index expanded
    (decode: ``block_tables`` of ``ref["table_width"]`` columns)."""
    d = dict(ref)
    W, S = cfg.window_size, cfg.swa_block_size
    d["kv_ca_index"], d["kv_ca_index_len"] = ({}, {}) if ref["kv_ca_index_offset_len"] is not None else (None, None)
    for key, offset_len in (ref["kv_ca_index_offset_len"] or {}).items():
        n = int(key)
        width, tpb = ref_index_width(cfg, n), cfg.block_size // n
        mnb = 0 if ref["is_prompt"] else ref["table_width"]
        rows = []
        for offset, length in offset_len:
            row = []
            for k in range(length):
                p = offset + k
                if ref["is_prompt"]:
                    row.append(p)
                else:  # block_tables.flatten()[p // tpb] * tpb + p % tpb
                    r, col = divmod(p // tpb, mnb)
                    row.append(ref["block_tables"][r][col] * tpb + p % tpb)
            rows.append(row + [PAD] * (width - length))
        d["kv_ca_index"][key] = rows
        d["kv_ca_index_len"][key] = [length for _offset, length in offset_len]
    d["kv_swa_full_index"] = d["kv_swa_index"] = None
    if W == 0:  # no sliding-window state cache
        return d
    if ref["is_prompt"]:
        d["kv_swa_full_index"] = [_expand_pivots(*p, W) for p in ref["kv_swa_full_index_pivots"]]
    else:
        rows = []
        for state, (offset, w) in zip(ref["state_block_idx"], ref["kv_swa_index_offset_len"]):
            start = offset - state * S
            rows.append([state * S + (start + k) % S for k in range(w)] + [PAD] * (W - w))
        d["kv_swa_index"] = rows
    return d
