"""``MetadataBroadcaster(..., persistent_outputs=True)`` on real gloo processes (and CUDA when present).

Every rank regenerates the driver's step from the shared seed (a pool of random layouts, new
random tensor values and scalar values every step) and compares what it received exactly against
it, and against what a second, plain broadcaster delivers for the same step: persistent outputs
equal fresh ones over many steps, layout changes, eviction past ``MAX_LAYOUTS``, aliasing, empty
dicts, the process-group path and the checksum. The validity rule: a second broadcast with the
same layout overwrites the first result (it is the same object), one with another layout does not.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from multiproc import run_ranks
from test_broadcast_multirank import _random_case

N_STEPS = 40  # persistent steps per equivalence run


def _same(a, b, what: str) -> None:
    from cpmeta.diff import metadata_diff

    diffs = metadata_diff(a, b)
    assert not diffs, f"{what}: {diffs}"


def _fresh_values(md, seed: int):
    """Write random values into ``md``'s tensors IN PLACE (same objects, addresses, aliasing and
    shared bytes, as an engine refilling its ``OutputArenas``) and move ``max_seqlen_k``: same
    layout, new content, identical on every rank. Returns ``md``."""
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for _, t in md.tensors():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.dtype == torch.bool:
            t.copy_(torch.randint(0, 2, t.shape, generator=g).bool())
        elif t.dtype.is_floating_point:
            t.copy_(torch.rand(t.shape, generator=g))
        else:
            t.copy_(torch.randint(-1000, 100000, t.shape, generator=g))
    if md.max_seqlen_k is not None:
        md.max_seqlen_k = md.max_seqlen_k % 1000 + seed % 7
    return md


def _pool(seed: int) -> list:
    """Layouts the steps draw from: decode and prompt, with attn info, aliased, empty dicts."""
    import cpmeta
    from strategies import random_prompt_batch

    pool = []
    for i in range(3):
        for is_prompt in (False, True):
            cfg, md = _random_case(seed, i, is_prompt)
            pool.append(md)
            if i == 0:
                pool.append(_random_case(seed, i, is_prompt)[1].compute_attn_info(cfg))
    md = _random_case(seed, 0, True)[1]  # every entry owns its tensors (values change in place)
    pool.append(md.replace(positions_cp=md.positions))  # aliasing
    md = _random_case(seed, 0, False)[1]
    pool.append(md.replace(positions_cp=md.positions[1:]))  # two views sharing bytes
    cfg0 = cpmeta.MetadataConfig.compressed_swa(dense_compress_ratios=(4,), sparse_compress_ratios=())
    md0 = cpmeta.prepare_prompt(random_prompt_batch(random.Random(seed), cfg0, max_total_q=200), cfg0)
    assert md0.ks == {}
    pool.append(md0)  # empty dicts
    return pool


def _equivalence(rank: int, world: int, seed: int, force_remote: bool, announce: bool = False) -> list:
    import cpmeta

    pool = _pool(seed)
    rng = random.Random(seed)
    n = 0
    kw = dict(src=0, force_remote=force_remote, timeout=60)
    with cpmeta.MetadataBroadcaster(persistent_outputs=True, **kw) as bp, \
            cpmeta.MetadataBroadcaster(**kw) as bf:
        warmed = [0, 0]  # warm calls, warms whose pieces the ring ran to their end
        ring = bp._objects.ring  # noqa: SLF001 - counting the follower's warm calls
        if ring is not None and ring.warm is not None:
            def counted(f=ring.warm) -> Any:
                warmed[0] += 1
                pieces = f()
                if pieces is None:
                    return None

                def run() -> Any:  # the hook's pieces, for the ring to run
                    yield from pieces
                    warmed[1] += 1
                return run()
            ring.warm = counted
        held: dict[int, tuple] = {}  # pool index -> (result object, what it must equal now)
        changed: list = []  # [result, the tensor a caller set on it]
        for step in range(N_STEPS):
            j = rng.randrange(len(pool))
            sent = _fresh_values(pool[j], seed * 1000 + step)
            if announce and rank == 0:  # the driver builds for 3 ms: followers warm ~30 times
                bp.begin_step()
                time.sleep(0.003)
            got = bp.broadcast(sent if rank == 0 else None)
            _same(sent, got, f"step {step} layout {j}")
            _same(bf.broadcast(sent if rank == 0 else None), got, f"step {step}: fresh vs persistent")
            if j in held:
                assert held[j][0] is got, f"step {step}: layout {j} came back as a new object"
            for k, (res, want) in held.items():  # results of other layouts are untouched
                if k != j and want is not None:
                    _same(want, res, f"step {step}: result of layout {k} changed")
            held[j] = (got, sent)
            if sent.positions_cp is sent.positions:
                assert got.positions_cp is got.positions, "aliasing lost"
            if sent.ks == {}:
                assert got.ks == {} and got.ke == {}
            if rank and changed and j != 0:  # kept until its layout's next step (warming included)
                assert changed[0].kv_swa_index is changed[1], f"step {step}: a caller's field was reset"
            if rank and j == 0:  # a caller setting fields in place (as compute_attn_info does),
                got.kv_swa_index = torch.zeros(3, dtype=torch.int32)  # undone by the next step
                changed[:] = [got, got.kv_swa_index]
                got.positions = got.positions[:1]
                if got.klen:
                    got.klen["999"] = torch.zeros(1, dtype=torch.int32)
                held[j] = (got, None)  # changed by us: not compared until its layout returns
            n += 1
        # both driver sources ran: a builder's arena (the frame's region as is: one memmove) and
        # tensors in several allocations (attn_info, aliasing: one memmove per tensor)
        kinds = sorted({a.src_ptrs is not None for a in bp._persist.arenas()}) if rank == 0 else None
    return [n, kinds, min(warmed) >= N_STEPS if announce and rank else None]


@pytest.mark.parametrize("world,force_remote", [(1, False), (2, False), (3, False), (2, True)])
def test_persistent_equals_fresh(world: int, force_remote: bool) -> None:
    assert run_ranks(_equivalence, world, 4242, force_remote, timeout=240) == [
        [N_STEPS, [False, True], None]] + [[N_STEPS, None, None]] * (world - 1)


def test_followers_warming_for_announced_steps_change_nothing() -> None:
    """Followers spinning for announced steps replay the last frame's checks and read its arena
    (``FollowerSide.warm``) dozens of times a step: every result still equals the driver's, a
    result of another layout is untouched, fields a caller set stay set until their layout's
    next step, and the warm hook ran to its end dozens of times (it was never dropped for
    raising; the ring took every piece of it while no frame was in)."""
    # world 2: a follower warms only with a core of its own (2 ranks on a 2-core machine)
    assert run_ranks(_equivalence, 2, 4242, False, True, timeout=240) == [
        [N_STEPS, [False, True], None], [N_STEPS, None, True]]


def _checksummed(rank: int, world: int) -> bool:
    import cpmeta

    pool = _pool(77)
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bp:
        for step in range(8):
            sent = _fresh_values(pool[step % 3], step)
            _same(sent, bp.broadcast(sent if rank == 0 else None), f"crc step {step}")
        return bp.checksum


def test_checksum_and_remote_path_env() -> None:
    env = {"CPMETA_CHECKSUM": "1", "CPMETA_FORCE_REMOTE": "1"}
    assert run_ranks(_checksummed, 2, env=env, timeout=120) == [True, True]


def _validity(rank: int, world: int) -> list:
    import cpmeta

    pool = _pool(5)
    a, b = pool[0], _fresh_values(pool[2], 3)  # two layouts (a decode, a prompt)
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bp:
        _fresh_values(a, 1)  # every rank: the driver sends it, followers compare with it
        r1 = bp.broadcast(a if rank == 0 else None)
        keep = r1.positions.clone()
        _same(a, r1, "a, step 1")
        r2 = bp.broadcast(b if rank == 0 else None)
        _same(a, r1, "a's result after another layout")  # a different layout does not overwrite
        _fresh_values(a, 2)
        r3 = bp.broadcast(a if rank == 0 else None)
        _same(a, r3, "a, step 2")
        _same(b, r2, "b's result after a's second step")
        out = [r3 is r1, r3.positions.data_ptr() == r1.positions.data_ptr(),
               torch.equal(r1.positions, keep)]
    with cpmeta.MetadataBroadcaster(src=0, timeout=60) as bf:  # without the option: fresh
        f1 = bf.broadcast(a if rank == 0 else None)
        keep = a.positions.clone()
        f2 = bf.broadcast(_fresh_values(a, 3) if rank == 0 else None)
        out.append(f1 is f2)
        if rank:
            assert torch.equal(f1.positions, keep), "a fresh result must not change"
    return out


def test_validity_rule() -> None:
    for rank, res in enumerate(run_ranks(_validity, 2, timeout=120)):
        same_obj, same_addr, unchanged, fresh_same = res
        assert same_obj and same_addr, "a second broadcast of one layout must reuse its arena"
        assert not unchanged, "the second broadcast must overwrite the first result"
        assert fresh_same == (rank == 0)  # without the option a CPU driver gets its own md back


def _eviction(rank: int, world: int) -> list:
    import cpmeta
    from cpmeta.broadcast.wire import MAX_LAYOUTS

    def tiny(n: int, v: int):
        return cpmeta.InputMetadata(is_prompt=False, num_seqs=1, total_q=n,
                                    positions=torch.arange(v, v + n, dtype=torch.int32))

    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bp:
        first = bp.broadcast(tiny(1, 0) if rank == 0 else None)
        for n in range(2, MAX_LAYOUTS + 6):  # every one a new layout: the first is evicted
            got = bp.broadcast(tiny(n, n) if rank == 0 else None)
            assert torch.equal(got.positions, torch.arange(n, 2 * n, dtype=torch.int32))
        again = bp.broadcast(tiny(1, 7) if rank == 0 else None)
        return [len(bp._persist), again is first, int(first.positions[0]), int(again.positions[0])]


def test_eviction_past_max_layouts() -> None:
    from cpmeta.broadcast.wire import MAX_LAYOUTS

    for kept, same, old, new in run_ranks(_eviction, 2, timeout=120):
        assert kept <= MAX_LAYOUTS
        assert not same, "an evicted layout must get a new arena"
        assert (old, new) == (0, 7), "an evicted arena's metadata must stay as it was"


def _mixed(rank: int, world: int) -> list:
    import cpmeta

    pool = _pool(31)
    out = []
    # a persistent driver (its builder arenas copied whole) and a follower without the option
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=rank == 0) as bp:
        prev = None
        for step in range(6):
            sent = _fresh_values(pool[0], step)
            got = bp.broadcast(sent if rank == 0 else None)
            _same(sent, got, f"mixed step {step}")
            out.append(got is prev)
            prev = got
    return out


def test_persistent_driver_plain_follower() -> None:
    drv, fol = run_ranks(_mixed, 2, timeout=120)
    assert drv[1:] == [True] * 5  # the driver's result is its arena's metadata
    assert not any(fol)  # the follower without the option gets fresh metadata every step


def _with_out(rank: int, world: int) -> int:
    import cpmeta

    pool = _pool(17)
    n = 0
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bp:
        for step in range(4):
            md = _fresh_values(pool[step % 2], step)
            bufs: dict = {}
            for name in md.field_names():  # buffers one row longer than the step needs
                v = getattr(md, name)
                if isinstance(v, torch.Tensor):
                    bufs[name] = torch.zeros((v.shape[0] + 1, *v.shape[1:]) if v.dim() else (),
                                             dtype=v.dtype)
                elif isinstance(v, dict) and v:
                    bufs[name] = {k: torch.zeros((x.shape[0] + 1, *x.shape[1:]), dtype=x.dtype)
                                  for k, x in v.items() if isinstance(x, torch.Tensor)}
            got = bp.broadcast(md if rank == 0 else None, out=md.replace(**bufs))
            _same(md, got, f"out= step {step}")
            for name, b in bufs.items():
                g = getattr(got, name)
                ptrs = ([g[k].data_ptr() == x.data_ptr() for k, x in b.items()]
                        if isinstance(b, dict) else [g.data_ptr() == b.data_ptr()])
                assert all(ptrs), f"{name}: not written into the out= buffer"
            n += 1
    return n


def test_out_buffers_with_persistent_outputs() -> None:
    assert run_ranks(_with_out, 2, timeout=120) == [4, 4]


def _collective(rank: int, world: int) -> int:
    import cpmeta

    pool = _pool(23)
    n = 0
    held: dict[int, object] = {}
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, tensor_path="collective",
                                    persistent_outputs=True) as bp:
        for step in range(8):
            j = step % 3
            sent = _fresh_values(pool[j], step)
            got = bp.broadcast(sent if rank == 0 else None)  # tensors by one gloo collective
            _same(sent, got, f"collective step {step}")
            assert held.setdefault(j, got) is got, "a layout must come back as its arena's object"
            n += 1
    return n


def test_collective_path_into_the_arena() -> None:
    assert run_ranks(_collective, 2, timeout=120) == [8, 8]


@pytest.mark.parametrize("is_prompt", [False, True])
def test_builder_arena_is_the_frame_region(is_prompt: bool) -> None:
    """A builder's outputs lie where the frame puts them (``ArenaLayout`` lays fields out by
    ``Plan.sizes``' rule), so a persistent driver copies its arena into the frame whole: every
    tensor's byte offset in the builder's allocation equals its offset in the frame's region,
    over random configs and batches, and the frame region fits the allocation; ``Plan.pack``
    (the plain path) then copies the region whole, with the bytes of a tensor-by-tensor copy."""
    from cpmeta.broadcast.collect import collect
    from cpmeta.broadcast.plan import Plan, one_source
    from cpmeta.broadcast.schema import INPUT_METADATA
    from cpmeta.broadcast.wire import ELEMENT_SIZE

    for i in range(12):
        md = _random_case(7, i, is_prompt)[1]
        key, tensors, _ = collect(md)
        plan = Plan(INPUT_METADATA, key[0], list(key[1]), list(key[2]), key[3])
        numels, starts, region, _ = plan.sizes(tuple(d for t in tensors for d in t.shape))
        want = []
        for (code, a, b), s in zip(plan.runs, starts):
            for m in numels[a:b]:
                want.append(s)
                s += m * ELEMENT_SIZE[code]
        storage = tensors[0].untyped_storage()
        assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in tensors), \
            f"case {i}: the builder's outputs are not one allocation"
        got = [t.data_ptr() - storage.data_ptr() for t in tensors]
        assert [g for g, m in zip(got, numels) if m] == [w for w, m in zip(want, numels) if m], \
            f"case {i}: {plan.tensor_paths}"
        assert region <= storage.nbytes()
        # Plan.pack copies such tensors with one memmove and separate ones per tensor: same bytes
        dims = tuple(d for t in tensors for d in t.shape)
        ptrs = [t.data_ptr() for t in tensors]
        assert one_source(tensors, ptrs, plan.offsets(dims, numels, starts), numels, region)
        clones = [t.clone() for t in tensors]
        assert not one_source(clones, [t.data_ptr() for t in clones], want, numels, region)
        frames = []
        for ts in (tensors, clones):
            buf = torch.full((region,), 255, dtype=torch.uint8)
            plan.pack(buf.data_ptr(), ts, dims, numels, starts, region)
            frames.append(plan.views(buf, dims, numels, starts))
            if ts is tensors:  # the arena's bytes between and after the runs are zero, not stale
                gap = torch.ones(region, dtype=torch.bool)
                for o, t in zip(want, tensors):
                    gap[o:o + t.numel() * t.element_size()] = False
                assert not buf[gap].any(), f"case {i}: nonzero bytes between the runs"
        assert all(torch.equal(x, y) and torch.equal(x, t)
                   for x, y, t in zip(frames[0], frames[1], tensors)), f"case {i}"


# ---- CUDA (skipped without it): the arena on the device, one H2D copy per step ---------------------


def _cuda_steps(rank: int, world: int, nccl: bool) -> int:
    import cpmeta

    if nccl:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank if nccl else 0)
    pool = _pool(9)
    rng = random.Random(9)
    n = 0
    with cpmeta.MetadataBroadcaster(src=0, device=dev, timeout=60, persistent_outputs=True) as bp:
        held: dict[int, object] = {}
        for step in range(16):
            j = rng.randrange(len(pool))
            sent = _fresh_values(pool[j], step)
            send = sent.to(dev) if j % 2 else sent  # odd layouts: metadata already on the GPU
            got = bp.broadcast(send if rank == 0 else None)  # (the collective path)
            for _, t in got.tensors():
                assert t.device == dev, t.device
            torch.cuda.current_stream().synchronize()
            _same(sent.to(dev), got, f"cuda step {step}")
            if j in held:
                assert held[j] is got
            held[j] = got
            n += 1
    return n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gloo_ranks_share_cuda0() -> None:
    assert run_ranks(_cuda_steps, 2, False, timeout=300) == [16, 16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_nccl() -> None:
    w = min(2, torch.cuda.device_count())
    assert run_ranks(_cuda_steps, w, True, backend="nccl", timeout=300) == [16] * w


def _warm_after_abort(rank: int, world: int) -> list:
    import torch.distributed as dist

    import cpmeta

    pool = _pool(11)
    counts = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=60, persistent_outputs=True) as bp:
        ring = bp._objects.ring  # noqa: SLF001 - counting the follower's warm calls
        warmed = [0]
        if rank:
            def counted(f=ring.warm) -> Any:
                warmed[0] += 1
                return f()  # the hook's pieces, for the ring to run
            ring.warm = counted
        for step in range(4):
            sent = _fresh_values(pool[0], step)
            dist.barrier()  # the follower is in its receive when the driver's announce window opens
            if rank == 0:
                bp.begin_step()
                time.sleep(0.010)  # < the 20 ms announce spin: room for warm calls on a loaded 2-core CI host
            if step == 1:  # the driver refuses this step: every follower's call raises
                with pytest.raises(TypeError):
                    bp.broadcast("not metadata" if rank == 0 else None)
            else:
                _same(sent, bp.broadcast(sent if rank == 0 else None), f"step {step}")
            counts.append(warmed[0])
        # the hook still installed (a warm that raised would have been dropped), and called
        # again after the abort, in the windows of steps 2 and 3 (how often in 10 ms is up to the
        # host's load: a loaded 2-core CI host gave the follower 2 calls once, and once none in
        # step 3's window alone -- a fresh-clone .ci/run of 6f81ff9)
        return [rank == 0 or ring.warm is counted, counts[3] - counts[1] >= 1]


def test_followers_keep_warming_after_an_aborted_step() -> None:
    """The warm replays the last frame the follower took, proving that frame's own step: a step
    the driver aborted in between does not make it stale (it would raise, and the ring would
    drop the hook for good)."""
    assert run_ranks(_warm_after_abort, 2, timeout=120) == [[True, False], [True, True]]
