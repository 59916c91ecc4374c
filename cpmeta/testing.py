"""Multi-rank equivalence tests in a few lines: spawn real ranks, check that every rank holds
what the driver built (as ``torch.testing`` is for tensors).

A complete test module (``test_equivalence.py``; run it with ``python -m pytest -q``)::

    import cpmeta
    from cpmeta import MetadataConfig, SequenceMetadata
    from cpmeta.testing import assert_same_on_ranks, run_ranks


    def _step(rank: int, world_size: int, seqlen: int) -> int:  # module level: spawn imports it
        md = None
        if rank == 0:  # the driver builds the step's metadata
            seqs = [SequenceMetadata(seqlen_q=seqlen, seqlen_k=seqlen, block_table=[7, 3],
                                     state_id=0, token_ids=list(range(seqlen)))]
            md = cpmeta.prepare_prompt(seqs, MetadataConfig())
        with cpmeta.MetadataBroadcaster(src=0) as bc:  # collective: every rank constructs it
            md = bc.broadcast(md)
        assert_same_on_ranks(md, src=0)  # every field of every rank == rank 0's, bit for bit
        return int(md.positions[-1])


    def test_every_rank_holds_the_drivers_metadata() -> None:
        assert run_ranks(_step, 3, 20) == [19, 19, 19]

When a rank holds something else, every rank raises the same ``AssertionError`` and
``run_ranks`` raises :class:`RankFailure` with it, e.g.
``rank 2: 'positions' differs from rank 0's: 1 of 20 elements, first at index (4,): 9 here,
4 on rank 0``.

:func:`run_ranks` starts ``world_size`` processes (the ``spawn`` context: the function must be
importable, i.e. defined at module level, and its arguments and result picklable), gives each
``MASTER_ADDR``/``MASTER_PORT`` (a free port), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS=1`` and ``CPMETA_TEST_SEED`` before its first instruction
(plus ``env`` and ``rank_env[rank]``), seeds ``random`` and torch with ONE seed on every rank
(printed to stderr; ``CPMETA_TEST_SEED=<seed>`` reproduces a run), initialises the process group
(``gloo`` by default), runs ``fn(rank, world_size, *args)`` and returns the per-rank results.
ONE deadline (``timeout`` seconds, spawn included) bounds the run; after the first failure the
others get :data:`FAIL_GRACE_S` seconds before they are killed; the :class:`RankFailure` carries
every failing rank's traceback under ``--- rank r FAILED ---``. Children exit on their own when
the parent disappears. :func:`spawn_ranks` returns the running :class:`RankGroup` instead (kill a
rank, then collect the others: fault-injection tests).

Already inside a process group (torchrun, an engine's own test harness)? Call
:func:`assert_same_on_ranks` there directly; ``group=`` picks a subgroup, ``src`` is a rank of it.
:func:`assert_same` is the same field-by-field check of two values in one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle  # results come back through multiprocessing, which pickles; see _worker
import queue as queue_mod
import random
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import multiprocessing as mp

import numpy as np
import torch

from . import envs

__all__ = ["run_ranks", "spawn_ranks", "RankGroup", "RankFailure", "free_port", "assert_same",
           "assert_same_on_ranks", "FAIL_GRACE_S"]

FAIL_GRACE_S = 5.0  # seconds the healthy ranks get after one rank failed, before they are killed
EXIT_GRACE_S = 10.0  # seconds a rank that already reported may take to exit cleanly
_POLL_S = 0.05  # parent polling period (queue + liveness)
_WATCHDOG_S = 0.5  # child: period of the "is my parent alive" check
_ENV_LOCK = threading.Lock()
_ALIASING = "<aliasing>"  # the pseudo-field: which paths hold one tensor object


class RankFailure(AssertionError):
    """A rank raised, crashed, or timed out. ``str()`` holds every failing rank's traceback."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- spawning ranks -----------------------------------------------------------------------------


def _parent_watchdog(parent_pid: int) -> None:
    """Child-side thread: exit hard when the parent is gone (re-parented), so nothing is orphaned."""
    while True:
        time.sleep(_WATCHDOG_S)
        if os.getppid() != parent_pid:
            os._exit(70)


