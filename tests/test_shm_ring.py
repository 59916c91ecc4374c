"""Tests of transport.ShmRing: in-process (threads) protocol checks and real multi-process runs."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from multiproc import spawn_ranks, run_ranks
from cpmeta.transport import PeerError, RingClosedError, ShmRing, ShmRingHandle
from cpmeta.transport._segment import is_segment_path
from cpmeta.transport.ring_njit import CLAIM_CLOSED, CLAIM_SLOW, ring_claim, ring_publish
from cpmeta.transport.shm_ring import ABSENT, ATTACHED, CLOSED

pytestmark = pytest.mark.timeout(180)


def _shm_listing() -> set[str]:
    """Entries of /dev/shm this package could create (other processes on the machine may add
    unrelated ones while the test runs). A test asserts that the listing after it is a subset of
    the one before: a name left by a writer killed in an earlier run may be reaped meanwhile."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(("cpmeta", "psm_"))}


def _ring(num_readers: int = 2, **kw: object) -> tuple[ShmRing, list[ShmRing]]:
    w = ShmRing.create(num_readers, **{"slot_size": 64, "num_slots": 4, "timeout": 5.0, **kw})
    h = ShmRingHandle.from_bytes(w.handle.to_bytes())
    readers = [ShmRing.attach(h, i, timeout=w.timeout) for i in range(num_readers)]
    w.wait_attached()
    return w, readers


def _pump(w: ShmRing, readers: list[ShmRing], msgs: list[bytes], slow: int = -1) -> list[list[bytes]]:
    out: list[list[bytes]] = [[] for _ in readers]

    def consume(i: int) -> None:
        for k in range(len(msgs)):
            if i == slow and k % 7 == 0:
                time.sleep(0.002)
            out[i].append(readers[i].read_bytes())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(readers))]
    for t in threads:
        t.start()
    for m in msgs:
        w.write(m)
    for t in threads:
        t.join(30)
    return out


# ----------------------------------------------------------------------------- in-process

@pytest.mark.parametrize("size", [0, 1, 47, 48, 49, 112, 200, 256 - 16, 256 - 15, 1000, 5000])
def test_single_message_sizes(size: int) -> None:
    w, readers = _ring()
    msg = bytes(random.Random(size).randrange(256) for _ in range(size))
    try:
        out = _pump(w, readers, [msg, b"after"])
        assert out == [[msg, b"after"], [msg, b"after"]]
    finally:
        for r in (w, *readers):
            r.close()


def test_wraparound_thousands_with_slow_reader() -> None:
    rng = random.Random(7)
    msgs = [rng.randbytes(rng.choice([0, 5, 48, 60, 100, 250, 600])) for _ in range(3000)]
    w, readers = _ring(3)
    try:
        out = _pump(w, readers, msgs, slow=1)
        assert all(o == msgs for o in out)
        assert w._w.head.value > 3 * w.handle.num_slots  # wrapped many times
    finally:
        for r in (w, *readers):
            r.close()


def _direct_write(w: ShmRing, payload: bytes) -> str:
    """``payload`` sent as a compiled writer sends it (``direct()``'s words, ``ring_claim``, the
    bytes, ``ring_publish``, ``direct_published``) -- through ``write`` when the claim refuses
    (a pad, a wait, a message larger than the ring, a closed reader). Returns the path taken."""
    def claimed() -> bool:  # (its views of the mapping die with it: nothing pins the mapping after)
        words = w.direct()
        assert words is not None
        m32, m64, m8, n, slots, size, data_at, floor = words
        pos, head = ring_claim(m32, m64, n, slots, size, data_at, len(payload), floor)
        if pos < 0:
            assert pos in (CLAIM_SLOW, CLAIM_CLOSED)
            return False
        m8[pos:pos + len(payload)] = np.frombuffer(payload, np.uint8)
        w.direct_published(ring_publish(m32, m64, n, head))
        return True

    if claimed():
        return "direct"
    w.write(payload)
    return "write"


def test_compiled_writer_claims_in_place_and_leaves_pads_and_waits_to_write() -> None:
    """Messages claimed, filled and published by the compiled calls reach every reader in order
    with the ones ``write`` sends when a claim needs a pad, a wait (a slow reader) or more than
    the ring; the writer's tail floor is refreshed by the claim itself (no ``write`` needed)."""
    rng = random.Random(11)
    msgs = [rng.randbytes(rng.choice([0, 5, 48, 60, 100, 200, 300])) for _ in range(2000)]
    w, readers = _ring(2)
    paths: dict[str, int] = {}
    out: list[list[bytes]] = [[], []]

    def consume(i: int) -> None:
        for k in range(len(msgs)):
            if i == 1 and k % 7 == 0:
                time.sleep(0.001)
            out[i].append(readers[i].read_bytes())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for m in msgs:
            p = _direct_write(w, m)
            paths[p] = paths.get(p, 0) + 1
        for t in threads:
            t.join(30)
        assert out == [msgs, msgs]
        assert paths["direct"] > 200 and paths["write"] > 100, paths  # both paths, interleaved
    finally:
        for r in (w, *readers):
            r.close()


