#!/usr/bin/env python
"""The results folder: fold a session's JSON into ``docs/benchmarks/``, render the docs' numbers from it.

``docs/benchmarks/`` keeps one current file per benchmark. A VM benchmark's file is the script's
own output (its ``run`` block says command, date, machine, commit); an H200 one
(``h200_<benchmark>.json``) holds every lend's run, oldest first::

    {"benchmark": "h200_build_state", "about": "...", "current": "r5c",
     "runs": [{"id": "s2", "artifact": "...", "run": {"command": ..., "date": ..., "host": ...,
               "machine": {...}, "commit": ...}, "data": <the script's output>}, ...]}

Commands::

    python scripts/bench_results.py add OUT --id r6a     # a gpu_session.sh $OUT: each OUT/<name>.json
                                                         # becomes run r6a of docs/benchmarks/<name>.json
                                                         # (OUT/<name>.<variant>.json: run r6a-<variant>)
    python scripts/bench_results.py render               # rewrite the generated blocks of README.md
                                                         # and docs/benchmarks.md from the JSON
    python scripts/bench_results.py render --check       # exit 1 if a block is stale (the test does this)

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; its text
is :data:`BLOCKS` ``[NAME]`` of the folder (tables whose every number comes from a run, named
by file and run id). Example: ``render`` after ``add`` refreshes README's "Measured" table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"
DOCS = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "slot_mapping.md", ROOT / "docs" / "features.md")

__all__ = ["runs", "run_entry", "run_of", "add", "render", "BLOCKS"]

Run = tuple[str, dict[str, Any], Any]  # (run id, run block, data)


def runs(name: str, folder: Path = BENCH) -> list[Run]:
    """Every run of ``folder/name``, oldest first (a single-run file: one, id ``current``)."""
    doc = json.loads((folder / name).read_text())
    if "runs" in doc and "benchmark" in doc:
        return [(r["id"], r["run"], r["data"]) for r in doc["runs"]]
    return [("current", doc.get("run", {}), doc)]


def run_entry(name: str, rid: Optional[str] = None, folder: Path = BENCH) -> Run:
    """Run ``rid`` (default: the current one) of ``folder/name``: (id, run block, data)."""
    all_runs = runs(name, folder)
    if rid is None:
        return all_runs[-1]
    for r in all_runs:
        if r[0] == rid:
            return r
    raise KeyError(f"{name}: no run {rid!r} (runs: {[i for i, _, _ in all_runs]})")


def run_of(name: str, rid: Optional[str] = None, folder: Path = BENCH) -> Any:
    """The data of run ``rid`` (default: the current one) of ``folder/name``."""
    return run_entry(name, rid, folder)[2]


def add(out: Path, rid: str, folder: Path = BENCH, *, new: bool = False) -> list[str]:
    """Fold every ``out/<benchmark>[.<variant>].json`` carrying a run block into
    ``folder/<benchmark>.json`` as run ``rid`` (``rid-<variant>`` for a variant), the new current
    one; a single-run (VM) file is replaced. Only benchmarks that have a file already, unless
    ``new`` (then a new H200 benchmark starts its own file). Returns the names folded. Example:
    ``out/h200_decode_cp.nccl1.json`` -> run ``r6a-nccl1`` of ``h200_decode_cp.json``."""
    done = []
    for src in sorted(out.glob("*.json")):
        data = json.loads(src.read_text())
        bench, _, variant = src.stem.partition(".")
        dst = folder / f"{bench}.json"
        if "run" not in data or not (dst.exists() or new):
            continue  # not a bench script's result file, or a benchmark without a file here
        run_id = f"{rid}-{variant}" if variant else rid
        if dst.exists() and "runs" not in json.loads(dst.read_text()):
            dst.write_text(json.dumps(data, indent=1) + "\n")
        else:
            doc = json.loads(dst.read_text()) if dst.exists() else {"benchmark": bench, "about": "", "runs": []}
            if any(r["id"] == run_id for r in doc["runs"]):
                raise ValueError(f"{dst.name}: run {run_id!r} exists already")
            run = data.pop("run")
            doc["runs"].append({"id": run_id, "artifact": f"session {rid}: {src.name}", "run": run, "data": data})
            doc["current"] = run_id
            dst.write_text(json.dumps(doc, indent=1) + "\n")
        done.append(src.name)
    return done


# ---- formatting --------------------------------------------------------------------------------
def span(values: Iterable[float], fmt: str = "{:.0f}") -> str:
    """``"lo-hi"`` of the values (one value when they round alike). Example: (114.3, 227.9) -> "114-228"."""
    vs = sorted(values)
    lo, hi = fmt.format(vs[0]), fmt.format(vs[-1])
    return lo if lo == hi else f"{lo}-{hi}"


def _p50(d: Any, *path: str) -> float:
    for k in path:
        d = d[k]
    return float(d["p50_us"] if isinstance(d, dict) else d)


def _bcast(data: Any, world: int, payload: str, method: str, mode: Optional[str] = "engine") -> float:
    for r in data["results"]:
        if (r.get("world"), r.get("payload"), r.get("method")) == (world, payload, method) \
                and (mode is None or r.get("mode") == mode) and not r.get("attn_info"):
            return float(r["p50_us"])
    raise KeyError(f"no cell world={world} payload={payload} method={method} mode={mode}")


#: The issue-18 sessions' runs (sessions 2 and 3 on the H200): the spans the docs quote are over these.
S23 = ("s2-slowlend", "s2", "s2-final", "s2-last", "s3a", "s3b", "s3c", "s3d", "s3f", "s3f-1", "s3f-2")


def _sessions(name: str, folder: Path) -> list[tuple[str, Any]]:
    return [(i, d) for i, _, d in runs(name, folder) if i in S23 or i.split("-nccl")[0].split("-gloo")[0] in S23]


# ---- blocks ------------------------------------------------------------------------------------
def _readme_measured(folder: Path) -> str:
    bc = run_of("h200_broadcast.json", "r5d", folder)
    dec = [(w, p) for w in (2, 4, 8) for p in ("decode-64", "decode-256")]
    pr = [(w, "prompt-32k") for w in (2, 4, 8)]
    pers = [_bcast(bc, w, p, "cpmeta+p") for w, p in dec]
    pers_r = [_bcast(bc, w, p, "cpmeta+p") / _bcast(bc, w, p, "mq") for w, p in dec]
    prom = [_bcast(bc, w, p, "cpmeta+p") for w, p in pr]
    prom_r = [_bcast(bc, w, p, "cpmeta+p") / _bcast(bc, w, p, "mq") for w, p in pr]
    fresh = [_bcast(bc, w, p, "cpmeta") for w, p in dec]
    fresh_r = [_bcast(bc, w, p, "cpmeta") / _bcast(bc, w, p, "mq") for w, p in dec]
    n1, n2 = run_of("h200_broadcast_nccl.json", "s1-final", folder), run_of("h200_broadcast_nccl.json", "x2", folder)
    c1, c2 = _bcast(n1, 1, "decode-64", "cpmeta", None), _bcast(n2, 2, "decode-64", "cpmeta", None)
    b1, b2 = c1 / _bcast(n1, 1, "decode-64", "bol", None), c2 / _bcast(n2, 2, "decode-64", "bol", None)
    st = [d["results"]["state_decode_256_d0"] for _, d in _sessions("h200_build_state.json", folder)]
    steps = dict(_sessions("h200_inplace_step.json", folder))
    eager = dict(_sessions("h200_inplace.json", folder))
    same = [(_p50(eager[i]["results"], "decode_256_d0", "eager_copy"), _p50(steps[i]["results"], "decode_256_d0", "step"))
            for i in steps if i in eager]
    last = run_of("h200_inplace_step.json", None, folder)["results"]
    cp = [(i, d) for i, d in _sessions("h200_decode_cp.json", folder) if "nccl1" in i]
    cps = [_cp(d, "staged_state") for _, d in cp]
    cpb = [_cp(d, "bcast") for _, d in cp]
    sm = [x for x in run_of("h200_slot_mapping.json", "r1", folder)["results"] if x["num_reqs"] in (64, 256)]
    b = run_of("build.json", None, folder)["results"]
    mir = [b[f"mirror_8x4096_cp{p}"] for p in (2, 4, 8)]
    rows = [
        ("broadcast, decode-64 / decode-256, 2-8 ranks, `persistent_outputs` (H200 host, engine case)",
         f"{span(pers)} µs", "vLLM 0.33 `MessageQueue`, same run", f"{span(pers_r, '{:.2f}')}x the time"),
        ("broadcast, prompt-32k (2.4 MB), 2-8 ranks, `persistent_outputs` (H200 host)", f"{span(prom)} µs",
         "`MessageQueue`", f"{span(prom_r, '{:.2f}')}x"),
        ("broadcast, decode-64 / -256, 2-8 ranks, default (fresh tensors) (H200 host)", f"{span(fresh)} µs",
         "`MessageQueue`", f"{span(fresh_r, '{:.2f}')}x"),
        ("broadcast, decode-64, NCCL: 1 rank (H200) / 2 ranks (2xH200)", f"{c1:.0f} / {c2:.0f} µs",
         "`broadcast_object_list`", f"{b1:.2f}x / {b2:.2f}x"),
        (f"`prepare_decode`, 256 seqs from a `BatchState` (H200, {len(st)} runs)",
         f"{span(_p50(s, 'builder') for s in st)} µs; {span(_p50(s, 'state_arena') for s in st)} µs with "
         "`out=OutputArenas()`", "the same call on a list of `SequenceMetadata`",
         f"{span((s['speedup_vs_list'] for s in st), '{:.1f}')}x faster; "
         f"{span((s['speedup_arena_vs_list'] for s in st), '{:.1f}')}x"),
        (f"in-place decode step, 256 seqs, host incl. staging, H2D, replay (H200, {len(same)} runs)",
         f"{span(s for _, s in same)} µs (0 drafts); latest run {_p50(last, 'decode_256_d0', 'step'):.0f} µs, "
         f"2 drafts {_p50(last, 'decode_256_d2', 'step'):.0f} µs, copy inside the graph "
         f"{_p50(last, 'decode_256_d0', 'step_graph_upload'):.0f} / {_p50(last, 'decode_256_d2', 'step_graph_upload'):.0f} µs",
         f"eager `prepare_decode` + one H2D copy, same lends: {span(e for e, _ in same)} µs",
         f"{span((e / s for e, s in same), '{:.0f}')}x faster"),
        (f"CP decode step, 256 seqs, world 1 NCCL, from a `BatchState` (H200, {len(cp)} runs)", f"{span(cps)} µs",
         f"`prepare_decode` + `MetadataBroadcaster`, {span(cpb)} µs",
         f"{span((s / c for s, c in zip(cps, cpb)), '{:.2f}')}x the time (same run)"),
        ("`compute_slot_mapping`, Triton, 64-256 requests (H200)", f"{span(x['triton_gpu_us'] for x in sm)} µs GPU",
         f"vectorized torch on the same GPU, {span(x['torch_gpu_us'] for x in sm)} µs",
         f"{span((x['triton_gpu_us'] / x['torch_gpu_us'] for x in sm), '{:.2f}')}x"),
        ("`prepare_prompt`, 8 x 4096 rows (VM)", f"{_p50(b, 'prompt_8x4096', 'builder') / 1000:.2f} ms",
         "a per-token Python loop (the tests' reference)", f"{b['prompt_8x4096']['speedup']:.0f}x faster"),
        ("`prepare_for_mirror_cp`, 32768 rows, cp 2-8 (VM)", f"{span(_p50(m, 'builder') for m in mir)} µs",
         "a per-token Python loop", f"{span((m['speedup'] for m in mir), '{:.0f}')}x faster"),
    ]
    head = "| what | cpmeta | baseline a user would otherwise pick | ratio |\n|---|---|---|---|\n"
    return head + "".join(f"| {a} | {b_} | {c} | {d} |\n" for a, b_, c, d in rows)


def _cp(data: Any, method: str, world: int = 1) -> float:
    for r in data["results"]:
        if r["world"] == world and r["method"] == method:
            return float(r["p50_us"])
    raise KeyError(f"no {method} at world {world}")


def _readme_plain(folder: Path) -> str:
    p = run_of("build_plain.json", None, folder)["results"]
    return (f"Builds are {span((r['speedup'] for r in p.values()), '{:.1f}')}x faster on the plain config (VM, "
            f"same batches, `docs/benchmarks/build_plain.json`).\n")


def _readme_step(folder: Path) -> str:
    """README rows of this round's H200 run: the end-to-end step and the tensor-dict broadcast."""
    rid, _, d = run_entry("h200_step.json", STEP_FULL, folder)
    p50 = {(r["world"], r["workload"], r["strategy"]): r["p50_us"] for r in d["results"]}
    dec = [(w, wl) for w in (2, 4, 8) for wl in ("decode-64", "decode-256")]
    rep = span((p50[(w, wl, "replicate")] for w, wl in dec))
    mqr = span((p50[(w, wl, "mq-replicate")] for w, wl in dec))
    bca = span((p50[(w, wl, "broadcast")] for w, wl in dec))
    r_mq = span((p50[(w, wl, "replicate")] / p50[(w, wl, "mq-replicate")] for w, wl in dec), "{:.2f}")
    b_mq = span((p50[(w, wl, "broadcast")] / p50[(w, wl, "mq-broadcast")] for w, wl in dec), "{:.2f}")
    bid, _, bc = runs("h200_broadcast.json", folder)[-1]
    cells = [(w, p) for w in (2, 4, 8) for p in ("decode-64", "decode-256", "prompt-32k")]
    td = span((_bcast(bc, w, p, "cpmeta-tdict") / _bcast(bc, w, p, "tdict") for w, p in cells), "{:.2f}")
    tm = span((_bcast(bc, w, p, "cpmeta-tdict") / _bcast(bc, w, p, "mq") for w, p in cells), "{:.2f}")
    return ("\nThe step, end to end, and the drop-in tensor dict:\n\n| what | cpmeta | baseline a user would "
            "otherwise pick | ratio |\n|---|---|---|---|\n"
            f"| end-to-end decode step (driver's decision -> last rank holds its metadata), 64 / 256 seqs, "
            f"2-8 ranks (H200 host, {rid}) | broadcast {bca} µs; replicate {rep} µs | the field's design: "
            f"`MessageQueue` carries the pickled ops, every rank builds, {mqr} µs | broadcast "
            f"{b_mq}x `mq-broadcast`; replicate {r_mq}x `mq-replicate` (slower) |\n"
            f"| `broadcast_tensor_dict`, decode-64 / -256 / prompt-32k, 2-8 ranks (H200 host, {bid}) | "
            f"one frame per dict | vLLM's per-tensor `broadcast_tensor_dict` scheme; `MessageQueue` | "
            f"{td}x; {tm}x |\n")


