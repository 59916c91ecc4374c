"""``profile_phases.py replay``: a step's calls three ways in one process -- applied, recorded,
replayed.

``bench_step.py``'s trace (``StepTrace``: a workload's adds, finishes, appends and batch specs)
drives, step by step: a plain ``BatchState`` (``apply``: the calls themselves, what
``mq-replicate``'s ranks run), the recorder of a ``defer_apply`` driver on its own state without
a process group (``record``: what ``replicate-defer``'s driver does before its send), the op log's
``pack`` (the frame's region) and a replica applying that region (``replay``:
``cpmeta.replicate.apply.apply_step``, what every rank of the replicated designs runs, the step
check included). Each step may follow ``--gap-ms`` of sleep before each part (an engine's idle
between steps, or its forward pass's cooling); p50 µs per part over the steps after the first 20.

``--build``: the replay part is a follower's whole step instead -- the replay and the metadata
built from its batches into ``OutputArenas``, as ``ReplicatedBatchState.sync_metadata`` builds
(``follower``: a decode step of a shape built before is built inside the replay's call) -- and
``kernels`` is the time inside its compiled calls alone (the replay kernels and the builders'
count / fill kernels, timed from Python around each call: their dispatch included), so
``follower - kernels`` is the Python between and around them; ``two_calls`` is the same step on a
second replica replayed, then built by the builders (``sync()`` and ``prepare_*`` of its
batches: what the one call saves), the two run in alternating order.

    python scripts/profile_phases.py replay --workload prompt --model plain --steps 300
    python scripts/profile_phases.py replay --workload decode-64 --build --gap-ms 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

import cpmeta
from cpmeta.launch.scheduler import default_config, plain_config
from cpmeta.builders.decode_sink import DecodeSink
from cpmeta.replicate.apply import apply_step
from cpmeta.replicate.recorder import Recorder

from .step_methods import StepTrace, apply_ops

_NO_DIGEST = np.zeros((0, 4), np.int64)


class _Recording(Recorder):
    """A ``defer_apply`` driver's recording on a plain state (no process group); :meth:`cut`
    packs the step's region (the copy ``ReplicatedBatchState``'s send writes into its ring slot)
    and opens the next."""

    def __init__(self, state: cpmeta.BatchState) -> None:
        self.state = state
        self._init_recorder(defer=True)

    def _driver(self, what: str) -> None:
        pass

    def _at_spec(self) -> None:
        pass

    def cut(self) -> tuple[Any, list[Any], list[int]]:
        log = self._log
        out = (log.pack(_NO_DIGEST), list(log.req_ids), list(log.specs))
        self._log, self._next = self._next, log
        log.clear()
        self._batches, self._pending = [], []
        return out


#: the compiled calls of a follower's step: (module, name), each wrapped by ``--build``'s timer
KERNELS = (("cpmeta.replicate.apply", "replay"), ("cpmeta.replicate.apply", "replay_decode"),
           ("cpmeta.builders.decode", "decode_fill"), ("cpmeta.builders.decode", "decode_shape"),
           ("cpmeta.builders.prompt", "prompt_count"), ("cpmeta.builders.prompt", "prompt_fill"))


def _time_kernels(spent: list[float]) -> None:
    """Wrap :data:`KERNELS` where their callers look them up: each call adds its time to ``spent[0]``."""
    import importlib

    for mod_name, name in KERNELS:
        mod = importlib.import_module(mod_name)
        fn = getattr(mod, name)

        def timed(*a: Any, _fn: Any = fn) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(mod, name, timed)


def replay_main(args: argparse.Namespace, argv: list[str]) -> int:
    from _harness.bench_meta import write_result

    cfg = plain_config() if args.model == "plain" else default_config()
    trace = StepTrace(cfg, args.workload)
    direct, rec = cpmeta.BatchState(cfg, trace.max_seqs), _Recording(cpmeta.BatchState(cfg, trace.max_seqs))
    replica, twin = cpmeta.BatchState(cfg, trace.max_seqs), cpmeta.BatchState(cfg, trace.max_seqs)
    parts: dict[str, list[float]] = {"apply": [], "record": [], "pack": [], "replay": []}
    pc = time.perf_counter
    spent = [0.0]
    if args.build:
        _time_kernels(spent)
        del parts["replay"]
        parts.update(follower=[], kernels=[], two_calls=[])
    arenas, twin_arenas = cpmeta.OutputArenas(), cpmeta.OutputArenas()
    sink = DecodeSink(cfg, arenas)

    def two_calls(cols: Any, req_ids: list[Any], specs: list[int]) -> None:
        """The same step replayed, then built by the builders (``sync()`` + ``prepare_*``)."""
        for b in apply_step(twin, cols, req_ids, specs)[0]:
            (cpmeta.prepare_prompt if b.is_prompt else cpmeta.prepare_decode)(b, cfg, out=twin_arenas)

    def follower(cols: Any, req_ids: list[Any], specs: list[int]) -> None:
        spent[0] = 0.0
        batches, _, mds = apply_step(replica, cols, req_ids, specs, sink, lazy=True)  # as sync_metadata builds
        for b, md in zip(batches, mds):
            if md is None:
                cpmeta.prepare_prompt(b, cfg, out=arenas) if b.is_prompt else sink.build(b)

    def timed(name: str, fn: Any, *a: Any) -> Any:
        if args.gap_ms:
            time.sleep(args.gap_ms / 1e3)
        t = pc()
        got = fn(*a)
        parts[name].append(pc() - t)
        return got

    for _ in range(args.steps + 20):
        ops = trace.next_step()
        timed("apply", apply_ops, direct, ops)
        timed("record", apply_ops, rec, ops)
        t = pc()
        cols, req_ids, specs = rec.cut()
        parts["pack"].append(pc() - t)
        if args.build:  # alternating which goes first
            if len(parts["follower"]) % 2:
                timed("two_calls", two_calls, cols, req_ids, specs)
            timed("follower", follower, cols, req_ids, specs)
            parts["kernels"].append(spent[0])
            if len(parts["two_calls"]) < len(parts["follower"]):
                timed("two_calls", two_calls, cols, req_ids, specs)
        else:
            timed("replay", apply_step, replica, cols, req_ids, specs)
    res = {k: round(statistics.median(v[20:]) * 1e6, 1) for k, v in parts.items()}
    print(f"{args.workload} {args.model} gap {args.gap_ms:g} ms, p50 us over {args.steps} steps: "
          + "  ".join(f"{k} {v}" for k, v in res.items()))
    if args.out:
        write_result(args.out, {"results": res}, argv)
    return 0