def test_compiled_claim_refuses_past_a_closed_reader_and_wakes_a_parked_one() -> None:
    """A claim past a reader that closed its end writes nothing (``write`` then names it);
    ``direct()`` is the writer's, and not while a ``reserve`` is pending; a publish tells the
    writer to wake a reader parked in ``FUTEX_WAIT``, which then reads the message."""
    w, readers = _ring(2, timeout=5.0)
    try:
        assert readers[0].direct() is None
        view, _ = w.reserve(8)
        view.release()
        assert w.direct() is None
        w.commit()
        for r in readers:
            assert r.read_bytes() == bytes(8)
        readers[0]._spin_s = 0.0  # parks at once
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(readers[0].read_bytes()))
        t.start()
        deadline = time.monotonic() + 10
        while not w._w.waiting[0].value and time.monotonic() < deadline:
            time.sleep(0.001)
        m32, m64, m8, n, slots, size, data_at, floor = w.direct()
        pos, head = ring_claim(m32, m64, n, slots, size, data_at, 3, floor)
        m8[pos:pos + 3] = np.frombuffer(b"abc", np.uint8)
        wake = ring_publish(m32, m64, n, head)
        assert wake  # reader 0's waiting flag
        w.direct_published(wake)
        del m32, m64, m8  # no view of the mapping outlives its use (close unmaps it)
        t.join(10)
        assert got == [b"abc"] and readers[1].read_bytes() == b"abc"
        readers[1].close()
        before = w._w.head.value
        assert ring_claim(*w.direct()[:2], n, slots, size, data_at, 3, 0) == (CLAIM_CLOSED, 0)
        assert w._w.head.value == before
        with pytest.raises(PeerError, match=r"rank 2 \(reader 1\) closed the ring"):
            _direct_write(w, b"z")
    finally:
        for r in (w, *readers):
            r.close()


