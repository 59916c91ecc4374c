"""Zigzag CP mirror (docs/design.md section 8): named hand-worked cases, reference comparison, properties.

Single process: every rank's share is computed in a loop and the ranks' rows are concatenated in
rank order, which is what ``all_gather`` produces on a real group (see test_mirror_multirank.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpmeta.cp.zigzag import (
    NO_SPARSE_RATIOS_FALLBACK,
    cp_mirror_len,
    mirror_rows,
    prepare_cp_mirror,
    unmirror,
)
from reference_mirror import (
    ref_all_ranks,
    ref_prepare_cp_mirror,
)

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


def test_unmirror_refuses_wrong_parts() -> None:
    """Issue 25: a missing rank's part was a bare IndexError; now a ValueError naming both counts."""
    ranks = [_t([0, 1, 2, 9, -1, -1]), _t([3, 4, 5, 6, 7, 8])]
    rev = _t([0, 1, 2, 6, 7, 8, 9, 10, 11, 3])
    assert unmirror(ranks, rev, cp_size=2).tolist() == list(range(10))
    with pytest.raises(ValueError, match=r"expected at least total_q=10 rows .*got 1 parts \(6 rows\)"):
        unmirror(ranks[:1], rev)
    with pytest.raises(ValueError, match=r"expected 3 parts \(cp_size=3\), got 2 parts"):
        unmirror(ranks, rev, cp_size=3)
    with pytest.raises(ValueError, match=r"rows: a multiple of cp_size.*got 12 rows"):
        unmirror(torch.cat(ranks), rev, cp_size=5)
    # enough rows for total_q, but too few parts: the reverse index reads past the end
    three = [_t([0, -1]), _t([1, -1]), _t([2, 3])]  # e.g. parts of 2 rows from 3 ranks
    rev3 = _t([0, 2, 4, 5])
    assert unmirror(three, rev3).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"expected at least 3 parts of 2 rows \(reverse_index reads rows 0\.\.5\), "
                                         r"got 2 parts \(4 rows\)"):
        unmirror(three[:2], rev3)
    with pytest.raises(ValueError, match=r"rows_from_all_ranks\[1\]"):  # a part of another size
        unmirror([three[0], three[1][:1], three[2]], rev3)
    with pytest.raises(ValueError, match="cp_size"):
        unmirror(three, rev3, cp_size=0)


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


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                                   torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cols", [(), (3,), (2, 4)])
def test_mirror_rows_every_dtype_and_width(dtype: torch.dtype, cols: tuple[int, ...]) -> None:
    # the CPU gather copies rows as 1-, 4- or 8-byte words: every row width and dtype against
    # index_select + the pad value
    width = 1
    for c in cols:
        width *= c
    full = (torch.arange(5 * width, dtype=torch.int64) % 7).view(5, *cols).to(dtype)
    index = _t([4, -1, 0, 2, -1, 4])
    got = mirror_rows(full, index, 1)
    want = full.index_select(0, index.clamp(min=0).long())
    want[index < 0] = 1
    assert got.dtype == dtype and got.shape == (6, *cols) and torch.equal(got, want)
    assert torch.equal(mirror_rows(full[:0], _t([-1, -1]), 1), torch.ones(2, *cols, dtype=dtype))
    with pytest.raises(IndexError, match=r"mirror_index: entry 1 reads row 5 of a tensor of 5 rows"):
        mirror_rows(full, _t([0, 5]))
