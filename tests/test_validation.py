"""``validate_batch``: every bad scheduler input of docs/design.md section 3 names ``seqs[i].field``."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cpmeta
from cpmeta import MetadataConfig, SequenceBatch, SequenceMetadata
from cpmeta.config import blocks_needed_array
from cpmeta.sequence import blocks_needed, validate_batch
from strategies import decode_cases, prompt_cases, random_config, random_decode_batch, random_prompt_batch

# bs 16, ratios (4,)/(8,): blocks_needed(k) = max(cdiv(k//4, 4), cdiv(k//8, 2)).
CFG = MetadataConfig(block_size=16, window_size=4, swa_block_size=4, dense_compress_ratios=(4,),
                     sparse_compress_ratios=(8,), max_model_len=64)
BAD = 3  # index of the corrupted sequence in a 5-sequence batch


def _prompt(i: int) -> SequenceMetadata:
    return SequenceMetadata(seqlen_q=4, seqlen_k=20, block_table=[10 * i, 10 * i + 1], state_id=i,
                            token_ids=list(range(20)))


def _decode(i: int) -> SequenceMetadata:
    # q=3, k=20: 18 confirmed tokens, 2 drafts.
    return SequenceMetadata(seqlen_q=3, seqlen_k=20, block_table=[10 * i, 10 * i + 1], state_id=i,
                            token_ids=list(range(18)), draft_tokens=[7, 8])


def _batch(is_prompt: bool, **bad: Any) -> list[SequenceMetadata]:
    make = _prompt if is_prompt else _decode
    seqs = [make(i) for i in range(5)]
    seqs[BAD] = dataclasses.replace(seqs[BAD], **bad)
    return seqs


def test_good_batches_pass() -> None:
    validate_batch(_batch(True), CFG, is_prompt=True)
    validate_batch(_batch(False), CFG, is_prompt=False)


# (corruption of seqs[3], field named in the message, paths it applies to)
CASES: list[tuple[str, dict[str, Any], str, tuple[bool, ...]]] = [
    ("seqlen_q_zero", {"seqlen_q": 0}, "seqlen_q", (True, False)),
    ("seqlen_q_negative", {"seqlen_q": -2}, "seqlen_q", (True, False)),
    ("seqlen_q_gt_seqlen_k", {"seqlen_q": 21}, "seqlen_q", (True, False)),
    ("seqlen_k_gt_max_model_len", {"seqlen_k": 65, "token_ids": list(range(65))}, "seqlen_k", (True,)),
    ("seqlen_k_gt_max_model_len_decode", {"seqlen_k": 65, "token_ids": list(range(63))}, "seqlen_k", (False,)),
    ("state_id_negative", {"state_id": -1}, "state_id", (True, False)),
    ("swa_valid_start_negative", {"swa_valid_start": -1}, "swa_valid_start", (True, False)),
    ("too_few_tokens", {"token_ids": list(range(17))}, "token_ids", (True, False)),
    ("too_many_tokens_decode", {"token_ids": list(range(19))}, "token_ids", (False,)),
    ("drafts_on_prompt", {"draft_tokens": [1]}, "draft_tokens", (True,)),
    ("too_few_drafts", {"draft_tokens": [7]}, "draft_tokens", (False,)),
    ("too_many_drafts", {"draft_tokens": [7, 8, 9]}, "draft_tokens", (False,)),
    ("block_table_too_short", {"block_table": [5]}, "block_table", (True, False)),
    ("block_table_empty", {"block_table": []}, "block_table", (True, False)),
    ("seqlen_q_not_int", {"seqlen_q": 4.0}, "seqlen_q", (True, False)),
    ("state_id_bool", {"state_id": True}, "state_id", (True, False)),
    # issue 33 item 6: a negative seqlen_k is a seqlen_k error (it was reported as seqlen_q)
    ("seqlen_k_negative", {"seqlen_k": -3}, "seqlen_k", (True, False)),
    # S = 4: state_id * 4 + 3 reaches 2**31 at 2**29 (slot_mapping_store_swa would overflow int32)
    ("state_id_ring_overflow", {"state_id": 2**29}, "state_id", (True, False)),
    ("state_id_beyond_int64", {"state_id": 2**63}, "state_id", (True, False)),
    ("state_id_shared", {"state_id": 0}, "state_id", (True, False)),  # seqs[0]'s, under the state cache
    ("seqlen_q_float_numpy", {"seqlen_q": np.float64(4)}, "seqlen_q", (True, False)),
]
_PARAMS = [(name, bad, field, p) for name, bad, field, paths in CASES for p in paths]


@pytest.mark.parametrize("name,bad,field,is_prompt", _PARAMS,
                         ids=[f"{n}-{'prompt' if p else 'decode'}" for n, _, _, p in _PARAMS])
def test_bad_input_names_sequence_and_field(name: str, bad: dict[str, Any], field: str, is_prompt: bool) -> None:
    with pytest.raises(ValueError, match=re.escape(f"seqs[{BAD}].{field}")):
        validate_batch(_batch(is_prompt, **bad), CFG, is_prompt=is_prompt)


def test_numpy_integers_pass() -> None:
    for is_prompt in (True, False):
        seqs = [dataclasses.replace(s, seqlen_q=np.int64(s.seqlen_q), seqlen_k=np.int32(s.seqlen_k),
                                    state_id=np.uint8(s.state_id), swa_valid_start=np.int16(0))
                for s in _batch(is_prompt)]
        validate_batch(seqs, CFG, is_prompt=is_prompt)


def test_too_many_tokens_is_fine_for_a_prompt() -> None:
    validate_batch(_batch(True, token_ids=list(range(40))), CFG, is_prompt=True)  # the whole prompt


def test_empty_batch() -> None:
    for is_prompt in (True, False):
        with pytest.raises(ValueError, match=r"seqs.*empty"):
            validate_batch([], CFG, is_prompt=is_prompt)


def test_not_a_list_of_sequences() -> None:
    with pytest.raises(TypeError, match=r"seqs"):
        validate_batch(_prompt(0), CFG, is_prompt=True)  # type: ignore[arg-type]
    seqs: list[Any] = _batch(True)
    seqs[BAD] = {"seqlen_q": 1}
    with pytest.raises(TypeError, match=re.escape(f"seqs[{BAD}]")):
        validate_batch(seqs, CFG, is_prompt=True)


def test_blocks_needed_is_the_max_over_ratios() -> None:
    # docstring example: bs 128, ratios (4, 128), seqlen_k 300 -> max(cdiv(75, 32), cdiv(2, 1)) = 3.
    cfg = MetadataConfig.compressed_swa(dense_compress_ratios=(4, 128), sparse_compress_ratios=())
    assert blocks_needed(300, cfg) == 3
    # bs 16, ratios (4, 16): seqlen_k 3 -> 0 (nothing compressed yet); 17 -> cdiv(4, 4) = 1 vs
    # cdiv(1, 1) = 1; 20 -> cdiv(5, 4) = 2 vs 1.
    cfg16 = MetadataConfig(block_size=16, window_size=4, swa_block_size=4, dense_compress_ratios=(4, 16),
                           sparse_compress_ratios=())
    assert [blocks_needed(k, cfg16) for k in (3, 4, 16, 17, 20, 31, 32)] == [0, 1, 1, 1, 2, 2, 2]
    assert blocks_needed(20, CFG) == 2  # CFG: cdiv(5, 4) = 2, cdiv(2, 2) = 1
    # the closed form the library uses, against the per-ratio definition, on every divisor set
    # (up to 3 ratios) of a few block sizes, scalar and vectorized
    for bs in (1, 4, 12, 16, 128):
        divs = [d for d in range(1, bs + 1) if bs % d == 0]
        for k in (1, 2, 3):
            for ratios in itertools.combinations(divs, k):
                cfg = MetadataConfig(block_size=bs, window_size=1, swa_block_size=1, dense_compress_ratios=ratios,
                                     sparse_compress_ratios=(), max_model_len=4 * bs)
                sk = np.arange(5 * bs)
                want = [max(-(-(x // n) // (bs // n)) for n in ratios) for x in sk.tolist()]
                assert [blocks_needed(x, cfg) for x in sk.tolist()] == want, (bs, ratios)
                assert blocks_needed_array(sk, cfg).tolist() == want, (bs, ratios)


def _brute_blocks(k: int, bs: int, ratios: tuple[int, ...], world: int, inter: int) -> int:
    """docs/design.md section 14 by counting: rank 0's keys among positions 0..k-1, then the per-ratio rule
    (ratio 1 for a plain model)."""
    local = sum(1 for p in range(k) if (p // inter) % world == 0)
    return max(-(-(local // n) // (bs // n)) for n in (ratios or (1,)))


def test_blocks_needed_plain_and_sharded() -> None:
    from cpmeta.config import seqlen_k_covered

    plain = dict(dense_compress_ratios=(), sparse_compress_ratios=(), window_size=0)
    # docstring examples: 17 tokens, block 16, plain -> 2; W=3, I=1, block 16, 300 tokens -> 7
    assert cpmeta.blocks_needed(17, MetadataConfig(block_size=16, **plain)) == 2
    cp3 = MetadataConfig(block_size=16, max_model_len=300, kv_cp_world_size=3, **plain)
    assert cpmeta.blocks_needed(300, cp3) == 7
    assert cpmeta.blocks_needed(40, MetadataConfig(block_size=16, kv_cp_world_size=2, kv_cp_interleave=16,
                                                   **plain)) == 2
    for bs in (1, 4, 6, 16):
        for world in (1, 2, 3):
            for inter in sorted({1, bs} | ({2} if bs % 2 == 0 else set())):
                cfg = MetadataConfig(block_size=bs, max_model_len=8 * bs * world, kv_cp_world_size=world,
                                     kv_cp_interleave=inter, **plain)
                sk = np.arange(7 * bs * world + 3)
                want = [_brute_blocks(x, bs, (), world, inter) for x in sk.tolist()]
                assert [cpmeta.blocks_needed(x, cfg) for x in sk.tolist()] == want, (bs, world, inter)
                assert blocks_needed_array(sk, cfg).tolist() == want, (bs, world, inter)
                assert cfg.max_num_blocks == _brute_blocks(cfg.max_model_len, bs, (), world, inter)
                for nb in range(6):  # the inverse: the largest k a table of nb blocks covers
                    assert seqlen_k_covered(nb, cfg) == max(x for x in sk.tolist() if want[x] <= nb)
    seed = MetadataConfig.compressed_swa(block_size=128, dense_compress_ratios=(4,))
    assert seqlen_k_covered(2, seed) == 259 and cpmeta.blocks_needed(260, seed) == 3


def test_sharded_block_table_message_names_the_sequence() -> None:
    cfg = MetadataConfig(block_size=16, max_model_len=300, kv_cp_world_size=3, dense_compress_ratios=(),
                         sparse_compress_ratios=(), window_size=0)
    ok = SequenceMetadata(1, 300, list(range(7)), 0, list(range(300)))
    validate_batch([ok], cfg, is_prompt=True)
    short = SequenceMetadata(1, 300, list(range(6)), 0, list(range(300)))
    msg = r"seqs\[1\]\.block_table: expected at least 7 blocks for seqlen_k=300 \(rank 0's share"
    with pytest.raises(ValueError, match=msg):
        validate_batch([ok, short], cfg, is_prompt=True)
    with pytest.raises(ValueError, match=msg):
        SequenceBatch.from_sequences([ok, short], cfg, is_prompt=True)


def test_block_table_boundary() -> None:
    seq = SequenceMetadata(1, 20, [1, 2], 0, list(range(20)))  # needs exactly 2
    validate_batch([seq], CFG, is_prompt=True)
    with pytest.raises(ValueError, match=re.escape("seqs[0].block_table")):
        validate_batch([dataclasses.replace(seq, block_table=[1])], CFG, is_prompt=True)
    tiny = SequenceMetadata(1, 3, [], 0, [1, 2, 3])  # seqlen_k 3 < every ratio: no block needed
    validate_batch([tiny], CFG, is_prompt=True)


def test_seqlen_k_equal_max_model_len_is_valid() -> None:
    seq = SequenceMetadata(1, 64, list(range(8)), 0, list(range(64)))
    validate_batch([seq], CFG, is_prompt=True)


# ---- random: valid batches pass; one corrupted field is reported with its index ---------------


@settings(max_examples=40, deadline=None)
@given(case=prompt_cases())
def test_random_prompt_batches_are_valid(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    cfg, seqs = case
    validate_batch(seqs, cfg, is_prompt=True)


@settings(max_examples=40, deadline=None)
@given(case=decode_cases())
def test_random_decode_batches_are_valid(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    cfg, seqs = case
    validate_batch(seqs, cfg, is_prompt=False)


CORRUPTIONS: dict[str, tuple[str, Callable[[SequenceMetadata, MetadataConfig], dict[str, Any]]]] = {
    "q0": ("seqlen_q", lambda s, c: {"seqlen_q": 0}),
    "q>k": ("seqlen_q", lambda s, c: {"seqlen_q": s.seqlen_k + 1}),
    "k>max": ("seqlen_k", lambda s, c: {"seqlen_k": c.max_model_len + 1}),
    "state": ("state_id", lambda s, c: {"state_id": -1 - s.state_id}),
    "valid_start": ("swa_valid_start", lambda s, c: {"swa_valid_start": -1}),
    "tokens": ("token_ids", lambda s, c: {"token_ids": list(s.token_ids)[: s.seqlen_k - s.seqlen_q]}),
    "drafts": ("draft_tokens", lambda s, c: {"draft_tokens": list(s.draft_tokens) + [1]}),
    "blocks": ("block_table", lambda s, c: {"block_table": list(s.block_table)[: blocks_needed(s.seqlen_k, c) - 1]}),
}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), is_prompt=st.booleans(), kind=st.sampled_from(sorted(CORRUPTIONS)),
       data=st.data())
def test_random_corruption_names_the_sequence(seed: int, is_prompt: bool, kind: str, data: Any) -> None:
    rng = random.Random(seed)
    cfg = random_config(rng)
    seqs = (random_prompt_batch if is_prompt else random_decode_batch)(rng, cfg)
    i = data.draw(st.integers(0, len(seqs) - 1))
    field, corrupt = CORRUPTIONS[kind]
    if kind == "blocks":
        assume(blocks_needed(seqs[i].seqlen_k, cfg) > 0)
    seqs[i] = dataclasses.replace(seqs[i], **corrupt(seqs[i], cfg))
    with pytest.raises(ValueError, match=re.escape(f"seqs[{i}].{field}")):
        validate_batch(seqs, cfg, is_prompt=is_prompt)


@pytest.mark.parametrize("field", ["compressed_token_ids", "token_ids", "block_table"])
def test_non_int_ids_name_their_field(field: str) -> None:
    """A None among the ids is a ValueError naming seqs[i].<field> (the Engram history once said
    only 'seqs[0] ids')."""
    cfg = MetadataConfig.compressed_swa(max_ngram_size=3)
    kw = dict(seqlen_q=4, seqlen_k=4, block_table=[1], state_id=0, token_ids=[1, 2, 3, 4])
    kw[field] = [None, None] if field != "token_ids" else [1, 2, None, 4]
    good = SequenceMetadata(seqlen_q=1, seqlen_k=1, block_table=[0], state_id=1, token_ids=[5])
    with pytest.raises(ValueError, match=rf"seqs\[1\]\.{field}"):
        cpmeta.prepare_prompt([good, SequenceMetadata(**kw)], cfg)