def test_portable_fallback_without_futex_or_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux (no futex: sleep-polling) and without libatomic (always wake) it still works."""
    import cpmeta.transport._futex as futex
    import cpmeta.transport._ring_io as ring_io

    monkeypatch.setattr(futex, "_WAIT", None)
    monkeypatch.setattr(futex, "_WAKE", None)
    monkeypatch.setattr(ring_io, "HAVE_FENCE", False)
    rng = random.Random(3)
    msgs = [rng.randbytes(rng.choice([0, 30, 100, 700])) for _ in range(300)]
    w, readers = _ring(2)
    try:
        assert all(o == msgs for o in _pump(w, readers, msgs, slow=0))
    finally:
        for r in (w, *readers):
            r.close()


def test_gather_write_and_in_place_consumer() -> None:
    w, readers = _ring(1, slot_size=128, num_slots=8)
    w.write([b"ab", memoryview(b"cd"), bytearray(b"ef")])
    assert readers[0].read(lambda view, owned: (bytes(view), owned)) == (b"abcdef", False)
    t = threading.Thread(target=lambda: (w.write(b"x" * 5000), w.write(b"y" * 3000)))
    t.start()  # both are larger than the 1 KiB ring: streamed into a private buffer
    assert readers[0].read(lambda view, owned: (bytes(view), owned)) == (b"x" * 5000, True)
    assert readers[0].read_bytes() == b"y" * 3000
    t.join()
    for r in (w, *readers):
        r.close()


def test_writer_timeout_names_lagging_reader() -> None:
    w, readers = _ring(2, timeout=0.3)
    try:
        w.write(b"a" * 100)  # 2 slots
        assert readers[0].read_bytes() == b"a" * 100
        w.write(b"b" * 100)  # reader 1 now 4 slots behind, reader 0 two
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 2 \(reader 1\) is 4 slot\(s\) behind"):
            w.write(b"c")
        assert time.monotonic() - t0 < 3.0
    finally:
        for r in (w, *readers):
            r.close()


def test_reader_idle_is_not_a_timeout_and_writer_close() -> None:
    """A reader waits for the next message as long as the writer lives, whatever the timeout
    (on 4ac8a65: ``TimeoutError ... slot 0 not yet published`` after 0.2 s); published data is
    still delivered after the writer closes, then ``RingClosedError``."""
    w, readers = _ring(1, timeout=0.2)
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(readers[0].read_bytes()))
    t.start()
    time.sleep(0.6)  # three times the timeout, idle
    assert t.is_alive() and not got
    w.write(b"late")
    t.join(5.0)
    assert got == [b"late"]
    w.write(b"last")
    w.close()
    assert readers[0].read_bytes() == b"last"  # published data is still delivered
    with pytest.raises(RingClosedError, match="closed the ring"):
        readers[0].read_bytes()
    readers[0].close()


def test_reader_timeout_in_the_middle_of_a_message() -> None:
    """A message in flight is bounded: a streamed message whose rest does not come (the writer
    waits on a reader that never reads) is a ``TimeoutError`` naming the writer on the reader
    that got its start, and naming the lagging reader on the writer."""
    w, readers = _ring(2, timeout=0.3)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            w.write(b"m" * 1000)  # 1000 B through a 256 B ring: streamed
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for writer rank 0 in the middle of a message"):
        readers[0].read_bytes()
    assert time.monotonic() - t0 < 3.0
    t.join(5.0)
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError), errors
    assert "rank 2 (reader 1)" in str(errors[0])
    for r in (w, *readers):
        r.close()


def test_closed_reader_reported_at_the_next_message() -> None:
    """A reader that closes its end (its process living on) is named by the very next write,
    which publishes nothing (on 4ac8a65: only once the ring filled up, ``num_slots`` messages
    later, and the messages before reached the other readers)."""
    w, readers = _ring(2, timeout=5.0)
    w.write(b"before")
    readers[1].close()
    assert w.states() == [ATTACHED, CLOSED]
    head = w.backlog()
    with pytest.raises(PeerError, match=r"rank 2 \(reader 1\) closed the ring"):
        w.write(b"z")
    assert w.backlog() == head  # nothing published
    assert readers[0].read_bytes() == b"before"
    w.close()  # the survivor hears what the writer saw gone, not only that it closed
    with pytest.raises(RingClosedError, match=r"writer rank 0 closed the ring \(gone before "
                                              r"it: rank 2 \(reader 1\) closed the ring\)"):
        readers[0].read_bytes()
    readers[0].close()


def test_gone_peers_name_closed_ends_on_either_side() -> None:
    """``gone_peers``: what each end sees gone without a message (for waits outside the ring):
    the writer a reader that closed, a reader the writer that closed; nothing while all live."""
    w, readers = _ring(2, timeout=5.0)
    assert w.gone_peers() == {} and readers[0].gone_peers() == {}
    readers[1].close()
    assert w.gone_peers() == {2: "rank 2 (reader 1) closed the ring"}
    w.close()
    assert readers[0].gone_peers() == {0: "rank 0 (writer) closed the ring"}
    readers[0].close()
    assert w.gone_peers() == {} and readers[0].gone_peers() == {}  # released ends see nothing


def test_absent_reader_not_waited_for() -> None:
    w = ShmRing.create(2, slot_size=64, num_slots=2, timeout=1.0)
    r0 = ShmRing.attach(ShmRingHandle.from_bytes(w.handle.to_bytes()), 0)
    w.mark_absent(1)
    assert w.states() == [ATTACHED, ABSENT]
    for i in range(5):
        w.write(b"%d" % i)
        assert r0.read_bytes() == b"%d" % i
    r0.close()
    w.close()


def test_named_segment_unlinked_after_attach_and_handle_checks() -> None:
    before = _shm_listing()
    w = ShmRing.create(1, slot_size=64, num_slots=2, use_memfd=False)
    assert w.handle.path.startswith("/dev/shm/cpmeta-") and is_segment_path(w.handle.path)
    assert os.stat(w.handle.path).st_mode & 0o777 == 0o600
    bad = ShmRingHandle(w.handle.path, b"\0" * 16, 1, 64, 2, os.getpid(), 0, (1,))
    with pytest.raises(ValueError, match="does not match"):
        ShmRing.attach(bad, 0)
    with pytest.raises(ValueError, match="reader_index"):
        ShmRing.attach(w.handle, 1)
    r = ShmRing.attach(w.handle, 0)
    w.wait_attached()
    assert not os.path.exists(w.handle.path)
    r.close()
    w.close()
    assert _shm_listing() <= before


def test_memfd_leaves_no_name_and_close_is_idempotent() -> None:
    before = _shm_listing()
    w, readers = _ring(1)
    assert w.handle.path.startswith("/proc/")
    assert _shm_listing() <= before
    for r in (w, *readers):
        r.close()
        r.close()
        assert r.closed
    with pytest.raises(ValueError):
        ShmRing.create(1, slot_size=60)


# ----------------------------------------------------------------------------- multi-process

def _payloads(seed: int) -> list[bytes]:
    """The same random payload list on every rank (shared seed): 0 B .. 3 MiB plus many small."""
    rng = random.Random(seed)
    sizes = [0, 1, 4096, 65536 - 16, 65536, 1 << 20, 3 << 20, 5 << 20]
    sizes += [rng.choice([0, 7, 100, 3000, 20000, 200000]) for _ in range(300)]
    sizes += [rng.randrange(64) for _ in range(2500)]  # wrap-around: thousands of messages
    return [rng.randbytes(n) for n in sizes]


def _ring_ranks(rank: int, world_size: int, seed: int) -> list:
    msgs = _payloads(seed)
    with ShmRing.from_process_group(dist.group.WORLD, 0, slot_size=4096, num_slots=16,
                                    timeout=60.0) as ring:
        if rank == 0:
            for m in msgs:
                ring.write(m)
            dist.barrier()
            return []
        digests = []
        for k in range(len(msgs)):
            if rank == 2 and k % 97 == 0:
                time.sleep(0.003)  # a deliberately slow reader
            digests.append(hashlib.sha1(ring.read_bytes()).hexdigest())
        dist.barrier()
        assert digests == [hashlib.sha1(m).hexdigest() for m in msgs]
        return [len(digests)]


def _idle_ranks(rank: int, world_size: int) -> list[float]:
    with ShmRing.from_process_group(dist.group.WORLD, 0, timeout=30.0) as ring:
        dist.barrier()
        if rank == 0:
            time.sleep(2.0)
            ring.write(b"wake up")
            dist.barrier()
            return []
        cpu0, wall0 = time.process_time(), time.monotonic()
        assert ring.read_bytes() == b"wake up"
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        dist.barrier()
        return [cpu, wall]


def test_multiprocess_random_payloads_wraparound_slow_reader() -> None:
    before = _shm_listing()
    seed = random.randrange(1 << 30)
    out = run_ranks(_ring_ranks, 3, seed, timeout=150)
    assert out[1] == out[2] == [len(_payloads(seed))]
    assert _shm_listing() <= before


def test_idle_follower_uses_almost_no_cpu() -> None:
    out = run_ranks(_idle_ranks, 2, timeout=90)
    cpu, wall = out[1]
    assert wall >= 1.5, "the follower did not actually wait"
    assert cpu < 0.05 * wall, f"idle follower used {cpu:.3f} s CPU in {wall:.2f} s"


def _kill_reader(rank: int, world_size: int) -> list:
    ring = ShmRing.from_process_group(dist.group.WORLD, 0, slot_size=256, num_slots=4, timeout=60.0)
    if rank == 2:
        ring.read_bytes()
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        t0 = time.monotonic()
        try:
            for _ in range(1000):
                ring.write(b"m" * 200)
                time.sleep(0.001)
        except PeerError as e:
            ring.close()
            return [str(e), time.monotonic() - t0]
        raise AssertionError("the writer never noticed the dead reader")
    try:
        while True:
            ring.read_bytes()
    except RingClosedError as e:
        return [str(e), 0.0]


def _kill_writer(rank: int, world_size: int) -> list:
    ring = ShmRing.from_process_group(dist.group.WORLD, 0, timeout=60.0)
    if rank == 0:
        ring.write(b"one")
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    assert ring.read_bytes() == b"one"
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="writer rank 0, pid .* died") as info:
        ring.read_bytes()
    return [str(info.value), time.monotonic() - t0]


def test_sigkilled_reader_reported_by_rank_fast() -> None:
    before = _shm_listing()
    with spawn_ranks(_kill_reader, 3, timeout=120) as group:
        out = group.results(allow_dead=[2])
    msg, elapsed = out[0]
    assert "rank 2 (reader 1)" in msg and "died" in msg
    assert elapsed < 20.0  # the ring timeout is 60 s: detected from the pid, not the timeout
    assert "closed the ring" in out[1][0]
    assert _shm_listing() <= before


def test_sigkilled_writer_reported_fast() -> None:
    before = _shm_listing()
    with spawn_ranks(_kill_writer, 3, timeout=120) as group:
        out = group.results(allow_dead=[0])
    for msg, elapsed in out[1:]:
        assert "writer rank 0" in msg and elapsed < 20.0
    assert _shm_listing() <= before


def _kill_reader_between_messages(rank: int, world_size: int) -> list:
    """Reader 2 dies while the ring has plenty of room: the next write must name it at once."""
    ring = ShmRing.from_process_group(dist.group.WORLD, 0, slot_size=4096, num_slots=64, timeout=60.0)
    if rank == 0:
        ring.write(b"first")
        time.sleep(1.5)  # reader 2 has read and died by now; 63 free slots remain
        writes = 0
        try:
            for _ in range(10):
                ring.write(b"next")
                writes += 1
        except PeerError as e:
            ring.close()
            return [str(e), writes]
        raise AssertionError("the writer kept writing to a ring with a dead reader")
    assert ring.read_bytes() == b"first"
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            ring.read_bytes()
    except (RingClosedError, PeerError) as e:
        return [str(e), -1]


def test_dead_reader_named_at_the_next_write() -> None:
    before = _shm_listing()
    with spawn_ranks(_kill_reader_between_messages, 3, timeout=120) as group:
        out = group.results(allow_dead=[2])
    msg, writes = out[0]
    assert "rank 2 (reader 1)" in msg and "died" in msg, msg
    assert writes == 0, f"{writes} writes went to a ring whose reader was already dead"
    assert _shm_listing() <= before


def test_peer_watch_with_a_pidfd_above_1024() -> None:
    """``PeerWatch.dead()`` works when its pidfd is numbered above FD_SETSIZE (1024)."""
    import resource
    import subprocess
    import sys

    from cpmeta.transport._segment import PeerWatch

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1400:
        pytest.skip("hard RLIMIT_NOFILE too low")
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1400, hard))
    padding = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch = PeerWatch(child.pid)
        if watch._pidfd is None:
            pytest.skip("no pidfd on this kernel")
        assert watch._pidfd >= 1024 and not watch.dead()
        child.kill()
        child.wait()
        assert watch.dead()
        watch.close()
    finally:
        child.kill()
        child.wait()
        for fd in padding:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_announced_reader_warms_then_reads_and_drops_a_failing_hook() -> None:
    """A reader spinning for an announced message calls its ``warm`` hook (repeatedly, every
    ``WARM_EVERY_S``) until the message lands, then reads it; a hook that raises is dropped
    (the message is still read) and never called again; an oversubscribed reader (yielding its
    core) does not warm at all."""
    w, (r,) = _ring(1)
    try:
        for case in ("ok", "raises", "yield"):
            calls: list[float] = []

            def hook() -> None:
                calls.append(time.perf_counter())
                if case == "raises":
                    raise RuntimeError("a broken warm hook")

            r.warm = hook
            r._yield_spin = case == "yield"  # noqa: SLF001 - the ring's own core test
            got: list[bytes] = []
            t = threading.Thread(target=lambda: got.append(r.read_bytes()))
            t.start()
            time.sleep(0.05)  # parked
            w.announce()
            time.sleep(0.005)  # the step is being built: ~50 warm periods
            w.write(case.encode())
            t.join(5.0)
            assert got == [case.encode()]
            if case == "ok":
                assert len(calls) >= 3 and r.warm is hook
            elif case == "raises":
                assert len(calls) == 1 and r.warm is None
            else:
                assert calls == []
    finally:
        for x in (w, r):
            x.close()


def test_a_warm_hook_of_pieces_is_left_between_two_pieces_once_the_message_is_in() -> None:
    """A hook that returns an iterator is run piece by piece: an endless one (a piece every 0.2
    ms) still lets the reader take its message, and it is called again on the next spin."""
    w, (r,) = _ring(1)
    r._spin_s = 0.05  # noqa: SLF001 - the ring's own core test: spin whatever the cores
    r._yield_spin = False  # noqa: SLF001
    try:
        pieces: list[int] = []
        calls: list[int] = []

        def endless() -> Any:
            calls.append(1)
            while True:
                pieces.append(1)
                time.sleep(0.0002)
                yield

        r.warm = endless
        got: list[bytes] = []
        for msg in (b"one", b"two"):
            t = threading.Thread(target=lambda: got.append(r.read_bytes()))
            t.start()
            time.sleep(0.005)  # spinning for the message, inside the endless warm
            w.write(msg)
            t.join(5.0)
            assert not t.is_alive(), "the reader never left its warm hook"
        assert got == [b"one", b"two"] and len(calls) >= 2 and len(pieces) >= 10 and r.warm is endless
    finally:
        for x in (w, r):
            x.close()


def test_spinning_reader_warms_while_it_waits_for_the_next_message() -> None:
    """A reader spinning after a message (``CPMETA_SHM_SPIN_US``) calls its ``warm`` hook while
    it waits for the next one, then reads it."""
    w, (r,) = _ring(1)
    r._spin_s = 0.05  # noqa: SLF001 - the ring's own core test: spin whatever the cores
    r._yield_spin = False  # noqa: SLF001
    try:
        calls: list[int] = []
        r.warm = lambda: calls.append(1)
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(r.read_bytes()))
        t.start()
        time.sleep(0.005)  # ~50 warm periods of spinning for the next message
        w.write(b"next")
        t.join(5.0)
        assert got == [b"next"] and len(calls) >= 3
    finally:
        for x in (w, r):
            x.close()


# ----------------------------------------------------------------------------- a full tmpfs

@pytest.fixture
def tiny_tmpfs(tmp_path: Any) -> Any:
    """A 1 MiB tmpfs (a container's small /dev/shm, in miniature); root only."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_tmpfs_refuses_the_ring_at_create_not_with_sigbus_at_a_write(tiny_tmpfs: str) -> None:
    """A /dev/shm segment larger than the room left: ``OSError`` (ENOSPC) at create, nothing left
    behind; a ring that fits works. (A sparse segment was created and the process died of SIGBUS
    at the first write that touched a page with no room: exit 135 in a subprocess, 2026-12-06.)"""
    script = f"""
import errno, os
from cpmeta.transport import _segment, ShmRing, ShmRingHandle
_segment._SHM_DIR = {tiny_tmpfs!r}
try:
    ShmRing.create(1, slot_size=65536, num_slots=64, use_memfd=False)  # 4 MiB
except OSError as e:
    assert e.errno == errno.ENOSPC and {tiny_tmpfs!r} in str(e), e
else:
    raise AssertionError("a 4 MiB ring was made in a 1 MiB tmpfs")
assert os.listdir({tiny_tmpfs!r}) == []
w = ShmRing.create(1, slot_size=4096, num_slots=64, use_memfd=False)  # 260 KiB: fits
r = ShmRing.attach(ShmRingHandle.from_bytes(w.handle.to_bytes()), 0)
w.wait_attached()
for i in range(200):
    w.write(b"%d" % i * 1000)
    assert r.read_bytes() == b"%d" % i * 1000
r.close()
w.close()
assert os.listdir({tiny_tmpfs!r}) == []
"""
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])