def _report(out: Any, item: tuple[int, bool, Any], code: int) -> None:
    out.put(item)
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit/finalizers of half-torn-down libraries: the result is already sent


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, backend: str,
            timeout: float, init: bool, seed: int, parent_pid: int, out: Any,
            child_setup: Optional[Callable[[int], None]] = None) -> None:
    """Child entry point (runs in the spawned process)."""
    if child_setup is not None:
        try:
            child_setup(rank)  # first: no thread exists yet (a namespace switch is per thread)
        except BaseException:  # noqa: BLE001 - reported like any rank failure
            _report(out, (rank, False, f"rank {rank} (pid {os.getpid()}): child_setup failed:\n"
                                       f"{traceback.format_exc()}"), 1)
    threading.Thread(target=_parent_watchdog, args=(parent_pid,), daemon=True).start()
    import torch.distributed as dist

    try:
        random.seed(seed)
        torch.manual_seed(seed)
        if init:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, *args)
            pickle.dumps(result)  # an unpicklable result fails HERE, with a traceback
        finally:
            if init and dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        _report(out, (rank, False, f"rank {rank} (pid {os.getpid()}):\n{traceback.format_exc()}"), 1)
    _report(out, (rank, True, result), 0)


@dataclasses.dataclass
class RankGroup:
    """Processes started by :func:`spawn_ranks`; collect with :meth:`results`, or use as a context
    manager (``__exit__`` kills whatever is still running)."""

    procs: list[BaseProcess]
    port: int
    seed: int
    deadline: float  # time.monotonic() after which stragglers are killed
    _queue: Any = dataclasses.field(repr=False)

    @property
    def world_size(self) -> int:
        return len(self.procs)

    def pid(self, rank: int) -> int:
        pid = self.procs[rank].pid
        assert pid is not None
        return pid

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to ``rank``'s process."""
        os.kill(self.pid(rank), sig)

    def kill_all(self) -> None:
        """Kill every process that is still alive and reap it."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5.0)

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def results(self, allow_dead: Iterable[int] = ()) -> list[Any]:
        """Wait for every rank; return per-rank return values (``None`` for ranks in ``allow_dead``
        that died without reporting). Raises :class:`RankFailure` on an exception, a crash, an
        unexpected exit code or the deadline."""
        allowed = set(allow_dead)
        got: dict[int, tuple[bool, Any]] = {}
        first_fail: Optional[float] = None
        try:
            while len(got) < self.world_size:
                now = time.monotonic()
                if now > self.deadline:
                    raise self._failure(got, "deadline exceeded (timeout)")
                if first_fail is not None and now > first_fail + FAIL_GRACE_S:
                    break
                try:
                    rank, ok, payload = self._queue.get(timeout=_POLL_S)
                    got[rank] = (ok, payload)
                    if not ok and rank not in allowed and first_fail is None:
                        first_fail = time.monotonic()
                    continue
                except queue_mod.Empty:
                    pass
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive() and p.exitcode is not None:
                        self._drain(got)
                        if r not in got:
                            got[r] = (False, f"rank {r} died without reporting, exit code {p.exitcode}")
                            if r not in allowed and first_fail is None:
                                first_fail = time.monotonic()
            self._join_all(got)
        finally:
            self.kill_all()
        bad = {r: v for r, v in got.items() if not v[0] and r not in allowed}
        if bad or len(got) < self.world_size:
            raise self._failure(got, "rank failure")
        return [got[r][1] if got[r][0] else None for r in range(self.world_size)]

    def _drain(self, got: dict[int, tuple[bool, Any]]) -> None:
        while True:
            try:
                rank, ok, payload = self._queue.get_nowait()
            except queue_mod.Empty:
                return
            got[rank] = (ok, payload)

    def _join_all(self, got: dict[int, tuple[bool, Any]]) -> None:
        end = time.monotonic() + EXIT_GRACE_S
        for r, p in enumerate(self.procs):
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                got.setdefault(r, (False, f"rank {r} did not exit after reporting"))
            elif p.exitcode not in (0, None) and got.get(r, (False,))[0]:
                got[r] = (False, f"rank {r} reported a result but exited with code {p.exitcode}")

    def _failure(self, got: dict[int, tuple[bool, Any]], why: str) -> RankFailure:
        lines = [f"cpmeta.testing: {why}; world_size={self.world_size} port={self.port} "
                 f"seed={self.seed} (re-run with {envs.TEST_SEED}={self.seed})"]
        for r in range(self.world_size):
            if r not in got:
                lines.append(f"--- rank {r}: no result (still running or killed) ---")
            elif not got[r][0]:
                lines.append(f"--- rank {r} FAILED ---\n{got[r][1]}")
        return RankFailure("\n".join(lines))


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                timeout: float = 120.0, env: Optional[Mapping[str, str]] = None,
                init: bool = True, seed: Optional[int] = None,
                rank_env: Optional[Sequence[Mapping[str, str]]] = None,
                child_setup: Optional[Callable[[int], None]] = None) -> RankGroup:
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return at once.

    ``fn`` must be a module-level function (the spawn context pickles it by qualified name);
    ``args`` must be picklable. The returned group's deadline is ``timeout`` seconds from now.
    ``rank_env[r]`` (one mapping per rank) is applied after ``env`` for rank ``r``;
    ``child_setup(rank)`` (picklable) runs first thing in every child, before any thread starts
    and before torch is imported (e.g. to enter a network namespace); ``init=False`` skips
    ``init_process_group``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env: expected one mapping per rank ({world_size}), got {len(rank_env)}")
    if seed is None:
        seed = envs.testing_seed() or random.randrange(1, 2**31)
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    print(f"[cpmeta.testing] {getattr(fn, '__qualname__', fn)} world_size={world_size} "
          f"backend={backend} port={port} seed={seed}", file=sys.stderr)
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", envs.TEST_SEED: str(seed)}
    procs: list[BaseProcess] = []
    group = RankGroup(procs, port, seed, time.monotonic() + timeout, out)
    try:
        for rank in range(world_size):
            child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), **(env or {}),
                         **(rank_env[rank] if rank_env is not None else {})}
            p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, backend, timeout, init, seed,
                                  os.getpid(), out, child_setup))
            _start_with_env(p, child_env)
            procs.append(p)
    except BaseException:
        group.kill_all()
        raise
    return group


def _start_with_env(p: BaseProcess, child_env: Mapping[str, str]) -> None:
    """Start ``p`` with ``child_env`` applied to the inherited environment (restored afterwards:
    the child's environment exists from its first instruction, so modules that read a variable
    at import time see it)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in child_env}
        os.environ.update(child_env)
        try:
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 120.0, env: Optional[Mapping[str, str]] = None, init: bool = True,
              seed: Optional[int] = None, rank_env: Optional[Sequence[Mapping[str, str]]] = None,
              child_setup: Optional[Callable[[int], None]] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the per-rank results.

    Example: ``run_ranks(_allreduce, 3, 10)`` with ``_allreduce`` summing ``rank * 10`` over the
    group -> ``[30, 30, 30]``. Raises :class:`RankFailure` (an ``AssertionError``) with the failing
    rank's traceback when a rank raises, crashes, exits non-zero, or the run exceeds ``timeout``
    seconds. Keyword arguments as in :func:`spawn_ranks`.
    """
    with spawn_ranks(fn, world_size, *args, backend=backend, timeout=timeout, env=env,
                     init=init, seed=seed, rank_env=rank_env, child_setup=child_setup) as group:
        return group.results()


# ---- field-by-field comparison --------------------------------------------------------------------


def _flatten(value: Any) -> dict[str, Any]:
    """Leaves by dotted path: a dataclass's fields, a dict's keys, a list's or tuple's indices;
    tensors, scalars and empty containers are leaves; ``<aliasing>`` lists the paths that share
    one tensor object. Example: ``{"klen": {"4": t}, "n": 2}`` -> ``{"klen.4": t, "n": 2,
    "<aliasing>": []}``."""
    flat: dict[str, Any] = {}

    def walk(path: str, v: Any) -> None:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            items: list[tuple[Any, Any]] = [(f.name, getattr(v, f.name)) for f in dataclasses.fields(v)]
        elif isinstance(v, dict):
            items = list(v.items())
        elif isinstance(v, (list, tuple)):
            items = list(enumerate(v))
        else:
            flat[path] = v
            return
        if not items and path:
            flat[path] = v  # an empty container is information (absent keys)
        for k, x in items:
            walk(f"{path}.{k}" if path else str(k), x)

    walk("", value)
    groups: dict[int, list[str]] = {}
    for path, v in flat.items():
        if isinstance(v, torch.Tensor):
            groups.setdefault(id(v), []).append(path)
    flat[_ALIASING] = sorted(g for g in groups.values() if len(g) > 1)
    return flat


def _digest(v: Any) -> str:
    """64-bit BLAKE2b (hex) of a leaf: a tensor's dtype, shape and bytes, else its type and repr."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"{type(v).__name__}:{v!r}".encode())
    return h.hexdigest()