#: The before / after run of h200_step.json that README's known gaps quote (its "before" twin: 4ac8a65)
GAPS_AFTER = "d1206c-plain.after"


def _readme_gaps(folder: Path) -> str:
    bc = run_of("h200_broadcast.json", "r5d", folder)
    dec = [(w, p) for w in (2, 4, 8) for p in ("decode-64", "decode-256")]
    ratio = span((_bcast(bc, w, p, "cpmeta+p") / _bcast(bc, w, p, "mq") for w, p in dec), "{:.2f}")
    n = run_of("h200_broadcast_nccl.json", "r5d", folder)
    floor = _bcast(n, 1, "decode-64", "cpmeta+p", None) / _bcast(n, 1, "decode-64", "floor", None)
    rid, run, data = run_entry("h200_step.json", GAPS_AFTER, folder)
    before = {(r["world"], r["workload"], r["strategy"]): r["p50_us"]
              for r in run_of("h200_step.json", GAPS_AFTER.replace("after", "before"), folder)["results"]}
    d64 = {r["strategy"]: r["p50_us"] for r in data["results"] if (r["world"], r["workload"]) == (8, "decode-64")}
    ours = min((s for s in d64 if not s.startswith("mq-")), key=lambda k: d64[k])
    return (f"- End to end (H200 host, {run['commit'][:7]}, plain config, run {rid}): decode-64 to 8 ranks "
            f"takes {d64[ours]:.0f} µs with cpmeta's best\n  (`{ours}`; {before[(8, 'decode-64', ours)]:.0f} µs at "
            f"the previous release, 4ac8a65, same run; issue 37's goal 300 µs) and {d64['mq-replicate']:.0f} µs as "
            f"`mq-replicate`\n  (vLLM's `MessageQueue` carrying the ops; goal: cpmeta at 0.5x it, now "
            f"{d64[ours] / d64['mq-replicate']:.2f}x) (docs/benchmarks.md, \"Before / after on the H200 host\").\n"
            f"- Speed goals not met ([docs/benchmarks.md](docs/benchmarks.md); run r5d, before the compiled path):\n"
            f"  steady-state decode broadcasts at {ratio}x `MessageQueue` (goal 0.35x) and {_bcast(bc, 8, 'decode-64', 'cpmeta+p'):.0f} µs to 8 "
            f"ranks (goal 150 µs); NCCL world 1\n  with `persistent_outputs` {floor:.2f}x one NCCL broadcast "
            "(goal 1.3x); the CP staged decode with\n  processes sharing one GPU (time slicing). H200 lends differ "
            "up to 2x in host speed.\n")


