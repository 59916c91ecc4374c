#!/usr/bin/env python
"""CPU builders against the per-token reference (issue 3 item 7): prepare_decode, prepare_prompt,
compute_attn_info.

Every case is timed single-threaded (``torch.set_num_threads(1)``), p50/p90 over ``--repeat``
calls after warm-up; the reference (``tests/reference.py``, the literal per-token oracle) is timed
in the same run when it is importable, and the speed-up is ``ref p50 / builder p50``.

Cases are a dict of named functions (``CASES``), so other sections (CP mirror, YoCo, in-place GPU
decode) are added with ``@case("name")`` and a function ``(BenchContext) -> dict``:

    python scripts/bench_build.py                       # all cases, writes docs/benchmarks/build.json
    python scripts/bench_build.py --quick               # smoke run (fewer repeats, small reference)
    python scripts/bench_build.py --only decode_256     # cases whose name contains the string
    python scripts/bench_build.py --device cuda         # compute_attn_info cases on the GPU
    python scripts/bench_build.py --only state_ --out docs/benchmarks/build_state.json
                                                        # array input: BatchState vs list, same run
    python scripts/bench_build.py --only plain_vs_seed --out docs/benchmarks/build_plain.json
                                                        # a plain paged-KV config vs the seed's, same batches

Batches (``MetadataConfig.compressed_swa()``: block 128, W = S = 128, ratios dense (4,) sparse (4,),
max_model_len 8192): decode ``seqlen_k`` uniform in ``[1 + d, 8192]`` with ``d`` drafts, block
tables of exactly ``blocks_needed`` random ids; prompt chunks of ``seqlen_q`` rows at a random
``q_start`` in ``[0, 8192 - seqlen_q]``, every 4th sequence a first chunk.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cpmeta import MetadataConfig, SequenceMetadata  # noqa: E402
from cpmeta.sequence import blocks_needed  # noqa: E402
from _harness.bench_meta import time_us, write_result  # noqa: E402  (scripts/_harness/bench_meta.py: the shared harness)

logger = logging.getLogger("bench_build")

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "build.json"
VOCAB = 128_000
MAX_BLOCK_ID = 1_000_000


@dataclass
class BenchContext:
    """What a case needs: repeat counts, the reference module (or None), a seeded rng, device."""

    quick: bool
    repeat: int
    ref_repeat: int
    ref: Any  # the tests/reference.py module, or None
    rng: random.Random
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)


CaseFn = Callable[[BenchContext], dict[str, Any]]
CASES: dict[str, CaseFn] = {}


def case(name: str) -> Callable[[CaseFn], CaseFn]:
    """Register a benchmark case under ``name`` (order of registration = order of the table)."""

    def deco(fn: CaseFn) -> CaseFn:
        CASES[name] = fn
        return fn

    return deco


# ---- batches --------------------------------------------------------------------------------


def decode_batch(rng: random.Random, cfg: MetadataConfig, n: int, drafts: int) -> list[SequenceMetadata]:
    """``n`` decode sequences with ``drafts`` MTP drafts each (seqlen_q = 1 + drafts)."""
    seqs = []
    for i in range(n):
        q = 1 + drafts
        k = rng.randint(q, cfg.max_model_len)
        seqs.append(SequenceMetadata(
            seqlen_q=q, seqlen_k=k, state_id=i,
            block_table=rng.sample(range(MAX_BLOCK_ID), blocks_needed(k, cfg)),
            token_ids=[rng.randrange(VOCAB) for _ in range(k - q + 1)],
            draft_tokens=[rng.randrange(VOCAB) for _ in range(drafts)],
        ))
    return seqs


def prompt_batch(rng: random.Random, cfg: MetadataConfig, n: int, q: int) -> list[SequenceMetadata]:
    """``n`` prompt chunks of ``q`` rows each (every 4th a first chunk, others at a random q_start)."""
    seqs = []
    for i in range(n):
        q_start = 0 if i % 4 == 0 else rng.randint(0, cfg.max_model_len - q)
        k = q_start + q
        seqs.append(SequenceMetadata(
            seqlen_q=q, seqlen_k=k, state_id=i,
            block_table=rng.sample(range(MAX_BLOCK_ID), blocks_needed(k, cfg)),
            token_ids=[rng.randrange(VOCAB) for _ in range(k)],
        ))
    return seqs


# ---- cases ----------------------------------------------------------------------------------


def _builder_vs_ref(ctx: BenchContext, build: Callable, ref_build: Optional[Callable],
                    seqs: list, cfg: MetadataConfig, target: str) -> dict[str, Any]:
    res: dict[str, Any] = {"builder": time_us(lambda: build(seqs, cfg), ctx.repeat), "target": target}
    res["total_q"] = sum(s.seqlen_q for s in seqs)
    res["n_seqs"] = len(seqs)
    if ref_build is not None:
        res["reference"] = time_us(lambda: ref_build(seqs, cfg), ctx.ref_repeat, warmup=0)
        res["speedup"] = res["reference"]["p50_us"] / res["builder"]["p50_us"]
    return res


def _decode_case(n: int, drafts: int, numpy_tables: bool = False) -> CaseFn:
    """``numpy_tables``: block tables as int32 numpy arrays (as engines usually keep them), which
    skips reading one Python int per block id."""

    def run(ctx: BenchContext) -> dict[str, Any]:
        import numpy as np

        from cpmeta import prepare_decode

        cfg = MetadataConfig.compressed_swa()
        seqs = decode_batch(ctx.rng, cfg, n, drafts)
        if numpy_tables:
            for s in seqs:
                s.block_table = np.asarray(s.block_table, dtype=np.int32)
        ref = ctx.ref.ref_prepare_decode if ctx.ref else None
        return _builder_vs_ref(ctx, prepare_decode, ref, seqs, cfg, "p50 < 1000 us (256 seqs)")

    return run


def _prompt_case(n: int, q: int) -> CaseFn:
    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import prepare_prompt

        cfg = MetadataConfig.compressed_swa()
        seqs = prompt_batch(ctx.rng, cfg, n, q)
        ref = ctx.ref.ref_prepare_prompt if ctx.ref else None
        return _builder_vs_ref(ctx, prepare_prompt, ref, seqs, cfg, ">= 50x reference (32768 rows)")

    return run


for _n in (64, 256):
    for _d in (0, 2):
        case(f"decode_{_n}_d{_d}")(_decode_case(_n, _d))
for _d in (0, 2):
    case(f"decode_256_d{_d}_np_tables")(_decode_case(256, _d, numpy_tables=True))
case("prompt_8x4096")(_prompt_case(8, 4096))
case("prompt_256x128")(_prompt_case(256, 128))


def _state_from(seqs: list, cfg: MetadataConfig, is_prompt: bool) -> tuple[Any, Any, Any]:
    """A ``BatchState`` holding ``seqs``' requests (added once, untimed) and the step's arguments."""
    import numpy as np

    from cpmeta import BatchState

    st = BatchState(cfg, max_seqs=len(seqs))
    slots, lens, drafts, nd = [], [], [], []
    for s in seqs:
        q_start = s.seqlen_k - s.seqlen_q
        done = q_start if is_prompt else len(s.token_ids)
        slots.append(st.add_request(len(slots), s.token_ids, s.block_table, s.state_id, num_computed=done,
                                    swa_valid_start=s.swa_valid_start))
        lens.append(s.seqlen_q)
        drafts += list(s.draft_tokens)
        nd.append(len(s.draft_tokens))
    return st, np.array(slots), (np.array(lens), np.array(drafts, np.int64), np.array(nd))


def _array_case(is_prompt: bool, n: int, q: int) -> CaseFn:
    """Array input (issue 18): the same batch from a list of ``SequenceMetadata`` (``list``) and
    from a ``BatchState`` (``builder`` = ``state.decode_batch`` / ``prompt_batch`` + the builder,
    the whole per-step cost), in the same run; also both with ``out=`` buffers reused (steady
    state) and the batch step alone. Target: decode 256 <= 150 us and >= 4x list; prompt >= 1.5x."""

    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import prepare_decode, prepare_prompt

        cfg = MetadataConfig.compressed_swa()
        seqs = prompt_batch(ctx.rng, cfg, n, q) if is_prompt else decode_batch(ctx.rng, cfg, n, q)
        st, slots, (lens, drafts, nd) = _state_from(seqs, cfg, is_prompt)
        if is_prompt:
            step = lambda: st.prompt_batch(slots, lens, advance=False)  # noqa: E731
            build = prepare_prompt
        else:
            step = lambda: st.decode_batch(slots, drafts, nd)  # noqa: E731
            build = prepare_decode
        rep = ctx.repeat // (4 if is_prompt else 1)
        out_l: dict = {}
        out_s: dict = {}
        build(seqs, cfg, out=out_l)
        build(step(), cfg, out=out_s)
        res: dict[str, Any] = {"total_q": sum(s.seqlen_q for s in seqs), "n_seqs": n}
        for _ in range(2):  # interleave list / array twice, keep the second round (warm, same load)
            res["list"] = time_us(lambda: build(seqs, cfg), rep)
            res["builder"] = time_us(lambda: build(step(), cfg), rep)
        res["list_out"] = time_us(lambda: build(seqs, cfg, out=out_l), rep)
        res["state_out"] = time_us(lambda: build(step(), cfg, out=out_s), rep)
        if not is_prompt:  # the steady state of an engine loop: one arena per batch shape, refilled
            from cpmeta import OutputArenas

            arenas = OutputArenas()
            res["state_arena"] = time_us(lambda: build(step(), cfg, out=arenas), rep)
            res["speedup_arena_vs_list"] = res["list"]["p50_us"] / res["state_arena"]["p50_us"]
        res["batch_step"] = time_us(step, rep)
        res["speedup_vs_list"] = res["list"]["p50_us"] / res["builder"]["p50_us"]
        res["speedup_vs_list_out"] = res["list_out"]["p50_us"] / res["state_out"]["p50_us"]
        res["target"] = ">= 1.5x list" if is_prompt else "<= 150 us, >= 4x list"
        return res

    return run


for _d in (0, 2):
    case(f"state_decode_256_d{_d}")(_array_case(False, 256, _d))
case("state_prompt_8x4096")(_array_case(True, 8, 4096))


#: The plain paged-KV model of DESIGN 14 next to the compressed-KV + sliding-window config
#: (``MetadataConfig.compressed_swa()``): same block size and max_model_len, no compressed KV, no
#: sliding window, so one batch is valid for both.
PLAIN = MetadataConfig(block_size=128, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=())


def _plain_vs_seed_case(path: str, n: int, q: int) -> CaseFn:
    """Issue 25: the same batch built with the plain config (``builder``) and with the seed's
    (``seed``), interleaved twice in one run (the second round kept); ``speedup`` = seed / plain.
    ``path``: ``"prompt"`` / ``"decode"`` (list input, ``prepare_*``), or ``"state"`` (the
    BatchState decode path: ``decode_batch`` + ``prepare_decode`` into ``OutputArenas``, and
    ``stage_decode`` filling the in-place path's staging buffer, host side only). Tables hold
    the plain config's ``blocks_needed`` (``cdiv(seqlen_k, 128)``, >= the seed's need)."""

    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import OutputArenas, prepare_decode, prepare_prompt
        from cpmeta.gpu import DecodeStaging, stage_decode

        seed_cfg = MetadataConfig.compressed_swa()
        seqs = (prompt_batch if path == "prompt" else decode_batch)(ctx.rng, PLAIN, n, q)
        rep = ctx.repeat // (4 if path == "prompt" else 1)
        timed: dict[str, Callable[[MetadataConfig], Callable[[], Any]]] = {}
        if path in ("prompt", "decode"):
            build = prepare_prompt if path == "prompt" else prepare_decode
            timed["builder"] = lambda cfg: (lambda: build(seqs, cfg))
        else:
            def state_path(cfg: MetadataConfig) -> Callable[[], Any]:
                st, slots, (_, drafts, nd) = _state_from(seqs, cfg, False)
                arenas = OutputArenas()
                return lambda: prepare_decode(st.decode_batch(slots, drafts, nd), cfg, out=arenas)

            def staging_path(cfg: MetadataConfig) -> Callable[[], Any]:
                st, slots, (_, drafts, nd) = _state_from(seqs, cfg, False)
                stg = DecodeStaging("cpu")
                return lambda: stage_decode(stg, st, slots, drafts, nd, upload=False, capacity=None)

            timed["builder"], timed["stage_decode"] = state_path, staging_path
        res: dict[str, Any] = {"total_q": sum(s.seqlen_q for s in seqs), "n_seqs": n,
                               "target": "(info) speedup = seed / plain"}
        fns = {(k, which): make(cfg) for k, make in timed.items()
               for which, cfg in (("plain", PLAIN), ("seed", seed_cfg))}
        for _ in range(2):  # interleaved, the second round kept (warm, same load)
            for (k, which), fn in fns.items():
                res[f"{k}_{which}"] = time_us(fn, rep)
        for k in timed:
            res[k] = res.pop(f"{k}_plain")
            res[f"{k}_seed"] = res.pop(f"{k}_seed")
            res[f"{k}_speedup"] = res[f"{k}_seed"]["p50_us"] / res[k]["p50_us"]
        res["seed"], res["speedup"] = res["builder_seed"], res["builder_speedup"]
        return res

    return run


case("plain_vs_seed_decode_256_d0")(_plain_vs_seed_case("decode", 256, 0))
case("plain_vs_seed_decode_256_d2")(_plain_vs_seed_case("decode", 256, 2))
case("plain_vs_seed_prompt_8x4096")(_plain_vs_seed_case("prompt", 8, 4096))
case("plain_vs_seed_prompt_256x128")(_plain_vs_seed_case("prompt", 256, 128))
case("plain_vs_seed_state_decode_256_d2")(_plain_vs_seed_case("state", 256, 2))


#: Issue 37's hot-build bounds (p50, VM or H200 host, one thread), per case: (plain, seed) in us.
HOT_BOUNDS = {"hot_prompt_8x1024": (60, 60), "hot_decode_64": (15, 30), "hot_decode_256": (40, 80)}


def _hot_case(name: str, is_prompt: bool, n: int, q: int) -> CaseFn:
    """Issue 37's hot build: ``prepare_prompt`` / ``prepare_decode(batch, cfg, out=arenas)`` on a
    validated ``SequenceBatch`` (made once, untimed: what ``BatchState.prompt_batch`` /
    ``decode_batch`` hands over; the state's step itself is ``state_decode_*``'s ``batch_step``)
    into ``OutputArenas`` (one arena per batch shape, refilled); ``builder`` = the plain config,
    ``seed`` = ``MetadataConfig.compressed_swa()``, same batch, interleaved twice (second round
    kept); ``dict_out`` / ``dict_out_seed``: the same into a reused ``out`` dict. ``q``: rows per
    prompt chunk, or drafts per decode sequence. Bounds: :data:`HOT_BOUNDS`."""

    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import OutputArenas, SequenceBatch, prepare_decode, prepare_prompt

        build = prepare_prompt if is_prompt else prepare_decode
        seqs = prompt_batch(ctx.rng, PLAIN, n, q) if is_prompt else decode_batch(ctx.rng, PLAIN, n, q)
        fns: dict[str, Callable[[], Any]] = {}
        for which, cfg in (("plain", PLAIN), ("seed", MetadataConfig.compressed_swa())):
            sb = SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)
            arenas, out = OutputArenas(), {}
            fns[f"arena_{which}"] = lambda sb=sb, cfg=cfg, a=arenas: build(sb, cfg, out=a)
            fns[f"dict_{which}"] = lambda sb=sb, cfg=cfg, o=out: build(sb, cfg, out=o)
        plain, seed = HOT_BOUNDS[name]
        res: dict[str, Any] = {"total_q": sum(s.seqlen_q for s in seqs), "n_seqs": n,
                               "target": f"<= {plain} us plain, <= {seed} us seed"}
        for _ in range(2):
            for k, fn in fns.items():
                res[k] = time_us(fn, ctx.repeat)
        res["builder"], res["seed"] = res.pop("arena_plain"), res.pop("arena_seed")
        res["dict_out"], res["dict_out_seed"] = res.pop("dict_plain"), res.pop("dict_seed")
        res["speedup"] = res["seed"]["p50_us"] / res["builder"]["p50_us"]
        res["bounds_met"] = res["builder"]["p50_us"] <= plain and res["seed"]["p50_us"] <= seed
        return res

    return run


case("hot_prompt_8x1024")(_hot_case("hot_prompt_8x1024", True, 8, 1024))
case("hot_decode_64")(_hot_case("hot_decode_64", False, 64, 0))
case("hot_decode_256")(_hot_case("hot_decode_256", False, 256, 0))


def _attn_case(is_prompt: bool, n: int, q: int) -> CaseFn:
    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import prepare_decode, prepare_prompt
        from cpmeta.builders.attn_info import compute_attn_info

        cfg = MetadataConfig.compressed_swa()
        if is_prompt:
            md = prepare_prompt(prompt_batch(ctx.rng, cfg, n, q), cfg)
        else:
            md = prepare_decode(decode_batch(ctx.rng, cfg, n, q), cfg)
        md = md.to(ctx.device)
        cuda = ctx.device.startswith("cuda")
        rep = max(3, ctx.repeat // (20 if is_prompt and not cuda else 1))
        t = time_us(lambda: compute_attn_info(md, cfg), rep, setup=md.clean_derived_, sync=cuda)
        return {"builder": t, "total_q": md.total_q, "n_seqs": n, "device": ctx.device,
                "target": "(information)"}

    return run


case("attn_info_decode_256")(_attn_case(False, 256, 0))
case("attn_info_prompt_8x4096")(_attn_case(True, 8, 4096))


def _mirror_case(n: int, q: int, cp: int) -> CaseFn:
    """CP mirror (issue 6): ``prepare_for_mirror_cp`` of the last rank (and ``prepare_cp_mirror``
    alone) on ``n`` prompt chunks of ``q`` rows; reference = tests/reference_mirror.py per row."""

    def run(ctx: BenchContext) -> dict[str, Any]:
        from cpmeta import prepare_prompt
        from cpmeta.cp.mirror import prepare_for_mirror_cp
        from cpmeta.cp.zigzag import cp_mirror_len, prepare_cp_mirror

        cfg = MetadataConfig.compressed_swa()
        seqs = prompt_batch(ctx.rng, cfg, n, q)
        md = prepare_prompt(seqs, cfg).to(ctx.device)
        cuda = ctx.device.startswith("cuda")
        ratios = tuple(int(k) for k in md.ks) or (1,)
        length = cp_mirror_len(md.cu_seqlens_q, cp)
        res: dict[str, Any] = {
            "builder": time_us(lambda: prepare_for_mirror_cp(md, cp - 1, cp), ctx.repeat, sync=cuda),
            "prepare_cp_mirror": time_us(lambda: prepare_cp_mirror(
                md.cu_seqlens_q, md.cu_seqlens_k, cp, cp - 1, ratios, md.total_q, length), ctx.repeat, sync=cuda),
            "total_q": md.total_q, "n_seqs": n, "cp_size": cp, "cp_mirror_len": length,
            "device": ctx.device, "target": "(info) speedup = ref / prepare_cp_mirror",
        }
        if ctx.ref is not None:
            import reference_mirror  # type: ignore[import-not-found]  # tests/ is on sys.path with ctx.ref

            sq, sk = [s.seqlen_q for s in seqs], [s.seqlen_k for s in seqs]
            res["reference"] = time_us(lambda: reference_mirror.ref_prepare_cp_mirror(sq, sk, cp, cp - 1, ratios),
                                       ctx.ref_repeat, warmup=0)
            res["speedup"] = res["reference"]["p50_us"] / res["prepare_cp_mirror"]["p50_us"]
        return res

    return run


for _cp in (2, 4, 8):
    case(f"mirror_8x4096_cp{_cp}")(_mirror_case(8, 4096, _cp))


def _yoco_case(n: int, q: int, mode: str, cp: int, keep: int = 512) -> CaseFn:
    """YoCo (issue 10, added by the YoCo helper): extra cost of the section-10 fields.

    ``builder`` = ``prepare_prompt`` with ``yoco_keep_tokens=keep``; ``without_yoco`` = the same
    batch without YoCo; the view (``get_consumer_view`` /
    ``get_mask_view``); compact also times ``prepare_for_mirror_cp`` with and without the YoCo CP
    fields and the mirrored consumer view (compact ``prepare_cp_mirror``) on the last of ``cp``
    ranks. Each chunk is the last of its prompt (``token_ids`` = ``seqlen_k`` tokens), so compact
    keeps ``min(q, keep)`` rows per sequence. Reference: tests/reference_yoco.py (compact only).
    """

    def run(ctx: BenchContext) -> dict[str, Any]:
        import dataclasses

        from cpmeta import prepare_for_mirror_cp, prepare_prompt

        plain = MetadataConfig.compressed_swa()
        cfg = dataclasses.replace(plain, yoco_keep_tokens=keep, yoco_mode=mode)
        seqs = prompt_batch(ctx.rng, cfg, n, q)
        md, md0 = prepare_prompt(seqs, cfg), prepare_prompt(seqs, plain)
        view = md.get_consumer_view if mode == "compact" else md.get_mask_view
        res: dict[str, Any] = {
            "builder": time_us(lambda: prepare_prompt(seqs, cfg), ctx.repeat),
            "without_yoco": time_us(lambda: prepare_prompt(seqs, plain), ctx.repeat),
            "view": time_us(view, ctx.repeat),
            "total_q": md.total_q, "kept_rows": md.yoco_consumer_total_q, "n_seqs": n, "mode": mode,
            "keep_tokens": keep, "target": "(info) extra = with - without YoCo",
        }
        res["extra_p50_us"] = res["builder"]["p50_us"] - res["without_yoco"]["p50_us"]
        if mode == "compact":
            mirrored = prepare_for_mirror_cp(md, cp - 1, cp)
            res["cp_size"] = cp
            res["mirror_with_yoco"] = time_us(lambda: prepare_for_mirror_cp(md, cp - 1, cp), ctx.repeat)
            res["mirror_without_yoco"] = time_us(lambda: prepare_for_mirror_cp(md0, cp - 1, cp), ctx.repeat)
            res["mirrored_consumer_view"] = time_us(mirrored.get_consumer_view, ctx.repeat)
            if ctx.ref is not None:
                import reference_yoco  # type: ignore[import-not-found]  # tests/ is on sys.path with ctx.ref

                res["reference"] = time_us(lambda: reference_yoco.ref_yoco_fields(seqs, cfg),
                                           ctx.ref_repeat, warmup=0)
                res["speedup"] = res["reference"]["p50_us"] / res["builder"]["p50_us"]
        return res

    return run


for _mode in ("compact", "mask"):
    case(f"yoco_{_mode}_8x4096")(_yoco_case(8, 4096, _mode, cp=4))
    case(f"yoco_{_mode}_256x128")(_yoco_case(256, 128, _mode, cp=4, keep=64))


# ---- driver ---------------------------------------------------------------------------------


def _load_reference() -> Any:
    tests = ROOT / "tests"
    if not (tests / "reference.py").exists():
        return None
    sys.path.insert(0, str(tests))
    import reference  # type: ignore[import-not-found]

    return reference


def _table(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'case':<34}{'rows':>7}{'p50 us':>11}{'p90 us':>11}{'ref/list/seed':>14}{'speedup':>9}  target"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        b = r["builder"]
        ref = r.get("reference", r.get("list", r.get("seed", {}))).get("p50_us")
        sp = r.get("speedup", r.get("speedup_vs_list"))
        lines.append(
            f"{name:<34}{r.get('total_q', 0):>7}{b['p50_us']:>11.1f}{b['p90_us']:>11.1f}"
            f"{(f'{ref:.0f}' if ref else '-'):>14}{(f'{sp:.1f}x' if sp else '-'):>9}  {r.get('target', '')}"
        )
        if "stage_decode" in r:  # plain vs seed: the in-place path's host fill from the state too
            st, sd = r["stage_decode"], r["stage_decode_seed"]
            lines.append(f"{'  + stage_decode (host fill)':<34}{r.get('total_q', 0):>7}{st['p50_us']:>11.1f}"
                         f"{st['p90_us']:>11.1f}{sd['p50_us']:>14.0f}{r['stage_decode_speedup']:>8.1f}x")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repeats, reference only on small cases")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls per case (default 200, quick 20)")
    ap.add_argument("--only", default=None, help="run cases whose name contains this string")
    ap.add_argument("--device", default="cpu", help="device for the compute_attn_info cases")
    ap.add_argument("--no-ref", action="store_true", help="skip the per-token reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output path ('' = none)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]  # the machine is shared: record how busy it was
    repeat = args.repeat or (20 if args.quick else 200)
    ctx = BenchContext(quick=args.quick, repeat=repeat, ref_repeat=1 if args.quick else 3,
                       ref=None if args.no_ref else _load_reference(), rng=random.Random(args.seed),
                       device=args.device)
    results: dict[str, dict[str, Any]] = {}
    for name, fn in CASES.items():
        if args.only and args.only not in name:
            continue
        if args.quick and ctx.ref is not None and "prompt_8x4096" == name:
            saved, ctx.ref = ctx.ref, None  # the per-token reference of 32768 rows takes seconds
            results[name] = fn(ctx)
            ctx.ref = saved
        else:
            results[name] = fn(ctx)
        logger.info("%s: p50 %.1f us", name, results[name]["builder"]["p50_us"])
    print(_table(results))
    if args.out:
        write_result(args.out, {"loadavg_1m_start_end": [load0, os.getloadavg()[0]], "threads": torch.get_num_threads(),
                                "reference": ctx.ref is not None, "repeat": repeat, "results": results}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
