"""In-place decode across a CP group (docs/design.md section 12, ``cpmeta.gpu.decode_cp``), on real ranks.

Every rank's ``StagedDecodeBroadcaster.broadcast`` result (one staging broadcast, kernels on each
rank, written into the rank's own ``out`` buffers) equals ``MetadataBroadcaster.broadcast`` of
``prepare_decode``'s output on that rank (``metadata_diff(..., cfg=cfg)``), for random decode
batches of several configs: gloo, 2 and 3 ranks, torch backend on the CPU; on CUDA (skipped
without): world 1 NCCL, and 2-3 gloo ranks sharing ``cuda:0``, each replaying ITS OWN captured
graph of the kernels after ``stage()``. Malformed messages (wrong version / scalars / dtype /
header offsets / block-table offsets / ratios) are a ``RuntimeError`` naming the follower's rank,
and a batch the driver refuses (too large for its buffers) is refused on every rank.

The driver's ``BatchState`` entry points (``broadcast_state`` / ``stage_state``, followers still
``broadcast(None)`` / ``stage(None)``): every rank's metadata equals ``prepare_decode(
state.decode_batch(same args))``, with and without MTP drafts and placeholders, also for an
Engram config (the state's general fallback); the driver's refusals reach every rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from typing import Any

import numpy as np
import pytest
import torch

from multiproc import run_ranks

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
N_CAP, Q_CAP = 8, 32  # out buffers: 8 sequences x up to 4 rows
STEPS = 5


def _capture_batch(cfg):  # type: ignore[no-untyped-def]
    """A deterministic batch of exactly N_CAP sequences and Q_CAP rows (allocates the out buffers)."""
    from strategies import random_decode_batch

    for seed in range(10_000):
        seqs = random_decode_batch(random.Random(seed), cfg, n_seqs=N_CAP, max_drafts=3)
        if sum(s.seqlen_q for s in seqs) == Q_CAP:
            return seqs
    raise AssertionError("no capture batch found")


def _configs():  # type: ignore[no-untyped-def]
    from strategies import random_config

    return [random_config(random.Random(700 + i), max_model_len=512) for i in range(2)]


def _cp_equals_broadcast(rank: int, world: int, device: str, graph: bool) -> int:
    """Each step: staged broadcast into this rank's buffers == MetadataBroadcaster(prepare_decode)."""
    import cpmeta
    from cpmeta.diff import metadata_diff
    from cpmeta.gpu import DecodeStaging, StagedDecodeBroadcaster, staging_capacity
    from cpmeta.gpu.decode_inplace import launch_decode_inplace, prepare_decode_inplace
    from strategies import metadata_prefix, random_decode_batch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    checked = 0
    for cfg in _configs():
        st = DecodeStaging(dev, staging_capacity(cfg, N_CAP, Q_CAP), fixed=True)
        out: dict[str, torch.Tensor] = {}
        prepare_decode_inplace(_capture_batch(cfg), cfg, out=out, device=dev, staging=st)
        g = md_full = None
        if graph:
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                launch_decode_inplace(st, cfg, out=out)  # warm (compiled already)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(g):
                md_full = launch_decode_inplace(st, cfg, out=out)
        with StagedDecodeBroadcaster(cfg, src=0, device=dev, staging=st, timeout=60) as sb, \
                cpmeta.MetadataBroadcaster(src=0, device=dev, timeout=60) as mb:
            for i in range(STEPS):
                seqs = random_decode_batch(random.Random(31 * i), cfg)  # same on every rank
                if graph:
                    staged = sb.stage(seqs if rank == 0 else None)
                    st.replay(g)
                    got = metadata_prefix(md_full, staged.num_seqs, staged.total_q)
                    got.max_seqlen_q, got.max_seqlen_k = staged.max_seqlen_q, staged.max_seqlen_k
                else:
                    got = sb.broadcast(seqs if rank == 0 else None, out=out)
                ref = mb.broadcast(cpmeta.prepare_decode(seqs, cfg, table_width=cfg.max_num_blocks) if rank == 0 else None)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                assert got.positions.device.type == dev.type
                assert got.positions.data_ptr() == out["positions"].data_ptr(), "not written in place"
                diff = metadata_diff(got, ref, cfg=cfg)
                assert not diff, f"rank {rank} step {i}: {diff}"
                checked += 1
    return checked


