"""``python -m cpmeta.launch`` / ``cpmeta-launch``: start a CP group with torchrun, on one node or several.

    python -m cpmeta.launch --nproc-per-node 2 --workload mixed --steps 50 --verify

    # two nodes, the usual c10d rendezvous (run on each node; HOST = node 0's address)
    python -m cpmeta.launch --nnodes 2 --nproc-per-node 2 --rdzv-endpoint HOST:29500 --rdzv-id job1 --verify

The torchrun options below (``--nproc-per-node``, ``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``, ``--master-addr``, ``--master-port``,
``--local-addr``) go
to ``torch.distributed.run`` (the torchrun machinery): with none of the multi-node ones it runs
a standalone rendezvous on this machine, with ``--rdzv-endpoint`` the c10d rendezvous (node
ranks assigned as nodes join), with ``--master-addr`` + ``--node-rank`` the static one. Every
other option is passed to :mod:`launch.worker` (see its ``--help``), so the same loop also runs
as ``torchrun ... -m cpmeta.launch.worker``. Across nodes, ranks on the driver's host read its frames
from shared memory and the others get them over the process group; nodes that share a hostname
and boot id (containers, network namespaces) need ``CPMETA_HOST_ID`` set per node, and gloo
binds the interface of ``GLOO_SOCKET_IFNAME`` when the hostname does not resolve to the address
the nodes reach each other on (docs/transport.md, "Host identity").
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import envs

__all__ = ["main", "torchrun_args"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Validate every argument (exit 2 with one message on stderr), then run torchrun.

    A failing rank's exception is shown once, first (``launch: rank 1 failed first:
    ValueError: ...``), above torchrun's report, which carries its traceback; exit code 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m cpmeta.launch", add_help=False)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--nnodes", default="1", help="nodes (N or MIN:MAX), torchrun's --nnodes")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous")
    p.add_argument("--rdzv-id", default="cpmeta")
    p.add_argument("--rdzv-conf", default=None,
                   help="c10d rendezvous settings, e.g. is_host=1 on the node that serves the store")
    p.add_argument("--master-addr", default=None, help="static rendezvous: node 0's address")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--local-addr", default=None, help="this node's address as the others reach it")
    p.add_argument("-h", "--help", action="store_true")
    ours, rest = p.parse_known_args(argv)
    from .worker import build_parser, check_args

    if ours.help:
        print(__doc__)
        build_parser().print_help()
        return 0
    if ours.nproc_per_node < 1:
        p.error(f"--nproc-per-node: expected >= 1, got {ours.nproc_per_node}")
    nodes, problem = torchrun_args(ours)
    if problem:
        p.error(problem)
    worker = build_parser()
    worker.prog = p.prog
    problem = check_args(worker.parse_args(rest), ours.nproc_per_node)  # exits 2 on bad syntax
    if problem:
        worker.error(problem)
    for k, v in envs.MULTICAST_OFF.items():
        envs.set_default(k, v)
    envs.set_default("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    targs = parse_args([*nodes, "-m", "cpmeta.launch.worker", *rest])
    try:
        run(targs)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"launch: rank {rank} failed first: {_one_line(failure.message)}", file=sys.stderr)
        print(e, file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - the rendezvous or the agent itself failed
        print(f"launch: torchrun failed: {e}", file=sys.stderr)
        return 1
    return 0


def _node_count(text: str) -> Optional[tuple[int, int]]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4); None when malformed or out of order."""
    parts = text.split(":")
    if len(parts) not in (1, 2) or not all(x.strip().isdigit() for x in parts):
        return None
    lo, hi = int(parts[0]), int(parts[-1])
    return (lo, hi) if 1 <= lo <= hi else None


def _endpoint(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535


def torchrun_args(ours: argparse.Namespace) -> tuple[list[str], Optional[str]]:
    """torchrun's node options for ``ours``, or the first problem with them.

    One node without rendezvous options: ``--standalone``. Several: ``--rdzv-endpoint``
    (c10d) or ``--master-addr`` with ``--node-rank`` (static), not both. Example:
    ``--nnodes 2 --rdzv-endpoint 10.0.0.1:29500`` -> ``["--nnodes=2", "--nproc-per-node=2",
    "--max-restarts=0", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500",
    "--rdzv-id=cpmeta"]``; ``--nnodes 2`` alone -> the problem "--nnodes 2: needs
    --rdzv-endpoint HOST:PORT (c10d rendezvous) or --master-addr with --node-rank (static)".
    """
    count = _node_count(ours.nnodes)
    if count is None:
        return [], f"--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {ours.nnodes!r}"
    base = [f"--nproc-per-node={ours.nproc_per_node}", "--max-restarts=0"]
    rendezvous = ours.rdzv_endpoint or ours.master_addr
    if count == (1, 1) and not rendezvous and ours.node_rank is None:
        return ["--standalone", *base], None
    if ours.rdzv_endpoint and ours.master_addr:
        return [], "--rdzv-endpoint (c10d) and --master-addr (static): give one rendezvous, not both"
    if not rendezvous:
        return [], (f"--nnodes {ours.nnodes}: needs --rdzv-endpoint HOST:PORT (c10d rendezvous) or "
                    "--master-addr with --node-rank (static)")
    if ours.node_rank is not None and not 0 <= ours.node_rank < count[1]:
        return [], f"--node-rank: expected 0..{count[1] - 1}, got {ours.node_rank}"
    out = [f"--nnodes={ours.nnodes}", *base]
    if ours.rdzv_endpoint:
        if not _endpoint(ours.rdzv_endpoint):
            return [], f"--rdzv-endpoint: expected HOST:PORT, got {ours.rdzv_endpoint!r}"
        out += ["--rdzv-backend=c10d", f"--rdzv-endpoint={ours.rdzv_endpoint}",
                f"--rdzv-id={ours.rdzv_id}"]
        if ours.rdzv_conf:
            out.append(f"--rdzv-conf={ours.rdzv_conf}")
    else:
        if ours.node_rank is None or count[0] != count[1]:
            return [], "--master-addr (static rendezvous): needs --node-rank and a fixed --nnodes N"
        if not 1 <= ours.master_port <= 65535:
            return [], f"--master-port: expected 1..65535, got {ours.master_port}"
        out += ["--rdzv-backend=static", f"--master-addr={ours.master_addr}",
                f"--master-port={ours.master_port}"]
    if ours.node_rank is not None:
        out.append(f"--node-rank={ours.node_rank}")
    if ours.local_addr:
        out.append(f"--local-addr={ours.local_addr}")
    return out, None


def _one_line(message: object) -> str:
    """The exception line of a rank's error record (``{"message": "ValueError: ...", ...}``),
    or torchrun's own text (a signal, an exit code without a record)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message).strip().splitlines()[0] if str(message).strip() else "<no message>"


if __name__ == "__main__":
    sys.exit(main())
