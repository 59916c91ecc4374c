"""Tests of transport.ObjectChannel and transport.TensorChannel with real processes (gloo)."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

import os
import signal
import time

from multiproc import run_ranks, spawn_ranks
from cpmeta.transport import CodecError, ObjectChannel, PeerError, TensorChannel, TensorDesc
from cpmeta.transport.codec import DTYPES

pytestmark = pytest.mark.timeout(240)



def _random_obj(rng: random.Random, big: bool) -> Any:
    size = rng.choice([0, 1, 100, 4096, 70000] + ([3 << 20] if big else []))
    return {"bytes": rng.randbytes(size), "ints": [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(20))],
            "tuple": (rng.random(), "s" * rng.randrange(5), None, True), "empty": {},
            "nested": {"a": [1, (2, 3)], "desc": TensorDesc(torch.int32, (rng.randrange(9), 2))}}


def _tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``name`` (NaN bit patterns included: compare bytes)."""
    dtype = DTYPES[name]
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2 == 1).view(shape)
    return raw.view(dtype).view(shape)


def _tensor_list(seed: int) -> list[torch.Tensor]:
    """Every dtype, zero-size, 0-d, and non-contiguous tensors (the same list on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = [_tensor(n, (3, 5), g) for n in sorted(DTYPES)]
    out += [torch.zeros(0, 4, dtype=torch.int64), torch.empty(0, dtype=torch.bool),
            _tensor("float32", (), g), _tensor("int32", (6, 8), g)[:, ::3],  # non-contiguous
            _tensor("int64", (4, 5), g).t(), _tensor("bool", (7,), g)[1::2],
            _tensor("float32", (75_000,), g)]  # ~300 KB
    return out


def _bytes_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def _exercise(rank: int, group: Any, src: int, seed: int, **kw: Any) -> dict:
    """Objects and the tensor channel (lists of tensors, raw buffers) from ``src``; returns a summary."""
    ch = ObjectChannel(group, src, timeout=60.0, slot_size=4096, num_slots=8, **kw)
    rng = random.Random(seed)
    is_src = rank == src
    for i in range(40):
        obj = _random_obj(rng, big=i % 13 == 0)
        assert ch.broadcast(obj if is_src else None) == obj
    tensors = _tensor_list(seed)
    tc = TensorChannel(group, src)
    got = tc.broadcast(tensors if is_src else [(t.dtype, tuple(t.shape)) for t in tensors])
    assert all(_bytes_equal(x, y) for x, y in zip(tensors, got))
    assert tc.broadcast([] if is_src else []) == []
    reuse = TensorChannel(group, src, reuse_buffers=True)
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    a = reuse.broadcast(tensors if is_src else specs)
    b = reuse.broadcast(tensors[::-1] if is_src else specs[::-1])
    assert a[0].untyped_storage().data_ptr() == b[0].untyped_storage().data_ptr()  # reused
    assert all(_bytes_equal(x, y) for x, y in zip(tensors[::-1], b))
    for t in tensors:  # broadcast_buffer: a caller's bytes, in place, every dtype
        buf = t.contiguous().reshape(-1).view(torch.uint8) if is_src else \
            torch.zeros(t.numel() * t.element_size(), dtype=torch.uint8)
        tc.broadcast_buffer(buf)
        assert _bytes_equal(buf.view(t.dtype).view(t.shape), t)
    summary = {"local": ch.local_ranks, "remote": ch.remote_ranks}
    ch.close()
    return summary


def _same_host(rank: int, world_size: int) -> dict:
    return _exercise(rank, dist.group.WORLD, 1, 1234)


def _forced(rank: int, world_size: int) -> dict:
    return _exercise(rank, dist.group.WORLD, 2, 99)  # CPMETA_FORCE_REMOTE=1 in the env


def _mixed(rank: int, world_size: int) -> dict:
    return _exercise(rank, None, 0, 5, force_remote=False)  # rank 2: CPMETA_HOST_ID=elsewhere


def _subgroup(rank: int, world_size: int) -> dict:
    sub = dist.new_group([1, 2, 3], backend="gloo")
    out: dict = {}
    if rank != 0:
        out = _exercise(rank, sub, 2, 42)
        out["flag_remote"] = _exercise(rank, sub, 3, 43, force_remote=True)["remote"]
    dist.barrier()  # rank 0 hosts the rendezvous store: it must outlive the members' group set-up
    return out


def test_same_host_shared_memory() -> None:
    out = run_ranks(_same_host, 3, timeout=200)
    assert out == [{"local": [0, 2], "remote": []}] * 3


def test_forced_remote_by_env() -> None:
    out = run_ranks(_forced, 3, env={"CPMETA_FORCE_REMOTE": "1"}, timeout=200)
    assert out == [{"local": [], "remote": [0, 1]}] * 3


def test_mixed_local_and_remote_followers() -> None:
    """Rank 2 says it runs on another host (``CPMETA_HOST_ID``, as in production with the same
    hostname and boot id): it gets the frames over the process group, rank 1 over the ring."""
    ids = [{"CPMETA_HOST_ID": h} for h in ("here", "here", "elsewhere")]
    out = run_ranks(_mixed, 3, timeout=200, rank_env=ids)
    assert out == [{"local": [1], "remote": [2]}] * 3


def test_subgroup_with_nonzero_src() -> None:
    out = run_ranks(_subgroup, 4, timeout=200)
    assert out[0] == {}
    assert out[1:] == [{"local": [1, 3], "remote": [], "flag_remote": [1, 2]}] * 3


# ----------------------------------------------------------------------------- error paths

def _errors(rank: int, world_size: int) -> list[str]:
    seen = []
    good = ObjectChannel(None, 0, schema=b"v1", timeout=30.0)
    bad = ObjectChannel(None, 0, schema=b"v1" if rank == 0 else b"v2", timeout=30.0)
    remote = ObjectChannel(None, 0, schema=b"v1" if rank == 0 else b"v2", force_remote=True, timeout=30.0)
    for ch in (bad, remote):
        try:
            ch.broadcast({"x": 1} if rank == 0 else None)
        except CodecError as e:
            seen.append(str(e))
    if rank == 0:
        try:
            good.broadcast({"x": {1, 2}})  # refused on the source before anything is sent
        except TypeError as e:
            seen.append(str(e))
    assert good.broadcast("still fine" if rank == 0 else None) == "still fine"
    tc = TensorChannel(None, 0)
    try:
        tc.broadcast([torch.zeros(4)] if rank == 0 else [(torch.int32, (4,))])
    except ValueError as e:
        seen.append(str(e))
    for ch in (good, bad, remote):
        ch.close()
    return seen


def test_error_paths() -> None:
    out = run_ranks(_errors, 2, timeout=120)
    assert out[0][0].startswith("$.x: unsupported type builtins.set")
    assert len(out[1]) == 3
    assert all("schema fingerprint mismatch" in m for m in out[1][:2])
    assert "do not match the source rank 0" in out[1][2]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices")
def test_tensor_channel_nccl() -> None:
    out = run_ranks(_nccl, 2, backend="nccl", timeout=200)
    assert out == [True, True]


def _nccl(rank: int, world_size: int) -> bool:
    torch.cuda.set_device(rank)
    tensors = _tensor_list(3)
    tc = TensorChannel(None, 0)  # device defaults to the current CUDA device for NCCL
    for _ in range(3):  # the pinned staging buffer is reused
        got = tc.broadcast(tensors if rank == 0 else [(t.dtype, tuple(t.shape)) for t in tensors])
        assert all(g.device.type == "cuda" for g in got)
        assert all(_bytes_equal(x, y.cpu()) for x, y in zip(tensors, got))
    ch = ObjectChannel(None, 1)  # NCCL group: the channel makes its own gloo group
    return ch.broadcast({"ok": True} if rank == 1 else None)["ok"]


def _cuda_gloo(rank: int, world_size: int) -> bool:
    tensors = _tensor_list(4)
    on_gpu = [t.cuda() if i % 3 == 0 else t for i, t in enumerate(tensors)]  # mixed host/device
    tc = TensorChannel(None, 0, device="cuda", verify=True)
    for _ in range(3):  # the pinned staging buffer is reused across calls
        got = tc.broadcast(on_gpu if rank == 0 else [(t.dtype, tuple(t.shape)) for t in tensors])
        assert all(g.device.type == "cuda" for g in got)
        assert all(_bytes_equal(x, y.cpu()) for x, y in zip(tensors, got))
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_channel_cuda_staging_over_gloo() -> None:
    assert run_ranks(_cuda_gloo, 2, timeout=200) == [True, True]


def _remote_follower_killed(rank: int, world_size: int) -> str:
    ch = ObjectChannel(None, 0, force_remote=True, timeout=60.0)
    assert ch.broadcast("hello" if rank == 0 else None) == "hello"
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(2000):
            ch.broadcast(b"x" * 100 if rank == 0 else None)
            time.sleep(0.001)
    except PeerError as e:
        return str(e)
    raise AssertionError("the dead follower was never noticed")


def test_process_group_path_names_the_dead_rank() -> None:
    with spawn_ranks(_remote_follower_killed, 3, timeout=120) as group:
        out = group.results(allow_dead=[2])
    assert re.search(r"rank 2 \(host [^)]+\) died \(pid \d+\)", out[0]), out[0]


# (patched platform facts, ring expected) -- the facts _futex derives from the CPU at import
PLATFORM_CASES = {
    "aarch64-no-libatomic": ({"NEEDS_RELEASE_FENCE": True, "HAVE_FENCE": False, "BIG_ENDIAN": False}, False),
    "aarch64-libatomic": ({"NEEDS_RELEASE_FENCE": True, "HAVE_FENCE": True, "BIG_ENDIAN": False}, True),
    "x86-no-libatomic": ({"NEEDS_RELEASE_FENCE": False, "HAVE_FENCE": False, "BIG_ENDIAN": False}, True),
    "s390x": ({"NEEDS_RELEASE_FENCE": True, "HAVE_FENCE": True, "BIG_ENDIAN": True}, False),
}


def _platforms(rank: int, world_size: int) -> dict:
    """Per case: does ObjectChannel keep the ring, which ranks go remote, does the object
    arrive, and how many 'ShmRing refused' warnings this process logged (two channels/case)."""
    import logging

    import cpmeta.transport._futex as futex

    records: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "refused" in record.getMessage():
                records.append(record.getMessage())

    logging.getLogger("cpmeta.transport").addHandler(_Catch())
    saved = {k: getattr(futex, k) for k in PLATFORM_CASES["s390x"][0]}
    out = {}
    for name, (facts, _) in PLATFORM_CASES.items():
        for k, v in facts.items():
            setattr(futex, k, v)
        before = len(records)
        seen = []
        for _ in range(2):  # a second channel on the same platform warns no more
            with ObjectChannel(None, 0, timeout=30) as ch:
                got = ch.broadcast({"case": name} if rank == 0 else None)
                seen.append((ch.ring is not None, ch.remote_ranks, got == {"case": name}))
        out[name] = (seen, len(records) - before)
        for k, v in saved.items():
            setattr(futex, k, v)
    return out


def test_ring_refused_on_unsupported_platforms() -> None:
    """Weakly ordered CPU without a fence, or big-endian: process-group path, ONE warning on
    the source; a working fence or x86 keeps the ring."""
    driver, follower = run_ranks(_platforms, 2, timeout=200)
    for name, (_, ring) in PLATFORM_CASES.items():
        for rank, (seen, warnings) in ((0, driver[name]), (1, follower[name])):
            assert seen == [(ring, [] if ring else [1], True)] * 2, (name, rank, seen)
            assert warnings == (1 if rank == 0 and not ring else 0), (name, rank, warnings)


def test_ring_unsupported_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import cpmeta.transport._futex as futex
    from cpmeta.transport import ShmRing

    monkeypatch.setattr(futex, "BIG_ENDIAN", False)
    monkeypatch.setattr(futex, "NEEDS_RELEASE_FENCE", True)
    monkeypatch.setattr(futex, "HAVE_FENCE", False)
    assert "libatomic" in futex.ring_unsupported_reason()
    with pytest.raises(OSError, match="libatomic"):
        ShmRing.create(1, slot_size=64, num_slots=4)
    monkeypatch.setattr(futex, "HAVE_FENCE", True)
    assert futex.ring_unsupported_reason() is None
    monkeypatch.setattr(futex, "BIG_ENDIAN", True)
    assert "big-endian" in futex.ring_unsupported_reason()


def _tensor_channel_stall(rank: int, world_size: int, sleeper: int) -> tuple[str, float]:
    """``sleeper`` sleeps 4 s before the second broadcast; the others must give up after the
    channel's 1 s timeout (not the group's 200 s) with an error naming whom they awaited."""
    ch = TensorChannel(None, 0, timeout=1.0)
    x = torch.arange(1000, dtype=torch.int32)
    ch.broadcast([x] if rank == 0 else [(torch.int32, (1000,))])
    if rank == sleeper:
        time.sleep(4.0)
        return "slept", 0.0
    t0 = time.monotonic()
    try:
        ch.broadcast([x] if rank == 0 else [(torch.int32, (1000,))])
    except TimeoutError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


@pytest.mark.parametrize("sleeper", [0, 1])
def test_tensor_channel_stall_is_bounded_by_its_timeout(sleeper: int) -> None:
    out = run_ranks(_tensor_channel_stall, 2, sleeper, timeout=200)
    err, dt = out[1 - sleeper]
    assert f"awaited rank(s) [{sleeper}]" in err and dt < 3.0, out


@pytest.mark.parametrize("seed", range(6))
def test_coalesced_buffer_is_laid_by_the_frame_rule(seed: int) -> None:
    """``coalesce.plan``: a dtype run starts 16-aligned, a run's tensors lie back to back, and
    tensors of the frame's dtypes given in dtype runs lie exactly where a builder arena / a frame
    region puts them (``ArenaLayout``: the one rule). Random descriptors of every codec dtype,
    empty tensors too."""
    from cpmeta.buffers import DTYPE_CODE, ArenaLayout
    from cpmeta.transport.coalesce import plan

    rng = random.Random(seed)
    pool = ["bool", "int32", *rng.sample(sorted(DTYPES), 2)]  # few dtypes: runs of several tensors
    descs = [TensorDesc(DTYPES[rng.choice(pool)], tuple(rng.randrange(0, 7) for _ in range(rng.randrange(1, 3))))
             for _ in range(rng.randrange(4, 16))]
    offsets, total = plan(descs, 40)
    for i, (d, off) in enumerate(zip(descs, offsets)):
        same_run = i > 0 and descs[i - 1].dtype == d.dtype
        assert off == (offsets[i - 1] + descs[i - 1].nbytes if same_run else -(-(offsets[i - 1] + descs[i - 1].nbytes if i else 40) // 16) * 16)
        assert off % d.dtype.itemsize == 0
    assert total % 16 == 0 and total >= offsets[-1] + descs[-1].nbytes
    runs = sorted((d for d in descs if d.dtype in DTYPE_CODE), key=lambda d: DTYPE_CODE[d.dtype])  # a frame's order
    lay = ArenaLayout([(str(i), d.shape, d.dtype) for i, d in enumerate(runs)])
    want = [lay.fields[str(i)][0] * d.dtype.itemsize for i, d in enumerate(runs)]
    assert plan(runs, 0)[0] == want


def test_background_jobs_run_in_order_and_end_with_their_channel() -> None:
    """``transport.background``: one helper thread per channel, jobs in order, a job's error
    raised by its wait, a bounded wait that times out, the thread gone once the channel is."""
    import gc
    import threading

    from cpmeta.transport import background

    class Channel:  # what background needs of a channel: identity, a key for its messages
        channel_key = "test/background"

    ch, order, gate, before = Channel(), [], threading.Event(), set(threading.enumerate())
    first = background(ch, lambda: gate.wait(10) and order.append(1))
    with pytest.raises(TimeoutError, match="test/background"):
        first(0.05)  # held by the gate
    second = background(ch, lambda: order.append(2) or 7)
    failing = background(ch, lambda: 1 // 0)
    gate.set()
    assert second(10) == 7 and order == [1, 2]
    with pytest.raises(ZeroDivisionError):
        failing(10)
    helpers = [t for t in threading.enumerate() if t.name == "cpmeta-background" and t not in before]
    assert len(helpers) == 1
    del ch, first, second, failing
    gc.collect()
    helpers[0].join(5)
    assert not helpers[0].is_alive()


def _switches(rank: int, world: int) -> list[str]:
    out = []
    for make in (lambda: ObjectChannel(None, 0, force_remote="no"), lambda: TensorChannel(None, 0, verify=1),
                 lambda: ObjectChannel(None, torch.tensor(0)), lambda: TensorChannel(None, torch.tensor([0, 1])),
                 lambda: ObjectChannel(None, 0, agree=torch.tensor([1, 2])),
                 lambda: ObjectChannel(None, 0, agree={"n": torch.tensor(3)})):
        try:
            make()
            out.append("made")
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_channel_switches_and_src_are_checked_by_name() -> None:
    """``force_remote="no"`` was on (taken by its truth); a tensor ``src`` or ``agree`` failed in
    torch's ambiguous truth of a tensor comparison."""
    (out,) = run_ranks(_switches, 1, timeout=60)
    assert out[:2] == ["TypeError: force_remote: expected a bool (or None for the default), got 'no'",
                       "TypeError: verify: expected a bool (or None for the default), got 1"], out
    assert all(m.startswith("ValueError: src: global rank") for m in out[2:4]), out
    assert out[4:] == ["TypeError: agree: expected a mapping of setting names to scalars, got Tensor",
                       "TypeError: agree['n']: expected a str setting name and a scalar (None, bool, int, float or "
                       "str), got Tensor"], out
