"""``SequenceBatch`` (docs/design.md section 13): same metadata and same errors as the list of ``SequenceMetadata``.

Batches are built two ways: ``SequenceBatch.from_sequences`` and a plain per-sequence Python
construction of the documented layout (``_by_hand``), which does not share code with the builders;
both must give metadata bit-identical to the list path (itself checked against the per-token
reference in ``test_builders.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from builder_cases import NAMED_CASES, NamedCase
from cpmeta import MetadataConfig, SequenceBatch, SequenceMetadata, prepare_decode, prepare_prompt
from cpmeta.diff import metadata_diff
from strategies import decode_cases, prompt_cases
from test_validation import BAD, CASES, CFG, _batch

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _by_hand(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> SequenceBatch:
    """The class docstring's layout, one sequence at a time."""
    lb = max(cfg.max_ngram_size - 1, 0)
    cols: dict[str, list[Any]] = {k: [] for k in ("q", "k", "st", "v", "ph", "nt", "bt", "bo", "tk", "to", "c", "co")}
    cols["bo"], cols["to"], cols["co"] = [0], [0], [0]
    for s in seqs:
        lo = max(0, s.seqlen_k - s.seqlen_q - lb)
        win = list(s.token_ids[lo:s.seqlen_k]) if is_prompt else list(s.token_ids[lo:]) + list(s.draft_tokens)
        comp = list(s.compressed_token_ids[lo:min(len(s.compressed_token_ids), s.seqlen_k)]) if lb or cfg.max_ngram_size else []
        for key, v in (("q", s.seqlen_q), ("k", s.seqlen_k), ("st", s.state_id), ("v", s.swa_valid_start),
                       ("ph", s.is_placeholder), ("nt", len(s.token_ids))):
            cols[key].append(v)
        cols["bt"] += list(s.block_table)
        cols["bo"].append(len(cols["bt"]))
        cols["tk"] += win
        cols["to"].append(len(cols["tk"]))
        cols["c"] += comp
        cols["co"].append(len(cols["c"]))
    i64 = lambda key: np.array(cols[key], np.int64)  # noqa: E731
    return SequenceBatch(
        is_prompt=is_prompt, seqlen_q=i64("q"), seqlen_k=i64("k"), state_id=i64("st"),
        swa_valid_start=i64("v"), is_placeholder=np.array(cols["ph"], bool), num_tokens=i64("nt"),
        block_tables=i64("bt"), block_table_offsets=i64("bo"), tokens=i64("tk"), token_offsets=i64("to"),
        compressed=i64("c"), compressed_offsets=i64("co"), lookback=lb,
    )


def _build(batch: Any, cfg: MetadataConfig, is_prompt: bool) -> Any:
    return prepare_prompt(batch, cfg) if is_prompt else prepare_decode(batch, cfg)


def _same(seqs: list[SequenceMetadata], cfg: MetadataConfig, is_prompt: bool) -> None:
    want = _build(seqs, cfg, is_prompt)
    hand = _by_hand(seqs, cfg, is_prompt)
    conv = SequenceBatch.from_sequences(seqs, cfg, is_prompt=is_prompt)
    assert len(conv) == len(seqs)
    for name in ("seqlen_q", "seqlen_k", "num_tokens", "block_tables", "tokens", "token_offsets",
                 "compressed", "compressed_offsets", "is_placeholder"):
        assert np.array_equal(getattr(hand, name), getattr(conv, name)), name
    for batch in (hand, conv):
        assert metadata_diff(_build(batch, cfg, is_prompt), want, cfg=cfg) == []


@pytest.mark.parametrize("case", NAMED_CASES, ids=[c.name for c in NAMED_CASES])
def test_named_cases_batch_equals_list(case: NamedCase) -> None:
    _same(case.seqs, case.cfg, case.is_prompt)