def _leaf_diff(got: Any, want: Any, other: str) -> Optional[str]:
    """How leaf ``got`` (here) differs from ``want`` (on ``other``), or None when bit-identical."""
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
        a, b = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{tuple(a.shape)} here, {b.dtype}{tuple(b.shape)} on {other}"
        # bitwise, element by element (NaN payloads and -0.0 count): compare each element's bytes
        width = a.element_size()
        bad = (a.reshape(-1).view(torch.uint8).reshape(-1, width)
               != b.reshape(-1).view(torch.uint8).reshape(-1, width)).any(dim=1).nonzero()
        if bad.numel() == 0:
            return None
        i = int(bad[0])
        index = tuple(int(x) for x in np.unravel_index(i, tuple(a.shape))) if a.dim() else ()
        return (f"{bad.shape[0]} of {a.numel()} elements, first at index {index}: "
                f"{a.reshape(-1)[i].item()!r} here, {b.reshape(-1)[i].item()!r} on {other}")
    kind = want.kind if isinstance(want, _Shown) else type(want).__name__
    if isinstance(got, torch.Tensor) or isinstance(want, torch.Tensor) or kind != type(got).__name__:
        return f"{type(got).__name__} here, {kind} on {other}"
    if not isinstance(want, _Shown) and _digest(got) == _digest(want):
        return None
    return f"{got!r} here, {want!r} on {other}"


