"""``launch.spawn.run_ranks``: the packaged process spawner the examples use (not tests/multiproc).

Two real gloo ranks: results come back per rank (JSON values), a rank that raises is named with its
traceback, and ``scripts/cp_generate.py`` reaches nothing under ``tests/`` (it runs from a wheel).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cpmeta.launch.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _sum_ranks(rank: int, world_size: int, n: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank * n])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": int(t)}


def _second_rank_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def test_results_per_rank_and_the_failing_rank_named() -> None:
    assert run_ranks(_sum_ranks, 2, 10, timeout=120) == [{"rank": r, "world": 2, "sum": 10} for r in range(2)]
    with pytest.raises(RuntimeError, match=r"rank 1 failed first:(.|\n)*ValueError: rank one refuses"):
        run_ranks(_second_rank_raises, 2, timeout=120)
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sum_ranks, 0, 1)


def test_cp_generate_needs_nothing_from_tests() -> None:
    tree = ast.parse((ROOT / "scripts" / "cp_generate.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "multiproc" not in imported and not any(m.startswith("tests") for m in imported), imported
    assert not [s for s in ast.walk(tree) if isinstance(s, ast.Constant) and s.value == "tests"]
