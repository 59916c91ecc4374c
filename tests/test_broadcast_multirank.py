"""MetadataBroadcaster equivalence on real gloo processes (2 and 4 ranks).

Each test starts its ranks once and runs many checks inside them: every rank regenerates the
driver's random batch from the shared seed, rebuilds it locally and compares the received
metadata bit for bit (``metadata_diff``), aliasing and empty dicts included.
"""

from __future__ import annotations

import random

import pytest
import torch

from multiproc import run_ranks

N_RANDOM = 12  # random batches per path per run


def _random_case(seed: int, i: int, is_prompt: bool):
    import cpmeta
    from strategies import random_config, random_decode_batch, random_prompt_batch

    rng = random.Random(seed * 1000 + i)
    cfg = random_config(rng)
    if is_prompt:
        seqs = random_prompt_batch(rng, cfg, max_total_q=600)
        return cfg, cpmeta.prepare_prompt(seqs, cfg)
    seqs = random_decode_batch(rng, cfg)
    return cfg, cpmeta.prepare_decode(seqs, cfg)


def _expect_same(local, got, cfg, what: str) -> None:
    from cpmeta.diff import metadata_diff

    diffs = metadata_diff(local, got, cfg=cfg)
    assert not diffs, f"{what}: {diffs}"


def _equivalence(rank: int, world: int, seed: int, force_remote: bool, tensor_path: str | None = None) -> int:
    import cpmeta

    checked = 0
    with cpmeta.MetadataBroadcaster(src=0, force_remote=force_remote, timeout=30, tensor_path=tensor_path) as bc:
        for i in range(N_RANDOM):
            for is_prompt in (True, False):
                cfg, local = _random_case(seed, i, is_prompt)
                got = bc.broadcast(local if rank == 0 else None)
                _expect_same(local, got, cfg, f"case {i} prompt={is_prompt}")
                # after expansion, too (a second metadata object: expand on the driver first)
                cfg, local = _random_case(seed, i, is_prompt)
                local.compute_attn_info(cfg)
                got = bc.broadcast(local if rank == 0 else None)
                _expect_same(local, got, cfg, f"case {i} prompt={is_prompt} + attn info")
                checked += 2
        # aliasing: one tensor reachable by two paths stays one tensor
        cfg, local = _random_case(seed, 99, True)
        mirrored = cpmeta.prepare_for_mirror_cp(local, 0, 2)
        assert mirrored.positions_cp is local.positions
        aliased = local.replace(positions_cp=local.positions)
        got = bc.broadcast(aliased if rank == 0 else None)
        assert got.positions_cp is got.positions, "aliasing lost"
        assert torch.equal(got.positions, local.positions)
        # empty dicts survive: a config with no sparse ratios has ks == {}
        from strategies import random_prompt_batch

        cfg0 = cpmeta.MetadataConfig.compressed_swa(dense_compress_ratios=(4,), sparse_compress_ratios=())
        seqs = random_prompt_batch(random.Random(seed), cfg0, max_total_q=300)
        local = cpmeta.prepare_prompt(seqs, cfg0)
        assert local.ks == {}
        got = bc.broadcast(local if rank == 0 else None)
        assert got.ks == {} and isinstance(got.ks, dict) and got.ke == {}
        _expect_same(local, got, cfg0, "no sparse ratios")
        checked += 2
        checked += _plain_configs(bc, rank, seed)
    return checked


def _plain_configs(bc, rank: int, seed: int) -> int:
    """A plain paged-KV config (docs/design.md section 14; KV sharded too): the metadata has no compressed or
    sliding-window field at all, and broadcasts (prompt, mirrored prompt, expanded decode)."""
    import cpmeta
    from strategies import random_decode_batch, random_prompt_batch

    checked = 0
    for shards in (1, 3):
        cfg = cpmeta.MetadataConfig(block_size=16, max_model_len=512, dense_compress_ratios=(),
                                    sparse_compress_ratios=(), window_size=0, kv_cp_world_size=shards)
        rng = random.Random(seed + shards)
        prompt = cpmeta.prepare_prompt(random_prompt_batch(rng, cfg, max_total_q=300), cfg)
        decode = cpmeta.prepare_decode(random_decode_batch(rng, cfg), cfg).compute_attn_info(cfg)
        for what, local in (("prompt", prompt), ("mirrored", cpmeta.prepare_for_mirror_cp(prompt, 1, 2)),
                            ("decode", decode)):
            assert local.ks is None and local.slot_mapping_store_swa is None and local.klen is None
            got = bc.broadcast(local if rank == 0 else None)
            assert got.positions_c is None and got.state_block_idx is None and got.kv_swa_index is None
            _expect_same(local, got, cfg, f"plain config, {shards} KV shards, {what}")
            checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4])
def test_followers_equal_driver(world: int) -> None:
    counts = run_ranks(_equivalence, world, 1234, False, timeout=240)
    assert counts == [counts[0]] * world and counts[0] == 4 * N_RANDOM + 2 + 6


def test_forced_remote_path() -> None:
    counts = run_ranks(_equivalence, 2, 77, True, timeout=240)
    assert counts[0] == 4 * N_RANDOM + 2 + 6


def test_collective_tensor_path() -> None:
    """The frame's tensor region as one gloo broadcast (what NCCL groups use for large CUDA
    metadata): fresh buffers on every rank, aliasing and empty dicts kept."""
    counts = run_ranks(_equivalence, 3, 4321, False, "collective", timeout=240)
    assert counts == [counts[0]] * 3 and counts[0] == 4 * N_RANDOM + 2 + 6


