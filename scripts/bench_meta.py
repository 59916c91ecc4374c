"""The ``run`` block every benchmark JSON carries: command, date, machine and commit, from facts.

Every ``scripts/bench_*.py`` / ``profile_*.py`` result file has, at the top level::

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
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["run_meta", "machine", "host_label"]

ROOT = Path(__file__).resolve().parents[1]


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
