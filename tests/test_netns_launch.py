"""``python -m cpmeta.launch`` across two nodes: the README's two-node command, run for real on two
network-namespace hosts (tests/netns.py), and the multi-node options validated before anything
is spawned.

Each node runs the README's command under ``ip netns exec`` with what a namespace host needs on
top (a real cluster has none of it): ``CPMETA_HOST_ID`` (the nodes share hostname and boot id),
``GLOO_SOCKET_IFNAME=eth0`` and ``--local-addr`` (the hostname resolves to 127.0.0.1 here) and
``--rdzv-conf is_host=1`` on node a (torchrun cannot tell from the hostname that the rendezvous
endpoint is this node's address).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from netns import NetnsHosts, netns_hosts

pytestmark = [pytest.mark.timeout(300), pytest.mark.long]  # .ci/run runs the long suite after the README command

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 240.0
RDZV_PORT = "29500"  # inside host a's namespace: no other process there


def readme_two_node_command() -> list[str]:
    """The argv after ``python -m cpmeta.launch`` of the README's two-node block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Two nodes", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip().startswith("python -m cpmeta.launch")]
    assert len(lines) == 1, block
    argv = lines[0].split()
    assert argv[:3] == ["python", "-m", "cpmeta.launch"] and "--nnodes" in argv, lines[0]
    return argv[3:]


@pytest.fixture(scope="module")
def hosts() -> Iterator[NetnsHosts]:
    with netns_hosts(2) as h:
        yield h


def test_readme_two_node_run_on_namespace_hosts(hosts: NetnsHosts, tmp_path: Path) -> None:
    """Both nodes exit 0; node a's table shows world 4 and every rank bit-identical to the
    driver's rebuild (ranks 0, 1 on a share the ring, ranks 2, 3 on b take the process group)."""
    argv = [a.replace("HOST", hosts.addr("a")) for a in readme_two_node_command()]
    steps = argv.index("--steps")
    argv[steps + 1] = "12"  # the README runs 50: the same command, shorter
    procs = []
    for host in "ab":
        env = {**os.environ, "CPMETA_HOST_ID": host, "GLOO_SOCKET_IFNAME": "eth0",
               "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        node = [sys.executable, "-m", "cpmeta.launch", *argv, "--warmup", "2", "--timeout", "60",
                "--local-addr", hosts.addr(host), "--rdzv-conf", f"is_host={int(host == 'a')}"]
        log = open(tmp_path / f"node-{host}.log", "w")
        procs.append((host, log, subprocess.Popen(hosts.exec_argv(host, node), cwd=ROOT, env=env,
                                                  stdout=log, stderr=subprocess.STDOUT)))
    try:
        for host, log, p in procs:
            p.wait(timeout=RUN_TIMEOUT_S)
    finally:
        for host, log, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    out = {host: (tmp_path / f"node-{host}.log").read_text() for host in "ab"}
    for host, _, p in procs:
        assert p.returncode == 0, f"node {host} exited {p.returncode}:\n{out[host][-4000:]}"
    table = out["a"] + out["b"]  # the driver's node prints the table
    assert "world=4" in table and "verify: every rank bit-identical" in table, table[-4000:]


# ----------------------------------------------------------------------------- validation

def _main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    import torch.distributed.run as trun

    from cpmeta.launch.__main__ import main

    seen: list[list[str]] = []
    real = trun.parse_args

    def parse(args: list[str]) -> object:
        seen.append(list(args))
        return real(args)

    monkeypatch.setattr(trun, "parse_args", parse)
    monkeypatch.setattr(trun, "run", lambda targs: None)
    assert main(argv) == 0
    return seen


def test_two_node_options_reach_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "10.0.0.1:29500",
            "--rdzv-id", "job1", "--local-addr", "10.0.0.2", "--steps", "3"]
    (args,) = _main(argv, monkeypatch)
    assert args[:args.index("-m")] == [
        "--nnodes=2", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500", "--rdzv-id=job1", "--local-addr=10.0.0.2"], args
    assert args[args.index("-m"):] == ["-m", "cpmeta.launch.worker", "--steps", "3"]
    (static,) = _main(["--nnodes", "2", "--master-addr", "10.0.0.1", "--node-rank", "1",
                       "--steps", "3"], monkeypatch)
    assert "--rdzv-backend=static" in static and "--node-rank=1" in static, static
    (single,) = _main(["--steps", "3"], monkeypatch)
    assert single[0] == "--standalone", single


BAD_NODES = {
    "nnodes-syntax": (["--nnodes", "two"], "--nnodes: expected N or MIN:MAX"),
    "nnodes-order": (["--nnodes", "3:2"], "--nnodes: expected N or MIN:MAX"),
    "no-rendezvous": (["--nnodes", "2"], "--nnodes 2: needs --rdzv-endpoint HOST:PORT"),
    "both-rendezvous": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-addr", "h"],
                        "give one rendezvous, not both"),
    "endpoint": (["--nnodes", "2", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint: expected HOST:PORT"),
    "node-rank": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"],
                  "--node-rank: expected 0..1, got 2"),
    "static-needs-rank": (["--nnodes", "2", "--master-addr", "h"], "needs --node-rank"),
}


@pytest.mark.parametrize("case", list(BAD_NODES))
def test_bad_node_options_exit_2_before_spawning(case: str, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import torch.distributed.run as trun

    from cpmeta.launch.__main__ import main

    argv, want = BAD_NODES[case]
    monkeypatch.setattr(trun, "run", lambda *a, **k: pytest.fail("spawned despite bad input"))
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--steps", "3"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and want in err, err
