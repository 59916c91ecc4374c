"""Which fields each feature adds (docs/design.md section 14, docs/features.md): a plain paged-KV config carries the
common fields only, and switching one feature on adds exactly its fields, on both paths, before
and after ``compute_attn_info``; every field named here is named in docs/features.md."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

import cpmeta
from strategies import random_decode_batch, random_prompt_batch

DOC = Path(__file__).resolve().parents[1] / "docs" / "features.md"

COMMON = {"is_prompt", "num_seqs", "total_q", "max_seqlen_q", "max_seqlen_k", "positions", "input_ids",
          "gate_force_random", "cu_seqlens_q", "cu_seqlens_k", "valid_token_mask", "query_indices"}
COMMON_PROMPT = COMMON | {"seq_block_tables"}
COMMON_DECODE = COMMON | {"context_lens", "block_tables"}
#: feature -> (config overrides turning it on, prompt fields it adds, decode fields it adds)
FEATURES: dict[str, tuple[dict[str, Any], set[str], set[str]]] = {
    "compressed KV": (
        {"dense_compress_ratios": (4,), "sparse_compress_ratios": (4, 8)},
        {"positions_c", "slot_mapping_store_ca", "cu_compressed_seqlens_q", "cu_compressed_seqlens_k",
         "load_segments_ca", "total_k_compressed", "ks", "ke", "kv_ca_index_offset_len", "kv_ca_index",
         "kv_ca_index_len"},
        {"positions_c", "slot_mapping_store_ca", "klen", "kv_ca_index_offset_len", "kv_ca_index", "kv_ca_index_len"},
    ),
    "sliding window": (
        {"window_size": 4, "swa_block_size": 8},
        {"slot_mapping_store_swa", "state_block_idx", "total_k_swa", "load_segments_swa",
         "kv_swa_full_index_pivots", "kv_swa_full_index"},
        {"slot_mapping_store_swa", "state_block_idx", "kv_swa_index_offset_len", "kv_swa_index"},
    ),
    "Engram": ({"max_ngram_size": 2}, {"ngram_token_ids"}, {"ngram_token_ids"}),
}
PLAIN = dict(block_size=16, max_model_len=256, window_size=0, dense_compress_ratios=(), sparse_compress_ratios=())


def _present(md: cpmeta.InputMetadata) -> set[str]:
    return {name for name in md.field_names() if getattr(md, name) is not None}


def _both(cfg: cpmeta.MetadataConfig, seed: int) -> tuple[set[str], set[str]]:
    """Fields present on a random prompt and decode batch, after ``compute_attn_info``."""
    rng = random.Random(seed)
    pre = cpmeta.prepare_prompt(random_prompt_batch(rng, cfg), cfg).compute_attn_info(cfg)
    dec = cpmeta.prepare_decode(random_decode_batch(rng, cfg), cfg).compute_attn_info(cfg)
    return _present(pre), _present(dec)


@pytest.mark.parametrize("seed", range(3))
def test_plain_config_carries_the_common_fields_only(seed: int) -> None:
    assert _both(cpmeta.MetadataConfig(**PLAIN), seed) == (COMMON_PROMPT, COMMON_DECODE)
    sharded = cpmeta.MetadataConfig(**PLAIN, kv_cp_world_size=3, kv_cp_interleave=4)  # adds no field
    assert _both(sharded, seed) == (COMMON_PROMPT, COMMON_DECODE)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_adds_exactly_its_fields(feature: str) -> None:
    on, prompt, decode = FEATURES[feature]
    cfg = cpmeta.MetadataConfig(**{**PLAIN, **on})
    assert _both(cfg, 7) == (COMMON_PROMPT | prompt, COMMON_DECODE | decode)


def test_all_features_together_is_the_union() -> None:
    on = {k: v for o, _, _ in FEATURES.values() for k, v in o.items()}
    cfg = cpmeta.MetadataConfig(**{**PLAIN, **on})
    assert _both(cfg, 3) == (COMMON_PROMPT.union(*(p for _, p, _ in FEATURES.values())),
                             COMMON_DECODE.union(*(d for _, _, d in FEATURES.values())))


def test_docs_name_every_field() -> None:
    text = DOC.read_text()
    named = set(re.findall(r"`([a-z_0-9]+)`", text))
    fields = COMMON_PROMPT | COMMON_DECODE
    for _, p, d in FEATURES.values():
        fields |= p | d
    assert fields <= named, sorted(fields - named)
    assert fields <= set(cpmeta.InputMetadata.field_names())


@pytest.mark.parametrize("world,inter,ratios", [(1, 1, ()), (3, 1, ()), (2, 16, ()), (4, 2, ()), (1, 4, ()),
                                                (1, 1, (4,)), (1, 1, (2, 16))])
def test_torch_block_rule_equals_blocks_needed(world: int, inter: int, ratios: tuple[int, ...]) -> None:
    """``blocks_needed_tensor`` (metadata_diff, the in-place decode's emulation) is
    ``cpmeta.blocks_needed`` for every ``seqlen_k`` up to ``max_model_len``."""
    import torch

    from cpmeta.config import blocks_needed_tensor

    cfg = cpmeta.MetadataConfig(block_size=16, window_size=0, dense_compress_ratios=ratios, sparse_compress_ratios=(),
                                max_model_len=300, kv_cp_world_size=world, kv_cp_interleave=inter)
    k = torch.arange(cfg.max_model_len + 1)
    assert blocks_needed_tensor(k, cfg).tolist() == [cpmeta.blocks_needed(int(x), cfg) for x in k]
