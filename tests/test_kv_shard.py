"""``cpmeta.cp_local_seqlens`` (docs/design.md section 11) against a per-position count, and its docstring example."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import cpmeta

sys.path.insert(0, os.path.dirname(__file__))
from reference_slot_mapping import owner_rank  # noqa: E402


def ref_local_seqlen(seqlen_k: int, world: int, rank: int, interleave: int) -> int:
    """Count position by position: ``(p // interleave) % world == rank``."""
    return sum(1 for p in range(seqlen_k) if owner_rank(p, world, interleave) == rank)


def test_docstring_examples() -> None:
    f = cpmeta.cp_local_seqlens
    assert f(torch.tensor([300]), 2, 0, 128).tolist() == [172]
    assert f(torch.tensor([300]), 2, 1, 128).tolist() == [128]
    assert [f(torch.tensor([7]), 3, r, 1).item() for r in range(3)] == [3, 2, 2]
    assert f(torch.tensor([300]), 2, 0, 128).dtype == torch.int32


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 5, 16])
def test_matches_per_position_count(world: int, interleave: int) -> None:
    lens = torch.tensor(list(range(0, 70)) + [129, 257, 1000], dtype=torch.int64)
    total = torch.zeros_like(lens, dtype=torch.int32)
    for rank in range(world):
        got = cpmeta.cp_local_seqlens(lens.to(torch.int32), world, rank, interleave)
        assert got.tolist() == [ref_local_seqlen(int(n), world, rank, interleave) for n in lens]
        total += got
    assert torch.equal(total.to(torch.int64), lens)  # every position owned exactly once


def test_argument_errors() -> None:
    f = cpmeta.cp_local_seqlens
    with pytest.raises(ValueError, match="cp_rank"):
        f(torch.tensor([3]), 2, 2, 1)
    with pytest.raises(ValueError, match="cp_interleave"):
        f(torch.tensor([3]), 2, 0, 0)
    with pytest.raises(ValueError, match="seqlens_k"):
        f(torch.tensor([-1]), 2, 0, 1)
    with pytest.raises(TypeError, match="seqlens_k"):
        f(torch.tensor([1.0]), 2, 0, 1)
