"""Run a function on N local processes with ``torch.distributed`` initialised (for examples).

``python -m cpmeta.launch`` starts its ranks with torchrun; an example that wants a Python function on
every rank and its results back in the parent (``scripts/cp_generate.py``) uses :func:`run_ranks`
instead, from an installed wheel (the test suite's own helper, ``tests/multiproc.py``, is not
part of it). Per-rank example (every rank runs ``_rank``; the parent gets the list)::

    def _rank(rank: int, world_size: int, n: int) -> dict:   # MODULE level: spawn imports it by name
        t = torch.tensor([rank * n]); dist.all_reduce(t)
        return {"sum": int(t)}

    run_ranks(_rank, 3, 10) == [{"sum": 30}, {"sum": 30}, {"sum": 30}]

What happens: a free TCP port on 127.0.0.1; ``world_size`` processes of the ``spawn`` context;
each calls ``init_process_group(backend, init_method="tcp://127.0.0.1:PORT", rank, world_size)``
(no environment variable is read or set), runs ``fn``, sends its result back as JSON bytes over a pipe (no
pickle of results: return JSON values), destroys the group and exits without interpreter teardown
(library threads of a finished rank cannot abort it). ONE deadline bounds the run; after the first
failure the others get :data:`FAIL_GRACE_S` seconds, then every straggler is killed, and the
``RuntimeError`` names the failing rank with its traceback. A child exits on its own when the
parent disappears.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

__all__ = ["run_ranks", "free_port", "FAIL_GRACE_S"]

FAIL_GRACE_S = 5.0  # seconds the other ranks get after one failed, before they are killed
_POLL_S = 0.05


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(70)


def _child(fn: Callable[..., Any], rank: int, world: int, args: tuple, backend: str, timeout: float,
           port: int, conn: Any, parent: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    code = 0
    try:
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        try:
            conn.send_bytes(json.dumps({"ok": fn(rank, world, *args)}).encode())
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send_bytes(json.dumps({"error": f"rank {rank} (pid {os.getpid()}):\n{traceback.format_exc()}"}).encode())
        code = 1
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; the per-rank results.

    Collective: every rank runs ``fn`` inside one process group of ``backend``. ``fn`` must be a
    module-level function and return a JSON value. Raises ``RuntimeError`` naming the first rank
    that raised, crashed or missed the deadline (``timeout`` seconds for the whole run).
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    port, ctx = free_port(), mp.get_context("spawn")
    procs, conns = [], []
    deadline = time.monotonic() + timeout
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, args, backend, timeout, port, send, os.getpid()))
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        return _collect(procs, conns, deadline)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)


def _collect(procs: list[Any], conns: list[Any], deadline: float) -> list[Any]:
    """Every rank's ``{"ok": result}`` or the first ``{"error": ...}`` / crash / timeout."""
    got: dict[int, dict[str, Any]] = {}
    first_fail: Optional[tuple[int, str]] = None
    fail_at = float("inf")
    while len(got) < len(procs) and time.monotonic() < min(deadline, fail_at):
        for rank, (p, c) in enumerate(zip(procs, conns)):
            if rank in got:
                continue
            if c.poll(_POLL_S / len(procs)):
                try:
                    got[rank] = json.loads(c.recv_bytes())
                except EOFError:
                    got[rank] = {"error": f"rank {rank} closed its pipe without a result (exit code {p.exitcode})"}
            elif not p.is_alive():
                got[rank] = {"error": f"rank {rank} died without reporting, exit code {p.exitcode}"}
            if rank in got and "error" in got[rank] and first_fail is None:
                first_fail, fail_at = (rank, got[rank]["error"]), time.monotonic() + FAIL_GRACE_S
    if first_fail is not None:
        raise RuntimeError(f"cpmeta.launch.spawn: rank {first_fail[0]} failed first:\n{first_fail[1]}")
    if len(got) < len(procs):
        missing = sorted(set(range(len(procs))) - set(got))
        raise RuntimeError(f"cpmeta.launch.spawn: deadline exceeded; ranks {missing} did not report")
    return [got[r]["ok"] for r in range(len(procs))]

