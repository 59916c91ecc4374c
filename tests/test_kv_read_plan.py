"""``cpmeta.cp_kv_read_plan`` (docs/design.md section 14) against the per-key reference, and against the write side.

Metadata comes from ``prepare_prompt`` / ``prepare_decode`` on a plain config (KV sharded over
W in {1, 2, 3} ranks, interleave 1 or ``block_size``) and on the seed's default-style config
(compressed KV, W = 1, tables long enough for uncompressed KV). The property: over all ranks,
every key of every entry appears exactly once, at the slot ``compute_slot_mapping`` gives it.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpmeta
import cpmeta.cp
from cpmeta import InputMetadata, MetadataConfig, SequenceMetadata

sys.path.insert(0, os.path.dirname(__file__))
from reference_read_plan import ref_entries, ref_read_plan  # noqa: E402
from strategies import _DrawRng, random_decode_batch, random_prompt_batch  # noqa: E402

I32 = torch.int32


def plain(block_size: int = 16, max_model_len: int = 512, world: int = 1, interleave: int = 1) -> MetadataConfig:
    return MetadataConfig(block_size=block_size, max_model_len=max_model_len, dense_compress_ratios=(),
                          sparse_compress_ratios=(), window_size=0,
                          kv_cp_world_size=world, kv_cp_interleave=interleave)


def seed_like() -> MetadataConfig:
    """``MetadataConfig.compressed_swa()`` at a test-sized max_model_len (compressed KV, SWA, W = 1)."""
    return MetadataConfig(block_size=16, max_model_len=512, window_size=8, swa_block_size=8,
                          dense_compress_ratios=(4,), sparse_compress_ratios=(4,))


def uncompressed_tables(seqs: list[SequenceMetadata], cfg: MetadataConfig, rng: random.Random) -> list[SequenceMetadata]:
    """The same sequences with tables long enough for every uncompressed key (seed config)."""
    out = []
    for s in seqs:
        need = -(-s.seqlen_k // cfg.block_size) + rng.choice([0, 0, 1])
        out.append(dataclasses.replace(s, block_table=rng.sample(range(4000), need)))
    return out


def check_against_reference(md: InputMetadata, cfg: MetadataConfig, rank: int) -> cpmeta.cp.KVReadPlan:
    plan = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
    ref = ref_read_plan(md, cfg, rank)
    assert plan.seqlens.dtype == I32 and plan.cu_seqlens.dtype == I32 and plan.block_tables.dtype == I32
    assert plan.seqlens.tolist() == ref.seqlens
    assert plan.cu_seqlens.tolist() == ref.cu_seqlens
    assert plan.max_total == ref.max_total
    assert plan.positions.dtype == torch.int64 and plan.slots.dtype == torch.int64
    assert plan.positions.tolist() == ref.positions
    assert plan.slots.tolist() == ref.slots
    assert plan.total == len(ref.positions)
    return plan


def check_write_side(md: InputMetadata, cfg: MetadataConfig) -> None:
    """Over all ranks every key of every entry appears exactly once, at the slot the write side
    (``compute_slot_mapping`` over every key position) gives it on that rank."""
    w, inter, bs = cfg.kv_cp_world_size, cfg.kv_cp_interleave, cfg.block_size
    entries = ref_entries(md)
    lens = [0 if ph else keys for keys, ph, _ in entries]
    qsl = torch.tensor([0] + lens, dtype=I32).cumsum(0).to(I32)
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    table = md.seq_block_tables if md.is_prompt else md.block_tables
    seen: list[dict[int, int]] = [{} for _ in entries]  # entry -> position -> times held
    for rank in range(w):
        plan = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
        want = cpmeta.compute_slot_mapping(qsl, pos, table, bs, max_num_tokens=int(pos.numel()),
                                           cp_world_size=w, cp_rank=rank, cp_interleave=inter)
        cu = plan.cu_seqlens.tolist()
        for e in range(len(entries)):
            p_e = plan.positions[cu[e]:cu[e + 1]].tolist()
            s_e = plan.slots[cu[e]:cu[e + 1]].tolist()
            w_e = want[int(qsl[e]):int(qsl[e + 1])].tolist()
            assert {p: s for p, s in zip(p_e, s_e)} == {p: s for p, s in enumerate(w_e) if s != -1}, (rank, e)
            for p in p_e:
                seen[e][p] = seen[e].get(p, 0) + 1
    for e, n in enumerate(lens):
        assert seen[e] == {p: 1 for p in range(n)}, f"entry {e}: keys not held exactly once"


# ---- named cases ------------------------------------------------------------------------------


def test_docstring_example_decode() -> None:
    """Module/function docstring: W=2, I=2, block 4, rows at positions 6 and 9, table [3, 9, 5]."""
    cfg = plain(block_size=4, max_model_len=12, world=2, interleave=2)
    md = InputMetadata(is_prompt=False, context_lens=torch.tensor([7, 10], dtype=I32),
                       query_indices=torch.tensor([0, 0], dtype=I32),
                       block_tables=torch.tensor([[3, 9, 5], [3, 9, 5]], dtype=I32))
    r1 = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=1)
    assert r1.seqlens.tolist() == [3, 4] and r1.cu_seqlens.tolist() == [0, 3, 7]
    assert r1.positions.tolist() == [2, 3, 6, 2, 3, 6, 7]
    assert r1.slots.tolist() == [12, 13, 14, 12, 13, 14, 15]
    assert r1.max_total == 10 and torch.equal(r1.block_tables, md.block_tables)
    assert r1.block_tables.data_ptr() != md.block_tables.data_ptr()  # unguarded table: the plan's own copy
    r0 = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=0)
    assert r0.positions.tolist() == [0, 1, 4, 5, 0, 1, 4, 5, 8, 9]
    assert r0.slots.tolist() == [12, 13, 14, 15, 12, 13, 14, 15, 36, 37]
    # a row at position p sees the first cp_local_seqlens(p + 1, W, r, I) local keys
    sees = [cpmeta.cp_local_seqlens(torch.tensor([7]), 2, r, 2).item() for r in range(2)]
    assert sees == [4, 3]


def test_plain_prompt_17_tokens_two_blocks() -> None:
    cfg = plain(block_size=16)
    seq = SequenceMetadata(seqlen_q=5, seqlen_k=17, block_table=[7, 2], state_id=0, token_ids=list(range(17)))
    md = cpmeta.prepare_prompt([seq], cfg)
    plan = check_against_reference(md, cfg, 0)
    assert plan.seqlens.tolist() == [17] and plan.max_total == 17
    assert plan.slots.tolist() == list(range(112, 128)) + [32]
    with pytest.raises(ValueError, match=r"seqs\[0\]\.block_table: expected at least 2 blocks for seqlen_k=17"):
        cpmeta.prepare_prompt([dataclasses.replace(seq, block_table=[7])], cfg)


def test_sharded_300_tokens_seven_blocks() -> None:
    """Issue 25's probe: CP 3, block 16, 300 tokens: each rank holds 100 keys in 7 blocks."""
    cfg = plain(block_size=16, max_model_len=300, world=3, interleave=1)
    assert cpmeta.blocks_needed(300, cfg) == 7 and cfg.max_num_blocks == 7
    seq = SequenceMetadata(seqlen_q=300, seqlen_k=300, block_table=list(range(7)), state_id=0,
                           token_ids=list(range(300)))
    md = cpmeta.prepare_prompt([seq], cfg)
    for rank in range(3):
        plan = check_against_reference(md, cfg, rank)
        assert plan.seqlens.tolist() == [100] and plan.max_total == 100
    check_write_side(md, cfg)
    with pytest.raises(ValueError, match=r"seqs\[0\]\.block_table: expected at least 7 blocks"):
        cpmeta.prepare_prompt([dataclasses.replace(seq, block_table=list(range(6)))], cfg)


