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
    return subprocess.run([sys.executable, "-m", "cpmeta.launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _readme_main_job() -> list[str]:
    first = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    line = first.strip().splitlines()[0]
    cmd = line.split("&&", 1)[1].split()
    assert cmd[:3] == ["python", "-m", "cpmeta.launch"], line
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
    # every kernel compiled or loaded before the first step (cpmeta.jit.warm_all), the time said
    assert f"kernels ready in {summary['warm_s']:.1f} s" in res.stdout and summary["warm_s"] > 0


@pytest.mark.parametrize("workload", ["prompt", "decode"])
def test_launch_workloads_with_attn_info(workload: str) -> None:
    res = _launch("--nproc-per-node", "2", "--workload", workload, "--steps", "4", "--warmup", "1",
                  "--cp-mirror", "--attn-info", "--verify", "--decode-seqs", "16",
                  "--max-prompt", "1024", *(["--strategy", "replicate"] if workload == "prompt" else []))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("strategy", ["broadcast", "replicate", "replicate-defer"])
def test_launch_plain_model_verify_and_attention_check(strategy: str) -> None:
    """``--model plain`` (docs/design.md section 14): the metadata carries only the common fields, broadcasts
    (or, replicated, every rank builds it from its own state; deferred, the driver's scheduler
    validating with its own state), mirrors and verifies bit for bit, and CP attention equals
    one rank's, at 2 ranks."""
    res = _launch("--nproc-per-node", "2", "--model", "plain", "--workload", "mixed", "--steps", "5",
                  "--warmup", "1", "--cp-mirror", "--verify", "--attention-check", "--kv-interleave", "4",
                  "--decode-seqs", "8", "--max-prompt", "700", "--strategy", strategy)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "model=plain" in res.stdout and "bit-identical" in res.stdout
    assert f"strategy={strategy}" in res.stdout
    assert "CP result equals single-rank attention on all 5 steps" in res.stdout


def test_launch_rejects_bad_arguments() -> None:
    res = _launch("--nproc-per-node", "0")
    assert res.returncode == 2 and "--nproc-per-node: expected >= 1" in res.stderr


BAD_INPUTS = {  # argv -> what the one-line error must say (validated before anything spawns)
    "workload": (["--workload", "bogus"], "argument --workload: invalid choice: 'bogus'"),
    "backend": (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
    "unknown-option": (["--stepz", "3"], "unrecognized arguments: --stepz"),
    "steps": (["--steps", "0"], "--steps: expected >= 1, got 0"),
    "nproc": (["--nproc-per-node", "0"], "--nproc-per-node: expected >= 1, got 0"),
    "warmup-negative": (["--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    "warmup-vs-steps": (["--steps", "4", "--warmup", "4"], "--warmup: expected < --steps (4), got 4"),
    "decode-seqs": (["--decode-seqs", "0"], "--decode-seqs: expected >= 1, got 0"),
    "prompt-seqs": (["--prompt-seqs", "0"], "--prompt-seqs: expected >= 1, got 0"),
    # (10**8 ended in numpy's 6 TiB allocation error in every rank)
    "decode-seqs-huge": (["--decode-seqs", "100000000"], "--decode-seqs: expected <= 4096, got 100000000"),
    "max-prompt": (["--max-prompt", "8"], "--max-prompt: expected >= 16, got 8"),
    "timeout": (["--timeout", "0"], "--timeout: expected a finite number of seconds > 0"),
    "timeout-huge": (["--timeout", "1e12"], "--timeout: expected a finite number of seconds > 0 (at most 315360000)"),
    "kv-interleave-negative": (["--kv-interleave", "-2"], "--kv-interleave: expected >= 0, got -2"),
    "kv-interleave-divisor": (["--kv-interleave", "3"],
                              "--kv-interleave: expected 0 (off) or a divisor of the KV block size 128, got 3"),
    "model": (["--model", "llama"], "argument --model: invalid choice: 'llama'"),
    "plain-yoco": (["--model", "plain", "--workload", "yoco"], "--workload yoco: needs the sliding window"),
    "plain-kv-interleave": (["--model", "plain", "--kv-interleave", "32"],
                            "--kv-interleave: expected 0 (off) or a divisor of the KV block size 16, got 32"),
    "nccl-without-gpus": (["--backend", "nccl"], "--backend nccl: needs one CUDA device per rank (2), found 0"),
    "json-dir": (["--json", "/nonexistent-dir/x.json"], "--json: directory of"),
    "device-cuda-without-gpus": (["--device", "cuda"], "--device cuda: no CUDA device on this machine"),
    "device-cpu-with-nccl": (["--device", "cpu", "--backend", "nccl"], "--device cpu: NCCL moves CUDA tensors"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_before_spawning(case: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    import torch.distributed.run as trun

    from cpmeta.launch.__main__ import main

    argv, want = BAD_INPUTS[case]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(trun, "run", lambda *a, **k: pytest.fail("spawned despite bad input"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and want in err, err
    assert err.strip().splitlines()[-1].startswith("python -m cpmeta.launch: error: "), err


def test_good_input_passes_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as trun

    from cpmeta.launch.__main__ import main

    called = []
    monkeypatch.setattr(trun, "run", lambda targs: called.append(targs))
    assert main(["--steps", "3", "--kv-interleave", "16", "--backend", "gloo"]) == 0
    assert called, "torchrun was not started"


def test_failing_rank_error_shown_once_first() -> None:
    """A rank that raises (here: a malformed transport variable) is summarized on the first
    line, above torchrun's report, and its traceback appears once (in the report)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CPMETA_FORCE_REMOTE": "maybe"}
    res = subprocess.run([sys.executable, "-m", "cpmeta.launch", "--nproc-per-node", "1", "--steps", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 1, res.stderr
    summary = "launch: rank 0 failed first: ValueError: CPMETA_FORCE_REMOTE: expected 0/1/true/false"
    assert summary in res.stderr, res.stderr
    assert res.stderr.index(summary) < res.stderr.index("Root Cause"), res.stderr
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr
