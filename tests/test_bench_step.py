"""Smoke test of ``scripts/bench_step.py --quick`` (world 2, a handful of steps per workload).

Every (world, workload, strategy) cell is in the JSON, measured or -- the mq strategies when
vLLM's MessageQueue does not import -- listed as skipped; no timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = {"broadcast", "replicate", "replicate-defer", "mq-replicate", "mq-broadcast"}
WORKLOADS = {"decode-64", "decode-256", "mixed", "prompt"}

pytestmark = [pytest.mark.timeout(120), pytest.mark.long]  # .ci/run runs the long suite after the README command


def test_bench_step_quick(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--quick", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert {"command", "date", "machine", "commit", "timed"} <= set(meta)
    assert meta["machine"]["cpus"] and meta["machine"]["platform"]
    measured = {(r["world"], r["workload"], r["strategy"]) for r in data["results"]}
    skipped = {(r["world"], r["workload"], r["strategy"]) for r in data["skipped"]}
    assert measured | skipped == {(2, w, s) for w in WORKLOADS for s in STRATEGIES}
    assert not measured & skipped
    assert {s for _, _, s in skipped} <= {"mq-replicate", "mq-broadcast"}
    for r in data["results"]:
        assert r["n"] >= 1 and 0 < r["p50_us"] <= r["p90_us"]
        assert r["phases_p50_us"]["send"] >= 0 and "wake_recv" in r["phases_p50_us"]
    assert {b["workload"] for b in data["best"]} == WORKLOADS
    assert {c["workload"] for c in data["cold"]} == WORKLOADS
    for c in data["cold"]:
        assert {"back_to_back", "gap_3ms", "warm_loop"} <= set(c)
    if skipped:
        assert "skipped mq-replicate, mq-broadcast" in res.stdout
    assert "best strategy per cell" in res.stdout
