"""Spawning ranks for :mod:`cpmeta.testing`: :func:`run_ranks`, :func:`spawn_ranks` and the
:class:`RankGroup` they start (what a run does: the package docstring). Each rank's return value
comes back to the parent through a ``multiprocessing`` queue, which pickles it: between processes
of one test, never on a wire between ranks.

Example: ``run_ranks(_allreduce, 3, 10)`` with ``_allreduce`` summing ``rank * 10`` over the group
-> ``[30, 30, 30]``.
"""

from __future__ import annotations

import dataclasses
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

from .. import envs

__all__ = ["run_ranks", "spawn_ranks", "RankGroup", "RankFailure", "free_port", "pid_alive", "FAIL_GRACE_S"]

FAIL_GRACE_S = 5.0  # seconds the healthy ranks get after one rank failed, before they are killed
EXIT_GRACE_S = 10.0  # seconds a rank that already reported may take to exit cleanly
_POLL_S = 0.05  # parent polling period (queue + liveness)
_WATCHDOG_S = 0.5  # child: period of the "is my parent alive" check
_ENV_LOCK = threading.Lock()


class RankFailure(AssertionError):
    """A rank raised, crashed, or timed out. ``str()`` holds every failing rank's traceback."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parent_watchdog(parent_pid: int) -> None:
    """Child-side thread: exit hard when the parent is gone (re-parented), so nothing is orphaned.
    ``parent_pid``: the child's parent at its start -- the test process (spawn) or the fork server,
    which exits when the test process does (forkserver)."""
    while True:
        time.sleep(_WATCHDOG_S)
        if os.getppid() != parent_pid:
            os._exit(70)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (signal 0; one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _report(out: Any, item: tuple[int, bool, Any], code: int) -> None:
    out.put(item)
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit/finalizers of half-torn-down libraries: the result is already sent


def _worker(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, backend: str,
            timeout: float, init: bool, seed: int, parent_pid: int, out: Any,
            child_setup: Optional[Callable[[int], None]] = None,
            environ: Optional[Mapping[str, str]] = None) -> None:
    """Child entry point (runs in the rank's process). ``environ``: the whole environment a
    forked rank takes over (a spawned one got it at its start)."""
    if environ is not None:  # forked from the server: the test process's environment now
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if child_setup is not None:
        try:
            child_setup(rank)  # first: no thread exists yet (a namespace switch is per thread)
        except BaseException:  # noqa: BLE001 - reported like any rank failure
            _report(out, (rank, False, f"rank {rank} (pid {os.getpid()}): child_setup failed:\n"
                                       f"{traceback.format_exc()}"), 1)
    ppid = os.getppid()  # the test process, or the fork server (it exits with the test process)
    if ppid != parent_pid and not pid_alive(parent_pid):
        os._exit(70)
    threading.Thread(target=_parent_watchdog, args=(ppid,), daemon=True).start()
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
    """Start ``fn(rank, world_size, *args)`` on ``world_size`` processes and return at once: forks
    of the fork server (:func:`_fork_server`), or spawned interpreters with ``child_setup`` or
    ``CPMETA_TEST_START=spawn`` (the package docstring says what each rank's environment is).

    ``fn`` must be a module-level function (both contexts pickle it by qualified name);
    ``args`` must be picklable. The returned group's deadline is ``timeout`` seconds from now.
    ``rank_env[r]`` (one mapping per rank) is applied after ``env`` for rank ``r``;
    ``child_setup(rank)`` (picklable) runs first thing in every child, before any thread starts
    and before torch is imported (e.g. to enter a network namespace); ``init=False`` skips
    ``init_process_group``.
    """
    # refused before any rank starts (world_size=True started one rank whose WORLD_SIZE was "True")
    if not isinstance(world_size, (int, np.integer)) or isinstance(world_size, bool):
        raise TypeError(f"world_size: expected an int, got {world_size!r}")
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ValueError(f"timeout: expected a finite number of seconds > 0, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env: expected one mapping per rank ({world_size}), got {len(rank_env)}")
    if seed is None:
        seed = envs.testing_seed() or random.randrange(1, 2**31)
    port = free_port()
    forked = child_setup is None and envs.testing_start() == "forkserver"
    ctx = _fork_server() if forked else mp.get_context("spawn")
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
            # forked: the server's environment is its own, so the rank takes this one over
            last = (None, {**os.environ, **child_env}) if forked else (child_setup,)
            p = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, backend, timeout, init, seed,
                                  os.getpid(), out, *last))
            if forked:
                p.start()
            else:
                _start_with_env(p, child_env)
            procs.append(p)
    except BaseException:
        group.kill_all()
        raise
    return group


#: What the fork server imports once, so a forked rank starts with them loaded; the last one
#: compiles or loads every kernel there.
_PRELOAD = ["torch", "torch.distributed", "numpy", "cpmeta", "cpmeta.testing.ranks", "cpmeta.testing._server"]


def _fork_server() -> Any:
    """The ``forkserver`` context, its server started (once per test process) with the modules
    of :data:`_PRELOAD` imported and ``OMP_NUM_THREADS=1`` (read when torch loads its OpenMP
    runtime), and every kernel compiled or loaded (``cpmeta.jit.warm_all``; on a cold cache the
    first ranks wait for it): a rank is then a fork of it (~0.2 s, its kernels in memory) instead
    of a fresh interpreter importing torch (~1.5 s on 2 cores) and loading each kernel it calls.
    Ranks take over the test process's environment in :func:`_worker`."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    with _ENV_LOCK:
        ctx.set_forkserver_preload(_PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    return ctx


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