def _malformed_messages(rank: int, world: int) -> list[str]:
    """The driver sends hand-made bad frames on the broadcaster's channel; followers must raise
    RuntimeError naming their rank (and stay usable for the next message)."""
    from cpmeta.broadcast import wire
    from cpmeta.broadcast.collect import collect
    from cpmeta.gpu import StagedDecodeBroadcaster
    from cpmeta.gpu.staged_frame import STAGED_SCHEMA, StagedFrame, staged_values
    from strategies import random_decode_batch

    cfg = _configs()[0]
    seqs = random_decode_batch(random.Random(5), cfg, n_seqs=3)
    errors: list[str] = []
    with StagedDecodeBroadcaster(cfg, src=0, device="cpu", timeout=60) as sb:
        staged = sb.staging.fill(seqs, cfg) if rank == 0 else None
        good = sb.staging.host_buffer[: staged.used].clone() if rank == 0 else None
        scal = staged_values(staged) if rank == 0 else None
        key = sb._keys[0]

        def bad_buf(idx: int, value: int) -> torch.Tensor:
            t = good.clone()
            t[idx] = value
            return t

        def unchecked(t: torch.Tensor) -> tuple:  # a layout the driver's own schema would refuse
            STAGED_SCHEMA.check_tensors = lambda *a: None  # type: ignore[method-assign]
            return collect(StagedFrame(*scal, staging=t), STAGED_SCHEMA)[0], [t], scal

        hl = 8 + len(cfg.ca_ratios) + len(cfg.sparse_compress_ratios) + len(cfg.dense_compress_ratios)
        variants = [
            lambda: (collect(StagedFrame(*scal[:5], staging=good), STAGED_SCHEMA)[0], [good], scal[:5]),
            lambda: unchecked(good.to(torch.int64)),                           # dtype
            lambda: (key, [good[:-1]], scal),                                  # truncated
            lambda: "version",                   # version skew (the layout is known by now)
            lambda: (key, [good], [*scal[:1], scal[1] + 1, *scal[2:]]),        # total_q vs header
            lambda: (key, [bad_buf(4, int(good[4]) + 1)], scal),               # off_ids
            lambda: (key, [bad_buf(hl + 6 * staged.num_seqs, 10**6)], scal),   # bt_offset of seq 0
            lambda: (key, [bad_buf(hl + 2 * staged.num_seqs, 99)], scal),      # cu_seqlens_q_incl
            lambda: (key, [bad_buf(8, 3)] if cfg.ca_ratios else [bad_buf(0, 99)], scal),  # ratios / n_seq
        ]
        for make in variants:
            if rank == 0:
                got = make()
                check = STAGED_SCHEMA.check_tensors
                if got == "version":
                    wire.MESSAGE_VERSION += 1
                    sb._ch.send_packed(key, [good], scal)
                    wire.MESSAGE_VERSION -= 1
                else:
                    sb._ch.send_packed(*got)
                STAGED_SCHEMA.check_tensors = check  # type: ignore[method-assign]
            else:
                with pytest.raises(RuntimeError, match=rf"rank {rank}: (staged decode message|malformed "
                                   r"StagedDecodeBroadcaster message|frame version)") as e:
                    sb.broadcast(None)
                errors.append(str(e.value).split(": ", 2)[-1][:60])
        # the channel is still in step: a good batch goes through
        md = sb.broadcast(seqs if rank == 0 else None)
        assert md.num_seqs == 3
        # the driver refuses a batch too large for ITS buffers: every rank raises
        out: dict[str, torch.Tensor] = {}
        if rank == 0:
            from cpmeta.gpu.decode_inplace import prepare_decode_inplace
            prepare_decode_inplace(seqs[:1], cfg, out=out, device="cpu")
            with pytest.raises(ValueError, match="exceed the captured buffers"):
                sb.broadcast(seqs, out=out)
        else:
            with pytest.raises(RuntimeError, match=rf"rank {rank}: .*the driver refused the batch"):
                sb.broadcast(None)
    return errors