def test_placeholders_hold_no_keys() -> None:
    cfg = plain(block_size=4, world=2, interleave=4)
    seqs = [SequenceMetadata(seqlen_q=1, seqlen_k=9, block_table=[1, 2], state_id=0, token_ids=list(range(9))),
            SequenceMetadata(seqlen_q=2, seqlen_k=6, block_table=[3], state_id=1, token_ids=list(range(5)),
                             is_placeholder=True, draft_tokens=[1])]
    md = cpmeta.prepare_decode(seqs, cfg)
    plan = check_against_reference(md, cfg, 0)
    assert plan.seqlens.tolist() == [5, 0, 0]  # 9 keys: rank 0 holds 0..3 and 8
    assert plan.max_total == 5
    check_write_side(md, cfg)


def test_mirrored_prompt_gives_the_same_plan() -> None:
    cfg = plain(block_size=4, world=2, interleave=1)
    seqs = [SequenceMetadata(seqlen_q=5, seqlen_k=11, block_table=[4, 8], state_id=0, token_ids=list(range(11))),
            SequenceMetadata(seqlen_q=1, seqlen_k=3, block_table=[6], state_id=1, token_ids=[1, 2, 3])]
    md = cpmeta.prepare_prompt(seqs, cfg)
    for rank in range(2):
        want = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
        mine = cpmeta.prepare_for_mirror_cp(md, rank, 3)
        got = cpmeta.cp_kv_read_plan(mine, cfg, cp_rank=rank)
        for name in ("seqlens", "cu_seqlens", "block_tables", "slots", "positions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert got.max_total == want.max_total


_PLAN_FIELDS = ("seqlens", "cu_seqlens", "block_tables", "max_total", "total", "slots", "positions")


def test_plan_over_a_rewritten_table_keeps_its_step() -> None:
    """A plan whose table lies in a buffer its owner rewrites (a persistent broadcast arena)
    keeps its own step through EVERY public field. Failed on 4ac8a65: only slots/positions were
    guarded, and block_tables silently showed the next step's."""
    cfg = plain(block_size=4, max_model_len=12, world=2, interleave=2)
    arena = torch.tensor([[3, 9, 5], [3, 9, 5]], dtype=I32)
    md = InputMetadata(is_prompt=False, context_lens=torch.tensor([7, 10], dtype=I32),
                       query_indices=torch.tensor([0, 0], dtype=I32), block_tables=arena)
    fresh = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=1)
    lazy = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=1)
    before = {name: getattr(fresh, name) for name in _PLAN_FIELDS}
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in before.items()}
    assert fresh.slots.tolist() == [12, 13, 14, 12, 13, 14, 15]
    arena.copy_(torch.tensor([[1, 2, 4], [6, 7, 8]], dtype=I32))  # the next step's tables
    md.context_lens.copy_(torch.tensor([3, 4], dtype=I32))
    for name in _PLAN_FIELDS:
        for plan in (fresh, lazy):  # slots already computed, or not yet
            got, want = getattr(plan, name), before[name]
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), name


