"""In-place decode across a CP group (DESIGN section 12, ``cpmeta.gpu.decode_cp``), on real ranks.

Every rank's ``StagedDecodeBroadcaster.broadcast`` result (one staging broadcast, kernels on each
rank, written into the rank's own ``out`` buffers) equals ``MetadataBroadcaster.broadcast`` of
``prepare_decode``'s output on that rank (``metadata_diff(..., cfg=cfg)``), for random decode
batches of several configs: gloo, 2 and 3 ranks, torch backend on the CPU; on CUDA (skipped
without): world 1 NCCL, and 2-3 gloo ranks sharing ``cuda:0``, each replaying ITS OWN captured
graph of the kernels after ``stage()``. Malformed messages (wrong version / scalars / dtype /
header offsets / block-table offsets / ratios) are a ``RuntimeError`` naming the follower's rank,
and a batch the driver refuses (too large for its buffers) is refused on every rank.
"""

from __future__ import annotations

import importlib.util
import random

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
                ref = mb.broadcast(cpmeta.prepare_decode(seqs, cfg) if rank == 0 else None)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                assert got.positions.device.type == dev.type
                assert got.positions.data_ptr() == out["positions"].data_ptr(), "not written in place"
                diff = metadata_diff(got, ref, cfg=cfg)
                assert not diff, f"rank {rank} step {i}: {diff}"
                checked += 1
    return checked


def _malformed_messages(rank: int, world: int) -> list[str]:
    """The driver sends hand-made bad messages on the broadcaster's channel; followers must raise
    RuntimeError naming their rank (and stay usable for the next message)."""
    from cpmeta.gpu import StagedDecodeBroadcaster
    from cpmeta.gpu.decode_cp import STAGED_DECODE_VERSION
    from strategies import random_decode_batch

    cfg = _configs()[0]
    seqs = random_decode_batch(random.Random(5), cfg, n_seqs=3)
    errors: list[str] = []
    with StagedDecodeBroadcaster(cfg, src=0, device="cpu", timeout=60) as sb:
        staged = sb.staging.fill(seqs, cfg) if rank == 0 else None
        good = sb.staging.host_buffer[: staged.used].clone() if rank == 0 else None
        scal = ([STAGED_DECODE_VERSION, staged.num_seqs, staged.total_q, staged.total_k, staged.max_seqlen_q,
                 staged.max_seqlen_k, staged.used, staged.max_blocks] if rank == 0 else None)

        def bad_buf(idx: int, value: int) -> torch.Tensor:
            t = good.clone()
            t[idx] = value
            return t

        hl = 8 + len(cfg.ca_ratios) + len(cfg.sparse_compress_ratios) + len(cfg.dense_compress_ratios)
        variants = [
            lambda: ([STAGED_DECODE_VERSION + 1, *scal[1:]], [good]),           # version
            lambda: (scal[:5], [good]),                                        # too few scalars
            lambda: (scal, [good.to(torch.int64)]),                            # dtype
            lambda: (scal, [good[:-1]]),                                       # truncated
            lambda: ([*scal[:2], scal[2] + 1, *scal[3:]], [good]),             # total_q vs header
            lambda: (scal, [bad_buf(4, int(good[4]) + 1)]),                    # off_ids
            lambda: (scal, [bad_buf(hl + 6 * staged.num_seqs, 10**6)]),        # bt_offset of seq 0
            lambda: (scal, [bad_buf(hl + 2 * staged.num_seqs, 99)]),           # cu_seqlens_q_incl
            lambda: (scal, [bad_buf(8, 3)] if cfg.ca_ratios else [bad_buf(0, 99)]),  # ratios / n_seq
        ]
        for make in variants:
            if rank == 0:
                obj, tensors = make()
                sb._ch.broadcast_packed(obj, tensors)
            else:
                with pytest.raises(RuntimeError, match=rf"rank {rank}: staged decode message") as e:
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


@pytest.mark.parametrize("world", [2, 3])
def test_cp_staged_decode_equals_broadcast_cpu(world: int) -> None:
    n = len(_configs()) * STEPS
    assert run_ranks(_cp_equals_broadcast, world, "cpu", False, timeout=240) == [n] * world


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
