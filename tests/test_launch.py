"""The README's main-job command, run for real (short ``--steps``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _readme_main_job() -> list[str]:
    first = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    line = first.strip().splitlines()[0]
    cmd = line.split("&&", 1)[1].split()
    assert cmd[:3] == ["python", "-m", "launch"], line
    return cmd[3:]


def test_readme_main_job_passes(tmp_path: Path) -> None:
    args = _readme_main_job()
    steps = args.index("--steps")
    args[steps + 1] = "8"  # the README runs 50; the same command, shorter
    out = tmp_path / "launch.json"
    res = _launch(*args, "--warmup", "2", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "bit-identical" in res.stdout
    summary = json.loads(out.read_text())
    assert len(summary["ranks"]) == 2 and summary["steps"] == 8


@pytest.mark.parametrize("workload", ["prompt", "decode"])
def test_launch_workloads_with_attn_info(workload: str) -> None:
    res = _launch("--nproc-per-node", "2", "--workload", workload, "--steps", "4", "--warmup", "1",
                  "--cp-mirror", "--attn-info", "--verify", "--decode-seqs", "16",
                  "--max-prompt", "1024")
    assert res.returncode == 0, res.stdout + res.stderr


def test_launch_rejects_bad_arguments() -> None:
    res = _launch("--nproc-per-node", "0")
    assert res.returncode != 0
