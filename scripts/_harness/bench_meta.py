"""The scripts' shared harness: the ``run`` block every result file carries, the timing loops and
the JSON writer.

- :func:`run_meta`: command, date, machine and commit, from facts (below);
- :func:`time_us`: p50 / p90 / min of one function called in a loop (the builders' timer);
- :func:`interleaved`: p50 / min of several functions called round-robin (the profiler's timer:
  machine load hits every phase alike);
- :func:`latency_us`: p50 / p90 of a sorted list of per-step seconds (the multi-rank timers');
- :func:`write_result`: a result document plus its run block, written as JSON.

Every ``scripts/*.py`` result file has, at the top level::

    "run": {"command": "python scripts/bench_build.py --only state_ --out build_state.json",
            "date": "2026-12-02T10:04:11+00:00",
            "host": "NVIDIA H200 x1, 16 cpus",          # a label made of the facts below
            "machine": {"cpus": 16, "cpu_model": "...", "gpus": ["NVIDIA H200"], "torch": "...", ...},
            "commit": "6c04afb...", "dirty": false}

``host`` is derived from what the machine reports (GPU names and count, CPU count), never from its
hostname: lent GPU machines and the CI VM may all be called ``vm``. Example: a 2-vCPU VM without a
GPU is ``"2 cpus, no GPU"``; two H200s on a 32-core host ``"NVIDIA H200 x2, 32 cpus"``.
Import it from a script (``scripts/`` is the script's own directory, first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import time
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["run_meta", "machine", "host_label", "time_us", "interleaved", "latency_us", "write_result"]

ROOT = Path(__file__).resolve().parents[2]


def machine() -> dict[str, Any]:
    """Facts about this machine (CPU, GPUs, library versions, load at the time of the call)."""
    facts: dict[str, Any] = {"platform": platform.platform(), "arch": platform.machine(),
                             "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        pass
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu_model"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:  # hardware threads per core: spinning followers share a core with the driver when > 1
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            facts["threads_per_core"] = sum(
                int(b) - int(a) + 1 for a, _, b in (r.partition("-") if "-" in r else (r, "", r)
                                                    for r in f.read().strip().split(",")))
    except (OSError, ValueError):
        pass
    facts["loadavg"] = list(os.getloadavg())
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        pass
    return facts


def host_label(facts: dict[str, Any]) -> str:
    """A short label from :func:`machine`'s facts. Example: ``{"cpus": 16, "gpus": ["NVIDIA H200"]}``
    -> ``"NVIDIA H200 x1, 16 cpus"``; ``{"cpus": 2}`` -> ``"2 cpus, no GPU"``."""
    gpus = facts.get("gpus") or []
    cpus = f"{facts.get('cpus')} cpus"
    if not gpus:
        return f"{cpus}, no GPU"
    names = sorted(set(gpus))
    return ", ".join(f"{n} x{gpus.count(n)}" for n in names) + f", {cpus}"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_meta(argv: Optional[Sequence[str]] = None, script: Optional[str] = None) -> dict[str, Any]:
    """The ``run`` block: the command as typed (``argv`` default ``sys.argv[1:]``, ``script``
    default ``sys.argv[0]``), the UTC date, :func:`host_label`, :func:`machine`, and the git
    commit of the checkout (``None`` outside one) with whether tracked files were modified."""
    script = script or sys.argv[0]
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        shown = str(Path(script).resolve().relative_to(ROOT))
    except ValueError:
        shown = script
    facts = machine()
    commit = _git("rev-parse", "HEAD") or None
    return {
        "command": " ".join(["python", shlex.quote(shown), *map(shlex.quote, args)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": host_label(facts),
        "machine": facts,
        "commit": commit,
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None,
    }


def write_result(path: str | Path, doc: dict[str, Any], argv: Optional[Sequence[str]] = None) -> Path:
    """Write ``doc`` plus its ``run`` block (:func:`run_meta` of ``argv``) as JSON at ``path``
    (folders made as needed); returns the path. Example: ``write_result("/tmp/b.json",
    {"results": rows})`` writes ``{"results": [...], "run": {"command": "python scripts/...", ...}}``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**doc, "run": run_meta(argv)}, indent=1) + "\n")
    print("wrote", out, flush=True)
    return out


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def time_us(fn: Callable[[], Any], repeat: int, *, warmup: int = 3, setup: Optional[Callable[[], Any]] = None,
            sync: bool = False) -> dict[str, float]:
    """p50 / p90 / min of ``fn()`` in microseconds over ``repeat`` calls after ``warmup`` calls
    (``setup()`` runs untimed before each call; ``sync``: a CUDA sync before and after each
    timed call). Example: ``time_us(lambda: sum(range(1000)), 100)`` -> ``{"p50_us": 9.8,
    "p90_us": 11.0, "min_us": 9.5, "n": 100}``."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    ts = []
    for _ in range(repeat):
        if setup:
            setup()
        if sync:
            _sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            _sync()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return {"p50_us": ts[len(ts) // 2], "p90_us": ts[min(len(ts) - 1, int(len(ts) * 0.9))],
            "min_us": ts[0], "n": repeat}


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int,
                sync: Callable[[], None] = lambda: None) -> dict[str, dict[str, float]]:
    """p50 / min (us) of every function, one call of each per round in an order shuffled per
    round (seeded), after 3 warm-up rounds; ``sync()`` runs untimed before each call (a device
    sync where the phases enqueue GPU work). Example: ``interleaved({"a": f, "b": g}, 500)`` ->
    ``{"a": {"p50_us": 3.1, "min_us": 2.9}, "b": {...}}``."""
    rng = random.Random(0)
    names = list(fns)
    ts: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(3):
        for k in names:
            fns[k]()
        sync()
    for _ in range(repeat):
        rng.shuffle(names)
        for k in names:
            sync()
            t0 = time.perf_counter()
            fns[k]()
            ts[k].append((time.perf_counter() - t0) * 1e6)
    out = {}
    for k, v in ts.items():
        v.sort()
        out[k] = {"p50_us": v[len(v) // 2], "min_us": v[0]}
    return out


def latency_us(lat: list[float]) -> dict[str, float]:
    """``{"p50_us", "p90_us"}`` of per-step latencies in seconds, sorted ascending. Example:
    ``latency_us([1e-4, 2e-4, 3e-4])`` -> ``{"p50_us": 200.0, "p90_us": 300.0}``."""
    return {"p50_us": lat[len(lat) // 2] * 1e6, "p90_us": lat[min(len(lat) - 1, int(0.9 * len(lat)))] * 1e6}
