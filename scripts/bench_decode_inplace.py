#!/usr/bin/env python
"""In-place decode metadata (issue 12) against the eager CPU builder + ONE coalesced H2D copy.

Per case (64 / 256 sequences, 0 / 2 MTP drafts, default ``MetadataConfig``: block 128, ratios
(4,), max_model_len 8192, ``seqlen_k`` uniform in ``[1 + d, 8192]``; the batches of
``scripts/bench_build.py``) it times, p50 / p90 over ``--repeat`` steps:

- ``eager_copy``: ``prepare_decode(seqs, cfg, out=arena)`` where every output tensor is a view of
  ONE pinned host arena, then ONE ``copy_(non_blocking=True)`` of the arena to the device and a
  sync -- the best case of "build on the CPU, then copy" (no packing step);
- ``inplace``: ``prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)`` and a sync
  (validation + staging + ONE H2D copy + the two kernels), i.e. the per-step latency;
- ``inplace_cpu``: the same call without the sync (host time per step; the GPU work overlaps);
- breakdown: ``stage`` (validate + fill + copy enqueue), ``extract`` (the builders'
  ``extract_batch`` alone: reading the ``SequenceMetadata`` objects), ``kernels``
  (``launch_decode_inplace``: cached graph replay of the two kernels, synced), ``kernels_cpu``
  (the same, host time only) and ``graph_replay`` (a bare ``CUDAGraph.replay`` of the kernels);
- ``from_arrays``: staging from already extracted arrays + copy + kernels + sync, i.e. a step
  when the scheduler hands over per-sequence arrays instead of Python objects;
- ``from_state`` / ``from_state_cpu``: the batch from a ``BatchState`` (issue 18) then
  ``prepare_decode_inplace``, synced / host time only (goal: <= 50 us host time at 256
  sequences); ``state_staging_fill``: ``BatchState.decode_batch`` + the staging fill alone;
  ``state_stage_decode``: ``BatchState.stage_decode`` (the staging written straight from the
  state arrays + the checks + the copy enqueue, no ``SequenceBatch``), host time, to compare with
  ``state_staging_fill`` + the copy; ``from_state_fast_cpu``: ``stage_decode`` then
  ``launch_decode_inplace`` (the cached graph replay), host time of the whole step.

``decode_256_d0_np`` repeats the 256-sequence case with block tables held as int32 numpy arrays
(reading ~8k Python ints out of lists dominates the host time otherwise).

On a machine without CUDA everything runs on the CPU (the torch emulation of the kernels; no
copy): ``--quick`` makes that a smoke run. JSON to ``--out``, a table on stdout.

    python scripts/bench_decode_inplace.py --out $OUT/inplace.json      # on the H200
    python scripts/bench_decode_inplace.py --quick --out ''              # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import random
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_build import _state_from, decode_batch, time_us  # noqa: E402  (same batches and timer as the builders)
from cpmeta import MetadataConfig  # noqa: E402
from cpmeta.builders.extract import extract_batch  # noqa: E402
from cpmeta.builders.decode import prepare_decode  # noqa: E402
from cpmeta.gpu.decode_inplace import (  # noqa: E402
    DecodeStaging, capture_decode_graph, launch_decode_inplace, prepare_decode_inplace, staging_capacity,
)
from cpmeta.diff import metadata_diff  # noqa: E402
from cpmeta.gpu.decode_staging import stage_decode  # noqa: E402
from cpmeta.gpu.staging_layout import unpack_staging  # noqa: E402
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)

logger = logging.getLogger("bench_decode_inplace")

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "decode_inplace.json"
TARGET_US = 50.0  # per step at 256 sequences, incl. staging (H200)
TARGET_SPEEDUP = 3.0  # against eager + copy


def _arena(schema: dict[str, torch.Tensor], pin: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One uint8 host arena and an ``out`` dict of views into it shaped like ``schema``'s buffers
    (the decode ``out=`` schema: per-ratio fields stacked)."""
    flat = schema
    align = 16
    sizes = {k: -(-v.numel() * v.element_size() // align) * align for k, v in flat.items()}
    arena = torch.empty(sum(sizes.values()), dtype=torch.uint8, pin_memory=pin)
    out, off = {}, 0
    for k, v in flat.items():
        nbytes = v.numel() * v.element_size()
        out[k] = arena[off:off + nbytes].view(v.dtype).view(v.shape)
        off += sizes[k]
    return arena, out


def _eager_copy_fn(seqs: list, cfg: MetadataConfig, dev: torch.device) -> Callable[[], Any]:
    cuda = dev.type == "cuda"
    schema: dict[str, torch.Tensor] = {}
    prepare_decode(seqs, cfg, out=schema)
    arena, out = _arena(schema, pin=cuda)
    dev_arena = torch.empty_like(arena, device=dev) if cuda else None

    def step() -> None:
        prepare_decode(seqs, cfg, out=out)
        if dev_arena is not None:
            dev_arena.copy_(arena, non_blocking=True)
            torch.cuda.synchronize()

    return step


def _graph_fn(st: DecodeStaging, cfg: MetadataConfig, out: dict) -> Optional[Callable[[], Any]]:
    """The two kernels captured in a CUDA graph (replay + sync), or None without CUDA."""
    if st.device.type != "cuda":
        return None
    g = capture_decode_graph(st, cfg, out=out)

    def replay() -> None:
        g.replay()
        torch.cuda.synchronize()

    return replay


def run_case(n: int, drafts: int, dev: torch.device, repeat: int, rng: random.Random,
             np_tables: bool = False) -> dict[str, Any]:
    cfg = MetadataConfig.compressed_swa()
    seqs = decode_batch(rng, cfg, n, drafts)
    if np_tables:  # an engine that keeps block tables as int32 arrays: one np.concatenate
        for s in seqs:
            s.block_table = np.asarray(s.block_table, dtype=np.int32)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    st = DecodeStaging(dev, staging_capacity(cfg, n, n * (1 + drafts)))
    out: dict[str, torch.Tensor] = {}
    md = prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)
    sync()
    diff = metadata_diff(md, prepare_decode(seqs, cfg), cfg=cfg)
    if diff:
        raise AssertionError(f"in-place result differs from prepare_decode: {diff}")

    def inplace() -> None:
        prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st)
        sync()

    res: dict[str, Any] = {"n_seqs": n, "drafts": drafts, "total_q": md.total_q, "device": str(dev),
                           "block_tables": "numpy int32" if np_tables else "list"}
    res["eager_copy"] = time_us(_eager_copy_fn(seqs, cfg, dev), repeat)
    res["inplace"] = time_us(inplace, repeat)
    res["inplace_cpu"] = time_us(lambda: prepare_decode_inplace(seqs, cfg, out=out, device=dev, staging=st),
                                 repeat)
    sync()
    res["stage"] = time_us(lambda: st.stage(seqs, cfg), repeat)
    res["kernels"] = time_us(lambda: launch_decode_inplace(st, cfg, out=out), repeat, sync=cuda)
    res["kernels_cpu"] = time_us(lambda: launch_decode_inplace(st, cfg, out=out), repeat)
    sync()
    b = extract_batch(seqs, cfg, is_prompt=False)

    def from_arrays() -> None:  # what a step costs when the scheduler hands over arrays
        st.upload(st.fill_arrays(b, cfg))
        launch_decode_inplace(st, cfg, out=out)
        sync()

    res["from_arrays"] = time_us(from_arrays, repeat)
    bs, slots, (_, drafts_, nd) = _state_from(seqs, cfg, False)  # issue 18: the batch from a BatchState

    def from_state() -> None:  # the whole step of an engine keeping a BatchState
        prepare_decode_inplace(bs.decode_batch(slots, drafts_, nd), cfg, out=out, device=dev, staging=st)
        sync()

    res["from_state"] = time_us(from_state, repeat)
    res["from_state_cpu"] = time_us(  # host time: batch + staging fill + copy enqueue + replay launch
        lambda: prepare_decode_inplace(bs.decode_batch(slots, drafts_, nd), cfg, out=out, device=dev, staging=st),
        repeat)
    sync()
    res["state_staging_fill"] = time_us(lambda: st.fill(bs.decode_batch(slots, drafts_, nd), cfg), repeat)
    sync()
    ref = st.stage(bs.decode_batch(slots, drafts_, nd), cfg)
    ref_batch = unpack_staging(st.host_buffer[:ref.used].numpy().copy(), ref, cfg)
    sync()
    got = stage_decode(st, bs, slots, drafts_, nd)
    got_batch = unpack_staging(st.host_buffer[:got.used].numpy(), got, cfg)
    if got._replace(used=0) != ref._replace(used=0) or ref_batch["sizes"] != got_batch["sizes"] or not all(
            np.array_equal(x, y) for k in ("seq", "ids") for x, y in [(ref_batch[k], got_batch[k])]) or not all(
            np.array_equal(x, y) for x, y in zip(ref_batch["tables"], got_batch["tables"])):
        raise AssertionError("BatchState.stage_decode staged another batch than decode_batch + stage")
    sync()
    res["state_stage_decode"] = time_us(lambda: stage_decode(st, bs, slots, drafts_, nd), repeat)
    sync()

    def from_state_fast() -> None:  # host time: staging straight from the state + copy + replay launch
        stage_decode(st, bs, slots, drafts_, nd)
        launch_decode_inplace(st, cfg, out=out)

    res["from_state_fast_cpu"] = time_us(from_state_fast, repeat)
    sync()
    res["extract"] = time_us(lambda: extract_batch(seqs, cfg, is_prompt=False), repeat)
    replay = _graph_fn(st, cfg, out)
    if replay is not None:
        res["graph_replay"] = time_us(replay, repeat)
    res["speedup"] = res["eager_copy"]["p50_us"] / res["inplace"]["p50_us"]
    return res