def _steady(folder: Path) -> str:
    d5, b5 = run_of("h200_broadcast.json", "r5d", folder), run_of("h200_broadcast.json", "r5b", folder)
    out = ["| world | payload | r5d cpmeta | r5d cpmeta+p | r5d mq | r5d cpmeta/mq | **r5d cpmeta+p/mq** | "
           "r5b cpmeta+p/mq |", "|---|---|---|---|---|---|---|---|"]
    for w in (2, 4, 8):
        for p in ("decode-64", "decode-256", "prompt-32k"):
            a, b_, m = (_bcast(d5, w, p, x) for x in ("cpmeta", "cpmeta+p", "mq"))
            r5b = _bcast(b5, w, p, "cpmeta+p") / _bcast(b5, w, p, "mq")
            out.append(f"| {w} | {p} | {a:.0f} µs | {b_:.0f} µs | {m:.0f} µs | {a / m:.2f} | **{b_ / m:.2f}** | "
                       f"{r5b:.2f} |")
    return "\n".join(out) + "\n"


def _sessions_table(folder: Path) -> str:
    st = dict(_sessions("h200_build_state.json", folder))
    sp = dict(_sessions("h200_inplace_step.json", folder))
    ip = dict(_sessions("h200_inplace.json", folder))
    cp = {i.split("-nccl1")[0]: d for i, d in _sessions("h200_decode_cp.json", folder) if "nccl1" in i}
    out = ["| run | `prepare_decode` from `BatchState` (x list) | with `OutputArenas` | in-place step d0 / d2 "
           "| eager + copy | CP step world 1 (broadcasting `prepare_decode`) |", "|---|---|---|---|---|---|"]
    for i in S23:
        if not any(i in t for t in (st, sp, ip, cp)):
            continue
        c = []
        s = st.get(i, {}).get("results", {}).get("state_decode_256_d0")
        c.append(f"{_p50(s, 'builder'):.0f} µs ({s['speedup_vs_list']:.1f}x)" if s else "-")
        c.append(f"{_p50(s, 'state_arena'):.0f} µs" if s and "state_arena" in s else "-")
        r = sp.get(i, {}).get("results")
        c.append(f"{_p50(r, 'decode_256_d0', 'step'):.0f} / {_p50(r, 'decode_256_d2', 'step'):.0f} µs" if r else "-")
        e = ip.get(i, {}).get("results")
        c.append(f"{_p50(e, 'decode_256_d0', 'eager_copy'):.0f} µs" if e else "-")
        k = cp.get(i)
        c.append(f"{_cp(k, 'staged_state'):.0f} µs ({_cp(k, 'bcast'):.0f})" if k else "-")
        out.append(f"| {i} | " + " | ".join(c) + " |")
    return "\n".join(out) + "\n"


