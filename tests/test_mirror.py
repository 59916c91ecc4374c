"""Zigzag CP mirror (DESIGN section 8): named hand-worked cases, reference comparison, properties.

Single process: every rank's share is computed in a loop and the ranks' rows are concatenated in
rank order, which is what ``all_gather`` produces on a real group (see test_mirror_multirank.py).
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
    ref_all_ranks,
    ref_mirror_field,
    ref_prepare_cp_mirror,
    row_items,
)
from strategies import prompt_cases

I32 = torch.int32


def _cu(lens: list[int]) -> torch.Tensor:
    out = [0]
    for x in lens:
        out.append(out[-1] + x)
    return torch.tensor(out, dtype=I32)


def _mirror(sq: list[int], sk: list[int], p: int, r: int, ratios: tuple[int, ...]) -> tuple[Any, ...]:
    cu_q = _cu(sq)
    return prepare_cp_mirror(cu_q, _cu(sk), p, r, ratios, sum(sq), cp_mirror_len(cu_q, p))


def _t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=I32)


def _assert_case(sq, sk, p, ratios, want_index, want_reverse, want_ks, want_ke) -> None:  # noqa: ANN001
    for r in range(p):
        index, reverse, ks, ke = _mirror(sq, sk, p, r, ratios)
        assert index.dtype == I32 and reverse.dtype == I32
        assert torch.equal(index, _t(want_index[r])), f"rank {r}: {index.tolist()}"
        assert torch.equal(reverse, _t(want_reverse)), f"rank {r}: {reverse.tolist()}"
        for key in ks:
            assert torch.equal(ks[key], _t(want_ks[r])), f"rank {r} ks: {ks[key].tolist()}"
            assert torch.equal(ke[key], _t(want_ke[r])), f"rank {r} ke: {ke[key].tolist()}"


# ---- named hand-worked cases -----------------------------------------------------------------


def test_cp2_sq10_first_chunk() -> None:
    # ps = cdiv(10, 4) = 3; chunks [0,1,2] [3,4,5] [6,7,8] [9,-,-]; rank 0: chunks 0,3; rank 1: 1,2.
    # seqlen_k = 10, r = 4: base 0, ke = (pos+1)//4 with pos = local.
    _assert_case(
        [10], [10], 2, (4,),
        want_index=[[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]],
        # concatenation [0,1,2,9,P,P,3,4,5,6,7,8]: row 9 at 3, row 3 at 6, ...
        want_reverse=[0, 1, 2, 6, 7, 8, 9, 10, 11, 3],
        want_ks=[[0] * 6, [0] * 6],
        want_ke=[[0, 0, 0, 2, 0, 0], [1, 1, 1, 1, 2, 2]],
    )


def test_cp2_sq10_chunked_prefill() -> None:
    # seqlen_k = 14 -> q_start = 4, pos = 4 + local. rank 0 positions 4,5,6,13 -> ke 1,1,1,3;
    # rank 1 positions 7..12 -> ke (8..13)//4 = 2,2,2,2,3,3.
    _assert_case(
        [10], [14], 2, (4,),
        want_index=[[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]],
        want_reverse=[0, 1, 2, 6, 7, 8, 9, 10, 11, 3],
        want_ks=[[0] * 6, [0] * 6],
        want_ke=[[1, 1, 1, 3, 0, 0], [2, 2, 2, 2, 3, 3]],
    )


def test_cp3_lengths_1_5_13() -> None:
    # 2p = 6, ps = 1, 1, 3 -> cp_mirror_len 10; cu_seqlens_q = [0, 1, 6, 19].
    # seq 0 (sq 1): only chunk 0 is real (rank 0). seq 1 (sq 5, rows 1..5): chunk b = local b,
    # chunk 5 empty. seq 2 (sq 13, rows 6..18): chunks of 3, chunk 4 = local 12 only, chunk 5 empty.
    # seqlen_k = [1, 9, 13], r = 4: loaded max(1, k//4) = 1, 2, 3 -> base 0, 1, 3; q_start 0, 4, 0.
    _assert_case(
        [1, 5, 13], [1, 9, 13], 3, (4,),
        want_index=[
            [0, -1, 1, -1, 6, 7, 8, -1, -1, -1],
            [-1, -1, 2, 5, 9, 10, 11, 18, -1, -1],
            [-1, -1, 3, 4, 12, 13, 14, 15, 16, 17],
        ],
        # rank r's rows start at 10 r in the concatenation.
        want_reverse=[0, 2, 12, 22, 23, 13, 4, 5, 6, 14, 15, 16, 24, 25, 26, 27, 28, 29, 17],
        want_ks=[
            [0, 0, 1, 0, 3, 3, 3, 0, 0, 0],
            [0, 0, 1, 1, 3, 3, 3, 3, 0, 0],
            [0, 0, 1, 1, 3, 3, 3, 3, 3, 3],
        ],
        # e.g. rank 1 row 5 (seq 1 local 4, pos 8): 1 + 9//4 = 3; row 18 (pos 12): 3 + 13//4 = 6.
        want_ke=[
            [0, 0, 2, 0, 3, 3, 3, 0, 0, 0],
            [0, 0, 2, 3, 4, 4, 4, 6, 0, 0],
            [0, 0, 2, 3, 4, 5, 5, 5, 5, 6],
        ],
    )


def test_cp4_sequence_shorter_than_2p() -> None:
    # 2p = 8. seq 0: sq 3 < 8, ps 1 -> ranks 0,1,2 get one row each, rank 3 nothing.
    # seq 1: sq 9, ps 2, rows 3..11: chunk b = local [2b, 2b+2); chunk 4 = local 8 only (rank 3).
    # seqlen_k = [3, 20], r = 2: loaded 1, 10 -> base 0, 1; q_start 0, 11.
    _assert_case(
        [3, 9], [3, 20], 4, (2,),
        want_index=[
            [0, -1, 3, 4, -1, -1],
            [1, -1, 5, 6, -1, -1],
            [2, -1, 7, 8, -1, -1],
            [-1, -1, 9, 10, 11, -1],
        ],
        want_reverse=[0, 6, 12, 2, 3, 8, 9, 14, 15, 20, 21, 22],
        want_ks=[[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0]],
        # rank 3 row 11 = seq 1 local 8, pos 19: 1 + 20//2 = 11.
        want_ke=[[0, 0, 7, 7, 0, 0], [1, 0, 8, 8, 0, 0], [1, 0, 9, 9, 0, 0], [0, 0, 10, 10, 11, 0]],
    )


def test_cp1_keeps_order_with_padding() -> None:
    # p = 1: ps = cdiv(3, 2) = 2, chunks [0,1] [2,-]: the full order, one pad row.
    index, reverse, _, _ = _mirror([3], [3], 1, 0, (1,))
    assert index.tolist() == [0, 1, 2, -1]
    assert reverse.tolist() == [0, 1, 2]


def test_ratio_one_fallback_and_several_ratios() -> None:
    # ratio 1: ke = base + pos + 1 with base = sum of earlier seqlen_k; two ratios keyed "1", "4".
    index, _, ks, ke = _mirror([2, 2], [5, 2], 1, 0, (1, 4))
    assert list(ks) == ["1", "4"]
    assert index.tolist() == [0, 1, 2, 3]
    assert ks["1"].tolist() == [0, 0, 5, 5] and ke["1"].tolist() == [4, 5, 6, 7]
    # r=4: loaded max(1, 5//4)=1 -> base 0, 1; positions 3,4 then 0,1.
    assert ks["4"].tolist() == [0, 0, 1, 1] and ke["4"].tolist() == [1, 1, 1, 1]
    assert NO_SPARSE_RATIOS_FALLBACK == (1,)


def test_cp_mirror_len_examples() -> None:
    assert cp_mirror_len(_cu([1, 5, 13]), 3) == 10
    assert cp_mirror_len(_cu([10]), 2) == 6
    assert cp_mirror_len(_cu([3, 9]), 4) == 6
    assert cp_mirror_len(_cu([7]), 1) == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cp_size=0), "cp_size"),
        (dict(cp_rank=2), "cp_rank"),
        (dict(cp_rank=-1), "cp_rank"),
        (dict(ratios=()), "ratios"),
        (dict(ratios=(0,)), "ratios"),
        (dict(total_q=9), "total_q"),
        (dict(cp_mirror_len=5), "cp_mirror_len"),
        (dict(cu_seqlens_k=_cu([9])), "seqlen_q 10 > seqlen_k 9"),
        (dict(cu_seqlens_k=_cu([10, 1])), "cu_seqlens_k"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 10.0])), "cu_seqlens_q"),
    ],
)
def test_prepare_cp_mirror_rejects_bad_input(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(cu_seqlens_q=_cu([10]), cu_seqlens_k=_cu([10]), cp_size=2, cp_rank=0,
                                ratios=(4,), total_q=10, cp_mirror_len=6)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        prepare_cp_mirror(**args)


# ---- row helpers -----------------------------------------------------------------------------


def test_mirror_rows_and_unmirror_examples() -> None:
    full = _t([10, 11, 12, 13])
    assert mirror_rows(full, _t([3, -1, 0])).tolist() == [13, 0, 10]
    two_d = torch.arange(8, dtype=I32).view(4, 2)
    assert mirror_rows(two_d, _t([-1, 2]), -1).tolist() == [[-1, -1], [4, 5]]
    mask = torch.tensor([True, False, True, True])
    assert mirror_rows(mask, _t([0, -1, 1])).tolist() == [True, False, False]
    out = mirror_rows(full, _t([0, 1, 2, 3]))
    assert out.data_ptr() != full.data_ptr()  # a copy, never an alias of the full tensor
    ranks = [_t([0, 1, 2, 9, -1, -1]), _t([3, 4, 5, 6, 7, 8])]
    rev = _t([0, 1, 2, 6, 7, 8, 9, 10, 11, 3])
    assert unmirror(ranks, rev).tolist() == list(range(10))
    assert unmirror(torch.cat(ranks), rev).tolist() == list(range(10))
    with pytest.raises(ValueError, match=r"rows_from_all_ranks\[1\]"):
        unmirror([ranks[0], ranks[1][:5]], rev)
    with pytest.raises(TypeError, match="mirror_index"):
        mirror_rows(full, torch.tensor([0.5]))


# ---- random batches: reference and properties --------------------------------------------------


@st.composite
def _batches(draw: Any) -> tuple[list[int], list[int], int, tuple[int, ...]]:
    n = draw(st.integers(1, 6))
    p = draw(st.integers(1, 8))
    sq = [draw(st.one_of(st.integers(1, 2 * p), st.integers(1, 60))) for _ in range(n)]
    sk = [q + draw(st.sampled_from([0, 0, 1, 3, 17, 200])) for q in sq]
    ratios = draw(st.sampled_from([(1,), (4,), (2, 8), (4, 128), (3,)]))
    return sq, sk, p, ratios


@settings(max_examples=80, deadline=None)
@given(case=_batches())
def test_matches_reference_and_properties(case: tuple[list[int], list[int], int, tuple[int, ...]]) -> None:
    sq, sk, p, ratios = case
    refs = ref_all_ranks(sq, sk, p, ratios)
    length = refs[0]["cp_mirror_len"]
    assert cp_mirror_len(_cu(sq), p) == length
    indices = []
    for r, ref in enumerate(refs):
        index, reverse, ks, ke = _mirror(sq, sk, p, r, ratios)
        assert index.tolist() == ref["mirror_cp_index"], f"rank {r}"
        assert reverse.tolist() == ref["mirror_cp_reverse_index"], f"rank {r}"
        assert {k: v.tolist() for k, v in ks.items()} == ref["ks"], f"rank {r}"
        assert {k: v.tolist() for k, v in ke.items()} == ref["ke"], f"rank {r}"
        indices.append(index)
    cat = torch.cat(indices)
    real = cat[cat >= 0]
    # every real row on exactly one rank
    assert sorted(real.tolist()) == list(range(sum(sq)))
    # un-mirror of the index itself is the identity
    assert torch.equal(unmirror(indices, reverse), torch.arange(sum(sq), dtype=I32))
    _check_balance(sq, p, indices)


def _check_balance(sq: list[int], p: int, indices: list[torch.Tensor]) -> None:
    """Per sequence: rank row counts differ by at most ps; with 2p | sq counts AND causal work match."""
    start = 0
    cu = _cu(sq).tolist()
    for s, q in enumerate(sq):
        ps = -(-q // (2 * p))
        counts, work = [], []
        for index in indices:
            seg = index[start:start + 2 * ps]
            rows = seg[seg >= 0] - cu[s]
            counts.append(int(rows.numel()))
            work.append(int((rows + 1).sum()))
        assert max(counts) - min(counts) <= ps, (s, counts)
        if q % (2 * p) == 0:
            assert len(set(counts)) == 1 and len(set(work)) == 1, (s, counts, work)
        start += 2 * ps


def test_compact_layout_keeps_absolute_positions() -> None:
    # A compacted q layout (keep 3 of 8 rows) with the ORIGINAL seqlen_k = 20: pos = 20 - 3 + c.
    index, _, _, ke = _mirror([3], [20], 1, 0, (1,))
    assert index.tolist() == [0, 1, 2, -1]
    assert ke["1"].tolist() == [18, 19, 20, 0]
    ref = ref_prepare_cp_mirror([3], [20], 1, 0, (1,))
    assert ke["1"].tolist() == ref["ke"]["1"]


def _expand_both(sq: list[int], sk: list[int], p: int, r: int, ratios: tuple[int, ...]) -> tuple[Any, Any]:
    """The numpy (CPU) and the torch (device) expansion of the same plans, both run on the CPU."""
    from cpmeta.cp import mirror_plan as M

    cu_q, cu_k = _cu(sq).numpy().astype("int64"), _cu(sk).numpy().astype("int64")
    length = cp_mirror_len(_cu(sq), p)
    rank_plan = M._rank_plan(cu_q, cu_k, p, r, ratios).astype("int32")
    rev_plan = M._reverse_plan(cu_q, p, length).astype("int32")
    by_numpy = M._expand(M._NumpyOps(), rank_plan, rev_plan, ratios, length, sum(sq))
    by_torch = M._expand(M._TorchOps(torch.device("cpu")), torch.from_numpy(rank_plan),
                         torch.from_numpy(rev_plan), ratios, length, sum(sq))
    return by_numpy, by_torch


@settings(max_examples=40, deadline=None)
@given(case=_batches(), data=st.data())
def test_torch_expansion_matches_numpy(case: tuple[list[int], list[int], int, tuple[int, ...]], data: Any) -> None:
    # CUDA inputs take the torch path; force it on the CPU so CI checks it against the numpy path.
    sq, sk, p, ratios = case
    r = data.draw(st.integers(0, p - 1))
    (ni, nr, nks, nke), (ti, tr, tks, tke) = _expand_both(sq, sk, p, r, ratios)
    assert ti.dtype == tr.dtype == torch.int32
    assert ti.tolist() == ni.tolist() and tr.tolist() == nr.tolist()
    for k in nks:
        assert tks[k].dtype == tke[k].dtype == torch.int32
        assert tks[k].tolist() == nks[k].tolist() and tke[k].tolist() == nke[k].tolist()


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mirror_and_attn_info_match_cpu() -> None:
    from cpmeta.build.prompt import prepare_prompt
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
    from cpmeta.build.prompt import prepare_prompt

    cfg, seqs = case
    fresh = prepare_prompt(seqs, cfg)
    parts = _mirror_all(fresh, cfg, p)  # attn_info's gather on mirrored objects
    assert fresh.kv_swa_full_index is None and fresh.mirror_cp_index is None  # md untouched
    full = prepare_prompt(seqs, cfg).compute_attn_info(cfg)
    assert check_unmirror_equivalence(full, parts) >= 5
    # expanding first and mirroring afterwards (prepare_for_mirror_cp's own gather) agrees
    early = [prepare_for_mirror_cp(full, r, p) for r in range(p)]
    for a, b in zip(parts, early):
        for name in ("kv_swa_full_index", "kv_ca_index", "kv_ca_index_len"):
            for path, x in row_items(a, name).items():
                assert torch.equal(x, row_items(b, name)[path]), path
    # mirrored ks/ke agree with the literal reference of the mirror
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
    from cpmeta.build.prompt import prepare_prompt
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