def _table(results: dict[str, dict[str, Any]]) -> str:
    cols = ("eager_copy", "inplace", "inplace_cpu", "stage", "extract", "kernels", "kernels_cpu",
            "graph_replay", "from_arrays", "from_state", "from_state_cpu", "state_staging_fill",
            "state_stage_decode", "from_state_fast_cpu")
    head = f"{'case':<17}{'rows':>6}" + "".join(f"{c:>19}" for c in cols) + f"{'speedup':>9}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        vals = "".join(f"{r[c]['p50_us']:>19.1f}" if c in r else f"{'-':>19}" for c in cols)
        lines.append(f"{name:<17}{r['total_q']:>6}{vals}{r['speedup']:>8.2f}x")
    lines.append(f"(p50 us; goal on the H200: inplace p50 < {TARGET_US:.0f} us at 256 seqs and "
                 f">= {TARGET_SPEEDUP:.0f}x eager_copy)")
    return "\n".join(lines)


def write_run(path: str, results: Any, dev: torch.device) -> None:
    """``results`` as JSON at ``path`` with the command line, the date and :func:`_machine`
    (the in-place step's profiling scripts write their runs this way)."""
    doc = {"command": " ".join(sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": _machine(dev), "results": results, "run": run_meta()}
    Path(path).write_text(json.dumps(doc, indent=1))
    print("wrote", path)


def _machine(dev: torch.device) -> dict[str, Any]:
    m: dict[str, Any] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                         "cpu_count": os.cpu_count(), "python": platform.python_version(),
                         "torch": torch.__version__, "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(dev)
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        m["triton"] = None
    return m


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats (CPU smoke run)")
    ap.add_argument("--repeat", type=int, default=None, help="timed steps per measurement (default 300, quick 10)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path ('' = none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeat = args.repeat or (10 if args.quick else 300)
    rng = random.Random(args.seed)
    results = {}
    for n in (64, 256):
        for d in (0, 2):
            name = f"decode_{n}_d{d}"
            results[name] = run_case(n, d, dev, repeat, rng)
            logger.info("%s: inplace p50 %.1f us, eager+copy p50 %.1f us", name,
                        results[name]["inplace"]["p50_us"], results[name]["eager_copy"]["p50_us"])
    results["decode_256_d0_np"] = run_case(256, 0, dev, repeat, rng, np_tables=True)
    print(_table(results))
    meta = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": _machine(dev),
        "repeat": repeat, "targets": {"inplace_p50_us_256": TARGET_US, "speedup": TARGET_SPEEDUP},
        "results": results, "run": run_meta(argv),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(meta, indent=2) + "\n")
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
