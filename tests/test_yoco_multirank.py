"""YoCo on real ranks (gloo): broadcast -> views -> compact + CP redistribution with all_gather.

Rank 0 builds YoCo prompt metadata with ``cpmeta.prepare_prompt`` and sends it through
``cpmeta.MetadataBroadcaster``; every rank also builds it locally from the same seeded batch.
Per case every rank checks:

- the received metadata (YoCo fields included) equals the local build, bit for bit;
- its consumer / mask view of the received metadata, expanded, equals the driver's view sent
  through the broadcaster (aliasing included);
- compact: the four CP fields equal the literal reference for this rank, and the redistribution
  ``all_gather(full_mirror_rows[yoco_cp_contrib_index])[yoco_cp_boundary_index]`` equals the
  mirrored consumer view's rows, on every non-pad row (payloads: full-mirror positions, global
  row ids, input ids);
- the mirrored views' expanded rows, all-gathered and un-mirrored, equal the non-CP view.

Ranks start once per world size; many batches run inside them.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from multiproc import run_ranks

CASES_PER_RUN = 10  # seeded batches checked inside one group of ranks
SEED_BASE = 7100
TIMEOUT_S = 240.0
#: Row fields of a view compared after all_gather + un-mirror (dict fields by every key).
VIEW_ROW_FIELDS = ("positions", "ks", "ke", "kv_swa_full_index", "kv_ca_index", "kv_ca_index_len")


def _all_gather(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Rank-major concatenation of ``x`` from every rank (bool travels as uint8 for gloo)."""
    import torch.distributed as dist

    send = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    out = [torch.empty_like(send) for _ in range(world_size)]
    dist.all_gather(out, send)
    cat = torch.cat(out)
    return cat.to(torch.bool) if x.dtype == torch.bool else cat


def _row_tensors(md: Any) -> dict[str, torch.Tensor]:
    return {p: t for p, t in md.tensors() if p.split(".")[0] in VIEW_ROW_FIELDS}


def _check_unmirrored(flat_view: Any, mirrored_view: Any, world_size: int, what: str) -> int:
    """all_gather(rows of every rank)[reverse] == rows of the non-CP view, per row field."""
    from cpmeta.cp.zigzag import unmirror

    want = _row_tensors(flat_view)
    got = _row_tensors(mirrored_view)
    assert set(got) == set(want), f"{what}: {sorted(got)} vs {sorted(want)}"
    for path in sorted(want):  # same order on every rank
        rows = _all_gather(got[path], world_size)
        assert torch.equal(unmirror(rows, mirrored_view.mirror_cp_reverse_index), want[path]), f"{what} {path}"
    return len(want)


def _check_redistribution(md: Any, mine: Any, view: Any, world_size: int, what: str) -> int:
    """The boundary all_gather moves this rank's kept full-mirror rows to the compact-mirror rows."""
    from cpmeta.cp.zigzag import mirror_rows

    real = view.mirror_cp_index >= 0
    assert torch.equal(mine.yoco_cp_boundary_index >= 0, real), what
    compact_full_row = mirror_rows(md.yoco_consumer_query_indices, view.mirror_cp_index, -1)
    payloads = {  # name: (this rank's full-mirror rows, the compact-mirror rows they must become)
        "positions": (mine.positions, view.positions),
        "row": (mirror_rows(torch.arange(md.total_q, dtype=torch.int32), mine.mirror_cp_index, 0),
                compact_full_row),
        "input_ids": (mirror_rows(md.input_ids, mine.mirror_cp_index, 0),
                      mirror_rows(md.input_ids, compact_full_row, 0)),
    }
    for name, (full_mirror_rows, want) in payloads.items():
        gathered = _all_gather(mirror_rows(full_mirror_rows, mine.yoco_cp_contrib_index, 0), world_size)
        got = mirror_rows(gathered, mine.yoco_cp_boundary_index, 0)
        assert torch.equal(got[real], want[real]), f"{what}: {name}"
    return len(payloads)


def _worker(rank: int, world_size: int, n_cases: int, seed_base: int) -> dict[str, int]:
    import cpmeta
    from cpmeta.diff import metadata_diff
    from reference_yoco import ref_yoco_cp
    from strategies import random_config, random_prompt_batch

    checks = 0
    with cpmeta.MetadataBroadcaster(group=None, src=0) as bcast:
        for case in range(n_cases):
            rng = random.Random(seed_base + case)  # identical draw on every rank
            mode = "mask" if case % 4 == 3 else "compact"
            cfg = random_config(rng, yoco_keep_tokens=rng.choice([1, 3, 8, 24, 80]), yoco_mode=mode)
            seqs = random_prompt_batch(rng, cfg, max_total_q=rng.choice([8, 40, 160]), whole_prompt=True)
            what = f"rank {rank} case {case} ({mode})"
            md = bcast.broadcast(cpmeta.prepare_prompt(seqs, cfg) if rank == 0 else None)
            local = cpmeta.prepare_prompt(seqs, cfg)
            assert metadata_diff(md, local) == [], f"{what}: {metadata_diff(md, local)}"
            get_view = (lambda m: m.get_mask_view()) if mode == "mask" else (lambda m: m.get_consumer_view())
            flat_view = get_view(md).compute_attn_info(cfg)
            driver_view = bcast.broadcast(flat_view if rank == 0 else None)
            assert metadata_diff(flat_view, driver_view) == [], f"{what}: {metadata_diff(flat_view, driver_view)}"
            mine = cpmeta.prepare_for_mirror_cp(md, rank, world_size)
            view = get_view(mine).compute_attn_info(cfg)
            checks += _check_unmirrored(flat_view, view, world_size, what)
            if mode == "compact":
                ref = ref_yoco_cp(seqs, cfg, world_size, rank)
                for name in ("yoco_consumer_cp_mirror_len", "yoco_consumer_cp_contrib_pad_len",
                             "yoco_cp_contrib_index", "yoco_cp_boundary_index"):
                    got = getattr(mine, name)
                    assert (got.tolist() if isinstance(got, torch.Tensor) else got) == ref[name], f"{what}: {name}"
                checks += _check_redistribution(md, mine, view, world_size, what)
    return {"checks": checks}


@pytest.mark.parametrize("world_size", [2, 4])
def test_yoco_on_real_ranks(world_size: int) -> None:
    results = run_ranks(_worker, world_size, CASES_PER_RUN, SEED_BASE + 100 * world_size, timeout=TIMEOUT_S)
    assert len(results) == world_size
    assert len({r["checks"] for r in results}) == 1 and results[0]["checks"] >= 4 * CASES_PER_RUN
