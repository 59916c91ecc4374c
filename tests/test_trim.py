"""Trimmed tables on the frame: ``block_tables`` (and ``kv_ca_index``) travel as their used columns.

A decode step's ``block_tables`` is ``max_model_len``'s columns wide but its rows define only
``blocks_needed`` of them, -1 after. The driver frames the columns up to the widest row's last
non-pad entry (``cpmeta.broadcast.trim_njit.used_columns``); every follower restores the full
width and the pad, so each rank holds the driver's tensor bit for bit -- including pad values
INSIDE a row and rows that do not end in pad at all (those are sent whole).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multiproc import run_ranks


def _used_reference(a: np.ndarray, pad: int) -> int:
    """Per entry: one past the last column of any row whose entry is not ``pad``."""
    used = 0
    for r in range(a.shape[0]):
        for c in range(a.shape[1]):
            if a[r, c] != pad:
                used = max(used, c + 1)
    return used


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 6), st.integers(0, 9), st.integers(0, 2**31 - 1), st.sampled_from([-1, 0, 7]))
def test_used_columns_equals_reference(rows: int, cols: int, seed: int, pad: int) -> None:
    from cpmeta.broadcast.trim_njit import used_columns

    rng = np.random.default_rng(seed)
    a = np.full((rows, cols), pad, np.int32)
    for r in range(rows):  # a defined prefix, pad inside it now and then, pad after
        n = int(rng.integers(0, cols + 1))
        a[r, :n] = rng.choice([pad, 3, 5, -7], size=n)
    assert used_columns(a, pad) == _used_reference(a, pad)


def _decode_md(seed: int, max_model_len: int = 8192):
    import cpmeta
    from cpmeta.launch.scheduler import plain_config

    rng = random.Random(seed)
    cfg = plain_config(max_model_len=max_model_len)
    seqs = []
    for i in range(12):
        n = rng.randrange(1, 700)  # keys; one query row, no drafts
        seqs.append(cpmeta.SequenceMetadata(
            seqlen_q=1, seqlen_k=n, block_table=list(range(i * 64, i * 64 + cpmeta.blocks_needed(n, cfg))),
            state_id=i, token_ids=[rng.randrange(1, 1000) for _ in range(n)]))
    return cfg, cpmeta.prepare_decode(seqs, cfg)


def test_plan_narrows_and_widens_bit_identically() -> None:
    """One process: the framed dims carry the used columns then the full width; widening the
    narrowed view gives back the driver's tensor; a frame whose width word is below its columns
    is refused naming the table."""
    from cpmeta.broadcast.collect import collect
    from cpmeta.broadcast.plan import Plan, trim_slots, trim_widths
    from cpmeta.broadcast.schema import INPUT_METADATA
    from cpmeta.broadcast.wire import WireError

    cfg, md = _decode_md(3)
    key, tensors, _ = collect(md, INPUT_METADATA)
    widths = trim_widths(trim_slots(INPUT_METADATA, *key[:3]), tensors)
    assert widths == [md.block_tables.shape[1]]
    plan = Plan(INPUT_METADATA, key[0], list(key[1]), list(key[2]), key[3], widths)
    assert [plan.tensor_paths[i] for i, _, _, _ in plan.trims] == ["block_tables"]
    framed, dims = plan.narrow(tensors)
    (i, at, pad, cols), = plan.trims
    bt = md.block_tables
    used = int((bt != -1).nonzero()[:, 1].max()) + 1
    assert framed[i].shape == (bt.shape[0], used) and dims[at] == used and cols == bt.shape[1]
    assert plan.trimmed(dims) and plan.full_dims(dims)[at] == bt.shape[1]
    numels, starts, region, exact = plan.sizes(dims)
    whole = plan.sizes(plan.narrow(tensors, trim=False)[1])[3]
    assert whole - exact == bt.shape[0] * (bt.shape[1] - used) * 4
    buf = torch.zeros(region, dtype=torch.uint8)
    plan.pack(buf.data_ptr(), framed, numels, starts)
    got = plan.widen(plan.views(buf, dims, numels, starts), dims)
    for a, b in zip(got, tensors):
        assert a.dtype == b.dtype and torch.equal(a, b)
    bad = list(dims)
    bad[at] = cols + 1
    with pytest.raises(WireError, match="block_tables: .* columns sent of a table"):
        plan.sizes(tuple(bad))
    for tail in (None, [], [cols, cols], [-1], ["512"]):  # the layout's widths are proven
        with pytest.raises(WireError, match="trimmed-table widths"):
            Plan(INPUT_METADATA, key[0], list(key[1]), list(key[2]), key[3], tail)


def _trimmed_ranks(rank: int, world: int, seed: int, force_remote: bool, persistent: bool) -> list:
    import cpmeta
    from cpmeta.testing import assert_same

    sizes = []
    with cpmeta.MetadataBroadcaster(src=0, force_remote=force_remote, timeout=30, metrics=True,
                                    persistent_outputs=persistent) as bc:
        for step in range(6):
            cfg, md = _decode_md(seed + step)
            bt = md.block_tables
            if step == 3:  # pad INSIDE rows and a row that does not end in pad: exact either way
                bt[0, :3] = torch.tensor([-1, 5, -1], dtype=torch.int32)
                bt[1, -1] = 11
            if step == 4:  # every entry pad
                bt.fill_(-1)
            got = bc.broadcast(md if rank == 0 else None)
            assert_same(got, md)
            assert got.block_tables.shape == bt.shape and torch.equal(got.block_tables, bt)
            sizes.append((bc.stats().bytes_total, _framed_bytes(md)))
            if step < 3:  # after expansion too
                md.compute_attn_info(cfg)
                assert_same(bc.broadcast(md if rank == 0 else None), md)
                sizes.append((bc.stats().bytes_total, _framed_bytes(md)))
        # a follower's out= buffers (full width, captured once) get the restored table
        cfg, md = _decode_md(seed + 10)
        have = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
        out = cpmeta.InputMetadata(**{f: (torch.full((64, t.shape[1]), 99, dtype=t.dtype)
                                          if f == "block_tables" else
                                          torch.empty((256,) + tuple(t.shape[1:]), dtype=t.dtype))
                                      for f, t in have.items() if isinstance(t, torch.Tensor)})
        got = bc.broadcast(md if rank == 0 else None, out=out)
        assert torch.equal(got.block_tables, md.block_tables)
        assert got.block_tables.data_ptr() == out.block_tables.data_ptr()
    return sizes


def _framed_bytes(md) -> tuple[int, int]:
    """``(tensor bytes with block_tables cut to its used columns, bytes saved by the cut)``."""
    seen = {id(t): t for f in dataclasses.fields(md) for t in _tensors(getattr(md, f.name))}
    total = sum(t.numel() * t.element_size() for t in seen.values())
    bt = md.block_tables
    used = _used_reference(bt.numpy(), -1)
    saved = bt.shape[0] * (bt.shape[1] - used) * 4
    return total - saved, saved


def _tensors(v) -> list:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for t in v.values() if isinstance(t, torch.Tensor)] if isinstance(v, dict) else []


@pytest.mark.parametrize("force_remote,persistent", [(False, False), (True, False), (False, True)],
                         ids=["ring", "process-group", "ring-persistent"])
def test_trimmed_tables_reach_every_rank_bit_identical(force_remote: bool, persistent: bool) -> None:
    """3 ranks: every follower holds the driver's decode metadata bit for bit, step after step
    (widths change, pad inside rows, a row that does not end in pad, an all-pad table, after
    compute_attn_info, into out= buffers); each frame carries the tables cut to their used
    columns (whole with persistent_outputs: its arenas' views hold whole tables)."""
    seed = random.Random(7).randrange(1 << 20)
    driver = run_ranks(_trimmed_ranks, 3, seed, force_remote, persistent, timeout=180)[0]
    prev = 0
    for total, (tensor_bytes, saved) in driver:  # each frame: its tensors, cut, + values and layout
        sent = tensor_bytes + (saved if persistent else 0)  # persistent arenas hold whole tables
        assert 0 <= total - prev - sent < 4096, driver
        prev = total
    assert sum(saved for _, (_, saved) in driver) > 0, driver