def _full_shm_channel(rank: int, world_size: int, shm_dir: str) -> Any:
    from cpmeta.transport import ObjectChannel, _segment

    _segment._SHM_DIR = shm_dir
    del os.memfd_create  # the named fallback: the one a small /dev/shm limits
    with ObjectChannel(slot_size=65536, num_slots=64, timeout=30.0) as ch:
        got = [ch.broadcast({"step": k} if rank == 0 else None) for k in range(20)]
        return ch.ring is None, got


def test_a_full_tmpfs_sends_every_follower_over_the_process_group(tiny_tmpfs: str) -> None:
    """The driver cannot reserve its ring: every rank still gets every message, over gloo."""
    out = run_ranks(_full_shm_channel, 2, tiny_tmpfs, timeout=90)
    assert out == [(True, [{"step": k} for k in range(20)])] * 2


def _fake_cgroups(tmp_path: Any, monkeypatch: Any, v1: bool, levels: dict[str, tuple[str, int, int]],
                  swap_kb: int = 0, mount_at: str = "", root: str = "/") -> None:
    """A cgroup tree under ``tmp_path``: ``levels`` maps a folder below the mount to its
    (limit, usage, file pages); this process sits in the deepest, ``root`` + that folder in
    the hierarchy, and the mount (``tmp_path/memory`` for v1, ``tmp_path/mount_at`` for v2)
    shows the hierarchy's ``root``."""
    from cpmeta.transport import _segment

    mount = tmp_path / ("memory" if v1 else mount_at)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_") if v1 else \
        ("memory.max", "memory.current", "")
    for rel, (limit, usage, files) in levels.items():
        d = mount / rel.strip("/") if rel != "/" else mount
        d.mkdir(parents=True, exist_ok=True)
        (d / names[0]).write_text(f"{limit}\n")
        (d / names[1]).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"{names[2]}active_file {files // 2}\n{names[2]}inactive_file "
                                       f"{files - files // 2}\n{names[2]}shmem 0\n")
    leaf = os.path.normpath(root + "/" + max(levels, key=len))
    (tmp_path / "self_cgroup").write_text(("5:memory:" + leaf + "\n0::/\n" if v1 else "0::" + leaf + "\n")
                                          + "garbled line\n")
    (tmp_path / "meminfo").write_text(f"MemTotal: 1000 kB\nSwapTotal: {swap_kb} kB\n")
    point = str(mount).replace(" ", "\\040")  # mountinfo's escape for a space
    (tmp_path / "mountinfo").write_text(
        "22 1 0:21 / /proc rw - proc proc rw\ngarbled\n"
        f"35 31 0:32 {root} {point if v1 else tmp_path / 'memory'} rw - cgroup cgroup rw,memory\n"
        f"36 31 0:33 / {tmp_path / 'cpu'} rw - cgroup cgroup rw,cpu\n"
        f"41 31 0:38 {root} {point if not v1 else tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n")
    monkeypatch.setattr(_segment, "_MOUNTINFO", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(_segment, "_PROC_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(_segment, "_MEMINFO", str(tmp_path / "meminfo"))


@pytest.mark.parametrize("v1", [True, False], ids=["cgroup-v1", "cgroup-v2"])
def test_memory_cgroup_room_is_the_tightest_limit_less_what_reclaim_cannot_free(tmp_path: Any, monkeypatch: Any,
                                                                               v1: bool) -> None:
    """The room of the leaf and of each limited ancestor; file pages count as free, the least
    wins and names its folder; no limit, or swap on the host: unknown (None)."""
    from cpmeta.transport._segment import memory_cgroup_room

    unlimited = str((1 << 63) - 4096) if v1 else "max"
    mib = 1 << 20
    _fake_cgroups(tmp_path, monkeypatch, v1, {"/": (unlimited, 900 * mib, 0),
                                              "/job": (1024 * mib, 800 * mib, 300 * mib),
                                              "/job/rank0": (unlimited, 100 * mib, 0)})
    job = os.path.join(str(tmp_path), "memory" if v1 else "", "job")
    assert memory_cgroup_room() == (524 * mib, os.path.normpath(job))
    _fake_cgroups(tmp_path, monkeypatch, v1, {"/job": (1024 * mib, 800 * mib, 300 * mib),
                                              "/job/rank0": (600 * mib, 500 * mib, 0)})
    assert memory_cgroup_room() == (100 * mib, os.path.normpath(job + "/rank0"))
    _fake_cgroups(tmp_path, monkeypatch, v1, {"/job": (1024 * mib, 800 * mib, 300 * mib),
                                              "/job/rank0": (600 * mib, 500 * mib, 0)}, swap_kb=1024)
    assert memory_cgroup_room() is None
    _fake_cgroups(tmp_path, monkeypatch, v1, {"/job": (unlimited, 800 * mib, 0)})
    assert memory_cgroup_room() is None


def test_memory_cgroup_room_finds_the_hierarchy_where_mountinfo_puts_it(tmp_path: Any, monkeypatch: Any) -> None:
    """A hybrid host's v2 at ``unified`` (a path with a space), a container's mount of its own
    subtree (the mount's root is that subtree's folder), and a mount of a subtree that does not
    hold the process (unknown: None)."""
    from cpmeta.transport._segment import memory_cgroup_room

    mib = 1 << 20
    _fake_cgroups(tmp_path, monkeypatch, False, {"/job": (1024 * mib, 800 * mib, 0)}, mount_at="uni fied")
    assert memory_cgroup_room() == (224 * mib, str(tmp_path / "uni fied" / "job"))
    _fake_cgroups(tmp_path, monkeypatch, False, {"/": (512 * mib, 100 * mib, 0), "/rank0": ("max", 50 * mib, 0)},
                  mount_at="box", root="/kubepods/pod7")
    assert memory_cgroup_room() == (412 * mib, str(tmp_path / "box"))
    (tmp_path / "self_cgroup").write_text("0::/elsewhere/rank0\n")
    assert memory_cgroup_room() is None


def test_a_ring_past_its_memory_cgroup_room_is_refused_with_oserror(tmp_path: Any, monkeypatch: Any) -> None:
    """The check comes before any segment exists: ``OSError`` (ENOMEM) naming the size, the
    cgroup and the variables that size the ring, and no descriptor left open; a ring within
    the room is made."""
    import errno

    from cpmeta.transport import _segment

    _fake_cgroups(tmp_path, monkeypatch, False, {"/job": (64 << 20, 60 << 20, 0)})
    fds = set(os.listdir("/proc/self/fd"))
    for memfd in (True, False):
        with pytest.raises(OSError) as err:
            ShmRing.create(1, slot_size=65536, num_slots=128, use_memfd=memfd)  # 8 MiB > 4 MiB of room
        assert err.value.errno == errno.ENOMEM
        assert f"memory cgroup {tmp_path}/job has room for {4 << 20} more" in str(err.value)
        assert "CPMETA_SHM_SLOT_SIZE" in str(err.value)
    assert set(os.listdir("/proc/self/fd")) == fds
    ShmRing.create(1, slot_size=4096, num_slots=64).close()
    assert _segment.memory_cgroup_room() == (4 << 20, f"{tmp_path}/job")


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "dev-shm"])
def test_a_large_ring_reads_the_room_again_before_each_step_of_its_reservation(tmp_path: Any, monkeypatch: Any,
                                                                               memfd: bool) -> None:
    """Another process of the cgroup takes most of its room while a 4-step ring is being
    reserved: the next step is refused with the same named ``OSError``, the partly reserved
    segment is gone (no descriptor, no /dev/shm name); with nobody taking room all four steps
    are made."""
    import errno

    from cpmeta.transport import _segment

    mib = 1 << 20
    _fake_cgroups(tmp_path, monkeypatch, False, {"/job": (64 * mib, 40 * mib, 0)})
    monkeypatch.setattr(_segment, "RESERVE_STEP", 1 * mib)
    real, steps = os.posix_fallocate, []

    def fallocate(fd: int, offset: int, length: int) -> None:
        steps.append((offset, length))
        real(fd, offset, length)
        if len(steps) == 2 and taker:  # our 2 MiB, then another driver's ring takes 21.5 of the 22 left
            (tmp_path / "job" / "memory.current").write_text(f"{64 * mib - mib // 2}\n")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    mine = f"-{os.getpid()}-"  # names of this process (another's dead leftovers may be reaped meanwhile)
    fds, names = set(os.listdir("/proc/self/fd")), {n for n in os.listdir(_segment._shm_dir()) if mine in n}
    taker = True
    with pytest.raises(OSError) as err:
        _segment.create_segment(4 * mib, use_memfd=memfd)
    assert err.value.errno == errno.ENOMEM and steps == [(0, mib), (mib, mib)]
    assert f"has room for {mib // 2} more, less than the next step of its reservation ({mib} bytes)" in str(err.value)
    assert set(os.listdir("/proc/self/fd")) == fds
    assert {n for n in os.listdir(_segment._shm_dir()) if mine in n} == names
    _fake_cgroups(tmp_path, monkeypatch, False, {"/job": (64 * mib, 40 * mib, 0)})
    taker, steps[:] = False, []
    seg = _segment.create_segment(4 * mib, use_memfd=memfd)
    try:
        assert steps == [(k * mib, mib) for k in range(4)] and os.fstat(seg.fd).st_size == 4 * mib
    finally:
        os.close(seg.fd)
        if seg.unlink_path:
            os.unlink(seg.unlink_path)