def _plain_table(folder: Path) -> str:
    p = run_of("build_plain.json", None, folder)["results"]
    out = ["| case | plain p50 | seed p50 | seed / plain |", "|---|---|---|---|"]
    for k, r in p.items():
        out.append(f"| `{k.removeprefix('plain_vs_seed_')}` | {_p50(r, 'builder'):.0f} µs | {_p50(r, 'seed'):.0f} µs "
                   f"| {r['speedup']:.2f}x |")
        if "stage_decode" in r:  # the state path's in-place host fill, same batches
            out.append(f"| `stage_decode` host fill, same batch | {_p50(r, 'stage_decode'):.1f} µs | "
                       f"{_p50(r, 'stage_decode_seed'):.1f} µs | {1 / r['stage_decode_speedup']:.2f}x |")
    return "\n".join(out) + "\n"


def _builders_table(folder: Path) -> str:
    b = run_of("build.json", None, folder)["results"]
    out = ["| case (VM, one thread) | p50 | per-token reference | speed-up |", "|---|---|---|---|"]
    for k in ("decode_256_d0", "decode_256_d2", "prompt_8x4096", "prompt_256x128", "mirror_8x4096_cp2",
              "mirror_8x4096_cp4", "mirror_8x4096_cp8", "yoco_compact_8x4096"):
        r = b[k]
        out.append(f"| `{k}` | {_p50(r, 'builder'):.0f} µs | {_p50(r, 'reference'):.0f} µs | {r['speedup']:.0f}x |")
    return "\n".join(out) + "\n"


