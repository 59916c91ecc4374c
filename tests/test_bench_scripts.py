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
    methods = {r["method"] for r in data["results"]}
    assert methods == {"cpmeta", "cpmeta+p", "bol", "tdict", "floor"}
    for r in data["results"]:
        assert r["n"] >= 1 and 0 < r["p50_us"] <= r["p90_us"] and r["bytes"] > 0
    assert "cpmeta+p/floor" in res.stdout and "ratios below 1 mean" in res.stdout


@pytest.mark.parametrize("script,args", [
    ("bench_build.py", ["--quick", "--only", "decode", "--repeat", "3"]),
    ("bench_transport.py", ["--quick"]),
    ("bench_decode_inplace.py", ["--quick", "--repeat", "3"]),
    ("bench_slot_mapping.py", ["--quick"]),
    ("profile_array_input.py", ["--repeat", "3"]),  # per-phase profile: follows the builders' internals
    ("bench_decode_cp.py", ["--quick", "--worlds", "1", "2"]),  # staged, staged_state, bcast on gloo ranks
])
def test_other_benchmarks_quick(tmp_path: Path, script: str, args: list[str]) -> None:
    out = tmp_path / "o.json"
    res = _run(script, *args, "--out", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    json.loads(out.read_text())  # well-formed
