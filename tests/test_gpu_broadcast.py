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