def assert_same(actual: Any, expected: Any) -> None:
    """Raise ``AssertionError`` unless ``actual`` and ``expected`` (``InputMetadata``, any
    dataclass, dicts / lists / tuples of tensors and plain values) are bit-identical field by
    field: same paths, tensor dtypes, shapes and bytes, equal plain values, same aliasing.

    Example: ``assert_same({"p": torch.tensor([0, 1, 5])}, {"p": torch.tensor([0, 1, 2])})``
    -> ``AssertionError: 'p' differs from expected: 1 of 3 elements, first at index (2,): 5 here,
    2 on expected``.
    """
    got, want = _flatten(actual), _flatten(expected)
    problems = []
    for path in list(want) + [p for p in got if p not in want]:
        if path not in got or path not in want:
            problems.append(f"{path!r} {'missing here' if path in want else 'not in expected'}")
            continue
        why = _leaf_diff(got[path], want[path], "expected")
        if why is not None:
            problems.append(f"{path!r} differs from expected: {why}")
    if problems:
        raise AssertionError("; ".join(problems))


def assert_same_on_ranks(value: Any, *, src: int = 0, group: Any = None) -> None:
    """Collective: every rank of ``group`` (default: the whole world) calls it with what it holds;
    raises the SAME ``AssertionError`` on every rank unless every rank's ``value`` is
    bit-identical, field by field (as :func:`assert_same`), to rank ``src``'s (``src`` is a rank
    of ``group``, as are the ranks named in the message).

    Cost when every rank agrees: one broadcast of ``src``'s table of per-field 64-bit digests and
    one all-gather of each rank's differing fields (two collectives each: length, then bytes).
    Otherwise ``src`` then broadcasts the values of the differing fields only, every rank names its
    differences (field, first differing index, both values) and the messages are all-gathered.
    Per-rank example, 2 ranks, rank 1 holding ``{"positions": tensor([0, 1, 9])}`` where rank 0
    holds ``tensor([0, 1, 2])``: both ranks raise ``rank 1: 'positions' differs from rank 0's:
    1 of 3 elements, first at index (2,): 9 here, 2 on rank 0``.
    """
    import torch.distributed as dist

    me, size = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= src < size:
        raise ValueError(f"src: expected a rank of the group in [0, {size}), got {src}")
    wire = _Bytes(group, src if group is None else dist.get_global_rank(group, src), size)
    flat = _flatten(value)
    table = {p: _digest(v) for p, v in flat.items()}
    theirs: dict[str, str] = json.loads(wire.bcast(json.dumps(table).encode() if me == src else None))
    differing = [p for p in theirs if table.get(p) != theirs[p]] + [p for p in table if p not in theirs]
    union: list[str] = []
    for blob in wire.gather(json.dumps(differing).encode()):
        union += [p for p in json.loads(blob) if p not in union]
    if not union:
        return
    problems = []
    for path in union:  # the same paths in the same order on every rank
        if path not in theirs:
            problems += [f"rank {me}: {path!r} not on rank {src}"] if path in differing else []
            continue
        want = _leaf_from_src(wire, flat[path] if me == src else None, me == src)
        if path not in differing:
            continue
        if path not in flat:
            problems.append(f"rank {me}: {path!r} missing here (rank {src} has it)")
        else:
            problems.append(f"rank {me}: {path!r} differs from rank {src}'s: "
                            f"{_leaf_diff(flat[path], want, f'rank {src}')}")
    messages = [m.decode() for m in wire.gather("; ".join(problems).encode())]
    raise AssertionError("; ".join(m for m in messages if m))


