"""The top-level API: at most twelve names, one job each, every name documented, typed for checkers.

Rule (``cpmeta/__init__.py``): ``__all__`` is the front door (the README's "Which one do I use?"
table names each); everything else lives in its room (``cpmeta.gpu``, ``cpmeta.cp``, ...). The
names the design contract calls as ``cpmeta.<name>`` stay attributes, the same objects as their
room's.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import cpmeta

ROOT = Path(__file__).resolve().parents[1]

#: The in-place decode API an engine drives (docs/design.md section 12), in its room.
IN_PLACE_DECODE = ("prepare_decode_inplace", "launch_decode_inplace", "capture_decode_graph",
                   "DecodeStaging", "staging_capacity", "stage_decode", "StagedDecodeBroadcaster")

#: Names the design contract calls as ``cpmeta.<name>`` (attributes, not all in ``__all__``).
CONTRACT = ("MetadataConfig", "SequenceMetadata", "InputMetadata", "prepare_prompt", "prepare_decode",
            "compute_attn_info", "MetadataBroadcaster", "prepare_cp_mirror", "prepare_for_mirror_cp",
            "SequenceBatch", "BatchState", "blocks_needed", "cp_kv_read_plan", "mirror_rows", "unmirror",
            "ReplicatedBatchState", "broadcast_tensor_dict", "compute_slot_mapping", "cp_local_seqlens",
            "prepare_decode_inplace", "get_or_create_tensor", "get_or_create_stacked")


def test_every_exported_name_resolves_and_is_documented() -> None:
    for name in cpmeta.__all__:
        obj = getattr(cpmeta, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj) or ""
            assert len(doc) >= 60, f"cpmeta.{name}: expected a docstring, got {doc!r}"
    assert sorted(cpmeta.__all__) == dir(cpmeta)


def test_internals_are_not_exported() -> None:
    assert "INT32_MAX" not in cpmeta.__all__
    assert not [n for n in cpmeta.__all__ if n.startswith("_")]
    assert len(cpmeta.__all__) <= 12, cpmeta.__all__


def test_in_place_decode_api_lives_in_the_gpu_room() -> None:
    import cpmeta.gpu as gpu

    for name in IN_PLACE_DECODE:
        assert name in gpu.__all__, name
    assert cpmeta.prepare_decode_inplace is gpu.prepare_decode_inplace


def test_contract_names_resolve_to_their_rooms_objects() -> None:
    import importlib

    for name in CONTRACT:
        obj = getattr(cpmeta, name)
        mod = importlib.import_module(obj.__module__)
        assert getattr(mod, name) is obj, name


def test_prepare_dispatches_on_the_batch() -> None:
    import pytest

    cfg = cpmeta.MetadataConfig(block_size=16, max_model_len=256, dense_compress_ratios=(),
                                sparse_compress_ratios=(), window_size=0)
    seq = cpmeta.SequenceMetadata(seqlen_q=3, seqlen_k=3, block_table=[2], state_id=0, token_ids=[5, 6, 7])
    got = cpmeta.prepare([seq], cfg, is_prompt=True)
    assert got.is_prompt and got.positions.tolist() == [0, 1, 2]
    batch = cpmeta.SequenceBatch.from_sequences([seq], cfg, is_prompt=True)
    assert cpmeta.prepare(batch, cfg).is_prompt
    both = cpmeta.prepare((batch, batch), cfg)
    assert isinstance(both, tuple) and len(both) == 2
    with pytest.raises(ValueError, match="is_prompt: required"):
        cpmeta.prepare([seq], cfg)
    with pytest.raises(ValueError, match="is_prompt=False but the SequenceBatch is a prompt batch"):
        cpmeta.prepare(batch, cfg, is_prompt=False)


def test_type_checkers_see_every_lazy_name() -> None:
    """A lazily imported name is also imported under ``TYPE_CHECKING`` (STYLE 20: a module
    ``__getattr__`` alone hides it behind ``Any``)."""
    tree = ast.parse((ROOT / "cpmeta" / "__init__.py").read_text())
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in ast.walk(node):
                if isinstance(imp, ast.ImportFrom):
                    typed.update(a.asname or a.name for a in imp.names)
    lazy = set(cpmeta._LAZY)  # type: ignore[attr-defined]  # the private table of lazy names
    assert lazy <= typed, sorted(lazy - typed)