def _slot_table(folder: Path) -> str:
    rows = run_of("h200_slot_mapping.json", "r1", folder)["results"]
    out = ["| layout | requests | tokens | tile/warps | Triton gpu_us | torch gpu_us | Triton call_us | torch call_us "
           "| CPU torch call_us |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for x in rows:
        out.append(f"| {x['layout']} | {x['num_reqs']} | {x['num_tokens']} | {x['tile']}/{x['num_warps']} | "
                   f"{x['triton_gpu_us']:.1f} | {x['torch_gpu_us']:.1f} | {x['triton_call_us']:.0f} | "
                   f"{x['torch_call_us']:.0f} | {x['cpu_torch_call_us']:.0f} |")
    return "\n".join(out) + "\n"


def _headline(name: str, data: Any) -> str:
    """A few numbers of one run, for the history table ('-' where the run has none of them)."""
    try:
        if name in ("build.json", "h200_build.json") and "decode_256_d0" in data.get("results", {}):
            return f"decode 256 {_p50(data['results'], 'decode_256_d0', 'builder'):.0f} µs"
        if name in ("build_state.json", "h200_build_state.json"):
            s = data["results"]["state_decode_256_d0"]
            return f"state decode 256 {_p50(s, 'builder'):.0f} µs ({s['speedup_vs_list']:.1f}x list)"
        if name == "build_plain.json":
            return f"seed / plain {span((r['speedup'] for r in data['results'].values()), '{:.1f}')}x"
        if name == "h200_inplace.json":
            r = data["results"]["decode_256_d0"]
            return f"eager + copy {_p50(r, 'eager_copy'):.0f} µs, graph replay {_p50(r, 'graph_replay'):.1f} µs"
        if name == "h200_inplace_step.json":
            return f"step d0 {_p50(data['results'], 'decode_256_d0', 'step'):.0f} µs"
        if name == "h200_decode_cp.json":
            return ", ".join(f"w{r['world']} {r['method']} {r['p50_us']:.0f} µs" for r in data["results"])
        if name.startswith(("broadcast", "h200_broadcast")) and "results" in data:
            res = [r for r in data["results"] if r.get("payload") == "decode-64" and r.get("method") in ("cpmeta", "cpmeta+p")]
            return ", ".join(f"w{r['world']} {r['method']} {r['p50_us']:.0f} µs" for r in res[:3])
        if name == "h200_gpu_sharing.json":
            return ", ".join(f"{r['procs']} procs {r['p50_us']:.0f} µs" for r in data["results"] if r["method"] == "step")
        if name == "h200_cp_generate.json":
            return f"ok={data['ok']}, max logit diff {data['max_logit_diff']:.1e}"
    except (KeyError, TypeError, ValueError, IndexError):
        pass
    return "-"


def _history(folder: Path) -> str:
    out = ["| file | run | date | machine | commit | command | headline |", "|---|---|---|---|---|---|---|"]
    for f in sorted(folder.glob("*.json")):
        for i, run, data in runs(f.name, folder):
            cmd = str(run.get("command", "-")).replace("|", "\\|")
            cmd = cmd if len(cmd) <= 70 else cmd[:67] + "..."
            out.append(f"| {f.name} | {i} | {str(run.get('date', '-'))[:16]} | {run.get('host', '-')} | "
                       f"{str(run.get('commit') or '-')[:7]} | `{cmd}` | {_headline(f.name, data)} |")
    return "\n".join(out) + "\n"


#: Generated blocks: name -> (doc, text of the block from the folder).
#: the run of h200_step.json with every workload and strategy (the tables of r6a); later runs of
#: that file that measure a subset (r6b-defer: defer_apply) render in their own block
STEP_FULL = "r6a"
STEP_DEFER = "r6b-defer"


_PHASES = ("driver_apply", "driver_build", "send", "wake_recv", "apply", "build")


def _step_table(folder: Path, rid: str, strat: tuple[str, ...], extra: str,
                row_tail: Callable[[dict[str, dict[str, Any]]], str]) -> list[str]:
    """The lines of a step table of ``h200_step.json``'s run ``rid``: its run line, then per
    (world, workload) every strategy's p50 / p90 and ``row_tail(cells by strategy)`` under the
    ``extra`` column heads (``" | a | b"``)."""
    rid, run, d = run_entry("h200_step.json", rid, folder)
    cell: dict[tuple, dict[str, Any]] = {}
    for r in d["results"]:
        cell.setdefault((r["world"], r["workload"]), {})[r["strategy"]] = r
    out = [f"Run {rid} ({run['date']}, {run['host']}, commit {str(run['commit'])[:7]}): `{run['command']}`", "",
           "| world | workload | " + " | ".join(f"{s} p50 / p90" for s in strat) + extra + " |",
           "|---" * (2 + len(strat) + extra.count("|")) + "|"]
    order = {w: i for i, w in enumerate(("decode-64", "decode-256", "mixed", "prompt"))}
    for (w, wl), ms in sorted(cell.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 9))):
        row = [f"{ms[s]['p50_us']:.0f} / {ms[s]['p90_us']:.0f} µs" if s in ms else "-" for s in strat]
        out.append(f"| {w} | {wl} | " + " | ".join(row) + " | " + row_tail(ms) + " |")
    return out


