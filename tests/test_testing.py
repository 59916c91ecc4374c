"""``cpmeta.testing``: its docstring example runs as written; ``assert_same`` and
``assert_same_on_ranks`` name the rank, the field and the first differing index."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import cpmeta.testing
from cpmeta import MetadataConfig, SequenceMetadata, prepare_prompt
from cpmeta.testing import RankFailure, assert_same, run_ranks

pytestmark = pytest.mark.timeout(240)


def _docstring_example() -> str:
    """The module docstring's code block (the lines after ``::``, dedented by four spaces)."""
    doc = cpmeta.testing.__doc__
    assert doc is not None
    block = doc.split("::\n", 1)[1].split("\n\nWhen a rank", 1)[0]
    return "\n".join(line[4:] for line in block.splitlines()) + "\n"


def test_docstring_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example is written to a file and imported like a test module (spawned ranks import it
    by name through the parent's ``sys.path``), then its test runs, plus the rank function on 2 ranks."""
    (tmp_path / "example_equivalence.py").write_text(_docstring_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("example_equivalence")
    try:
        mod.test_every_rank_holds_the_drivers_metadata()
        assert run_ranks(mod._step, 2, 7) == [6, 6]
    finally:
        sys.modules.pop("example_equivalence", None)


def _md(seqlen: int = 20):
    seqs = [SequenceMetadata(seqlen_q=seqlen, seqlen_k=seqlen, block_table=[7, 3], state_id=0,
                             token_ids=list(range(seqlen)))]
    return prepare_prompt(seqs, MetadataConfig())


def test_assert_same_names_field_and_first_index() -> None:
    a, b = _md(), _md()
    assert_same(a, b)  # two builds of one batch: bit-identical
    b.positions[4] = 99
    with pytest.raises(AssertionError, match=re.escape(
            "'positions' differs from expected: 1 of 20 elements, first at index (4,): 4 here, "
            "99 on expected")):
        assert_same(a, b)
    with pytest.raises(AssertionError, match=re.escape("'x' missing here")):
        assert_same({"y": 1}, {"x": 1, "y": 1})
    with pytest.raises(AssertionError, match=re.escape("'k.3' not in expected")):
        assert_same({"k": {3: torch.zeros(2)}}, {"k": {}})
    with pytest.raises(AssertionError, match=re.escape("torch.int32(2,) here, torch.int64(2,) on expected")):
        assert_same({"t": torch.zeros(2, dtype=torch.int32)}, {"t": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(AssertionError, match=re.escape("first at index (1, 0): -0.0 here, 0.0")):
        assert_same([torch.zeros(2, 2).index_fill(0, torch.tensor([1]), -0.0)], [torch.zeros(2, 2)])
    with pytest.raises(TypeError, match=r"^m\.0: a sparse_coo tensor has no bytes to compare"):
        assert_same({"m": [torch.eye(2).to_sparse()]}, {"m": [torch.eye(2)]})  # (was torch's copy error)
    t = torch.arange(3)
    with pytest.raises(AssertionError, match=re.escape("'<aliasing>' differs")):
        assert_same({"a": t, "b": t}, {"a": t.clone(), "b": t.clone()})


def _scenarios(rank: int, world_size: int) -> list[str]:
    """Each case on every rank: the message it raised ('' when it passed)."""
    import torch.distributed as dist

    from cpmeta.testing import assert_same_on_ranks

    sub = dist.new_group([1, 2])  # collective: every rank creates it, ranks 1 and 2 are in it
    p = torch.arange(20, dtype=torch.int32)
    cases = [
        lambda: assert_same_on_ranks(_md()),  # every rank built the same metadata
        lambda: assert_same_on_ranks({"pos": p.index_fill(0, torch.tensor([2]), 9) if rank == 1 else p}),
        lambda: assert_same_on_ranks({"pos": p, **({} if rank == 0 else {"n": 1}),
                                      **({"extra": 1} if rank == 2 else {})}, src=1),
        lambda: assert_same_on_ranks({"n": rank == 2, "t": p.long() if rank == 1 else p}),
        # a tensor without bytes on one rank: every rank raises (none left in a collective)
        lambda: assert_same_on_ranks({"pos": p.to_sparse() if rank == 1 else p}),
    ]
    if rank in (1, 2):  # the subgroup's rank 1 (global rank 2) is the reference
        cases.append(lambda: assert_same_on_ranks([p + (rank == 1)], src=1, group=sub))
    out = []
    for case in cases:
        try:
            case()
            out.append("")
        except (AssertionError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}" if isinstance(e, TypeError) else str(e))
    return out


def test_assert_same_on_ranks_same_message_on_every_rank() -> None:
    res = run_ranks(_scenarios, 3)
    for case in range(5):
        assert res[0][case] == res[1][case] == res[2][case], case
    assert res[1][5] == res[2][5]
    ok, tampered, keys, kinds, sparse, sub = res[1]
    assert sparse == ("TypeError: rank 1: pos: a sparse_coo tensor has no bytes to compare (dense tensors with "
                      "data only)")
    assert ok == ""
    assert tampered == ("rank 1: 'pos' differs from rank 0's: 1 of 20 elements, first at index (2,): "
                        "9 here, 2 on rank 0")
    assert keys == "rank 0: 'n' missing here (rank 1 has it); rank 2: 'extra' not on rank 1"
    assert kinds == ("rank 1: 't' differs from rank 0's: torch.int64(20,) here, torch.int32(20,) on rank 0; "
                     "rank 2: 'n' differs from rank 0's: True here, False on rank 0")
    assert sub == "rank 0: '0' differs from rank 1's: 20 of 20 elements, first at index (0,): 1 here, 0 on rank 1"


def _diverge(rank: int, world_size: int) -> None:
    from cpmeta.testing import assert_same_on_ranks

    assert_same_on_ranks({"slot_mapping": torch.tensor([5, 6, 7 + rank])})


def test_run_ranks_reports_every_ranks_failure() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_diverge, 2, timeout=60)
    text = str(info.value)
    assert "--- rank 0 FAILED ---" in text and "--- rank 1 FAILED ---" in text
    assert text.count("rank 1: 'slot_mapping' differs from rank 0's: 1 of 3 elements, first at index (2,): "
                      "8 here, 7 on rank 0") == 2
    assert "seed=" in text


@pytest.mark.parametrize("kw,err", [
    ({"world_size": True}, "TypeError: world_size: expected an int, got True"),  # (started one rank that failed)
    ({"world_size": 2.0}, "TypeError: world_size: expected an int, got 2.0"),
    ({"world_size": 0}, "ValueError: world_size: expected >= 1, got 0"),
    ({"world_size": 2, "timeout": 0}, "ValueError: timeout: expected a finite number of seconds > 0, got 0"),
    ({"world_size": 2, "timeout": float("nan")},
     "ValueError: timeout: expected a finite number of seconds > 0, got nan"),
    ({"world_size": 2, "backend": "mpi"}, "ValueError: backend: expected 'gloo' or 'nccl', got 'mpi'"),
])
def test_bad_arguments_are_refused_before_any_rank_starts(kw: dict, err: str) -> None:
    """(Each of these started the ranks and ended in a rank failure or the deadline, naming nothing.)"""
    with pytest.raises((TypeError, ValueError)) as info:
        run_ranks(_diverge, kw.pop("world_size"), **kw)
    assert f"{info.type.__name__}: {info.value}" == err


def _env_probe(rank: int, world_size: int) -> tuple:
    import os

    import torch as _torch

    return (os.environ.get("CPMETA_PROBE"), os.environ["RANK"], os.environ["OMP_NUM_THREADS"],
            _torch.get_num_threads(), os.getppid() != 1)


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_see_the_test_processs_environment_as_it_is_now(start: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked rank takes over the test process's environment of the moment (not the one the
    fork server started with): a variable set, then removed, is seen, then gone; ``RANK`` and
    ``OMP_NUM_THREADS=1`` are the rank's, torch runs one thread. The spawn path alike."""
    monkeypatch.setenv("CPMETA_TEST_START", start)
    monkeypatch.setenv("CPMETA_PROBE", "set")
    assert run_ranks(_env_probe, 2, init=False) == [("set", "0", "1", 1, True), ("set", "1", "1", 1, True)]
    monkeypatch.delenv("CPMETA_PROBE")
    assert run_ranks(_env_probe, 2, init=False) == [(None, "0", "1", 1, True), (None, "1", "1", 1, True)]
