"""Numbers in README and docs agree with the JSON they come from (STYLE 23).

- Every generated block (README's "Measured" table, its plain-config line and speed gaps; the tables
  and the History of docs/benchmarks.md) equals what ``scripts/bench_results.py`` renders from
  ``docs/benchmarks/`` now: a number changed by hand, or a JSON replaced without ``render``, fails.
- Every measured number (``µs`` / ``us`` / ``ms`` / ``Nx``) elsewhere in these docs sits in a
  generated block or under a heading that says "historical" (written then, its runs listed in the
  History table); README's environment and reliability sections cite the doc they come from
  (docs/transport.md, docs/reliability.md, whose own numbers are not benchmark files).
- The known disagreements stay fixed: the mirror row is build.json's, no H200 run says
  ``"host": "vm"``, every benchmark file carries a run block, the folder stays small.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_results  # noqa: E402

OWNED = ["README.md", "docs/benchmarks.md", "docs/build.md", "docs/decode_inplace.md", "docs/slot_mapping.md",
         "docs/features.md", "docs/attention_check.md"]
MEASURED = re.compile(r"\d[\d.,]*\s?(µs|us|ms)\b|\b\d+(\.\d+)?x\b")
CITED = ("docs/transport.md", "docs/reliability.md")
#: Sections whose numbers are checked by their owner's test instead, with the reason.
EXEMPT = {"## End-to-end step (2026-12-01)": "bench_step.py's section (issue 30), numbers from docs/benchmarks/step.json",
          "## Which one do I use?": "checked against h200_step_compare.json / h200_wire.json (test_compare_sections_match_their_json)",
          "## Before / after the compiled path (2026-12-03)": "checked against h200_step_compare.json (same test)"}
#: Sections whose µs numbers must each be a p50 (rounded) of ``docs/benchmarks/h200_step_compare.json``.
COMPARE = {"README.md": "## Which one do I use?",
           "docs/benchmarks.md": "## Before / after the compiled path (2026-12-03)"}


@pytest.mark.parametrize("doc", bench_results.DOCS, ids=lambda p: p.name)
def test_generated_blocks_are_current(doc: Path) -> None:
    text = doc.read_text()
    fresh = bench_results.render(text, doc)
    if fresh != text:
        diff = [f"- {a}\n+ {b}" for a, b in zip(text.splitlines(), fresh.splitlines()) if a != b]
        pytest.fail(f"{doc.name}: generated numbers differ from docs/benchmarks/ "
                    f"(python scripts/bench_results.py render):\n" + "\n".join(diff[:12]))


def _sections(text: str) -> list[tuple[list[str], list[str]]]:
    """(heading stack, lines outside generated blocks and code fences) per section."""
    out: list[tuple[list[str], list[str]]] = [([], [])]
    stack: list[tuple[int, str]] = []
    block = fence = False
    for ln in text.splitlines():
        if ln.startswith("```"):
            fence = not fence
        if ln.startswith("<!-- generated:"):
            block = True
        elif ln.startswith("<!-- end:"):
            block = False
        elif not block and not fence and re.match(r"#{1,6} ", ln):
            level = len(ln) - len(ln.lstrip("#"))
            stack = [(lv, h) for lv, h in stack if lv < level] + [(level, ln)]
            out.append(([h for _, h in stack], []))
        elif not block:
            out[-1][1].append(ln)
    return out


@pytest.mark.parametrize("doc", OWNED)
def test_measured_numbers_are_generated_or_historical(doc: str) -> None:
    bad = []
    for heads, lines in _sections((ROOT / doc).read_text()):
        if any("historical" in h.lower() or h in EXEMPT for h in heads):
            continue
        body = "\n".join(lines)
        if doc == "README.md" and any(c in body for c in CITED):
            continue
        bad += [f"{heads[-1] if heads else '(top)'}: {ln.strip()[:100]}" for ln in lines if MEASURED.search(ln)]
    assert not bad, f"{doc}: measured numbers neither generated nor marked historical:\n" + "\n".join(bad[:15])


def test_known_disagreements_stay_fixed() -> None:
    readme = (ROOT / "README.md").read_text()
    build = bench_results.run_of("build.json")["results"]
    lo = min(build[f"mirror_8x4096_cp{p}"]["builder"]["p50_us"] for p in (2, 4, 8))
    assert f"| {lo:.0f}-" in readme and "359-470" not in readme and "119-361x" not in readme
    for f in sorted((ROOT / "docs" / "benchmarks").glob("*.json")):
        text = f.read_text()
        assert '"host": "vm"' not in text, f"{f.name}: a host label that is a hostname"
        for rid, run, _ in bench_results.runs(f.name):
            assert {"command", "date", "host", "machine", "commit"} <= set(run), (f.name, rid)
    files = [p for p in (ROOT / "docs" / "benchmarks").rglob("*") if p.is_file()]
    assert len(files) <= 30 and not any(p.suffix in (".log", ".txt") for p in files), sorted(map(str, files))


def test_add_folds_a_session_into_its_file(tmp_path: Path) -> None:
    """``bench_results.py add``: a session's result becomes the new current run of its H200 file."""
    folder, out = tmp_path / "bench", tmp_path / "out"
    folder.mkdir()
    out.mkdir()
    (folder / "h200_x.json").write_text(json.dumps({"benchmark": "h200_x", "about": "", "current": "a", "runs": [
        {"id": "a", "artifact": "-", "run": {"command": "c", "date": "d", "host": "h", "machine": {}, "commit": "1"},
         "data": {"results": {"v": 1}}}]}))
    (out / "h200_x.json").write_text(json.dumps({"run": {"command": "c2", "date": "d2", "host": "h", "machine": {},
                                                         "commit": "2"}, "results": {"v": 2}}))
    (out / "h200_x.gloo.json").write_text((out / "h200_x.json").read_text())
    (out / "h200_new.json").write_text((out / "h200_x.json").read_text())  # no such benchmark file: left out
    (out / "notes.json").write_text(json.dumps({"no": "run block"}))
    assert bench_results.add(out, "b", folder) == ["h200_x.gloo.json", "h200_x.json"]
    assert [r[0] for r in bench_results.runs("h200_x.json", folder)] == ["a", "b-gloo", "b"]
    assert bench_results.run_of("h200_x.json", folder=folder) == {"results": {"v": 2}}
    with pytest.raises(ValueError, match="exists already"):
        bench_results.add(out, "b", folder)


