"""The overlapped loop (issue 32 item 4): every rank runs a "forward" of step N that reads its
metadata while the driver builds and broadcasts step N+1; every step's metadata must be what the
driver sent (``scripts/bench_gpu.py overlap``'s loop: the forward ends with a checksum of its step's
tensors, compared with the driver's).

CPU: the forward is a thread sleeping, then reading (an asynchronous device); the result of step N
must survive step N+1's broadcast, which ``persistent_outputs=2`` guarantees. CUDA (skipped
without it; run on a GPU machine): the forward is a matmul loop of a few hundred us on the current
stream, then the checksum kernels; with ``streams=2`` each step runs on the other of two streams,
so the device copy of step N+1 must wait for step N's kernels through the arena's event.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

from multiproc import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def _args(steps: int, forward_us: float, streams: int) -> argparse.Namespace:
    return argparse.Namespace(steps=steps, warmup=2, decode_seqs=16, forward_us=forward_us,
                              timeout=120, streams=streams)


def _loop(rank: int, world: int, device: str, mode: str, depth: int, steps: int,
          forward_us: float, streams: int) -> dict:
    from bench_gpu import overlap_cell

    dev = torch.device(device)
    if dev.type == "cuda" and world > 1 and torch.cuda.device_count() >= world and device == "cuda":
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
    return overlap_cell(rank, dev, _args(steps, forward_us, streams), mode, depth)


def test_overlapped_loop_cpu() -> None:
    for r in run_ranks(_loop, 2, "cpu", "overlap", 2, 12, 5000.0, 1, timeout=300):
        assert r["steps"] == 13 and r["wrong_steps"] == 0, r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("depth,streams", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_overlapped_loop_cuda_shared_gpu(depth: int, streams: int) -> None:
    """gloo ranks sharing cuda:0 (the follower paths: frame on the CPU, one H2D per step)."""
    for r in run_ranks(_loop, 2, "cuda:0", "overlap", depth, 40, 300.0, streams, timeout=600):
        assert r["steps"] == 41 and r["wrong_steps"] == 0, r
        assert r["forward_us"] > 100, r  # the forward really ran a few hundred us


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
@pytest.mark.parametrize("streams", [1, 2])
def test_overlapped_loop_cuda_nccl(streams: int) -> None:
    for r in run_ranks(_loop, 2, "cuda", "overlap", 2, 40, 300.0, streams, backend="nccl",
                       timeout=600):
        assert r["steps"] == 41 and r["wrong_steps"] == 0, r
