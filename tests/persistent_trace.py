"""Traces an engine runs ``persistent_outputs`` through (issue 32 item 3), and their memory.

- ``chunked_prefill``: every step a 16k-32k-token prompt batch of the seed config (the launch
  loop's DeepSeek-V4-like model: compressed KV, sliding window, Engram), so the layout changes
  almost every step. One 32k-token batch is built once and each step is its rows cut to the step's
  token count (:func:`_cut`): the trace costs one build, the broadcaster sees a
  new layout of the same fields and sizes as a real chunked prefill's.
- ``decode``: decode batches of 1-300 sequences (one 300-sequence batch cut likewise).

``run_trace`` broadcasts a trace on every rank of a gloo group and reports, per rank, the arenas
and bytes the broadcaster holds and the process RSS growth. Run as a script it prints the table
docs/metrics.md quotes (``python tests/persistent_trace.py``).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from typing import Any, Iterator

import torch

TRACE_STEPS = 300
PROMPT_TOKENS = (16384, 32768)
DECODE_SEQS = (1, 300)


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _seed_prompt() -> Any:
    import cpmeta
    from cpmeta.launch.scheduler import default_config

    cfg = default_config(max_model_len=65536)
    seqs, per = [], 2048
    for i in range(PROMPT_TOKENS[1] // per):
        k = (i % 4) * 1024 + per  # continued chunks: history of 0-3k tokens
        seqs.append(cpmeta.SequenceMetadata(
            seqlen_q=per, seqlen_k=k, block_table=list(range(i * 64, i * 64 + cpmeta.blocks_needed(k, cfg))),
            state_id=i, token_ids=[(7 * t + i) % 30000 + 1 for t in range(k)], swa_valid_start=0))
    return cpmeta.prepare_prompt(seqs, cfg)


def _seed_decode() -> Any:
    import cpmeta
    from cpmeta.launch.scheduler import SyntheticScheduler, default_config

    cfg = default_config()
    _, seqs = SyntheticScheduler(0, cfg, "decode", decode_seqs=DECODE_SEQS[1],
                                 placeholder_rate=0.0).next_batch()
    return cpmeta.prepare_decode(seqs, cfg)


def _cut(md: Any, n: int, tq: int) -> Any:
    """``md`` cut to its first ``n`` sequences / ``tq`` rows: ``cu_seqlens_*`` to ``n + 1``
    entries, every other tensor (and tensor dict entry) to its first ``tq`` rows."""
    changes: dict[str, Any] = {}
    for name in md.field_names():
        v = getattr(md, name)
        if isinstance(v, torch.Tensor) and v.dim():
            changes[name] = v[:n + 1] if name.startswith("cu_seqlens") else v[:tq]
        elif isinstance(v, dict):
            changes[name] = {k: x[:tq] if isinstance(x, torch.Tensor) and x.dim() else x
                             for k, x in v.items()}
    return md.replace(num_seqs=n, total_q=tq, **changes)


def trace(kind: str, seed: int, steps: int = TRACE_STEPS) -> Iterator[Any]:
    """The driver's metadata of each step of trace ``kind`` (``chunked_prefill`` or ``decode``)."""
    rng = random.Random(seed)
    full = _seed_prompt() if kind == "chunked_prefill" else _seed_decode()
    assert full.cu_seqlens_q is not None
    cu = full.cu_seqlens_q.tolist()
    for _ in range(steps):
        if kind == "chunked_prefill":
            tq = rng.randint(*PROMPT_TOKENS)
            n = next(i for i, c in enumerate(cu) if c >= tq)
        else:
            n = rng.randint(*DECODE_SEQS)
            tq = cu[n]
        yield _cut(full, n, tq)


def run_trace(rank: int, world: int, kind: str, persistent: Any, seed: int = 3,
              steps: int = TRACE_STEPS) -> dict[str, Any]:
    """Every rank: broadcast ``steps`` of trace ``kind`` with ``persistent_outputs=persistent``;
    return the arenas, bytes and RSS growth of this rank, checking a few results on the way."""
    import cpmeta

    torch.set_num_threads(1)
    if rank == 0:  # the base batch is built before the RSS baseline (only the broadcasts count)
        it = trace(kind, seed, steps)
        steps_md: Iterator[Any] = itertools.chain([next(it)], it)
    else:
        steps_md = iter([None] * steps)
    rss0 = rss_bytes()
    peak = 0
    with cpmeta.MetadataBroadcaster(src=0, timeout=120, persistent_outputs=persistent,
                                    metrics=True) as bc:
        for i, md in enumerate(steps_md):
            got = bc.broadcast(md)
            assert got.total_q == (md.total_q if md is not None else got.total_q)
            peak = max(peak, rss_bytes() - rss0)
        st = bc.stats()
    a = st.arenas or {}
    return dict(rank=rank, kind=kind, steps=st.steps, layouts=st.layouts, arenas=a.get("arenas", 0),
                host_bytes=a.get("host_bytes", 0), persisted=a.get("persisted", 0),
                fresh=a.get("fresh", 0), evicted=a.get("evicted", 0),
                rss_growth=rss_bytes() - rss0, rss_peak_growth=peak,
                bytes_per_step=st.bytes_per_step.mean)


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from multiproc import run_ranks

    cases = [("off", False), ("True", True), ("depth 2", 2)]
    print(f"{'trace':>16} {'persistent':>12} {'rank':>4} {'arenas':>6} {'arena MiB':>9} "
          f"{'persisted':>9} {'fresh':>5} {'evicted':>7} {'RSS +MiB':>8} {'peak +MiB':>9}")
    for kind in ("chunked_prefill", "decode"):
        for name, persistent in cases:
            for r in run_ranks(run_trace, 2, kind, persistent, timeout=900):
                print(f"{kind:>16} {name:>12} {r['rank']:>4} {r['arenas']:>6} "
                      f"{r['host_bytes'] / 2**20:>9.1f} {r['persisted']:>9} {r['fresh']:>5} "
                      f"{r['evicted']:>7} {r['rss_growth'] / 2**20:>8.1f} "
                      f"{r['rss_peak_growth'] / 2**20:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
