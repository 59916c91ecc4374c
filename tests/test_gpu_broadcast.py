"""MetadataBroadcaster with CUDA tensors: NCCL groups (1 or 2 GPUs) and the packed path to CUDA.

Skipped without CUDA; run on a GPU machine with the normal test command.
"""

from __future__ import annotations

import random

import pytest
import torch

from multiproc import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _nccl_equivalence(rank: int, world: int, tensor_path: str, on_device: bool) -> int:
    import cpmeta
    from cpmeta.diff import metadata_diff
    from strategies import random_config, random_decode_batch, random_prompt_batch

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    n = 0
    with cpmeta.MetadataBroadcaster(src=0, tensor_path=tensor_path, timeout=60) as bc:
        assert bc.device == dev
        for i in range(8):
            rng = random.Random(1000 + i)
            cfg = random_config(rng)
            is_prompt = i % 2 == 0
            seqs = (random_prompt_batch(rng, cfg, max_total_q=800) if is_prompt
                    else random_decode_batch(rng, cfg))
            md = cpmeta.prepare_prompt(seqs, cfg) if is_prompt else cpmeta.prepare_decode(seqs, cfg)
            if i % 4 >= 2:
                md.compute_attn_info(cfg)
            send = md.to(dev) if on_device else md
            got = bc.broadcast(send if rank == 0 else None)
            for _, t in got.tensors():
                assert t.device == dev, t.device
            diffs = metadata_diff(md.to(dev), got, cfg=cfg)
            assert not diffs, f"case {i}: {diffs}"
            n += 1
    return n


def _world() -> int:
    return min(2, torch.cuda.device_count())


@pytest.mark.parametrize("tensor_path,on_device",
                         [("auto", False), ("auto", True), ("packed", False), ("collective", False)])
def test_nccl_followers_equal_driver(tensor_path: str, on_device: bool) -> None:
    w = _world()
    assert run_ranks(_nccl_equivalence, w, tensor_path, on_device, backend="nccl",
                     timeout=300) == [8] * w


# ---- 2-3 gloo ranks sharing cuda:0: the follower paths a one-GPU machine can run (issue 16 item 4) --


def _gloo_cuda0_equivalence(rank: int, world: int, tensor_path: str, on_device: bool) -> int:
    """MetadataBroadcaster(device="cuda:0") on a GLOO group. ``packed``/``auto`` with CPU metadata:
    ring message + ONE H2D copy per rank; ``auto`` with CUDA metadata on the driver: one gloo
    collective of CUDA tensors; ``collective`` with CUDA tensors on gloo is refused (ValueError)."""
    import cpmeta
    from cpmeta.diff import metadata_diff
    from strategies import random_config, random_decode_batch, random_prompt_batch

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if tensor_path == "collective":
        with pytest.raises(ValueError, match="needs an NCCL group"):
            cpmeta.MetadataBroadcaster(src=0, device=dev, tensor_path="collective")
        return 0
    n = 0
    with cpmeta.MetadataBroadcaster(src=0, device=dev, tensor_path=tensor_path, timeout=60) as bc:
        assert bc.device == dev
        for i in range(6):
            rng = random.Random(2000 + i)
            cfg = random_config(rng)
            is_prompt = i % 2 == 0
            seqs = (random_prompt_batch(rng, cfg, max_total_q=600) if is_prompt else random_decode_batch(rng, cfg))
            md = cpmeta.prepare_prompt(seqs, cfg) if is_prompt else cpmeta.prepare_decode(seqs, cfg)
            if i % 3 == 2:
                md.compute_attn_info(cfg)
            send = md.to(dev) if on_device else md
            got = bc.broadcast(send if rank == 0 else None)
            for _, t in got.tensors():
                assert t.device == dev, t.device
            torch.cuda.synchronize()
            diffs = metadata_diff(md.to(dev), got, cfg=cfg)
            assert not diffs, f"rank {rank} case {i}: {diffs}"
            n += 1
    return n


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tensor_path,on_device", [("packed", False), ("auto", False), ("auto", True)])
def test_gloo_ranks_share_cuda0(world: int, tensor_path: str, on_device: bool) -> None:
    assert run_ranks(_gloo_cuda0_equivalence, world, tensor_path, on_device, timeout=240) == [6] * world


def test_gloo_collective_to_cuda_is_refused() -> None:
    assert run_ranks(_gloo_cuda0_equivalence, 2, "collective", False, timeout=120) == [0, 0]
