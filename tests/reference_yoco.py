"""Literal per-token reference of YoCo prefill truncation (docs/design.md section 10): the test oracle.

Plain Python loops over sequences, rows, ranks and chunks, one line per formula of docs/design.md; no
torch and nothing imported from ``cpmeta`` except the input types. The zigzag chunks are built
row by row, and the CP redistribution indices are found by SEARCHING the gathered rows (not by
the closed formulas the library uses).

Functions return plain dicts of python ints / lists keyed by the exact ``InputMetadata`` names:
:func:`ref_yoco_fields` (what ``prepare_prompt`` adds), :func:`ref_consumer_rows` (the consumer
view's per-row fields), :func:`ref_yoco_cp` (what ``prepare_for_mirror_cp`` adds for one rank,
plus the mirrored consumer view's rows).
"""

from __future__ import annotations

from typing import Any, Sequence

from cpmeta.config import MetadataConfig
from cpmeta.sequence import SequenceMetadata

__all__ = ["ref_yoco_fields", "ref_consumer_rows", "ref_yoco_cp", "ref_zigzag_rows", "ref_kept_local_rows"]

PAD = -1
PLACEHOLDER_QI = 998244353
NO_SPARSE_FALLBACK = (1,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _q_start(seq: SequenceMetadata) -> int:
    return seq.seqlen_k - seq.seqlen_q


def _rect_lo(seq: SequenceMetadata, k: int) -> int:
    return max(0, len(seq.token_ids) - k)


def _clip_prefix(seq: SequenceMetadata, k: int) -> int:
    return min(max(len(seq.token_ids) - k - _q_start(seq), 0), seq.seqlen_q - 1)


def ref_kept_local_rows(seq: SequenceMetadata, k: int, compact: bool) -> list[int]:
    """Local rows ``j`` the consumer layers keep (compact) or all rows (mask)."""
    first = _clip_prefix(seq, k) if compact else 0
    return [j for j in range(seq.seqlen_q) if j >= first]


def _pivots(seqs: Sequence[SequenceMetadata], s: int, j: int, cu_q: list[int], cfg: MetadataConfig) -> list[int]:
    seq, W = seqs[s], cfg.window_size
    k = cfg.yoco_keep_tokens
    q_start = _q_start(seq)
    pos = q_start + j
    visible = [t for t in range(pos - W + 1, pos + 1)  # window, then rectangle and validity bounds
               if t >= 0 and t >= _rect_lo(seq, k) and t >= seq.swa_valid_start]
    abs_lo = visible[0] if visible else pos + 1
    assert abs_lo == min(max(pos - W + 1, _rect_lo(seq, k), seq.swa_valid_start, 0), pos + 1)
    start_slot = min(abs_lo, q_start) - (q_start - W)
    k_lo = max(0, abs_lo - q_start)
    return [s * W + start_slot, W - start_slot, len(seqs) * W + cu_q[s] + k_lo, j - k_lo + 1]


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def ref_yoco_fields(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> dict[str, Any]:
    """The YoCo fields ``prepare_prompt`` fills for ``cfg.yoco_mode`` (the other mode's are None)."""
    names = [
        "yoco_mask_swa_index_pivots", "yoco_consumer_cu_seqlens_q", "yoco_consumer_total_q",
        "yoco_consumer_query_indices", "yoco_consumer_positions",
        "yoco_consumer_slot_mapping_store_swa", "yoco_consumer_ks", "yoco_consumer_ke",
        "yoco_consumer_kv_ca_index_offset_len", "yoco_consumer_kv_swa_full_index_pivots",
    ]
    d: dict[str, Any] = {n: None for n in names}
    k = cfg.yoco_keep_tokens
    if k is None:
        return d
    cu_q = _prefix([seq.seqlen_q for seq in seqs])
    if cfg.yoco_mode == "mask":
        d["yoco_mask_swa_index_pivots"] = [
            _pivots(seqs, s, j, cu_q, cfg) for s, seq in enumerate(seqs) for j in range(seq.seqlen_q)
        ]
        return d
    S = cfg.swa_block_size
    kept = [(s, j) for s, seq in enumerate(seqs) for j in ref_kept_local_rows(seq, k, compact=True)]
    d["yoco_consumer_cu_seqlens_q"] = _prefix([len(ref_kept_local_rows(seq, k, True)) for seq in seqs])
    d["yoco_consumer_total_q"] = len(kept)
    d["yoco_consumer_query_indices"] = [cu_q[s] + j for s, j in kept]
    d["yoco_consumer_positions"] = [_q_start(seqs[s]) + j for s, j in kept]
    slots = []
    for s, j in kept:
        seq = seqs[s]
        pos = _q_start(seq) + j
        writes = not seq.is_placeholder and pos >= _rect_lo(seq, k) and seq.seqlen_q - j <= S
        slots.append(seq.state_id * S + pos % S if writes else PAD)
    d["yoco_consumer_slot_mapping_store_swa"] = slots

    def base(s: int, r: int) -> int:
        return sum(max(1, seqs[t].seqlen_k // r) for t in range(s))

    d["yoco_consumer_ks"] = {str(r): [base(s, r) for s, _j in kept] for r in cfg.sparse_compress_ratios}
    d["yoco_consumer_ke"] = {
        str(r): [base(s, r) + (_q_start(seqs[s]) + j + 1) // r for s, j in kept]
        for r in cfg.sparse_compress_ratios
    }
    d["yoco_consumer_kv_ca_index_offset_len"] = {
        str(n): [[base(s, n), (_q_start(seqs[s]) + j + 1) // n] for s, j in kept]
        for n in cfg.dense_compress_ratios
    }
    d["yoco_consumer_kv_swa_full_index_pivots"] = [_pivots(seqs, s, j, cu_q, cfg) for s, j in kept]
    if not (cfg.dense_compress_ratios or cfg.sparse_compress_ratios):  # no compressed KV: no such fields
        for name in ("yoco_consumer_ks", "yoco_consumer_ke", "yoco_consumer_kv_ca_index_offset_len"):
            d[name] = None
    return d


def ref_consumer_rows(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig) -> dict[str, Any]:
    """Fields of the (un-mirrored) consumer view that differ from the full metadata."""
    y = ref_yoco_fields(seqs, cfg)
    cu = y["yoco_consumer_cu_seqlens_q"]
    return {
        "positions": y["yoco_consumer_positions"],
        "cu_seqlens_q": cu,
        "total_q": y["yoco_consumer_total_q"],
        "max_seqlen_q": max(cu[s + 1] - cu[s] for s in range(len(seqs))),
        "query_indices": y["yoco_consumer_query_indices"],
        "slot_mapping_store_swa": y["yoco_consumer_slot_mapping_store_swa"],
        "ks": y["yoco_consumer_ks"],
        "ke": y["yoco_consumer_ke"],
        "kv_ca_index_offset_len": y["yoco_consumer_kv_ca_index_offset_len"],
        "kv_swa_full_index_pivots": y["yoco_consumer_kv_swa_full_index_pivots"],
    }


def ref_zigzag_rows(rows_per_seq: Sequence[Sequence[Any]], cp_size: int, cp_rank: int) -> list[Any]:
    """Rank ``cp_rank``'s zigzag rows: per sequence chunk ``r`` then chunk ``2p-1-r``, pad = None.

    ``rows_per_seq[s]`` lists sequence s's rows in order (any objects).
    """
    out: list[Any] = []
    for rows in rows_per_seq:
        ps = _cdiv(len(rows), 2 * cp_size)
        for block in (cp_rank, 2 * cp_size - 1 - cp_rank):
            for i in range(ps):
                local = block * ps + i
                out.append(rows[local] if local < len(rows) else None)
    return out


def ref_yoco_cp(seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Compact + CP reference for one rank.

    Returns the four fields ``prepare_for_mirror_cp`` adds, and ``view`` = the mirrored consumer
    view's rows: ``mirror_cp_index``, ``mirror_cp_reverse_index``, ``cp_mirror_len``,
    ``positions``, ``positions_cp``, ``valid_token_mask``, ``ks``, ``ke``.
    """
    k = cfg.yoco_keep_tokens
    cu_q = _prefix([seq.seqlen_q for seq in seqs])
    # rows are identified by their full-layout global row id
    full_rows = [[cu_q[s] + j for j in range(seq.seqlen_q)] for s, seq in enumerate(seqs)]
    kept = [[cu_q[s] + j for j in ref_kept_local_rows(seq, k, True)] for s, seq in enumerate(seqs)]
    kept_set = {g for rows in kept for g in rows}
    contributions = []  # per rank: global rows it keeps, in its full-mirror order
    contrib_pos = []  # per rank: their positions in the rank's full-mirror rows
    for r in range(cp_size):
        mirror = ref_zigzag_rows(full_rows, cp_size, r)
        contrib_pos.append([m for m, g in enumerate(mirror) if g is not None and g in kept_set])
        contributions.append([mirror[m] for m in contrib_pos[-1]])
    pad_len = max(len(c) for c in contributions)
    gathered = []
    for c in contributions:
        gathered += c + [None] * (pad_len - len(c))
    compact_ids = [(s, i) for s, rows in enumerate(kept) for i in range(len(rows))]
    cu_c = _prefix([len(rows) for rows in kept])
    compact_rows = [[cu_c[s] + i for i in range(len(rows))] for s, rows in enumerate(kept)]
    every_rank = [ref_zigzag_rows(compact_rows, cp_size, r) for r in range(cp_size)]
    mine = every_rank[cp_rank]
    flat = [c for rank_rows in every_rank for c in rank_rows]
    full_of = {cu_c[s] + i: kept[s][i] for s, i in compact_ids}
    boundary = []
    for c in mine:
        boundary.append(PAD if c is None else gathered.index(full_of[c]))
    view = _ref_mirrored_view(seqs, cfg, mine, flat, full_of, cu_c)
    return {
        "yoco_consumer_cp_mirror_len": len(mine),
        "yoco_consumer_cp_contrib_pad_len": pad_len,
        "yoco_cp_contrib_index": contrib_pos[cp_rank] + [PAD] * (pad_len - len(contrib_pos[cp_rank])),
        "yoco_cp_boundary_index": boundary,
        "view": view,
    }


def _ref_mirrored_view(
    seqs: Sequence[SequenceMetadata], cfg: MetadataConfig, mine: list[Any], flat: list[Any],
    full_of: dict[int, int], cu_c: list[int],
) -> dict[str, Any]:
    cu_q = _prefix([seq.seqlen_q for seq in seqs])
    seq_of_full = {cu_q[s] + j: s for s, seq in enumerate(seqs) for j in range(seq.seqlen_q)}
    y = ref_yoco_fields(seqs, cfg)
    positions = y["yoco_consumer_positions"]
    ratios = [str(r) for r in cfg.sparse_compress_ratios]
    view: dict[str, Any] = {
        "mirror_cp_index": [PAD if c is None else c for c in mine],
        "mirror_cp_reverse_index": [flat.index(c) for c in range(cu_c[-1])],
        "cp_mirror_len": len(mine),
        "positions": [0 if c is None else positions[c] for c in mine],
        "positions_cp": positions,
        "valid_token_mask": [c is not None and not seqs[seq_of_full[full_of[c]]].is_placeholder for c in mine],
        "ks": {r: [0 if c is None else y["yoco_consumer_ks"][r][c] for c in mine] for r in ratios},
        "ke": {r: [0 if c is None else y["yoco_consumer_ke"][r][c] for c in mine] for r in ratios},
    }
    if y["yoco_consumer_ks"] is None:  # no compressed KV: ks / ke stay None through the mirror
        view["ks"] = view["ke"] = None
    return view