def _state_cp_equals_prepare(rank: int, world: int) -> dict[str, int]:
    """The driver's ``broadcast_state`` / ``stage_state`` (followers: ``broadcast(None)`` /
    ``stage(None)``) == ``prepare_decode(state.decode_batch(...))`` on every rank. Every rank
    builds the same engine from the same seed (its reference); only the driver hands it over."""
    from cpmeta import prepare_decode
    from cpmeta.diff import metadata_diff
    from cpmeta.gpu import DecodeStaging, StagedDecodeBroadcaster
    from cpmeta.gpu.decode_inplace import launch_decode_inplace, prepare_decode_inplace
    from strategies import metadata_prefix
    from test_stage_decode import CONFIGS, ENGRAM_CI, PLAIN_CI, _engine

    seen = {"steps": 0, "drafts": 0, "no_drafts": 0, "placeholders": 0, "staged": 0}
    drv = rank == 0
    # no Engram; Engram (stage_decode's general fallback); a plain paged-KV config (docs/design.md section 14)
    for ci in (0, ENGRAM_CI, PLAIN_CI):
        cfg = CONFIGS[ci]
        assert bool(cfg.max_ngram_size) == (ci == ENGRAM_CI) and cfg.has_swa == (ci != PLAIN_CI)
        state, steps = _engine(cfg, random.Random(ci))
        every = np.flatnonzero(state.active)
        st, out = DecodeStaging("cpu", 4096, fixed=True), {}  # out: every request, 3 drafts, 3 placeholders
        prepare_decode_inplace(state.decode_batch(every, np.zeros(3 * len(every), np.int64), np.full(len(every), 3),
                                                  num_placeholders=3), cfg, out=out, device="cpu", staging=st)
        with StagedDecodeBroadcaster(cfg, src=0, device="cpu", staging=st, timeout=60) as sb:
            for i, (slots, drafts, counts, n_ph) in enumerate(steps(6)):
                if i % 3 == 0:
                    drafts = counts = None
                n_ph = 2 if i == 4 else n_ph
                args = (slots, drafts, counts)
                ref = prepare_decode(state.decode_batch(*args, num_placeholders=n_ph), cfg, table_width=cfg.max_num_blocks)
                if i % 3 == 2:  # stage + the kernels on the captured-size buffers (a graph's view)
                    staged = sb.stage_state(state, *args, num_placeholders=n_ph) if drv else sb.stage(None)
                    md = metadata_prefix(launch_decode_inplace(st, cfg, out=out), staged.num_seqs, staged.total_q)
                    md.max_seqlen_q, md.max_seqlen_k = staged.max_seqlen_q, staged.max_seqlen_k
                    seen["staged"] += 1
                else:
                    md = (sb.broadcast_state(state, *args, num_placeholders=n_ph, out=out) if drv
                          else sb.broadcast(None, out=out))
                    assert md.positions.data_ptr() == out["positions"].data_ptr(), "not written in place"
                assert metadata_diff(md, ref, cfg=cfg) == [], f"rank {rank} cfg {ci} step {i}"
                seen["steps"] += 1
                seen["drafts" if counts is not None and counts.any() else "no_drafts"] += 1
                seen["placeholders"] += n_ph > 0
            if ci == 0:
                _state_refusals(sb, state, every, rank)
    return seen


def _state_refusals(sb: Any, state: Any, every: np.ndarray, rank: int) -> None:
    """Refused batches reach every rank; out=None lifts the limits as for ``broadcast``."""
    from cpmeta import BatchState, prepare_decode
    from cpmeta.diff import metadata_diff
    from cpmeta.gpu.decode_inplace import prepare_decode_inplace

    cfg, drv = sb.cfg, rank == 0
    if not drv:  # local misuse, no message
        for call in (sb.broadcast_state, sb.stage_state):
            with pytest.raises(ValueError, match=rf"rank {rank}: only src=0 passes a BatchState"):
                call(state, every)
    small: dict[str, torch.Tensor] = {}
    prepare_decode_inplace(state.decode_batch(every[:1]), cfg, out=small, device="cpu")
    other = BatchState(dataclasses.replace(cfg, max_model_len=2 * cfg.max_model_len), 1)
    for why, call in ((r"total_q: 2 rows exceed the captured buffers' q_cap=1",
                       lambda: sb.broadcast_state(state, every[:2], out=small)),
                      (r"state: expected a BatchState for the broadcaster's cfg",
                       lambda: sb.broadcast_state(other, np.zeros(0, np.int64), out=small))):
        if drv:
            with pytest.raises(ValueError, match=why):
                call()
        else:
            with pytest.raises(RuntimeError, match=rf"rank {rank}: .*the driver refused the batch: {why}"):
                sb.broadcast(None, out=small)
    # out=None: no limits (as broadcast()), although the staging's out_capacity (seq_cap n + 3) is smaller
    n = len(every)
    md = sb.broadcast_state(state, every, num_placeholders=4) if drv else sb.broadcast(None)
    assert md.num_seqs == n + 4 and sb.staging.out_capacity.seq_cap == n + 3
    assert metadata_diff(md, prepare_decode(state.decode_batch(every, num_placeholders=4), cfg, table_width=cfg.max_num_blocks), cfg=cfg) == []


@pytest.mark.parametrize("world", [2, 3])
def test_cp_staged_decode_equals_broadcast_cpu(world: int) -> None:
    n = len(_configs()) * STEPS
    assert run_ranks(_cp_equals_broadcast, world, "cpu", False, timeout=240) == [n] * world


@pytest.mark.parametrize("world", [2, 3])
def test_cp_state_driver_equals_prepare_decode_cpu(world: int) -> None:
    res = run_ranks(_state_cp_equals_prepare, world, timeout=240)
    assert all(r == res[0] for r in res), res
    assert res[0]["steps"] == 18 and min(res[0].values()) >= 1, res


