"""A real HuggingFace Llama under CP from cpmeta's broadcast alone equals the model in one process.

Runs ``scripts/cp_generate.py``'s engine loop (``run_rank``) on real gloo processes at CP 1 (through
the example's ``launch``, as its command line does), 2 and 3, float64: the plain config with KV interleaved over the group (interleave 1 and = block
size 16), and the seed's compressed config (KV replicated) at CP 2. Chunked prompts (46, 62, 38
tokens in chunks of 32: the second chunk reads its history back from the paged cache through
``cp_kv_read_plan``), a placeholder sequence in every step, 4 greedy tokens per request (the
46- or 62-token request's table grows by a block during decode at every CP size). Every
row's logits must be within 1e-9 of the single-process model's, and the tokens equal its
``generate(do_sample=False)``. One process group per world size runs all its cases; one case
(CP 3) replicates the step instead (``--strategy replicate``: every rank builds its metadata
from its own ``ReplicatedBatchState``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import cp_generate  # noqa: E402
from multiproc import run_ranks  # noqa: E402

CASES: dict[int, list[cp_generate.GenOptions]] = {
    1: [cp_generate.GenOptions(cp=1)],
    2: [cp_generate.GenOptions(cp=2, interleave=1), cp_generate.GenOptions(cp=2, interleave=16),
        cp_generate.GenOptions(cp=2, config="seed")],
    3: [cp_generate.GenOptions(cp=3, interleave=1), cp_generate.GenOptions(cp=3, interleave=16),
        # every rank builds from its own replicated BatchState: nothing but the step is moved
        cp_generate.GenOptions(cp=3, interleave=4, strategy="replicate")],
}


def _run_cases(rank: int, world: int, cases: list[cp_generate.GenOptions]) -> list[Any]:
    """Every rank: the example's engine loop once per case (rank 0 returns the reports)."""
    return [cp_generate.run_rank(rank, world, o) for o in cases]


@pytest.mark.parametrize("world", sorted(CASES))
def test_real_llama_matches_single_process(world: int) -> None:
    if world == 1:  # through the example's own entry, as its command line runs it
        reports = [cp_generate.launch(o) for o in CASES[world]]
    else:
        reports = run_ranks(_run_cases, world, CASES[world], timeout=240)[0]
    for o, r in zip(CASES[world], reports):
        case = f"cp={o.cp} interleave={o.interleave} config={o.config} strategy={o.strategy}"
        assert r["max_logit_diff"] <= 1e-9, f"{case}: max |logit diff| {r['max_logit_diff']}"
        assert r["tokens"] == r["generate_tokens"], f"{case}: {r['tokens']} != {r['generate_tokens']}"
        assert r["ok"], case
        assert all(len(t) == o.new_tokens for t in r["tokens"]), case


def test_the_example_needs_nothing_from_tests() -> None:
    """``cp_generate.py`` runs from an installed wheel: its ranks start through ``cpmeta.testing``."""
    tree = ast.parse((ROOT / "scripts" / "cp_generate.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "multiproc" not in imported and not any(m.startswith("tests") for m in imported), imported
    assert "cpmeta.testing" in imported, imported
    assert not [s for s in ast.walk(tree) if isinstance(s, ast.Constant) and s.value == "tests"]
