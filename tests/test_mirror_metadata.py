"""``prepare_for_mirror_cp`` (docs/design.md section 8) on hand-made metadata and with the real builders
(un-mirror equivalence of every per-row field). Split from tests/test_mirror.py, which tests the
index plan (``prepare_cp_mirror``, ``mirror_rows``, ``unmirror``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta.metadata import InputMetadata
from cpmeta.cp.mirror import prepare_for_mirror_cp
from cpmeta.cp.zigzag import (
    NO_SPARSE_RATIOS_FALLBACK,
    cp_mirror_len,
    mirror_rows,
    prepare_cp_mirror,
    unmirror,
)
from reference_mirror import (
    check_unmirror_equivalence,
    ref_mirror_field,
    ref_prepare_cp_mirror,
    row_items,
)
from strategies import prompt_cases

I32 = torch.int32

from test_mirror import _cu, _t


# ---- prepare_for_mirror_cp on a hand-made metadata object --------------------------------------


def _toy_md(sq: list[int], sk: list[int], ks_keys: tuple[str, ...] = ("4",), ngram: int = 2) -> InputMetadata:
    """Just the fields the mirror reads, computed literally (positions = q_start + j)."""
    pos = [k - q + j for q, k in zip(sq, sk) for j in range(q)]
    total = len(pos)
    valid = torch.ones(total, dtype=torch.bool)
    valid[0] = False  # sequence 0 pretends to be a placeholder
    return InputMetadata(
        is_prompt=True, num_seqs=len(sq), total_q=total, max_seqlen_q=max(sq), max_seqlen_k=max(sk),
        positions=_t(pos), input_ids=_t([100 + i for i in range(total)]),
        gate_force_random=torch.tensor([i % 2 == 0 for i in range(total)]),
        ngram_token_ids=torch.arange(total * ngram, dtype=I32).view(total, ngram) if ngram else None,
        cu_seqlens_q=_cu(sq), cu_seqlens_k=_cu(sk), valid_token_mask=valid,
        query_indices=_t([s for s, q in enumerate(sq) for _ in range(q)]),
        slot_mapping_store_swa=_t(list(range(total))),
        ks={k: _t([7] * total) for k in ks_keys}, ke={k: _t([8] * total) for k in ks_keys},
        kv_ca_index_offset_len={"4": torch.zeros(total, 2, dtype=I32)},
        kv_swa_full_index_pivots=torch.zeros(total, 4, dtype=I32),
    )


def test_prepare_for_mirror_cp_field_table() -> None:
    sq, sk, p = [10, 3], [14, 3], 2
    md = _toy_md(sq, sk)
    before = {name: getattr(md, name) for name in InputMetadata.field_names()}
    for r in range(p):
        ref = ref_prepare_cp_mirror(sq, sk, p, r, (4,))
        idx = ref["mirror_cp_index"]
        out = prepare_for_mirror_cp(md, r, p)
        assert out is not md
        assert out.cp_rank == r and out.cp_size == p and out.cp_mirror_len == len(idx) == 8
        assert out.mirror_cp_index.tolist() == idx
        assert out.mirror_cp_reverse_index.tolist() == ref["mirror_cp_reverse_index"]
        assert out.positions.tolist() == ref_mirror_field(md.positions.tolist(), idx, 0)
        assert out.positions_cp is md.positions
        assert out.ngram_token_ids.tolist() == ref_mirror_field(md.ngram_token_ids.tolist(), idx, [0, 0])
        assert out.gate_force_random is md.gate_force_random
        assert out.gate_force_random_cp.dtype == torch.bool
        assert out.gate_force_random_cp.tolist() == ref_mirror_field(md.gate_force_random.tolist(), idx, False)
        assert out.valid_token_mask.tolist() == ref_mirror_field(md.valid_token_mask.tolist(), idx, False)
        assert out.ks["4"].tolist() == ref["ks"]["4"] and out.ke["4"].tolist() == ref["ke"]["4"]
        for name in ("input_ids", "cu_seqlens_q", "cu_seqlens_k", "query_indices", "slot_mapping_store_swa",
                     "kv_ca_index_offset_len", "kv_swa_full_index_pivots", "total_q", "num_seqs"):
            assert getattr(out, name) is getattr(md, name), name
    # md untouched: every field is the same object as before
    for name, value in before.items():
        assert getattr(md, name) is value, name
    assert md.mirror_cp_index is None and md.positions_cp is None


def test_prepare_for_mirror_cp_without_sparse_ratios_or_ngram_or_mask() -> None:
    md = _toy_md([5], [5], ks_keys=(), ngram=0).replace(valid_token_mask=None, ks={}, ke={})
    out = prepare_for_mirror_cp(md, 1, 2)
    # ratio (1,) ran internally; its ks/ke are dropped: still the empty dicts of md
    assert out.ks == {} and out.ke == {} and out.ks is md.ks
    assert out.ngram_token_ids is None
    # ps = 2, rank 1: chunks 1 ([2,3]) and 2 ([4,-]) -> valid from the index
    assert out.mirror_cp_index.tolist() == [2, 3, 4, -1]
    assert out.valid_token_mask.tolist() == [True, True, True, False]


def test_prepare_for_mirror_cp_gathers_already_expanded_fields() -> None:
    md = _toy_md([3], [3]).replace(
        kv_swa_full_index=torch.arange(6, dtype=I32).view(3, 2),
        kv_ca_index={"4": torch.arange(3, dtype=I32).view(3, 1)},
        kv_ca_index_len={"4": _t([1, 1, 1])},
    )
    out = prepare_for_mirror_cp(md, 0, 1)  # index [0, 1, 2, -1]
    assert out.kv_swa_full_index.tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1]]
    assert out.kv_ca_index["4"].tolist() == [[0], [1], [2], [-1]]
    assert out.kv_ca_index_len["4"].tolist() == [1, 1, 1, 0]


def test_prepare_for_mirror_cp_rejects() -> None:
    md = _toy_md([4], [4])
    with pytest.raises(ValueError, match="is_prompt"):
        prepare_for_mirror_cp(md.replace(is_prompt=False), 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        prepare_for_mirror_cp(md, 2, 2)
    with pytest.raises(ValueError, match="cp_size"):
        prepare_for_mirror_cp(md, 0, 0)
    with pytest.raises(ValueError, match="already mirrored"):
        prepare_for_mirror_cp(prepare_for_mirror_cp(md, 0, 2), 0, 2)
    with pytest.raises(TypeError, match="InputMetadata"):
        prepare_for_mirror_cp({"positions": md.positions}, 0, 2)  # type: ignore[arg-type]
    # a row field shorter or longer than positions: named (the gather's IndexError named only
    # mirror_index, and a longer field was gathered as if it fit)
    for name, bad in (("valid_token_mask", md.valid_token_mask[:2]), ("gate_force_random", md.gate_force_random[:0]),
                      ("ngram_token_ids", torch.zeros(5, 2, dtype=I32))):
        with pytest.raises(ValueError, match=rf"md\.{name}: expected 4 rows \(one per query row, as md.positions\)"):
            prepare_for_mirror_cp(md.replace(**{name: bad}), 0, 2)


def test_public_exports() -> None:
    assert cpmeta.prepare_cp_mirror is prepare_cp_mirror
    assert cpmeta.prepare_for_mirror_cp is prepare_for_mirror_cp
    assert cpmeta.unmirror is unmirror and cpmeta.mirror_rows is mirror_rows


# ---- with the real builders: un-mirror equivalence of every per-row field -------------------------

def _mirror_all(full_fresh: InputMetadata, cfg: Any, p: int) -> list[InputMetadata]:
    return [prepare_for_mirror_cp(full_fresh, r, p).compute_attn_info(cfg) for r in range(p)]


@settings(max_examples=40, deadline=None)
@given(case=prompt_cases(), p=st.integers(1, 8))
def test_unmirror_equivalence_with_builders(case: Any, p: int) -> None:
    from cpmeta.builders.prompt import prepare_prompt

    cfg, seqs = case
    fresh = prepare_prompt(seqs, cfg)
    parts = _mirror_all(fresh, cfg, p)  # attn_info's gather on mirrored objects
    assert fresh.kv_swa_full_index is None and fresh.mirror_cp_index is None  # md untouched
    full = prepare_prompt(seqs, cfg).compute_attn_info(cfg)
    # positions, valid_token_mask, gate_force_random_cp always; ks / ke / expanded indices per feature
    assert check_unmirror_equivalence(full, parts) >= 3
    # expanding first and mirroring afterwards (prepare_for_mirror_cp's own gather) agrees
    early = [prepare_for_mirror_cp(full, r, p) for r in range(p)]
    for a, b in zip(parts, early):
        for name in ("kv_swa_full_index", "kv_ca_index", "kv_ca_index_len"):
            for path, x in row_items(a, name).items():
                assert torch.equal(x, row_items(b, name)[path]), path
    # mirrored ks/ke agree with the literal reference of the mirror
    if full.ks is None:  # no compressed KV: the (1,) fallback ran and its ks / ke were dropped
        assert all(part.ks is None and part.ke is None for part in parts)
        return
    ratios = tuple(int(k) for k in full.ks) or NO_SPARSE_RATIOS_FALLBACK
    sq = [s.seqlen_q for s in seqs]
    sk = [s.seqlen_k for s in seqs]
    for r, part in enumerate(parts):
        ref = ref_prepare_cp_mirror(sq, sk, p, r, ratios)
        for k in full.ks:
            assert part.ks[k].tolist() == ref["ks"][k] and part.ke[k].tolist() == ref["ke"][k]


def test_named_builder_case_cp2_sq10() -> None:
    """cp=2 sq=10 through prepare_prompt: rank 0 sees positions 4,5,6,13 (+ two pad rows)."""
    from cpmeta.config import MetadataConfig
    from cpmeta.builders.prompt import prepare_prompt
    from cpmeta.sequence import SequenceMetadata

    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=4, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4,), max_model_len=64)
    seq = SequenceMetadata(seqlen_q=10, seqlen_k=14, block_table=[3], state_id=1, token_ids=list(range(14)))
    full = prepare_prompt([seq], cfg)
    r0 = prepare_for_mirror_cp(full, 0, 2).compute_attn_info(cfg)
    assert r0.positions.tolist() == [4, 5, 6, 13, 0, 0]
    assert r0.valid_token_mask.tolist() == [True] * 4 + [False] * 2
    assert r0.ke["4"].tolist() == [1, 1, 1, 3, 0, 0]
    # kv_ca_index of the row at pos 13: offset 0, len 14//4 = 3 -> [0, 1, 2, -1, ...]; pad rows all -1
    assert r0.kv_ca_index["4"][3, :4].tolist() == [0, 1, 2, -1]
    assert bool((r0.kv_ca_index["4"][4:] == -1).all())
    assert r0.kv_ca_index_len["4"].tolist() == [1, 1, 1, 3, 0, 0]
    assert bool((r0.kv_swa_full_index[4:] == -1).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mirror_and_attn_info_match_cpu() -> None:
    from cpmeta.builders.prompt import prepare_prompt
    from reference_mirror import ROW_FIELDS_PAD
    from strategies import random_config, random_prompt_batch

    rng = random.Random(11)
    for _ in range(15):
        cfg = random_config(rng)
        md = prepare_prompt(random_prompt_batch(rng, cfg), cfg)
        p = rng.randint(1, 8)
        for r in range(p):
            cpu = prepare_for_mirror_cp(md, r, p).compute_attn_info(cfg)
            gpu = prepare_for_mirror_cp(md.to("cuda"), r, p).compute_attn_info(cfg)
            for name in (*ROW_FIELDS_PAD, "mirror_cp_index", "mirror_cp_reverse_index"):
                want, got = row_items(cpu, name), row_items(gpu, name)
                assert set(want) == set(got), name
                for path, x in want.items():
                    assert got[path].is_cuda and torch.equal(got[path].cpu(), x), path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    rng = random.Random(3)
    for _ in range(30):
        p = rng.randint(1, 8)
        sq = [rng.randint(1, 70) for _ in range(rng.randint(1, 6))]
        sk = [q + rng.choice([0, 5, 300]) for q in sq]
        cu_q, cu_k = _cu(sq), _cu(sk)
        length = cp_mirror_len(cu_q, p)
        for r in range(p):
            cpu = prepare_cp_mirror(cu_q, cu_k, p, r, (4, 1), sum(sq), length)
            gpu = prepare_cp_mirror(cu_q.cuda(), cu_k.cuda(), p, r, (4, 1), sum(sq), length)
            assert gpu[0].is_cuda and gpu[1].is_cuda
            assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])
            for k in cpu[2]:
                assert torch.equal(gpu[2][k].cpu(), cpu[2][k]) and torch.equal(gpu[3][k].cpu(), cpu[3][k])
    md = _toy_md([10, 3], [14, 3])
    cpu_md = prepare_for_mirror_cp(md, 1, 2)
    gpu_md = prepare_for_mirror_cp(md.to("cuda"), 1, 2)
    for name in ("positions", "valid_token_mask", "gate_force_random_cp", "ngram_token_ids", "mirror_cp_index",
                 "mirror_cp_reverse_index"):
        assert getattr(gpu_md, name).is_cuda, name
        assert torch.equal(getattr(gpu_md, name).cpu(), getattr(cpu_md, name)), name