def test_plan_from_reused_output_arenas_keeps_its_step() -> None:
    """Issue 38 item 5: a plan built from ``prepare_decode(..., out=OutputArenas())`` (a host
    arena the next call of the same shape refills, with no generation) keeps its own step's
    table and keys. Fails on 4ac8a65: the plan held the arena's table, so after the next step
    its block_tables and slots were the new step's."""
    cfg = plain(block_size=4, max_model_len=64)
    arenas = cpmeta.OutputArenas()

    def step(tables: list[list[int]]) -> InputMetadata:
        seqs = [SequenceMetadata(seqlen_q=1, seqlen_k=9, block_table=t, state_id=i, token_ids=list(range(9)))
                for i, t in enumerate(tables)]
        return cpmeta.prepare_decode(seqs, cfg, out=arenas)

    md1 = step([[1, 2, 3], [4, 5, 6]])
    plan = cpmeta.cp_kv_read_plan(md1, cfg, cp_rank=0)
    want = {name: getattr(plan, name) for name in ("seqlens", "cu_seqlens", "max_total", "total")}
    want_table = plan.block_tables.clone()
    md2 = step([[7, 8, 9], [10, 11, 12]])
    assert md2.block_tables is md1.block_tables  # the arena was refilled in place
    assert md1.block_tables[0, 0].item() == 7
    assert torch.equal(plan.block_tables, want_table)
    assert plan.slots.tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    for name, value in want.items():
        value2 = getattr(plan, name)
        assert (torch.equal(value2, value) if isinstance(value, torch.Tensor) else value2 == value), name