def _phases(ms: dict[str, Any]) -> str:
    return ", ".join(f"{ms['phases_p50_us'][k]:.0f}" for k in _PHASES) + " µs"


def _step_defer_h200(folder: Path) -> str:
    """``defer_apply`` on the H200 host (run r6b-defer): p50 / p90 per strategy and its ratios."""
    def tail(ms: dict[str, dict[str, Any]]) -> str:
        p = {s: c["p50_us"] for s, c in ms.items()}
        return " | ".join(f"{p['replicate-defer'] / p[b]:.2f}" for b in ("replicate", "mq-replicate", "broadcast")) \
            + " | " + _phases(ms["replicate-defer"])

    out = _step_table(folder, STEP_DEFER, ("broadcast", "replicate", "replicate-defer", "mq-replicate"),
                      " | replicate-defer / replicate | replicate-defer / mq-replicate | replicate-defer / "
                      "broadcast | replicate-defer: phases p50 (driver record, driver build, send + own apply, "
                      "wake + receive, apply, build)", tail)
    return "\n".join(out) + "\n"


def _step_h200(folder: Path) -> str:
    """The end-to-end step on the H200 host (``h200_step.json``'s run r6a): p50 / p90 per
    strategy, the ratios, the best strategy's phases, the driver's cold step."""
    def tail(ms: dict[str, dict[str, Any]]) -> str:
        best = min(ms, key=lambda s: ms[s]["p50_us"])
        rr = ms["replicate"]["p50_us"] / ms["mq-replicate"]["p50_us"] if "mq-replicate" in ms else float("nan")
        rb = ms[best]["p50_us"] / ms["mq-broadcast"]["p50_us"] if "mq-broadcast" in ms else float("nan")
        return f"{rr:.2f} | {best} {rb:.2f} | " + _phases(ms[best])

    d = run_of("h200_step.json", STEP_FULL, folder)
    out = _step_table(folder, STEP_FULL, ("broadcast", "replicate", "mq-replicate", "mq-broadcast"),
                      " | replicate / mq-replicate | best / mq-broadcast | best: phases p50 (driver apply, "
                      "driver build, send, wake + receive, apply, build)", tail)
    out += ["", "Cold step on the driver (p50 apply / build): " + "; ".join(
        f"{c['workload']} back to back {c['back_to_back']['apply_p50_us']:.0f} / {c['back_to_back']['build_p50_us']:.0f} µs, "
        f"after 3 ms {c['gap_3ms']['apply_p50_us']:.0f} / {c['gap_3ms']['build_p50_us']:.0f} µs, after 30 ms "
        f"{c['gap_30ms']['apply_p50_us']:.0f} / {c['gap_30ms']['build_p50_us']:.0f} µs (warm-loop build "
        f"{c['warm_loop']['build_p50_us']:.0f} µs)" for c in d["cold"]) + "."]
    return "\n".join(out) + "\n"


