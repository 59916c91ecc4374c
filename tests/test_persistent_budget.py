"""``persistent_outputs`` on real gloo ranks: the budget (held layouts and bytes, LRU eviction),
depth 2's lifetime, and a derived read plan that outlives its arena's next step.

The trace test runs the case that made the budget necessary -- 300 steps of 16k-32k-token chunked
prompts (seed config), a new layout almost every step -- and checks the arenas, bytes and RSS stay
within it.
"""

from __future__ import annotations

import pytest
import torch

from multiproc import run_ranks
from persistent_trace import run_trace

MiB = 1 << 20


def _tiny(n: int, v: int, is_prompt: bool = False):
    """A one-tensor metadata whose layout is ``n`` (its positions' length); values start at ``v``."""
    import cpmeta

    return cpmeta.InputMetadata(is_prompt=is_prompt, num_seqs=1, total_q=n,
                                positions=torch.arange(v, v + n, dtype=torch.int32))


# ---- the budget: traces, LRU eviction, validation -------------------------------------------------


def test_chunked_prefill_trace_stays_in_the_budget() -> None:
    from cpmeta.broadcast.persistent import MAX_ARENA_BYTES, MAX_HELD_LAYOUTS

    for r in run_ranks(run_trace, 2, "chunked_prefill", True, timeout=600):
        assert r["steps"] == 300 and r["fresh"] == 0 and r["persisted"] == 300, r
        assert r["arenas"] <= MAX_HELD_LAYOUTS and r["host_bytes"] <= MAX_ARENA_BYTES, r
        assert r["evicted"] > 200, r  # (almost) every step a new layout
        assert r["rss_peak_growth"] < MAX_ARENA_BYTES + 96 * MiB, r  # the budget + the allocator's slack


def test_decode_trace_depth_two_within_the_layouts() -> None:
    from cpmeta.broadcast.persistent import MAX_HELD_LAYOUTS

    for r in run_ranks(run_trace, 2, "decode", 2, 7, 120, timeout=600):
        assert r["persisted"] == 120 and r["arenas"] <= 2 * MAX_HELD_LAYOUTS and r["evicted"] > 0, r


def _lru(rank: int, world: int) -> list:
    import cpmeta
    import cpmeta.broadcast.persistent as P

    # a one-tensor step's arena is the frame's region: 4 bytes per position, rounded up to 16
    size = {n: -(-4 * n // 16) * 16 for n in (4, 8, 12, 16)}
    P.MAX_ARENA_BYTES = size[16] + size[12] + size[8]  # 144: a, b, c fit
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True, metrics=True) as bc:
        def step(n: int, v: int):
            return bc.broadcast(_tiny(n, v) if rank == 0 else None)

        a, b, _ = step(16, 0), step(12, 0), step(8, 0)
        a2 = step(16, 1)  # touch a: b is now the least recently used
        step(4, 0)  # 144 + 16 > 144: b goes (LRU), 112 held
        b2, a3 = step(12, 2), step(16, 3)  # b: a new arena (c goes: 128 held); a: its arena
        big = step(40, 5)  # 160 bytes > the whole budget: fresh tensors, nothing evicted
        st = bc.stats().arenas
        assert st is not None
        return [a2 is a, b2 is b, a3 is a, int(b.positions[0]), st["evicted"], st["host_bytes"],
                size[16] + size[4] + size[12], st["fresh"], int(big.positions[0])]


def test_lru_eviction_by_bytes() -> None:
    for same_a, same_b, still_a, old_b, evicted, held, want, fresh, big in run_ranks(_lru, 2, timeout=120):
        assert same_a and still_a and not same_b
        assert old_b == 0, "an evicted arena's result must stay as it was"
        assert evicted == 2 and held == want == 128
        assert fresh == 1 and big == 5


def test_persistent_outputs_validation() -> None:
    from cpmeta.broadcast.persistent import MAX_DEPTH, depth_of

    assert (depth_of(False), depth_of(None), depth_of(True), depth_of(3)) == (0, 0, 1, 3)
    for bad in ("yes", 0, MAX_DEPTH + 1, 1.0, -1):
        with pytest.raises(ValueError, match="persistent_outputs"):
            depth_of(bad)


# ---- depth 2: step N unchanged by step N+1 -------------------------------------------------------


def _depth(rank: int, world: int, depth: int) -> list:
    import cpmeta

    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=depth, metrics=True) as bc:
        r = [bc.broadcast(_tiny(8, 100 * i) if rank == 0 else None) for i in range(1)]
        kept = []
        for i in range(1, 6):  # same layout every step
            r.append(bc.broadcast(_tiny(8, 100 * i) if rank == 0 else None))
            kept.append(int(r[-2].positions[0]))  # the previous step's result, after this one
        return [kept, r[2] is r[0], r[1] is r[0]]


@pytest.mark.parametrize("depth", [1, 2])
def test_depth_two_keeps_the_previous_step(depth: int) -> None:
    for kept, second_next, next_ in run_ranks(_depth, 2, depth, timeout=120):
        if depth == 2:  # step N untouched by N+1; N+2 reuses N's arena (same object)
            assert kept == [0, 100, 200, 300, 400] and second_next and not next_
        else:  # depth 1: step N+1 rewrote step N (same object)
            assert kept == [100, 200, 300, 400, 500] and next_


# ---- a derived read plan keeps its own step ------------------------------------------------------


def _decode_md(base: int, lens: list[int]):
    import cpmeta

    cfg = cpmeta.MetadataConfig(block_size=16, max_model_len=512, dense_compress_ratios=(),
                                sparse_compress_ratios=(), window_size=0)
    seqs = [cpmeta.SequenceMetadata(
        seqlen_q=1, seqlen_k=k, state_id=i, token_ids=list(range(1, k + 1)),
        block_table=list(range(base + 40 * i, base + 40 * i + cpmeta.blocks_needed(k, cfg))))
        for i, k in enumerate(lens)]
    return cfg, cpmeta.prepare_decode(seqs, cfg)


def _plan_outlives(rank: int, world: int) -> list:
    import cpmeta

    steps = [_decode_md(1000 * i, [20 + i, 33 + i, 50 + i]) for i in range(3)]
    cfg = steps[0][0]
    want = cpmeta.cp_kv_read_plan(steps[0][1], cfg, cp_rank=0)
    out = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bc:
        md0 = bc.broadcast(steps[0][1] if rank == 0 else None)
        plan = cpmeta.cp_kv_read_plan(md0, cfg, cp_rank=0)
        for i in (1, 2):
            md = bc.broadcast(steps[i][1] if rank == 0 else None)
            out.append(md is md0)  # the arena was rewritten under md0 ...
            out.append(plan.slots.tolist() == want.slots.tolist()  # ... not under the plan
                       and torch.equal(plan.block_tables, want.block_tables)
                       and torch.equal(plan.seqlens, want.seqlens))
    return out


def test_read_plan_outlives_its_arenas_next_step() -> None:
    for res in run_ranks(_plan_outlives, 2, timeout=120):
        assert res == [True, True, True, True], res