@SETTINGS
@given(case=prompt_cases())
def test_random_prompt_batch_equals_list(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    _same(case[1], case[0], True)


@SETTINGS
@given(case=decode_cases())
def test_random_decode_batch_equals_list(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    _same(case[1], case[0], False)


@SETTINGS
@given(case=prompt_cases({"max_ngram_size": 3}))
def test_random_engram_prompt(case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    _same(case[1], case[0], True)


@pytest.mark.parametrize("mode", ["compact", "mask"])
@SETTINGS
@given(case=prompt_cases())
def test_random_yoco_prompt(mode: str, case: tuple[MetadataConfig, list[SequenceMetadata]]) -> None:
    # YoCo limits the sliding window, so it needs one (MetadataConfig refuses window_size 0)
    cfg = dataclasses.replace(case[0], yoco_keep_tokens=5, yoco_mode=mode, window_size=case[0].window_size or 1)
    _same(case[1], cfg, True)  # the YoCo fields too: one build reads the batch's num_tokens either way


# Draft counts are implied by seqlen_q in a SequenceBatch, so the draft cases cannot be written.
_EXPRESSIBLE = [c for c in CASES if c[2] != "draft_tokens"]


@pytest.mark.parametrize("name,bad,field,paths", _EXPRESSIBLE, ids=[c[0] for c in _EXPRESSIBLE])
def test_bad_batch_same_message(name: str, bad: dict[str, Any], field: str, paths: tuple[bool, ...]) -> None:
    for is_prompt in paths:
        seqs = _batch(is_prompt, **bad)
        with pytest.raises(ValueError) as want:
            _build(seqs, CFG, is_prompt)
        assert f"seqs[{BAD}].{field}" in str(want.value)
        with pytest.raises(ValueError) as conv:
            SequenceBatch.from_sequences(seqs, CFG, is_prompt=is_prompt)
        assert str(conv.value) == str(want.value)
        if not all(type(v) is int and -2**63 <= v < 2**63 or (type(v) is list and all(type(x) is int for x in v))
                   for v in bad.values()):
            continue  # a non-int value or one beyond int64: int64 arrays cannot hold the corruption
        hand = _by_hand(seqs, CFG, is_prompt)
        with pytest.raises(ValueError) as got:
            _build(hand, CFG, is_prompt)
        assert str(got.value) == str(want.value), name


def test_batch_misuse_is_named() -> None:
    seqs = _batch(True)
    b = _by_hand(seqs, CFG, True)
    with pytest.raises(ValueError, match="expected a decode SequenceBatch"):
        prepare_decode(b, CFG)
    with pytest.raises(ValueError, match="batch.lookback"):
        prepare_prompt(b, dataclasses.replace(CFG, max_ngram_size=2))
    short = dataclasses.replace(b, tokens=b.tokens[:-1], token_offsets=b.token_offsets.copy())
    short.token_offsets[-1] -= 1
    with pytest.raises(ValueError, match=r"seqs\[4\].token_ids: expected a window"):
        prepare_prompt(short, CFG)
    with pytest.raises(ValueError, match="batch.seqlen_k"):
        prepare_prompt(dataclasses.replace(b, seqlen_k=b.seqlen_k[:-1]), CFG)
    with pytest.raises(ValueError, match="empty batch"):
        prepare_prompt(_by_hand([], CFG, True), CFG)


def test_docstring_example() -> None:
    cfg = MetadataConfig.compressed_swa(block_size=128, max_ngram_size=3)
    p = SequenceMetadata(3, 5, [7], 0, [11, 12, 13, 14, 15, 16], compressed_token_ids=[90, 91])
    d = SequenceMetadata(2, 9, [4, 6], 1, list(range(20, 28)), draft_tokens=[50])
    bp = SequenceBatch.from_sequences([p], cfg, is_prompt=True)
    bd = SequenceBatch.from_sequences([d], cfg, is_prompt=False)
    assert bp.tokens.tolist() == [11, 12, 13, 14, 15] and bp.compressed.tolist() == [90, 91]
    assert bd.tokens.tolist() == [25, 26, 27, 50] and bd.compressed.tolist() == []
    assert bd.block_tables.tolist() == [4, 6] and bp.num_tokens.tolist() == [6]


def test_validated_marker_is_not_a_constructor_argument() -> None:
    """A user-built batch cannot claim it was validated (issue 18: the builders skip validate
    only for batches from_sequences / validate() / the state room's vouched constructors marked
    for that config)."""
    import dataclasses

    assert not next(f for f in dataclasses.fields(SequenceBatch) if f.name == "_vouch").init
    with pytest.raises(TypeError):
        SequenceBatch(_vouch=object(), **dataclasses.asdict(_by_hand(_batch(True), CFG, True)))  # type: ignore[call-arg]
    b = _by_hand(_batch(True), CFG, True)
    assert b.vouch_for(CFG) is None
    b.validate(CFG)
    assert b.vouch_for(CFG) is not None and b.vouch_for(MetadataConfig.compressed_swa()) is None