BLOCKS: dict[str, tuple[Path, Callable[[Path], str]]] = {
    "step-h200": (DOCS[1], _step_h200),
    "step-defer-h200": (DOCS[1], _step_defer_h200),
    "readme-measured": (DOCS[0], _readme_measured),
    "readme-plain": (DOCS[0], _readme_plain),
    "readme-gaps": (DOCS[0], _readme_gaps),
    "readme-step": (DOCS[0], _readme_step),
    "steady-broadcast": (DOCS[1], _steady),
    "issue18-sessions": (DOCS[1], _sessions_table),
    "plain-vs-seed": (DOCS[1], _plain_table),
    "builders": (DOCS[1], _builders_table),
    "history": (DOCS[1], _history),
    "slot-mapping": (DOCS[2], _slot_table),
    "features-cost": (DOCS[3], _plain_table),
}


def render(text: str, doc: Path, folder: Path = BENCH) -> str:
    """``text`` (the contents of ``doc``) with each of its generated blocks rewritten from ``folder``."""
    for name, (where, make) in BLOCKS.items():
        if where != doc:
            continue
        pat = re.compile(rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end: {re.escape(name)} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"{doc.name}: no generated block {name!r}")
        block = make(folder)
        text = pat.sub(lambda m: m.group(1) + block + m.group(2), text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("out", type=Path)
    a.add_argument("--id", required=True, help="the run's id (e.g. the lend: r6a)")
    a.add_argument("--new", action="store_true", help="also start files for benchmarks not in docs/benchmarks/")
    r = sub.add_parser("render")
    r.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "add":
        print("added:", ", ".join(add(args.out, args.id, new=args.new)) or "nothing")
        return 0
    stale = []
    for doc in DOCS:
        old = doc.read_text()
        new = render(old, doc)
        if new != old:
            stale.append(doc.name)
            if not args.check:
                doc.write_text(new)
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "none"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