def test_a_memfd_past_a_real_memory_cgroup_limit_is_an_oserror_not_the_oom_killer() -> None:
    """A process in a cgroup v1 memory cgroup limited to 768 MiB (torch imported: ~160 MiB in
    use) asks for a 1 GiB ring: it gets ``OSError`` and lives (without the check the reservation
    ended it with SIGKILL: exit 137, 2026-12-06); a 4 MiB ring works there. Root and a v1 memory
    hierarchy only."""
    base = "/sys/fs/cgroup/memory"
    if os.geteuid() != 0 or not os.path.isfile(os.path.join(base, "memory.limit_in_bytes")):
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    group = os.path.join(base, f"cpmeta-test-{os.getpid()}-{random.Random().getrandbits(32):08x}")
    try:
        os.mkdir(group)
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(768 << 20))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    script = f"""
import errno, os
with open({os.path.join(group, "cgroup.procs")!r}, "w") as f:
    f.write(str(os.getpid()))
from cpmeta.transport import ShmRing
try:
    ShmRing.create(1, slot_size=1 << 20, num_slots=1024)
except OSError as e:
    assert e.errno == errno.ENOMEM and {group!r} in str(e), e
else:
    raise AssertionError("a 1 GiB ring was made in a 768 MiB cgroup")
ShmRing.create(1, slot_size=65536, num_slots=64).close()
"""
    try:
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        os.rmdir(group)
    assert got.returncode == 0, (got.returncode, got.stderr[-2000:])


