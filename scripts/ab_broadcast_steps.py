#!/usr/bin/env python
"""One process, no process group: the driver's and a follower's per-step Python of
``MetadataBroadcaster`` over a real ``ShmRing`` (writer and one reader in this process).

The driver's ``_send`` writes the frame into the ring slot; the follower's ``_receive`` reads it
back right away. Per-phase p50 (the wrappers of ``profile_broadcast.PHASES``) and the totals, over
``--steps`` steps: CPU work only (no wake-up, no other process), so on a noisy shared VM it is the
number to compare two trees with. A/B two trees by running it alternately from each::

    for i in 1 2 3; do for t in /tmp/base /work/wt23; do
      (cd $t && PYTHONPATH=$t python scripts/ab_broadcast_steps.py --tag $t); done; done
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--payload", default="decode-64")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--no-phases", action="store_true", help="totals only (no phase wrappers)")
    p.add_argument("--tag", default="")
    p.add_argument("--persistent", action="store_true", help="persistent_outputs=True on both sides")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import torch

    import cpmeta
    from bench_broadcast import make_payload
    from cpmeta.broadcast.broadcaster import MetadataBroadcaster
    from cpmeta.broadcast.persistent import PersistentArenas
    from cpmeta.transport.shm_ring import ShmRing

    torch.set_num_threads(1)
    _, md = make_payload(args.payload, False)
    ring = ShmRing.create(1, timeout=10)
    reader = ShmRing.attach(ring.handle, 0, timeout=10)

    class _Chan:
        """The two ObjectChannel calls the broadcaster makes, over the in-process ring."""

        def __init__(self, r: ShmRing) -> None:
            self.ring, self.timeout, self.has_readers = r, 10.0, True

        def send_frame(self, nbytes: int, fill) -> None:
            view, addr = self.ring.reserve(nbytes)
            fill(view, addr)
            view.release()
            self.ring.commit()

        def recv_frame(self, consumer):
            return self.ring.read(lambda view, owned: consumer(view))

        def close(self) -> None:
            self.ring.close()

    def make(is_src: bool, r: ShmRing) -> MetadataBroadcaster:
        b = MetadataBroadcaster.__new__(MetadataBroadcaster)
        b.__dict__.update(group=None, src=0, rank=0 if is_src else 1, is_src=is_src,
                          device=torch.device("cpu"), tensor_path="auto", checksum=False,
                          _packed_max=1 << 20, _backend="gloo", _objects=_Chan(r), _tensors=None,
                          _layouts={}, _plans={}, _pin=False, _closed=False,
                          _persist=PersistentArenas(torch.device("cpu")) if args.persistent else None)
        return b

    drv, fol = make(True, ring), make(False, reader)
    log: dict[str, list[int]] = {}
    if not args.no_phases:
        import profile_broadcast

        profile_broadcast._install(log, {})
    tot_d, tot_f = [], []
    got = None
    for i in range(args.steps + 200):
        log.clear()
        t0 = time.perf_counter_ns()
        drv.broadcast(md)
        t1 = time.perf_counter_ns()
        got = fol.broadcast(None)
        t2 = time.perf_counter_ns()
        if i >= 200:
            tot_d.append(t1 - t0)
            tot_f.append(t2 - t1)
    # phases: a second pass, per-step sums of each wrapped phase
    phases: dict[str, list[int]] = {}
    if not args.no_phases:
        for i in range(args.steps):
            log.clear()
            drv.broadcast(md)
            fol.broadcast(None)
            for k, v in log.items():
                phases.setdefault(k, []).append(sum(v))
    for name in cpmeta.InputMetadata.field_names():  # bit-identical check of the last step
        a, b = getattr(md, name), getattr(got, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        elif isinstance(a, dict):
            assert a.keys() == b.keys(), name
        else:
            assert a == b, name

    def p50(xs: list[int]) -> float:
        s = sorted(xs)
        return s[len(s) // 2] / 1e3

    res = {"driver total (no phase wrappers)": p50(tot_d) if args.no_phases else None,
           "follower total (no phase wrappers)": p50(tot_f) if args.no_phases else None}
    if not args.no_phases:
        res = {"driver total (wrapped)": p50(tot_d), "follower total (wrapped)": p50(tot_f)}
        res.update({k: p50(v) for k, v in sorted(phases.items())})
    print(f"{args.tag} {args.payload} p50 us over {args.steps} steps")
    for k, v in res.items():
        print(f"  {k:<44} {v:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"run": run_meta(), **res}, indent=1))
    fol._objects.ring.close()
    drv._objects.ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
