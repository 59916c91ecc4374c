"""``PersistentPolicy`` on real gloo ranks (issue 32 items 3-4): the budget, what is persisted,
LRU eviction, the bytes held, depth-2 lifetime, the generation check and the debug poison.

The trace test reproduces the issue's finding -- 300 steps of 16k-32k-token chunked prompts (seed
config) with ``persistent_outputs=True`` end with 256 arenas and hundreds of MiB per rank -- and
shows a budget holding on the same trace (arena bytes and RSS growth).
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


# ---- the trace: unbounded by default, held by a budget -------------------------------------


def test_chunked_prefill_trace_grows_without_a_budget() -> None:
    for r in run_ranks(run_trace, 2, "chunked_prefill", True, timeout=600):
        assert r["steps"] == 300 and r["fresh"] == 0
        assert r["arenas"] == 256, r  # every step a new layout: the MAX_LAYOUTS cap is reached
        assert r["host_bytes"] > 300 * MiB and r["rss_growth"] > 300 * MiB, r


def test_budget_holds_on_the_chunked_prefill_trace() -> None:
    from cpmeta.broadcast import PersistentPolicy

    pol = PersistentPolicy(max_bytes=32 * MiB, max_layouts=16, min_repeats=2)
    for r in run_ranks(run_trace, 2, "chunked_prefill", pol, timeout=600):
        assert r["steps"] == 300
        assert r["arenas"] <= 16 and r["host_bytes"] <= 32 * MiB, r
        assert r["persisted"] + r["fresh"] == 300 and r["fresh"] > 250, r  # most never repeat
        assert r["rss_peak_growth"] < 32 * MiB + 96 * MiB, r  # the budget + the allocator's slack


def test_decode_trace_kinds_and_budget() -> None:
    from cpmeta.broadcast import PersistentPolicy

    pol = PersistentPolicy(max_layouts=8, kinds=("decode",))
    for r in run_ranks(run_trace, 2, "decode", pol, 7, 120, timeout=600):
        assert r["persisted"] == 120 and r["arenas"] <= 8 and r["evicted"] > 0, r


# ---- admission, eviction, bytes held (known small traces) --------------------------------------------


def _admission(rank: int, world: int) -> list:
    import cpmeta
    from cpmeta.broadcast import PersistentPolicy

    out = []
    pol = PersistentPolicy(min_repeats=2, kinds=("decode",))
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=pol, metrics=True) as bc:
        prev: dict = {}
        # layouts (length, is_prompt): 3 d, 3 d, 3 d, 5 d, 4 p, 4 p, 5 d, 3 d
        for i, (n, p) in enumerate([(3, 0), (3, 0), (3, 0), (5, 0), (4, 1), (4, 1), (5, 0), (3, 0)]):
            got = bc.broadcast(_tiny(n, 10 * i, bool(p)) if rank == 0 else None)
            assert got.positions.tolist() == list(range(10 * i, 10 * i + n))
            out.append(prev.get((n, p)) is got)
            prev[(n, p)] = got
        a = bc.stats().arenas
        assert a is not None
        out.append([a["persisted"], a["fresh"], a["layouts"], a["host_bytes"]])
    return out


def test_min_repeats_and_kinds() -> None:
    for res in run_ranks(_admission, 2, timeout=120):
        # 3d: 1st fresh, 2nd persisted (new arena), 3rd the same arena; 5d fresh then persisted;
        # prompts never; the last 3d is its arena again
        assert res[:8] == [False, False, True, False, False, False, False, True], res
        persisted, fresh, layouts, nbytes = res[8]
        assert (persisted, fresh, layouts) == (4, 4, 2)
        assert nbytes == 16 + 32  # the frame's regions of int32 [3] and [5] (rounded up to 16)


def _lru(rank: int, world: int) -> list:
    import cpmeta
    from cpmeta.broadcast import PersistentPolicy

    # a one-tensor step's arena is the frame's region: 4 bytes per position, rounded up to 16
    size = {n: -(-4 * n // 16) * 16 for n in (4, 8, 12, 16)}
    pol = PersistentPolicy(max_bytes=size[16] + size[12] + size[8])  # 144: a, b, c fit
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=pol, metrics=True) as bc:
        def step(n: int, v: int):
            return bc.broadcast(_tiny(n, v) if rank == 0 else None)

        a, b, _ = step(16, 0), step(12, 0), step(8, 0)
        a2 = step(16, 1)  # touch a: b is now the least recently used
        step(4, 0)  # 144 + 16 > 144: b goes (LRU), 112 held
        b2, a3 = step(12, 2), step(16, 3)  # b: a new arena (c goes: 128 held); a: its arena
        st = bc.stats().arenas
        assert st is not None
        return [a2 is a, b2 is b, a3 is a, int(b.positions[0]), st["evicted"], st["host_bytes"],
                size[16] + size[4] + size[12]]


def test_lru_eviction_by_bytes() -> None:
    for same_a, same_b, still_a, old_b, evicted, held, want in run_ranks(_lru, 2, timeout=120):
        assert same_a and still_a and not same_b
        assert old_b == 0, "an evicted arena's result must stay as it was"
        assert evicted == 2 and held == want == 128


def test_policy_validation() -> None:
    from dataclasses import dataclass

    from cpmeta.broadcast import PersistentPolicy
    from cpmeta.broadcast.persistent import PersistentArenas
    from cpmeta.broadcast.schema import Schema

    for bad in (dict(max_bytes=-1), dict(depth=0), dict(depth=9), dict(min_repeats=0),
                dict(max_layouts=257), dict(kinds="decode"), dict(kinds=("prefill",)),
                dict(max_bytes=1.5)):
        with pytest.raises(ValueError, match="PersistentPolicy"):
            PersistentPolicy(**bad)
    with pytest.raises(TypeError, match="persistent_outputs"):
        PersistentPolicy.of("yes")
    assert PersistentPolicy.of(True) == PersistentPolicy() and PersistentPolicy.of(False) is None

    @dataclass
    class NoKind:
        x: torch.Tensor  # [n] int32

    with pytest.raises(ValueError, match="is_prompt"):
        PersistentArenas(torch.device("cpu"), Schema.of(NoKind), PersistentPolicy(kinds=("decode",)))


# ---- depth 2: step N unchanged by step N+1 -------------------------------------------------------


def _depth(rank: int, world: int, depth: int) -> list:
    import cpmeta
    from cpmeta.broadcast import PersistentPolicy

    pol = PersistentPolicy(depth=depth)
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=pol, metrics=True) as bc:
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


# ---- a stale derived object is refused; the debug poison -------------------------------------------


def _decode_md(base: int, lens: list[int]):
    import cpmeta

    cfg = cpmeta.MetadataConfig(block_size=16, max_model_len=512, dense_compress_ratios=(),
                                sparse_compress_ratios=(), window_size=0)
    seqs = [cpmeta.SequenceMetadata(
        seqlen_q=1, seqlen_k=k, state_id=i, token_ids=list(range(1, k + 1)),
        block_table=list(range(base + 40 * i, base + 40 * i + cpmeta.blocks_needed(k, cfg))))
        for i, k in enumerate(lens)]
    return cfg, cpmeta.prepare_decode(seqs, cfg)


def _stale(rank: int, world: int, depth: int) -> list:
    import cpmeta
    from cpmeta.broadcast import PersistentPolicy
    from cpmeta.lifetime import StaleResultError

    steps = [_decode_md(1000 * i, [20 + i, 33 + i, 50 + i]) for i in range(3)]
    cfg = steps[0][0]
    out = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=60,
                                    persistent_outputs=PersistentPolicy(depth=depth)) as bc:
        md0 = bc.broadcast(steps[0][1] if rank == 0 else None)
        plan = cpmeta.cp_kv_read_plan(md0, cfg, cp_rank=0)
        want = cpmeta.cp_kv_read_plan(steps[0][1], cfg, cp_rank=0).slots.tolist()
        for i in (1, 2):
            bc.broadcast(steps[i][1] if rank == 0 else None)
            try:
                out.append(plan.slots.tolist() == want)
            except StaleResultError as e:
                out.append(str(e))
    fresh = cpmeta.cp_kv_read_plan(steps[0][1], cfg, cp_rank=0)  # not in an arena: never stale
    out.append(fresh._stamp is None)
    return out


@pytest.mark.parametrize("depth", [1, 2])
def test_stale_read_plan_is_refused(depth: int) -> None:
    for res in run_ranks(_stale, 2, depth, timeout=120):
        after_next, after_second, unstamped = res
        assert unstamped
        if depth == 1:
            assert isinstance(after_next, str) and "KVReadPlan.slots" in after_next, res
            assert "generation" in after_next
        else:
            assert after_next is True, res  # still valid after the next broadcast
            assert isinstance(after_second, str) and "rewritten" in after_second, res


def _poisoned(rank: int, world: int) -> list:
    import cpmeta
    from cpmeta.broadcast import PersistentPolicy
    from cpmeta.lifetime import StaleResultError

    steps = [_decode_md(1000 * i, [20 + i, 33 + i]) for i in range(3)]
    cfg = steps[0][0]
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, metrics=True,
                                    persistent_outputs=PersistentPolicy(depth=1)) as bc:
        md0 = bc.broadcast(steps[0][1] if rank == 0 else None)
        plan = cpmeta.cp_kv_read_plan(md0, cfg, cp_rank=0)
        md1 = bc.broadcast(steps[1][1] if rank == 0 else None)
        with pytest.raises(StaleResultError):
            plan.slots
        ok = torch.equal(md1.block_tables, steps[1][1].block_tables)
        poisoned = bool((md0.block_tables == torch.iinfo(torch.int32).max).all())
        with pytest.raises(IndexError):  # a stale read used as an index fails loudly
            torch.zeros(4096)[md0.block_tables.long()]
        st = bc.stats().arenas
        assert st is not None
        return [md1 is md0, ok, poisoned, st["retired"], st["arenas"]]


def test_poison_mode_makes_stale_reads_loud() -> None:
    env = {"CPMETA_POISON_ARENAS": "1"}
    for same, ok, poisoned, retired, arenas in run_ranks(_poisoned, 2, env=env, timeout=120):
        assert not same and ok and poisoned
        assert retired == 1 and arenas == 1
