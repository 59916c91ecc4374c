"""Literal per-row reference of the zigzag CP mirror (docs/design.md section 8), the oracle for tests.

Plain Python loops over sequences, chunks and rows, written to be read against docs/design.md;
no torch in the reference itself. The reverse index is found by building every rank's rows and
searching them, not by the closed formula the library uses. :func:`check_unmirror_equivalence`
(torch) is the one checker shared by the single-process and the multi-rank tests.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cpmeta.metadata import InputMetadata
from cpmeta.cp.zigzag import unmirror

__all__ = [
    "ref_prepare_cp_mirror", "ref_all_ranks", "ref_mirror_field", "check_unmirror_equivalence",
    "ROW_FIELDS_PAD", "row_items",
]

PAD = -1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rank_rows(seqlens_q: Sequence[int], cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """``(sequence, local row)`` of each mirror row of one rank, ``(s, -1)`` for a pad row."""
    out: list[tuple[int, int]] = []
    for s, sq in enumerate(seqlens_q):
        ps = _cdiv(sq, 2 * cp_size)
        for block in (cp_rank, 2 * cp_size - 1 - cp_rank):
            for j in range(ps):
                local = ps * block + j
                out.append((s, local if local < sq else PAD))
    return out


def ref_prepare_cp_mirror(
    seqlens_q: Sequence[int], seqlens_k: Sequence[int], cp_size: int, cp_rank: int,
    ratios: Sequence[int],
) -> dict[str, Any]:
    """Reference of ``prepare_cp_mirror`` for one rank, as Python lists.

    Returns ``{"mirror_cp_index", "mirror_cp_reverse_index", "ks", "ke", "cp_mirror_len"}``;
    ``ks``/``ke`` are dicts keyed by ``str(r)``.
    """
    cu_q = [0]
    for sq in seqlens_q:
        cu_q.append(cu_q[-1] + sq)
    rows = _rank_rows(seqlens_q, cp_size, cp_rank)
    index = [PAD if j == PAD else cu_q[s] + j for s, j in rows]

    every_rank: list[int] = []
    for r in range(cp_size):
        every_rank += [PAD if j == PAD else cu_q[s] + j for s, j in _rank_rows(seqlens_q, cp_size, r)]
    where: dict[int, list[int]] = {}
    for m, x in enumerate(every_rank):
        where.setdefault(x, []).append(m)
    reverse = []
    for g in range(cu_q[-1]):
        hits = where.get(g, [])
        assert len(hits) == 1, f"row {g} held {len(hits)} times"
        reverse.append(hits[0])

    ks: dict[str, list[int]] = {}
    ke: dict[str, list[int]] = {}
    for r in ratios:
        ks[str(r)], ke[str(r)] = [], []
        for s, j in rows:
            if j == PAD:
                ks[str(r)].append(0)
                ke[str(r)].append(0)
                continue
            base = 0
            for s2 in range(s):
                base += max(1, seqlens_k[s2] // r)
            pos = seqlens_k[s] - seqlens_q[s] + j
            ks[str(r)].append(base)
            ke[str(r)].append(base + (pos + 1) // r)
    return {
        "mirror_cp_index": index,
        "mirror_cp_reverse_index": reverse,
        "ks": ks,
        "ke": ke,
        "cp_mirror_len": len(rows),
    }


def ref_all_ranks(
    seqlens_q: Sequence[int], seqlens_k: Sequence[int], cp_size: int, ratios: Sequence[int]
) -> list[dict[str, Any]]:
    """:func:`ref_prepare_cp_mirror` for every rank ``0..cp_size-1``."""
    return [ref_prepare_cp_mirror(seqlens_q, seqlens_k, cp_size, r, ratios) for r in range(cp_size)]


def ref_mirror_field(full_rows: Sequence[Any], mirror_index: Sequence[int], pad: Any) -> list[Any]:
    """Rows of a full-layout list picked by a mirror index, ``pad`` on pad rows."""
    return [pad if i == PAD else full_rows[i] for i in mirror_index]


# ---- torch checker shared by test_mirror.py and test_mirror_multirank.py ----------------------

#: Per-row fields compared after un-mirroring, with the value their pad rows must hold.
ROW_FIELDS_PAD: dict[str, Any] = {
    "positions": 0,
    "valid_token_mask": False,
    "gate_force_random_cp": False,
    "ngram_token_ids": 0,
    "ks": 0,
    "ke": 0,
    "kv_swa_full_index": -1,
    "kv_ca_index": -1,
    "kv_ca_index_len": 0,
}

#: Where the full-layout value of a mirrored field lives in the non-CP metadata.
_FULL_NAME = {"gate_force_random_cp": "gate_force_random"}


def row_items(md: InputMetadata, name: str) -> dict[str, torch.Tensor]:
    """``{path: tensor}`` of one field: ``{name: t}`` or ``{"name.key": t}`` per dict entry."""
    v = getattr(md, name)
    if v is None:
        return {}
    return {f"{name}.{k}": x for k, x in v.items()} if isinstance(v, dict) else {name: v}


def check_unmirror_equivalence(full: InputMetadata, parts: list[InputMetadata]) -> int:
    """``cat(rank rows)[reverse] == full rows`` and pad-row values, for every row field; returns #checks.

    ``full`` has had ``compute_attn_info``; ``parts[r]`` is rank r's mirrored, expanded metadata.
    The multi-rank test passes objects rebuilt from all-gathered rows (only the row fields,
    ``mirror_cp_index``, ``mirror_cp_reverse_index`` and ``cp_mirror_len`` are read).
    """
    checks = 0
    reverse = parts[0].mirror_cp_reverse_index
    for part in parts:
        assert torch.equal(part.mirror_cp_reverse_index, reverse)
    for name, pad in ROW_FIELDS_PAD.items():
        full_name = _FULL_NAME.get(name, name)
        want = {name + path[len(full_name):]: x for path, x in row_items(full, full_name).items()}
        got_parts = [row_items(part, name) for part in parts]
        for r, got in enumerate(got_parts):
            assert set(got) == set(want), f"{name} rank {r}: paths {sorted(got)} vs {sorted(want)}"
        for mpath, full_rows in want.items():
            rows = [g[mpath] for g in got_parts]
            for r, (x, part) in enumerate(zip(rows, parts)):
                assert x.shape[0] == part.cp_mirror_len, f"{mpath} rank {r}: {tuple(x.shape)}"
                assert x.dtype == full_rows.dtype, f"{mpath} rank {r}: {x.dtype}"
                pads = x[part.mirror_cp_index < 0]
                assert bool((pads == pad).all()), f"{mpath} rank {r}: pad rows hold {pads.tolist()}"
            assert torch.equal(unmirror(rows, reverse), full_rows), f"{mpath}: un-mirrored rows differ"
            checks += 1
    return checks