def _cgroup_full_channel(rank: int, world_size: int, root: str) -> Any:
    from cpmeta.transport import ObjectChannel, _segment

    _segment._MOUNTINFO, _segment._PROC_CGROUP, _segment._MEMINFO = \
        os.path.join(root, "mountinfo"), os.path.join(root, "self_cgroup"), os.path.join(root, "meminfo")
    with ObjectChannel(slot_size=65536, num_slots=64, timeout=30.0) as ch:
        got = [ch.broadcast({"step": k} if rank == 0 else None) for k in range(20)]
        return ch.ring is None, got


def test_a_memory_cgroup_without_room_sends_every_follower_over_the_process_group(tmp_path: Any,
                                                                                   monkeypatch: Any) -> None:
    """The driver's cgroup has 1 MiB of room for a 4 MiB ring: every rank still gets every
    message, over gloo."""
    _fake_cgroups(tmp_path, monkeypatch, False, {"/job": (64 << 20, 63 << 20, 0)})
    out = run_ranks(_cgroup_full_channel, 2, str(tmp_path), timeout=90)
    assert out == [(True, [{"step": k} for k in range(20)])] * 2


def test_ring_arguments_are_named() -> None:
    """A size past int32 was an ``OverflowError`` of the segment's size, a handle that is not one
    an ``AttributeError`` of ``num_readers``."""
    for kw, err, msg in (({"slot_size": 2**63}, ValueError, "slot_size: expected an int within int32"),
                         ({"num_slots": 1.5}, TypeError, "num_slots: expected an int, got 1.5")):
        with pytest.raises(err, match=msg):
            ShmRing.create(1, **kw)
    with pytest.raises(ValueError, match="num_readers: expected an int within int32"):
        ShmRing.create(2**63)
    w = ShmRing.create(1, slot_size=64, num_slots=2, timeout=5)
    try:
        with pytest.raises(TypeError, match=r"^handle: expected a ShmRingHandle .*, got bytes$"):
            ShmRing.attach(b"x", 0)
        with pytest.raises(TypeError, match=r"^reader_index: expected an int, got True$"):
            ShmRing.attach(w.handle, True)
    finally:
        w.close()
