"""The replicated in-place decode path (issue 30): no metadata moved, every rank stages its own.

Every rank keeps the same ``ReplicatedBatchState``; after ``sync()`` each stages the decode
step straight from ITS replica (``cpmeta.gpu.stage_decode(staging, rep.state, *rep.spec...)``) and
runs the in-place kernels into its own buffers (CPU: the torch emulation of the kernels; CUDA:
the Triton kernels, one GPU shared by the ranks). Every rank's rows must equal
``prepare_decode`` of the driver's batch, step for step, while requests come, go, draft and grow.
"""

from __future__ import annotations

import random

import pytest
import torch

from multiproc import run_ranks

HAS_CUDA = torch.cuda.is_available()


def _rank(rank: int, world: int, device: str, seed: int) -> int:
    import cpmeta
    import cpmeta.diff
    import cpmeta.gpu
    from cpmeta.gpu.decode_inplace import finish_staged, resolve_backend
    from cpmeta.launch.scheduler import plain_config
    from replicate_trace import drive

    cfg = plain_config(max_model_len=1024)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    staging = cpmeta.gpu.DecodeStaging(dev)
    rng = random.Random(seed)
    results: list = []  # the step's outcome arrives after its forward: the next step's first calls
    n = 0
    with cpmeta.ReplicatedBatchState(cfg, 10, max_tokens=1024, timeout=60) as rep:
        for _ in range(120):
            if rank == 0:
                drive(rep, cfg, rng, [], results)
            batch = rep.sync()
            spec = rep.spec
            if batch is None or spec is None or spec.is_prompt:
                continue
            staged = cpmeta.gpu.stage_decode(staging, rep.state, spec.slots, spec.draft_tokens,
                                         spec.num_drafts, num_placeholders=spec.num_placeholders,
                                         upload=False)  # finish_staged uploads
            md = finish_staged(staging, staged, cfg, out=None, device=dev,
                               backend=resolve_backend("auto", dev))  # Triton on CUDA
            want = cpmeta.prepare_decode(batch, cfg, table_width=cfg.max_num_blocks)  # this rank's batch (checked)
            # a BLOCKING copy: InputMetadata.to defaults to non_blocking=True, and a non-blocking
            # CUDA -> CPU copy returns pinned tensors before their bytes arrive (reading them at once
            # compared stale bytes: rank 1's failure at world 3 on the H200, 2026-12-03 14:17)
            got = md.to("cpu", non_blocking=False)
            assert cpmeta.diff.metadata_diff(got, want, cfg=cfg) == [], (rank, n)
            n += 1
    return n


def test_every_rank_stages_from_its_replica_cpu() -> None:
    out = run_ranks(_rank, 2, "cpu", 4, timeout=180)
    assert out[0] == out[1] and out[0] >= 30, out


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_stages_from_its_replica_cuda(world: int) -> None:
    out = run_ranks(_rank, world, "cuda:0", 5, timeout=300)
    assert len(set(out)) == 1 and out[0] >= 30, out
