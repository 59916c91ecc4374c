"""Smoke tests of the benchmark scripts' ``--quick`` modes: they run and write well-formed JSON.

No timing is asserted (numbers on a shared CI machine mean nothing); only the structure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.long  # .ci/run runs the long suite after the README's test command

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_broadcast_quick(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    res = _run("bench_broadcast.py", "--quick", "--methods", "cpmeta", "cpmeta+p", "bol", "tdict",
               "floor", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert {"date", "command", "timed", "backend"} <= set(data["meta"])
    _check_run(data, "bench_broadcast.py")
    methods = {r["method"] for r in data["results"]}
    assert methods == {"cpmeta", "cpmeta+p", "bol", "tdict", "floor"}
    for r in data["results"]:
        assert r["n"] >= 1 and 0 < r["p50_us"] <= r["p90_us"] and r["bytes"] > 0
    assert "cpmeta+p/floor" in res.stdout and "ratios below 1 mean" in res.stdout


@pytest.mark.parametrize("script,args", [
    ("bench_build.py", ["--quick", "--only", "decode", "--repeat", "3"]),
    ("bench_broadcast.py", ["transport", "--quick", "--max-readers", "2"]),  # worlds 2 and 3: the smoke, not the sweep
    ("bench_gpu.py", ["inplace", "--quick", "--repeat", "3"]),
    ("bench_gpu.py", ["slots", "--quick"]),
    ("bench_gpu.py", ["cp", "--quick", "--worlds", "1", "2"]),  # staged, staged_state, bcast on gloo ranks
    ("bench_gpu.py", ["sharing", "--procs", "1", "--seconds", "0.5"]),
    ("profile_phases.py", ["build", "--repeat", "3"]),  # per-phase profile: follows the builders' internals
    ("profile_phases.py", ["broadcast", "--steps", "5", "--warmup", "2"]),
    ("profile_phases.py", ["inplace", "--repeat", "3"]),
    ("profile_phases.py", ["sync", "--defer", "--steps", "5", "--warmup", "2"]),  # follows the replica's stages
    ("profile_phases.py", ["sync", "--defer", "--split-read", "--steps", "5", "--warmup", "2"]),  # its patched read
    ("profile_phases.py", ["replay", "--workload", "mixed", "--steps", "3"]),  # follows the recorder and the replay
], ids=lambda a: a if isinstance(a, str) else " ".join(a[:1]))
def test_other_benchmarks_quick(tmp_path: Path, script: str, args: list[str]) -> None:
    out = tmp_path / "o.json"
    res = _run(script, *args, "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    _check_run(json.loads(out.read_text()), script)


def test_sync_lean_times_every_stage(tmp_path: Path) -> None:
    """``sync --lean``: with only the publish, the compiled calls and the ends stamped, every
    stage of the driver and of the last follower still comes out as a time (a stamp renamed in
    the library would leave a stage empty: nan)."""
    out = tmp_path / "o.json"
    res = _run("profile_phases.py", "sync", "--defer", "--lean", "--steps", "6", "--warmup", "2", "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    _check_run(data, "profile_phases.py")
    got = data["results"]
    sys.path.insert(0, str(ROOT / "scripts"))
    from _harness.sync_timeline import LEAN

    stages = [got[side][name] for side, name, _, _ in LEAN]
    assert all(isinstance(v, float) and v == v and v >= 0 for v in stages), got
    assert got["end_to_end"] >= got["driver"]["publish"] > 0 and "(lean stamps)" in res.stdout


def test_overlap_and_replicate_profile_run(tmp_path: Path) -> None:
    """The two sub-commands without a smoke case above: the overlapped loop on 2 CPU ranks (every
    step's checksum right) and the cProfile of the replicated step (its report printed)."""
    out = tmp_path / "o.json"
    res = _run("bench_gpu.py", "overlap", "--steps", "6", "--warmup", "1", "--forward-us", "2000", "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    _check_run(data, "bench_gpu.py")
    assert {r["mode"] for r in data["rows"]} == {"serial", "overlap"} and not any(r["wrong_steps"] for r in data["rows"])
    res = _run("profile_phases.py", "replicate", "--steps", "3", "--top", "3")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "== StagedStateMethod:" in res.stdout and "== ReplicateInplaceMethod:" in res.stdout


def _check_run(data: dict, script: str) -> None:
    """Every result file carries the run block (scripts/_harness/bench_meta.py): the command with the
    script's path, the date, the machine's facts and the label made of them (never the
    hostname), and the commit of this checkout."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from _harness.bench_meta import host_label

    run = data["run"]
    assert run["command"].startswith(f"python scripts/{script} ") and "--out" in run["command"]
    assert run["date"][:4].isdigit() and run["machine"]["cpus"] == os.cpu_count()
    assert run["host"] == host_label(run["machine"]) and f"{os.cpu_count()} cpus" in run["host"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert run["commit"] == (head or None)


def test_host_label_is_made_of_facts() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from _harness.bench_meta import host_label

    assert host_label({"cpus": 2}) == "2 cpus, no GPU"
    assert host_label({"cpus": 16, "gpus": ["NVIDIA H200"]}) == "NVIDIA H200 x1, 16 cpus"
    assert host_label({"cpus": 32, "gpus": ["NVIDIA H200", "NVIDIA H200"]}) == "NVIDIA H200 x2, 32 cpus"