def _subgroup(rank: int, world: int, seed: int) -> int:
    """Ranks 1..3 form a CP group whose driver is global rank 2; rank 0 stays outside."""
    import torch.distributed as dist

    import cpmeta

    members = [1, 2, 3]
    group = dist.new_group(members, backend="gloo")
    n = -1
    if rank in members:
        n = 0
        with cpmeta.MetadataBroadcaster(group=group, src=2, timeout=30) as bc:
            for i in range(4):
                cfg, local = _random_case(seed, i, i % 2 == 0)
                got = bc.broadcast(local if rank == 2 else None)
                _expect_same(local, got, cfg, f"subgroup case {i}")
                n += 1
    # rank 0 hosts the rendezvous store: it must outlive the members' group set-up (returning at
    # once let the store die under their gloo rendezvous: "Broken pipe", seen once in a full run)
    dist.barrier()
    return n


def test_subgroup_with_nonzero_src() -> None:
    assert run_ranks(_subgroup, 4, 5, timeout=180) == [-1, 4, 4, 4]


def _schema_mismatch(rank: int, world: int) -> str:
    import cpmeta
    from cpmeta.broadcast import schema

    if rank == 1:  # pretend this follower runs another cpmeta version: refused at construction
        schema.INPUT_METADATA.fingerprint = "0" * 16
    try:
        cpmeta.MetadataBroadcaster(src=0, timeout=30)
    except ValueError as e:
        return str(e)
    return "constructed"


def test_schema_mismatch_is_refused_at_construction() -> None:
    for msg in run_ranks(_schema_mismatch, 2, timeout=120):  # both ranks, naming the ranks
        assert "MetadataBroadcaster schema setting differs" in msg and "at ranks [0]" in msg \
            and "at ranks [1]" in msg, msg


def _schema_skew_per_frame(rank: int, world: int) -> str:
    import cpmeta

    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:  # the same check on every frame
        if rank == 1:
            bc._ch.reader.fingerprint = b"0" * 16
        cfg, local = _random_case(3, 0, False)
        try:
            bc.broadcast(local if rank == 0 else None)
        except RuntimeError as e:
            return str(e)
        return "ok"


def test_schema_mismatch_is_an_error_on_the_follower() -> None:
    out = run_ranks(_schema_skew_per_frame, 2, timeout=120)
    assert out[0] == "ok"
    assert "schema" in out[1] and "mismatch" in out[1] and "rank 1" in out[1], out[1]


def _bad_calls(rank: int, world: int) -> list[str]:
    import cpmeta

    errs = []
    for make in (lambda: cpmeta.MetadataBroadcaster(src=0, timeout=30, checksum="no"),  # (was on)
                 lambda: cpmeta.ReplicatedBatchState(cpmeta.MetadataConfig(), 2, defer_apply="yes")):
        try:  # refused on every rank before the constructor's first collective
            make().close()
        except TypeError as e:
            errs.append(str(e))
    with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
        try:
            bc.broadcast(None if rank == 0 else cpmeta.InputMetadata())
        except (TypeError, ValueError) as e:
            errs.append(type(e).__name__)
    return errs


def test_wrong_role_arguments_raise_before_sending() -> None:
    flags = ["checksum: expected a bool (or None for the default), got 'no'",
             "defer_apply: expected a bool (or None for the default), got 'yes'"]
    assert run_ranks(_bad_calls, 2, timeout=120) == [flags + ["TypeError"], flags + ["ValueError"]]


HIGH_FD_FLOOR = 1024  # select.select() refuses descriptors >= FD_SETSIZE (1024 on Linux)
HIGH_FD_PADDING = 1100  # descriptors opened before the broadcaster, so its own land above 1024


def _many_fds(rank: int, world: int, seed: int, steps: int) -> list[int]:
    """Open HIGH_FD_PADDING descriptors first, so the ring's pidfds are numbered above 1024,
    then broadcast checksummed payloads; every follower compares them bit for bit with a local
    regeneration. Returns the pidfds the ring's liveness checks used."""
    import os
    import resource

    import cpmeta
    from reliability_cases import make_payload, payload_equal, verify_payload

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = HIGH_FD_PADDING + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(HIGH_FD_PADDING)]
    try:
        with cpmeta.MetadataBroadcaster(src=0, timeout=30) as bc:
            for step in range(steps):
                md = make_payload(seed, step) if rank == 0 else None
                got = bc.broadcast(md)
                verify_payload(got, step)
                bad = payload_equal(make_payload(seed, step), got)
                assert bad is None, f"step {step}: {bad} differs"
            ring = bc._objects.ring
            return sorted(w._pidfd for w in ring._watch.values() if w._pidfd is not None)
    finally:
        for fd in padding:
            os.close(fd)


def test_ring_works_with_pidfds_above_1024() -> None:
    """A process holding > 1024 descriptors: every ring write polls pidfds numbered above
    FD_SETSIZE (``select.select`` raised ``ValueError: filedescriptor out of range``)."""
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < HIGH_FD_PADDING + 256:
        pytest.skip("hard RLIMIT_NOFILE too low to open > 1024 descriptors")
    fds = run_ranks(_many_fds, 3, 11, 8, timeout=180)
    assert len(fds[0]) == 2 and len(fds[1]) == len(fds[2]) == 1, fds  # 2 readers; the writer
    assert all(fd >= HIGH_FD_FLOOR for per_rank in fds for fd in per_rank), fds
