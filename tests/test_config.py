"""``MetadataConfig``: defaults (a plain paged-KV model), the ``compressed_swa`` preset, derived
properties and every bad input (docs/design.md section 3)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from cpmeta import MetadataConfig
from cpmeta.constants import PAD_SLOT_ID, PLACEHOLDER_QUERY_INDEX
from cpmeta.constants import INT32_MAX
from strategies import configs

PLAIN = dict(dense_compress_ratios=(), sparse_compress_ratios=(), window_size=0)


def test_defaults_are_a_plain_paged_kv_model() -> None:
    cfg = MetadataConfig()
    assert (cfg.block_size, cfg.window_size, cfg.max_model_len) == (16, 0, 8192)
    assert cfg.dense_compress_ratios == () and cfg.sparse_compress_ratios == ()
    assert (cfg.has_compressed_kv, cfg.has_swa, cfg.has_engram, cfg.has_yoco, cfg.kv_sharded) == (
        False, False, False, False, False)
    assert cfg.min_ratio == 1 and cfg.max_num_blocks == 512  # cdiv(8192, 16)
    assert cfg == MetadataConfig(block_size=16, max_model_len=8192, **PLAIN)


def test_compressed_swa_preset_matches_design_table() -> None:
    cfg = MetadataConfig.compressed_swa()
    assert (cfg.block_size, cfg.window_size, cfg.swa_block_size) == (128, 128, 128)
    assert cfg.dense_compress_ratios == (4,) and cfg.sparse_compress_ratios == (4,)
    assert cfg.max_model_len == 8192
    assert (cfg.max_ngram_size, cfg.ngram_pad_token, cfg.ngram_lookup, cfg.image_token_id) == (0, 0, None, None)
    assert cfg.force_load_balance is False
    assert cfg.yoco_keep_tokens is None and cfg.yoco_mode == "compact"
    # overrides replace the preset's values or set other fields; a bad one names the field
    assert MetadataConfig.compressed_swa(block_size=64, max_ngram_size=3) == MetadataConfig(
        block_size=64, window_size=128, swa_block_size=128, dense_compress_ratios=(4,),
        sparse_compress_ratios=(4,), max_ngram_size=3)
    with pytest.raises(ValueError, match="block_size 6"):
        MetadataConfig.compressed_swa(block_size=6)


def test_named_constants() -> None:
    assert PAD_SLOT_ID == -1
    assert PLACEHOLDER_QUERY_INDEX == 998244353
    assert INT32_MAX == 2**31 - 1


def test_ca_ratios_is_the_sorted_union() -> None:
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=[128, 4], sparse_compress_ratios=(8, 4))
    assert cfg.dense_compress_ratios == (128, 4)  # lists become tuples, order kept
    assert cfg.ca_ratios == (4, 8, 128)
    assert cfg.min_ratio == 4
    only_sparse = MetadataConfig.compressed_swa(dense_compress_ratios=(), sparse_compress_ratios=(16,))
    assert only_sparse.ca_ratios == (16,) and only_sparse.min_ratio == 16


def test_derived_widths() -> None:
    # compressed_swa(): max_num_blocks = cdiv(8192 // 4, 128 // 4) = 64; width_4 = cdiv(2048, 128) * 128.
    cfg = MetadataConfig.compressed_swa()
    assert cfg.max_num_blocks == 64
    assert cfg.attn_index_width(4) == 2048
    # bs 16, min ratio 16, max_model_len 100: cdiv(100 // 16, 1) = 6 blocks; width cdiv(6, 128)*128.
    small = MetadataConfig(block_size=16, max_model_len=100, dense_compress_ratios=(16,),
                           sparse_compress_ratios=(), window_size=4, swa_block_size=4)
    assert small.max_num_blocks == 6
    assert small.attn_index_width(16) == 128
    # ratio 1, 1000 tokens: width cdiv(1000, 128) * 128 = 1024.
    assert MetadataConfig.compressed_swa(dense_compress_ratios=(1,), max_model_len=1000).attn_index_width(1) == 1024


def test_plain_model_switches_every_feature_off() -> None:
    """docs/design.md section 14: a plain paged-KV model; the rules that use the smallest ratio use 1."""
    cfg = MetadataConfig(block_size=16, max_model_len=4096, **PLAIN)
    assert cfg.ca_ratios == () and cfg.min_ratio == 1
    assert (cfg.has_compressed_kv, cfg.has_swa, cfg.has_engram, cfg.has_yoco, cfg.kv_sharded) == (
        False, False, False, False, False)
    assert cfg.max_num_blocks == 256  # cdiv(4096, 16)
    assert MetadataConfig(block_size=16, max_model_len=4097, **PLAIN).max_num_blocks == 257
    seed = MetadataConfig.compressed_swa(max_ngram_size=2, yoco_keep_tokens=8)
    assert (seed.has_compressed_kv, seed.has_swa, seed.has_engram, seed.has_yoco) == (True, True, True, True)
    # SWA without compressed KV, and compressed KV without SWA, are both valid configs
    assert MetadataConfig.compressed_swa(dense_compress_ratios=(), sparse_compress_ratios=(), window_size=8).has_swa
    assert not MetadataConfig.compressed_swa(window_size=0).has_swa


def test_kv_sharding_fields() -> None:
    cfg = MetadataConfig.compressed_swa()
    assert (cfg.kv_cp_world_size, cfg.kv_cp_interleave) == (1, 1)
    # W=3, I=1, block 16, 300 tokens: rank 0 holds 100 -> 7 blocks wide decode tables
    sharded = MetadataConfig(block_size=16, max_model_len=300, kv_cp_world_size=3, **PLAIN)
    assert sharded.kv_sharded and sharded.max_num_blocks == 7
    # W=2, I=16: 300 = 9 full cycles of 32 (16 each) + 12 -> rank 0 holds 144 + 12 = 156 -> 10 blocks
    inter = MetadataConfig(block_size=16, max_model_len=300, kv_cp_world_size=2, kv_cp_interleave=16, **PLAIN)
    assert inter.max_num_blocks == 10
    MetadataConfig.compressed_swa(kv_cp_interleave=128)  # divides block_size; unsharded compressed is fine
    with pytest.raises(ValueError, match="until defined"):
        MetadataConfig.compressed_swa(kv_cp_world_size=2)


def test_frozen() -> None:
    cfg = MetadataConfig.compressed_swa()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 64  # type: ignore[misc]


def test_valid_edge_values() -> None:
    MetadataConfig.compressed_swa(window_size=128, swa_block_size=128)  # S == W is allowed
    MetadataConfig.compressed_swa(dense_compress_ratios=(4,), sparse_compress_ratios=())  # one side empty
    MetadataConfig.compressed_swa(dense_compress_ratios=(1, 128), sparse_compress_ratios=(4,))  # ratio == block_size
    MetadataConfig.compressed_swa(yoco_keep_tokens=1, yoco_mode="mask")
    MetadataConfig.compressed_swa(max_ngram_size=3, ngram_lookup=torch.arange(10), image_token_id=7)


# (overrides, field the message must name); every one is a ValueError.
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 0}, "block_size"),
    ({"block_size": -128}, "block_size"),
    ({"window_size": -1}, "window_size"),
    ({"swa_block_size": 0}, "swa_block_size"),
    ({"window_size": 128, "swa_block_size": 64}, "swa_block_size"),  # S < W
    ({"max_model_len": 0}, "max_model_len"),
    ({"dense_compress_ratios": (3,)}, "dense_compress_ratios"),  # 3 does not divide 128
    ({"sparse_compress_ratios": (256,)}, "sparse_compress_ratios"),  # larger than the block
    ({"block_size": 96, "dense_compress_ratios": (4, 64), "sparse_compress_ratios": ()}, "dense_compress_ratios"),
    ({"kv_cp_world_size": 0}, "kv_cp_world_size"),
    ({"kv_cp_interleave": 0}, "kv_cp_interleave"),
    ({"kv_cp_interleave": 3}, "kv_cp_interleave"),  # does not divide block_size 128
    ({"kv_cp_world_size": 2}, "kv_cp_world_size"),  # compressed KV sharded: not defined yet
    ({"window_size": 0, "swa_block_size": 128, "yoco_keep_tokens": 4}, "window_size"),  # YoCo needs SWA
    ({"dense_compress_ratios": (4, 4)}, "dense_compress_ratios"),  # listed twice
    ({"sparse_compress_ratios": (8, 4, 8)}, "sparse_compress_ratios"),
    ({"dense_compress_ratios": (0,)}, "dense_compress_ratios"),
    ({"sparse_compress_ratios": (-4,)}, "sparse_compress_ratios"),
    ({"max_ngram_size": -1}, "max_ngram_size"),
    ({"ngram_lookup": torch.zeros(3, 3, dtype=torch.int64)}, "ngram_lookup"),  # 2-D
    ({"ngram_lookup": torch.zeros(3)}, "ngram_lookup"),  # float
    ({"ngram_lookup": [1, 2, 3]}, "ngram_lookup"),  # not a tensor
    # empty: prepare_decode / prepare_prompt read it as no table, prepare_prompt_cp and the
    # in-place staging as a table every id falls outside -- one rule: refused here
    ({"ngram_lookup": torch.zeros(0, dtype=torch.int64)}, "ngram_lookup"),
    ({"image_token_id": "5"}, "image_token_id"),
    ({"force_load_balance": 1}, "force_load_balance"),
    ({"yoco_keep_tokens": 0}, "yoco_keep_tokens"),
    ({"yoco_keep_tokens": -3}, "yoco_keep_tokens"),
    ({"yoco_keep_tokens": 2.5}, "yoco_keep_tokens"),
    ({"yoco_keep_tokens": True}, "yoco_keep_tokens"),
    # (2**63 was accepted, then an OverflowError at a build)
    ({"yoco_keep_tokens": 2**63}, "yoco_keep_tokens: expected an int in [1, 2**31 - 1]"),
    ({"yoco_mode": "drop"}, "yoco_mode"),
    ({"yoco_mode": None}, "yoco_mode"),
]


@pytest.mark.parametrize("overrides,field", BAD_VALUES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_VALUES)])
def test_bad_value_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        MetadataConfig.compressed_swa(**overrides)


# Wrong types: ValueError or TypeError, still naming the field.
BAD_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 12.0}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"window_size": "128"}, "window_size"),
    ({"dense_compress_ratios": "4"}, "dense_compress_ratios"),
    ({"sparse_compress_ratios": 4}, "sparse_compress_ratios"),
    ({"dense_compress_ratios": (4.0,)}, "dense_compress_ratios"),
    ({"ngram_pad_token": 1.5}, "ngram_pad_token"),
    ({"kv_cp_world_size": 2.0}, "kv_cp_world_size"),
    ({"kv_cp_interleave": True}, "kv_cp_interleave"),
]


@pytest.mark.parametrize("overrides,field", BAD_TYPES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_TYPES)])
def test_bad_type_names_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(field)):
        MetadataConfig.compressed_swa(**overrides)


@settings(max_examples=50, deadline=None)
@given(cfg=configs())
def test_random_configs_hold_their_invariants(cfg: MetadataConfig) -> None:
    assert cfg.ca_ratios == tuple(sorted(set(cfg.ca_ratios)))
    assert cfg.min_ratio == (cfg.ca_ratios[0] if cfg.ca_ratios else 1)
    assert cfg.has_compressed_kv == bool(cfg.ca_ratios)
    assert all(cfg.block_size % n == 0 for n in cfg.ca_ratios)
    assert cfg.swa_block_size >= cfg.window_size
    m = cfg.min_ratio
    # rank 0's share of max_model_len keys (all of them unless the KV is sharded: plain configs)
    share = sum(1 for p in range(cfg.max_model_len) if (p // cfg.kv_cp_interleave) % cfg.kv_cp_world_size == 0)
    assert cfg.kv_sharded == (cfg.kv_cp_world_size > 1) and (not cfg.kv_sharded or not cfg.ca_ratios)
    assert cfg.max_num_blocks == -(-(share // m) // (cfg.block_size // m))
    for n in cfg.ca_ratios:
        w = cfg.attn_index_width(n)
        assert w % 128 == 0 and w >= cfg.max_model_len // n > w - 128
