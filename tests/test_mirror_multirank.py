"""Un-mirror equivalence on real ranks: broadcast -> mirror -> expand -> all_gather == non-CP metadata.

Rank 0 builds prompt metadata with ``cpmeta.prepare_prompt`` and sends it through
``cpmeta.MetadataBroadcaster``; every rank mirrors its share with ``prepare_for_mirror_cp``, runs
``compute_attn_info``, and the per-row fields of all ranks are all-gathered (gloo) and un-mirrored.
Every rank also builds the non-CP metadata locally from the same seeded batch and checks the
gathered rows against it. Ranks start once per world size; many batches run inside them.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from multiproc import run_ranks


CASES_PER_RUN = 12  # seeded batches checked inside one group of ranks
SEED_BASE = 6000
TIMEOUT_S = 240.0


def _gather_rows(x: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """all_gather one per-row tensor (bool travels as uint8: gloo has no bool all_gather)."""
    import torch.distributed as dist

    send = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    out = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(out, send)
    return [t.to(torch.bool) for t in out] if x.dtype == torch.bool else out


def _gathered_parts(mirrored: Any, world_size: int) -> list[Any]:
    """Every rank's mirrored row fields, rebuilt as one InputMetadata per rank (rank order)."""
    from cpmeta.metadata import InputMetadata
    from reference_mirror import ROW_FIELDS_PAD, row_items

    flat: dict[str, Any] = {}
    for name in (*ROW_FIELDS_PAD, "mirror_cp_index", "mirror_cp_reverse_index"):
        v = getattr(mirrored, name)
        if isinstance(v, dict) and not v:
            flat[name] = {}
        flat.update(row_items(mirrored, name))
    per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
    for path in sorted(flat):  # same order on every rank: paths come from the same config
        v = flat[path]
        rows = _gather_rows(v, world_size) if isinstance(v, torch.Tensor) else [v] * world_size
        for r in range(world_size):
            per_rank[r][path] = rows[r]
    return [InputMetadata.from_flatten_dict({**d, "cp_mirror_len": mirrored.cp_mirror_len}) for d in per_rank]


def _worker(rank: int, world_size: int, n_cases: int, seed_base: int) -> dict[str, int]:
    import cpmeta
    from cpmeta.cp.mirror import prepare_for_mirror_cp
    from reference_mirror import check_unmirror_equivalence
    from strategies import random_config, random_prompt_batch

    checks = rows = 0
    with cpmeta.MetadataBroadcaster(group=None, src=0) as bcast:
        for case in range(n_cases):
            rng = random.Random(seed_base + case)  # identical draw on every rank
            cfg = random_config(rng)
            seqs = random_prompt_batch(rng, cfg, max_total_q=rng.choice([8, 40, 160]))
            md = bcast.broadcast(cpmeta.prepare_prompt(seqs, cfg) if rank == 0 else None)
            full = cpmeta.prepare_prompt(seqs, cfg).compute_attn_info(cfg)
            assert torch.equal(md.positions, full.positions), f"rank {rank} case {case}: broadcast positions"
            mine = prepare_for_mirror_cp(md, rank, world_size).compute_attn_info(cfg)
            assert md.mirror_cp_index is None and md.kv_swa_full_index is None, "md was modified"
            parts = _gathered_parts(mine, world_size)
            assert torch.equal(parts[rank].mirror_cp_index, mine.mirror_cp_index)
            checks += check_unmirror_equivalence(full, parts)
            rows += int(mine.cp_mirror_len)
    return {"checks": checks, "rows": rows}


@pytest.mark.parametrize("world_size", [2, 4])
def test_unmirror_equivalence_on_real_ranks(world_size: int) -> None:
    results = run_ranks(_worker, world_size, CASES_PER_RUN, SEED_BASE + 100 * world_size, timeout=TIMEOUT_S)
    assert len(results) == world_size
    # every rank checked every case and every rank holds the same number of mirror rows
    assert len({r["checks"] for r in results}) == 1 and results[0]["checks"] >= 5 * CASES_PER_RUN
    assert len({r["rows"] for r in results}) == 1