def test_compare_sections_match_their_json() -> None:
    """The before / after numbers (README's "Which one do I use?", benchmarks.md's section) are
    p50s of the one device session in ``h200_step_compare.json`` or, for README's later lends,
    of a run in ``h200_wire.json`` / ``h200_step.json``, rounded to the µs."""
    doc = json.loads((ROOT / "docs" / "benchmarks" / "h200_step_compare.json").read_text())
    known = {round(r["p50_us"]) for v in ("before", "after") for m in doc[v].values() for r in m["results"]}
    wire = {round(r["p50_us"]) for f in ("h200_wire.json", "h200_step.json") for _, _, d in bench_results.runs(f)
            for r in (d.get("results") or []) if isinstance(r, dict) and "p50_us" in r}
    for name, head in COMPARE.items():
        found = [lines for heads, lines in _sections((ROOT / name).read_text()) if heads and heads[-1] == head]
        assert found, f"{name}: no section {head!r}"
        nums = {int(x.replace(",", "")) for ln in found[0] for x in re.findall(r"(\d[\d,]*) µs", ln)}
        assert nums, f"{name} {head}: no µs numbers"
        allowed = known | wire if name == "README.md" else known
        assert nums <= allowed, f"{name} {head}: {sorted(nums - allowed)} are not p50s of h200_step_compare.json" \
            + (" or h200_wire.json / h200_step.json" if name == "README.md" else "")
