"""``--attention-check`` (cpmeta/launch/attention_check.py): CP attention from the broadcast alone equals
single-rank attention -- prefill zigzag (bit-exact in float64) and interleaved-KV decode combined
by log-sum-exp (within 1e-12) -- at CP 2, 3 and 4; and it FAILS when the metadata is wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # whole launcher runs of 2-4 ranks: .ci/run runs the long suite

from multiproc import run_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world,interleave,extra", [
    (1, 128, ()),  # one rank: the decode KV reaches past the compressed blocks (whole tables needed)
    (2, 128, ("--verify", "--cp-mirror")),  # block-sized interleave, with the digest verify
    (3, 1, ()),
    (4, 128, ()),
])
def test_launch_attention_check(world: int, interleave: int, extra: tuple[str, ...]) -> None:
    # mixed: step 1 and 5 are prompt (chunked prefill: chunks of 256..2048), 2-4 decode
    cmd = [sys.executable, "-m", "cpmeta.launch", "--nproc-per-node", str(world), "--workload", "mixed",
           "--steps", "5", "--warmup", "1", "--attention-check", "--kv-interleave", str(interleave),
           "--decode-seqs", "4", "--prompt-seqs", "2", "--max-prompt", "700", *extra]
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "attention check: CP result equals single-rank attention on all 5 steps" in res.stdout


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 16)])
def test_launch_attention_check_plain_model(world: int, interleave: int) -> None:
    """``--model plain`` (docs/design.md section 14): no compressed or sliding-window field in the metadata, the
    KV sharded over the ranks (tables of rank 0's share); verify + attention check pass."""
    cmd = [sys.executable, "-m", "cpmeta.launch", "--nproc-per-node", str(world), "--model", "plain",
           "--workload", "mixed", "--steps", "5", "--warmup", "1", "--attention-check", "--verify",
           "--cp-mirror", "--attn-info", "--kv-interleave", str(interleave), "--decode-seqs", "4",
           "--prompt-seqs", "2", "--max-prompt", "700"]
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "model=plain" in res.stdout and "bit-identical" in res.stdout
    assert "attention check: CP result equals single-rank attention on all 5 steps" in res.stdout


def _seqs(rng, cfg, prompt: bool):  # noqa: ANN001, ANN202
    from cpmeta import SequenceMetadata
    from cpmeta.sequence import blocks_needed

    seqs, pool = [], rng.sample(range(500), 500)  # distinct physical blocks across sequences
    for i in range(3):
        k = rng.randint(5, 200)
        q = rng.randint(1, k) if prompt else rng.randint(1, 3)
        bt = [pool.pop() for _ in range(blocks_needed(k, cfg) + rng.randint(0, 2))]
        toks = list(range(k)) if prompt else list(range(k - q + 1))
        drafts = [] if prompt else [7] * (q - 1)
        seqs.append(SequenceMetadata(q, k, bt, state_id=10 + i, token_ids=toks, draft_tokens=drafts))
    seqs.append(SequenceMetadata(1, 1, [0], 0, [0], is_placeholder=True))
    return seqs


def _direct(rank: int, world: int) -> list[str]:
    """Every rank builds the same batches (seeded) and runs the check functions directly: the
    seed-style config, then plain paged-KV configs (docs/design.md section 14; KV sharded over the ranks too)."""
    import random

    import torch

    import cpmeta
    from cpmeta.launch.attention_check import check_step
    from cpmeta.launch.verify import VerifyError

    cfg = cpmeta.MetadataConfig(block_size=16, window_size=4, swa_block_size=8, dense_compress_ratios=(4,),
                                sparse_compress_ratios=(4,), max_model_len=256)
    rng, cpu, out = random.Random(5), torch.device("cpu"), []
    for step in range(2):
        pre = cpmeta.prepare_prompt(_seqs(rng, cfg, True), cfg)
        dec = cpmeta.prepare_decode(_seqs(rng, cfg, False), cfg)
        out.append(f"prefill {check_step(pre, None, rank, world, cpu, 16, 1, step)}")
        for inter in (1, 16):
            out.append(f"decode {check_step(dec, None, rank, world, cpu, 16, inter, step) <= 1e-12}")
    for shards, inter in ((1, 1), (world, 1), (world, 8)):  # plain; KV sharded like the CP group
        plain = cpmeta.MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=(), max_model_len=256,
                                      sparse_compress_ratios=(), kv_cp_world_size=shards, kv_cp_interleave=inter)
        pp = cpmeta.prepare_prompt(_seqs(rng, plain, True), plain)
        pd = cpmeta.prepare_decode(_seqs(rng, plain, False), plain)
        assert pp.state_block_idx is None and pd.state_block_idx is None and pd.kv_swa_index_offset_len is None
        out.append(f"prefill {check_step(pp, None, rank, world, cpu, 16, inter, 10)}")
        out.append(f"decode {check_step(pd, None, rank, world, cpu, 16, inter, 11) <= 1e-12}")
    # wrong metadata must fail on every rank: a shifted position on one rank's mirror ...
    mine = cpmeta.prepare_for_mirror_cp(pre, rank, world)
    if rank == world - 1:
        mine.positions = mine.positions.clone()
        mine.positions[0] += 1
    try:
        check_step(pre, mine, rank, world, cpu, 16, 1, 99)
        out.append("shifted position passed")
    except VerifyError:
        out.append("shifted position caught")
    # ... and two sequences sharing a physical block (one slot written twice)
    dec.block_tables = torch.zeros_like(dec.block_tables)
    try:
        check_step(dec, None, rank, world, cpu, 16, 1, 100)
        out.append("shared block passed")
    except VerifyError:
        out.append("shared block caught")
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_checks_pass_on_good_metadata_and_fail_on_bad(world: int) -> None:
    for res in run_ranks(_direct, world, timeout=240.0):
        assert res[-2:] == ["shifted position caught", "shared block caught"], res
        assert all(r in ("prefill 0.0", "decode True") for r in res[:-2]), res
