#!/usr/bin/env python
"""Per-phase host cost of one step from a ``BatchState`` (issue 18): where the time goes.

Times each phase of ``prepare_decode`` / ``prepare_prompt`` / the in-place decode's staging fill
separately on the same batch (p50 over ``--repeat`` calls, single thread, phases interleaved in
each round so machine load hits them alike), and the whole step for reference:

    python scripts/profile_array_input.py                  # decode 256 (d0, d2), prompt 8 x 4096
    python scripts/profile_array_input.py --repeat 2000 --out docs/benchmarks/array_phases.json

Phases: ``batch`` (``BatchState.decode_batch`` / ``prompt_batch``), ``extract`` (``extract_batch``
of that already validated batch), ``fill_common``, then the path's own fields, ``metadata``
(``InputMetadata(**fields)``), and ``staging`` (``StagingLayout.write_batch`` of the extracted arrays, the
host side of ``prepare_decode_inplace`` after the batch), ``inplace_host`` (batch + extract +
staging) and ``stage_decode`` (``cpmeta.gpu.stage_decode``: the same staging bytes written straight
from the state arrays, no batch, plus its checks and the (CPU: no-op) upload). The phase sum
differs from ``step`` by the glue between them (and by noise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_build import _state_from, decode_batch, prompt_batch  # noqa: E402
from cpmeta import MetadataConfig, prepare_decode, prepare_prompt  # noqa: E402
from cpmeta.builders import common_fields as common, decode  # noqa: E402
from cpmeta.builders.extract import extract_batch  # noqa: E402
from cpmeta.gpu.decode_staging import DecodeStaging, stage_decode, staging_capacity  # noqa: E402
from cpmeta.gpu.staging_layout import StagingLayout  # noqa: E402
from cpmeta.metadata import InputMetadata  # noqa: E402
from bench_meta import run_meta  # noqa: E402  (scripts/bench_meta.py: the run block)


def _interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """p50 (us) of every fn, called round-robin ``repeat`` times after a warm-up round."""
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeat + 5):
        for k, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn()
            if r >= 5:
                ts[k].append((time.perf_counter_ns() - t0) / 1e3)
    return {k: float(np.median(v)) for k, v in ts.items()}


def _decode_phases(cfg: MetadataConfig, n: int, d: int, repeat: int, rng: random.Random) -> dict[str, float]:
    seqs = decode_batch(rng, cfg, n, d)
    st, slots, (_, drafts, nd) = _state_from(seqs, cfg, False)
    step = lambda: st.decode_batch(slots, drafts, nd)  # noqa: E731
    sb = step()
    b = extract_batch(sb, cfg, is_prompt=False)
    md = prepare_decode(sb, cfg)
    fields = {k: getattr(md, k) for k in InputMetadata.__dataclass_fields__ if getattr(md, k) is not None}
    bt = decode._fill_block_tables(b, cfg, None)[1]
    pos1 = (b.row_pos + 1).astype(np.int32)  # what prepare_decode hands the per-ratio fields (context_lens)
    view = np.zeros(staging_capacity(cfg, n, b.total_q), np.int32)
    layout = StagingLayout.of(cfg)
    stg = DecodeStaging("cpu", staging_capacity(cfg, n, b.total_q))

    phases = {
        "step": lambda: prepare_decode(step(), cfg),
        "batch": step,
        "extract": lambda: extract_batch(sb, cfg, is_prompt=False),
        "fill_common": lambda: common.fill_common(b, cfg, None),
        "block_tables": lambda: decode._fill_block_tables(b, cfg, None),
        "ratio_fields": lambda: decode._fill_ratio_fields(b, cfg, None, {}, bt, pos1),
        "metadata": lambda: InputMetadata(**fields),
        "staging": lambda: layout.write_batch(view, b),
        "inplace_host": lambda: layout.write_batch(view, extract_batch(step(), cfg, is_prompt=False)),
        "stage_decode": lambda: stage_decode(stg, st, slots, drafts, nd),  # inplace_host without the batch
    }
    return _interleaved(phases, repeat)


def _prompt_phases(cfg: MetadataConfig, n: int, q: int, repeat: int, rng: random.Random) -> dict[str, float]:
    """The prompt step: ``batch``, the build's count pass alone (``count``, :mod:`cpmeta.builders.prompt_njit`),
    the whole build into ``OutputArenas`` (``build_arena``: count, layout, fill, views) and with a
    new arena (``build``), ``metadata`` and the whole step both ways."""
    from cpmeta import OutputArenas
    from cpmeta.builders.prompt_njit import count_slots, prompt_consts, prompt_count

    seqs = prompt_batch(rng, cfg, n, q)
    st, slots, (lens, _, _) = _state_from(seqs, cfg, True)
    step = lambda: st.prompt_batch(slots, lens, advance=False)  # noqa: E731
    sb = step()
    arenas = OutputArenas()
    md = prepare_prompt(sb, cfg, out=arenas)
    fields = {k: getattr(md, k) for k in InputMetadata.__dataclass_fields__ if getattr(md, k) is not None}
    k, cnt, err = prompt_consts(cfg), np.empty(count_slots(cfg), np.int64), np.zeros(4, np.int64)
    phases = {
        "step": lambda: prepare_prompt(step(), cfg),
        "step_arena": lambda: prepare_prompt(step(), cfg, out=arenas),
        "list": lambda: prepare_prompt(seqs, cfg),
        "batch": step,
        "count": lambda: prompt_count(sb.seqlen_q, sb.seqlen_k, sb.state_id, sb.swa_valid_start, sb.num_tokens,
                                      sb.block_tables, sb.block_table_offsets, k, cnt, err),
        "build": lambda: prepare_prompt(sb, cfg),
        "build_arena": lambda: prepare_prompt(sb, cfg, out=arenas),
        "metadata": lambda: InputMetadata(**fields),
    }
    return _interleaved(phases, repeat)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=500)
    ap.add_argument("--out", default="", help="JSON output path ('' = none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg, rng = MetadataConfig.compressed_swa(), random.Random(0)
    load0 = os.getloadavg()[0]
    res = {f"decode_256_d{d}": _decode_phases(cfg, 256, d, args.repeat, rng) for d in (0, 2)}
    res["prompt_8x4096"] = _prompt_phases(cfg, 8, 4096, max(args.repeat // 10, 20), rng)
    for name, ph in res.items():
        print(name)
        for k, v in ph.items():
            print(f"  {k:<18}{v:>9.1f} us")
    if args.out:
        meta = {"loadavg_1m_start_end": [load0, os.getloadavg()[0]], "cpu_count": os.cpu_count(),
                "repeat": args.repeat, "p50_us": res, "run": run_meta(argv)}
        Path(args.out).write_text(json.dumps(meta, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
