"""``python -m launch`` / ``cpmeta-launch``: start a CP group on this machine with torchrun.

    python -m launch --nproc-per-node 2 --workload mixed --steps 50 --verify

Every option other than ``--nproc-per-node`` is passed to :mod:`launch.worker` (see its
``--help``). The ranks are started by ``torch.distributed.run`` (the torchrun machinery, with a
standalone rendezvous), so the same loop also runs as ``torchrun ... -m launch.worker``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]

#: NVLink multicast stays off: a program using it can take shared GPUs out of service.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m launch", add_help=False)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("-h", "--help", action="store_true")
    ours, rest = p.parse_known_args(argv)
    if ours.help:
        from .worker import build_parser

        print(__doc__)
        build_parser().print_help()
        return 0
    if ours.nproc_per_node < 1:
        print("--nproc-per-node: expected >= 1", file=sys.stderr)
        return 2
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.run import parse_args, run

    targs = parse_args([
        "--standalone",
        f"--nproc-per-node={ours.nproc_per_node}",
        "--max-restarts=0",
        "-m", "launch.worker", *rest,
    ])
    try:
        run(targs)
    except Exception as e:  # torchrun raises ChildFailedError with per-rank details
        print(f"launch: a rank failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