def test_cp_malformed_message_names_the_rank() -> None:
    res = run_ranks(_malformed_messages, 2, timeout=180)
    assert res[0] == [] and len(res[1]) == 9, res


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
def test_cp_staged_decode_nccl_world1() -> None:
    n = len(_configs()) * STEPS
    assert run_ranks(_cp_equals_broadcast, 1, "cuda:0", False, backend="nccl", timeout=240) == [n]


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA + triton")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("graph", [False, True], ids=["kernels", "graph"])
def test_cp_staged_decode_gloo_ranks_share_cuda0(world: int, graph: bool) -> None:
    """2-3 gloo ranks on ONE GPU: each uploads the received staging and runs the kernels (or
    replays its own captured graph) into its own buffers on cuda:0."""
    n = len(_configs()) * STEPS
    assert run_ranks(_cp_equals_broadcast, world, "cuda:0", graph, timeout=300) == [n] * world


def test_check_staged_layout_names_every_corruption() -> None:
    """A follower validates the received staging before any write: a well-formed buffer passes,
    and each corrupted address-bearing value is named (never a kernel reading past a buffer)."""
    from cpmeta import BatchState, MetadataConfig
    from cpmeta.gpu import stage_decode
    from cpmeta.gpu.decode_cp import check_staged_layout
    from cpmeta.gpu.decode_staging import DecodeStaging
    from cpmeta.gpu.staging_header import (
        F_BT_OFFSET, F_CU_K_INCL, F_CU_Q_INCL, F_PLACEHOLDER, F_SEQLEN_K, F_SEQLEN_Q, F_STATE, SEQ_FIELDS,
    )
    from cpmeta.gpu.staging_layout import StagingLayout

    cfg = MetadataConfig(block_size=16, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                         sparse_compress_ratios=(4, 8), max_model_len=96)
    st = BatchState(cfg, max_seqs=4)
    for i, n in enumerate((5, 40, 17)):
        st.add_request(i, list(range(n)), list(range(8 * i, 8 * i + 6)), i, num_computed=n)
    stg = DecodeStaging("cpu", 64)
    staged = stage_decode(stg, st, np.array([0, 1, 2]), np.array([3, 4], np.int64), np.array([0, 2, 0]))
    good = stg.host_buffer[:staged.used].numpy().copy()
    assert check_staged_layout(good, staged, cfg) is None
    hl, n = StagingLayout.of(cfg).header_len, staged.num_seqs

    def row(a: np.ndarray, f: int) -> np.ndarray:
        return a[hl:hl + SEQ_FIELDS * n].reshape(SEQ_FIELDS, n)[f]

    cases = [
        (lambda a: row(a, F_SEQLEN_Q).__setitem__(0, 0), staged, "seqlen_q < 1"),
        (lambda a: row(a, F_CU_K_INCL).__setitem__(0, 4), staged, "prefix sums"),
        (lambda a: row(a, F_CU_Q_INCL).__setitem__(1, 2), staged, "prefix sums"),
        (lambda a: row(a, F_STATE).__setitem__(2, -1), staged, "negative state id"),
        (lambda a: row(a, F_PLACEHOLDER).__setitem__(1, 2), staged, "placeholder flag"),
        (lambda a: row(a, F_BT_OFFSET).__setitem__(0, -1), staged, "block-table offset"),
        (lambda a: row(a, F_BT_OFFSET).__setitem__(2, 10**6), staged, "block-table offset"),
        (lambda a: a.__setitem__(8, 5), staged, "ratios"),
        (lambda a: None, staged._replace(max_seqlen_k=staged.max_seqlen_k + 1), "max_seqlen"),
        (lambda a: None, staged._replace(max_blocks=staged.max_blocks + 1), "max_blocks"),
        (lambda a: None, staged._replace(total_q=staged.total_q + 1), "header"),
        (lambda a: None, staged._replace(used=staged.used + 1), "buffer of"),
    ]
    for corrupt, meta, msg in cases:
        a = good.copy()
        corrupt(a)
        why = check_staged_layout(a, meta, cfg)
        assert why is not None and msg in why, (msg, why)
    long_k = good.copy()  # seqlen_k past max_model_len, prefix sums and maxima made consistent
    row(long_k, F_SEQLEN_K)[0] = cfg.max_model_len + 1
    np.cumsum(row(long_k, F_SEQLEN_K), out=row(long_k, F_CU_K_INCL))
    k = row(long_k, F_SEQLEN_K)
    meta = staged._replace(total_k=int(k.sum()), max_seqlen_k=int(k.max()))
    long_k[2] = meta.total_k  # header: total_k
    assert "max_model_len" in check_staged_layout(long_k, meta, cfg)
