"""``python -m launch`` / ``cpmeta-launch``: start a CP group on this machine with torchrun.

    python -m launch --nproc-per-node 2 --workload mixed --steps 50 --verify

Every option other than ``--nproc-per-node`` is passed to :mod:`launch.worker` (see its
``--help``). The ranks are started by ``torch.distributed.run`` (the torchrun machinery, with a
standalone rendezvous), so the same loop also runs as ``torchrun ... -m launch.worker``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import envs

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Validate every argument (exit 2 with one message on stderr), then run torchrun.

    A failing rank's exception is shown once, first (``launch: rank 1 failed first:
    ValueError: ...``), above torchrun's report, which carries its traceback; exit code 1.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m launch", add_help=False)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("-h", "--help", action="store_true")
    ours, rest = p.parse_known_args(argv)
    from .worker import build_parser, check_args

    if ours.help:
        print(__doc__)
        build_parser().print_help()
        return 0
    if ours.nproc_per_node < 1:
        p.error(f"--nproc-per-node: expected >= 1, got {ours.nproc_per_node}")
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

    targs = parse_args([
        "--standalone",
        f"--nproc-per-node={ours.nproc_per_node}",
        "--max-restarts=0",
        "-m", "launch.worker", *rest,
    ])
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


def _one_line(message: object) -> str:
    """The exception line of a rank's error record (``{"message": "ValueError: ...", ...}``),
    or torchrun's own text (a signal, an exit code without a record)."""
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message).strip().splitlines()[0] if str(message).strip() else "<no message>"


if __name__ == "__main__":
    sys.exit(main())