def test_errors_name_the_field() -> None:
    cfg = plain(block_size=4, world=2)
    seq = SequenceMetadata(seqlen_q=1, seqlen_k=9, block_table=[1, 2, 3], state_id=0, token_ids=list(range(9)))
    md = cpmeta.prepare_prompt([seq], cfg)
    with pytest.raises(ValueError, match="cp_rank"):
        cpmeta.cp_kv_read_plan(md, cfg, cp_rank=2)
    with pytest.raises(TypeError, match="cp_rank"):
        cpmeta.cp_kv_read_plan(md, cfg, cp_rank=True)
    with pytest.raises(TypeError, match="md"):
        cpmeta.cp_kv_read_plan(object(), cfg, cp_rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq_block_tables"):  # a config with smaller blocks
        cpmeta.cp_kv_read_plan(md, plain(block_size=1, world=2), cp_rank=0)
    unsharded = plain(block_size=4)  # W = 1: 9 keys need 3 blocks on every rank
    assert cpmeta.cp_kv_read_plan(md, unsharded, cp_rank=5).seqlens.tolist() == [9]
    short = dataclasses.replace(md, seq_block_tables=torch.tensor([[1, 2, -1]], dtype=I32))
    with pytest.raises(ValueError, match=r"seq_block_tables\[0\].*column 2 is -1"):
        cpmeta.cp_kv_read_plan(short, unsharded, cp_rank=0)
    with pytest.raises(ValueError, match="context_lens"):
        cpmeta.cp_kv_read_plan(InputMetadata(is_prompt=False), cfg, cp_rank=0)
    # index fields of another shape or kind: named before the kernel (a 2-D or float one made numba
    # compile another signature and fail with a TypingError; a short one was read past its end)
    one_d = "expected a 1-D integer tensor"
    for bad, kind, match in (
            ({"query_indices": md.query_indices.view(1, -1)}, TypeError, rf"md.query_indices: {one_d}"),
            ({"cu_seqlens_q": md.cu_seqlens_q.float()}, TypeError, rf"md.cu_seqlens_q: {one_d}"),
            ({"cu_seqlens_q": md.cu_seqlens_q[:1]}, ValueError, r"md.cu_seqlens_q: expected 2 entries, got 1"),
            ({"cu_seqlens_q": torch.tensor([5, 9], dtype=I32)}, ValueError,
             r"md.cu_seqlens_q\[0\]: expected a query row in \[0, 1\]"),
            ({"cu_seqlens_k": torch.tensor([9, 0], dtype=I32)}, ValueError,
             r"md.cu_seqlens_k\[1\] - cu_seqlens_k\[0\]: expected a key count >= 0, got -9"),
            ({"seq_block_tables": md.seq_block_tables.float()}, ValueError,
             r"md.seq_block_tables: expected an integer table")):
        with pytest.raises(kind, match=match):
            cpmeta.cp_kv_read_plan(dataclasses.replace(md, **bad), cfg, cp_rank=0)
    dec = cpmeta.prepare_decode([seq], cfg)
    for bad, match in (({"query_indices": dec.query_indices[:0]}, r"md.query_indices: expected 1 entries, got 0"),
                       ({"context_lens": torch.tensor([-3], dtype=I32)},
                        r"md.context_lens\[0\]: expected a key count >= 0, got -3")):
        with pytest.raises(ValueError, match=match):
            cpmeta.cp_kv_read_plan(dataclasses.replace(dec, **bad), cfg, cp_rank=0)


def test_slots_past_int32_are_exact() -> None:
    """Slots are int64: a block id whose slots pass 2**31 - 1 (the per-key work is int32 only
    while the slots fit)."""
    cfg = plain(block_size=16, max_model_len=64)
    big = 2**27  # slots from 2**31
    md = InputMetadata(is_prompt=False, context_lens=torch.tensor([20, 3], dtype=I32),
                       query_indices=torch.tensor([0, 1], dtype=I32),
                       block_tables=torch.tensor([[big - 1, big], [5, -1]], dtype=I32))
    plan = check_against_reference(md, cfg, 0)
    assert plan.slots.tolist()[:20] == [(big - 1) * 16 + j for j in range(16)] + [big * 16 + j for j in range(4)]


# ---- random batches ----------------------------------------------------------------------------


@st.composite
def plain_cases(draw: st.DrawFn, prompt: bool) -> tuple[MetadataConfig, InputMetadata]:
    rng = _DrawRng(draw)
    bs = rng.choice([4, 8, 16])
    cfg = plain(block_size=bs, max_model_len=rng.choice([40, 100, 200]),
                world=rng.choice([1, 2, 3]), interleave=rng.choice([1, bs]))
    if prompt:
        return cfg, cpmeta.prepare_prompt(random_prompt_batch(rng, cfg, max_total_q=60), cfg)
    return cfg, cpmeta.prepare_decode(random_decode_batch(rng, cfg, max_drafts=3), cfg)


@settings(max_examples=40, deadline=None)
@given(case=plain_cases(prompt=True))
def test_random_plain_prompt(case: tuple[MetadataConfig, InputMetadata]) -> None:
    cfg, md = case
    for rank in range(cfg.kv_cp_world_size):
        check_against_reference(md, cfg, rank)
    check_write_side(md, cfg)


@settings(max_examples=40, deadline=None)
@given(case=plain_cases(prompt=False))
def test_random_plain_decode(case: tuple[MetadataConfig, InputMetadata]) -> None:
    cfg, md = case
    for rank in range(cfg.kv_cp_world_size):
        check_against_reference(md, cfg, rank)
    check_write_side(md, cfg)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), prompt=st.booleans())