class _Bytes:
    """Bytes over the group's collectives (a length, then a uint8 tensor on the backend's device:
    CUDA for NCCL); no pickle."""

    def __init__(self, group: Any, src_global: int, size: int) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.src, self.size = dist, group, src_global, size
        nccl = "nccl" in str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _tensor(self, data: bytes) -> torch.Tensor:
        if not data:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def _count(self, n: int) -> torch.Tensor:
        return torch.tensor([n], dtype=torch.int64, device=self.device)

    def bcast(self, data: Optional[bytes]) -> bytes:
        """``src`` passes the bytes, every other rank ``None``; every rank returns them."""
        n = self._count(len(data) if data is not None else 0)
        self.dist.broadcast(n, self.src, group=self.group)
        buf = self._tensor(data) if data is not None else torch.empty(int(n), dtype=torch.uint8, device=self.device)
        if int(n):
            self.dist.broadcast(buf, self.src, group=self.group)
        return bytes(buf.cpu().numpy())

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's bytes, in rank order, on every rank."""
        sizes = [self._count(0) for _ in range(self.size)]
        self.dist.all_gather(sizes, self._count(len(data)), group=self.group)
        width = max(int(n) for n in sizes)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[:len(data)] = self._tensor(data)
        bufs = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        self.dist.all_gather(bufs, mine, group=self.group)
        return [bytes(b[:int(n)].cpu().numpy()) for b, n in zip(bufs, sizes)]


class _Shown:
    """A non-tensor leaf of another rank, as its type name and ``repr`` (compared by digest)."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind, self.text = kind, text

    def __repr__(self) -> str:
        return self.text


def _leaf_from_src(wire: _Bytes, leaf: Any, is_src: bool) -> Any:
    """``src``'s leaf on every rank: a tensor as a JSON header (dtype, shape) then its bytes,
    another value as its type name and ``repr``. Every rank calls it for the same paths."""
    head = None
    if is_src:
        head = ({"dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
                if isinstance(leaf, torch.Tensor) else {"kind": type(leaf).__name__, "repr": repr(leaf)})
    h = json.loads(wire.bcast(json.dumps(head).encode() if is_src else None))
    if "repr" in h:
        return _Shown(h["kind"], h["repr"])
    data = wire.bcast(leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                 if is_src else None)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, h["dtype"])) \
        .reshape(h["shape"]) if data else torch.empty(h["shape"], dtype=getattr(torch, h["dtype"]))