def test_random_seed_config(seed: int, prompt: bool) -> None:
    """The seed's config (compressed KV, SWA; W = 1) with tables for uncompressed KV."""
    rng = random.Random(seed)
    cfg = seed_like()
    seqs = random_prompt_batch(rng, cfg, max_total_q=60) if prompt else random_decode_batch(rng, cfg)
    seqs = uncompressed_tables(seqs, cfg, rng)
    md = cpmeta.prepare_prompt(seqs, cfg) if prompt else cpmeta.prepare_decode(seqs, cfg)
    check_against_reference(md, cfg, 0)
    check_write_side(md, cfg)
    if prompt:
        mine = cpmeta.prepare_for_mirror_cp(md, 1, 2)
        assert torch.equal(cpmeta.cp_kv_read_plan(mine, cfg, cp_rank=1).slots,
                           cpmeta.cp_kv_read_plan(md, cfg, cp_rank=1).slots)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_cpu() -> None:
    rng = random.Random(3)
    for world, inter in ((1, 1), (2, 1), (3, 8)):
        cfg = plain(block_size=8, max_model_len=200, world=world, interleave=inter)
        for md in (cpmeta.prepare_prompt(random_prompt_batch(rng, cfg), cfg),
                   cpmeta.prepare_decode(random_decode_batch(rng, cfg), cfg)):
            dev = dataclasses.replace(md, **{f: getattr(md, f).cuda() for f in (
                "cu_seqlens_q", "cu_seqlens_k", "query_indices", "seq_block_tables", "context_lens",
                "block_tables") if getattr(md, f) is not None})
            for rank in range(world):
                a = cpmeta.cp_kv_read_plan(md, cfg, cp_rank=rank)
                b = cpmeta.cp_kv_read_plan(dev, cfg, cp_rank=rank)
                assert b.slots.is_cuda and a.max_total == b.max_total
                for name in ("seqlens", "cu_seqlens", "slots", "positions"):
                    assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
